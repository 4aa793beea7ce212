r"""Exports a finished run for devices, as TF SavedModels.

  python -m binaries.export <the run's binaries.train flags> \
    --export_dir=/tmp/export [--export_clients=0,1,2]

Reads <root_output_dir>/<experiment_name>/ (the server checkpoint of the
last round and the clients' private states committed with it) and writes
to --export_dir: `device/` (the device's part of a round:
`local_update(...)`), `personalized/<client id>/` (each client's
personalized model: `predict(x)`) and `export.json`
(tff_personal/export.py; docs/production.md). Loading them needs
TensorFlow only. Exit codes as binaries.evaluate's: 2 for flags, 3 for a
missing or unreadable checkpoint or client state.
"""

import sys

from absl import app
from absl import flags
from absl import logging
import tensorflow as tf

from binaries import common
from tasks import mnist_io
from tasks import registry as task_registry
from tff_personal import experiment
from tff_personal import export
from tff_personal import run_lock
from tff_personal.core import runtime

FLAGS = flags.FLAGS
common.define_flags()
flags.DEFINE_string('export_dir', None, 'Where to write (must not exist).')
flags.DEFINE_list('export_clients', ['0', '1', '2'],
                  'Client ids whose personalized models to export.')


def _export(config, task_kwargs) -> int:
  if not FLAGS.use_gpu:
    tf.config.set_visible_devices([], 'GPU')
  if not FLAGS['verbosity'].present:  # SavedModel writes log every file.
    logging.set_verbosity(logging.WARNING)
  try:
    if not FLAGS.export_dir:
      raise ValueError('--export_dir is required')
    clients = [int(c) for c in FLAGS.export_clients]
    mnist_io.set_verify_checksums(FLAGS.verify_data_checksums)
    task = task_registry.build_task(FLAGS.task, **task_kwargs)
    experiment.validate(config, task.population)
  except ValueError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  try:
    with run_lock.hold(config.experiment_dir, create=False), (
        runtime.local_runtime()):
      export.export_run(task, config, FLAGS.export_dir, clients,
                        getattr(task, 'batch_size', None) or FLAGS.batch_size)
  except common.STATE_ERRORS as e:
    if not common.state_failure(e):
      raise
    return 3
  except ValueError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  print(f'written: {FLAGS.export_dir}')
  return 0


def main(argv):
  return common.main(argv, FLAGS, _export)


if __name__ == '__main__':
  app.run(main)
