r"""Evaluates a finished experiment again, e.g. with test-time fine-tuning.

  python -m binaries.evaluate --run_dir=<root_output_dir>/<experiment_name> \
    [--eval_fine_tune] [--eval_clients=N] --eval_name=fine_tuned
  python -m binaries.evaluate <the run's binaries.train flags> \
    [--eval_fine_tune] [--eval_clients=N] --eval_name=fine_tuned

With --eval_strategies (repeatable), named personalization strategies are
evaluated too, each reported under its name (tff_personal/config/strategies.py):
e.g. `--eval_strategies=ft3=fine_tune(epochs=3)` tests every evaluated
client after three local passes over its own data, and
`--eval_strategies=new=cold_start(start=dp_average,samples=1/all)` tests
the task's withheld users (never trained on: `--list` shows the `withheld`
capability) as new users, starting from the DP average of the trained
users' private states (one release whose (epsilon, delta) the record
states), after the algorithm's own adaptation on their first 1 and all
samples.

With --run_dir the run is reopened from its own record (`runs.Run.open`):
its task and configuration are the run's, and only the evaluation flags
given on the command line change. Otherwise the run's flags are given again.

Reads <root_output_dir>/<experiment_name>/: summary.json (the run's flags;
they must match these, except the evaluation and runtime flags), the
server checkpoint of the last round and the clients' private states as
committed then. Writes only evaluations/<eval_name>.json (refused if it
exists, unless --overwrite_evaluation). Exit codes: 2 for flags or a run that
has not finished, 3 for a missing or unreadable checkpoint or client state, or
an experiment directory in use by another training or evaluation.
"""

from absl import app
from absl import flags

from binaries import common

FLAGS = flags.FLAGS
common.define_flags()
flags.DEFINE_string('eval_name', 'evaluation',
                    'Name of the result file: evaluations/<eval_name>.json.')
flags.DEFINE_bool('overwrite_evaluation', False,
                  'Replace an existing evaluations/<eval_name>.json.')
flags.DEFINE_string('run_dir', None,
                    'A run\'s directory: evaluate it from its own record '
                    '(the other flags but the evaluation and runtime ones '
                    'are ignored).')


def main(argv):
  if FLAGS.run_dir:
    return common.evaluate_run_dir(FLAGS.run_dir, FLAGS, FLAGS.eval_name,
                                   overwrite=FLAGS.overwrite_evaluation)
  return common.main(
      argv, FLAGS, lambda config, task_kwargs: common.run_evaluation(
          config, task_kwargs, FLAGS, FLAGS.eval_name,
          overwrite=FLAGS.overwrite_evaluation))


if __name__ == '__main__':
  app.run(main)
