"""The benchmark binary: records, ratios and its error handling."""

import json
import os

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from binaries import benchmark
from binaries import benchmark_families
from binaries import benchmark_report
from tests import conftest
from tests import process_utils
from tff_personal.core import client_state
from tff_personal.core import process as process_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope='module')
def binary():
  """`python -m binaries.benchmark`, each run a process of its own forked
  from one that imported the binary once (its runs are subprocesses)."""
  with process_utils.ForkServer('binaries.benchmark', REPO) as server:
    yield server


def test_small_run_writes_consistent_records(binary, tmp_path):
  out = tmp_path / 'bench'
  has_mnist = os.path.isdir(os.path.join(conftest.SHARED_DATA, 'mnist'))
  result = binary.run(
      [f'--output_dir={out}',
       '--systems=global,tf_ceiling_batched',
       '--cohorts=4', '--rounds=2', f'--data_dir={conftest.SHARED_DATA}']
      + (['--families=ditto', '--family_rounds=2'] if has_mnist else []),
      timeout=900)
  assert result.returncode == 0, result.stderr[-3000:]
  records = json.loads((out / 'benchmark.json').read_text())
  families = [r for r in records if r.get('form')]
  records = [r for r in records if not r.get('form')]
  # One project system and one ceiling: each kind of child the parent
  # spawns (the batched family form below runs the batched code path).
  assert [(r['name'], r['cohort']) for r in records] == [
      ('global', 4), ('tf_ceiling_batched', 4)]
  # The family row: binaries.train on the family's task in each form.
  assert [(r['name'], r['workload'], r['form']) for r in families] == [
      ('ditto', 'label_skew_mnist', 'sharded'),
      ('ditto', 'label_skew_mnist', 'per_client'),
      ('ditto', 'label_skew_mnist', 'batched')][:3 * has_mnist]
  if has_mnist:
    assert families[0]['simulation_shards'] >= 1
    assert families[1]['simulation_shards'] == 0
    assert families[2]['simulation_shards'] >= 1
  for r in families:
    assert r['rounds'] == 2 and r['cohort'] == 10
    assert r['client_updates_per_s'] == pytest.approx(
        10 / r['seconds_per_round'])
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
  assert '| global | 4 |' in table and '| tf_ceiling_batched | 4 |' in table
  assert ('| ditto | label_skew_mnist |' in table) == has_mnist


def test_no_two_family_forms_share_a_root():
  """A staged family's forms must each train the timed stage: runs in one
  root reuse a finished stage (`shared_stages/`), which would time one
  form's stage for all of them."""
  roots = []
  for family in benchmark_families.FAMILIES.values():
    for form in family.forms():
      cmd = benchmark_families.train_command(family, form, 2, '/d', '/out')
      (root,) = [a for a in cmd if a.startswith('--root_output_dir=')]
      roots.append(root)
  assert len(roots) == len(set(roots))


@pytest.mark.parametrize('system', ['global', 'fedembed_prototype'])
def test_ceiling_round_is_the_processs_round(system):
  """A system's ceiling computes what its federated process computes: one
  round from the same weights and client states on the same cohort, split
  in two parts, gives the same new server weights and client states (for
  FedEmbed: its personal embeddings, and the sub-population, head and draw
  counter its prepare step and loss set)."""
  rng = np.random.default_rng(1)
  n = benchmark.EXAMPLES_PER_CLIENT
  data = dict(x=rng.random((5, n, 28, 28, 1), dtype=np.float32),
              y=rng.integers(0, 2, (5, n)).astype(np.int32),
              type=rng.integers(0, 10, (5, n)).astype(np.int32))
  ids = [0, 1, 2, 3, 4]
  # Local SGD: Adam would turn float noise in near-zero gradients into
  # steps of the learning rate whose sign follows the summation order.
  sgd = lambda: tff.learning.optimizers.build_sgdm(0.1)
  proc = benchmark.build_project_process(system, seed=0,
                                         client_optimizer=sgd())
  state = proc.initialize()
  start = [np.asarray(w) for w in proc.get_model_weights(state).trainable]
  template = tff.types.type_to_tf_tensor_specs(proc.client_state_type)
  states = [client_state.seeded_initial_state_fn(template, 0, 'normal',
                                                 0.1)(i) for i in ids]
  state, new_states, _ = proc.next(
      state, states, benchmark._datasets(data, ids, ('x', 'y', 'type')))
  federated = [np.asarray(w) for w in proc.get_model_weights(state).trainable]

  # Two parts (clients 0-1 and 2-4) on two builds of the model.
  round_fn = benchmark.build_ceiling_round(
      [proc.model_fn() for _ in range(2)], sgd())
  # The client state's private part (its participation count is no
  # arithmetic of the round).
  private_of = lambda s: s[process_lib.CLIENT_STATE_PRIVATE]
  private = tuple(np.stack(column) for column in zip(
      *[private_of(s) for s in states]))
  ceiling, ceiling_private = round_fn(
      tuple(tf.constant(w) for w in start), private,
      benchmark._cohort_batches(data, ids))
  assert len(ceiling) == len(federated)
  moved = max(float(np.max(np.abs(f - s))) for f, s in zip(federated, start))
  assert moved > 1e-4  # The round changed the weights.
  for c, f in zip(ceiling, federated):
    np.testing.assert_allclose(np.asarray(c), f, rtol=1e-4, atol=1e-6)
  expected = [np.stack(column) for column in zip(
      *[private_of(s) for s in new_states])]
  # FedEmbed: the embedding, sub-population, head, draws and salt.
  assert len(ceiling_private) == len(expected) == len(private) == (
      0 if system == 'global' else 5)
  for c, e, before in zip(ceiling_private, expected, private):
    if e.dtype.kind == 'f':
      assert np.max(np.abs(e - before)) > 1e-4  # Trained locally.
      np.testing.assert_allclose(np.asarray(c), e, rtol=1e-4, atol=1e-6)
    else:
      np.testing.assert_array_equal(np.asarray(c), e)
  if system == 'fedembed_prototype':
    # The draw counter counted every local step of every client, and each
    # new client fixed its salt (odd: set).
    steps = n // benchmark.BATCH_SIZE
    np.testing.assert_array_equal(ceiling_private[-2] - private[-2], steps)
    assert not private[-1].any() and (np.asarray(ceiling_private[-1]) % 2
                                      == 1).all()


def test_render_markdown_ratios():
  records = [
      dict(name='tff_fedavg', cohort=50, client_updates_per_s=10.0,
           examples_per_s=200.0, seconds_per_round=5.0, startup_s=9.0,
           peak_rss_mib=1000.0),
      dict(name='global', cohort=50, client_updates_per_s=60.0,
           examples_per_s=1200.0, seconds_per_round=0.83, startup_s=9.0,
           peak_rss_mib=1000.0,
           worker_threads={'intra_op': 1, 'inter_op': 2}),
      dict(name='tf_ceiling', cohort=50, client_updates_per_s=120.0,
           examples_per_s=2400.0, seconds_per_round=0.4, startup_s=5.0,
           peak_rss_mib=600.0),
      dict(name='fedembed_prototype', cohort=50, client_updates_per_s=40.0,
           examples_per_s=800.0, seconds_per_round=1.25, startup_s=9.0,
           peak_rss_mib=1000.0,
           worker_threads={'intra_op': 1, 'inter_op': 2}),
      dict(name='tf_ceiling_fedembed_prototype', cohort=50,
           client_updates_per_s=80.0, examples_per_s=1600.0,
           seconds_per_round=0.63, startup_s=5.0, peak_rss_mib=600.0,
           worker_threads={'intra_op': 1, 'inter_op': 2}),
      dict(name='ditto', workload='label_skew_mnist', form='sharded',
           cohort=10, stage='', client_updates_per_s=30.0,
           examples_per_s=600.0, seconds_per_round=0.33),
      dict(name='ditto', workload='label_skew_mnist', form='per_client',
           cohort=10, stage='', client_updates_per_s=6.0,
           examples_per_s=120.0, seconds_per_round=1.67),
  ] + [dict(name='fedperc', workload='tv_shows', form=form, cohort=10,
            stage='', client_updates_per_s=rate, seconds_per_round=10 / rate)
       for form, rate in (('sharded', 20.0), ('per_client', 10.0),
                          ('batched', 50.0))]
  table = benchmark.render_markdown(records, 'test machine', 'cmd')
  global_row = [line for line in table.splitlines()
                if line.startswith('| global |')][0]
  # Against tff_fedavg, tf_ceiling, its model's ceiling (FedAvg's), pfl.
  assert global_row.endswith('| 6.00x | 0.50x | 0.50x | - | 1/2 |')
  row = lambda name: next(line for line in table.splitlines()
                          if line.startswith(f'| {name} |'))
  # FedEmbed's model has its own ceiling; a ceiling runs no worker.
  assert row('fedembed_prototype').endswith(
      '| 4.00x | 0.33x | 0.50x | - | 1/2 |')
  assert row('tf_ceiling_fedembed_prototype').endswith(
      '| 8.00x | 0.67x | 1.00x | - | - |')
  summary = benchmark_report.readme_markdown(
      dict(records=records, machine='test machine', command='cmd'))
  assert '| fedembed_prototype | 40 (0.50x) |' in summary
  assert '| global | 60 (0.50x) |' in summary
  sharded_row = [line for line in table.splitlines()
                 if line.startswith('| ditto |') and 'sharded' in line][0]
  assert sharded_row.endswith('| 5.00x |')
  # A batched family row is against the family's sharded form.
  fedperc_rows = {line.split('|')[5].strip(): line
                  for line in table.splitlines()
                  if line.startswith('| fedperc | tv_shows |')}
  assert fedperc_rows['sharded'].endswith('| 2.00x |')
  assert fedperc_rows['batched'].endswith('| 2.50x |')
  assert ('| fedperc | tv_shows | 10 | 20.0 | 10.0 | 2.00x | 50.0 | 2.50x |'
          in summary)
  assert '| ditto | label_skew_mnist | 10 | 30.0 | 6.0 | 5.00x | - | - |' in (
      summary)
  scale = [dict(name='global_plus', workload='synthetic', population=p,
                cohort=200, seconds_per_round=t, peak_rss_mib=m,
                client_updates_per_s=200 / t)
           for p, t, m in ((10_000, 0.5, 1000.0), (1_000_000, 0.55, 1050.0))]
  table = benchmark.render_markdown(records + scale, 'test machine', 'cmd')
  assert '| 1,000,000 | 200 | 0.550 | 1050 | 1.10x | 1.05x |' in table
  # Population rows are not systems rows.
  assert '| global_plus | 200 |' not in table


def test_unknown_system_is_a_usage_error(binary, tmp_path):
  result = binary.run([f'--output_dir={tmp_path}', '--systems=nope'],
                      timeout=300)
  assert result.returncode != 0
  assert 'unknown --systems' in result.stderr


def test_render_markdown_worker_rows():
  records = [
      dict(name='global', cohort=50, client_updates_per_s=60.0,
           examples_per_s=1200.0, seconds_per_round=0.83, startup_s=9.0,
           peak_rss_mib=1000.0),
      dict(name='two_core_calibration', pair=0, speedup=1.9,
           one_core_s=3.0, two_cores_s=3.16, pinned_cores=[0, 1]),
      dict(name='global_plus', cohort=200, local_epochs=4, workers=1,
           pair=0, pinned_cores=[0], seconds_per_round=2.0,
           client_updates_per_s=100.0, examples_per_s=8000.0),
      dict(name='global_plus', cohort=200, local_epochs=4, workers=2,
           pair=0, pinned_cores=[0, 1], seconds_per_round=1.25,
           client_updates_per_s=160.0, examples_per_s=12800.0,
           speedup=1.6, max_weight_diff=0.0),
  ]
  table = benchmark.render_markdown(records, 'test machine', 'cmd')
  assert '| 1 | 1.90x | 2.000 | 1.250 | 1.60x | 0 |' in table
  assert 'global_plus, cohort 200, 4 local epochs;' in table
  assert '| median |' not in table  # One pair.
  second = [dict(r, pair=1) for r in records[1:]]
  second[0]['speedup'] = 1.5
  second[2].update(seconds_per_round=1.667, speedup=1.2, max_weight_diff=0.0)
  table = benchmark.render_markdown(records + second, 'test machine', 'cmd')
  assert '| 2 | 1.50x | 2.000 | 1.667 | 1.20x | 0 |' in table
  assert '| median | 1.70x | | | 1.40x | |' in table
  # Worker rows are not systems rows, in the full tables or the README's.
  assert '| global_plus | 200 |' not in table
  readme = benchmark_report.readme_markdown(
      dict(machine='m', command='cmd', records=records))
  assert '| 1 | 1.90x | 2.000 | 1.250 | 1.60x | 0 |' in readme
  assert 'global_plus' not in readme.split('Two workers')[0]


def test_two_pinned_workers_train_the_model_one_worker_trains(binary,
                                                             tmp_path):
  if len(os.sched_getaffinity(0)) < 2:
    pytest.skip('needs two CPUs')
  out = tmp_path / 'bench'
  result = binary.run(
      [f'--output_dir={out}', '--systems=', '--cohorts=4', '--rounds=2',
       '--simulation_shards=2', '--worker_pairs=1', '--worker_cohort=4',
       '--worker_local_epochs=2'],
      timeout=900)
  assert result.returncode == 0, result.stderr[-3000:]
  records = json.loads((out / 'benchmark.json').read_text())
  calibration, one, two = records
  cores = sorted(os.sched_getaffinity(0))[:2]
  assert calibration['name'] == 'two_core_calibration'
  assert calibration['pinned_cores'] == cores
  assert [(r['name'], r['workers'], r['pinned_cores'], r['local_epochs'])
          for r in (one, two)] == [('global_plus', 1, cores[:1], 2),
                                   ('global_plus', 2, cores, 2)]
  assert one['simulation_shards'] == two['simulation_shards'] == 2
  assert two['speedup'] == pytest.approx(
      one['seconds_per_round'] / two['seconds_per_round'])
  # The same shards on one worker or two: the same model, and a trained one.
  assert two['max_weight_diff'] <= 1e-6
  proc = benchmark.build_project_process('global_plus', seed=0)
  initial = proc.get_model_weights(proc.initialize()).trainable
  with np.load(out / 'workers' / 'weights_0_2.npz') as got:
    trained = [got[f'arr_{i}'] for i in range(len(initial))]
  assert max(np.max(np.abs(a - np.asarray(b)))
             for a, b in zip(trained, initial)) > 1e-4
  assert '| 1 |' in (out / 'benchmark.md').read_text()


def test_bad_worker_and_repeat_flags_are_usage_errors(binary, tmp_path):
  result = binary.run([f'--output_dir={tmp_path}', '--worker_pairs=1',
                       '--worker_cohort=1'], timeout=300)
  assert result.returncode != 0
  assert '--worker_cohort must be in [2, 1000]' in result.stderr
  assert not os.listdir(tmp_path)  # Nothing written.
  result = binary.run([f'--output_dir={tmp_path}', '--repeats=0'],
                      timeout=300)
  assert result.returncode != 0
  assert '--repeats must be >= 1' in result.stderr
  assert not os.listdir(tmp_path)


def test_median_of_repeats_keeps_the_median_run():
  runs = [dict(name='global', cohort=10, client_updates_per_s=u,
               examples_per_s=20 * u, seconds_per_round=10 / u, startup_s=t)
          for u, t in ((100.0, 5.0), (300.0, 6.0), (200.0, 7.0))]
  other = dict(name='tf_ceiling', cohort=10, client_updates_per_s=400.0)
  memory = dict(name='global', cohort=10, client_updates_per_s=50.0,
                memory_run=True)
  out = benchmark_report.median_of_repeats(
      [runs[0], other, runs[1], memory, runs[2]])
  assert [r['name'] for r in out] == ['global', 'tf_ceiling', 'global']
  # The whole median run is kept (its start-up too), with every rate.
  assert out[0]['client_updates_per_s'] == 200.0
  assert out[0]['startup_s'] == 7.0
  assert out[0]['repeats'] == 3
  assert out[0]['client_updates_per_s_runs'] == [100.0, 300.0, 200.0]
  assert out[1] == other and out[2] == memory  # Single runs as they were.
  # Even counts keep the lower median.
  out = benchmark_report.median_of_repeats(runs[:2])
  assert out[0]['client_updates_per_s'] == 100.0
  table = benchmark.render_markdown(
      benchmark_report.median_of_repeats(runs), 'test machine', 'cmd')
  assert 'run of median rate of 3' in table and '3.00x' in table
