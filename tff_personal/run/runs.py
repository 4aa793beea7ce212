"""Runs: `run_experiment` trains one; `Run` is the handle on any run.

`Run.open(directory)` rebuilds a finished or interrupted run from what it
recorded when it started (`run_config.json`: the configuration with DP as
resolved, and how its task was built), so nothing outside the library
parses a run's files. A `Run` reads as its summary (a mapping: `run['eval']`)
once the run has finished, and offers:

* `config`, `digest`, `task`, `summary`, `finished`, `privacy_report()`;
* `curves()`: the released training and evaluation metrics per round;
* `weights(round=, stage=, group=)`, `client_states(ids, ...)`: the shared
  model and the clients' private states as checkpointed (the process is
  rebuilt with the run's DP aggregator, so DP runs load);
* `evaluate(...)`: the run's final state evaluated again, under other
  evaluation settings or strategies if asked;
* `client_outputs(ids, strategy, round=, stage=)`: each client's
  evaluation outputs under one per-client strategy, at any kept round;
* `participations(stage=)`: the training rounds each client took part in;
* `resume(rounds=)`: continues an interrupted run, or extends a finished one.

What runs TFF computations (`run_experiment`, `weights`, `client_states`,
`evaluate`, ...) runs in the installed runtime, or, called outside
`runtime.local_runtime()`, in one of its own for the call. A record that
cannot be used (unreadable, or edited after the run started) is a
`DamagedRunError`.

Example:

  run = runs.run_experiment(task, config)     # trains; a Run
  run = runs.Run.open('/tmp/out/fedrep_dp')   # any run, later
  print(run['eval'], run.privacy_report()['epsilon'])
  weights = run.weights()                     # the last checkpoint's
  states = run.client_states([0, 1, 2])
  again = run.evaluate(eval_fine_tune=True)   # returned, not written
"""

from __future__ import annotations

import collections
import collections.abc
import dataclasses
import functools
import hashlib
import json
import os
from typing import Any, Callable, Optional, Sequence

import numpy as np

from tasks import registry as task_registry
from tff_personal.algorithms import registry as algorithm_registry
from tff_personal.config import experiment
from tff_personal.config import run_spec
from tff_personal.config import strategies as strategies_lib
from tff_personal.core import privacy
from tff_personal.core import runtime
from tff_personal.core import sharded
from tff_personal.core import stages as stages_lib
from tff_personal.core import task as task_lib
from tff_personal.core import training_loop
from tff_personal.evaluation import run_evaluation
from tff_personal.records import run_privacy
from tff_personal.records import run_records
from tff_personal.run import training

SUMMARY_FILENAME = 'summary.json'


def _in_runtime(fn):
  """`fn`, run in the installed runtime or, called outside one, in a
  `runtime.local_runtime()` of its own (`runtime.ensure_runtime`)."""
  @functools.wraps(fn)
  def call(*args, **kwargs):
    with runtime.ensure_runtime():
      return fn(*args, **kwargs)
  return call


@_in_runtime
def run_experiment(task,
                   config: experiment.ExperimentConfig | experiment.Resolved,
                   log_fn: Callable[[str], None] = print,
                   flag_values: Optional[dict[str, Any]] = None,
                   export_private_states: bool = False,
                   eval_ids: Optional[Sequence[int]] = None) -> 'Run':
  """Trains and evaluates one run (`training.train`); returns its `Run`.

  Args:
    task: the task (`core/task.py`); one built by name
      (`tasks.registry.build_task`) is recorded so that `Run.open` rebuilds
      it.
    config: the run's configuration, or it resolved against `task`
      (`experiment.resolve`); the run lives in `config.experiment_dir`
      (with `config.resume`, an interrupted run there continues).
    log_fn: progress lines.
    flag_values: a binary's grouped flags, recorded with the run.
    export_private_states: also write the evaluated clients' final private
      states to `private_states.npz`.
    eval_ids: the clients every evaluation tests (None: `eval_clients` of
      them drawn by the seed).

  Returns:
    The finished run, which reads as its summary (`run['eval']`).
  """
  resolved = experiment.resolve(task, config)
  config = resolved.config
  summary, built = training.train(
      task, resolved, log_fn=log_fn, flag_values=flag_values,
      export_private_states=export_private_states, eval_ids=eval_ids)
  record = run_records.read_json_record(
      os.path.join(config.experiment_dir, run_records.RUN_CONFIG_FILENAME),
      RunError)
  run = Run(dataclasses.replace(config, resume=False), record, task=task,
            summary=summary)
  # Reading this handle's weights or states does not trace the process
  # again; `Run.open` still builds it from the record.
  run._built_process = built  # pylint: disable=protected-access
  run._dp = resolved.dp  # pylint: disable=protected-access
  return run


def finished_or_trained(task, config: experiment.ExperimentConfig,
                        log_fn: Callable[[str], None] = print,
                        **kwargs) -> 'Run':
  """The run of `config`: opened if it finished, else trained.

  A finished run (its summary written) is opened without building or
  running anything; otherwise `run_experiment` trains it, and with
  `config.resume` an interrupted run continues from its checkpoints. This
  is how an analysis reuses a run it may already have.

  Args:
    task: the run's task.
    config: the run's configuration.
    log_fn: progress lines, while it trains.
    **kwargs: more arguments of `run_experiment`.

  Returns:
    The finished `Run`.

  Example:
    run = runs.finished_or_trained(task, config)
    final = run.weights()
  """
  path = os.path.join(config.experiment_dir, SUMMARY_FILENAME)
  if os.path.exists(path):
    return Run.open(config.experiment_dir, task=task)
  return run_experiment(task, config, log_fn=log_fn, **kwargs)


class RunError(ValueError):
  """A directory cannot be opened as a run, or a request of it is invalid;
  the message names the file or the argument."""


class DamagedRunError(RunError):
  """A run's record cannot be used: unreadable, not a run record, or
  changed after the run started; the message names the file."""


def digest(record: dict) -> str:
  """A run's identity: a digest of its recorded configuration (its DP as
  resolved, its task's build), leaving out what a resumed run may change
  (`run_records.RESUMABLE_FIELDS`: evaluation, simulation, where it lives),
  the task's data directory, and fields at the value runs had before the
  field existed (`run_records.LEGACY_VALUES`)."""
  task = dict(record.get('task') or {})
  task['arguments'] = {k: v for k, v in task.get('arguments', {}).items()
                       if k != 'data_dir'}
  identity = {
      'config': {k: v for k, v in record.get('config', {}).items()
                 if k not in run_records.RESUMABLE_FIELDS and
                 run_records.LEGACY_VALUES.get(k, ()) != v},
      'task': task}
  return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str)
                        .encode()).hexdigest()[:16]


def config_from_record(record: dict, directory: str
                       ) -> experiment.ExperimentConfig:
  """The `ExperimentConfig` run_config.json records, living in `directory`
  (its DP as the run resolved it: a target epsilon is its noise
  multiplier)."""
  directory = os.path.abspath(directory)
  path = os.path.join(directory, run_records.RUN_CONFIG_FILENAME)
  fields = {f.name for f in dataclasses.fields(experiment.ExperimentConfig)}
  config = record.get('config') if isinstance(record, dict) else None
  if not isinstance(config, dict) or not isinstance(
      config.get('dp') or {}, dict):
    raise DamagedRunError(f'{path} does not hold a run record (an object '
                          'with its `config` and `config.dp`)')
  values = {k: v for k, v in run_records.with_legacy_values(config).items()
            if k in fields}
  dp_fields = {f.name for f in dataclasses.fields(privacy.DPConfig)}
  values['dp'] = privacy.DPConfig(**{
      k: v for k, v in (values.get('dp') or {}).items() if k in dp_fields})
  values.update(root_output_dir=os.path.dirname(directory),
                experiment_name=os.path.basename(directory), resume=False)
  try:
    return experiment.ExperimentConfig(**values)
  except (TypeError, ValueError) as e:
    raise DamagedRunError(f'{path} does not hold a run configuration: '
                          f'{e}') from e


def _client_ids(ids) -> list[int]:
  """`ids` as a list of ints; RunError for anything else (strings, floats,
  a single id)."""
  if isinstance(ids, (str, bytes)) or not isinstance(
      ids, collections.abc.Iterable):
    raise RunError(f'ids must be a sequence of client ids (ints), got '
                   f'{ids!r}')
  ids = list(ids)
  bad = [c for c in ids if isinstance(c, bool) or
         not isinstance(c, (int, np.integer))]
  if bad:
    raise RunError(f'client ids must be ints, got {bad[:5]!r}')
  return [int(c) for c in ids]


class Run(collections.abc.Mapping):
  """A run's directory, its record, and what can be read or done with it.

  Build one with `Run.open(directory)` or take the one `run_experiment`
  returns. As a mapping it is the run's summary
  (summary.json); an unfinished run has none (`finished` is False).
  """

  def __init__(self, config: experiment.ExperimentConfig, record: dict,
               task=None, summary: Optional[dict] = None):
    self._config = config
    self._record = record
    self._task = task
    self._summary = summary
    self._built_process = None  # Built once, when first needed.
    self._groups = None  # The same.
    self._dp = None  # The same (`experiment.resolve`).

  @classmethod
  def open(cls, directory: str, task=None) -> 'Run':
    """The run in `directory`, from its run_config.json alone.

    Args:
      directory: a run's directory (`<root_output_dir>/<experiment_name>`).
      task: the run's task, when it was not built by name (a task built
        by `tasks.registry.build_task`, as the binaries do, is rebuilt
        from the record when first needed).

    Raises:
      RunError: the directory holds no run record.
      DamagedRunError: the record is unreadable, or it names an algorithm
        that is unknown, takes other options or is not the one the run's
        flags or summary record (a record edited by hand).
    """
    path = os.path.join(directory, run_records.RUN_CONFIG_FILENAME)
    if not os.path.exists(path):
      raise RunError(f'{path} does not exist: {directory} is not a run '
                     'directory (a run writes it before its first round)')
    record = run_records.read_json_record(path, DamagedRunError)
    config = config_from_record(record, directory)
    run = cls(config, record, task=task)
    run._check_algorithm(path)  # pylint: disable=protected-access
    return run

  def _check_algorithm(self, path: str) -> None:
    """Raises RunError unless the recorded algorithm is known, its options
    are its own, and the run's flags and summary (where recorded) name the
    same algorithm."""
    algorithm = self._config.algorithm
    try:
      algorithm_registry.check_algorithm_options(
          algorithm, self._config.algorithm_options)
    except ValueError as e:
      raise DamagedRunError(f'{path}: {e}') from e
    named = {'flags': run_records.flat_flags(
        self._record.get('flags')).get('algorithm')}
    summary_path = os.path.join(self.directory, SUMMARY_FILENAME)
    if os.path.exists(summary_path):
      named['summary.json'] = (self.summary or {}).get('algorithm')
    for where, other in named.items():
      if other is not None and other != algorithm:
        raise DamagedRunError(
            f'{path} records algorithm {algorithm!r}, but the run\'s '
            f'{where} record {other!r}: the record was changed after the '
            'run started; restore it (its checkpoints are those of '
            f'{other!r})')

  # The summary as a mapping.
  def _finished_summary(self) -> dict:
    summary = self.summary
    if summary is None:
      raise RunError(f'{self.directory} has not finished (no '
                     f'{SUMMARY_FILENAME}); resume it with run.resume()')
    return summary

  def __getitem__(self, key):
    return self._finished_summary()[key]

  def __iter__(self):
    return iter(self._finished_summary())

  def __len__(self):
    return len(self._finished_summary())

  def __repr__(self):
    state = 'finished' if self.finished else 'unfinished'
    return (f'Run({self.directory!r}, {self._config.algorithm}, '
            f'{self.task_name}, {state})')

  @property
  def directory(self) -> str:
    return self._config.experiment_dir

  @property
  def config(self) -> experiment.ExperimentConfig:
    """The run's configuration, DP as resolved."""
    return self._config

  @property
  def record(self) -> dict:
    """run_config.json: the configuration, flags and the task's build."""
    return self._record

  @property
  def digest(self) -> str:
    """The run's identity (`digest`)."""
    return digest(self._record)

  @property
  def spec(self) -> run_spec.RunSpec:
    """The run as a typed spec: its recorded config (DP as resolved) on
    its task's name and build options; `run.spec.override({...})` states a
    variant of it. Its `resolve(task)` records this run's digest.

    Raises:
      RunError: the run's task was built in Python, not by name, so no
        spec can name it (the message says how to make it recordable), or
        the record's task or options are not those of a known task.
    """
    built = self._record.get('task')
    if not built:
      raise RunError(
          f'{self.directory}: the run\'s task ({self.task_name}) was built '
          'in Python, not by name, so no spec can name it; to make it '
          'recordable, build it by name (tp.build_task, or --task=) or '
          'with a builder declared by @tp.task_factory, defined at the top '
          'level of an importable module and called with JSON-scalar '
          'arguments (docs/your_own_task.md)')
    options = {k: v for k, v in (built.get('arguments') or {}).items()
               if k not in task_registry.RUN_ARGUMENTS}
    try:
      return run_spec.RunSpec.from_config(self._config, built.get('name'),
                                          options)
    except ValueError as e:
      raise RunError(f'{self.directory}/{run_records.RUN_CONFIG_FILENAME}: '
                     f'{e}') from e

  @property
  def task_name(self) -> str:
    if self._task is not None:
      return task_lib.task_name(self._task)
    return (self._record.get('task') or {}).get('name', '?')

  @property
  def task(self):
    """The run's task: the one given, else rebuilt from the record."""
    if self._task is None:
      built = self._record.get('task')
      if not built:
        raise RunError(
            f'{self.directory}: the run\'s task was not built by name (its '
            'run_config.json records no `task`), so it cannot be rebuilt; '
            'pass it: Run.open(directory, task=...)')
      self._task = task_registry.build_task(built['name'],
                                            **built['arguments'])
    return self._task

  @property
  def summary(self) -> Optional[dict]:
    """summary.json, or None while the run has not finished."""
    if self._summary is None:
      path = os.path.join(self.directory, SUMMARY_FILENAME)
      if os.path.exists(path):
        self._summary = run_records.read_json_record(path, RunError)
    return self._summary

  @property
  def finished(self) -> bool:
    return self.summary is not None

  def privacy_report(self) -> Optional[dict]:
    """The run's privacy report (None without DP), recomputed from its
    recorded DP configuration and the rounds its directories record as
    started, replays included (`run_privacy.recorded_privacy_report`): for
    an interrupted run, what it has spent so far.

    Raises:
      training_loop.CheckpointError: a record of rounds started is missing,
        unreadable, or inconsistent (its two places disagree, or it counts
        fewer rounds than the run's checkpoints or released metrics show).
    """
    if self._config.dp.mechanism == 'none':
      return None
    config, dp = self._config, self._resolved_dp()
    groups = experiment.group_members(
        self.task, config, self._built().stages[-1].grouping) if (
            self._per_group()) else None
    return run_privacy.recorded_privacy_report(config, dp, groups)

  def curves(self, stage: Optional[str] = None,
             group: Optional[str] = None) -> dict[str, list[dict]]:
    """`{'train': rows, 'eval': rows}`: the released metrics per round
    (train_metrics.csv, eval_metrics.csv), each row a dict with `round`,
    of the run, or of an earlier `stage` or a `group`'s run."""
    directory = self._directory_of(stage, group)
    return {kind: training_loop.read_metrics(
        os.path.join(directory, f'{kind}_metrics.csv'))
            for kind in ('train', 'eval')}

  def rounds(self, stage: Optional[str] = None,
             group: Optional[str] = None) -> list[int]:
    """The rounds with a checkpoint (the run's, or a stage's or group's)."""
    return training_loop.checkpoint_rounds(self._directory_of(stage, group))

  def participations(self, stage: Optional[str] = None) -> dict[int, int]:
    """`{client id: training rounds it took part in}` over the rounds the
    run completed (up to its newest checkpoint): of its last stage (run per group: each client in its
    own group's run) or of an earlier `stage`. Clients that never trained
    are absent.

    The loop's cohorts are a pure function of the run's seed, sampling,
    population and round (`training_loop.sample_clients`), so this replays
    them rather than reading a record; a client's count equals the
    `rounds_participated` of its state (`client_states`), for the
    algorithms that keep one. Example, a client's cost in model transfers:
    `2 * run.participations().get(c, 0) + 1`.
    """
    built, config = self._built(), self._config
    if stage is not None:
      self.process(stage)  # An unknown stage fails here.
      s = next(s for s in built.stages if s.name == stage)
      parts = [(experiment.stage_directory(config, stage),
                list(range(self.task.population)),
                s.clients_per_round or config.clients_per_round)]
    elif self._per_group():
      parts = [(experiment.group_directory(config, g), members,
                config.clients_per_round)
               for g, members in self.groups().items()]
    else:
      parts = [(self.directory, list(range(self.task.population)),
                config.clients_per_round)]
    counts = collections.Counter()
    for directory, members, cohort in parts:
      for r in range(1, (training_loop.completed_round(directory) or 0) + 1):
        counts.update(members[int(i)] for i in training_loop.sample_clients(
            len(members), cohort, r, config.seed, config.sampling))
    return dict(sorted(counts.items()))

  def process(self, stage: Optional[str] = None):
    """The process the run trained (or its earlier `stage`'s), with the
    run's aggregator, DP included."""
    built = self._built()
    if stage is None:
      return stages_lib.final_process(built)
    names = ([s.name for s in built.stages]
             if isinstance(built, stages_lib.Staged) else [])
    if stage not in names[:-1]:
      raise RunError(f'{self._config.algorithm} has no earlier stage '
                     f'{stage!r}; its earlier stages: {names[:-1]}')
    return built.stages[names.index(stage)].process

  @_in_runtime
  def weights(self, round: Optional[int] = None,  # pylint: disable=redefined-builtin
              stage: Optional[str] = None, group: Optional[str] = None):
    """The shared model's weights (`tff.learning.models.ModelWeights`) at a
    checkpointed round (None: the last) of the run, an earlier `stage` or
    a `group`'s run."""
    directory, proc, round_num = self._checkpoint(round, stage, group)
    return proc.get_model_weights(
        training_loop.load_checkpoint(proc, directory, round_num))

  @_in_runtime
  def server_state(self, round: Optional[int] = None,  # pylint: disable=redefined-builtin
                   stage: Optional[str] = None, group: Optional[str] = None):
    """The whole server state at a checkpointed round (None: the last)."""
    directory, proc, round_num = self._checkpoint(round, stage, group)
    return training_loop.load_checkpoint(proc, directory, round_num)

  @_in_runtime
  def client_states(self, ids: Sequence[int], round: Optional[int] = None,  # pylint: disable=redefined-builtin
                    stage: Optional[str] = None,
                    group: Optional[str] = None) -> list:
    """The client states of `ids` (the task's client ids; of a `group`'s
    run, its members) as committed at a round (None: the last checkpoint's),
    read only. The in-memory store keeps the snapshots of its checkpoints;
    the SQLite store only its last round."""
    ids = _client_ids(ids)
    directory, proc, round_num = self._checkpoint(round, stage, group)
    population = self.task.population
    local = list(ids)
    if group is not None:
      members = self.groups()[group]
      where = {c: i for i, c in enumerate(members)}
      outside = [c for c in ids if c not in where]
      if outside:
        raise RunError(f'clients {outside[:5]} are not in group {group!r}')
      local, population = [where[c] for c in ids], len(members)
    bad = [c for c in local if not 0 <= c < population]
    if bad:
      raise RunError(f'client ids {bad[:5]} are not in [0, {population})')
    store = run_evaluation.open_committed_store(proc, self._config, population,
                                                directory, round_num)
    try:
      return store.load(local)
    finally:
      store.close()

  @_in_runtime
  def client_outputs(self, ids: Sequence[int], strategy: Any = 'none',
                     round: Optional[int] = None,  # pylint: disable=redefined-builtin
                     stage: Optional[str] = None) -> list:
    """Each client's evaluation outputs under one per-client strategy.

    What `task.evaluate(outputs, ids)` pools into the run's metrics, one
    entry per client of `ids`, in order: for analyses that need clients
    one by one (a per-client comparison of two methods, a pool over a
    subset). A run whose last stage ran per group scores each client with
    its own group's model (unless `stage` names an earlier stage).

    Args:
      ids: the task's client ids.
      strategy: a per-client strategy (`tff_personal.config.strategies`: `none`,
        `fine_tune`, `adapt`) or its text. A `fine_tune` reads the
        client's training data of the run's last round at every `round`,
        as the run's own learning curve does.
      round: a checkpointed round (None: the last).
      stage: an earlier stage of a staged algorithm (e.g. 'fl').

    Returns:
      The per-client outputs of `ids`.

    Example:
      sgd = strategies.FineTune(epochs=5, learning_rate=0.1, optimizer='sgd')
      tuned = run.client_outputs([3, 7], sgd, stage='fl')
    """
    if isinstance(strategy, str):
      strategy = strategies_lib.parse(strategy)[1]
    if not isinstance(strategy, strategies_lib.PER_CLIENT):
      raise RunError(f'{strategies_lib.to_text(strategy)} does not score '
                     'the run\'s clients one by one')
    ids = _client_ids(ids)
    if stage is not None or not self._per_group():
      return self._outputs(self.task, strategy, ids, round, stage, None)
    groups = self.groups()
    group_of = {c: g for g, members in groups.items() for c in members}
    outside = [c for c in ids if c not in group_of]
    if outside:
      raise RunError(f'clients {outside[:5]} are in no group of the run')
    out = [None] * len(ids)
    for g, members in groups.items():
      where = {c: i for i, c in enumerate(members)}
      positions = [p for p, c in enumerate(ids) if group_of[c] == g]
      if not positions:
        continue
      view = task_lib.TaskSubset(self.task, members,
                                 name=task_lib.task_name(self.task))
      outs = self._outputs(view, strategy, [where[ids[p]] for p in positions],
                           round, None, g)
      for p, o in zip(positions, outs):
        out[p] = o
    return out

  @_in_runtime
  def evaluate(self, eval_name: Optional[str] = None, overwrite: bool = False,
               log_fn: Callable[[str], None] = lambda s: None,
               strategies: Any = None, **evaluation: Any) -> dict:
    """The finished run's final state evaluated again
    (`run_evaluation.evaluate_experiment`).

    Args:
      eval_name: write the record to `evaluations/<eval_name>.json` too
        (None: only return it).
      overwrite: replace an existing record of that name.
      log_fn: progress lines.
      strategies: named personalization strategies to evaluate instead of
        the run's own `eval_strategies`: `{name: strategy or text}` or a
        list of texts (`tff_personal.config.strategies`), e.g. `{'ft3':
        strategies.FineTune(epochs=3), 'new': strategies.ColdStart(
        start='dp_average', samples=(1, 'all'))}`.
      **evaluation: evaluation settings to change
        (`run_records.EVALUATION_FIELDS`, e.g. `eval_fine_tune=True`).

    Returns:
      `{'eval', 'test', 'test_fine_tuned', 'cold_start', 'privacy', ...}`;
      a per-group run's also has each group's `groups`; with strategies,
      `strategies`: `{name: its results}`
      (`run_evaluation.evaluate_strategies`).
    """
    unknown = sorted(set(evaluation) - set(run_records.EVALUATION_FIELDS))
    if unknown:
      raise RunError(f'evaluate() changes only the evaluation settings '
                     f'{run_records.EVALUATION_FIELDS}; got {unknown}')
    if strategies is not None:
      try:
        evaluation['eval_strategies'] = strategies_lib.texts(
            strategies_lib.resolve(strategies))
      except ValueError as e:
        raise RunError(str(e)) from e
    config = dataclasses.replace(self._config, **evaluation)
    return run_evaluation.evaluate_experiment(
        self.task, config, eval_name, log_fn=log_fn, overwrite=overwrite)

  @_in_runtime
  def resume(self, rounds: Optional[int] = None,
             log_fn: Callable[[str], None] = print) -> 'Run':
    """Continues the run from its last checkpoint (an interrupted run), or
    extends a finished one to `rounds`; returns the finished run."""
    config = dataclasses.replace(self._config, resume=True,
                                 rounds=rounds or self._config.rounds)
    summary = self.summary
    flags = summary.get('flags') if summary else None
    return run_experiment(
        self.task, config, log_fn=log_fn,
        flag_values=flags if isinstance(flags, dict) and all(
            isinstance(v, dict) for v in flags.values()) else None)

  # Helpers.
  def _resolved_dp(self) -> privacy.DPConfig:
    if self._dp is None:  # Checked once per handle.
      self._dp = experiment.resolve(self.task, self._config).dp
    return self._dp

  def _built(self):
    if self._built_process is None:  # Reused if built before
      # (`experiment.build_process`): reading a run round by round does not
      # trace its process again.
      self._built_process = experiment.build_process(
          self.task, self._config, dp=self._resolved_dp())
    return self._built_process

  def _per_group(self) -> bool:
    return os.path.isdir(os.path.join(self.directory,
                                      experiment.GROUPS_DIRNAME))

  def groups(self) -> dict[str, list[int]]:
    """`{group: its client ids}` of a run whose last stage ran per group."""
    if self._groups is None:
      built = self._built()
      if not (isinstance(built, stages_lib.Staged) and built.per_group):
        raise RunError(f'{self._config.algorithm} does not run per group')
      self._groups = experiment.group_members(self.task, self._config,
                                              built.stages[-1].grouping)
    return {g: list(m) for g, m in self._groups.items()}

  def _directory_of(self, stage: Optional[str], group: Optional[str]) -> str:
    if stage is not None and group is not None:
      raise RunError('give a stage or a group, not both')
    if stage is not None:
      self.process(stage)  # An unknown stage fails here.
      return experiment.stage_directory(self._config, stage)
    if group is not None:
      if group not in self.groups():
        raise RunError(f'no group {group!r}; groups: '
                       f'{sorted(self.groups())}')
      return experiment.group_directory(self._config, group)
    if self._per_group():
      raise RunError(f'{self.directory} ran its last stage once per group; '
                     f'name one: group= one of {sorted(self.groups())}')
    return self.directory

  def _outputs(self, task, strategy, ids, round_num, stage, group) -> list:
    """`client_outputs` of the clients `ids` of `task` (a group's view:
    its members' positions) from one directory's checkpoint."""
    directory, proc, round_num = self._checkpoint(round_num, stage, group)
    bad = [c for c in ids if not 0 <= c < task.population]
    if bad:
      raise RunError(f'client ids {bad[:5]} are not in [0, '
                     f'{task.population})')
    # A fine-tuning reads the training data of the run's last round at any
    # round, as the run's own curve does (`personal_evaluator`).
    config = self._config
    num_shards = sharded.resolve_num_shards(proc, config.simulation_shards)
    state = training_loop.load_checkpoint(proc, directory, round_num)
    store = run_evaluation.open_committed_store(proc, config, task.population,
                                                directory, round_num)
    try:
      return list(run_evaluation.strategy_evaluator(
          task, proc, config, store, num_shards, strategy, ids).outputs(
              state))
    finally:
      store.close()

  def _checkpoint(self, round_num, stage, group):
    if round_num is not None and (
        isinstance(round_num, bool) or
        not isinstance(round_num, (int, np.integer))):
      raise RunError(f'round must be a round number (an int) or None, got '
                     f'{round_num!r} ({type(round_num).__name__})')
    directory = self._directory_of(stage, group)
    proc = self.process(stage)
    if round_num is None:
      round_num = training_loop.completed_round(directory)
      if not round_num:
        raise training_loop.CheckpointError(
            f'{directory} has no checkpoint of a trained round')
    elif round_num not in training_loop.checkpoint_rounds(directory):
      raise RunError(
          f'{directory} has no checkpoint of round {round_num}; it keeps '
          f'rounds {training_loop.checkpoint_rounds(directory)} (more with '
          'keep_checkpoints)')
    return directory, proc, round_num
