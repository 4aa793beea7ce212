r"""Trains and evaluates one personalized-FL experiment.

  python -m binaries.train --task=mnist_preference --algorithm=global_plus \
    --data_dir=../shared/data/mnist --num_users=1000 --rounds=5 \
    --clients_per_round=20 --root_output_dir=/tmp/out --experiment_name=smoke

Writes <root_output_dir>/<experiment_name>/{summary.json, run_config.json,
train_metrics.csv, eval_metrics.csv, rounds_started.json, tensorboard/,
checkpoints/, client_states/, experiment.lock}. Kill it at any moment and
rerun with --resume: it continues from the last checkpoint. While it runs it
holds experiment.lock (tff_personal/records/run_lock.py): a second training or
evaluation of the same directory exits with code 3, naming its PID.

With --workers=host:port,... (services started by `python -m binaries.worker
--port=N`), each round's clients are split across those workers.

  python -m binaries.train --list

prints which algorithms run on which task (and, for the others, what the
task lacks), each algorithm's options and each task's options.
"""

import sys

from absl import app
from absl import flags

from binaries import common

FLAGS = flags.FLAGS
common.define_flags()
flags.DEFINE_bool('list', False, 'Print the algorithm x task matrix and '
                  'every algorithm\'s and task\'s options, then exit.')


def main(argv):
  if FLAGS.list:  # With an outside --task or --algorithm, listed too.
    outside = lambda name: [name] if ':' in name else []
    try:
      print(common.listing(tasks=outside(FLAGS.task),
                           algorithms=outside(FLAGS.algorithm)))
    except ValueError as e:
      print(f'error: {e}', file=sys.stderr)
      return 2
    return 0
  return common.main(
      argv, FLAGS, lambda config, task_kwargs: common.run(
          config, task_kwargs, FLAGS))


if __name__ == '__main__':
  app.run(main)
