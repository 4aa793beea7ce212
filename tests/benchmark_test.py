"""The benchmark binary: records, ratios and its error handling."""

import json
import os

import pytest

from binaries import benchmark
from tests import process_utils

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope='module')
def binary():
  """`python -m binaries.benchmark`, each run a process of its own forked
  from one that imported the binary once (its runs are subprocesses)."""
  with process_utils.ForkServer('binaries.benchmark', REPO) as server:
    yield server


def test_small_run_writes_consistent_records(binary, tmp_path):
  out = tmp_path / 'bench'
  result = binary.run(
      [f'--output_dir={out}', '--systems=global,keras_central',
       '--cohorts=4', '--rounds=2'], timeout=900)
  assert result.returncode == 0, result.stderr[-3000:]
  records = json.loads((out / 'benchmark.json').read_text())
  assert [(r['name'], r['cohort']) for r in records] == [
      ('global', 4), ('keras_central', 4)]
  for r in records:
    assert r['client_updates_per_s'] == pytest.approx(
        4 / r['seconds_per_round'])
    assert r['examples_per_s'] == pytest.approx(
        4 * benchmark.EXAMPLES_PER_CLIENT / r['seconds_per_round'])
    # Start-up covers at least the first round; RSS includes TF (> 200 MiB).
    assert r['startup_s'] >= r['first_round_s'] > 0
    assert r['peak_rss_mib'] > 200
  assert records[0]['simulation_shards'] >= 1  # auto: sharded
  # The project's systems run the worker with one thread per op.
  assert records[0]['worker_threads']['intra_op'] == 1
  table = (out / 'benchmark.md').read_text()
  assert '| global | 4 |' in table and 'keras_central' in table


def test_render_markdown_ratios():
  records = [
      dict(name='tff_fedavg', cohort=50, client_updates_per_s=10.0,
           examples_per_s=200.0, seconds_per_round=5.0, startup_s=9.0,
           peak_rss_mib=1000.0),
      dict(name='global', cohort=50, client_updates_per_s=60.0,
           examples_per_s=1200.0, seconds_per_round=0.83, startup_s=9.0,
           peak_rss_mib=1000.0,
           worker_threads={'intra_op': 1, 'inter_op': 2}),
      dict(name='keras_central', cohort=50, client_updates_per_s=120.0,
           examples_per_s=2400.0, seconds_per_round=0.4, startup_s=5.0,
           peak_rss_mib=600.0),
  ]
  table = benchmark.render_markdown(records, 'test machine', 'cmd')
  global_row = [line for line in table.splitlines()
                if line.startswith('| global |')][0]
  assert global_row.endswith('| 6.00x | 0.50x | - | 1/2 |')


def test_unknown_system_is_a_usage_error(binary, tmp_path):
  result = binary.run([f'--output_dir={tmp_path}', '--systems=nope'],
                      timeout=300)
  assert result.returncode != 0
  assert 'unknown --systems' in result.stderr
