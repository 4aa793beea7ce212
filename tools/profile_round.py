r"""Where a training round's time goes: the client work's ops, by type.

Runs an algorithm on a task for a few rounds in one shard (as each shard
of a sharded run), sharded or batched, and profiles the rounds
after the first (which traces) with TensorFlow's profiler. Prints the
round's wall time split into the shard's client work and the rest (the
TFF aggregation and server step, packing users, the client-state store),
then the client work's op types by self time.

  python -m tools.profile_round --task=label_skew_mnist \
      --algorithm=ditto --data_dir=../shared/data/mnist --clients=5 \
      --form=batched

Self times are summed over the threads that ran the ops (a shard's ops
run on its inter-op threads, one thread per op), and an op nested in
another (a function call's body) counts only in itself; the op types are
TensorFlow's (`BatchMatMulV2`, `ExtractImagePatches`, ...).
"""

from __future__ import annotations

import os
import tempfile
import time

from absl import app
from absl import flags
import numpy as np
import tensorflow as tf

from tasks import registry as task_registry
from tff_personal.config import experiment
from tff_personal.core import client_state
from tff_personal.core import runtime
from tff_personal.core import sharded
from tff_personal.core import stages as stages_lib

_TASK = flags.DEFINE_string('task', 'label_skew_mnist', 'Task name.')
_ALGORITHM = flags.DEFINE_string('algorithm', 'ditto',
                                 'Algorithm name (a single-stage one).')
_DATA_DIR = flags.DEFINE_string('data_dir', None, 'The task\'s data.')
_TASK_OPTIONS = flags.DEFINE_list('task_options', [],
                                  'key=value task arguments (integers or strings).')
_CLIENTS = flags.DEFINE_integer('clients', 5, 'Users in the shard.')
_FORM = flags.DEFINE_enum('form', 'batched', ['batched', 'sharded'],
                          'How the shard trains its users.')
_ROUNDS = flags.DEFINE_integer('rounds', 4, 'Rounds; all but the first '
                               'are profiled.')
_BATCH_USERS = flags.DEFINE_integer('batch_users', 0,
                                    'Batched: users trained together '
                                    '(0: all).')
_TOP = flags.DEFINE_integer('top', 12, 'Op types to print.')
_BY_NAME = flags.DEFINE_bool('by_name', False,
                             'Group by op name instead of op type.')


def _op_stats(logdir: str, by_name: bool = False
              ) -> list[tuple[str, float]]:
  """(op type, self-time microseconds) of the TensorFlow ops in the
  profile in `logdir`, summed over threads; an op's self time excludes
  ops nested in it (a function call's body)."""
  # pylint: disable=g-import-not-at-top
  from tensorflow.core.profiler.protobuf import xplane_pb2
  # pylint: enable=g-import-not-at-top
  by_type = {}
  for d, _, files in os.walk(logdir):
    for name in files:
      if not name.endswith('.xplane.pb'):
        continue
      space = xplane_pb2.XSpace()
      with open(os.path.join(d, name), 'rb') as f:
        space.ParseFromString(f.read())
      for plane in space.planes:
        if not plane.name.startswith('/host'):
          continue
        # A TF op's event is named `name:Type` with display name `Type`.
        types = {k: (m.name if by_name else m.display_name)
                 for k, m in plane.event_metadata.items()
                 if m.display_name and m.name.endswith(':' + m.display_name)}
        for line in plane.lines:
          events = sorted(((e.offset_ps, e.duration_ps, types[e.metadata_id])
                           for e in line.events
                           if e.metadata_id in types), key=lambda e: (
                               e[0], -e[1]))
          stack = []  # [end, type, self time] of the enclosing ops.
          for start, duration, op in events:
            while stack and stack[-1][0] <= start:
              _, t, own = stack.pop()
              by_type[t] = by_type.get(t, 0.0) + own / 1e6
            if stack:
              stack[-1][2] -= duration
            stack.append([start + duration, op, duration])
          for _, t, own in stack:
            by_type[t] = by_type.get(t, 0.0) + own / 1e6
  return sorted(by_type.items(), key=lambda kv: -kv[1])


def main(argv):
  del argv
  options = {}
  for item in _TASK_OPTIONS.value:
    key, value = item.split('=', 1)
    options[key] = int(value) if value.lstrip('-').isdigit() else value
  config = experiment.ExperimentConfig(
      algorithm=_ALGORITHM.value, clients_per_round=_CLIENTS.value,
      rounds=_ROUNDS.value, root_output_dir=tempfile.mkdtemp(),
      experiment_name='profile')
  with runtime.local_runtime():
    task = task_registry.build_task(_TASK.value, data_dir=_DATA_DIR.value,
                                    **options)
    proc = experiment.build_process(task, config)
    if isinstance(proc, stages_lib.Staged):
      raise app.UsageError(f'{_ALGORITHM.value} is staged; profile the '
                           'algorithm of the stage (e.g. global)')
    batched = _FORM.value == 'batched'
    train = sharded.ShardedProcess(
        proc, 1, batched=batched,
        batch_users=(_BATCH_USERS.value or None) if batched else None)
    store = client_state.make_store(
        'memory', experiment.initial_client_state_fn(proc, config),
        population=task.population, directory=None)
    work = train._driver_work  # pylint: disable=protected-access
    work_seconds = []
    plain_call = work.__call__

    def timed(calls, lanes=None):
      t = time.perf_counter()
      out = plain_call(calls, lanes)
      work_seconds.append(time.perf_counter() - t)
      return out

    train._driver_work = timed  # pylint: disable=protected-access
    state = train.initialize()
    rng = np.random.default_rng(0)
    logdir = tempfile.mkdtemp(prefix='profile_round_')
    round_seconds = []
    for r in range(1, _ROUNDS.value + 1):
      ids = [int(i) for i in rng.choice(task.population, _CLIENTS.value,
                                        replace=False)]
      # As the sharded run reads them (`training._training_parts`).
      batches = (task.train_batches(ids, r) if hasattr(task, 'train_batches')
                 else task.train_datasets(ids, r))
      if r == 2:
        tf.profiler.experimental.start(logdir)
      t = time.perf_counter()
      state, new_states, _ = train.next(state, store.load(ids), batches)
      store.save(ids, [tf.nest.map_structure(np.asarray, s)
                       for s in new_states], r)
      round_seconds.append(time.perf_counter() - t)
    tf.profiler.experimental.stop()
    store.close()
  steady = round_seconds[1:]
  work_steady = work_seconds[1:]
  print(f'{_ALGORITHM.value} on {_TASK.value}, {_CLIENTS.value} users in one '
        f'shard, {_FORM.value}; rounds 2-{_ROUNDS.value} (profiled):')
  print(f'  round {np.median(steady):.3f} s (median); the shard\'s client '
        f'work {np.median(work_steady):.3f} s, the rest '
        f'{np.median(steady) - np.median(work_steady):.3f} s')
  stats = _op_stats(logdir, _BY_NAME.value)
  total = sum(t for _, t in stats)
  print('  client work by op type (self time, share of all ops):')
  for op, t in stats[:_TOP.value]:
    print(f'    {op[-60:]:60s} {t / 1e3:9.1f} ms  {t / total:6.1%}')


if __name__ == '__main__':
  app.run(main)
