"""A run's typed specification, split by concern, checked and resolved once.

`RunSpec` is what a user or a paper cell states about a run: the task and
its options, the algorithm and its options (typed by the builder's
signature, `registry.algorithm_options`), and one small frozen dataclass
per concern: `Loop`, `Optimizers`, `Privacy`, `Evaluation`, `Simulation`,
`Output`. Construction checks every name and value it can without the
task's data (an unknown algorithm, option or value is one error naming
it); `resolve(task)` checks the rest against the task and decides DP once,
giving the `experiment.Resolved` that `runs.run_experiment` trains and
records. The recorded, hashed form of a run (run_config.json,
`runs.digest`) is the `ExperimentConfig` that `config()` gives, so a spec
and the flags or config that say the same thing are the same run.

A cell of a table is a base spec plus overrides by dotted name
(`override`), each checked like the constructor's values:

  from tff_personal.config import run_spec
  from tff_personal.core import runtime
  from tff_personal.run import runs

  base = run_spec.RunSpec(
      task='label_skew_mnist', algorithm='ditto',
      task_options={'alpha': 0.1, 'num_clients': 20},
      loop=run_spec.Loop(rounds=20, clients_per_round=10),
      output=run_spec.Output('/tmp/out', 'ditto'))
  cell = base.override({'algorithm_options.lam': 0.5,
                        'privacy.mechanism': 'gaussian_fixed',
                        'privacy.noise_multiplier': 1.0,
                        'output.experiment_name': 'ditto_dp'})
  task = cell.build_task(data_dir='../shared/data/mnist')
  with runtime.local_runtime():
    run = runs.run_experiment(task, cell.resolve(task))

Written by hand: TFF and absl have no per-run typed configuration; the
option types come from `core/options.py`, the checks of values that need
the task from `experiment.resolve`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

from tasks import registry as task_registry
from tff_personal.algorithms import registry as algorithm_registry
from tff_personal.config import experiment
from tff_personal.core import privacy


@dataclasses.dataclass(frozen=True)
class Loop:
  """How the loop trains: rounds, cohorts, seeds, checkpoints, the store.

  `embedding_dim` None takes the algorithm's default; `personal_init` is
  how a never-trained client's private state starts ('model': the model's
  own initializers, seeded per client; 'normal': N(0,
  `personal_init_stddev`^2)).
  """
  rounds: int = 10
  clients_per_round: int = 10
  sampling: str = 'fixed_size'
  seed: int = 0
  embedding_dim: Optional[int] = None
  personal_init: str = 'model'
  personal_init_stddev: float = 0.1
  checkpoint_every: int = 1
  keep_checkpoints: int = 3
  resume: bool = False
  client_state_backend: str = 'auto'
  train_metrics: bool = True


@dataclasses.dataclass(frozen=True)
class Optimizers:
  """The local ('adam' or 'sgd') and server optimizers and their rates;
  `private_learning_rate` None trains private variables with the client's
  optimizer, else with `private` ('adam' or 'sgd') at that rate."""
  client: str = 'adam'
  client_learning_rate: float = 1e-3
  private_learning_rate: Optional[float] = None
  private: str = 'adam'
  server: str = 'sgd'
  server_learning_rate: float = 1.0
  server_momentum: float = 0.0


@dataclasses.dataclass(frozen=True)
class Privacy:
  """User-level DP of the shared update (`privacy.DPConfig` without what
  the run fills in: cohort, population, rounds, sampling).

  `mechanism` one of `privacy.MECHANISMS`: 'none' (no DP),
  'gaussian_fixed' or 'gaussian_adaptive' (noise added by a trusted
  aggregator), 'distributed_dgauss' or 'distributed_skellam' (noise shares
  added on the devices, summed by secure aggregation);
  `noise_multiplier` or `target_epsilon` (calibrated once, at `resolve`);
  `target_delta` None: `privacy.default_target_delta(population)`.
  `personal_heads` 'exempt' or 'noised' (`experiment.DP_PERSONAL_HEADS`);
  `release_unnoised_metrics` releases values epsilon does not cover.
  """
  mechanism: str = 'none'
  noise_multiplier: Optional[float] = None
  target_epsilon: Optional[float] = None
  clip_norm: float = 1.0
  target_delta: Optional[float] = None
  target_unclipped_quantile: float = 0.5
  personal_heads: str = 'exempt'
  release_unnoised_metrics: bool = False


@dataclasses.dataclass(frozen=True)
class Evaluation:
  """When and whom the run evaluates, and how (`strategies`: named
  personalization strategies as `strategies.parse` texts)."""
  every: int = 0
  clients: int = 0
  curve_clients: int = 0
  chunk: int = 250
  fine_tune: bool = False
  test_fine_tune: bool = False
  cold_start_epochs: int = 5
  strategies: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Simulation:
  """How rounds are simulated: `shards` (-1 automatic, 0 one user per TFF
  client), `batched` (a shard's users trained together),
  `batch_users` (the most trained together) and `round` (where a round
  runs: 'auto', 'inprocess' or 'tff', `ExperimentConfig.simulation_round`)."""
  shards: int = -1
  batched: bool = False
  batch_users: int = 25
  round: str = 'auto'


@dataclasses.dataclass(frozen=True)
class Output:
  """Where the run lives: `<root_output_dir>/<experiment_name>`."""
  root_output_dir: str = ''
  experiment_name: str = ''


SECTIONS = {'loop': Loop, 'optimizers': Optimizers, 'privacy': Privacy,
            'evaluation': Evaluation, 'simulation': Simulation,
            'output': Output}

# (section, field) -> the ExperimentConfig field it is recorded as; every
# ExperimentConfig field but `algorithm`, `algorithm_options` and `dp` is
# here once (a test holds the two to each other).
CONFIG_FIELDS = {
    **{('loop', f): f for f in (
        'rounds', 'clients_per_round', 'sampling', 'seed', 'embedding_dim',
        'personal_init', 'personal_init_stddev', 'checkpoint_every',
        'keep_checkpoints',
        'resume', 'client_state_backend', 'train_metrics')},
    ('optimizers', 'client'): 'client_optimizer',
    ('optimizers', 'client_learning_rate'): 'client_learning_rate',
    ('optimizers', 'private_learning_rate'): 'private_learning_rate',
    ('optimizers', 'private'): 'private_optimizer',
    ('optimizers', 'server'): 'server_optimizer',
    ('optimizers', 'server_learning_rate'): 'server_learning_rate',
    ('optimizers', 'server_momentum'): 'server_momentum',
    ('privacy', 'personal_heads'): 'dp_personal_heads',
    ('privacy', 'release_unnoised_metrics'): 'release_unnoised_metrics',
    ('evaluation', 'every'): 'eval_every',
    ('evaluation', 'clients'): 'eval_clients',
    ('evaluation', 'curve_clients'): 'curve_eval_clients',
    ('evaluation', 'chunk'): 'eval_chunk',
    ('evaluation', 'fine_tune'): 'eval_fine_tune',
    ('evaluation', 'test_fine_tune'): 'test_fine_tune',
    ('evaluation', 'cold_start_epochs'): 'cold_start_epochs',
    ('evaluation', 'strategies'): 'eval_strategies',
    ('simulation', 'shards'): 'simulation_shards',
    ('simulation', 'batched'): 'simulation_batched',
    ('simulation', 'batch_users'): 'simulation_batch_users',
    ('simulation', 'round'): 'simulation_round',
    ('output', 'root_output_dir'): 'root_output_dir',
    ('output', 'experiment_name'): 'experiment_name',
}
# Privacy fields recorded in the config's DPConfig.
DP_FIELDS = ('mechanism', 'noise_multiplier', 'target_epsilon', 'clip_norm',
             'target_delta', 'target_unclipped_quantile')


def _typed(section: str, value):
  """`value` (a section) with each field checked against its default's
  type; an int given for a float field becomes a float (so a spec and the
  flags that say the same thing record the same config), a list for a
  tuple a tuple. Fields whose default is None take that type or None."""
  hints = {f.name: f for f in dataclasses.fields(value)}
  changes = {}
  for name, field in hints.items():
    v = getattr(value, name)
    kind = type(field.default)
    if field.default is None:  # Optional[int] or Optional[float]
      kind = int if 'int' in str(field.type) else float
      if v is None:
        continue
    if kind is float and type(v) is int:
      changes[name] = float(v)
    elif kind is tuple and isinstance(v, (list, tuple)):
      if not all(isinstance(item, str) for item in v):
        raise ValueError(f'{section}.{name}={v!r} must be a list of '
                         'strings')
      changes[name] = tuple(v)
    elif type(v) is not kind:
      raise ValueError(f'{section}.{name}={v!r} must be of type '
                       f'{kind.__name__}, got {type(v).__name__}')
  return dataclasses.replace(value, **changes) if changes else value


def _shown(value) -> str:
  """`value`'s repr, cut to a line."""
  text = repr(value)
  return text if len(text) <= 60 else text[:57] + '...'


def _check_mapping(name: str, value) -> None:
  """Raises ValueError unless `value` maps names (strings) to values."""
  if not isinstance(value, Mapping):
    raise ValueError(f'{name} must be an object of names and values, got '
                     f'{_shown(value)} ({type(value).__name__})')
  bad = [k for k in value if not isinstance(k, str)]
  if bad:
    raise ValueError(f'{name}: names must be strings, got {_shown(bad)}')


@dataclasses.dataclass(frozen=True)
class RunSpec:
  """A run: what it trains on, what it trains, and how (module docstring).

  Attributes:
    task: a registered task's name or an outside `package.module:factory`.
    algorithm: a registered algorithm's name (or `package.module:builder`).
    task_options: the task builder's options (checked and typed by its
      signature, as `--task_options`).
    algorithm_options: the algorithm builder's options (as
      `--algorithm_options`).
    loop, optimizers, privacy, evaluation, simulation, output: the
      concerns' settings.
  """
  task: str
  algorithm: str
  task_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  algorithm_options: Mapping[str, Any] = dataclasses.field(
      default_factory=dict)
  loop: Loop = Loop()
  optimizers: Optimizers = Optimizers()
  privacy: Privacy = Privacy()
  evaluation: Evaluation = Evaluation()
  simulation: Simulation = Simulation()
  output: Output = Output()

  def __post_init__(self):
    task_registry.spec(self.task)  # An unknown task fails here, by name.
    algorithm_registry.spec(self.algorithm)  # The same.
    for name in ('task_options', 'algorithm_options'):
      _check_mapping(name, getattr(self, name))
    object.__setattr__(self, 'task_options', dict(
        task_registry.check_task_options(self.task, self.task_options)))
    object.__setattr__(self, 'algorithm_options', dict(
        algorithm_registry.check_algorithm_options(
            self.algorithm, self.algorithm_options)))
    for name, kind in SECTIONS.items():
      value = getattr(self, name)
      if not isinstance(value, kind):
        raise ValueError(f'{name} must be a run_spec.{kind.__name__}, got '
                         f'{type(value).__name__}')
      object.__setattr__(self, name, _typed(name, value))
    if self.privacy.mechanism not in privacy.MECHANISMS:
      raise ValueError(f'privacy.mechanism must be one of '
                       f'{privacy.MECHANISMS}, got {self.privacy.mechanism!r}')

  def override(self, changes: Mapping[str, Any]) -> 'RunSpec':
    """This spec with `changes` by dotted name: 'loop.rounds',
    'privacy.noise_multiplier', 'algorithm_options.lam', 'task_options.alpha',
    or 'task' / 'algorithm' (whose options must then fit the new one).

    Raises:
      ValueError: naming an unknown section, field or option, or a value
        of the wrong type.
    """
    top = {'task': self.task, 'algorithm': self.algorithm,
           'task_options': dict(self.task_options),
           'algorithm_options': dict(self.algorithm_options)}
    sections = {name: {} for name in SECTIONS}
    for key, value in changes.items():
      head, _, field = key.partition('.')
      if head in ('task', 'algorithm') and not field:
        top[head] = value
      elif head in ('task_options', 'algorithm_options') and field:
        top[head][field] = value
      elif head in SECTIONS and field:
        names = [f.name for f in dataclasses.fields(SECTIONS[head])]
        if field not in names:
          raise ValueError(f'{key}: {head} has no field {field!r}; its '
                           f'fields: {names}')
        sections[head][field] = value
      else:
        raise ValueError(
            f'{key}: not a run spec setting; use task, algorithm, '
            'task_options.<option>, algorithm_options.<option> or one of '
            + ', '.join(f'{s}.<field>' for s in SECTIONS))
    return RunSpec(**top, **{
        name: dataclasses.replace(getattr(self, name), **values)
        for name, values in sections.items()})

  def config(self) -> experiment.ExperimentConfig:
    """The run's recorded configuration (what `runs.digest` hashes once
    resolved): the task is recorded with the task it builds."""
    values = {config_field: getattr(getattr(self, section), field)
              for (section, field), config_field in CONFIG_FIELDS.items()}
    return experiment.ExperimentConfig(
        algorithm=self.algorithm,
        algorithm_options=dict(self.algorithm_options),
        dp=privacy.DPConfig(
            **{f: getattr(self.privacy, f) for f in DP_FIELDS},
            clients_per_round=self.loop.clients_per_round,
            rounds=self.loop.rounds, sampling=self.loop.sampling),
        **values)

  def build_task(self, data_dir: Optional[str] = None, **kwargs):
    """The task with the spec's options (`tasks.registry.build_task`);
    `kwargs`: the builder's other arguments (its `seed`, say)."""
    return task_registry.build_task(self.task, data_dir=data_dir,
                                    **dict(self.task_options, **kwargs))

  def resolve(self, task) -> experiment.Resolved:
    """Checked against `task` and DP decided, once (`experiment.resolve`)."""
    return experiment.resolve(task, self.config())

  def to_dict(self) -> dict[str, Any]:
    """The spec as JSON-able values, one key per section (`from_dict`
    reads it back)."""
    out = {'task': self.task, 'algorithm': self.algorithm,
           'task_options': dict(self.task_options),
           'algorithm_options': dict(self.algorithm_options)}
    for name in SECTIONS:
      section = dataclasses.asdict(getattr(self, name))
      out[name] = {k: list(v) if isinstance(v, tuple) else v
                   for k, v in section.items()}
    return out

  @classmethod
  def from_dict(cls, values: Mapping[str, Any]) -> 'RunSpec':
    """The spec `to_dict` wrote (a JSON file's, say); sections and fields
    left out take their defaults, unknown ones are an error naming them."""
    keys = ('task, algorithm, task_options, algorithm_options, '
            + ', '.join(SECTIONS))
    if not isinstance(values, Mapping):
      raise ValueError(f'a run spec is an object of {keys}; got '
                       f'{_shown(values)} ({type(values).__name__})')
    unknown = set(values) - set(SECTIONS) - {
        'task', 'algorithm', 'task_options', 'algorithm_options'}
    if unknown:
      raise ValueError(f'not run spec keys: {sorted(unknown, key=repr)}; '
                       f'the keys: {keys}')
    missing = {'task', 'algorithm'} - set(values)
    if missing:
      raise ValueError(f'a run spec needs {sorted(missing)}')
    for name in ('task', 'algorithm'):
      if not isinstance(values[name], str):
        raise ValueError(f'{name} must be a string (a registered name or '
                         f'package.module:attribute), got '
                         f'{_shown(values[name])}')
    for name in ('task_options', 'algorithm_options', *SECTIONS):
      if values.get(name) is not None:
        _check_mapping(name, values[name])
    base = cls(task=values['task'], algorithm=values['algorithm'],
               task_options=values.get('task_options') or {},
               algorithm_options=values.get('algorithm_options') or {})
    return base.override({f'{name}.{k}': v for name in SECTIONS
                          for k, v in (values.get(name) or {}).items()})

  @classmethod
  def from_config(cls, config: experiment.ExperimentConfig, task: str,
                  task_options: Optional[Mapping[str, Any]] = None
                  ) -> 'RunSpec':
    """The spec of an `ExperimentConfig` on `task` (`config()` gives
    `config` back, up to the DP fields the run fills in)."""
    sections = {name: {} for name in SECTIONS}
    for (section, field), config_field in CONFIG_FIELDS.items():
      sections[section][field] = getattr(config, config_field)
    sections['privacy'].update(
        {f: getattr(config.dp, f) for f in DP_FIELDS})
    return cls(task=task, algorithm=config.algorithm,
               task_options=dict(task_options or {}),
               algorithm_options=dict(config.algorithm_options),
               **{name: SECTIONS[name](**values)
                  for name, values in sections.items()})


# The sections, also as `RunSpec.Loop` etc. (`tff_personal.RunSpec.Loop`).
for _section in SECTIONS.values():
  setattr(RunSpec, _section.__name__, _section)
del _section
