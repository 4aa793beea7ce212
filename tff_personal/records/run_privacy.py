"""A run's privacy report: epsilon for the rounds it noised, replays and
earlier stages included, per group for a per-group stage, and what it
released (covered by epsilon or not)."""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

from tff_personal.config import experiment
from tff_personal.config import strategies as strategies_lib
from tff_personal.core import privacy
from tff_personal.core import private_noise
from tff_personal.core import training_loop


def per_group_privacy(config: experiment.ExperimentConfig, dp, groups, noised,
                      earlier_noised: int, report: dict) -> dict:
  """The privacy report's per-group fields: epsilon per group (the earlier
  stages' rounds over everyone, then the group's run over its clients) and
  the largest of them as the run's epsilon."""
  per_group = {}
  for name, members in groups.items():
    group_dp = dataclasses.replace(dp, population=len(members))
    composed = privacy.compute_epsilon_phases(
        [(dp, earlier_noised), (group_dp, noised[name])])
    per_group[name] = dict(
        epsilon=composed['epsilon'], accountant=composed['accountant'],
        population=len(members),
        sampling_probability=config.clients_per_round / len(members),
        rounds_noised=noised[name])
  worst = max(per_group, key=lambda g: per_group[g]['epsilon'])
  return {
      'epsilon': per_group[worst]['epsilon'],
      'accountant': per_group[worst]['accountant'],
      'epsilon_rdp': None, 'epsilon_pld': None,
      'groups': per_group,
      'rounds_noised': earlier_noised + max(noised.values()),
      'notes': (report.get('notes', '') + ' Per-group stage: a user took '
                f'part in the first {earlier_noised} noised rounds (cohorts '
                'from every client) and in its own group\'s run only '
                '(cohorts from the group\'s clients); each group\'s epsilon '
                'composes the two, and epsilon is the largest over groups '
                '(groups).').strip()}


def rounds_noised(directory: str) -> int:
  """The rounds one run directory (a run's, an earlier stage's or a
  group's) noised: its record of rounds started, replays included, checked
  as a resume checks it (`training_loop.check_records`: both places of the
  record agree, and it counts at least the rounds the run's checkpoints
  and released metrics show). 0 for a directory where no round started.

  Raises:
    training_loop.CheckpointError: the record is missing, unreadable or
      inconsistent (naming the files).
  """
  started = training_loop.check_records(directory)
  if started is None:  # No checkpoint: no round can have completed.
    started = training_loop.rounds_started(directory) or 0
  return started


def earlier_stages_noised(config: experiment.ExperimentConfig) -> int:
  """The rounds a finished run's earlier stages noised (0 for a
  single-stage algorithm), read from their directories (`rounds_noised`)."""
  stages_dir = os.path.join(config.experiment_dir, 'stages')
  return sum(rounds_noised(os.path.join(stages_dir, name)) for name in (
      sorted(os.listdir(stages_dir)) if os.path.isdir(stages_dir) else ()))


def recorded_privacy_report(config: experiment.ExperimentConfig,
                            dp: privacy.DPConfig,
                            groups: Optional[dict[str, list[int]]] = None
                            ) -> Optional[dict]:
  """The privacy report of the run in `config.experiment_dir` as its
  directories record it (None without DP): for an interrupted run, what it
  has spent so far. `groups`: a per-group run's groups
  (`group_privacy_report`)."""
  earlier = earlier_stages_noised(config)
  if groups is not None:
    return group_privacy_report(config, dp, groups, earlier)
  completed = training_loop.completed_round(config.experiment_dir) or 0
  return run_privacy_report(config, dp, completed,
                            rounds_noised(config.experiment_dir), earlier)


def run_privacy_report(config: experiment.ExperimentConfig,
                       dp: privacy.DPConfig,
                       rounds_completed: int,
                       rounds_started: Optional[int],
                       earlier_stages_noised: int = 0) -> Optional[dict]:
  """The privacy report of a run (None without DP).

  `dp` is the run's resolved DP config. Epsilon accounts every round whose
  noised aggregate was computed, `rounds_noised`: the rounds started in the
  experiment directory (`training_loop.rounds_started`), which include rounds
  replayed after a kill, and at least `rounds_completed`, plus
  `earlier_stages_noised`, those of a multi-stage algorithm's earlier
  stages (`core/stages.py`). A replay trains and noises the round again, so
  it is accounted as another release.
  """
  noised = max(rounds_completed, rounds_started or 0) + earlier_stages_noised
  report = privacy.privacy_report(dp, noised)
  if report is None:
    return None
  report['rounds_completed'] = rounds_completed
  report['rounds_noised'] = noised
  report['notes'] = (report.get('notes', '') + ' Epsilon accounts '
                     'rounds_noised rounds: every round started, including '
                     'rounds replayed after a kill (a replay trains and '
                     'noises the round again, another release).').strip()
  noise = experiment.private_noise_of(config, dp)
  if noise is not None:
    report['personal_heads'] = private_noise.personal_report(
        noise, personal_passes(config, noised),
        report['delta'], report['neighboring_relation'])
  report['released'] = released_values(config, dp)
  report['train_metrics_released'] = experiment.releases_train_metrics(config)
  report['unnoised_metrics_released'] = experiment.releases_unnoised(config)
  if experiment.releases_unnoised(config):
    report['notes'] = (report.get('notes', '') + ' Un-noised diagnostics '
                       '(--release_unnoised_metrics) are released and are not '
                       'covered by epsilon; see released.').strip()
  return report


RELEASE_BASES = ('dp', 'public', 'timing', 'evaluation', 'unnoised',
                 'separate_dp')


def _released(name: str, basis: str, why: str, trusted: str = '') -> dict:
  return dict(name=name, covered=basis in ('dp', 'public'), basis=basis,
              why=why, trusted=trusted)


def trust_model(dp: privacy.DPConfig) -> str:
  """Who must be trusted, and for what, for epsilon to hold for the shared
  update under `dp`'s mechanism (`privacy`'s module docstring)."""
  sampling = ('the server, to sample each cohort uniformly and keep it '
              'secret (the accounting assumes it)')
  if dp.is_distributed:
    return (
        'secure aggregation, to reveal only the sum of the cohort\'s '
        'updates (no one, the server included, sees one update or the sum '
        'before noise); every sampled device, to add its noise share '
        '(epsilon assumes all clients_per_round shares: with k devices '
        'dropped or colluding with the server, the noise left is that of '
        'the other n - k); ' + sampling + ', and to send the devices the '
        'configured clip and noise. TFF\'s aggregator also sums, securely '
        'but without noise, how many of the cohort\'s updates were clipped; '
        'the compiled round gives that count to the server (the run does '
        'not release it; epsilon does not cover it). This simulation runs '
        'the secure sums as plain sums (TFF\'s test backend), so it '
        'protects nothing itself')
  return ('the aggregator (the server, or whoever sums the updates): it '
          'sees every sampled user\'s clipped, un-noised update and must add '
          'the noise and release only the noised mean; ' + sampling)


def released_values(config: experiment.ExperimentConfig, dp: privacy.DPConfig
                    ) -> list[dict]:
  """What a DP run releases, each `{name, covered, basis, why, trusted}`.

  `covered` says whether the (epsilon, delta) of the privacy report bounds
  what the value reveals about a user; `basis` says why or why not:
  'dp' (computed from the noised aggregate only: accounted in epsilon),
  'public' (depends on no user: covered trivially), 'timing' (wall time,
  which may depend on the users' data: not covered), 'evaluation' (the
  simulation's held-out evaluation: not covered), 'unnoised' (opt-in
  diagnostics, `release_unnoised_metrics`: not covered), 'separate_dp'
  (noised personal heads: bounded by their own epsilon, not the shared
  one). `trusted` says who must be trusted, and for what, for a covered
  value's epsilon to hold (`trust_model`; empty where nothing is). The list
  follows what the run writes to train_metrics.csv, eval_metrics.csv,
  TensorBoard, summary.json and its log.
  """
  if dp.is_distributed:
    update_why = (
        f'rotated, clipped to {dp.clip_norm}, rounded and noised on each '
        f'device by {dp.mechanism} (its noise split among the cohort\'s '
        'devices), summed by secure '
        'aggregation; accounted in epsilon with the rounding\'s '
        'sensitivity inflation')
    measured_why = (
        'computed on the server from the noised sum and from public values '
        '(TFF\'s DistributedDpSumFactory\'s clip, scale factor, norm bound, '
        'noise and padded dimension; the securely summed cohort size, '
        'clients_per_round under fixed-size sampling) and the server '
        'optimizer\'s state: post-processing')
  else:
    update_why = (f'clipped to {dp.clip_norm} and noised by the '
                  f'{dp.mechanism} DP aggregator; accounted in epsilon')
    measured_why = ('computed on the server from the noised aggregate (e.g. '
                    'the adaptive clip, the server optimizer\'s state): '
                    'post-processing')
  released = [
      _released('shared model update', 'dp', update_why, trust_model(dp)),
      _released('aggregator and finalizer measurements', 'dp', measured_why,
                trust_model(dp)),
      _released('round number, configuration, epsilon and delta', 'public',
                'functions of the configuration and of the rounds run, not '
                'of any user\'s data')]
  unnoised = experiment.releases_unnoised(config)
  if experiment.releases_train_metrics(config):
    released.append(_released(
        'training-metric sums', 'unnoised',
        'loss, accuracy and non-finite counts summed over the cohort '
        'without noise (--release_unnoised_metrics; --notrain_metrics '
        'withholds them)'))
  if config.sampling == 'fixed_size':
    released.append(_released(
        'cohort_size', 'public',
        'always clients_per_round under fixed-size sampling: it depends '
        'on no user'))
  elif unnoised:
    released.append(_released(
        'cohort_size', 'unnoised',
        'under Poisson sampling the number of users sampled depends on '
        'who took part, and the accounting assumes it is not released '
        '(--release_unnoised_metrics)'))
  released.append(_released(
      'round_seconds and other timings', 'timing',
      'wall time of rounds and set-up, which can depend on the cohort\'s '
      'data; released as the simulation\'s cost'))
  released.append(_released(
      'evaluation metrics', 'evaluation',
      'measured by the simulation on each evaluated user\'s held-out data '
      'and private state, without noise: a measurement of the experiment, '
      'which a deployment would not release'))
  if config.dp_personal_heads == 'noised':
    released.append(_released(
        'personal heads', 'separate_dp',
        'noised on their own; bounded by personal_heads.epsilon, not by '
        'the shared epsilon'))
  for name, strategy in strategies_lib.resolve(
      config.eval_strategies).items():
    if (isinstance(strategy, strategies_lib.ColdStart) and
        strategy.start == 'dp_average'):
      released.append(_released(
          f'new-user DP average (strategy {name})', 'separate_dp',
          'the DP average of the trained users\' private states, released '
          f'once; bounded by strategies.{name}.dp_average\'s own (epsilon, '
          'delta), not by the shared epsilon'))
  return released


def personal_passes(config: experiment.ExperimentConfig, rounds: int) -> int:
  """An upper bound on the noised local passes of one user's personal head:
  one per round, one per intermediate evaluation (each fine-tunes from the
  stored state), and the final evaluation's, the held-out test's and the
  fine-tuned test's (a user who never trained has at most the evaluations');
  and each `fine_tune` strategy's pass at every one of those evaluations
  and at the held-out test.
  """
  intermediate = rounds // config.eval_every if config.eval_every else 0
  tuned = sum(isinstance(s, strategies_lib.FineTune) for s in
              strategies_lib.resolve(config.eval_strategies).values())
  return rounds + intermediate + 3 + tuned * (intermediate + 2)


def group_privacy_report(config: experiment.ExperimentConfig,
                         dp: privacy.DPConfig, groups: dict[str, list[int]],
                         earlier_noised: int) -> Optional[dict]:
  """The privacy report of a per-group run, from the rounds each group's
  directory records as started (None without DP)."""
  noised = {name: rounds_noised(experiment.group_directory(config, name))
            for name in groups}
  report = run_privacy_report(config, dp, config.rounds,
                              max(noised.values()), earlier_noised)
  if report is not None:
    report.update(per_group_privacy(config, dp, groups, noised,
                                    earlier_noised, report))
  return report
