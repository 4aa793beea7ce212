r"""Evaluates a finished experiment again, e.g. with test-time fine-tuning.

  python -m binaries.evaluate --run_dir=<root_output_dir>/<experiment_name> \
    [--eval_fine_tune] [--eval_clients=N] --eval_name=fine_tuned
  python -m binaries.evaluate <the run's binaries.train flags> \
    [--eval_fine_tune] [--eval_clients=N] --eval_name=fine_tuned

With --new_users_samples (e.g. `1,all`), the task's withheld users (those
never trained on: `--list` shows the `withheld` capability) are evaluated
as new users too: each starts from --new_users_start (`initial`, or
`dp_average`: the DP average of the trained users' private states, one
release whose (epsilon, delta) the record states), then the algorithm's
own adaptation reads its first k samples, for each k given.

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

import sys

from absl import app
from absl import flags

from binaries import common
from tff_personal import run_evaluation as run_evaluation_lib

FLAGS = flags.FLAGS
common.define_flags()
flags.DEFINE_string('eval_name', 'evaluation',
                    'Name of the result file: evaluations/<eval_name>.json.')
flags.DEFINE_bool('overwrite_evaluation', False,
                  'Replace an existing evaluations/<eval_name>.json.')
flags.DEFINE_list('new_users_samples', [],
                  'Evaluate the task\'s withheld users as new users, after '
                  'adapting on this many of their samples each (ints or '
                  '"all", e.g. 1,all). Empty: not evaluated.')
flags.DEFINE_enum('new_users_start', 'initial',
                  list(run_evaluation_lib.NEW_USER_STARTS),
                  'How a new user starts: the process\'s initial state, or '
                  'the DP average of the trained users\' private states.')
flags.DEFINE_float('new_users_noise_multiplier', 1.0,
                   'The new-user DP average\'s noise stddev over its clip.')
flags.DEFINE_float('new_users_clip', None,
                   'The new-user DP average\'s L2 clip of each trained '
                   'user\'s state (default: the algorithm\'s).')
flags.DEFINE_string('run_dir', None,
                    'A run\'s directory: evaluate it from its own record '
                    '(the other flags but the evaluation and runtime ones '
                    'are ignored).')


def _new_users():
  """The --new_users_* flags as a `run_evaluation.NewUsers`, or None."""
  if not FLAGS.new_users_samples:
    return None
  return run_evaluation_lib.NewUsers(
      samples=run_evaluation_lib.NewUsers.parse_samples(
          FLAGS.new_users_samples),
      start=FLAGS.new_users_start,
      noise_multiplier=FLAGS.new_users_noise_multiplier,
      clip_norm=FLAGS.new_users_clip)


def main(argv):
  try:
    new_users = _new_users()
  except ValueError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  if FLAGS.run_dir:
    return common.evaluate_run_dir(FLAGS.run_dir, FLAGS, FLAGS.eval_name,
                                   overwrite=FLAGS.overwrite_evaluation,
                                   new_users=new_users)
  return common.main(
      argv, FLAGS, lambda config, task_kwargs: common.run_evaluation(
          config, task_kwargs, FLAGS, FLAGS.eval_name,
          overwrite=FLAGS.overwrite_evaluation, new_users=new_users))


if __name__ == '__main__':
  app.run(main)
