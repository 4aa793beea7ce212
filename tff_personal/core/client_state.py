"""Stores for per-client private state, loaded and saved one cohort at a time.

Each client owns a private state (personal embeddings, a personal head, a
participation counter, ...) that never leaves the client in the federated
computation. In simulation the driver keeps these states in a
`ClientStateStore`: every round it loads only the sampled cohort's states,
runs the TFF process with them, and saves the states the process returns.

A state is a nested structure (dicts, `collections.OrderedDict`, lists, tuples,
namedtuples) of numpy arrays with fixed shapes and dtypes, the same for every
client. The structure is described by a *template*: a structure of numpy
arrays or of `tf.TensorSpec`s (anything with `.shape` and `.dtype`). Mappings
are flattened in sorted key order, as `tf.nest` does, and rebuilt with the
template's container types and key order. Leaves are cast to the template's
dtype with numpy `same_kind` casting (float64 -> float32 is accepted,
float -> int is not) and must have the template's shape exactly. 0-d leaves are
returned as numpy scalars (`np.int64(3)`), all others as `np.ndarray`s.

Clients that were never saved get `initial_state_fn(client_id)`, which must be
deterministic; `seeded_initial_state_fn` builds the documented one (see there).
Their state is not written until the training loop saves it.

Two backends:

* `InMemoryClientStateStore`: a dict, optionally snapshotted to
  `client_states_<round>.npz` on `commit`. For populations that fit in memory.
* `SqliteClientStateStore`: one SQLite file; memory is bounded by the cohort
  (plus an optional LRU cache of encoded states), so a million clients is fine.

Crash-consistency protocol
--------------------------
Every saved state is tagged with the round that produced it, and a store keeps,
per client, the newest committed version plus any newer uncommitted ones. The
training loop does, for round r:

  (a) run round r on the cohort's loaded states;
  (b) `store.save(cohort, new_states, r)`  (durable on return for SQLite);
  (c) every k rounds, save the server state as version r with
      `tff.program.FileProgramStateManager`;
  (d) then `store.commit(r)`: everything saved with round <= r becomes the
      checkpoint; older versions that it supersedes are dropped.

On `--resume` the loop loads the latest server state version v and calls
`store.rollback(v)`, which forgets every save tagged with a round > v and
brings back the versions those saves overwrote. Hence a kill between any two
steps loses nothing and duplicates nothing: a kill before (c) resumes from the
previous checkpoint v and rolls back the saves of rounds > v; a kill between
(c) and (d) resumes from r, and the SQLite store still holds every save with
round <= r (they were durable after (b)); a kill during a save or commit
leaves SQLite's previous transaction intact.

The in-memory backend is durable only at (d) (the snapshot), so after a kill
between (c) and (d) there is no snapshot for round r: `rollback(r)` then
raises `SnapshotNotFoundError` listing the snapshots that exist, and the loop
must resume from the newest version both have (the store keeps at least the
last two snapshots and `snapshot_rounds()` lists them for exactly this). It never
silently starts fresh.

Record of rounds started
------------------------
A store also keeps the count of noised rounds started in its directory
(`record_rounds_started`, `rounds_started`): a monotone counter the
training loop advances before a round's aggregate exists, beside the run
directory's own record (`training_loop.rounds_started` compares the two).
The SQLite store keeps it in its `meta` table (`rounds_started`), the
memory store in `rounds_started.json` beside its snapshots; rollbacks and
restores leave it as it is, and lowering it raises.
`read_rounds_started(directory)` reads it without opening the store.

Rules enforced by every store: `save` with a round <= `committed_round()`
raises (that would rewrite a checkpoint); `commit(r)` and `rollback(r)` need
r >= `committed_round()` (older versions are gone; the in-memory store instead
reloads snapshot r if it has one).

Pure numpy and the standard library; no TensorFlow import is needed.
"""

from __future__ import annotations

import abc
import collections
import contextlib
import json
import os
import re
import sqlite3
import zipfile
import zlib
from typing import Callable, Iterable, Iterator, Optional, Sequence

import numpy as np

from tff_personal.core import atomic_io
from tff_personal.core import fault
from tff_personal.core import state_codec

Structure = state_codec.Structure
InitialStateFn = Callable[[int], Structure]
# Re-exported: the codec, the initial states and the stores' errors.
ClientStateStoreError = state_codec.ClientStateStoreError
StructureMismatchError = state_codec.StructureMismatchError
CorruptStateError = state_codec.CorruptStateError
SnapshotNotFoundError = state_codec.SnapshotNotFoundError
StateCodec = state_codec.StateCodec
SeededInitialState = state_codec.SeededInitialState
seeded_initial_state_fn = state_codec.seeded_initial_state_fn
ConstantInitialState = state_codec.ConstantInitialState
constant_initial_state_fn = state_codec.constant_initial_state_fn

_SNAPSHOT_RE = re.compile(r'^client_states_(\d+)\.npz$')
_TMP_PREFIX = '.client_states_'  # atomic_io's temp files: '.<name>.<rand>.tmp'
_SQLITE_CHUNK = 500  # Ids per `IN (...)` query; below every SQLite limit.
_FORMAT_VERSION = '1'



# ----------------------------------------------------------------------------
# Stores.


class ClientStateStore(abc.ABC):
  """Loads/saves only the requested clients' private state.

  Subclasses implement the `_`-prefixed hooks over flat, validated leaves;
  this class handles structures, initial states and argument checks.
  """

  def __init__(self, initial_state_fn: InitialStateFn,
               template: Optional[Structure] = None):
    """Initializes the store.

    Args:
      initial_state_fn: `client_id -> state`; must be deterministic. Used for
        clients that were never saved.
      template: the structure template. Defaults to
        `initial_state_fn.template` if present, else `initial_state_fn(0)`.
    """
    if template is None:
      template = getattr(initial_state_fn, 'template', None)
    if template is None:
      template = initial_state_fn(0)
    self._initial_state_fn = initial_state_fn
    self._codec = StateCodec(template)
    self._closed = False

  @property
  def codec(self) -> StateCodec:
    return self._codec

  def initial_state(self, client_id: int) -> Structure:
    """The validated initial state of `client_id` (never written)."""
    cid = int(client_id)
    return self._codec.pack(
        self._codec.flatten(self._initial_state_fn(cid), cid))

  def load(self, client_ids: Sequence[int]) -> list[Structure]:
    """States of `client_ids`, in that order; initial state for unseen ids."""
    self._check_open()
    ids = [int(c) for c in client_ids]
    found = self._load_leaves(sorted(set(ids)))
    out = []
    for cid in ids:
      leaves = found.get(cid)
      if leaves is None:
        out.append(self.initial_state(cid))
      else:
        out.append(self._codec.pack([np.array(x) for x in leaves]))
    return out

  def save(self, client_ids: Sequence[int], states: Sequence[Structure],
           round_num: int) -> None:
    """Saves `states[i]` for `client_ids[i]`, tagged with `round_num`."""
    self._check_open()
    ids = [int(c) for c in client_ids]
    states = list(states)
    if len(ids) != len(states):
      raise ValueError(
          f'save: {len(ids)} client ids but {len(states)} states.')
    if len(set(ids)) != len(ids):
      raise ValueError('save: duplicate client ids in one call.')
    round_num = int(round_num)
    committed = self.committed_round()
    if committed is not None and round_num <= committed:
      raise ValueError(
          f'save: round {round_num} <= committed round {committed}; a '
          'checkpoint cannot be rewritten (missing rollback on resume?).')
    leaves = [self._codec.flatten(s, cid) for cid, s in zip(ids, states)]
    self._save_leaves(ids, leaves, round_num)

  def commit(self, round_num: int) -> None:
    """Makes everything saved with round <= `round_num` the checkpoint."""
    self._check_open()
    round_num = int(round_num)
    committed = self.committed_round()
    if committed is not None and round_num < committed:
      raise ValueError(
          f'commit: round {round_num} < committed round {committed}.')
    self._commit(round_num)

  def rollback(self, round_num: int) -> None:
    """Forgets every save tagged with a round > `round_num`."""
    self._check_open()
    round_num = int(round_num)
    committed = self.committed_round()
    if committed is not None and round_num < committed:
      raise ClientStateStoreError(
          f'rollback: round {round_num} is older than the committed round '
          f'{committed}; the versions it needs were superseded. Resume from a '
          f'round >= {committed}.')
    self._rollback(round_num)

  def rounds_started(self) -> Optional[int]:
    """The store's count of rounds started, or None if it has none."""
    self._check_open()
    return self._read_rounds_started()

  def record_rounds_started(self, count: int) -> None:
    """Durably records that `count` rounds have started.

    The count never decreases: a lower `count` than the recorded one raises
    `ClientStateStoreError`; an equal one writes nothing.
    """
    self._check_open()
    count = int(count)
    if count < 0:
      raise ValueError(f'record_rounds_started: count {count} < 0')
    current = self._read_rounds_started()
    if current is not None and count < current:
      raise ClientStateStoreError(
          f'{self.rounds_started_location()} counts {current} rounds '
          f'started; it cannot be lowered to {count}.')
    if current != count:
      self._write_rounds_started(count)

  @abc.abstractmethod
  def rounds_started_location(self) -> str:
    """Where the store keeps its count of rounds started (for messages)."""

  @abc.abstractmethod
  def _read_rounds_started(self) -> Optional[int]:
    """The recorded count, or None."""

  @abc.abstractmethod
  def _write_rounds_started(self, count: int) -> None:
    """Records `count` durably (checked not to lower it)."""

  @abc.abstractmethod
  def committed_round(self) -> Optional[int]:
    """Round of the last `commit`, or None."""

  @abc.abstractmethod
  def num_saved(self) -> int:
    """Number of clients with a saved state."""

  def close(self) -> None:
    self._closed = True

  def __enter__(self) -> 'ClientStateStore':
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def _check_open(self) -> None:
    if self._closed:
      raise ClientStateStoreError('The client-state store is closed.')

  @abc.abstractmethod
  def _load_leaves(
      self, client_ids: Sequence[int]) -> dict[int, list[np.ndarray]]:
    """Newest saved leaves of those `client_ids` that have a saved state."""

  @abc.abstractmethod
  def _save_leaves(self, client_ids: Sequence[int],
                   leaves: Sequence[list[np.ndarray]], round_num: int) -> None:
    """Saves validated leaves."""

  @abc.abstractmethod
  def _commit(self, round_num: int) -> None:
    """Commit with the arguments checked."""

  @abc.abstractmethod
  def _rollback(self, round_num: int) -> None:
    """Rollback with the arguments checked."""


class InMemoryClientStateStore(ClientStateStore):
  """All states in a dict; optional atomic `.npz` snapshots on `commit`.

  Per client the store keeps a list of versions `(round, payload)` sorted by
  round, where `payload` is the state's raw leaf bytes (`StateCodec.payload`,
  one `bytes` object per version instead of one numpy array per leaf: 437
  instead of 615 bytes per client for a 32-float state): after `commit(r)`
  at most one version with round <= r plus newer, uncommitted ones, so
  `rollback` can restore what uncommitted saves overwrote. `commit` and
  `rollback` touch only the clients saved since the last commit
  (`_pending`), so a round costs O(cohort) however many clients are stored;
  only the snapshot itself (written by `commit` with a `checkpoint_dir`) is
  O(stored clients), vectorized over them.

  With `checkpoint_dir`, `commit(r)` writes the committed view (for every
  client its newest version with round <= r) to `client_states_<r>.npz`
  atomically (temp file, fsync, `os.replace`, fsync of the directory), then
  deletes snapshots of other rounds except the newest `keep_snapshots - 1`
  below r, so the last `keep_snapshots` (at least two) remain: the loop
  keeps as many as server checkpoints, so every kept checkpoint has its
  client states (snapshots of rounds > r belong to an abandoned timeline
  and are deleted too). A new store over an existing directory
  loads nothing until `rollback(r)` or `restore(r)`, which load snapshot r
  exactly; a missing snapshot raises `SnapshotNotFoundError` and a corrupt
  one `CorruptStateError`, both naming the file. The one exception is
  `rollback(0)` on a directory without any snapshot (a fresh run, or a kill
  before the first `commit(0)`): round 0 precedes all saves, so the store
  simply starts with every client at its initial state.
  """

  def __init__(self, initial_state_fn: InitialStateFn,
               checkpoint_dir: Optional[str] = None, *,
               template: Optional[Structure] = None, keep_snapshots: int = 2):
    super().__init__(initial_state_fn, template)
    if keep_snapshots < 2:
      raise ValueError('keep_snapshots must be >= 2 (a kill during a commit '
                       f'needs the one before), got {keep_snapshots}')
    self._keep_snapshots = keep_snapshots
    self._checkpoint_dir = checkpoint_dir
    if checkpoint_dir is not None:
      os.makedirs(checkpoint_dir, exist_ok=True)
    self._versions: dict[int, list[tuple[int, bytes]]] = {}
    # Clients with more than one version or a version newer than the
    # committed round: the only ones `commit`/`rollback` need to visit.
    self._pending: set[int] = set()
    self._committed: Optional[int] = None
    # False until this instance saved, committed or restored: a fresh store
    # over a checkpoint directory must reload a snapshot on rollback.
    self._live = False
    # Without a checkpoint directory the count of rounds started lives here.
    self._rounds_started: Optional[int] = None

  def rounds_started_location(self) -> str:
    if self._checkpoint_dir is None:
      return 'the in-memory client-state store'
    return os.path.join(self._checkpoint_dir, ROUNDS_STARTED_FILENAME)

  def _read_rounds_started(self) -> Optional[int]:
    if self._checkpoint_dir is None:
      return self._rounds_started
    return _read_counter_file(self.rounds_started_location())

  def _write_rounds_started(self, count: int) -> None:
    if self._checkpoint_dir is None:
      self._rounds_started = count
      return
    with atomic_io.atomic_write(self.rounds_started_location()) as f:
      json.dump({'rounds_started': count}, f)

  def committed_round(self) -> Optional[int]:
    return self._committed

  def num_saved(self) -> int:
    return len(self._versions)

  def snapshot_path(self, round_num: int) -> str:
    if self._checkpoint_dir is None:
      raise ValueError('This store has no checkpoint_dir.')
    return os.path.join(self._checkpoint_dir,
                        f'client_states_{int(round_num)}.npz')

  def snapshot_rounds(self) -> list[int]:
    """Rounds of the snapshots in `checkpoint_dir`, ascending."""
    if self._checkpoint_dir is None:
      return []
    rounds = []
    for name in os.listdir(self._checkpoint_dir):
      m = _SNAPSHOT_RE.match(name)
      if m:
        rounds.append(int(m.group(1)))
    return sorted(rounds)

  def rollback(self, round_num: int) -> None:
    self._check_open()
    round_num = int(round_num)
    if self._checkpoint_dir is not None and (
        not self._live or (self._committed is not None
                           and round_num < self._committed)):
      if (not self._live and round_num == 0 and not self.snapshot_rounds()):
        # Round 0 precedes every save of the loop (rounds >= 1), so with no
        # snapshot at all it is the all-initial state; nothing can be lost.
        self._live = True
        return
      self.restore(round_num)
      return
    super().rollback(round_num)

  def restore(self, round_num: int) -> None:
    """Replaces all states with snapshot `round_num` (committed there)."""
    self._check_open()
    round_num = int(round_num)
    path = self.snapshot_path(round_num)
    if not os.path.exists(path):
      raise SnapshotNotFoundError(
          f'Client-state snapshot {path} not found (snapshots present for '
          f'rounds {self.snapshot_rounds()}). Resume from a round that has '
          'both a server checkpoint and a client-state snapshot.')
    versions = self._read_snapshot(path, round_num)
    self._versions = versions
    self._pending = set()
    self._committed = round_num
    self._live = True

  def _read_snapshot(
      self, path: str,
      round_num: int) -> dict[int, list[tuple[int, bytes]]]:
    codec = self._codec
    try:
      with np.load(path, allow_pickle=False) as z:
        data = {k: z[k] for k in z.files}  # Reads (and CRC-checks) members.
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, KeyError,
            zlib.error) as e:
      raise CorruptStateError(
          f'Client-state snapshot {path} is corrupt or truncated: '
          f'{type(e).__name__}: {e}') from e
    try:
      signature = str(data['signature'])
    except KeyError as e:
      raise CorruptStateError(
          f'Client-state snapshot {path} lacks entry {e}.') from e
    # Before the leaves: a snapshot of another structure (e.g. written by a
    # model with fewer private tensors) is named as such, not as corrupt.
    if signature != codec.signature():
      raise StructureMismatchError(
          f'Client-state snapshot {path} was written for another structure: '
          f'{signature} vs. the template {codec.signature()}.')
    try:
      stored_round = int(data['round'])
      client_ids = data['client_ids']
      rounds = data['rounds']
      leaf_arrays = [data[f'leaf_{i}'] for i in range(len(codec.paths))]
    except KeyError as e:
      raise CorruptStateError(
          f'Client-state snapshot {path} lacks entry {e}.') from e
    if stored_round != round_num:
      raise CorruptStateError(
          f'Client-state snapshot {path} holds round {stored_round}, not '
          f'{round_num}.')
    n = len(client_ids)
    for arr, dtype, shape in zip(leaf_arrays, codec.dtypes, codec.shapes):
      if arr.dtype != dtype or arr.shape != (n,) + shape:
        raise CorruptStateError(
            f'Client-state snapshot {path} has a leaf of {arr.dtype}'
            f'{arr.shape}, expected {dtype}{(n,) + shape}.')
    if len(rounds) != n:
      raise CorruptStateError(f'Client-state snapshot {path} is inconsistent.')
    payloads = codec.payloads_from_columns(leaf_arrays, n)
    return {int(cid): [(int(r), payload)] for cid, r, payload in
            zip(client_ids.tolist(), rounds.tolist(), payloads)}

  def _load_leaves(self, client_ids):
    return {cid: self._codec.from_payload(self._versions[cid][-1][1])
            for cid in client_ids if cid in self._versions}

  def _save_leaves(self, client_ids, leaves, round_num):
    self._live = True
    for cid, lv in zip(client_ids, leaves):
      versions = self._versions.setdefault(cid, [])
      versions[:] = [v for v in versions if v[0] != round_num]
      versions.append((round_num, self._codec.payload(lv)))
      versions.sort(key=lambda v: v[0])
      self._pending.add(cid)

  def _settle(self, cid: int) -> None:
    """Drops `cid` from `_pending` once it holds one committed version."""
    versions = self._versions.get(cid)
    committed = self._committed
    if not versions or (len(versions) == 1 and committed is not None
                        and versions[0][0] <= committed):
      self._pending.discard(cid)

  def _commit(self, round_num):
    for cid in self._pending:
      versions = self._versions[cid]
      older = [i for i, v in enumerate(versions) if v[0] <= round_num]
      if older:
        del versions[:older[-1]]
    if self._checkpoint_dir is not None:
      self._write_snapshot(round_num)
    self._committed = round_num
    self._live = True
    for cid in list(self._pending):
      self._settle(cid)

  def _rollback(self, round_num):
    for cid in list(self._pending):
      kept = [v for v in self._versions[cid] if v[0] <= round_num]
      if kept:
        self._versions[cid] = kept
      else:
        del self._versions[cid]
      self._settle(cid)

  def _write_snapshot(self, round_num: int) -> None:
    codec = self._codec
    ids, rounds, rows = [], [], []
    pending = self._pending
    for cid in sorted(self._versions):
      versions = self._versions[cid]
      if cid in pending:
        committed = [v for v in versions if v[0] <= round_num]
        if not committed:
          continue
        version = committed[-1]
      else:
        version = versions[0]  # One version, committed earlier.
      ids.append(cid)
      rounds.append(version[0])
      rows.append(version[1])
    arrays = {
        'signature': np.array(codec.signature()),
        'round': np.array(round_num, np.int64),
        'client_ids': np.array(ids, np.int64),
        'rounds': np.array(rounds, np.int64),
    }
    for i, column in enumerate(codec.leaf_columns(rows)):
      arrays[f'leaf_{i}'] = column
    with atomic_io.atomic_write(self.snapshot_path(round_num), 'wb') as f:
      np.savez(f, **arrays)
      fault.point('mid_store_commit')  # Written, not yet renamed.
    # Keep this snapshot and the newest older ones; drop the rest.
    older = [r for r in self.snapshot_rounds() if r < round_num]
    keep = {round_num} | set(
        older[max(0, len(older) - self._keep_snapshots + 1):])
    for r in self.snapshot_rounds():
      if r not in keep:
        os.remove(self.snapshot_path(r))
    for name in os.listdir(self._checkpoint_dir):
      full = os.path.join(self._checkpoint_dir, name)
      if name.startswith(_TMP_PREFIX) and name.endswith('.tmp'):
        os.remove(full)  # Left by a killed commit.


class SqliteClientStateStore(ClientStateStore):
  """States in one SQLite file; memory bounded by the cohort plus a cache.

  Schema: `states(client_id, round, blob, PRIMARY KEY(client_id, round))`
  with an index on `round`, and `meta(key, value)` holding `signature` (the
  template's paths/dtypes/shapes; opening a file written for another structure
  raises `StructureMismatchError`) and `committed_round`. Blobs use
  `StateCodec`'s raw encoding (raw leaf bytes + CRC-32, length and CRC checked
  on read; a bad blob raises `CorruptStateError` naming the client).

  * `save(r)`: one transaction of `INSERT OR REPLACE` rows tagged r.
  * `load`: for each requested id only, the row with the greatest round
    (`SELECT ... WHERE client_id IN (...)`, chunked); nothing else is read.
  * `commit(r)`: one transaction deleting, for each client saved in
    (committed_round, r], its rows older than its newest row with round <= r,
    and setting committed_round = r.
  * `rollback(r)`: deletes rows with round > r.

  Durability: WAL journal mode with `synchronous=FULL`. In WAL mode NORMAL
  survives process crashes but may lose the last transactions on power loss
  or an OS crash; the protocol needs the rows of `save(r)` to be on disk
  before the server checkpoint of round r is written (step (c)), which resume
  trusts, so every save/commit transaction fsyncs the WAL: one fsync per
  round, negligible next to a federated round.
  """

  def __init__(self, initial_state_fn: InitialStateFn, path: str,
               cache_size: int = 0, *, template: Optional[Structure] = None):
    super().__init__(initial_state_fn, template)
    if cache_size < 0:
      raise ValueError(f'cache_size must be >= 0, got {cache_size}.')
    self._path = path
    self._cache_size = int(cache_size)
    self._cache: collections.OrderedDict[int, bytes] = (
        collections.OrderedDict())
    self.rows_read = 0  # Rows fetched from SQLite by `load` (for tests).
    self._conn = None
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    try:
      self._conn = sqlite3.connect(path, isolation_level=None)
      self._conn.execute('PRAGMA journal_mode=WAL')
      self._conn.execute('PRAGMA synchronous=FULL')
      with self._transaction():
        self._conn.execute(
            'CREATE TABLE IF NOT EXISTS states (client_id INTEGER NOT NULL, '
            'round INTEGER NOT NULL, blob BLOB NOT NULL, '
            'PRIMARY KEY (client_id, round))')
        self._conn.execute(
            'CREATE INDEX IF NOT EXISTS states_round ON states(round)')
        self._conn.execute(
            'CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, '
            'value TEXT)')
        meta = dict(self._conn.execute('SELECT key, value FROM meta'))
        signature = self._codec.signature()
        if 'signature' not in meta:
          self._conn.executemany(
              'INSERT INTO meta (key, value) VALUES (?, ?)',
              [('signature', signature), ('format_version', _FORMAT_VERSION)])
        elif meta['signature'] != signature:
          raise StructureMismatchError(
              f'Client-state database {path} was written for another state '
              f'structure.\n  stored:   {_describe_signature(meta["signature"])}'
              f'\n  template: {self._codec.describe()}')
        elif meta.get('format_version', _FORMAT_VERSION) != _FORMAT_VERSION:
          raise ClientStateStoreError(
              f'Client-state database {path} has format version '
              f'{meta["format_version"]}, expected {_FORMAT_VERSION}.')
        committed = meta.get('committed_round')
        self._committed = None if committed is None else int(committed)
        self._rounds_started = _counter(meta.get(_ROUNDS_STARTED_KEY), path)
    except sqlite3.OperationalError as e:
      self._close_conn()
      raise ClientStateStoreError(
          f'Cannot open client-state database {path}: {e}') from e
    except sqlite3.DatabaseError as e:  # E.g. "file is not a database".
      self._close_conn()
      raise CorruptStateError(
          f'Cannot open client-state database {path}: {e}') from e
    except BaseException:
      self._close_conn()
      raise

  @property
  def path(self) -> str:
    return self._path

  def rounds_started_location(self) -> str:
    return f'{self._path} (meta {_ROUNDS_STARTED_KEY})'

  def _read_rounds_started(self) -> Optional[int]:
    return self._rounds_started

  def _write_rounds_started(self, count: int) -> None:
    with self._db_errors(), self._transaction():
      self._conn.execute('INSERT OR REPLACE INTO meta (key, value) '
                         'VALUES (?, ?)', (_ROUNDS_STARTED_KEY, str(count)))
    self._rounds_started = count

  def committed_round(self) -> Optional[int]:
    return self._committed

  def num_saved(self) -> int:
    self._check_open()
    with self._db_errors():
      return self._conn.execute(
          'SELECT COUNT(DISTINCT client_id) FROM states').fetchone()[0]

  def close(self) -> None:
    self._close_conn()
    super().close()

  def _close_conn(self) -> None:
    conn = self._conn
    if conn is not None:
      conn.close()
      self._conn = None

  @contextlib.contextmanager
  def _db_errors(self) -> Iterator[None]:
    """Re-raises SQLite's errors naming the database file.

    A damaged file (e.g. "database disk image is malformed") raises
    `CorruptStateError`; other SQLite errors (a full disk, a lock) raise
    `ClientStateStoreError`.
    """
    try:
      yield
    except sqlite3.OperationalError as e:
      raise ClientStateStoreError(
          f'Client-state database {self._path}: {e}') from e
    except sqlite3.DatabaseError as e:
      raise CorruptStateError(
          f'Client-state database {self._path} is damaged: {e}') from e

  @contextlib.contextmanager
  def _transaction(self) -> Iterator[None]:
    """BEGIN IMMEDIATE ... COMMIT, or ROLLBACK on an exception."""
    self._conn.execute('BEGIN IMMEDIATE')
    try:
      yield
    except BaseException:
      self._conn.execute('ROLLBACK')
      raise
    self._conn.execute('COMMIT')

  def _cache_put(self, cid: int, blob: bytes) -> None:
    if self._cache_size:
      self._cache[cid] = blob
      self._cache.move_to_end(cid)
      while len(self._cache) > self._cache_size:
        self._cache.popitem(last=False)

  def _load_leaves(self, *args):
    with self._db_errors():
      return self._sqlite_load_leaves(*args)

  def _sqlite_load_leaves(self, client_ids):
    blobs: dict[int, bytes] = {}
    missing = []
    for cid in client_ids:
      blob = self._cache.get(cid)
      if blob is None:
        missing.append(cid)
      else:
        self._cache.move_to_end(cid)
        blobs[cid] = blob
    for chunk in _chunks(missing, _SQLITE_CHUNK):
      # SQLite takes the bare column `blob` from the row holding MAX(round).
      rows = self._conn.execute(
          'SELECT client_id, MAX(round), blob FROM states WHERE client_id IN '
          f'({",".join("?" * len(chunk))}) GROUP BY client_id', chunk)
      for cid, _, blob in rows:
        self.rows_read += 1
        blobs[cid] = blob
        self._cache_put(cid, blob)
    return {cid: self._codec.decode(blob, cid) for cid, blob in blobs.items()}

  def _save_leaves(self, *args):
    with self._db_errors():
      return self._sqlite_save_leaves(*args)

  def _sqlite_save_leaves(self, client_ids, leaves, round_num):
    blobs = [self._codec.encode(lv) for lv in leaves]
    with self._transaction():
      self._conn.executemany(
          'INSERT OR REPLACE INTO states (client_id, round, blob) '
          'VALUES (?, ?, ?)',
          ((cid, round_num, blob) for cid, blob in zip(client_ids, blobs)))
    for cid, blob in zip(client_ids, blobs):
      self._cache_put(cid, blob)

  def _commit(self, *args):
    with self._db_errors():
      return self._sqlite_commit(*args)

  def _sqlite_commit(self, round_num):
    previous = -(2**63) if self._committed is None else self._committed
    with self._transaction():
      # Only clients saved in (previous, r] can hold two versions <= r.
      self._conn.execute(
          'DELETE FROM states WHERE client_id IN ('
          '  SELECT client_id FROM states WHERE round > :prev AND round <= :r)'
          ' AND round < (SELECT MAX(s.round) FROM states AS s'
          '              WHERE s.client_id = states.client_id'
          '              AND s.round <= :r)',
          {'prev': previous, 'r': round_num})
      fault.point('mid_store_commit')  # Inside the open transaction.
      self._conn.execute(
          'INSERT OR REPLACE INTO meta (key, value) '
          "VALUES ('committed_round', ?)", (str(round_num),))
    self._committed = round_num

  def _rollback(self, *args):
    with self._db_errors():
      return self._sqlite_rollback(*args)

  def _sqlite_rollback(self, round_num):
    with self._transaction():
      self._conn.execute('DELETE FROM states WHERE round > ?', (round_num,))
    self._cache.clear()

def _describe_signature(signature: str) -> str:
  try:
    return ', '.join(f'{p}: {d}{s}' for p, d, s in json.loads(signature))
  except (ValueError, TypeError):
    return signature


def _chunks(items: Sequence[int], size: int) -> Iterable[Sequence[int]]:
  for i in range(0, len(items), size):
    yield items[i:i + size]


_BACKENDS = ('auto', 'memory', 'sqlite')
SQLITE_FILENAME = 'client_states.sqlite'
# The memory store's count of rounds started, beside its snapshots.
ROUNDS_STARTED_FILENAME = 'rounds_started.json'
_ROUNDS_STARTED_KEY = 'rounds_started'


def _counter(value, where: str) -> Optional[int]:
  """A recorded count of rounds started (None: not recorded)."""
  if value is None:
    return None
  try:
    count = int(value)
  except (TypeError, ValueError):
    count = -1
  if isinstance(value, bool) or count < 0 or str(count) != str(value):
    raise CorruptStateError(
        f'{where} holds {value!r} as its count of rounds started, not a '
        'count')
  return count


def _read_counter_file(path: str) -> Optional[int]:
  if not os.path.exists(path):
    return None
  try:
    with open(path, encoding='utf-8') as f:
      value = json.load(f)['rounds_started']
  except OSError as e:
    raise ClientStateStoreError(
        f'{path} cannot be read ({type(e).__name__}: {e})') from e
  except (ValueError, KeyError, TypeError) as e:
    raise CorruptStateError(
        f'{path} is damaged ({type(e).__name__}: {e})') from e
  return _counter(value, path)


def read_rounds_started(directory: str) -> tuple[Optional[int], str]:
  """`(count, where)`: the count of rounds started that the store in
  `directory` records, read without opening the store (nothing is
  written), and where it is kept; count None when the store records none
  (no store, or one written before stores kept the count).

  Raises:
    CorruptStateError: the record cannot be read (names the file).
  """
  database = os.path.join(directory, SQLITE_FILENAME)
  if os.path.exists(database) and os.path.getsize(database):
    where = f'{database} (meta {_ROUNDS_STARTED_KEY})'
    try:
      conn = sqlite3.connect(f'file:{database}?mode=ro', uri=True)
      try:
        tables = {row[0] for row in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table'")}
        row = conn.execute(
            'SELECT value FROM meta WHERE key = ?',
            (_ROUNDS_STARTED_KEY,)).fetchone() if 'meta' in tables else None
      finally:
        conn.close()
    except sqlite3.OperationalError as e:  # E.g. no permission.
      raise ClientStateStoreError(
          f'Cannot read client-state database {database}: {e}') from e
    except sqlite3.DatabaseError as e:  # E.g. "file is not a database".
      raise CorruptStateError(
          f'Cannot read client-state database {database}: {e}') from e
    return _counter(row and row[0], where), where
  path = os.path.join(directory, ROUNDS_STARTED_FILENAME)
  return _read_counter_file(path), path


def resolve_backend(backend: str, population: int,
                    auto_threshold: int = 100_000) -> str:
  """'memory' or 'sqlite': the backend `make_store` builds for `backend`."""
  if backend not in _BACKENDS:
    raise ValueError(
        f'Unknown client-state backend {backend!r}; expected one of '
        f'{_BACKENDS}.')
  if backend == 'auto':
    return 'sqlite' if population > auto_threshold else 'memory'
  return backend


def missing_store(backend: str, directory: str, population: int,
                  auto_threshold: int = 100_000) -> Optional[str]:
  """What is missing of a store `make_store` would open, or None.

  A store that has committed a round leaves files in `directory`: the SQLite
  database (non-empty), or at least one `client_states_<round>.npz` snapshot.
  Returns the path (or pattern) that should exist but does not, so that a
  resumed run can refuse before opening, and so creating, an empty store.
  """
  backend = resolve_backend(backend, population, auto_threshold)
  if backend == 'sqlite':
    path = os.path.join(directory, SQLITE_FILENAME)
    if not os.path.exists(path) or os.path.getsize(path) == 0:
      return path
    return None
  names = os.listdir(directory) if os.path.isdir(directory) else []
  if not any(_SNAPSHOT_RE.match(n) for n in names):
    return os.path.join(directory, 'client_states_<round>.npz')
  return None


def make_store(backend: str, initial_state_fn: InitialStateFn, *,
               population: int, directory: Optional[str],
               cache_size: int = 0, auto_threshold: int = 100_000,
               template: Optional[Structure] = None,
               keep_snapshots: int = 2) -> ClientStateStore:
  """Builds a client-state store.

  Args:
    backend: 'memory', 'sqlite', or 'auto' (sqlite when
      `population > auto_threshold`, else memory).
    initial_state_fn: deterministic `client_id -> state` for unseen clients.
    population: number of clients.
    directory: where snapshots (memory) or `client_states.sqlite` (sqlite)
      live; required for sqlite, optional for memory (no durability if None).
    cache_size: LRU cache entries (sqlite only).
    auto_threshold: population above which 'auto' picks sqlite.
    template: structure template; see `ClientStateStore`.
    keep_snapshots: the newest snapshots the memory backend keeps (>= 2;
      the SQLite store keeps its last round only).

  Returns:
    The store.

  Raises:
    ValueError: unknown backend, or sqlite without a directory.
  """
  backend = resolve_backend(backend, population, auto_threshold)
  if backend == 'memory':
    return InMemoryClientStateStore(initial_state_fn, directory,
                                    template=template,
                                    keep_snapshots=keep_snapshots)
  if directory is None:
    raise ValueError(
        f'The sqlite client-state backend (population {population}, '
        f'auto_threshold {auto_threshold}) needs a directory.')
  os.makedirs(directory, exist_ok=True)
  return SqliteClientStateStore(
      initial_state_fn, os.path.join(directory, SQLITE_FILENAME),
      cache_size=cache_size, template=template)
