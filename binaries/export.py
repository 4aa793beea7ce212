r"""Exports a run for devices, as TF SavedModels, from the run's own record.

  python -m binaries.export --run_dir=<root_output_dir>/<experiment_name> \
    --export_dir=/tmp/export [--export_clients=0,1,2] [--allow_unfinished]

Reads the run directory (run_config.json: the run's task and every
training setting; the server checkpoint of the last round and the clients'
private states committed with it; the record of rounds started, for
epsilon) and writes to --export_dir: `device/` (the device program of a
round, serving signature `local_update`: it trains once and returns the
upload, the round's clipped `MapReduceForm.work` output under DP and all
that may leave the device, and the new client state to keep; with
`broadcast.npz`, what the server sends for the next round),
`personalized/<client id>/` (each client's personalized model, serving
signature `predict`) and `export.json` (the run's digest, rounds, privacy
and the signatures' names: tff_personal/run/export.py; docs/production.md).
Loading them needs TensorFlow only; both convert to TensorFlow Lite with
Select TF ops (docs/production.md).

The run may instead be named by --root_output_dir and --experiment_name,
or stated by --spec (a run_spec.RunSpec JSON file, e.g. the run's own
`runs.Run.open(directory).spec.to_dict()`), whose training settings must be
the run's. A training flag (the task's, the algorithm's, the rounds, cohort,
sampling, seed, store and privacy flags) may be given only with the run's
own value, which is checked; any other flag of binaries.train cannot change
an export and is refused as unknown. --data_dir and
--noverify_data_checksums say where and how to read the run's data.

An unfinished run (killed, or resumed and not yet done) is refused unless
--allow_unfinished, which exports its newest checkpoint and is recorded in
export.json.

Exit codes: 2 for flags (unknown, or disagreeing with the run) or a run that
has not finished; 3 for a missing or unreadable checkpoint, client state or
record of rounds started (its two places disagreeing included), or a run
directory in use.
"""

import os
import sys

from absl import app
from absl import flags
from absl import logging
import tensorflow as tf

from binaries import common
from tasks import mnist_io
from tasks import registry as task_registry
from tff_personal.config import run_spec
from tff_personal.core import atomic_io
from tff_personal.core import runtime
from tff_personal.records import run_lock
from tff_personal.records import run_records
from tff_personal.run import export
from tff_personal.run import runs

FLAGS = flags.FLAGS
common.define_flags()
flags.DEFINE_string('export_dir', None, 'Where to write (must not exist).')
flags.DEFINE_list('export_clients', ['0', '1', '2'],
                  'Client ids whose personalized models to export.')
flags.DEFINE_bool('allow_unfinished', False,
                  'Export an unfinished run\'s newest checkpoint (recorded '
                  'in export.json) instead of refusing it.')
if 'run_dir' not in FLAGS:  # binaries.evaluate defines it too.
  flags.DEFINE_string('run_dir', None,
                      'A run\'s directory: export it from its own record.',
                      allow_override=True)

# Where the run is, and how to read its data: free.
_LOCATION_FLAGS = ('root_output_dir', 'experiment_name', 'data_dir',
                   'verify_data_checksums', 'use_gpu')
# The run's training settings: given, each must be the run's.
_TRAINING = ('rounds', 'clients_per_round', 'sampling', 'seed',
             'client_state_backend', 'train_metrics')


def training_flags() -> tuple[str, ...]:
  """The training flags an export checks against the run's record."""
  groups = common.FLAG_GROUPS
  return tuple(name for name in (groups['task'] + groups['algorithm'] +
                                 groups['privacy'] + list(_TRAINING))
               if name not in _LOCATION_FLAGS)


def unknown_flags() -> tuple[str, ...]:
  """The flags of binaries.train that cannot change an export."""
  known = set(training_flags()) | set(_LOCATION_FLAGS)
  return tuple(name for names in common.FLAG_GROUPS.values()
               for name in names if name not in known)


def _given(name: str) -> bool:
  return name in FLAGS and not FLAGS[name].using_default_value


def _recorded(run: runs.Run, name: str):
  """What the run recorded for training flag `name` (KeyError: nothing)."""
  if name == 'rounds':  # Resuming may extend a run: the rounds it ran.
    return (run.summary or {}).get('rounds_completed', run.config.rounds)
  recorded = run.record.get('flags') or {}
  if name in recorded:
    return recorded[name]
  built = run.record.get('task') or {}
  dp = dict(run.record.get('config', {}).get('dp') or {}, dp=(
      run.record.get('config', {}).get('dp') or {}).get('mechanism'))
  for source in ({'task': built.get('name')}, built.get('arguments') or {},
                 run.record.get('config', {}), dp):
    if name in source:
      return source[name]
  raise KeyError(name)


def check_flags(run: runs.Run) -> None:
  """Refuses a training flag whose value is not the run's (ValueError
  naming each, with the run's value)."""
  wrong = []
  for name in training_flags():
    if not _given(name):
      continue
    try:
      want = _recorded(run, name)
    except KeyError:
      wrong.append(f'--{name} (the run\'s record holds no value to check it '
                   'against)')
      continue
    got = FLAGS[name].value
    if run_records.as_json(got) != run_records.as_json(want):
      wrong.append(f'--{name}={got!r}, the run\'s is {want!r}')
  if wrong:
    raise ValueError(
        f'{os.path.join(run.directory, run_records.RUN_CONFIG_FILENAME)}: '
        + '; '.join(wrong) + '. An export takes every training setting from '
        'the run; drop the flag or give the run\'s value')


def _spec_run() -> runs.Run:
  """The run --spec states, refused (ValueError) when a training setting
  of the spec is not the run's, or a training flag is given beside it."""
  beside = [name for name in training_flags() if _given(name)]
  if beside:
    raise ValueError(f'--spec={FLAGS.spec} states the run; ' + ', '.join(
        f'--{n}' for n in beside) + ' given beside it')
  spec = run_spec.RunSpec.from_dict(atomic_io.read_json(FLAGS.spec))
  run = runs.Run.open(spec.config().experiment_dir)
  stated, recorded = spec.to_dict(), run.spec.to_dict()
  for values in (stated, recorded):  # Not training settings.
    for section in ('evaluation', 'simulation', 'output'):
      values.pop(section, None)
  lines = run_records.differences(recorded, stated,
                                  ignore=run_records.RESUMABLE_FIELDS)
  if lines:
    raise ValueError(
        f'--spec={FLAGS.spec} is not the run in {run.directory}: ' +
        '; '.join(lines) + '. An export takes every training setting from '
        'the run (its own spec: runs.Run.open(directory).spec.to_dict())')
  return run


def _open_run() -> tuple[runs.Run, object]:
  """The run the flags name and its task (ValueError for bad flags)."""
  unknown = [name for name in unknown_flags() if _given(name)]
  if unknown:
    raise ValueError(
        ', '.join(f'--{n}' for n in unknown) + ': unknown to binaries.export '
        '(it cannot change an export, which reads the run\'s record); drop '
        'it')
  if not FLAGS.export_dir:
    raise ValueError('--export_dir is required')
  if (bool(FLAGS.run_dir) + _given('spec') +
      (_given('root_output_dir') or _given('experiment_name'))) > 1:
    raise ValueError('give --run_dir, --spec, or --root_output_dir and '
                     '--experiment_name, not two of them')
  if _given('spec'):
    run = _spec_run()
  else:
    run = runs.Run.open(FLAGS.run_dir or os.path.join(
        FLAGS.root_output_dir, FLAGS.experiment_name))
    check_flags(run)
  run_dir = run.directory
  built = run.record.get('task')
  if not built:
    raise ValueError(f'{run_dir}: the run\'s task was not built by name, so '
                     'binaries.export cannot rebuild it; export it from '
                     'Python with export.export_run(task, run.config, ...)')
  arguments = dict(built['arguments'])
  if _given('data_dir'):
    arguments['data_dir'] = FLAGS.data_dir
  mnist_io.set_verify_checksums(FLAGS.verify_data_checksums)
  return run, task_registry.build_task(built['name'], **arguments)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if not FLAGS.use_gpu:
    tf.config.set_visible_devices([], 'GPU')
  if not FLAGS['verbosity'].present:  # SavedModel writes log every file.
    logging.set_verbosity(logging.WARNING)
  try:
    run, task = _open_run()
    clients = [int(c) for c in FLAGS.export_clients]
  except ValueError as e:  # Flags, the run's record, or the task's data.
    print(f'error: {e}', file=sys.stderr)
    return 2
  try:
    with run_lock.hold(run.directory, create=False), (
        runtime.local_runtime()):
      export.export_run(task, run.config, FLAGS.export_dir, clients,
                        allow_unfinished=FLAGS.allow_unfinished)
  except common.STATE_ERRORS as e:
    if not common.state_failure(e):
      raise
    return 3
  except ValueError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  print(f'written: {FLAGS.export_dir}')
  return 0


def _parse_flags(argv):
  """absl's parsing, but an unknown flag is one `error:` line, exit 2."""
  try:
    return FLAGS(argv)
  except flags.Error as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)


if __name__ == '__main__':
  app.run(main, flags_parser=_parse_flags)
