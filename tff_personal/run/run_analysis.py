"""Analyses of a trained run, client by client.

A run's clients evaluated one by one under a per-client strategy
(`runs.Run.client_outputs`), each client's outputs reduced (e.g. to a
language model's token sums, `group_fl.token_sums`) and cached as JSON; a
fine-tuning learning rate selected on clients disjoint from the evaluated
ones; learning curves over the checkpoints a run kept; the round at which
a validation curve plateaus; and a finished run's privacy metrics and
accuracy curve. Scores are the caller's (`score`: a value of a
pool of clients' reduced outputs, lower is better, e.g.
`group_fl.perplexity`).

Example:
  run = runs.Run.open(directory, task=task)
  sgd = lambda lr: strategies.FineTune(epochs=5, learning_rate=lr,
                                       optimizer='sgd')
  tuned, lr, by_lr = run_analysis.tuned_evaluation(
      out_dir, 'perfl', run, eval_ids, sweep_ids, [0.1, 1.0], sgd,
      score=group_fl.perplexity, reduce=group_fl.token_sums, stage='fl')
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

from tff_personal.core import atomic_io
from tff_personal.run import runs


def _as_is(output: Any) -> Any:
  return output


def evaluate_clients(run: runs.Run, clients: Sequence[int],
                     strategy: Any = 'none', *, stage: Optional[str] = None,
                     round: Optional[int] = None,  # pylint: disable=redefined-builtin
                     reduce: Callable[[Any], Any] = _as_is) -> dict[int, Any]:
  """Each client's reduced evaluation outputs under one strategy.

  Args:
    run: the run (a run whose last stage ran per group scores each client
      with its group's model, unless `stage` names an earlier stage).
    clients: the task's client ids.
    strategy: a per-client strategy or its text
      (`tff_personal.config.strategies`).
    stage: an earlier stage of a staged algorithm (e.g. 'fl').
    round: a checkpointed round (None: the last).
    reduce: maps a client's outputs to what is returned for it.

  Returns:
    `{client: reduce(its outputs)}`, in the order of `clients`.

  Example:
    sums = run_analysis.evaluate_clients(run, [3, 7], stage='fl',
                                         reduce=group_fl.token_sums)
  """
  clients = list(clients)
  outputs = run.client_outputs(clients, strategy, round=round, stage=stage)
  return {c: reduce(o) for c, o in zip(clients, outputs)}


def cached_evaluation(path: str, run: runs.Run, clients: Sequence[int],
                      strategy: Any = 'none', *,
                      stage: Optional[str] = None,
                      reduce: Callable[[Any], Any] = _as_is
                      ) -> dict[int, Any]:
  """`evaluate_clients`, cached as the JSON file `path`.

  The file (`atomic_io.cached_json`: written atomically, read back when it
  exists) maps each client id, as text, to its reduced outputs, which must
  be JSON values. The cache is keyed by its path alone: put it in a
  directory keyed by what the evaluation depends on.

  Returns:
    `{client: reduced outputs}` as the file reads back.

  Example:
    fl = run_analysis.cached_evaluation(
        os.path.join(out_dir, 'eval_fl.json'), run, eval_ids, stage='fl',
        reduce=group_fl.token_sums)
  """
  return {int(c): v for c, v in atomic_io.cached_json(path, lambda: {
      str(c): v for c, v in evaluate_clients(
          run, clients, strategy, stage=stage, reduce=reduce).items()
  }).items()}


def tuned_evaluation(directory: str, name: str, run: runs.Run,
                     eval_clients: Sequence[int],
                     sweep_clients: Sequence[int],
                     learning_rates: Sequence[float],
                     strategy_of: Callable[[float], Any], *,
                     score: Callable[[list], float],
                     stage: Optional[str] = None,
                     reduce: Callable[[Any], Any] = _as_is,
                     log_fn: Callable[[str], None] = lambda s: None
                     ) -> tuple[dict[int, Any], float, dict[float, float]]:
  """A strategy's evaluation at the learning rate chosen on other clients.

  Each learning rate's strategy (`strategy_of(lr)`) is evaluated on
  `sweep_clients` and scored as one pool; the lowest score wins (a tie: the
  smaller lr), and `eval_clients` are evaluated with it. Choosing on
  clients disjoint from the evaluated ones keeps the choice off the test
  data. Each evaluation is cached in `directory` (`cached_evaluation`):
  `sweep_<name>_lr<lr:g>.json` and `eval_<name>.json`.

  Args:
    directory: where the evaluations are cached.
    name: the method's name in the file names.
    run: the run whose clients are evaluated.
    eval_clients: the evaluated clients.
    sweep_clients: the clients that choose the learning rate.
    learning_rates: the learning rates swept, in order.
    strategy_of: the per-client strategy at a learning rate.
    score: a pool's value from its clients' reduced outputs (lower is
      better).
    stage: an earlier stage of the run whose model is evaluated.
    reduce: maps a client's outputs to what is cached for it.
    log_fn: told each evaluation and the choice.

  Returns:
    `({eval client: reduced outputs at the chosen lr}, the chosen lr,
    {lr: its score on the sweep clients})`.

  Example:
    tuned, lr, by_lr = run_analysis.tuned_evaluation(
        out_dir, 'perfl', run, [1, 2], [5], [0.1, 1.0],
        lambda lr: strategies.FineTune(epochs=5, learning_rate=lr),
        score=group_fl.perplexity, reduce=group_fl.token_sums)
  """
  by_lr = {}
  for lr in learning_rates:
    file = f'sweep_{name}_lr{lr:g}'
    log_fn(f'evaluating {file}')
    result = cached_evaluation(os.path.join(directory, file + '.json'), run,
                               sweep_clients, strategy_of(lr), stage=stage,
                               reduce=reduce)
    by_lr[lr] = score(list(result.values()))
  best = min(by_lr, key=lambda lr: (by_lr[lr], lr))
  log_fn(f'{name}: learning rate {best} (sweep {by_lr})')
  log_fn(f'evaluating {name}')
  tuned = cached_evaluation(os.path.join(directory, f'eval_{name}.json'), run,
                            eval_clients, strategy_of(best), stage=stage,
                            reduce=reduce)
  return tuned, best, by_lr


def evaluate_methods(directory: str,
                     methods: Mapping[str, tuple[runs.Run, Optional[str],
                                                 Optional[Callable]]],
                     eval_clients: Sequence[int],
                     sweep_clients: Sequence[int],
                     learning_rates: Sequence[float], *,
                     score: Callable[[list], float],
                     reduce: Callable[[Any], Any] = _as_is,
                     log_fn: Callable[[str], None] = lambda s: None
                     ) -> tuple[dict[str, dict[int, Any]],
                                dict[str, tuple[float, dict[float, float]]]]:
  """Several models evaluated on the same clients, in the order given.

  Args:
    directory: where each evaluation is cached.
    methods: `{name: (run, stage, strategy_of)}`: the model of `run` (of
      its earlier `stage`; None: its last), evaluated as trained when
      `strategy_of` is None (cached as `eval_<name>.json`), else under
      `strategy_of(lr)` at the learning rate chosen on `sweep_clients`
      (`tuned_evaluation`).
    eval_clients: the evaluated clients.
    sweep_clients: the clients that choose the learning rates.
    learning_rates: the learning rates swept.
    score: a pool's value from its clients' reduced outputs (lower is
      better).
    reduce: maps a client's outputs to what is cached for it.
    log_fn: told each evaluation and choice.

  Returns:
    `({name: {eval client: reduced outputs}}, {tuned name: (its chosen
    lr, {lr: its score on the sweep clients})})`.

  Example:
    sgd = lambda lr: strategies.FineTune(epochs=5, learning_rate=lr)
    results, chosen = run_analysis.evaluate_methods(
        out_dir, {'fl': (run, 'fl', None), 'perfl': (run, 'fl', sgd)},
        eval_ids, sweep_ids, [0.1, 1.0], score=group_fl.perplexity,
        reduce=group_fl.token_sums)
  """
  results, chosen = {}, {}
  for name, (run, stage, strategy_of) in methods.items():
    if strategy_of is None:
      log_fn(f'evaluating {name}')
      results[name] = cached_evaluation(
          os.path.join(directory, f'eval_{name}.json'), run, eval_clients,
          stage=stage, reduce=reduce)
    else:
      results[name], lr, by_lr = tuned_evaluation(
          directory, name, run, eval_clients, sweep_clients, learning_rates,
          strategy_of, score=score, stage=stage, reduce=reduce,
          log_fn=log_fn)
      chosen[name] = (lr, by_lr)
  return results, chosen


def check_checkpoints(run: runs.Run, rounds: Sequence[int],
                      stage: Optional[str] = None) -> None:
  """Raises unless the run (or its earlier `stage`) kept every round's
  checkpoint of `rounds`: a learning curve that needs them is refused,
  not drawn with the rounds it has.

  Raises:
    runs.RunError: naming the missing rounds (train the run again with
      more `keep_checkpoints`).
  """
  kept = set(run.rounds(stage=stage))
  missing = [r for r in rounds if r not in kept]
  if missing:
    raise runs.RunError(
        f'{run.directory} kept no checkpoint of rounds {missing[:5]}'
        f'{" ..." if len(missing) > 5 else ""} ({len(missing)} of the '
        f'{len(rounds)} the learning curve needs). The run was made before '
        'it kept them: move its directory away to train it again.')


def checkpoint_curves(run: runs.Run, clients: Sequence[int],
                      strategies: Mapping[str, Any],
                      points: Sequence[Mapping[str, Any]],
                      pools: Mapping[str, Sequence[int]], *,
                      score: Callable[[list], float],
                      reduce: Callable[[Any], Any] = _as_is,
                      log_fn: Callable[[str], None] = lambda s: None
                      ) -> dict[str, dict[str, list[float]]]:
  """Learning curves of a run's clients over the checkpoints it kept.

  At each point, the clients are evaluated under every strategy
  (`evaluate_clients`) and each pool of them is scored.

  Args:
    run: the run.
    clients: the clients evaluated (every pool's members among them).
    strategies: `{curve name: per-client strategy}`.
    points: the checkpoints, in order: each a dict of `evaluate_clients`'s
      `round` and `stage` (e.g. `{'stage': 'fl'}`: its last round).
    pools: `{pool name: its clients}`.
    score: a pool's value from its clients' reduced outputs.
    reduce: maps a client's outputs to what `score` takes.
    log_fn: told each point.

  Returns:
    `{curve name: {pool name: [value at each point]}}`.

  Example:
    curves = run_analysis.checkpoint_curves(
        run, ids, {'fl': 'none'}, [{'round': r} for r in (10, 20)],
        {'all': ids}, score=group_fl.perplexity, reduce=group_fl.token_sums)
  """
  out = {name: {p: [] for p in pools} for name in strategies}
  for point in points:
    log_fn(f'curves of {", ".join(strategies)} at {dict(point)}')
    for name, strategy in strategies.items():
      by_client = evaluate_clients(run, clients, strategy, reduce=reduce,
                                   **point)
      for p, members in pools.items():
        out[name][p].append(score([by_client[c] for c in members]))
  return out


def plateau_round(curve: Mapping[int, float], window: int,
                  tolerance: float) -> Optional[int]:
  """The round at which a validation curve has plateaued, or None.

  The first evaluated round T such that no evaluation in (T, T + window]
  is more than `tolerance` (relative) below the value at T, among the
  rounds whose whole window the curve covers (lower is better, e.g.
  perplexity).

  Args:
    curve: `{round: value}`.
    window: rounds after T that must not improve on it.
    tolerance: the relative improvement that counts as progress.

  Returns:
    T, or None when no round qualifies.

  Example:
    plateau_round({10: 200, 20: 150, 30: 149, 40: 149.5}, 20, 0.01)
    # 20: 149 is within 1% of 150.
  """
  rounds = sorted(curve)
  for t in rounds:
    if t + window > rounds[-1]:
      break
    later = [curve[r] for r in rounds if t < r <= t + window]
    if later and min(later) >= curve[t] * (1.0 - tolerance):
      return t
  return None


def eval_plateau(run: runs.Run, metric: str, window: int, tolerance: float
                 ) -> tuple[Optional[int], dict[int, float]]:
  """`plateau_round` of a run's evaluation curve (`Run.curves()['eval']`).

  Args:
    run: a run evaluated during training (`evaluation.every`).
    metric: the evaluated metric, lower is better (e.g. 'perplexity').
    window: rounds after T that must not improve on it.
    tolerance: the relative improvement that counts as progress.

  Returns:
    `(T or None, {round: value})`, the curve of every evaluated round.

  Example:
    rounds, curve = run_analysis.eval_plateau(run, 'perplexity', 50, 0.01)
  """
  curve = {int(r['round']): float(r[metric])
           for r in run.curves()['eval'] if metric in r}
  return plateau_round(curve, window, tolerance), curve


def privacy_metrics(run: runs.Run) -> dict:
  """The privacy block of a finished DP run's summary, or {} without DP.

  Returns:
    {'epsilon', 'delta', 'rounds_noised', 'noise_multiplier',
    'clip_norm'}: epsilon covers every round the run noised, every stage's.

  Example:
    metrics.update(run_analysis.privacy_metrics(runs.Run.open(directory)))
  """
  report = run.summary.get('privacy')
  if not report:
    return {}
  return {k: report[k] for k in ('epsilon', 'delta', 'rounds_noised',
                                 'noise_multiplier', 'clip_norm')}


def accuracy_curve(run: runs.Run) -> dict:
  """A classification run's test accuracy after every round.

  Returns:
    {'mean': per-round mean over clients of their accuracy, 'std': its std
    across clients (the eval curve's `accuracy`,
    `accuracy_std_across_clients`), 'seconds_per_round': the mean round
    time}.

  Example:
    final = run_analysis.accuracy_curve(runs.Run.open(directory))['mean'][-1]
  """
  curves = run.curves()
  return {'mean': [float(r['accuracy']) for r in curves['eval']],
          'std': [float(r['accuracy_std_across_clients'])
                  for r in curves['eval']],
          'seconds_per_round': float(np.mean(
              [float(r['round_seconds']) for r in curves['train']]))}
