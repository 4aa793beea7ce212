"""Tests for tff_personal.core.client_state."""

import collections
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

from tff_personal.core import client_state as cs

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), '..'))
DIM = 28
SEED = 1234


def make_template():
  return collections.OrderedDict(
      weights=[np.zeros(DIM, np.float32)], participations=np.int64(0))


def state_for(client_id, round_num):
  """A state whose values encode (client, round)."""
  return collections.OrderedDict(
      weights=[np.full(DIM, client_id * 100 + round_num, np.float32)],
      participations=np.int64(round_num))


def assert_state_equal(actual, expected):
  assert isinstance(actual, collections.OrderedDict)
  assert list(actual) == list(expected)
  assert actual['weights'][0].dtype == np.float32
  assert actual['weights'][0].shape == (DIM,)
  np.testing.assert_array_equal(actual['weights'][0], expected['weights'][0])
  assert isinstance(actual['participations'], np.int64)
  assert actual['participations'] == expected['participations']


def init_fn():
  return cs.seeded_initial_state_fn(make_template(), SEED)


BACKENDS = ('memory', 'sqlite', 'sqlite_cached')


def open_store(backend, directory, fn=None, **kwargs):
  fn = fn or init_fn()
  if backend == 'memory':
    return cs.InMemoryClientStateStore(fn, str(directory), **kwargs)
  cache = 4 if backend == 'sqlite_cached' else 0
  return cs.SqliteClientStateStore(
      fn, os.path.join(str(directory), 'states.sqlite'), cache_size=cache,
      **kwargs)


@pytest.mark.parametrize('backend', BACKENDS)
def test_unseen_clients_get_deterministic_initial_state(backend, tmp_path):
  with open_store(backend, tmp_path / 'a') as a, open_store(
      backend, tmp_path / 'b') as b:
    sa = a.load([3, 4])
    sb = b.load([3])
    assert_state_equal(sa[0], init_fn()(3))
    assert_state_equal(sb[0], sa[0])
    assert np.std(sa[0]['weights'][0]) > 0.001  # 'normal' init, not zeros.
    assert not np.array_equal(sa[0]['weights'][0], sa[1]['weights'][0])
    assert sa[0]['participations'] == 0
    assert a.num_saved() == 0  # Loading does not write initial states.


def test_seeded_initial_state_fn_options():
  fn = init_fn()
  s1, s2 = fn(7), fn(7)
  np.testing.assert_array_equal(s1['weights'][0], s2['weights'][0])
  other_seed = cs.seeded_initial_state_fn(make_template(), SEED + 1)(7)
  assert not np.array_equal(s1['weights'][0], other_seed['weights'][0])
  zeros = cs.seeded_initial_state_fn(make_template(), SEED, init='zeros')(7)
  np.testing.assert_array_equal(zeros['weights'][0], np.zeros(DIM))
  wide = cs.seeded_initial_state_fn(make_template(), SEED, stddev=1.0)(7)
  np.testing.assert_allclose(wide['weights'][0], 100 * s1['weights'][0],
                             rtol=1e-5)
  with pytest.raises(ValueError, match='uniform'):
    cs.seeded_initial_state_fn(make_template(), SEED, init='uniform')


def test_tensor_spec_template_matches_numpy_template():
  spec_template = collections.OrderedDict(
      weights=[tf.TensorSpec([DIM], tf.float32)],
      participations=tf.TensorSpec([], tf.int64))
  assert (cs.StateCodec(spec_template).signature() ==
          cs.StateCodec(make_template()).signature())
  fn = cs.seeded_initial_state_fn(spec_template, SEED)
  assert_state_equal(fn(5), init_fn()(5))
  with pytest.raises(cs.StructureMismatchError, match='partially known'):
    cs.StateCodec([tf.TensorSpec([None, 3], tf.float32)])


@pytest.mark.parametrize('backend', BACKENDS)
def test_save_load_round_trip_and_order(backend, tmp_path):
  with open_store(backend, tmp_path) as store:
    ids = list(range(20))
    states = [state_for(i, 1) for i in ids]
    store.save(ids, states, round_num=1)
    states[5]['weights'][0][:] = -1  # The store keeps its own copy.
    assert store.num_saved() == 20
    loaded = store.load([5, 2, 99])
    assert_state_equal(loaded[0], state_for(5, 1))
    assert_state_equal(loaded[1], state_for(2, 1))
    assert_state_equal(loaded[2], init_fn()(99))
    # Returned arrays are copies: mutating them does not change the store.
    loaded[0]['weights'][0][:] = -1
    assert_state_equal(store.load([5])[0], state_for(5, 1))
    store.commit(1)
  if backend != 'memory':
    with open_store(backend, tmp_path) as reopened:
      loaded = reopened.load([5, 2])
      assert reopened.rows_read == 2  # Only the requested rows were read.
      assert_state_equal(loaded[0], state_for(5, 1))
      assert_state_equal(loaded[1], state_for(2, 1))
      assert reopened.committed_round() == 1


@pytest.mark.parametrize('backend', BACKENDS)
def test_save_validates_structure(backend, tmp_path):
  with open_store(backend, tmp_path) as store:
    bad_shape = collections.OrderedDict(
        weights=[np.zeros(DIM + 1, np.float32)], participations=np.int64(0))
    with pytest.raises(cs.StructureMismatchError, match='client 8.*shape'):
      store.save([8], [bad_shape], 1)
    missing_leaf = collections.OrderedDict(weights=[np.zeros(DIM, np.float32)])
    with pytest.raises(cs.StructureMismatchError, match='client 9'):
      store.save([9], [missing_leaf], 1)
    with pytest.raises(ValueError, match='duplicate'):
      store.save([1, 1], [state_for(1, 1)] * 2, 1)
    # float64 values are cast to the template dtype (same_kind casting).
    store.save([3], [collections.OrderedDict(
        weights=[np.full(DIM, 2.5)], participations=4)], 1)
    loaded = store.load([3])[0]
    assert loaded['weights'][0].dtype == np.float32
    assert loaded['weights'][0][0] == 2.5 and loaded['participations'] == 4
    assert store.num_saved() == 1


@pytest.mark.parametrize('backend', BACKENDS)
def test_rollback_restores_overwritten_and_forgets_new(backend, tmp_path):
  with open_store(backend, tmp_path) as store:
    store.save(range(0, 10), [state_for(i, 1) for i in range(0, 10)], 1)
    store.commit(1)
    # Round 2 overwrites clients 5..9 and adds 10..14.
    store.save(range(5, 15), [state_for(i, 2) for i in range(5, 15)], 2)
    assert_state_equal(store.load([7])[0], state_for(7, 2))
    assert store.num_saved() == 15
    store.rollback(1)
    loaded = store.load(list(range(15)))
    for i in range(10):
      assert_state_equal(loaded[i], state_for(i, 1))
    for i in range(10, 15):
      assert_state_equal(loaded[i], init_fn()(i))
    assert store.num_saved() == 10
    assert store.committed_round() == 1
    # A checkpoint cannot be rewritten.
    with pytest.raises(ValueError, match='committed round 1'):
      store.save([1], [state_for(1, 1)], 1)
    # Training continues normally after the rollback.
    store.save([1], [state_for(1, 2)], 2)
    store.commit(2)
    assert_state_equal(store.load([1])[0], state_for(1, 2))


def test_sqlite_durability_settings(tmp_path):
  with open_store('sqlite', tmp_path) as store:
    assert store._conn.execute('PRAGMA journal_mode').fetchone()[0] == 'wal'
    assert store._conn.execute('PRAGMA synchronous').fetchone()[0] == 2  # FULL


@pytest.mark.parametrize('backend', ('sqlite', 'sqlite_cached'))
def test_sqlite_commit_prunes_superseded_rows(backend, tmp_path):
  with open_store(backend, tmp_path) as store:
    store.save([1, 2], [state_for(1, 1), state_for(2, 1)], 1)
    store.save([1], [state_for(1, 2)], 2)
    store.save([1], [state_for(1, 3)], 3)
    store.commit(2)
    rows = sorted(store._conn.execute('SELECT client_id, round FROM states'))
    assert rows == [(1, 2), (1, 3), (2, 1)]
    with pytest.raises(cs.ClientStateStoreError, match='older than'):
      store.rollback(1)
    store.rollback(2)
    assert_state_equal(store.load([1])[0], state_for(1, 2))


_CHILD = textwrap.dedent("""
    import collections, os, sys
    import numpy as np
    from tff_personal.core import client_state as cs
    path, mode = sys.argv[1], sys.argv[2]

    def state_for(c, r):
      return collections.OrderedDict(
          weights=[np.full({dim}, c * 100 + r, np.float32)],
          participations=np.int64(r))

    template = collections.OrderedDict(
        weights=[np.zeros({dim}, np.float32)], participations=np.int64(0))
    store = cs.SqliteClientStateStore(
        cs.seeded_initial_state_fn(template, {seed}), path)
    cohorts = {{1: range(0, 10), 2: range(5, 15), 3: range(10, 20)}}
    for r in (1, 2):
      store.save(cohorts[r], [state_for(c, r) for c in cohorts[r]], r)
      store.commit(r)
    if mode == 'after_save':
      store.save(cohorts[3], [state_for(c, 3) for c in cohorts[3]], 3)
    else:  # Killed inside the save transaction of round 3.
      store._conn.execute('BEGIN IMMEDIATE')
      store._conn.executemany(
          'INSERT OR REPLACE INTO states VALUES (?, 3, ?)',
          [(c, store.codec.encode(store.codec.flatten(state_for(c, 3), c)))
           for c in cohorts[3]])
    os.kill(os.getpid(), 9)
""").format(dim=DIM, seed=SEED)


@pytest.mark.parametrize('mode', ('after_save', 'mid_save'))
def test_sqlite_crash_consistency(mode, tmp_path):
  path = str(tmp_path / 'states.sqlite')
  env = dict(os.environ, PYTHONPATH=REPO_ROOT)
  proc = subprocess.run([sys.executable, '-c', _CHILD, path, mode],
                        env=env, capture_output=True, text=True, timeout=60,
                        check=False)
  assert proc.returncode == -signal.SIGKILL, proc.stderr
  with cs.SqliteClientStateStore(init_fn(), path) as store:
    assert store.committed_round() == 2
    before = store.load([12])[0]
    expected_before = state_for(12, 3 if mode == 'after_save' else 2)
    assert_state_equal(before, expected_before)  # The kill lost no save.
    store.rollback(store.committed_round())
    loaded = store.load(list(range(20)))
  for c in range(20):
    if c < 5:
      expected = state_for(c, 1)
    elif c < 15:
      expected = state_for(c, 2)
    else:
      expected = init_fn()(c)
    assert_state_equal(loaded[c], expected)


def test_memory_snapshots_restore_exactly(tmp_path):
  ckpt = str(tmp_path)
  with cs.InMemoryClientStateStore(init_fn(), ckpt) as store:
    for r, cohort in ((1, range(0, 10)), (2, range(5, 15)), (3, range(10, 20))):
      store.save(cohort, [state_for(c, r) for c in cohort], r)
      store.commit(r)
      assert os.path.exists(os.path.join(ckpt, f'client_states_{r}.npz'))
    assert store.snapshot_rounds() == [2, 3]  # The last two are kept.
    assert not [f for f in os.listdir(ckpt) if f.endswith('.tmp')]

  fresh = cs.InMemoryClientStateStore(init_fn(), ckpt)
  assert fresh.num_saved() == 0  # Nothing loaded before rollback/restore.
  assert_state_equal(fresh.load([3])[0], init_fn()(3))
  fresh.rollback(2)
  assert fresh.committed_round() == 2
  assert fresh.num_saved() == 15
  loaded = fresh.load(list(range(20)))
  for c in range(20):
    expected = (state_for(c, 1) if c < 5 else
                state_for(c, 2) if c < 15 else init_fn()(c))
    assert_state_equal(loaded[c], expected)

  latest = cs.InMemoryClientStateStore(init_fn(), ckpt)
  latest.rollback(3)
  assert_state_equal(latest.load([12])[0], state_for(12, 3))

  assert_state_equal(latest.load([7])[0], state_for(7, 2))
  # In-process rollback below the committed round reloads the snapshot.
  latest.rollback(2)
  assert_state_equal(latest.load([12])[0], state_for(12, 2))

  missing = cs.InMemoryClientStateStore(init_fn(), ckpt)
  with pytest.raises(cs.SnapshotNotFoundError, match='client_states_1.npz'):
    missing.rollback(1)


def test_memory_store_keeps_as_many_snapshots_as_asked(tmp_path):
  # The loop asks for as many as it keeps server checkpoints, so each kept
  # checkpoint's client states can be read back (`Run.client_states`).
  ckpt = str(tmp_path)
  with cs.InMemoryClientStateStore(init_fn(), ckpt, keep_snapshots=5) as store:
    for r in range(1, 8):
      store.save([r], [state_for(r, r)], r)
      store.commit(r)
      assert store.snapshot_rounds() == list(range(max(1, r - 4), r + 1))
  oldest = cs.InMemoryClientStateStore(init_fn(), ckpt)
  oldest.restore(3)
  assert_state_equal(oldest.load([3])[0], state_for(3, 3))
  assert_state_equal(oldest.load([4])[0], init_fn()(4))
  with pytest.raises(ValueError, match='keep_snapshots must be >= 2'):
    cs.InMemoryClientStateStore(init_fn(), ckpt, keep_snapshots=1)


def test_memory_rollback_zero_on_empty_dir_starts_fresh(tmp_path):
  ckpt = str(tmp_path)
  store = cs.InMemoryClientStateStore(init_fn(), ckpt)
  store.rollback(0)  # What the training loop does on a fresh start.
  assert store.num_saved() == 0 and store.committed_round() is None
  store.commit(0)
  store.save([1], [state_for(1, 1)], 1)
  store.commit(1)
  # With snapshots present, a missing round is an error, round 0 included.
  os.remove(os.path.join(ckpt, 'client_states_0.npz'))
  with pytest.raises(cs.SnapshotNotFoundError, match='client_states_0.npz'):
    cs.InMemoryClientStateStore(init_fn(), ckpt).rollback(0)
  with pytest.raises(cs.SnapshotNotFoundError, match='client_states_4.npz'):
    cs.InMemoryClientStateStore(init_fn(), str(tmp_path / 'empty')).rollback(4)


def test_memory_snapshot_truncated_raises_naming_file(tmp_path):
  ckpt = str(tmp_path)
  with cs.InMemoryClientStateStore(init_fn(), ckpt) as store:
    store.save(range(50), [state_for(c, 1) for c in range(50)], 1)
    store.commit(1)
  path = os.path.join(ckpt, 'client_states_1.npz')
  size = os.path.getsize(path)
  with open(path, 'r+b') as f:
    f.truncate(size // 2)
  store = cs.InMemoryClientStateStore(init_fn(), ckpt)
  with pytest.raises(cs.CorruptStateError, match='client_states_1.npz'):
    store.rollback(1)
  assert store.num_saved() == 0


def test_memory_snapshot_of_other_structure_raises(tmp_path):
  ckpt = str(tmp_path)
  with cs.InMemoryClientStateStore(init_fn(), ckpt) as store:
    store.save([1], [state_for(1, 1)], 1)
    store.commit(1)
  other = cs.seeded_initial_state_fn([np.zeros(3, np.float64)], SEED)
  with pytest.raises(cs.StructureMismatchError, match='client_states_1.npz'):
    cs.InMemoryClientStateStore(other, ckpt).rollback(1)
  # A template with more leaves than the snapshot (a model that gained a
  # private tensor) is a structure mismatch too, not a corrupt snapshot.
  more = cs.seeded_initial_state_fn(
      dict(make_template(), extra=np.zeros(2, np.int32)), SEED)
  with pytest.raises(cs.StructureMismatchError,
                     match='client_states_1.npz.*another structure'):
    cs.InMemoryClientStateStore(more, ckpt).rollback(1)


def test_sqlite_reopen_with_other_structure_raises(tmp_path):
  path = str(tmp_path / 'states.sqlite')
  with cs.SqliteClientStateStore(init_fn(), path) as store:
    store.save([1], [state_for(1, 1)], 1)
  other_template = collections.OrderedDict(
      weights=[np.zeros(DIM + 4, np.float32)], participations=np.int64(0))
  other = cs.seeded_initial_state_fn(other_template, SEED)
  with pytest.raises(cs.StructureMismatchError,
                     match=r'another state structure(.|\n)*<f4\[32\]'):
    cs.SqliteClientStateStore(other, path)
  # The original structure still opens.
  with cs.SqliteClientStateStore(init_fn(), path) as store:
    assert_state_equal(store.load([1])[0], state_for(1, 1))


def test_sqlite_corrupt_blob_raises_naming_client(tmp_path):
  path = str(tmp_path / 'states.sqlite')
  with cs.SqliteClientStateStore(init_fn(), path) as store:
    store.save([6, 7, 8], [state_for(c, 1) for c in (6, 7, 8)], 1)
  conn = sqlite3.connect(path)
  blob = conn.execute('SELECT blob FROM states WHERE client_id = 8').fetchone()
  flipped = bytearray(blob[0])
  flipped[3] ^= 0xFF
  with conn:
    conn.execute('UPDATE states SET blob = ? WHERE client_id = 7',
                 (b'\x00' * 10,))
    conn.execute('UPDATE states SET blob = ? WHERE client_id = 8',
                 (bytes(flipped),))
  conn.close()
  with cs.SqliteClientStateStore(init_fn(), path) as store:
    assert_state_equal(store.load([6])[0], state_for(6, 1))
    with pytest.raises(cs.CorruptStateError, match=r'client 7\b.*10 bytes'):
      store.load([7])
    with pytest.raises(cs.CorruptStateError, match=r'client 8\b.*CRC'):
      store.load([8])


def test_sqlite_not_a_database_raises(tmp_path):
  path = str(tmp_path / 'states.sqlite')
  with open(path, 'wb') as f:
    f.write(b'this is not a database' * 100)
  with pytest.raises(cs.CorruptStateError, match='states.sqlite'):
    cs.SqliteClientStateStore(init_fn(), path)


def test_make_store(tmp_path):
  fn = init_fn()
  small = cs.make_store('auto', fn, population=100, directory=str(tmp_path),
                        auto_threshold=100)
  assert isinstance(small, cs.InMemoryClientStateStore)
  big = cs.make_store('auto', fn, population=101, directory=str(tmp_path),
                      auto_threshold=100)
  assert isinstance(big, cs.SqliteClientStateStore)
  assert big.path == os.path.join(str(tmp_path), cs.SQLITE_FILENAME)
  big.close()
  default = cs.make_store('auto', fn, population=100_001, directory=str(
      tmp_path / 'd'))
  assert isinstance(default, cs.SqliteClientStateStore)
  default.close()
  assert isinstance(
      cs.make_store('memory', fn, population=10**7, directory=None),
      cs.InMemoryClientStateStore)
  with pytest.raises(ValueError, match="'bogus'"):
    cs.make_store('bogus', fn, population=10, directory=str(tmp_path))
  with pytest.raises(ValueError, match='needs a directory'):
    cs.make_store('sqlite', fn, population=10, directory=None)
  with pytest.raises(ValueError, match='needs a directory'):
    cs.make_store('auto', fn, population=10**6, directory=None)


def test_sqlite_scale_10000_clients(tmp_path):
  ids = list(range(10_000))
  rng = np.random.default_rng(0)
  weights = rng.normal(size=(len(ids), DIM)).astype(np.float32)
  states = [collections.OrderedDict(weights=[weights[i]],
                                    participations=np.int64(i)) for i in ids]
  path = str(tmp_path / 'states.sqlite')
  with cs.SqliteClientStateStore(init_fn(), path) as store:
    store.save(ids, states, 1)
    store.commit(1)
  with cs.SqliteClientStateStore(init_fn(), path) as store:
    assert store.num_saved() == 10_000
    loaded = store.load(ids[::-1])
    assert store.rows_read == 10_000
  got = np.stack([s['weights'][0] for s in loaded[::-1]])
  np.testing.assert_array_equal(got, weights)
  assert [int(s['participations']) for s in loaded] == ids[::-1]


def test_closed_store_raises(tmp_path):
  store = open_store('sqlite', tmp_path)
  store.close()
  store.close()  # Idempotent.
  with pytest.raises(cs.ClientStateStoreError, match='closed'):
    store.load([1])


def test_sqlite_damaged_page_raises_naming_the_database(tmp_path):
  path = str(tmp_path / 'states.sqlite')
  fn = cs.seeded_initial_state_fn(make_template(), SEED)
  ids = list(range(2000))
  with cs.SqliteClientStateStore(fn, path) as store:
    store.save(ids, [state_for(i, 1) for i in ids], 1)
    store.commit(1)
  conn = sqlite3.connect(path)
  page_size = conn.execute('PRAGMA page_size').fetchone()[0]
  roots = {r for (r,) in conn.execute('SELECT rootpage FROM sqlite_master')}
  conn.close()
  pages = os.path.getsize(path) // page_size
  assert pages > 10
  with open(path, 'r+b') as f:  # Garbles the pages below the roots.
    for page in range(2, pages + 1):  # Pages are numbered from 1.
      if page not in roots:
        f.seek((page - 1) * page_size)
        f.write(b'\xff' * 64)
  with pytest.raises(cs.CorruptStateError, match='states.sqlite') as info:
    with cs.SqliteClientStateStore(fn, path) as store:
      store.load(ids)
  assert 'malformed' in str(info.value)
