r"""Trains and evaluates one personalized-FL experiment.

  python -m binaries.train --task=mnist_preference --algorithm=global_plus \
    --data_dir=../shared/data/mnist --num_users=1000 --rounds=5 \
    --clients_per_round=20 --root_output_dir=/tmp/out --experiment_name=smoke

Writes <root_output_dir>/<experiment_name>/{summary.json, train_metrics.csv,
eval_metrics.csv, tensorboard/, checkpoints/, client_states/}. Kill it at any
moment and rerun with --resume: it continues from the last checkpoint.

With --workers=host:port,... (services started by `python -m binaries.worker
--port=N`), each round's clients are split across those workers.
"""

import sys

from absl import app
from absl import flags

from binaries import common

FLAGS = flags.FLAGS
common.define_flags()


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  try:
    config, task_kwargs = common.configs_from_flags(FLAGS)
  except ValueError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  try:
    return common.run(config, task_kwargs, FLAGS)
  except ConnectionError as e:  # --workers unreachable; nothing was trained.
    print(f'error: {e}', file=sys.stderr)
    return 4


if __name__ == '__main__':
  app.run(main)
