r"""DP diagnostics: what the noise costs a task's model, before training it.

  python -m binaries.dp_budget --task=speech_preference \
    --algorithm=fedembed_prototype --data_dir=out/speech_data --num_users=900 \
    --dp=gaussian_fixed --target_epsilon=10 --clip_norm=1 \
    --budget_grid=100x30,300x10,900x10 --probe_users=60

Two parts, both at the flags' epsilon, delta and clip (every `binaries.train`
flag applies):
* For each cohort x rounds of `--budget_grid`, the noise multiplier that the
  accountant of `core/privacy.py` calibrates, the noise std on the mean update
  per coordinate and unit of clip (z / cohort), and the norm of all the
  noise a run adds to the model (z * clip / cohort * sqrt(rounds * d), d the
  shared update's size).
* `--probe_users` users (evenly spaced ids) run their client step once (one
  round's local training, `--local_epochs`) from the initial model;
  reported: their update norms, and the coherent norm of the clipped updates
  (`core/update_stats.coherent_norm`, the part a mean over many clients
  keeps) against one round's noise norm at the flags' cohort.
Prints a markdown table and one JSON line (also written to --output if set).
"""

import json
import sys

from absl import app
from absl import flags
import numpy as np

from binaries import common
from tasks import registry as task_registry
from tff_personal import atomic_io
from tff_personal import experiment
from tff_personal.core import privacy
from tff_personal.core import runtime
from tff_personal.core import update_stats

FLAGS = flags.FLAGS
common.define_flags()
flags.DEFINE_list('budget_grid', ['100x30', '300x10', '900x10'],
                  'cohort x rounds pairs to account at the target epsilon.')
flags.DEFINE_integer('probe_users', 60,
                     'Users whose initial updates are probed (>= 2).')
flags.DEFINE_string('output', None, 'Also write the JSON result here.')


def _grid(values):
  out = []
  for v in values:
    try:
      cohort, rounds = (int(x) for x in v.lower().split('x'))
    except ValueError:
      raise ValueError(f'--budget_grid entry {v!r} is not COHORTxROUNDS, '
                       'e.g. 100x30') from None
    if cohort < 1 or rounds < 1:
      raise ValueError(f'--budget_grid entry {v!r}: cohort and rounds must '
                       'be positive')
    out.append((cohort, rounds))
  return out


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  try:
    config, task_kwargs = common.configs_from_flags(FLAGS)
    if FLAGS.dp == 'none' or FLAGS.target_epsilon is None:
      raise ValueError('dp_budget needs --dp=gaussian_fixed and '
                       '--target_epsilon (the budget to spend)')
    grid = _grid(FLAGS.budget_grid)
    if FLAGS.probe_users < 2:
      raise ValueError(f'--probe_users must be >= 2, got {FLAGS.probe_users}')
    task = task_registry.build_task(FLAGS.task, **task_kwargs)
    population = task.population
    if any(c > population for c, _ in grid):
      raise ValueError(f'--budget_grid has a cohort larger than the '
                       f'population {population}')
    dp = experiment.validate(config, population)
  except ValueError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  ids = np.linspace(0, population - 1,
                    min(FLAGS.probe_users, population)).astype(int).tolist()
  with runtime.local_runtime():
    updates = experiment.probe_client_updates(task, config, ids)
  d = updates.shape[1]
  rows = []
  for cohort, rounds in grid:
    row_config = privacy.resolve(privacy.DPConfig(
        mechanism=dp.mechanism, target_epsilon=FLAGS.target_epsilon,
        clip_norm=dp.clip_norm, target_delta=dp.target_delta,
        clients_per_round=cohort, population=population, rounds=rounds,
        sampling=dp.sampling))
    z = row_config.noise_multiplier
    rows.append(dict(
        cohort=cohort, rounds=rounds, noise_multiplier=z,
        # PLD where it applies (e.g. full participation), else RDP.
        accountant=privacy.compute_epsilon(row_config, rounds)['accountant'],
        noise_std_per_coordinate=z / cohort,
        run_noise_norm=update_stats.noise_norm(z, dp.clip_norm, cohort, d,
                                               rounds)))
  result = dict(task=FLAGS.task, algorithm=FLAGS.algorithm, d=d,
                epsilon=FLAGS.target_epsilon, delta=dp.target_delta,
                clip_norm=dp.clip_norm, grid=rows, probed_users=len(ids))
  norms = np.linalg.norm(updates, axis=1)
  clipped = update_stats.clip_rows(updates, dp.clip_norm)
  result.update(
      median_update_norm=float(np.median(norms)),
      clipped_fraction=float(np.mean(norms > dp.clip_norm)),
      coherent_clipped_norm=update_stats.coherent_norm(clipped),
      round_noise_norm=update_stats.noise_norm(
          dp.noise_multiplier, dp.clip_norm, dp.clients_per_round, d),
      round_noise_at=dict(cohort=dp.clients_per_round,
                          noise_multiplier=dp.noise_multiplier))
  print(f'd = {d} shared parameters; epsilon {FLAGS.target_epsilon} at delta '
        f'{dp.target_delta:.3g}, clip {dp.clip_norm}')
  print('| cohort | rounds | noise multiplier | accountant | std / coordinate '
        '| run noise norm |\n|---:|---:|---:|---|---:|---:|')
  for r in rows:
    print(f'| {r["cohort"]} | {r["rounds"]} | {r["noise_multiplier"]:.3f} | '
          f'{r["accountant"]} | {r["noise_std_per_coordinate"]:.5f} | '
          f'{r["run_noise_norm"]:.2f} |')
  print(f'probe ({len(ids)} users, one round of local training from the '
        'initial model): '
        f'median update norm {result["median_update_norm"]:.3f}, '
        f'{result["clipped_fraction"]:.0%} clipped; coherent clipped norm '
        f'{result["coherent_clipped_norm"]:.3f} vs one round\'s noise norm '
        f'{result["round_noise_norm"]:.3f} (cohort {dp.clients_per_round})')
  line = json.dumps(result, default=float)
  print(line)
  if FLAGS.output:
    with atomic_io.atomic_write(FLAGS.output) as f:
      f.write(line + '\n')
  return 0


if __name__ == '__main__':
  app.run(main)
