"""A run's evaluation: each evaluated client with its private state, the
held-out test split, cold-start users, per group; and the re-evaluation of
a finished run (`evaluate_experiment`)."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import time
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

from tff_personal.algorithms import fedavg_ft
from tff_personal.config import experiment
from tff_personal.config import strategies as strategies_lib
from tff_personal.core import client_data as client_data_lib
from tff_personal.core import client_state as client_state_lib
from tff_personal.core import evaluation
from tff_personal.core import moved
from tff_personal.core import privacy
from tff_personal.core import process as process_lib
from tff_personal.core import sharded
from tff_personal.core import sharded_eval
from tff_personal.core import stages as stages_lib
from tff_personal.core import task as task_lib
from tff_personal.core import training_loop
from tff_personal.evaluation import new_user_evaluation
from tff_personal.records import run_privacy
from tff_personal.records import run_records


def _evaluators(model_fn, weights_type, state_type, num_shards: int,
                fine_tune_optimizer, batches_eval: bool, eval_wire,
                train_wire) -> tuple:
  """`(personal_eval, test_eval, fine_tune_eval, test_fine_tune_eval)`: the
  traced evaluation computations of `personal_evaluator` (the fine-tuning
  ones None without `fine_tune_optimizer`). `batches_eval`: sharded
  evaluation reads the task's numpy batches (not its tf.data datasets);
  `eval_wire` / `train_wire`: the wire form of those evaluation / training
  batches (None: none)."""
  if not num_shards:
    personal_eval = evaluation.build_personal_eval(model_fn, weights_type,
                                                   state_type)
    fine_tune_eval = (evaluation.build_cold_start_eval(
        model_fn, weights_type, state_type, fine_tune_optimizer)
                      if fine_tune_optimizer is not None else None)
    return personal_eval, personal_eval, fine_tune_eval, fine_tune_eval
  # The same per-user outputs, users packed in shards.
  personal_eval = sharded_eval.ShardedPersonalEval(model_fn, num_shards,
                                                   wire=eval_wire)
  # Held-out test sets (test_datasets) are tf.data datasets.
  test_eval = (sharded_eval.ShardedPersonalEval(model_fn, num_shards)
               if batches_eval else personal_eval)
  if fine_tune_optimizer is None:
    return personal_eval, test_eval, None, None
  fine_tune_eval = sharded_eval.ShardedPersonalEval(
      model_fn, num_shards, fine_tune_optimizer=fine_tune_optimizer,
      wire=eval_wire, train_wire=train_wire)
  test_fine_tune_eval = (sharded_eval.ShardedPersonalEval(
      model_fn, num_shards, fine_tune_optimizer=fine_tune_optimizer,
      train_wire=train_wire) if batches_eval else fine_tune_eval)
  return personal_eval, test_eval, fine_tune_eval, test_fine_tune_eval


def personal_evaluator(task, proc, config: experiment.ExperimentConfig, store,
                       num_shards: int, eval_ids=None,
                       fine_tune: Optional[strategies_lib.FineTune] = None):
  """`(evaluate, eval_ids, eval_data_fn)` for `proc`'s state on `task`.

  `evaluate(state, datasets_fn, ids=eval_ids, fine_tune=config.eval_fine_tune,
  test=False)` tests the clients `ids` with their private states from
  `store` (after the local passes of the `fine_tune` strategy, default
  `FineTune()`: one pass, if `fine_tune`) and returns `task.evaluate`'s
  metrics; `evaluate.outputs` (same arguments) returns the per-client
  outputs instead. `eval_ids`: the clients evaluated by default (None:
  `config.eval_clients` of them drawn by the seed, `eval_client_ids`).
  Shared by training (`train`) and re-evaluation (`evaluate_experiment`).
  A `fine_tune` of a process whose evaluated clients hold no private
  variables (FedAvg's) tunes a copy of the whole global model, as FedAvg+FT
  does (`fedavg_ft.WholeModelView`).

  The traced evaluation computations are made once per process and
  evaluation settings (`experiment.derived`): the groups of a per-group
  stage, and a run evaluated again in the same Python process, reuse them.
  """
  whole_model = fine_tune is not None and not _has_private(proc)
  built_from = proc  # What the traced evaluators are kept with.
  if whole_model:
    proc = fedavg_ft.WholeModelView(proc)
  weights_type = proc.model_weights_type
  model_fn = getattr(proc, 'eval_model_fn', proc.model_fn)
  # The state evaluation sees (e.g. FedAvg+FT's: the global model to
  # fine-tune) and whether the process always fine-tunes before testing.
  state_type = getattr(proc, 'eval_client_state_type', proc.client_state_type)
  always_fine_tune = getattr(proc, 'eval_fine_tune', False)
  # The algorithm's declared protocol (Per-FedAvg's one step) unless a
  # strategy says otherwise.
  tune = fine_tune or strategies_lib.FineTune(
      steps=getattr(proc, 'eval_fine_tune_steps', None))
  fine_tune_optimizer = (tune.build_optimizer() or
                         getattr(proc, 'eval_fine_tune_optimizer', None) or
                         experiment.make_private_optimizer(config) or
                         experiment.make_client_optimizer(config)) if (
          fine_tune is not None or config.eval_fine_tune or
          config.test_fine_tune or always_fine_tune) else None
  # Sharded evaluation reads the task's numpy batches where it has them
  # (examples in its wire form); otherwise its tf.data datasets.
  wire = getattr(task, 'wire_format', None)
  batches_eval = bool(num_shards) and hasattr(task, 'eval_batches')
  eval_data_fn = task.eval_batches if batches_eval else task.eval_datasets
  batches_train = bool(num_shards) and hasattr(task, 'train_batches')
  fine_tune_train_fn = (task.train_batches if batches_train else
                        task.train_datasets)
  # The optimizer is made from the config: the key holds what it reads.
  optimizer_key = None if fine_tune_optimizer is None else (
      getattr(proc, 'eval_fine_tune_optimizer', None) is not None,
      config.private_learning_rate, config.private_optimizer,
      config.client_optimizer, config.client_learning_rate, tune.optimizer,
      tune.learning_rate)
  parts = experiment.derived(
      built_from, ('evaluators', num_shards, optimizer_key, batches_eval,
                   batches_train, repr(wire), whole_model),
      lambda: _evaluators(model_fn, weights_type, state_type, num_shards,
                          fine_tune_optimizer, batches_eval,
                          wire if batches_eval else None,
                          wire if batches_train else None))
  personal_eval, test_eval, fine_tune_eval, test_fine_tune_eval = parts
  if eval_ids is None:
    eval_ids = eval_client_ids(task.population, config.eval_clients,
                               config.seed)

  rounds_of = []  # The last `outputs_of` call's clients' participations.

  def outputs_of(state, datasets_fn, ids=eval_ids,
                 fine_tune=config.eval_fine_tune, test=False):
    fine_tune = fine_tune or always_fine_tune
    weights = proc.get_model_weights(state)
    plain, tuned = ((test_eval, test_fine_tune_eval) if test else
                    (personal_eval, fine_tune_eval))
    outputs = []
    rounds_of.clear()
    for i in range(0, len(ids), config.eval_chunk):
      chunk = ids[i:i + config.eval_chunk]
      stored = store.load(chunk)
      rounds_of.extend(s.get(process_lib.CLIENT_STATE_ROUNDS) for s in stored)
      states = process_lib.eval_client_states(proc, weights, stored)
      if not fine_tune:
        outputs.extend(plain(weights, states, datasets_fn(chunk)))
      else:  # The same fixed local pass at every evaluation.
        outputs.extend(tuned(
            weights, states, fine_tune_data(fine_tune_train_fn(
                chunk, config.rounds), tune), datasets_fn(chunk)))
    return outputs

  def evaluate(state, datasets_fn, ids=eval_ids,
               fine_tune=config.eval_fine_tune, test=False):
    outputs = outputs_of(state, datasets_fn, ids, fine_tune, test)
    return with_never_trained(task, task.evaluate(outputs, ids), ids,
                              outputs, list(rounds_of))

  evaluate.outputs = outputs_of
  return evaluate, eval_ids, eval_data_fn


def _has_private(proc) -> bool:
  """Whether `proc`'s evaluated clients hold private variables."""
  state_type = getattr(proc, 'eval_client_state_type', proc.client_state_type)
  private = state_type[process_lib.CLIENT_STATE_PRIVATE]
  return len(private) > 0  # pylint: disable=g-explicit-length-test


def fine_tune_data(data: Sequence[Any],
                   tune: strategies_lib.FineTune) -> list:
  """Each client's fine-tuning steps: its data (`tf.data.Dataset`s or
  `ClientBatches` of one pass) cut into `tune.batch_size` batches, visited
  `tune.epochs` times, or its first `tune.steps` batches, the passes
  repeated (`strategies.FineTune`)."""
  if tune.batch_size is None and tune.steps is None and tune.epochs == 1:
    return list(data)
  return [_client_steps(d, tune) for d in data]


def _client_steps(data, tune: strategies_lib.FineTune):
  """One client's fine-tuning steps (`fine_tune_data`)."""
  if isinstance(data, client_data_lib.ClientBatches):
    batches = list(data.index_batches)
    if tune.batch_size is not None:
      order = (np.concatenate(batches) if batches else
               np.zeros([0], np.int64))
      batches = [order[i:i + tune.batch_size]
                 for i in range(0, len(order), tune.batch_size)]
    if tune.steps is None:
      batches = batches * tune.epochs
    elif batches:
      passes = -(-tune.steps // len(batches))
      batches = (batches * passes)[:tune.steps]
    return dataclasses.replace(data, index_batches=tuple(batches))
  if tune.batch_size is not None:
    data = data.unbatch().batch(tune.batch_size)
  if tune.steps is None:
    return data.repeat(tune.epochs) if tune.epochs > 1 else data
  # An empty pass repeated is empty (tf.data ends a repeat whose epoch
  # gave nothing).
  return data.repeat().take(tune.steps)


NEVER_TRAINED = 'never_trained_clients'
# Where a run's summary and an evaluation record keep each strategy's
# results (`evaluate_strategies`).
STRATEGIES = 'strategies'
TRAINED_PREFIX = 'trained/'
NEVER_TRAINED_PREFIX = 'never_trained/'


def with_never_trained(task, metrics: dict, ids: Sequence[int],
                       outputs: Sequence[Any], rounds: Sequence[Any]) -> dict:
  """`metrics` (over every evaluated client) and how many of those clients
  never took part in a training round (`never_trained_clients`, from their
  states' `rounds_participated`); when some did and some did not, also the
  metrics of the trained ones alone (`trained/<name>`) and of the others
  (`never_trained/<name>`): a client never sampled is scored on its
  initial private state (a random head, say), which the pooled number
  mixes in.

  Unchanged when the states count no participation.
  """
  if not rounds or any(r is None for r in rounds):
    return metrics
  trained = [i for i, r in enumerate(rounds) if int(r) > 0]
  out = dict(metrics)
  out[NEVER_TRAINED] = len(rounds) - len(trained)
  if 0 < len(trained) < len(rounds):
    never = [i for i, r in enumerate(rounds) if int(r) == 0]
    for prefix, part in ((TRAINED_PREFIX, trained),
                         (NEVER_TRAINED_PREFIX, never)):
      apart = task.evaluate([outputs[i] for i in part],
                            [ids[i] for i in part])
      out.update({prefix + k: v for k, v in apart.items()
                  if isinstance(v, (int, float)) and not isinstance(v, bool)})
  return out


def curve_eval_ids(eval_ids: Sequence[int], curve_eval_clients: int,
                   seed: int) -> list[int]:
  """The clients the learning curve's points test: `curve_eval_clients` of
  `eval_ids` drawn by `seed` (sorted), or all of `eval_ids` for 0.

  Raises:
    ValueError: `curve_eval_clients` is negative or more than `eval_ids`.
  """
  ids = sorted(int(i) for i in eval_ids)
  if not 0 <= curve_eval_clients <= len(ids):
    raise ValueError('curve_eval_clients must be in [0, the evaluated '
                     f'clients={len(ids)}], got {curve_eval_clients}')
  if not curve_eval_clients or curve_eval_clients == len(ids):
    return ids
  rng = np.random.default_rng([seed, 0xC0E7])
  return np.sort(rng.choice(ids, curve_eval_clients,
                            replace=False)).tolist()


def checked_eval_ids(eval_ids: Sequence[int], population: int) -> list[int]:
  """`eval_ids` as a sorted list of ints; refuses repeats, clients outside
  [0, population) and an empty list."""
  ids = [int(i) for i in eval_ids]
  if not ids:
    raise experiment.ConfigurationError(
        'eval_ids is empty: give at least one client')
  if len(set(ids)) != len(ids):
    raise experiment.ConfigurationError('eval_ids repeats clients')
  outside = [i for i in ids if not 0 <= i < population]
  if outside:
    raise experiment.ConfigurationError(
        f'eval_ids {outside[:5]} are outside the '
        f'population [0, {population})')
  return sorted(ids)


def eval_client_ids(population: int, eval_clients: int, seed: int
                    ) -> list[int]:
  """The users a run evaluates: `eval_clients` of them drawn by `seed`
  (sorted), or all of them when `eval_clients` is 0."""
  if not 0 <= eval_clients <= population:
    raise ValueError(f'eval_clients must be in [0, population={population}], '
                     f'got {eval_clients}')
  if not eval_clients:
    return list(range(population))
  rng = np.random.default_rng([seed, 0xE7A1])
  return np.sort(rng.choice(population, eval_clients,
                            replace=False)).tolist()


def validation_client_ids(population: int, clients: int, eval_clients: int,
                          seed: int) -> list[int]:
  """Validation users for choosing hyperparameters (sorted): `clients` of
  them drawn by `seed` from the users that `eval_client_ids(population,
  eval_clients, seed)` does not test, so validation and test never share a
  user.

  Raises:
    ValueError: `eval_clients` is 0 (every user is tested) or fewer than
      `clients` users are left, or `clients` < 1.
  """
  test = set(eval_client_ids(population, eval_clients, seed))
  rest = [i for i in range(population) if i not in test]
  if not 0 < clients <= len(rest):
    raise ValueError(f'validation clients must be in [1, {len(rest)}] (the '
                     f'population {population} less {len(test)} test '
                     f'clients), got {clients}')
  rng = np.random.default_rng([seed, 0x7A1D])
  return np.sort(rng.choice(rest, clients, replace=False)).tolist()


def load_client_states(proc, config: experiment.ExperimentConfig,
                       population: int, directory: str, rounds: int) -> list:
  """Every client's state as committed at round `rounds` by the run of
  `proc` in `directory` (its `client_states/` store), read only.

  For reading back a finished run (or a stage of one): the store is opened,
  restored to that round's snapshot, read and closed; nothing is written.
  """
  store = client_state_lib.make_store(
      config.client_state_backend,
      experiment.initial_client_state_fn(proc, config),
      population=population,
      directory=os.path.join(directory, 'client_states'))
  try:
    store.restore(rounds)
    return store.load(list(range(population)))
  finally:
    store.close()


EVALUATIONS_DIRNAME = 'evaluations'


class EvaluationError(ValueError):
  """A run cannot be re-evaluated as asked (names the file and why)."""


def evaluation_path(config: experiment.ExperimentConfig, eval_name: str) -> str:
  return os.path.join(config.experiment_dir, EVALUATIONS_DIRNAME,
                      f'{eval_name}.json')


@run_records.holding_lock(create=False)
def evaluate_experiment(task, config: experiment.ExperimentConfig,
                        eval_name: Optional[str],
                        log_fn: Callable[[str], None] = print,
                        overwrite: bool = False,
                        flag_values: Optional[dict[str, Any]] = None
                        ) -> dict:
  """Evaluates a finished run's final state again; writes nothing else.

  Needs `<experiment_dir>/summary.json` (a run writes it when it ends) and
  reads the latest server checkpoint (its round is the evaluated round) and
  the clients' private states as committed at that round, then runs the
  same evaluations as the end of training (`eval`; `test` /
  `test_fine_tuned` with a held-out split; `cold_start`) under this
  config's evaluation fields (`EVALUATION_FIELDS`: e.g. `eval_fine_tune`,
  `eval_clients`). A run whose last stage ran per group is evaluated as
  its training did: each evaluated client with its own group's final model
  and state, pooled (`eval`; each group's own in `groups`). The result goes
  to `<experiment_dir>/evaluations/<eval_name>.json` (refused if it exists,
  unless `overwrite`; with `eval_name` None it is only returned); the
  checkpoints, the client-state store and summary.json are only read. The
  config's other fields must be those the run recorded when it started
  (`run_config.json`, required; `rounds` is taken from the checkpoint);
  `binaries.evaluate` also compares its flags (the task's too) with
  summary.json. The record's privacy report is recomputed from
  run_config.json's DP configuration and the rounds the run started
  (`run_privacy_report`), not copied from summary.json. The config's
  `eval_strategies` are evaluated too (`evaluate_strategies`; the record's
  `strategies`): e.g. a `ColdStart` evaluates the task's withheld users as
  new users.

  Raises:
    EvaluationError: the run has not finished, was trained under another
      config, or the output exists.
    training_loop.CheckpointError: the last round's checkpoint is missing or
      unreadable.
    client_state_lib.ClientStateStoreError: the stored states do not match
      that round.
    run_lock.ExperimentLockedError: another process holds the experiment
      directory (a training or another evaluation).
  """
  try:
    named = strategies_lib.resolve(config.eval_strategies)
    check_strategies(task, named)
  except ValueError as e:
    raise EvaluationError(f'eval_strategies: {e}') from e
  if eval_name is not None and (not eval_name or os.sep in eval_name or
                                eval_name.startswith('.')):
    raise EvaluationError(f'eval_name must be a plain file name, got '
                          f'{eval_name!r}')
  summary_path = os.path.join(config.experiment_dir, 'summary.json')
  if not os.path.exists(summary_path):
    raise EvaluationError(
        f'{summary_path} does not exist: the run in {config.experiment_dir} '
        'has not finished (resume it with binaries.train --resume); only '
        'finished runs are re-evaluated')
  out_path = eval_name and evaluation_path(config, eval_name)
  if out_path and os.path.exists(out_path) and not overwrite:
    raise EvaluationError(f'{out_path} exists; choose another eval_name or '
                          'overwrite it on purpose')
  per_group = os.path.isdir(os.path.join(config.experiment_dir,
                                         experiment.GROUPS_DIRNAME))
  # The round is the last checkpoint's (the store must be committed there).
  rounds = (run_records.read_json_record(summary_path, EvaluationError).get(
      'rounds_completed') if per_group else
            training_loop.completed_round(config.experiment_dir))
  if not rounds:
    raise training_loop.CheckpointError(
        f'{config.experiment_dir} has no checkpoint of a trained round '
        f'(checkpoints: '
        f'{training_loop.checkpoint_rounds(config.experiment_dir) or "none"})')
  # The evaluation's local pass reads the data of the run's last round.
  config = dataclasses.replace(config, rounds=rounds)
  population = task.population
  dp = experiment.validate(config, population)
  record_path = os.path.join(config.experiment_dir,
                             run_records.RUN_CONFIG_FILENAME)
  if not os.path.exists(record_path):
    raise EvaluationError(
        f'{record_path} is missing: without the record of the run\'s '
        'configuration, neither the configuration nor the privacy report '
        'of the run can be checked. Restore the file from a backup.')
  started = run_records.read_json_record(record_path,
                                         EvaluationError).get('config', {})
  lines = run_records.differences(
      started,
      run_records.run_record(config, dp, None)['config'])
  if lines:
    raise EvaluationError(
        f'{config.experiment_dir} was trained with another configuration '
        f'({record_path}):\n  ' + '\n  '.join(lines))
  # The run's guarantee, recomputed from its recorded DP configuration and
  # the rounds it ran (summary.json's copy is not trusted).
  run_dp = (privacy.DPConfig(**{**started['dp'], 'rounds': rounds})
            if started.get('dp') else dp)
  built = experiment.build_process(task, config, dp=dp)
  proc = stages_lib.final_process(built)
  try:
    check_strategies(task, named)
  except experiment.ConfigurationError as e:
    raise EvaluationError(f'eval_strategies: {e}') from e
  t_start = time.perf_counter()
  if per_group:
    try:
      named = per_group_strategies(named)
    except experiment.ConfigurationError as e:
      raise EvaluationError(str(e)) from e
    groups = experiment.group_members(task, config, built.stages[-1].grouping)
    run_report = run_privacy.group_privacy_report(
        config, run_dp, groups, run_privacy.earlier_stages_noised(config))
    result = evaluate_per_group(task, proc, config, groups, named)
    log_fn(f'eval, each client on its group\'s model: '
           f'{evaluation.format_metrics(result["eval"])}')
  else:
    run_report = run_privacy.run_privacy_report(
        config, run_dp, rounds,
        run_privacy.rounds_noised(config.experiment_dir),
        run_privacy.earlier_stages_noised(config))
    num_shards = sharded.resolve_num_shards(proc, config.simulation_shards)
    state = training_loop.load_checkpoint(proc, config.experiment_dir,
                                          rounds)
    store = open_committed_store(proc, config, population,
                                 config.experiment_dir, rounds)
    try:
      evaluate, _, eval_data_fn = personal_evaluator(
          task, proc, config, store, num_shards)
      result = {'eval': evaluate(state, eval_data_fn)}
      log_fn(f'eval: {evaluation.format_metrics(result["eval"])}')
      result.update(final_evaluations(task, proc, state, store, config,
                                      evaluate, log_fn))
      if named:
        result[STRATEGIES] = evaluate_strategies(
            task, proc, state, store, config, named, num_shards,
            run_delta=run_delta(run_dp, population), log_fn=log_fn)
    finally:
      store.close()
  record = {
      'eval_name':
          eval_name,
      'round':
          rounds,
      **result,
      'seconds':
          time.perf_counter() - t_start,
      'evaluation': {
          k: getattr(config, k) for k in run_records.EVALUATION_FIELDS
      },
      # The shared model's guarantee is the run's; evaluation metrics, like
      # training's, are simulation diagnostics.
      'privacy':
          run_report,
      'flags':
          flag_values
          if flag_values is not None else dataclasses.asdict(config),
  }
  if out_path:
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    training_loop.write_summary(out_path, record)
  return record


def run_delta(dp: privacy.DPConfig, population: int) -> Optional[float]:
  """The delta of a run's DP guarantee (None without DP)."""
  if not dp.is_private:
    return None
  return dp.target_delta or privacy.default_target_delta(population)


def open_committed_store(proc, config: experiment.ExperimentConfig,
                         population: int, directory: str, rounds: int):
  """The client-state store of the run of `proc` in `directory`, holding
  the states committed at round `rounds`, opened for reading (the caller
  closes it).

  Raises:
    client_state_lib.ClientStateStoreError: the store is missing or empty,
      or is committed at another round (an on-disk store keeps only its
      last round).
  """
  where = os.path.join(directory, 'client_states')
  missing = client_state_lib.missing_store(config.client_state_backend,
                                           where, population)
  if missing is not None:
    raise client_state_lib.ClientStateStoreError(
        f'the client-state store {missing} is missing or empty; it should '
        f'hold the client states committed at round {rounds}')
  store = client_state_lib.make_store(config.client_state_backend,
                                      experiment.initial_client_state_fn(
                                          proc, config),
                                      population=population,
                                      directory=where)
  try:
    if isinstance(store, client_state_lib.InMemoryClientStateStore):
      store.restore(rounds)  # Loads snapshot `rounds`; writes nothing.
    elif store.committed_round() != rounds:
      raise client_state_lib.ClientStateStoreError(
          f'the client-state store in {directory} is committed at round '
          f'{store.committed_round()}, not at round {rounds}')
  except BaseException:
    store.close()
    raise
  return store


def pooled_metrics(task, ids: list, outputs: list) -> dict:
  """`task.evaluate` of per-client outputs gathered in any order."""
  if not ids:
    return {}
  order = np.argsort(ids, kind='stable')
  return task.evaluate([outputs[i] for i in order], [ids[i] for i in order])


def evaluate_per_group(task, proc, config: experiment.ExperimentConfig,
                       groups: dict[str, list[int]],
                       named: Optional[Mapping[str, Any]] = None) -> dict:
  """`{'eval': pooled metrics, 'groups': {group: its metrics}}` of a finished
  per-group run: each evaluated client tested with its group's last
  checkpoint and its state committed there, as training's last
  evaluation (`_run_per_group`) tested it. With `named` per-client
  strategies, also `'strategies'` (`pooled_strategies`)."""
  eval_set = set(eval_client_ids(task.population, config.eval_clients,
                                 config.seed))
  num_shards = sharded.resolve_num_shards(proc, config.simulation_shards)
  ids, outputs, per_group = [], [], {}
  named = dict(named or {})
  strategy_outputs = {n: {} for n in named}
  for name, members in groups.items():
    local_eval = [i for i, c in enumerate(members) if c in eval_set]
    if not local_eval:
      continue
    directory = experiment.group_directory(config, name)
    rounds = training_loop.completed_round(directory)
    if rounds != config.rounds:
      raise training_loop.CheckpointError(
          f'{directory} has no checkpoint of round {config.rounds} (its last: '
          f'{rounds}); its group\'s run has not finished')
    view = task_lib.TaskSubset(task, members, name=task_lib.task_name(task))
    state = training_loop.load_checkpoint(proc, directory, rounds)
    store = open_committed_store(proc, config, len(members), directory,
                                 rounds)
    try:
      evaluate, _, eval_data_fn = personal_evaluator(
          view, proc, config, store, num_shards, eval_ids=local_eval)
      outs = list(evaluate.outputs(state, eval_data_fn, ids=local_eval))
      for n, strategy in named.items():
        strategy_outputs[n][name] = (view.global_ids(local_eval), list(
            strategy_evaluator(view, proc, config, store, num_shards,
                               strategy, local_eval).outputs(state)))
    finally:
      store.close()
    per_group[name] = view.evaluate(outs, local_eval)
    ids += view.global_ids(local_eval)
    outputs += outs
  result = {'eval': pooled_metrics(task, ids, outputs), 'groups': per_group}
  if named:
    result[STRATEGIES] = pooled_strategies(task, named, strategy_outputs)
  return result


def final_evaluations(task, proc, state, store,
                      config: experiment.ExperimentConfig, evaluate,
                      log_fn) -> dict:
  """The evaluations after the last round: `test`, `test_fine_tuned`,
  `cold_start` (None where the task or config has none)."""
  out = dict(test=None, test_fine_tuned=None, cold_start=None)
  if hasattr(task, 'test_datasets'):  # held-out test split, after training
    out['test'] = evaluate(state, task.test_datasets, test=True)
    log_fn(f'test: {evaluation.format_metrics(out["test"])}')
    if config.test_fine_tune:
      out['test_fine_tuned'] = evaluate(state, task.test_datasets,
                                        fine_tune=True, test=True)
      log_fn(f'test after one local pass of private state: '
             f'{evaluation.format_metrics(out["test_fine_tuned"])}')
  if getattr(task, 'cold_client_ids', None):
    out['cold_start'] = evaluate_cold_start(task, proc, state, store, config)
    log_fn(f'cold start ({len(task.cold_client_ids)} users never trained): '
           f'{evaluation.format_metrics(out["cold_start"])}')
  return out


def evaluate_cold_start(task, proc, state, store,
                        config: experiment.ExperimentConfig) -> dict:
  """Users who never trained: initial private state + local steps, then test.

  Their initial state is the store's documented one (the seeded
  `personal_init_stddev` normal draw for their id); `cold_start_epochs` passes
  over their own training data update only their private variables with the
  optimizer that trains private variables in training, and nothing leaves the
  client.
  """
  cold_eval = evaluation.build_cold_start_eval(
      getattr(proc, 'eval_model_fn', proc.model_fn), proc.model_weights_type,
      getattr(proc, 'eval_client_state_type', proc.client_state_type),
      experiment.make_private_optimizer(config) or
      experiment.make_client_optimizer(config))
  ids = list(task.cold_client_ids)
  weights = proc.get_model_weights(state)
  states = process_lib.eval_client_states(
      proc, weights, [store.initial_state(i) for i in ids])
  train, test = task.cold_start_datasets(ids, config.cold_start_epochs)
  outputs = []
  for i in range(0, len(ids), config.eval_chunk):
    sl = slice(i, i + config.eval_chunk)
    outputs.extend(cold_eval(weights, states[sl], train[sl], test[sl]))
  return task.evaluate(outputs, ids)


def strategy_evaluator(task, proc, config: experiment.ExperimentConfig, store,
                       num_shards: int, strategy: strategies_lib.Strategy,
                       eval_ids=None) -> Callable[..., dict]:
  """`evaluate(state, ids=eval_ids, test=False)`: the metrics of the
  per-client `strategy` (`AsTrained`, `FineTune` or `Adapt`) on the clients
  `ids`' evaluation data (their held-out test split with `test`),
  never-trained clients counted and reported apart (`with_never_trained`);
  `evaluate.outputs(state, ids)`: the per-client outputs instead.

  Raises:
    experiment.ConfigurationError: the task cannot run the strategy
      (`check_strategies`).
  """
  if not isinstance(strategy, strategies_lib.PER_CLIENT):
    raise ValueError(f'{strategies_lib.to_text(strategy)} does not score '
                     'the evaluated clients')
  check_strategies(task, {'': strategy})
  tune = strategy if isinstance(strategy, strategies_lib.FineTune) else None
  evaluate, default_ids, eval_data_fn = personal_evaluator(
      task, proc, config, store, num_shards, eval_ids, fine_tune=tune)
  if isinstance(strategy, strategies_lib.Adapt):
    eval_data_fn = functools.partial(eval_data_fn, samples=strategy.samples)

  def evaluate_strategy(state, ids=default_ids, test=False):
    if test and isinstance(strategy, strategies_lib.Adapt):
      raise ValueError('adapt scores the evaluation data only')
    return evaluate(state, task.test_datasets if test else eval_data_fn,
                    ids=ids, fine_tune=tune is not None, test=test)

  def outputs(state, ids=default_ids):
    return evaluate.outputs(state, eval_data_fn, ids=ids,
                            fine_tune=tune is not None)

  evaluate_strategy.outputs = outputs  # The per-client outputs instead.
  return evaluate_strategy


def check_strategies(task, named: Mapping[str, strategies_lib.Strategy]
                     ) -> None:
  """Refuses strategies that `task` cannot run, before anything runs.

  Raises:
    experiment.ConfigurationError: an `adapt` on a task whose evaluation
      data has no adaptation samples to limit (`eval_datasets(ids,
      samples=)`), or a `cold_start` on a task without withheld users.
  """
  for name, strategy in named.items():
    label = f'strategy {name + "=" if name else ""}' + strategies_lib.to_text(
        strategy)
    if isinstance(strategy, strategies_lib.Adapt):
      data_fns = [getattr(task, n) for n in ('eval_datasets', 'eval_batches')
                  if hasattr(task, n)]
      if not data_fns or any('samples' not in inspect.signature(
          fn).parameters for fn in data_fns):
        raise experiment.ConfigurationError(
            f'{label}: the evaluation data of task {task_lib.task_name(task)}'
            ' has no adaptation samples to limit (its eval_datasets / '
            'eval_batches take no samples=)')
    if isinstance(strategy, strategies_lib.ColdStart) and not getattr(
        task, 'withheld_names', None):
      raise experiment.ConfigurationError(
          f'{label}: task {task_lib.task_name(task)} has no withheld users '
          '(the `withheld` capability) to evaluate as new users')


def per_group_strategies(named: Mapping[str, strategies_lib.Strategy]
                         ) -> dict[str, strategies_lib.Strategy]:
  """`named`, checked for a run that ends with a model per group: each
  evaluated client is scored with its own group's model, so every strategy
  must be per-client (a cold start has no group).

  Raises:
    experiment.ConfigurationError: a strategy is not per-client.
  """
  others = [n for n, s in named.items()
            if not isinstance(s, strategies_lib.PER_CLIENT)]
  if others:
    raise experiment.ConfigurationError(
        f'strategies {others} evaluate users outside every group on one '
        'final model; this run ends with a model per group')
  return dict(named)


def pooled_strategies(task, named, outputs: Mapping[str, Mapping[str, tuple]]
                      ) -> dict:
  """`{name: {'strategy', 'eval'}}` from each strategy's per-group
  `(global ids, outputs)`, pooled over the groups (`pooled_metrics`)."""
  out = {}
  for name, strategy in named.items():
    ids, outs = [], []
    for group_ids, group_outs in outputs.get(name, {}).values():
      ids += list(group_ids)
      outs += list(group_outs)
    out[name] = {'strategy': strategies_lib.to_text(strategy),
                 'eval': pooled_metrics(task, ids, outs)}
  return out


def evaluate_strategies(task, proc, state, store,
                        config: experiment.ExperimentConfig,
                        named: Mapping[str, strategies_lib.Strategy],
                        num_shards: int, eval_ids=None,
                        run_delta: Optional[float] = None,
                        log_fn: Optional[Callable[[str], None]] = None,
                        evaluated: Optional[Mapping[str, dict]] = None
                        ) -> dict:
  """Every named strategy's results on `proc`'s final `state`.

  Args:
    task, proc, state, store, config, num_shards: the run's, as for
      `personal_evaluator`.
    named: `{name: strategy}` (`strategies.resolve`).
    eval_ids: the evaluated clients (None: the config's).
    run_delta: the delta of the run's DP guarantee, if any (a cold start's
      DP average defaults to it).
    log_fn: each result's line.
    evaluated: `{name: eval metrics}` already computed on `eval_ids` (the
      loop's last evaluation), not computed again.

  Returns:
    `{name: {'strategy': its text, 'eval': metrics, 'test': metrics (a task
    with a held-out split)}}` for per-client strategies, and `{name:
    {'strategy': ..., **new_user_evaluation.evaluate_new_users(...)}}` for
    `ColdStart`.
  """
  out = {}
  for name, strategy in named.items():
    text = strategies_lib.to_text(strategy)
    if isinstance(strategy, strategies_lib.ColdStart):
      try:
        result = new_user_evaluation.evaluate_new_users(
            task, proc, state, store, config, strategy, run_delta, log_fn)
      except new_user_evaluation.NewUserError as e:
        raise EvaluationError(str(e)) from e
      out[name] = {'strategy': text, **result}
      continue
    evaluate = strategy_evaluator(task, proc, config, store, num_shards,
                                  strategy, eval_ids)
    result = {'strategy': text,
              'eval': (evaluated or {}).get(name) or evaluate(state)}
    if hasattr(task, 'test_datasets') and not isinstance(
        strategy, strategies_lib.Adapt):
      result['test'] = evaluate(state, test=True)
    out[name] = result
    if log_fn:
      log_fn(f'strategy {name} ({text}): '
             f'{evaluation.format_metrics(result["eval"])}')
  return out


def write_private_states(store, ids, directory) -> None:
  states = store.load(ids)
  arrays = {'ids': np.asarray(ids, np.int64)}
  for i in range(len(states[0]['private']) if states else 0):
    arrays[f'private_{i}'] = np.stack([s['private'][i] for s in states])
  if states and 'rounds_participated' in states[0]:
    arrays['rounds_participated'] = np.asarray(
        [s['rounds_participated'] for s in states], np.int64)
  np.savez(os.path.join(directory, 'private_states.npz'), **arrays)


# Names that moved away raise an error naming their new place.
__getattr__ = moved.module_getattr(__name__)
