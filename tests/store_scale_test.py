"""The client-state stores at scale: per-round work independent of population.

Sizes a test can afford (2,000 vs. 50,000 stored clients); the full
measurement (10k to 1M clients) is `python -m binaries.store_benchmark`.
"""

import collections
import json
import os
import subprocess
import sys
import time
import tracemalloc

import numpy as np
import pytest

from binaries import store_benchmark
from tff_personal.core import client_state as cs
from tff_personal.core import state_codec

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL, LARGE, COHORT = 2_000, 50_000, 200


def _filled(backend, population, directory, state='32'):
  """A store holding every client; the memory one without snapshots."""
  if backend == 'memory' and directory is None:
    store = cs.InMemoryClientStateStore(
        cs.seeded_initial_state_fn(store_benchmark.template(state), 0))
  else:
    store = store_benchmark._open(backend, state, str(directory), 0, 0)  # pylint: disable=protected-access
  store_benchmark._fill(store, state, population)  # pylint: disable=protected-access
  return store


def _round(store, population, r):
  ids = store_benchmark.cohort_ids(population, COHORT, r, seed=0)
  states = store_benchmark._bump(store.load(ids))  # pylint: disable=protected-access
  store.save(ids, states, r)
  store.commit(r)


def test_sqlite_cohort_work_does_not_grow_with_population(tmp_path):
  """SQLite VM instructions per round are the same at 2k and 50k clients.

  A scan over the stored clients (e.g. an unindexed query) would add at
  least one instruction per row: 50,000 more at the large population.
  """
  steps = {}
  for population in (SMALL, LARGE):
    with _filled('sqlite', population, tmp_path / str(population)) as store:
      count = [0]

      def tick(count=count):
        count[0] += 1
        return 0

      store._conn.set_progress_handler(tick, 100)  # pylint: disable=protected-access
      for r in range(2, 7):
        _round(store, population, r)
      steps[population] = count[0] * 100 / 5
      assert store.num_saved() == population
  # About 130 instructions per cohort client at either size; a pass over the
  # rows would add several per extra row (more than 48,000).
  assert steps[LARGE] - steps[SMALL] < (LARGE - SMALL) / 10, steps


@pytest.mark.parametrize('backend', ['sqlite', 'memory'])
def test_cohort_time_within_factor_of_small_population(backend, tmp_path):
  """Wall time per round (load, save, commit) at 50k vs 2k stored clients."""
  times = {}
  for population in (SMALL, LARGE):
    # The memory store's snapshot is O(stored clients) by design (it is the
    # checkpoint); its per-round load, save and commit are measured here.
    directory = tmp_path / str(population) if backend == 'sqlite' else None
    store = _filled(backend, population, directory)
    samples = []
    for r in range(2, 14):
      t0 = time.perf_counter()
      _round(store, population, r)
      samples.append(time.perf_counter() - t0)
    store.close()
    times[population] = float(np.median(samples))
  # O(population) work would be 25x; a shared, loaded machine adds noise.
  assert times[LARGE] <= 4 * times[SMALL] + 0.02, times


def test_unseen_clients_are_not_materialised():
  """Loading a cohort of never-saved ids of a huge population stores nothing."""
  store = cs.InMemoryClientStateStore(cs.seeded_initial_state_fn(
      store_benchmark.template('10000'), seed=1))
  ids = (np.arange(COHORT, dtype=np.int64) * 4_999_999_999).tolist()
  tracemalloc.start()
  states = store.load(ids)
  _, peak = tracemalloc.get_traced_memory()
  tracemalloc.stop()
  assert store.num_saved() == 0
  cohort_bytes = COHORT * store.codec.payload_bytes  # 8 MB of states.
  assert peak < 3 * cohort_bytes, peak
  again = cs.seeded_initial_state_fn(store_benchmark.template('10000'),
                                     seed=1)(ids[7])
  np.testing.assert_array_equal(states[7]['private'][0], again['private'][0])


def _child(phase, config, directory, *extra):
  out = subprocess.run(
      [sys.executable, '-m', 'binaries.store_benchmark', f'--child={phase}',
       f'--config={config}', f'--work_dir={directory}',
       f'--output_dir={directory}', '--rounds=8', *extra],
      cwd=REPO, check=True, capture_output=True, text=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def test_sqlite_memory_bounded_by_cohort_not_population(tmp_path):
  """Peak RSS of a process running rounds is the same at 2k and 50k clients.

  Each store is filled in one process and used in a fresh one (the
  benchmark's own phases); the measuring process also checks that resume
  restores the committed states exactly (it raises otherwise).
  """
  peaks = {}
  for population in (SMALL, LARGE):
    directory = tmp_path / str(population)
    config = f'sqlite:32:{population}'
    _child('fill', config, directory)
    record = _child('measure', config, directory, '--fill_s=0')
    peaks[population] = record['peak_rss_mib']
    assert record['disk_mib'] > population * 132 / 2**20 * 0.9
  # 48,000 more stored clients hold ~6 MiB of states, none of it in memory.
  assert peaks[LARGE] - peaks[SMALL] < 4, peaks


def test_lru_cache_is_bounded(tmp_path):
  store = cs.SqliteClientStateStore(
      cs.seeded_initial_state_fn(store_benchmark.template('32'), 0),
      str(tmp_path / 'db.sqlite'), cache_size=300)
  store_benchmark._fill(store, '32', SMALL)  # pylint: disable=protected-access
  for r in range(2, 8):
    _round(store, SMALL, r)
    assert len(store._cache) <= 300  # pylint: disable=protected-access
  store.close()


def _reference_rounds(store, population, rounds):
  """Runs rounds, committing each; returns the expected committed states."""
  expected = {}
  for r in rounds:
    ids = store_benchmark.cohort_ids(population, 30, r, seed=3)
    states = store_benchmark._bump(store.load(ids))  # pylint: disable=protected-access
    for cid, s in zip(ids, states):
      s['private'] = tuple(x + cid for x in s['private'])
    store.save(ids, states, r)
    store.commit(r)
    for cid, s in zip(ids, states):
      expected[cid] = s
  return expected


@pytest.mark.parametrize('backend', ['sqlite', 'memory'])
def test_resume_restores_exactly(backend, tmp_path):
  population = 5_000
  initial_fn = cs.seeded_initial_state_fn(store_benchmark.template('32'), 4)
  store = store_benchmark._open(backend, '32', str(tmp_path), 4, 0)  # pylint: disable=protected-access
  store.commit(0)
  expected = _reference_rounds(store, population, range(1, 6))
  # Round 6 is saved but never committed (the process dies): it overwrites
  # some committed clients and creates new ones.
  ids = store_benchmark.cohort_ids(population, 30, 6, seed=3)
  store.save(ids, store_benchmark._bump(store.load(ids)), 6)  # pylint: disable=protected-access
  if backend == 'sqlite':
    store.close()
  resumed = store_benchmark._open(backend, '32', str(tmp_path), 4, 0)  # pylint: disable=protected-access
  resumed.rollback(5)
  assert resumed.num_saved() == len(expected)
  check = sorted(set(expected) | set(ids))
  for cid, got in zip(check, resumed.load(check)):
    want = expected.get(cid, initial_fn(cid))
    for x, y in zip(got['private'], want['private']):
      np.testing.assert_array_equal(x, y)
    assert int(got['rounds_participated']) == int(want['rounds_participated'])
  resumed.close()


def test_snapshot_columns_round_trip_mixed_leaves():
  tmpl = collections.OrderedDict(
      a=np.zeros((3, 2), '>f4'), b=np.int64(0), c=np.zeros(4, bool),
      d=np.zeros(0, np.float32), e=(np.zeros(5, np.float16),))
  codec = cs.StateCodec(tmpl)
  rng = np.random.default_rng(0)
  rows = []
  for _ in range(7):
    leaves = [rng.normal(size=(3, 2)).astype('>f4'), np.array(rng.integers(9)),
              rng.random(4) < 0.5, np.zeros(0, np.float32),
              rng.normal(size=5).astype(np.float16)]
    rows.append(codec.payload(codec.flatten(codec.pack(leaves), 0)))
  columns = codec.leaf_columns(rows)
  assert [c.shape for c in columns] == [(7, 3, 2), (7,), (7, 4), (7, 0),
                                        (7, 5)]
  assert columns[0].dtype == np.dtype('>f4')
  np.testing.assert_array_equal(
      columns[0][2], codec.from_payload(rows[2])[codec.paths.index('/a')])
  assert codec.payloads_from_columns(columns, 7) == rows
  assert codec.payloads_from_columns(codec.leaf_columns([]), 0) == []


def test_benchmark_binary_writes_json_and_markdown(tmp_path):
  subprocess.run(
      [sys.executable, '-m', 'binaries.store_benchmark',
       f'--output_dir={tmp_path}', '--configs=sqlite:32:300,memory:32:300',
       '--cohort=50', '--rounds=3'],
      cwd=REPO, check=True, capture_output=True, text=True)
  records = json.loads((tmp_path / 'store_benchmark.json').read_text())
  assert [(r['backend'], r['population']) for r in records] == [
      ('sqlite', 300), ('memory', 300)]
  for r in records:
    assert r['load_save_ms_p50'] > 0 and r['resume_s'] > 0
    assert r['state_params'] == 32 and r['cohort'] == 50
  table = (tmp_path / 'store_benchmark.md').read_text()
  assert '| sqlite | 32 | 300 |' in table
  assert not os.listdir(tmp_path / 'work')  # Store files removed.
  bad = subprocess.run(
      [sys.executable, '-m', 'binaries.store_benchmark',
       f'--output_dir={tmp_path}', '--configs=sqlite:7:300'],
      cwd=REPO, capture_output=True, text=True)
  assert bad.returncode == 2 and 'sqlite:7:300' in bad.stderr


def test_fast_flatten_agrees_with_general_path():
  """The per-template flattener (used on every load/save) changes nothing."""
  Pair = collections.namedtuple('Pair', ['w', 'b'])
  tmpl = collections.OrderedDict(
      z=np.zeros(2, np.float32), a=Pair(np.zeros(3), np.int32(0)),
      m=[np.zeros(1), (np.zeros(2),)])
  codec = cs.StateCodec(tmpl)
  good = {'a': Pair(np.arange(3.0), np.int64(4)), 'z': np.ones(2),
          'm': (np.ones(1), [np.full(2, 7.0)])}  # list <-> tuple accepted.
  general = [np.asarray(x) for _, x in state_codec._flatten_with_paths(good)]  # pylint: disable=protected-access
  for got, want in zip(codec.flatten(good, 0), general):
    np.testing.assert_array_equal(got, want)
  bad_states = (
      dict(good, extra=np.zeros(1)),                     # extra key
      {k: v for k, v in good.items() if k != 'z'},       # missing key
      dict(good, a=(np.arange(3.0), np.int64(4))),       # tuple, not Pair
      dict(good, z=[1.0, 2.0]),                          # list at a leaf
      dict(good, m=[np.ones(1)]),                        # shorter list
  )
  for bad in bad_states:
    with pytest.raises(cs.StructureMismatchError, match='client 9'):
      codec.flatten(bad, 9)


def test_benchmark_samples_cohorts_like_the_training_loop():
  from tff_personal.core import training_loop  # pylint: disable=g-import-not-at-top
  for population, r in ((1_000_000, 3), (10_000, 7), (300, 1)):
    np.testing.assert_array_equal(
        store_benchmark.cohort_ids(population, 200, r, seed=2),
        training_loop.sample_clients(population, 200, r, seed=2))
