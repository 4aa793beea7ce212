r"""DP diagnostics: what the noise costs a task's model, before training it.

  python -m binaries.dp_budget --task=speech_preference \
    --algorithm=fedembed_prototype --data_dir=out/speech_data --num_users=900 \
    --dp=gaussian_fixed --target_epsilon=10 --clip_norm=1 \
    --budget_grid=100x30,300x10,900x10 --probe_users=60

Two parts, both at the flags' epsilon, delta and clip (every `binaries.train`
flag applies; the computations are `tff_personal/core/dp_budget.py`'s):
* For each cohort x rounds of `--budget_grid`, the noise multiplier that the
  accountant of `core/privacy.py` calibrates, the noise std on the mean update
  per coordinate and unit of clip (z / cohort), and the norm of all the
  noise a run adds to the model (z * clip / cohort * sqrt(rounds * d), d the
  shared update's size).
* `--probe_users` users (evenly spaced ids) run their client step once (one
  round's local training, `--local_epochs`) from the initial model;
  reported: their update norms, and the coherent norm of the clipped updates
  (`core/update_stats.coherent_norm`, the part a mean over many clients
  keeps) against one round's noise norm at the flags' cohort, for the whole
  update and for each of its tensors (`parts`: where the signal is).
Prints a markdown table and one JSON line (also written to --output if set).
"""

import json
import sys

from absl import app
from absl import flags
import numpy as np

from binaries import common
from tasks import registry as task_registry
from tff_personal.config import experiment
from tff_personal.core import atomic_io
from tff_personal.core import dp_budget
from tff_personal.core import runtime

FLAGS = flags.FLAGS
common.define_flags()
flags.DEFINE_list('budget_grid', ['100x30', '300x10', '900x10'],
                  'cohort x rounds pairs to account at the target epsilon.')
flags.DEFINE_integer('probe_users', 60,
                     'Users whose initial updates are probed (>= 2).')
flags.DEFINE_string('output', None, 'Also write the JSON result here.')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  try:
    config, task_kwargs = common.configs_from_flags(FLAGS)
    if FLAGS.dp == 'none' or FLAGS.target_epsilon is None:
      raise ValueError('dp_budget needs --dp=gaussian_fixed and '
                       '--target_epsilon (the budget to spend)')
    dp_budget.parse_grid(FLAGS.budget_grid)  # Named errors before loading.
    if FLAGS.probe_users < 2:
      raise ValueError(f'--probe_users must be >= 2, got {FLAGS.probe_users}')
    task = task_registry.build_task(FLAGS.task, **task_kwargs)
    population = task.population
    grid = dp_budget.parse_grid(FLAGS.budget_grid, population)
    dp = experiment.validate(config, population)
  except ValueError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  ids = np.linspace(0, population - 1,
                    min(FLAGS.probe_users, population)).astype(int).tolist()
  with runtime.local_runtime():
    updates, shapes = experiment.probe_client_updates(task, config, ids,
                                                      return_shapes=True)
  d = updates.shape[1]
  result = dict(task=FLAGS.task, algorithm=FLAGS.algorithm, d=d,
                epsilon=FLAGS.target_epsilon, delta=dp.target_delta,
                clip_norm=dp.clip_norm,
                grid=dp_budget.budget_rows(dp, FLAGS.target_epsilon, population,
                                           grid, d),
                probed_users=len(ids))
  result.update(dp_budget.probe_summary(updates, dp))
  result['parts'] = dp_budget.probe_parts(updates, shapes, dp)
  print(dp_budget.markdown(result))
  line = json.dumps(result, default=float)
  print(line)
  if FLAGS.output:
    with atomic_io.atomic_write(FLAGS.output) as f:
      f.write(line + '\n')
  return 0


if __name__ == '__main__':
  app.run(main)
