"""The round loop: sample, load client states, next(), save states, metrics, checkpoints.

Crash consistency (kill the program at any moment, `--resume`, and nothing is
lost or duplicated):

1. Round 0: the initial server state is saved as program-state version 0 with
   `tff.program.FileProgramStateManager` (an atomic directory rename), then the
   client-state store commits round 0.
2. Round r: the cohort is sampled from `(seed, r)` alone; its states are loaded
   from the store; the count of rounds started, which the privacy accounting
   reads (a replayed round is noised again), is incremented durably in two
   places, the client-state store's record first, then the run directory's
   `rounds_started.json` (`rounds_started`); `process.next` runs; the
   returned states are saved tagged with round r; metrics are released (CSV
   rows with key >= r are replaced, so a replayed round overwrites, never
   duplicates).
3. Every `checkpoint_every` rounds and at the last round: the server state is
   saved as version r, then the store commits r.
4. `--resume`: the latest server-state version v is loaded (a corrupt one is
   an error, never a silent fresh start), the store rolls back every save
   tagged after v, and the loop continues at round v + 1. Because sampling,
   client shuffling and new-client initial states are pure functions of the
   seed, the round and the client id, the resumed run computes what the
   uninterrupted run computes.

Written by hand: TFF's `tff.program` gives the state manager and release
managers used here, but its program logic has no client-state store.
"""

from __future__ import annotations

import collections
import csv
import dataclasses
import json
import math
import os
import time
import weakref
from typing import Any, Callable, Optional, Sequence

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_personal.core import atomic_io
from tff_personal.core import client_state as client_state_lib
from tff_personal.core import coroutines
from tff_personal.core import fault
from tff_personal.core import privacy
from tff_personal.core import program_state as program_state_lib

# How cohorts are drawn: the schemes the DP accounting covers.
SAMPLING_SCHEMES = privacy.SAMPLING_SCHEMES


class CheckpointError(RuntimeError):
  """A checkpoint exists but cannot be used; nothing was overwritten."""


class NonFiniteRoundError(RuntimeError):
  """Every client of a round produced a non-finite update: training diverged.

  Raised before the round's states are saved or checkpointed; the last
  checkpoint is the round before.
  """


@dataclasses.dataclass(frozen=True)
class LoopConfig:
  rounds: int
  clients_per_round: int
  population: int
  experiment_dir: str
  sampling: str = 'fixed_size'
  seed: int = 0
  checkpoint_every: int = 1
  eval_every: int = 0  # 0: evaluate only after the last round.
  resume: bool = False
  keep_checkpoints: int = 3
  # Whether train_metrics.csv may hold values that depend on the cohort's
  # users without DP noise: the process's training-metric sums and, under
  # Poisson sampling, the cohort size. False (what a DP run does unless
  # --release_unnoised_metrics): each row holds the aggregator's and
  # finalizer's measurements (post-processing of the noised aggregate),
  # `round_seconds` and, under fixed-size sampling, `cohort_size` (always
  # `clients_per_round`, public).
  release_unnoised: bool = True

  def validate(self):
    if self.rounds < 1:
      raise ValueError(f'rounds must be >= 1, got {self.rounds}')
    if self.population < 1:
      raise ValueError(f'population must be >= 1, got {self.population}')
    if not 1 <= self.clients_per_round <= self.population:
      raise ValueError(
          f'clients_per_round must be in [1, population={self.population}], '
          f'got {self.clients_per_round}')
    if self.sampling not in SAMPLING_SCHEMES:
      raise ValueError(f'sampling must be one of {SAMPLING_SCHEMES}, '
                       f'got {self.sampling!r}')
    if self.checkpoint_every < 1:
      raise ValueError(
          f'checkpoint_every must be >= 1, got {self.checkpoint_every}')
    if self.eval_every < 0:
      raise ValueError(f'eval_every must be >= 0, got {self.eval_every}')
    if self.keep_checkpoints < 1:
      raise ValueError(
          f'keep_checkpoints must be >= 1, got {self.keep_checkpoints}')


@dataclasses.dataclass
class LoopResult:
  state: Any
  rounds_completed: int
  rounds_run_here: int
  # Rounds started in the experiment directory over all processes (replays
  # after a kill included): `rounds_started(experiment_dir)` at the end.
  rounds_started: int
  seconds_per_round: Optional[float]  # None: no round ran in this process.
  first_round_seconds: Optional[float]
  train_metrics: dict
  eval_metrics: dict
  resumed_from: Optional[int]


def sample_clients(population: int, clients_per_round: int, round_num: int,
                   seed: int, scheme: str = 'fixed_size') -> np.ndarray:
  """The cohort of a round: a pure function of (seed, round).

  'fixed_size': `clients_per_round` distinct clients, uniformly without
  replacement. 'poisson': every client independently with probability
  `clients_per_round / population` (the cohort size varies; this is the scheme
  that `privacy.compute_epsilon` accounts with add-or-remove-one). A Poisson
  cohort can be empty: `run_training` then leaves the server and client
  states as they are, and the round is still a round (released with
  `cohort_size` 0, checkpointed and accounted).
  """
  rng = np.random.default_rng([seed, round_num, 0x5A3])
  if scheme == 'fixed_size':
    return np.sort(rng.choice(population, clients_per_round, replace=False))
  if scheme == 'poisson':
    q = clients_per_round / population
    return np.flatnonzero(rng.random(population) < q)
  raise ValueError(f'unknown sampling scheme {scheme!r}')


def _flatten(prefix: str, value, out: dict):
  if isinstance(value, dict) or hasattr(value, 'items'):
    for k, v in value.items():
      _flatten(f'{prefix}/{k}' if prefix else str(k), v, out)
  elif isinstance(value, (list, tuple)):
    for i, v in enumerate(value):
      _flatten(f'{prefix}/{i}', v, out)
  else:
    arr = np.asarray(value)
    out[prefix] = arr.item() if arr.size == 1 else arr.tolist()
  return out


def flatten_metrics(metrics) -> dict[str, Any]:
  return _flatten('', metrics, {})


def _fmt_seconds(s: float) -> str:
  if not math.isfinite(s):
    return '?'
  s = int(round(s))
  return f'{s // 3600}h{(s % 3600) // 60:02d}m' if s >= 3600 else (
      f'{s // 60}m{s % 60:02d}s')


def _to_numpy_state(state):
  return tf.nest.map_structure(np.asarray, state)


def _restore(manager, ckpt_dir, versions, store, initial_state):
  """Latest round that both the server checkpoint and the store can restore.

  The server state of round r is saved before the store commits r, so a kill
  in between leaves a server checkpoint the store cannot match (the in-memory
  store only snapshots at commit). Then the previous checkpoint is used, and
  the newer server versions are removed so that the replayed rounds can save
  them again.
  """
  for latest in reversed(versions):
    try:
      program_state = coroutines.run_sync(manager.load(
          latest, {'server_state': initial_state, 'round_num': 0}))
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointError(
          f'checkpoint for round {latest} in {ckpt_dir} cannot be read '
          f'({type(e).__name__}: {e}). Refusing to start fresh; nothing was '
          'changed (the client-state store is untouched). Restore the '
          'checkpoint or start a new --experiment_name.') from e
    if int(program_state['round_num']) != latest:
      raise CheckpointError(
          f'checkpoint directory for round {latest} holds round '
          f'{program_state["round_num"]}; the checkpoint is inconsistent')
    if (not isinstance(store, client_state_lib.InMemoryClientStateStore)
        and latest > 0 and store.committed_round() is None):
      raise CheckpointError(
          f'the client-state store {_store_name(store)} holds no committed '
          f'round, but the server checkpoint of round {latest} in {ckpt_dir} '
          f'needs the client states committed at round {latest}: resuming '
          'would reset every client to its initial state. Restore the store, '
          'or start a new --experiment_name. Nothing was changed.')
    try:
      store.rollback(latest)
    except client_state_lib.SnapshotNotFoundError:
      continue
    except client_state_lib.ClientStateStoreError as e:
      raise CheckpointError(
          f'the client-state store {_store_name(store)} cannot be rolled back '
          f'to the server checkpoint of round {latest} in {ckpt_dir}: {e}. '
          'Nothing was changed.') from e
    for newer in versions:
      if newer > latest:
        tf.io.gfile.rmtree(os.path.join(ckpt_dir, f'program_state_{newer}'))
    return latest, program_state
  raise CheckpointError(
      f'none of the server checkpoints {versions} in {ckpt_dir} has a '
      'matching client-state snapshot; cannot resume without losing client '
      'state. Nothing was changed.')


ROUNDS_STARTED_FILENAME = 'rounds_started.json'
# Where a run directory keeps its client-state store.
STORE_DIRNAME = 'client_states'


# The most rounds a run can count (its round numbers are 32-bit).
_MAX_ROUNDS = 2**31 - 1


def _read_run_record(path: str) -> Optional[int]:
  """The count in the run directory's record, or None if it is missing."""
  if not os.path.exists(path):
    return None
  try:
    with open(path, encoding='utf-8') as f:
      started = json.load(f)['rounds_started']
    if (not isinstance(started, int) or isinstance(started, bool)
        or not 0 <= started <= _MAX_ROUNDS):
      raise ValueError(f'rounds_started is {started!r}, not a count in '
                       f'[0, {_MAX_ROUNDS}]')
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise CheckpointError(
        f'{path} cannot be read ({type(e).__name__}: {e}); it counts the '
        'rounds run so far, which the privacy accounting needs. Nothing was '
        'changed.') from e
  return started


def _store_record(experiment_dir: str, store=None
                  ) -> tuple[Optional[int], str]:
  """The store's count of rounds started and where it is kept: `store`'s,
  else that of the store in `experiment_dir/client_states`, read without
  opening it."""
  if store is not None:
    return store.rounds_started(), store.rounds_started_location()
  return client_state_lib.read_rounds_started(
      os.path.join(experiment_dir, STORE_DIRNAME))


def rounds_started(experiment_dir: str, required: bool = False,
                   store: Optional[client_state_lib.ClientStateStore] = None
                   ) -> Optional[int]:
  """How many rounds `run_training` started in `experiment_dir`, or None.

  Counted over every process that ran the experiment, rounds replayed after
  a kill included. The count is kept in two places, which the loop
  advances before it runs `process.next` for a round: first the
  client-state store's record (`ClientStateStore.record_rounds_started`),
  then the run directory's `rounds_started.json`. So a kill between the two
  writes leaves the store one round ahead, and nothing else can make them
  differ. This returns the larger when they agree or the store leads by
  one, and refuses any other difference: then one of them was lowered or
  replaced (a file restored from elsewhere), and epsilon, which accounts
  every round started, could under-count. A store that keeps no count (no
  store there, or one written before stores kept it) leaves the run
  directory's record alone.

  Args:
    experiment_dir: the directory `run_training` ran in.
    required: raise instead of returning None when the run directory's
      record is missing.
    store: the run's open store (default: read the one in
      `experiment_dir/client_states` without opening it).

  Returns:
    The count, or None when neither place records one (and not
    `required`).

  Raises:
    CheckpointError: a record cannot be read, the two disagree (naming both
      places and both counts), or the run directory's is missing and
      `required` (names the file).
  """
  path = os.path.join(experiment_dir, ROUNDS_STARTED_FILENAME)
  started = _read_run_record(path)
  try:
    stored, where = _store_record(experiment_dir, store)
  except client_state_lib.ClientStateStoreError as e:
    raise CheckpointError(
        'the client-state store\'s record of rounds started cannot be read '
        f'({e}); epsilon accounts it with {path}. Nothing was '
        'changed.') from e
  if started is None:
    if required:
      raise CheckpointError(
          f'{path} is missing: it records the rounds this run started, '
          'replays after a kill included, and epsilon accounts every one of '
          'them; without it the privacy report could under-count. Start a '
          'new --experiment_name. Nothing was changed.')
    return stored
  if stored is None or stored == started:
    return started
  if stored == started + 1:  # Killed between the store's write and ours.
    return stored
  raise CheckpointError(
      f'{path} counts {started} rounds started, but {where} counts '
      f'{stored}: the run\'s privacy record is inconsistent (the store '
      'records a round before the run directory does, so it can lead by one '
      'round after a kill, never otherwise), and epsilon, which accounts '
      'every round started, cannot be trusted from either. Start a new '
      '--experiment_name. Nothing was changed.')


def check_records(experiment_dir: str,
                  versions: Optional[Sequence[int]] = None,
                  store: Optional[client_state_lib.ClientStateStore] = None
                  ) -> Optional[int]:
  """Checks what a resume, an evaluation or an export of `experiment_dir`
  relies on; reads only.

  The newest checkpoint must hold the round its name says (`held_round`),
  and the record of rounds started, which epsilon accounts, must be there,
  readable, consistent between its two places (`rounds_started`) and count
  at least the rounds the run is known to have started: its newest
  checkpoint's round and its newest released training round. A record that
  counted fewer would under-count the rounds noised.

  Args:
    experiment_dir: the directory `run_training` ran in.
    versions: its checkpoint rounds (default: read them).
    store: the run's open store (default: read the one in the directory).

  Returns:
    The rounds started, or None when the directory has no checkpoint.

  Raises:
    CheckpointError: naming the file and the problem; nothing is changed.
  """
  versions = checkpoint_rounds(experiment_dir) if versions is None else (
      sorted(versions))
  if not versions:
    return None
  held_round(experiment_dir, versions[-1])
  started = rounds_started(experiment_dir, required=True, store=store)
  metrics = os.path.join(experiment_dir, 'train_metrics.csv')
  try:
    released = _released_rounds(metrics)
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise CheckpointError(
        f'{metrics} cannot be read ({type(e).__name__}: {e}); its rounds '
        'are checked against the record of rounds started, which epsilon '
        'accounts. Nothing was changed.') from e
  known = max([max(versions, default=0), *released])
  if started < known:
    raise CheckpointError(
        f'{os.path.join(experiment_dir, ROUNDS_STARTED_FILENAME)} counts '
        f'{started} rounds started, but the run has a checkpoint or released '
        f'metrics of round {known}: the run\'s privacy record is '
        'inconsistent, and epsilon would under-count the rounds noised. '
        'Start a new --experiment_name. Nothing was changed.')
  return started


def _record_rounds_started(experiment_dir: str, started: int) -> None:
  write_summary(os.path.join(experiment_dir, ROUNDS_STARTED_FILENAME),
                {'rounds_started': started})


def _record_started(experiment_dir: str, store, started: int) -> None:
  """Records `started` rounds started where a record is behind: the
  store's first, then the run directory's (`rounds_started`)."""
  store.record_rounds_started(started)
  if _read_run_record(os.path.join(experiment_dir,
                                   ROUNDS_STARTED_FILENAME)) != started:
    _record_rounds_started(experiment_dir, started)


def _store_name(store) -> str:
  return getattr(store, 'path', None) or type(store).__name__


def checkpoint_rounds(experiment_dir: str) -> list[int]:
  """Rounds of the server checkpoints `run_training` saved, ascending.

  Read from the directories' names (`program_state_<round>`);
  `completed_round` reads the newest one's round from its contents.
  """
  ckpt_dir = os.path.join(experiment_dir, 'checkpoints')
  if not os.path.isdir(ckpt_dir):
    return []
  return sorted(coroutines.run_sync(
      program_state_lib.FileProgramStateManager(ckpt_dir).get_versions()) or [])


# Where a checkpoint keeps the saved program state's 'round_num'.
_ROUND_VARIABLE = program_state_lib.stored_name('round_num')


def held_round(experiment_dir: str, version: int) -> int:
  """The round that checkpoint `version` holds, read from its contents.

  Reads one scalar of the checkpoint (not the server state). Raises
  `CheckpointError` naming the directory when it cannot be read or holds
  another round than its name says (a copied or renamed directory).
  """
  directory = os.path.join(experiment_dir, 'checkpoints',
                           f'program_state_{version}')
  try:
    reader = tf.train.load_checkpoint(
        os.path.join(directory, 'variables', 'variables'))
    held = int(reader.get_tensor(_ROUND_VARIABLE))
  except (tf.errors.OpError, ValueError, TypeError) as e:
    raise CheckpointError(
        f'checkpoint {directory} cannot be read ({type(e).__name__}: '
        f'{str(e).splitlines()[0] if str(e) else ""}). Nothing was '
        'changed.') from e
  if held != version:
    raise CheckpointError(
        f'checkpoint {directory} holds round {held}, not {version}: the '
        'directory was copied or renamed. Remove it (or restore the '
        'original) to resume. Nothing was changed.')
  return held


def completed_round(experiment_dir: str) -> Optional[int]:
  """The round of the newest server checkpoint, read from its contents.

  None without checkpoints. Raises `CheckpointError` as `held_round` does.
  """
  rounds = checkpoint_rounds(experiment_dir)
  return held_round(experiment_dir, rounds[-1]) if rounds else None


# What `load_checkpoint` read: the structure template of each process
# (its initial state) and the last checkpoints' server states, keyed by the
# checkpoint files' paths, sizes, inodes and modification times and the
# structure read. A rewritten checkpoint (resuming replaces the rounds
# newer than the client-state store) has other files, so it is read again.
_TEMPLATES = weakref.WeakKeyDictionary()
_LOADED = collections.OrderedDict()
_LOADED_MAX = 16
_LOADED_BYTES = 64 << 20  # At most this much of server states is kept.


def _nbytes(state) -> int:
  return sum(np.asarray(x).nbytes for x in tf.nest.flatten(state))


def _files_key(directory: str) -> tuple:
  out = []
  for d, _, names in os.walk(directory):
    for name in names:
      st = os.stat(os.path.join(d, name))
      out.append((os.path.join(d, name), st.st_size, st.st_ino,
                  st.st_mtime_ns))
  return tuple(sorted(out))


def _template(process):
  try:
    template = _TEMPLATES.get(process)
  except TypeError:  # Not weakly referenceable: no reuse.
    return process.initialize()
  if template is None:
    template = process.initialize()
    if _nbytes(template) <= _LOADED_BYTES:
      _TEMPLATES[process] = template
  return template


def _copied(state):
  return tf.nest.map_structure(
      lambda x: x.copy() if isinstance(x, np.ndarray) else x, state)


def load_checkpoint(process, experiment_dir: str, round_num: int):
  """The server state checkpointed at `round_num`, read only.

  A checkpoint read before, unchanged on disk, is not read again (the
  last few are kept in memory; each call returns its own copy).

  Raises `CheckpointError` naming the directory when there is no checkpoint
  of that round or it cannot be read; nothing is written or removed (unlike
  resuming, which drops checkpoints newer than the client-state store).
  """
  ckpt_dir = os.path.join(experiment_dir, 'checkpoints')
  manager = program_state_lib.FileProgramStateManager(ckpt_dir)
  versions = coroutines.run_sync(manager.get_versions()) or []
  if round_num not in versions:
    raise CheckpointError(
        f'{ckpt_dir} has no checkpoint of round {round_num} (has '
        f'{sorted(versions) or "none"})')
  template = {'server_state': _template(process), 'round_num': 0}
  key = (_files_key(os.path.join(ckpt_dir, f'program_state_{round_num}')),
         repr(tf.nest.map_structure(
             lambda x: (np.shape(x), np.asarray(x).dtype.str), template)))
  if key in _LOADED:
    _LOADED.move_to_end(key)
    return _copied(_LOADED[key])
  try:
    program_state = coroutines.run_sync(manager.load(round_num, template))
  except Exception as e:  # pylint: disable=broad-except
    raise CheckpointError(
        f'checkpoint for round {round_num} in {ckpt_dir} cannot be read '
        f'({type(e).__name__}: {e})') from e
  if int(program_state['round_num']) != round_num:
    raise CheckpointError(
        f'checkpoint directory for round {round_num} holds round '
        f'{program_state["round_num"]}; the checkpoint is inconsistent')
  state = program_state['server_state']
  if _nbytes(state) > _LOADED_BYTES:
    return state  # Not kept, so not copied.
  _LOADED[key] = state
  while len(_LOADED) > _LOADED_MAX or sum(
      _nbytes(s) for s in _LOADED.values()) > _LOADED_BYTES:
    _LOADED.popitem(last=False)
  return _copied(state)


def run_training(
    process,
    *,
    store: client_state_lib.ClientStateStore,
    train_data_fn: Callable[[Sequence[int], int], list],
    config: LoopConfig,
    eval_fn: Optional[Callable[[Any, int], dict]] = None,
    log_fn: Callable[[str], None] = print,
    initial_state: Any = None,
) -> LoopResult:
  """Drives a `StatefulClientProcess` for `config.rounds` rounds.

  Args:
    process: a `StatefulClientProcess`.
    store: the client-state store (owned by the caller, not closed here).
    train_data_fn: `(client_ids, round_num) -> list of tf.data.Dataset`; must
      be deterministic in its arguments for exact resumption.
    config: the loop configuration.
    eval_fn: `(server_state, round_num) -> dict` of evaluation metrics.
    log_fn: receives the one-line progress reports.
    initial_state: the server state of round 0 (default
      `process.initialize()`), e.g. a multi-stage algorithm's hand-off
      from its previous stage (`core/stages.py`); a resumed run reads it
      from its checkpoint instead.

  Returns:
    A `LoopResult`.
  """
  config.validate()
  ckpt_dir = os.path.join(config.experiment_dir, 'checkpoints')
  manager = program_state_lib.FileProgramStateManager(
      ckpt_dir, keep_total=config.keep_checkpoints, keep_first=False)
  train_release = tff.program.CSVFileReleaseManager(
      os.path.join(config.experiment_dir, 'train_metrics.csv'),
      key_fieldname='round')
  eval_release = tff.program.CSVFileReleaseManager(
      os.path.join(config.experiment_dir, 'eval_metrics.csv'),
      key_fieldname='round')
  tb_release = []  # Made at the first release: a refused resume writes none.

  def release(value, round_num, csv_manager):
    if not tb_release:
      tb_release.append(tff.program.TensorBoardReleaseManager(
          os.path.join(config.experiment_dir, 'tensorboard')))

    async def _release():
      await csv_manager.release(value, round_num)
      await tb_release[0].release(value, round_num)
    coroutines.run_sync(_release())

  versions = coroutines.run_sync(manager.get_versions())
  if initial_state is None:
    # A resumed run reads its state; the template only gives its structure
    # (the one `load_checkpoint` keeps, so a process initializes once).
    initial_state = (_template(process) if versions else
                     process.initialize())
  resumed_from = None
  if versions:
    if not config.resume:
      raise CheckpointError(
          f'{ckpt_dir} already holds checkpoints (rounds {versions}); pass '
          '--resume to continue that run, or choose a new --experiment_name. '
          'Nothing was changed.')
    check_records(config.experiment_dir, versions, store=store)
    latest, program_state = _restore(
        manager, ckpt_dir, versions, store, initial_state)
    state = program_state['server_state']
    start = latest + 1
    resumed_from = latest
    log_fn(f'resumed from round {latest} checkpoint in {ckpt_dir}')
  else:
    state = initial_state
    if store.num_saved():  # states of a run killed before its first checkpoint
      store.rollback(0)
    # The record exists before any checkpoint does: a directory with
    # checkpoints and no record has lost it (`check_records`).
    _record_started(config.experiment_dir, store, rounds_started(
        config.experiment_dir, store=store) or 0)
    coroutines.run_sync(manager.save(
        {'server_state': _to_numpy_state(state), 'round_num': 0}, 0))
    store.commit(0)
    start = 1

  def is_eval_round(round_num):
    return round_num == config.rounds or bool(
        config.eval_every and round_num % config.eval_every == 0)

  eval_metrics: dict = {}
  eval_csv = os.path.join(config.experiment_dir, 'eval_metrics.csv')
  if (eval_fn is not None and resumed_from and is_eval_round(resumed_from)
      and resumed_from not in _released_rounds(eval_csv)):
    # Killed after the checkpoint, before the evaluation was released.
    log_fn(f'round {resumed_from}: evaluating again (its evaluation was not '
           'released before the run stopped)')
    eval_metrics = _evaluate_and_release(
        eval_fn, state, resumed_from, lambda v, r: release(v, r, eval_release))
  started = rounds_started(config.experiment_dir, required=True, store=store)
  # A kill between the two records' writes left the store's ahead.
  _record_started(config.experiment_dir, store, started)
  round_times = []
  train_metrics: dict = {}
  first_round_seconds = None
  for round_num in range(start, config.rounds + 1):
    t0 = time.perf_counter()
    cohort = sample_clients(config.population, config.clients_per_round,
                            round_num, config.seed, config.sampling)
    cohort_ids = [int(c) for c in cohort]
    started += 1  # Recorded before the round's aggregate exists: in the
    # store first, then in the run directory (`rounds_started`).
    store.record_rounds_started(started)
    _record_rounds_started(config.experiment_dir, started)
    if cohort_ids:
      client_states = store.load(cohort_ids)
      datasets = train_data_fn(cohort_ids, round_num)
      state, new_client_states, metrics = process.next(
          state, client_states, datasets)
      nonfinite = flatten_metrics(metrics).get('train/nonfinite') or 0
      if nonfinite >= len(cohort_ids):
        raise NonFiniteRoundError(
            f'round {round_num}: all {len(cohort_ids)} clients of the cohort '
            'produced non-finite updates (loss or weights overflowed), so '
            'nothing was learned: training diverged. Nothing of this round '
            'was saved; the last checkpoint is of an earlier round. Lower the '
            'learning rates or check the data.')
      store.save(cohort_ids,
                 [_to_numpy_state(s) for s in new_client_states], round_num)
      fault.point('mid_round')
    else:  # Poisson sampling drew nobody: nothing trains, the round counts.
      metrics = {}
    elapsed = time.perf_counter() - t0
    if round_num == start:
      first_round_seconds = elapsed
    round_times.append(elapsed)
    train_metrics = flatten_metrics(metrics)
    if not config.release_unnoised:  # Only what the DP aggregate covers.
      train_metrics = {k: v for k, v in train_metrics.items()
                       if not k.startswith('train/')}
    if config.release_unnoised or config.sampling == 'fixed_size':
      train_metrics['cohort_size'] = len(cohort_ids)
    train_metrics['round_seconds'] = elapsed
    release(train_metrics, round_num, train_release)

    last = round_num == config.rounds
    if last or round_num % config.checkpoint_every == 0:
      with fault.during('mid_checkpoint', tf.io.gfile, 'rename'):
        coroutines.run_sync(manager.save(
            {'server_state': _to_numpy_state(state), 'round_num': round_num},
            round_num))
      fault.point('after_checkpoint')
      store.commit(round_num)

    steady = round_times[1:] or round_times
    per_round = float(np.mean(steady))
    eta = per_round * (config.rounds - round_num)
    loss = train_metrics.get('train/loss', float('nan'))
    if config.release_unnoised:
      line = (f'round {round_num}/{config.rounds} | cohort {len(cohort_ids)} | '
              + (f'train loss {loss:.4f}' if cohort_ids else
                 'empty cohort, server state unchanged'))
    else:  # Neither the loss nor a Poisson cohort's size is noised.
      line = (f'round {round_num}/{config.rounds} | DP aggregate only' +
              (f' | cohort {len(cohort_ids)}'
               if config.sampling == 'fixed_size' else ''))
    if 'train/accuracy' in train_metrics:
      line += f' acc {train_metrics["train/accuracy"]:.3f}'
    if train_metrics.get('train/nonfinite'):
      line += f' | {train_metrics["train/nonfinite"]} non-finite clients left out'
    line += (f' | {1.0 / per_round:.2f} rounds/s | ETA {_fmt_seconds(eta)}')

    if eval_fn is not None and is_eval_round(round_num):
      eval_metrics = _evaluate_and_release(
          eval_fn, state, round_num,
          lambda v, r: release(v, r, eval_release))
      flat_eval = flatten_metrics(eval_metrics)
      shown = ', '.join(f'{k} {v:.4f}' for k, v in flat_eval.items()
                        if k in ('f1', 'accuracy', 'auc', 'perplexity'))
      line += f' | eval {shown}'
    log_fn(line)

  rounds_run = len(round_times)
  steady = round_times[1:] or round_times
  if rounds_run == 0:  # Resumed at the last round: what it released.
    train_metrics = _released_row(
        os.path.join(config.experiment_dir, 'train_metrics.csv'),
        config.rounds)
    if eval_fn is not None and not eval_metrics:
      eval_metrics = eval_fn(state, config.rounds)
  return LoopResult(
      state=state,
      rounds_completed=config.rounds,
      rounds_run_here=rounds_run,
      rounds_started=started,
      seconds_per_round=float(np.mean(steady)) if steady else None,
      first_round_seconds=first_round_seconds,
      train_metrics=train_metrics,
      eval_metrics=eval_metrics,
      resumed_from=resumed_from)


def _evaluate_and_release(eval_fn, state, round_num, release_fn) -> dict:
  """Runs `eval_fn` at `round_num`, releases its numbers, returns them all."""
  eval_metrics = eval_fn(state, round_num)
  fault.point('mid_evaluation')
  flat_eval = {k: v for k, v in flatten_metrics(eval_metrics).items()
               if isinstance(v, (int, float))}
  release_fn(flat_eval, round_num)
  return eval_metrics


def _read_csv(path: str) -> list[dict]:
  if not os.path.exists(path):
    return []
  with open(path, newline='', encoding='utf-8') as f:
    return list(csv.DictReader(f))


def _released_rounds(path: str) -> set[int]:
  """Rounds with a row in a metrics CSV written by the release managers."""
  return {int(row['round']) for row in _read_csv(path)}


def read_metrics(path: str) -> list[dict]:
  """The rows of a metrics CSV the run released (train_metrics.csv,
  eval_metrics.csv), each a dict of its non-empty values with numbers as
  numbers, `round` included; [] if the file does not exist."""
  return [{k: _number(v) for k, v in row.items() if v not in (None, '')}
          for row in _read_csv(path)]


def _released_row(path: str, round_num: int) -> dict:
  """The values of round `round_num`'s row of a metrics CSV ({} if none)."""
  for row in read_metrics(path):
    if row['round'] == round_num:
      return {k: v for k, v in row.items() if k != 'round'}
  return {}


def _number(text: str):
  for convert in (int, float):
    try:
      return convert(text)
    except ValueError:
      pass
  return text


def strict_json_value(value):
  """`value` as strict JSON data: numpy as Python, NaN and infinities None."""
  if isinstance(value, (np.generic, np.ndarray)):
    value = value.tolist()
  if isinstance(value, float):
    return value if math.isfinite(value) else None
  if isinstance(value, dict) or hasattr(value, 'items'):
    return {k: strict_json_value(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [strict_json_value(v) for v in value]
  return value


def write_summary(path: str, summary: dict) -> None:
  """Writes a JSON record atomically (temp file + rename).

  The file is strict JSON: non-finite numbers are written as null.
  """
  with atomic_io.atomic_write(path) as f:
    json.dump(strict_json_value(summary), f, indent=2, sort_keys=True,
              default=_json_default, allow_nan=False)


def _json_default(o):
  if isinstance(o, np.generic):
    return o.item()
  if isinstance(o, np.ndarray):
    return o.tolist()
  return str(o)
