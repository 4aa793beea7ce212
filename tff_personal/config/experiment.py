"""An experiment's configuration and what it builds.

`ExperimentConfig` and its checks (`validate`, which also resolves DP), the
optimizers, the algorithm's process with the run's aggregator
(`build_process`), the clients' initial states, and where a run's stages and
groups live. Training is `training.train` (through `runs.run_experiment`);
records, privacy and evaluation are `run_records`, `run_privacy` and
`run_evaluation`. A task is any object with the members of
`tff_personal/core/task.Task` (and the optional capabilities the algorithm
needs, `algorithms/registry.py`); the process says how it is evaluated
(`StatefulClientProcess.eval_model_fn` and its neighbours).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
from typing import Any, Callable, Optional
import weakref

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_personal.algorithms import fedavg
from tff_personal.algorithms import registry
from tff_personal.config import strategies as strategies_lib
from tff_personal.core import client_state as client_state_lib
from tff_personal.core import moved
from tff_personal.core import options as options_lib
from tff_personal.core import personal_init as personal_init_lib
from tff_personal.core import privacy
from tff_personal.core import private_noise
from tff_personal.core import stages as stages_lib
from tff_personal.core import task as task_lib
from tff_personal.core import training_loop


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
  algorithm: str
  rounds: int
  clients_per_round: int
  root_output_dir: str
  experiment_name: str
  client_learning_rate: float = 1e-3
  # 'adam' (the papers' local optimizer) or 'sgd'. Adam's first steps move
  # every coordinate by about the learning rate, SGD's follow the gradient
  # (`binaries.dp_budget` compares the two under DP).
  client_optimizer: str = 'adam'
  private_learning_rate: Optional[float] = None  # None: client optimizer
  # The private variables' optimizer at `private_learning_rate`: 'adam'
  # or 'sgd' (unused without a private learning rate).
  private_optimizer: str = 'adam'
  server_optimizer: str = 'sgd'
  server_learning_rate: float = 1.0
  # Heavy-ball momentum of the 'sgd' server optimizer (0: none, FedAvg with
  # lr 1); DP-FedAvgM under DP. A linear filter of the server steps: it
  # smooths them but scales the accumulated signal and noise alike, so the
  # ratio of the two is still the accounting's.
  server_momentum: float = 0.0
  embedding_dim: Optional[int] = None  # None: the algorithm's default
  # The builder's own options, e.g. {'lam': 15.0} for pFedMe
  # (`registry.algorithm_options`); checked in `validate`.
  algorithm_options: dict[str, Any] = dataclasses.field(default_factory=dict)
  # How a never-trained client's private state starts
  # (`core/personal_init.py`): 'model', each private variable from the
  # model's own Keras initializer seeded per client; 'normal', from
  # N(0, personal_init_stddev^2) whatever the layer (the papers' recorded
  # runs). A process that sets its own new-client state (Ditto's, APFL's:
  # the initial global model) keeps it.
  personal_init: str = 'model'
  personal_init_stddev: float = 0.1
  sampling: str = 'fixed_size'
  seed: int = 0
  checkpoint_every: int = 1
  # Checkpoints kept in each run directory (the newest; older ones are
  # deleted): more keeps the models of earlier rounds for analysis after
  # the run, e.g. a learning curve evaluated from them.
  keep_checkpoints: int = 3
  eval_every: int = 0
  eval_clients: int = 0  # 0: every client of the population.
  # Clients tested at the evaluations before the last round (the learning
  # curve's points): a subset of the evaluated clients drawn by the seed,
  # the same at every such evaluation; 0: all of them. The last round's
  # evaluation, which the summary reports, always tests every evaluated
  # client. Evaluation never changes the run's states, so this changes
  # only the cost and the noise of the curve's earlier points.
  curve_eval_clients: int = 0
  eval_chunk: int = 250
  # Users per TFF client in training: 0 runs one user per TFF client (the
  # production-faithful form); n > 0 packs each round's users into n shards
  # (core/sharded.py: same results, much faster); -1 picks n automatically
  # (the CPU count when the algorithm supports it, else 0).
  simulation_shards: int = -1
  # Train each shard's users together, their weights stacked along a user
  # axis (core/batched.py: the same results up to float rounding, for the
  # algorithms and models it covers; others are refused saying why).
  simulation_batched: bool = False
  # With simulation_batched: the most users trained together; a shard runs
  # its users in groups of this size one after another (a group's per-user
  # weights and optimizer slots stay in cache; 25 to 50 measured fastest in
  # docs/performance.md). 0: all of a shard's users at once.
  simulation_batch_users: int = 25
  # Where a training round runs (`ROUND_FORMS`). 'inprocess': its compiled
  # production pieces (MapReduceForm) as TensorFlow functions of this
  # process, without TFF's runtime (core/inprocess.py): sharded, the
  # shards' client work in the driver as always and the aggregation, DP
  # noise and server step from the compiled pieces; with
  # simulation_shards=0, each user's device program too. Only for
  # algorithms the registry declares covered (`AlgorithmSpec.inprocess`).
  # 'tff': the round on TFF's runtime, the reference form. 'auto' (the
  # default): 'inprocess' for a covered algorithm run sharded, else 'tff'.
  # The results are the same up to float rounding (tests/inprocess_test.py).
  # Evaluation does not depend on it: sharded, it runs in the driver.
  simulation_round: str = 'auto'
  # Before testing, each evaluated client trains its private variables only
  # (shared weights frozen) on its own training data for one local pass (the
  # task's `local_epochs`), starting from its stored state: test-time
  # personalization, so that clients who never took part are evaluated after
  # the same local step as those who did. Nothing leaves the client.
  eval_fine_tune: bool = False
  # With a held-out test split (`task.test_datasets`): also test every
  # evaluated client after that same local pass, and report it as
  # summary['test_fine_tuned'] next to summary['test'] (which follows
  # `eval_fine_tune`). Measures how stale the stored private state is.
  test_fine_tune: bool = False
  cold_start_epochs: int = 5
  # Named personalization strategies evaluated next to the run's own
  # evaluation, as `strategies.parse` texts (e.g. 'ft3=fine_tune(epochs=3)',
  # 'new=cold_start(start=dp_average,samples=1/all)'): the per-client ones
  # at every evaluation (their curves: `strategies/<name>/<metric>`), all
  # of them after the last round (summary['strategies']).
  eval_strategies: tuple[str, ...] = ()
  resume: bool = False
  client_state_backend: str = 'auto'
  # Release training-metric sums (loss, accuracy: un-noised). Under DP they
  # are released only with `release_unnoised_metrics`.
  train_metrics: bool = True
  dp: privacy.DPConfig = privacy.DPConfig()
  # Under DP, also release values epsilon does not cover, un-noised, as
  # simulation diagnostics: the training-metric sums (with `train_metrics`)
  # and, under Poisson sampling, each round's cohort size. Off: a DP run
  # releases what epsilon covers, public values and timings only
  # (`released_values` lists them). No effect without DP.
  release_unnoised_metrics: bool = False
  # What DP does to private state (`DP_PERSONAL_HEADS`). 'exempt' (our
  # contract): private state never leaves the device and is never noised.
  # 'noised': FedEmbed's Algorithm 1 as we read it (core/private_noise.py):
  # each local pass's change of a personal head (private trainable variables
  # other than personal embeddings) is clipped to dp.clip_norm and noised at
  # the shared aggregate's noise multiplier, and its own epsilon is reported.
  # Needs dp.mechanism 'gaussian_fixed'.
  dp_personal_heads: str = 'exempt'

  def __post_init__(self):
    if isinstance(self.eval_strategies, list):  # A flag's or JSON's form.
      object.__setattr__(self, 'eval_strategies',
                         tuple(self.eval_strategies))

  @property
  def experiment_dir(self) -> str:
    return os.path.join(self.root_output_dir, self.experiment_name)


DP_PERSONAL_HEADS = ('exempt', 'noised')


def make_server_optimizer(name: str, lr: float, momentum: float = 0.0):
  """TFF's Adam or SGD (with heavy-ball `momentum` when it is not 0)."""
  if not 0.0 <= momentum < 1.0:
    raise ValueError(f'server_momentum must be in [0, 1), got {momentum}')
  if name == 'adam':
    if momentum:
      raise ValueError("server_momentum applies to server_optimizer='sgd' "
                       f'only (Adam has its own moments), got {momentum}')
    return fedavg.adam(lr)
  if name == 'sgd':
    return tff.learning.optimizers.build_sgdm(
        learning_rate=lr, momentum=momentum or None)
  raise ValueError(f"server_optimizer must be 'adam' or 'sgd', got {name!r}")


def make_client_optimizer(config: ExperimentConfig):
  """The local optimizer `config.client_optimizer` at its learning rate."""
  if config.client_optimizer == 'adam':
    return fedavg.adam(config.client_learning_rate)
  if config.client_optimizer == 'sgd':
    return tff.learning.optimizers.build_sgdm(
        learning_rate=config.client_learning_rate)
  raise ValueError("client_optimizer must be 'adam' or 'sgd', got "
                   f'{config.client_optimizer!r}')


def make_private_optimizer(config: ExperimentConfig):
  """The private variables' optimizer (`private_optimizer` at
  `private_learning_rate`), or None: the client optimizer's."""
  if config.private_learning_rate is None:
    return None
  if config.private_optimizer == 'sgd':
    return tff.learning.optimizers.build_sgdm(
        learning_rate=config.private_learning_rate)
  return fedavg.adam(config.private_learning_rate)


PRIVATE_OPTIMIZERS = ('adam', 'sgd')

# `ExperimentConfig.simulation_round`'s values.
ROUND_FORMS = ('auto', 'inprocess', 'tff')


def round_in_process(config: ExperimentConfig, num_shards: int) -> bool:
  """Whether a training round of `config` with `num_shards` shards (0: one
  user per client) runs in process (`ExperimentConfig.simulation_round`):
  asked for, or 'auto' for an algorithm the registry covers run sharded."""
  if config.simulation_round == 'auto':
    return num_shards > 0 and not registry.spec(config.algorithm).inprocess
  return config.simulation_round == 'inprocess'


class ConfigurationError(ValueError):
  """The algorithm cannot be built under this configuration (nothing ran)."""


def check_values(config: ExperimentConfig) -> None:
  """Raises ValueError for values no run can use, naming the field.

  Numbers must be finite and integers 32-bit (`options.INT_LIMIT`), the
  seed >= 0; `experiment_name` must be a plain directory name
  (the run writes only below `root_output_dir`); `personal_init_stddev`
  >= 0, `embedding_dim` >= 0 (whether 0, no personal embedding, is allowed
  is the algorithm builder's to say), `dp.clip_norm` > 0 (with or without
  DP), `eval_chunk` >= 1, `cold_start_epochs` >= 0,
  `simulation_batch_users` >= 0.
  """
  values = {**{f.name: getattr(config, f.name)
               for f in dataclasses.fields(config)},
            **{f'dp.{f.name}': getattr(config.dp, f.name)
               for f in dataclasses.fields(config.dp)}}
  for name, value in values.items():
    if isinstance(value, float) and not math.isfinite(value):
      raise ValueError(f'{name} must be a finite number, got {value}')
    options_lib.check_int_range(name, value)
  if config.seed < 0:  # Seeds numpy's generators, which take none below 0.
    raise ValueError(f'seed must be >= 0, got {config.seed}')
  name = config.experiment_name
  if (not name or name in ('.', '..') or '/' in name or os.sep in name or
      (os.altsep and os.altsep in name)):
    raise ValueError('experiment_name must be a plain directory name (no '
                     'path separator, not "." or ".."): the run is written '
                     f'to root_output_dir/experiment_name; got {name!r}')
  if config.personal_init_stddev < 0:
    raise ValueError('personal_init_stddev must be >= 0, got '
                     f'{config.personal_init_stddev}')
  if config.personal_init not in personal_init_lib.PERSONAL_INITS:
    raise ValueError(f'personal_init must be one of '
                     f'{personal_init_lib.PERSONAL_INITS}, got '
                     f'{config.personal_init!r}')
  if config.private_optimizer not in PRIVATE_OPTIMIZERS:
    raise ValueError(f'private_optimizer must be one of '
                     f'{PRIVATE_OPTIMIZERS}, got {config.private_optimizer!r}')
  if config.embedding_dim is not None and config.embedding_dim < 0:
    raise ValueError(
        f'embedding_dim must be >= 0, got {config.embedding_dim}')
  if not config.dp.clip_norm > 0:
    raise ValueError(f'clip_norm must be > 0, got {config.dp.clip_norm}')
  if config.eval_chunk < 1:
    raise ValueError(f'eval_chunk must be >= 1, got {config.eval_chunk}')
  if config.cold_start_epochs < 0:
    raise ValueError(
        f'cold_start_epochs must be >= 0, got {config.cold_start_epochs}')
  if config.simulation_batch_users < 0:
    raise ValueError('simulation_batch_users must be >= 0 (0: all of a '
                     f'shard\'s users), got {config.simulation_batch_users}')
  if isinstance(config.eval_strategies, str):
    raise ValueError('eval_strategies must be a list of strategy texts, got '
                     f'the string {config.eval_strategies!r}')
  try:
    strategies_lib.resolve(config.eval_strategies)
  except ValueError as e:
    raise ValueError(f'eval_strategies: {e}') from e


def validate(config: ExperimentConfig, population: int) -> privacy.DPConfig:
  """Checks the configuration before any work starts; returns the DP config."""
  check_values(config)
  registry.spec(config.algorithm)  # An unknown name fails here.
  training_loop.LoopConfig(
      rounds=config.rounds, clients_per_round=config.clients_per_round,
      population=population, experiment_dir=config.experiment_dir,
      sampling=config.sampling, checkpoint_every=config.checkpoint_every,
      eval_every=config.eval_every,
      keep_checkpoints=config.keep_checkpoints).validate()
  if (config.client_learning_rate <= 0 or config.server_learning_rate <= 0 or
      (config.private_learning_rate is not None and
       config.private_learning_rate <= 0)):
    raise ValueError('learning rates must be positive')
  if config.eval_clients < 0 or config.eval_clients > population:
    raise ValueError(f'eval_clients must be in [0, population={population}], '
                     f'got {config.eval_clients}')
  evaluated = config.eval_clients or population
  if not 0 <= config.curve_eval_clients <= evaluated:
    raise ValueError('curve_eval_clients must be in [0, the evaluated '
                     f'clients={evaluated}], got {config.curve_eval_clients}')
  make_server_optimizer(config.server_optimizer, config.server_learning_rate,
                        config.server_momentum)
  make_client_optimizer(config)
  registry.check_algorithm_options(config.algorithm, config.algorithm_options)
  if config.dp_personal_heads not in DP_PERSONAL_HEADS:
    raise ValueError(f'dp_personal_heads must be one of {DP_PERSONAL_HEADS}, '
                     f'got {config.dp_personal_heads!r}')
  if (config.dp_personal_heads == 'noised'
      and config.dp.mechanism != 'gaussian_fixed'):
    raise ValueError(
        "dp_personal_heads='noised' noises personal heads at the shared "
        "aggregate's noise multiplier, which needs dp mechanism "
        f"'gaussian_fixed'; got {config.dp.mechanism!r}")
  not_distributed = registry.spec(config.algorithm).distributed_dp
  if config.dp.is_distributed and not_distributed:
    raise ValueError(f'{config.algorithm} does not run dp mechanism '
                     f'{config.dp.mechanism!r}: {not_distributed}')
  if config.simulation_round not in ROUND_FORMS:
    raise ConfigurationError(f'simulation_round must be one of {ROUND_FORMS}, '
                             f'got {config.simulation_round!r}')
  if config.simulation_round == 'inprocess':
    not_inprocess = registry.spec(config.algorithm).inprocess
    if not_inprocess:
      raise ConfigurationError(f'simulation_round=inprocess: '
                               f'{config.algorithm} has no in-process round: '
                               f'{not_inprocess}')
  if (config.dp.mechanism not in ('none', 'gaussian_fixed') and
      config.simulation_shards > 0):
    raise ValueError(
        f'simulation_shards={config.simulation_shards}: the sharded '
        'simulation runs dp mechanism gaussian_fixed only (a shard sends '
        f'one record for its users; {config.dp.mechanism} needs each '
        'user\'s own); use simulation_shards=0 or -1 (one user per client)')
  # A multi-stage algorithm's earlier stages are noised rounds too.
  dp = dataclasses.replace(
      config.dp, clients_per_round=config.clients_per_round,
      population=population,
      rounds=config.rounds + registry.earlier_rounds(
          config.algorithm, config.algorithm_options),
      sampling=config.sampling)
  if dp.mechanism == 'none':
    return dp
  dp = privacy.resolve(dp)
  privacy.check_accountable(dp)  # Refused now, not at the first report.
  return dp


@dataclasses.dataclass(frozen=True)
class Resolved:
  """A run's configuration checked against its task, once (`resolve`).

  What the run's parts read instead of checking the configuration again:
  `training.train` and `runs.run_experiment` take one in place of the
  `ExperimentConfig` (a binary resolves before it starts a runtime, so a
  bad configuration ends there, naming the field).

  Attributes:
    config: the configuration as given.
    population: the task's population it was checked against.
    dp: the resolved DP config (`validate`): delta filled in, a target
      epsilon calibrated to a noise multiplier, the rounds of every stage.
  """
  config: ExperimentConfig
  population: int
  dp: privacy.DPConfig


def resolve(task, config: 'ExperimentConfig | Resolved') -> Resolved:
  """Checks `config` against `task` once: the algorithm fits the task
  (`registry.check_compatible`) and every value is usable (`validate`).

  A `Resolved` of the same population is returned as it is.

  Raises:
    ValueError: naming the field (or the missing capability and how the
      task gives it).

  Example:
    resolved = experiment.resolve(task, config)
    run = runs.run_experiment(task, resolved)
  """
  if isinstance(config, Resolved):
    if config.population != task.population:
      raise ValueError(
          f'the configuration was resolved for a population of '
          f'{config.population}, but the task has {task.population} clients')
    return config
  registry.check_compatible(config.algorithm, task, config.algorithm_options)
  return Resolved(config=config, population=task.population,
                  dp=validate(config, task.population))


def releases_unnoised(config: ExperimentConfig) -> bool:
  """Whether the run may release values DP does not cover: always without
  DP, under DP only with `release_unnoised_metrics`."""
  return config.dp.mechanism == 'none' or config.release_unnoised_metrics


def releases_train_metrics(config: ExperimentConfig) -> bool:
  """Whether the process releases its (un-noised) training-metric sums."""
  return config.train_metrics and releases_unnoised(config)


def private_noise_of(config: ExperimentConfig, dp: privacy.DPConfig
                     ) -> Optional[private_noise.PrivateNoise]:
  """The personal heads' noise of a run (None unless 'noised'); `dp` is
  `validate`'s resolved DP config."""
  if config.dp_personal_heads != 'noised':
    return None
  return private_noise.PrivateNoise(clip_norm=dp.clip_norm,
                                    noise_multiplier=dp.noise_multiplier)


# `build_process`'s default aggregator: the one `config.dp` describes.
FROM_CONFIG = 'from_config'


# Processes built with the aggregator `config.dp` describes, the most
# recent `_BUILT_MAX`, keyed by `_build_key`: a run trained again, resumed,
# re-evaluated or opened (`runs.Run`) in the same Python process reuses the
# process and what was made from it (`derived`), instead of tracing them
# again. A task built by name is keyed by its build record and class (a
# reloaded module's task is another), one built directly by its id (it is
# held, so the id is not reused). Only processes whose model weights take
# at most `_KEPT_WEIGHT_BYTES` are kept: what is made from a process holds
# models of its own (a sharded form one per shard), so keeping a large
# model's (FedPerC's GPT-2) would hold several copies of it between runs.
_BUILT = collections.OrderedDict()
_BUILT_MAX = 6
_KEPT_WEIGHT_BYTES = 32 << 20
# The `ExperimentConfig` fields a process does not depend on: where and how
# long a run trains, how it is simulated, evaluated and stored. DP enters
# the key resolved (but for its rounds, which only the accounting reads).
_NOT_BUILT_FROM = (
    'experiment_name', 'root_output_dir', 'resume', 'rounds',
    'checkpoint_every', 'keep_checkpoints', 'eval_every', 'eval_clients',
    'curve_eval_clients', 'eval_chunk', 'simulation_shards',
    'simulation_batched', 'simulation_batch_users', 'simulation_round',
    'eval_fine_tune',
    'test_fine_tune', 'cold_start_epochs', 'eval_strategies',
    'client_state_backend')
_DERIVED = weakref.WeakKeyDictionary()


def _build_key(task, config: ExperimentConfig, dp) -> tuple:
  record = task_lib.build_record(task)
  task_key = (('record', json.dumps(record, sort_keys=True, default=repr),
               id(type(task))) if record is not None else ('id', id(task)))
  built_from = dataclasses.replace(config, **dict.fromkeys(_NOT_BUILT_FROM))
  # The aggregator does not depend on the rounds the accounting covers.
  return task_key, repr(built_from), repr(
      dp if dp is None else dataclasses.replace(dp, rounds=None))


def derived(process, key, build: Callable[[], Any]):
  """`build()`, made once per `process` and `key` and kept as long as the
  process is: a form or traced computation made from a process alone (its
  sharded form, its evaluators), so that a process built again
  (`build_process`'s reuse) is not traced again. A process whose model
  weights take more than `_KEPT_WEIGHT_BYTES` keeps nothing (what is made
  holds models of its own).

  Example:
    train = derived(proc, ('sharded', 2), lambda: ShardedProcess(proc, 2))
  """
  size = _weight_bytes(process)
  if size is None or size > _KEPT_WEIGHT_BYTES:  # Not kept (`_BUILT`).
    return build()
  try:
    made = _DERIVED.setdefault(process, {})
  except TypeError:  # Not weakly referenceable: made every time.
    return build()
  if key not in made:
    made[key] = build()
  return made[key]


def build_process(task, config: ExperimentConfig, aggregator=FROM_CONFIG,
                  dp: Optional[privacy.DPConfig] = None):
  """The configured algorithm's process on `task`, as the run trains it.

  With the default aggregator, a process built before in this Python
  process for the same task and the configuration fields it depends on is
  returned again (the last few are kept).

  Args:
    task: the task (its model factories and metrics).
    config: the run's configuration.
    aggregator: the shared update's aggregation factory. By default the
      one `config.dp` resolves to (`privacy.build_aggregator`), so that a DP
      run's checkpoints load into the process built here; None: the
      weighted mean, whatever `config.dp` says.
    dp: the resolved DP config (`validate(config, task.population)`);
      resolved here when None and needed.

  Returns:
    The process, or a `stages.Staged` for a multi-stage algorithm.
  """
  noised_heads = config.dp_personal_heads == 'noised'
  if noised_heads and registry.spec(config.algorithm).model == 'fedperc':
    raise ValueError(
        f"dp_personal_heads='noised' noises a split model's personal "
        f'heads; {config.algorithm} trains FedPerC\'s model, whose private '
        "state is never noised (use dp_personal_heads='exempt')")
  if dp is None and (aggregator is FROM_CONFIG or noised_heads):
    dp = validate(config, task.population)
  key = None
  if aggregator is FROM_CONFIG:
    key = _build_key(task, config, dp)
    if key in _BUILT:
      _BUILT.move_to_end(key)
      return _BUILT[key][1]
    aggregator = privacy.build_aggregator(dp)
  built = _build(task, config, aggregator, dp, noised_heads)
  size = _weight_bytes(built)
  if key is not None and size is not None and size <= _KEPT_WEIGHT_BYTES:
    _BUILT[key] = (task, built)
    while len(_BUILT) > _BUILT_MAX:
      _BUILT.popitem(last=False)
  return built


def _weight_bytes(built) -> Optional[int]:
  """The bytes of `built`'s initial model weights (every stage's), or
  None where a process does not record them."""
  processes = ([s.process for s in built.stages]
               if isinstance(built, stages_lib.Staged) else [built])
  total = 0
  for proc in processes:
    composition = getattr(proc, 'composition', None)
    if composition is None:
      return None
    total += sum(np.asarray(w).nbytes for w in tf.nest.flatten(
        composition.initial_model_weights))
  return total


def _build(task, config: ExperimentConfig, aggregator, dp, noised_heads):
  model_factory = registry.model_factory(config.algorithm, task,
                                         config.algorithm_options)
  if noised_heads:
    model_factory = private_noise.with_private_noise(
        model_factory, private_noise_of(config, dp))
  return registry.build(
      config.algorithm, model_factory,
      client_optimizer=make_client_optimizer(config),
      server_optimizer=make_server_optimizer(config.server_optimizer,
                                             config.server_learning_rate,
                                             config.server_momentum),
      aggregator_factory=aggregator, metrics_fn=task.metrics_fn,
      train_metrics=releases_train_metrics(config), seed=config.seed,
      private_optimizer=make_private_optimizer(config),
      **({} if config.embedding_dim is None else
         {'embedding_dim': config.embedding_dim}),
      **registry.check_algorithm_options(config.algorithm,
                                         config.algorithm_options))


def initial_client_state_fn(proc, config: ExperimentConfig):
  """The documented initial state of a client id: the process's own
  (`initial_private`, e.g. Ditto's initial global model) where it sets one,
  else `config.personal_init`'s: the model's own initializers seeded per
  client ('model', `core/personal_init.py`) or the seeded normal draw of
  `personal_init_stddev` ('normal')."""
  template = tff.types.type_to_tf_tensor_specs(proc.client_state_type)
  initial_private = getattr(proc, 'initial_private', None)
  if initial_private is not None:
    return client_state_lib.constant_initial_state_fn(template,
                                                      initial_private)
  if config.personal_init == 'model' and getattr(proc, 'model_fn', None):
    return personal_init_lib.model_initial_state_fn(proc.model_fn, template,
                                                    config.seed)
  return client_state_lib.seeded_initial_state_fn(
      template, config.seed, init='normal', stddev=config.personal_init_stddev)


def probe_client_updates(task, config: ExperimentConfig, client_ids,
                         return_shapes: bool = False):
  """The shared-model updates the clients would send from the initial model.

  Each of `client_ids` runs the algorithm's client step once (its local
  training from its initial private state) on the initial server model; the
  result is one flattened update per row, unclipped and un-noised. For DP
  diagnostics (`binaries.dp_budget`): this is what the DP aggregator clips.
  Needs an algorithm whose process records its client step. With
  `return_shapes`, also the shapes of the update's tensors in row order
  (`(rows, shapes)`), so a row can be cut back into them.
  """
  # The shared update does not depend on noise on the personal heads, which
  # is added after it is computed (tests/private_noise_test.py).
  proc = stages_lib.final_process(build_process(task, dataclasses.replace(
      config, dp_personal_heads='exempt')))
  composition = proc.composition
  if composition is None or composition.client_step is None:
    raise ValueError(f'{config.algorithm!r} records no per-user client step; '
                     'its updates cannot be probed')
  step = tf.function(composition.client_step())
  weights = proc.get_model_weights(proc.initialize())
  initial_state = initial_client_state_fn(proc, config)
  rows, shapes = [], None
  for cid, data in zip(client_ids, task.train_datasets(list(client_ids), 1)):
    out = step(weights, initial_state(cid), data)
    tensors = [np.asarray(x) for x in tf.nest.flatten(out['update'])]
    shapes = [tuple(x.shape) for x in tensors]
    rows.append(np.concatenate([np.ravel(x) for x in tensors]))
  rows = np.stack(rows)
  return (rows, shapes) if return_shapes else rows


GROUPS_DIRNAME = 'groups'


def group_directory(config: ExperimentConfig, group: str) -> str:
  """Where a per-group stage's run of `group` lives."""
  return os.path.join(config.experiment_dir, GROUPS_DIRNAME, group)


# Salt of the shuffled grouping's permutation.
_SHUFFLED_GROUPS = 0x6A0


def group_members(task, config: ExperimentConfig,
                  grouping: str = 'task') -> dict[str, list[int]]:
  """`{group name: its client ids}` of a per-group stage.

  'task': the task's groups in its order (`group_names` where it has one,
  else sorted); 'shuffled': groups of the same sizes whose members are a
  permutation of the clients drawn by `config.seed`, named `random_<i>`;
  'one': every client in one group, `all`. Raises ConfigurationError when
  a group has fewer clients than a round's cohort (a group's run samples
  `clients_per_round` of its own clients), or when DP is calibrated to a
  target epsilon (the calibration assumes one population; give the noise
  multiplier).
  """
  ids = np.arange(task.population)
  if grouping == 'one':
    groups = {'all': [int(i) for i in ids]}
  else:
    labels = [str(g) for g in task.groups(ids)]
    order = [str(g) for g in getattr(task, 'group_names', ())] or sorted(
        set(labels))
    groups = {g: [int(i) for i, l in zip(ids, labels) if l == g]
              for g in order}
    groups = {g: m for g, m in groups.items() if m}
    if grouping == 'shuffled':
      perm = np.random.default_rng([config.seed, _SHUFFLED_GROUPS]
                                   ).permutation(task.population)
      shuffled, start = {}, 0
      for i, members in enumerate(groups.values()):
        shuffled[f'random_{i}'] = sorted(
            int(c) for c in perm[start:start + len(members)])
        start += len(members)
      groups = shuffled
  small = {g: len(m) for g, m in groups.items()
           if len(m) < config.clients_per_round}
  if small:
    raise ConfigurationError(
        f'{config.algorithm} runs its last stage once per group, sampling '
        f'clients_per_round={config.clients_per_round} of the group\'s '
        f'clients each round, but groups {small} have fewer clients; lower '
        '--clients_per_round')
  if config.dp.target_epsilon is not None:
    raise ConfigurationError(
        f'{config.algorithm} runs its last stage once per group (each '
        'group\'s run samples from its own clients), which a target-epsilon '
        'calibration over one population does not account; give '
        '--noise_multiplier instead (the report states epsilon per group)')
  for g in groups:
    if not g or '/' in g or g in ('.', '..'):
      raise ConfigurationError(f'group name {g!r} cannot name a directory')
  return groups


def stage_directory(config: ExperimentConfig, name: str) -> str:
  """Where an earlier stage of a multi-stage algorithm runs."""
  return os.path.join(config.experiment_dir, 'stages', name)


# Names that moved away raise an error naming their new place.
__getattr__ = moved.module_getattr(__name__)
