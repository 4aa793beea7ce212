"""Training one run: the loop over every stage, per group where the stage
says so, shared earlier stages, and the summary (`train`;
`runs.run_experiment` is the public entry, which returns the run's handle).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np

from tff_personal.config import experiment
from tff_personal.config import strategies as strategies_lib
from tff_personal.core import client_state as client_state_lib
from tff_personal.core import evaluation
from tff_personal.core import inprocess
from tff_personal.core import privacy
from tff_personal.core import sharded
from tff_personal.core import stages as stages_lib
from tff_personal.core import task as task_lib
from tff_personal.core import training_loop
from tff_personal.evaluation import run_evaluation
from tff_personal.records import run_lock
from tff_personal.records import run_privacy
from tff_personal.records import run_records


def train(task, config: experiment.ExperimentConfig | experiment.Resolved,
          log_fn: Callable[[str], None] = print,
          flag_values: Optional[dict[str, Any]] = None,
          export_private_states: bool = False,
          eval_ids: Optional[Sequence[int]] = None) -> tuple[dict, Any]:
  """Trains and evaluates; writes the summary (summary.json).

  `config`: the run's configuration, or it resolved against `task`
  (`experiment.resolve`, which this calls otherwise: the configuration is
  checked once, before the run's directory or lock is made).

  Returns (the summary, the process or `stages.Staged` it trained; None
  when the run had finished already and nothing was built).

  `runs.run_experiment` is the public entry: it returns this run's handle
  (`runs.Run`), which reads as this summary.

  `eval_ids`: the clients every evaluation tests (sorted, distinct, in the
  population), e.g. a validation sample disjoint from the clients a report
  tests; None: `config.eval_clients` of them drawn by the seed.

  With `export_private_states`, the final private states of the evaluated
  clients are written to `private_states.npz` (ids and each private tensor)
  for analysis such as the t-SNE of user embeddings. This reads every
  client's state, which only a simulation can do; a deployment never would.
  """
  resolved = experiment.resolve(task, config)
  return _train(task, resolved.config, resolved.dp, log_fn=log_fn,
                flag_values=flag_values,
                export_private_states=export_private_states,
                eval_ids=eval_ids)


@run_records.holding_lock(create=True)
def _train(task, config: experiment.ExperimentConfig, dp: privacy.DPConfig,
           log_fn: Callable[[str], None] = print,
           flag_values: Optional[dict[str, Any]] = None,
           export_private_states: bool = False,
           eval_ids: Optional[Sequence[int]] = None) -> tuple[dict, Any]:
  """`train` on a resolved configuration, holding the run's lock."""
  population = task.population
  if eval_ids is not None:
    eval_ids = run_evaluation.checked_eval_ids(eval_ids, population)
    if config.curve_eval_clients > len(eval_ids):
      raise experiment.ConfigurationError(
          f'curve_eval_clients={config.curve_eval_clients} is more than the '
          f'{len(eval_ids)} eval_ids')
  run_records.check_rounds_not_below_completed(config)
  resuming = bool(training_loop.checkpoint_rounds(config.experiment_dir))
  if resuming:  # Checks against the record; writes nothing.
    run_records.check_or_record_run_config(config, dp, flag_values,
                                           task_lib.build_record(task))
    finished = run_records.finished_summary(config)
    if finished is not None:
      log_fn(f'{config.experiment_dir} already finished its {config.rounds} '
             'rounds (summary.json); nothing was run and nothing was changed')
      return finished, None
  t_start = time.perf_counter()

  try:  # The builders check the rest of the configuration.
    built = experiment.build_process(task, config, dp=dp)
  except ValueError as e:
    raise experiment.ConfigurationError(str(e)) from e
  proc = stages_lib.final_process(built)
  if isinstance(built, stages_lib.Staged):
    _check_stage_cohorts(built, config, population)
  per_group = isinstance(built, stages_lib.Staged) and built.per_group
  named = strategies_lib.resolve(config.eval_strategies)
  run_evaluation.check_strategies(task, named)
  if per_group:  # Refused here, before any record or round.
    groups = experiment.group_members(task, config, built.stages[-1].grouping)
    named = run_evaluation.per_group_strategies(named)
  if not resuming:  # A new run's record, once its process could be built.
    os.makedirs(config.experiment_dir, exist_ok=True)
    run_records.check_or_record_run_config(config, dp, flag_values,
                                           task_lib.build_record(task))
  initial_state, earlier_noised = None, 0
  if isinstance(built, stages_lib.Staged):  # e.g. FedDVA: VAE, classifier
    initial_state, earlier_noised = _run_earlier_stages(task, built, config,
                                                        dp, log_fn)
  if per_group:  # e.g. GroupFL: one run of the last stage per group.
    return _run_per_group(task, proc, config, dp, groups, initial_state,
                          earlier_noised, log_fn, flag_values,
                          eval_ids, named), built
  train_proc, num_shards, store, train_data_fn = _training_parts(
      task, proc, config, config.experiment_dir, log_fn)

  evaluate, eval_ids, eval_data_fn = run_evaluation.personal_evaluator(
      task, proc, config, store, num_shards, eval_ids)

  curve_ids = run_evaluation.curve_eval_ids(eval_ids, config.curve_eval_clients,
                                            config.seed)

  # The per-client strategies are scored at every evaluation too.
  per_client = {name: run_evaluation.strategy_evaluator(
      task, proc, config, store, num_shards, s, eval_ids)
                for name, s in named.items()
                if isinstance(s, strategies_lib.PER_CLIENT)}

  def eval_fn(state, round_num):
    # A point of the learning curve, or the last round's evaluation.
    ids = curve_ids if round_num < config.rounds else eval_ids
    metrics = evaluate(state, eval_data_fn, ids=ids)
    if per_client:
      metrics[run_evaluation.STRATEGIES] = {name: fn(state, ids=ids)
                             for name, fn in per_client.items()}
    return metrics

  loop_config = _loop_config(config, config.experiment_dir, population)
  setup_seconds = time.perf_counter() - t_start
  try:
    result = training_loop.run_training(
        train_proc, store=store, train_data_fn=train_data_fn,
        config=loop_config, eval_fn=eval_fn, log_fn=log_fn,
        initial_state=initial_state)
    finals = run_evaluation.final_evaluations(task, proc, result.state, store,
                                              config, evaluate, log_fn)
    eval_metrics = dict(result.eval_metrics)
    if named:
      finals[run_evaluation.STRATEGIES] = run_evaluation.evaluate_strategies(
          task, proc, result.state, store, config, named, num_shards,
          eval_ids, run_evaluation.run_delta(dp, population), log_fn,
          evaluated=eval_metrics.pop(run_evaluation.STRATEGIES, None))
    if export_private_states:
      run_evaluation.write_private_states(store, eval_ids,
                                          config.experiment_dir)
  finally:
    store.close()

  # Every stage's shared update went through the run's aggregator.
  report = run_privacy.run_privacy_report(config, dp, result.rounds_completed,
                                          result.rounds_started, earlier_noised)
  summary = {
      'task': getattr(task, 'name', type(task).__name__),
      'algorithm': config.algorithm,
      'rounds_completed': result.rounds_completed,
      'rounds_run_in_this_process': result.rounds_run_here,
      'rounds_started': result.rounds_started,
      'resumed_from_round': result.resumed_from,
      'seconds_per_round': result.seconds_per_round,
      'first_round_seconds': result.first_round_seconds,
      'setup_seconds': setup_seconds,
      'population': population,
      'simulation_shards': num_shards,
      'eval': eval_metrics,
      **finals,
      'final_train_metrics': result.train_metrics,
  }
  return _write_summary(config, summary, report, flag_values, log_fn), built


def _write_summary(config: experiment.ExperimentConfig, summary: dict,
                   report: Optional[dict], flag_values, log_fn) -> dict:
  """Adds the privacy report and the flags, writes summary.json, logs the
  privacy spent; returns the summary."""
  summary = dict(summary, privacy=report, flags=(
      flag_values if flag_values is not None else dataclasses.asdict(config)))
  training_loop.write_summary(
      os.path.join(config.experiment_dir, 'summary.json'), summary)
  if report is not None:
    where = (' (the largest over groups)' if 'groups' in report else
             f', {report["sampling"]} sampling')
    log_fn(f'privacy: epsilon={report["epsilon"]:.4g}{where} '
           f'delta={report["delta"]:.3g} ({report["accountant"]}, '
           f'noise_multiplier={report["noise_multiplier"]:.4g})')
    if 'personal_heads' in report:
      heads = report['personal_heads']
      log_fn(f'privacy of the personal heads: epsilon={heads["epsilon"]:.4g} '
             f'delta={heads["delta"]:.3g} over at most {heads["passes"]} '
             'noised local passes per user (rdp, no subsampling)')
  return summary


def _loop_config(config: experiment.ExperimentConfig,
                 directory: str,
                 population: int,
                 rounds: int = 0,
                 clients_per_round: int = 0,
                 eval_every: Optional[int] = None) -> training_loop.LoopConfig:
  """The loop's configuration of one run in `directory` (the experiment's,
  an earlier stage's or a group's): the experiment's settings, with a
  stage's own `rounds` and `clients_per_round` where given (0: the
  experiment's)."""
  return training_loop.LoopConfig(
      rounds=rounds or config.rounds,
      clients_per_round=clients_per_round or config.clients_per_round,
      population=population,
      experiment_dir=directory,
      sampling=config.sampling,
      seed=config.seed,
      checkpoint_every=config.checkpoint_every,
      keep_checkpoints=config.keep_checkpoints,
      eval_every=config.eval_every if eval_every is None else eval_every,
      resume=config.resume,
      release_unnoised=experiment.releases_unnoised(config))


def _check_stage_cohorts(staged, config: experiment.ExperimentConfig,
                         population: int) -> None:
  """Refuses a stage cohort above the population, or one that differs from
  the experiment's under DP (one aggregator: its mean's denominator and the
  accounting are the experiment's cohort)."""
  for stage in staged.stages:
    m = stage.clients_per_round
    if not m or m == config.clients_per_round:
      continue
    if m > population:
      raise experiment.ConfigurationError(
          f'stage {stage.name!r} samples {m} clients per round from a '
          f'population of {population}')
    if config.dp.mechanism != 'none':
      raise experiment.ConfigurationError(
          f'under DP every stage samples the experiment\'s clients_per_round='
          f'{config.clients_per_round} (one aggregator and one accounting); '
          f'stage {stage.name!r} asks for {m}')


def _run_per_group(task, proc, config: experiment.ExperimentConfig, dp, groups,
                   initial_state, earlier_noised: int, log_fn,
                   flag_values, eval_ids=None, named=None) -> dict:
  """Runs a per-group last stage (`core/stages.py`) and writes the summary.

  Each group's run is the one loop on `core/task.TaskSubset(task, group)`
  in `group_directory` (its own checkpoints, store, metrics and resume),
  from `initial_state`. The evaluation tests each evaluated client with its
  group's final model and pools them with `task.evaluate`; each group's
  own metrics are in `summary['groups']` and its `eval_metrics.csv`. The
  per-client strategies `named` are scored so too (each group's curve;
  pooled in `summary['strategies']`).
  Privacy: a user took part in the earlier stages' rounds and in its own
  group's run only; epsilon is the largest over the groups of the two
  composed (`privacy.compute_epsilon_phases`).
  """
  if eval_ids is None:
    eval_ids = run_evaluation.eval_client_ids(task.population,
                                              config.eval_clients, config.seed)
  eval_set = set(eval_ids)
  curve_set = set(
      run_evaluation.curve_eval_ids(eval_ids, config.curve_eval_clients,
                                    config.seed))
  outputs, per_group, results = {}, {}, {}
  named = dict(named or {})
  strategy_outputs = {n: {} for n in named}
  # The groups' runs share one training form and one set of evaluators
  # (`experiment.derived`): each is traced once, not once per group.
  for name, members in groups.items():
    glog = lambda s, n=name: log_fn(f'[group {n}] {s}')
    view = task_lib.TaskSubset(task, members, name=task_lib.task_name(task))
    directory = experiment.group_directory(config, name)
    train_proc, num_shards, store, train_data_fn = _training_parts(
        view, proc, config, directory, glog)
    local_eval = [i for i, c in enumerate(members) if c in eval_set]
    local_curve = [i for i, c in enumerate(members) if c in curve_set]
    try:
      evaluate, _, eval_data_fn = run_evaluation.personal_evaluator(
          view, proc, config, store, num_shards, eval_ids=local_eval)
      strategy_fns = {n: run_evaluation.strategy_evaluator(
          view, proc, config, store, num_shards, s, local_eval)
                      for n, s in named.items()}

      def eval_fn(state, round_num, view=view, evaluate=evaluate,
                  eval_data_fn=eval_data_fn, local_eval=local_eval,
                  local_curve=local_curve, name=name,
                  strategy_fns=strategy_fns):
        ids = local_curve if round_num < config.rounds else local_eval
        if not ids:
          return {}
        outs = evaluate.outputs(state, eval_data_fn, ids=ids)
        outputs[name] = (view.global_ids(ids), outs)
        metrics = view.evaluate(outs, ids)
        if strategy_fns:
          metrics[run_evaluation.STRATEGIES] = {}
        for n, fn in strategy_fns.items():
          outs = fn.outputs(state, ids)
          strategy_outputs[n][name] = (view.global_ids(ids), outs)
          metrics[run_evaluation.STRATEGIES][n] = view.evaluate(outs, ids)
        return metrics

      result = training_loop.run_training(
          train_proc, store=store, train_data_fn=train_data_fn,
          config=_loop_config(config, directory, len(members)),
          eval_fn=eval_fn, log_fn=glog, initial_state=initial_state)
    finally:
      store.close()
    results[name] = result
    group_eval = dict(result.eval_metrics)
    group_strategies = group_eval.pop(run_evaluation.STRATEGIES, None)
    per_group[name] = {
        'clients': len(members), 'eval_clients': len(local_eval),
        'rounds_started': result.rounds_started,
        'resumed_from_round': result.resumed_from,
        'seconds_per_round': result.seconds_per_round,
        'eval': group_eval,
        **({run_evaluation.STRATEGIES: group_strategies}
           if group_strategies else {}),
        'final_train_metrics': result.train_metrics}
  ids, outs = [], []
  for name in groups:
    if name in outputs:
      ids += outputs[name][0]
      outs += list(outputs[name][1])
  eval_metrics = run_evaluation.pooled_metrics(task, ids, outs)
  log_fn(f'evaluation, each client on its group\'s model: '
         f'{evaluation.format_metrics(eval_metrics)}')
  noised = {name: max(r.rounds_completed, r.rounds_started or 0)
            for name, r in results.items()}
  report = run_privacy.run_privacy_report(config, dp, config.rounds,
                                          max(noised.values()), earlier_noised)
  if report is not None:
    report.update(run_privacy.per_group_privacy(config, dp, groups, noised,
                                                earlier_noised, report))
  times = [r.seconds_per_round for r in results.values()
           if r.seconds_per_round is not None]
  summary = {
      'task': task_lib.task_name(task),
      'algorithm': config.algorithm,
      'rounds_completed': config.rounds,
      'rounds_run_in_this_process': sum(r.rounds_run_here
                                        for r in results.values()),
      'rounds_started': max(noised.values()),
      'resumed_from_round': None,
      'seconds_per_round': float(np.mean(times)) if times else None,
      'first_round_seconds': None,
      'setup_seconds': None,
      'population': task.population,
      'simulation_shards': None,
      'eval': eval_metrics,
      'test': None, 'test_fine_tuned': None, 'cold_start': None,
      'groups': per_group,
      'final_train_metrics': {},
  }
  if named:
    summary[run_evaluation.STRATEGIES] = run_evaluation.pooled_strategies(
        task, named, strategy_outputs)
  return _write_summary(config, summary, report, flag_values, log_fn)


def _sharded_form(task, proc, config: experiment.ExperimentConfig,
                  num_shards: int, aggregate_in: str):
  """`proc` sharded as `config` says (itself for 0 shards), made once per
  process and settings (`experiment.derived`)."""
  # Tasks whose examples travel in a compact form (speech: uint8) say so.
  wire = getattr(task, 'wire_format', None)
  return experiment.derived(
      proc, ('training form', num_shards, repr(wire),
             config.simulation_batched, config.simulation_batch_users,
             aggregate_in),
      lambda: sharded.maybe_shard(
          proc, num_shards, wire, batched=config.simulation_batched,
          batch_users=(config.simulation_batch_users or None)
          if config.simulation_batched else None,
          aggregate_in=aggregate_in))


def _in_process_form(task, proc, config: experiment.ExperimentConfig,
                     num_shards: int):
  """The in-process training form of `proc`: sharded, the shards' work in
  the driver and the round's compiled pieces run here (compiled now, so
  that a process that does not compile says so before any round); with
  no shards, each user's device program too (`inprocess.build`).

  Raises:
    inprocess.NotInProcessError: the round does not compile.
  """
  if not num_shards:
    if config.simulation_batched:
      raise ValueError('batched training runs in shards; it needs '
                       'simulation_shards != 0')
    return experiment.derived(proc, ('training form', 'inprocess'),
                              lambda: inprocess.build(proc))
  form = _sharded_form(task, proc, config, num_shards,
                       sharded.AGGREGATE_IN_PROCESS)
  form.inprocess_round  # pylint: disable=pointless-statement
  return form


def _training_parts(task, proc, config: experiment.ExperimentConfig,
                    directory: str, log_fn):
  """`(train_proc, num_shards, store, train_data_fn)` of one process run
  in `directory` (its client-state store under `client_states/`).

  The training form (`train_proc`, e.g. the sharded one) is made once per
  process and settings (`experiment.derived`), so the groups of a
  per-group stage, or a run resumed in the same Python process, trace it
  once.
  """
  num_shards = sharded.resolve_num_shards(proc, config.simulation_shards)
  in_process = experiment.round_in_process(config, num_shards)
  train_proc = None
  if in_process:
    try:
      train_proc = _in_process_form(task, proc, config, num_shards)
    except inprocess.NotInProcessError as e:
      if config.simulation_round != 'auto':
        raise
      log_fn(f'simulation: the round runs on TFF\'s runtime ({e})')
      in_process = False
  if train_proc is None:
    train_proc = _sharded_form(task, proc, config, num_shards,
                               sharded.AGGREGATE_IN_TFF)
  where = ('in this process (its compiled production form)' if in_process
           else 'on TFF\'s runtime')
  log_fn((f'simulation: {num_shards} shards per round'
          + (', users trained together' if config.simulation_batched
             else '')) if num_shards else
         'simulation: one user per TFF client')
  log_fn(f'simulation: the round\'s aggregation and server step run {where}')
  rounds = training_loop.checkpoint_rounds(directory)
  if rounds and not config.resume:  # Before the store is opened: SQLite
    # would fold a killed run's write-ahead log into the database.
    raise training_loop.CheckpointError(
        f'{os.path.join(directory, "checkpoints")} already holds checkpoints '
        f'(rounds {rounds}); pass --resume to continue that run, or choose a '
        'new --experiment_name. Nothing was changed.')
  run_records.check_store_present(config, task.population, directory)
  store = client_state_lib.make_store(
      config.client_state_backend,
      experiment.initial_client_state_fn(proc, config),
      population=task.population,
      directory=os.path.join(directory, 'client_states'),
      # Every kept checkpoint keeps its client states (`Run.client_states`).
      keep_snapshots=max(2, config.keep_checkpoints))
  train_data_fn = (task.train_batches if num_shards and
                   hasattr(task, 'train_batches') else task.train_datasets)
  return train_proc, num_shards, store, train_data_fn


def _run_earlier_stages(task, staged: stages_lib.Staged,
                        config: experiment.ExperimentConfig, dp, log_fn):
  """Runs every stage but the last with the one loop, each in its own
  directory (resumed from there with `config.resume`; a finished stage runs
  no round again). Returns the last stage's initial server state and the
  rounds the earlier stages noised (started, replays included)."""
  state, noised = None, 0
  for stage, following in zip(staged.earlier, staged.stages[1:]):
    directory = experiment.stage_directory(config, stage.name)
    stage_log = lambda s, name=stage.name: log_fn(f'[{name}] {s}')
    stage_config, lock = config, contextlib.nullcontext()
    shared = _link_shared_stage(task, stage, config, dp, state is None)
    if shared is not None:  # One run of the stage for every run sharing it:
      # continued where any of them left it, under its own lock.
      stage_config = dataclasses.replace(config, resume=True)
      lock = run_lock.hold(shared)
      stage_log(f'shared stage: {shared}')
    with lock:
      train_proc, _, store, train_data_fn = _training_parts(
          task, stage.process, stage_config, directory, stage_log)
      try:
        result = training_loop.run_training(
            train_proc, store=store, train_data_fn=train_data_fn,
            config=_loop_config(
                stage_config, directory, task.population, rounds=stage.rounds,
                clients_per_round=stage.clients_per_round, eval_every=0),
            log_fn=stage_log, initial_state=state)
      finally:
        store.close()
    noised += max(result.rounds_completed, result.rounds_started or 0)
    state = following.handoff(result.state)
  return state, noised


SHARED_STAGES_DIRNAME = 'shared_stages'


_STAGE_IDENTITY_FILENAME = 'stage_identity.json'


def stage_identity(task, stage, config: experiment.ExperimentConfig,
                   dp: privacy.DPConfig) -> Optional[dict]:
  """What a shareable earlier stage's run depends on (None when it is not
  shareable: `stage.shared_as` unset, or the task not built by name, so
  that its identity is unknown). Two runs whose stages have equal
  identities train the same stage run."""
  built = task_lib.build_record(task)
  if not stage.shared_as or built is None:
    return None
  # Not the algorithm's (the stage's process is named by `shared_as`),
  # nor what a resumed run may change; DP as resolved, below.
  # The experiment's cohort reaches the stage through its DP aggregator
  # only (`clients_per_round` below is the stage's own).
  skip = ('algorithm', 'algorithm_options', 'dp',
          'clients_per_round') + run_records.RESUMABLE_FIELDS
  training = {k: v for k, v in dataclasses.asdict(config).items()
              if k not in skip and
              run_records.LEGACY_VALUES.get(k, ()) != v}
  return run_records.as_json({
      'stage': stage.name, 'process': stage.shared_as,
      'rounds': stage.rounds,
      'clients_per_round': stage.clients_per_round or config.clients_per_round,
      'task': {'name': built['name'], 'arguments': {
          k: v for k, v in built['arguments'].items() if k != 'data_dir'}},
      'training': training,
      'dp': {'mechanism': 'none'} if dp.mechanism == 'none' else {
          k: v for k, v in dataclasses.asdict(dp).items() if k != 'rounds'}})


def _link_shared_stage(task, stage, config: experiment.ExperimentConfig,
                       dp: privacy.DPConfig, first: bool) -> Optional[str]:
  """The shared run directory of `stage` if it is shared (`stage_identity`),
  linked from the experiment's `stages/<name>` (a relative symlink); None
  for a stage of the experiment's own, or one an earlier run of this
  experiment already trained in its own directory."""
  identity = stage_identity(task, stage, config, dp) if first else None
  directory = experiment.stage_directory(config, stage.name)
  if identity is None or (os.path.lexists(directory) and
                          not os.path.islink(directory)):
    return None
  key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()
                       ).hexdigest()[:16]
  shared = os.path.join(config.root_output_dir, SHARED_STAGES_DIRNAME,
                        f'{stage.name}-{key}')
  os.makedirs(shared, exist_ok=True)
  path = os.path.join(shared, _STAGE_IDENTITY_FILENAME)
  if not os.path.exists(path):
    training_loop.write_summary(path, identity)
  elif run_records.read_json_record(path, run_records.ResumeError) != identity:
    raise run_records.ResumeError(
        f'{path} records another stage under the same key; '
        'move the directory away. Nothing was changed.')
  if not os.path.lexists(directory):
    os.makedirs(os.path.dirname(directory), exist_ok=True)
    os.symlink(os.path.relpath(shared, os.path.dirname(directory)),
               directory)
  elif os.path.realpath(directory) != os.path.realpath(shared):
    raise run_records.ResumeError(
        f'{directory} links to {os.path.realpath(directory)}, '
        f'not to this stage\'s shared run {shared}. Nothing '
        'was changed.')
  return shared
