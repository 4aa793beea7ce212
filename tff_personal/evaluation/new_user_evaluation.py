"""The task's withheld users evaluated as new users (`strategies.ColdStart`).

Each withheld user starts from the process's new-user state, from the
private state the final shared model corresponds to (`start=global`, where
the algorithm declares one: `StatefulClientProcess.global_private_fn`), or
from the DP average of the trained users' private states
(`core/new_users.py`, one release with its own (epsilon, delta)). Then it
adapts on its first k samples and its test split is scored: a task whose
evaluation model adapts by itself (FedPerC's) reads them from
`withheld_eval_datasets(ids, k)`; a task that gives them apart
(`withheld_adaptation_datasets(ids, k)`, e.g. `ClientDataTask`) has each
user fine-tune its private state on them first (one pass; a process whose
clients hold no private variables fine-tunes a copy of the whole global
model, as FedAvg+FT does), with the optimizer a `fine_tune` would use.
`run_evaluation.evaluate_strategies` calls it for a `cold_start` strategy.
"""

from __future__ import annotations

import collections
from typing import Callable, Optional

import numpy as np
import tensorflow_federated as tff

from tff_personal.algorithms import fedavg_ft
from tff_personal.config import experiment
from tff_personal.config import strategies as strategies_lib
from tff_personal.core import evaluation
from tff_personal.core import new_users as new_users_lib
from tff_personal.core import process as process_lib
from tff_personal.core import task as task_lib


class NewUserError(ValueError):
  """New users cannot be evaluated as asked (says why)."""


def _dp_average_start(proc, store, population: int,
                      new_users: strategies_lib.ColdStart,
                      config: experiment.ExperimentConfig,
                      run_delta: Optional[float]) -> tuple:
  """(the DP average of the trained clients' private states, its record)."""
  private = []
  for start in range(0, population, config.eval_chunk):
    for s in store.load(list(range(start, min(start + config.eval_chunk,
                                              population)))):
      if int(s.get(process_lib.CLIENT_STATE_ROUNDS, 1)) > 0:
        private.append(tuple(
            np.asarray(v) for v in s[process_lib.CLIENT_STATE_PRIVATE]))
  if not private or not private[0]:
    raise NewUserError(
        'the dp_average new-user start needs trained clients with a private '
        f'state; this run has {len(private)} trained clients'
        + (' and no private state' if private else ''))
  base = getattr(proc, 'base_process', proc)
  clip = new_users.clip_norm or getattr(base, 'new_user_dp_clip', None)
  if clip is None:
    raise NewUserError(
        'the dp_average new-user start needs a clip norm: the algorithm '
        'declares none (new_user_dp_clip); give one '
        '(cold_start(clip_norm=...))')
  delta = (new_users.delta or run_delta or
           strategies_lib.DEFAULT_NEW_USERS_DELTA)
  private_type = tff.types.to_type(tuple(
      tff.TensorType(v.dtype, v.shape) for v in private[0]))
  dp_mean = new_users_lib.build_dp_mean(
      private_type, noise_multiplier=new_users.noise_multiplier,
      clip_norm=clip, num_clients=len(private), seed=config.seed)
  mean = tuple(np.asarray(v) for v in dp_mean(private))
  record = dict(
      users=len(private), clip_norm=float(clip),
      noise_multiplier=float(new_users.noise_multiplier),
      epsilon=new_users_lib.dp_mean_epsilon(new_users.noise_multiplier,
                                            delta),
      delta=float(delta), seed=config.seed,
      accounting='one Gaussian release, RDP (dp_accounting), add-or-remove '
                 'one trained user',
      released='the DP average of the trained users\' private states, '
               'once: every new user starts from it',
      clip=new_users_lib.dp_clip_report(private, clip))
  return mean, record


def global_start(proc, weights, algorithm: str) -> tuple:
  """The private state of the final shared model (`start=global`).

  Raises:
    NewUserError: the private state has no shared counterpart.
  """
  private_type = proc.client_state_type[process_lib.CLIENT_STATE_PRIVATE]
  to_private = getattr(proc, 'global_private_fn', None)
  if to_private is None:
    if not len(private_type):  # pylint: disable=g-explicit-length-test
      return ()  # Nothing private: every start is the global model.
    raise NewUserError(
        f'cold_start(start=global): {algorithm}\'s private state has no '
        'shared counterpart to start from; use start=initial or '
        'start=dp_average')
  return tuple(to_private(weights))


def evaluate_new_users(task, proc, state, store,
                       config: experiment.ExperimentConfig,
                       new_users: strategies_lib.ColdStart,
                       run_delta: Optional[float] = None,
                       log_fn: Optional[Callable[[str], None]] = None
                       ) -> dict:
  """The task's withheld users, evaluated as new users (`ColdStart`).

  Args:
    task: a task with the `withheld` capability.
    proc: the run's (final) process; `state` its server state.
    store: the run's client-state store at that state's round.
    config: the run's config (its seed draws the DP average's noise).
    new_users: how they start and adapt.
    run_delta: the delta of the run's own DP guarantee, if it has one (the
      DP average's default delta).
    log_fn: where each sample count's metrics are logged.

  Returns:
    `{'users': n, 'start': ..., 'samples': {'1': metrics, 'all': ...},
    'dp_average': the release's record (dp_average only)}`; the
    DP average's (epsilon, delta) covers only that one release.

  Raises:
    NewUserError: the task has no withheld users, or the start cannot be
      made.
  """
  names = list(getattr(task, 'withheld_names', ()) or ())
  if not names:
    raise NewUserError(
        f'task {task_lib.task_name(task)} has no withheld users (the '
        '`withheld` capability) to evaluate as new users')
  ids = list(range(len(names)))
  population = task.population
  weights = proc.get_model_weights(state)
  initial = experiment.initial_client_state_fn(proc, config)
  starts = [collections.OrderedDict(initial(population + i)) for i in ids]
  out = {'users': len(ids), 'start': new_users.start}
  if new_users.start == 'dp_average':
    mean, out['dp_average'] = _dp_average_start(proc, store, population,
                                                new_users, config, run_delta)
    for s in starts:
      s[process_lib.CLIENT_STATE_PRIVATE] = mean
  elif new_users.start == 'global':
    private = global_start(proc, weights, config.algorithm)
    for s in starts:
      s[process_lib.CLIENT_STATE_PRIVATE] = private
  adaptation_fn = getattr(task, 'withheld_adaptation_datasets', None)
  # Withheld users scored as the task scores them (`task.WithheldTask`
  # maps their ids back to the task's own).
  score = getattr(task, 'withheld_evaluate', task.evaluate)
  # Fine-tuning a process whose evaluated clients hold no private variables
  # tunes a copy of the whole global model (`fedavg_ft.WholeModelView`); a
  # process that declares its own evaluated model (FedBABU's: its frozen
  # head unfrozen) is tuned as it declares, as `run_evaluation` does.
  evaluated = proc
  eval_state_type = getattr(proc, 'eval_client_state_type',
                            proc.client_state_type)
  if adaptation_fn is not None and not len(  # pylint: disable=g-explicit-length-test
      eval_state_type[process_lib.CLIENT_STATE_PRIVATE]):
    evaluated = fedavg_ft.WholeModelView(proc)
  states = process_lib.eval_client_states(evaluated, weights, starts)
  model_fn = getattr(evaluated, 'eval_model_fn', proc.model_fn)
  state_type = getattr(evaluated, 'eval_client_state_type',
                       proc.client_state_type)
  personal_eval = evaluation.build_personal_eval(
      model_fn, proc.model_weights_type, state_type)
  tuned_eval = None
  out['samples'] = {}
  for samples in new_users.samples:
    count = None if samples == 'all' else samples
    data = task.withheld_eval_datasets(ids, count)
    adapt = adaptation_fn is not None and samples != 0
    if adapt and tuned_eval is None:
      tuned_eval = evaluation.build_cold_start_eval(
          model_fn, proc.model_weights_type, state_type,
          getattr(proc, 'eval_fine_tune_optimizer', None) or
          experiment.make_private_optimizer(config) or
          experiment.make_client_optimizer(config))
    train = adaptation_fn(ids, count) if adapt else None
    outputs = []
    for i in range(0, len(ids), config.eval_chunk):
      sl = slice(i, i + config.eval_chunk)
      if adapt:
        outputs.extend(tuned_eval(weights, states[sl], train[sl], data[sl]))
      else:
        outputs.extend(personal_eval(weights, states[sl], data[sl]))
    out['samples'][str(samples)] = score(outputs, ids)
    if log_fn:
      log_fn(f'new users ({len(ids)} withheld, start {new_users.start}, '
             f'{samples} samples): '
             f'{evaluation.format_metrics(out["samples"][str(samples)])}')
  return out
