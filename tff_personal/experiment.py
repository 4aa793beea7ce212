"""One experiment: a task, an algorithm, DP, a client-state store and the loop.

The binaries parse flags and call `run_experiment`; everything worth testing
is here or below. A task is any object with the members of
`tff_personal/core/task.Task` (and the optional capabilities the algorithm
needs, `algorithms/registry.py`); the process says how it is evaluated
(`StatefulClientProcess.eval_model_fn` and its neighbours).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_personal import run_lock
from tff_personal.algorithms import fedavg
from tff_personal.algorithms import registry
from tff_personal.core import client_state as client_state_lib
from tff_personal.core import evaluation
from tff_personal.core import options as options_lib
from tff_personal.core import private_noise
from tff_personal.core import privacy
from tff_personal.core import process as process_lib
from tff_personal.core import sharded
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


def _private_optimizer(config: ExperimentConfig):
  if config.private_learning_rate is None:
    return None
  return fedavg.adam(config.private_learning_rate)


class ConfigurationError(ValueError):
  """The algorithm cannot be built under this configuration (nothing ran)."""


def check_values(config: ExperimentConfig) -> None:
  """Raises ValueError for values no run can use, naming the field.

  Numbers must be finite and integers 32-bit (`options.INT_LIMIT`), the
  seed >= 0; `experiment_name` must be a plain directory name
  (the run writes only below `root_output_dir`); `personal_init_stddev`
  >= 0, `embedding_dim` >= 0 (whether 0, no personal embedding, is allowed
  is the algorithm builder's to say), `dp.clip_norm` > 0 (with or without
  DP), `eval_chunk` >= 1, `cold_start_epochs` >= 0.
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


def validate(config: ExperimentConfig, population: int) -> privacy.DPConfig:
  """Checks the configuration before any work starts; returns the DP config."""
  check_values(config)
  if config.algorithm not in registry.ALGORITHMS:
    raise ValueError(f'unknown algorithm {config.algorithm!r}; known: '
                     f'{sorted(registry.ALGORITHMS)}')
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
  # A multi-stage algorithm's earlier stages are noised rounds too.
  dp = dataclasses.replace(
      config.dp, clients_per_round=config.clients_per_round,
      population=population,
      rounds=config.rounds + registry.earlier_rounds(
          config.algorithm, config.algorithm_options),
      sampling=config.sampling)
  if dp.mechanism == 'none':
    return dp
  return privacy.resolve(dp)


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


def build_process(task, config: ExperimentConfig, aggregator=None,
                  dp: Optional[privacy.DPConfig] = None):
  """The configured algorithm's process on `task` (None: weighted mean).

  `dp`: the resolved DP config, needed when `config.dp_personal_heads` is
  'noised' (the personal heads' noise takes its clip and multiplier).
  """
  model_factory = registry.model_factory(config.algorithm, task,
                                         config.algorithm_options)
  if config.dp_personal_heads == 'noised':
    if registry.spec(config.algorithm).model == 'fedperc':
      raise ValueError(
          f"dp_personal_heads='noised' noises a split model's personal "
          f'heads; {config.algorithm} trains FedPerC\'s model, whose private '
          "state is never noised (use dp_personal_heads='exempt')")
    if dp is None:
      raise ValueError("dp_personal_heads='noised' needs the resolved DP "
                       'config (build_process(..., dp=validate(...)))')
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
      private_optimizer=_private_optimizer(config),
      **({} if config.embedding_dim is None else
         {'embedding_dim': config.embedding_dim}),
      **registry.check_algorithm_options(config.algorithm,
                                         config.algorithm_options))


def initial_client_state_fn(proc, config: ExperimentConfig):
  """The documented initial state of a client id: the process's own
  (`initial_private`, e.g. Ditto's initial global model) where it sets one,
  else the seeded normal draw of `personal_init_stddev`."""
  template = tff.types.type_to_tf_tensor_specs(proc.client_state_type)
  initial_private = getattr(proc, 'initial_private', None)
  if initial_private is not None:
    return client_state_lib.constant_initial_state_fn(template,
                                                      initial_private)
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


def _personal_evaluator(task, proc, config: ExperimentConfig, store,
                        num_shards: int, eval_ids=None):
  """`(evaluate, eval_ids, eval_data_fn)` for `proc`'s state on `task`.

  `evaluate(state, datasets_fn, ids=eval_ids, fine_tune=config.eval_fine_tune,
  test=False)` tests the clients `ids` with their private states from
  `store` (after the fixed local pass of `eval_fine_tune` if `fine_tune`)
  and returns `task.evaluate`'s metrics; `evaluate.outputs` (same
  arguments) returns the per-client outputs instead. `eval_ids`: the
  clients evaluated by default (None: `config.eval_clients` of them drawn
  by the seed, `eval_client_ids`). Shared by training (`run_experiment`)
  and re-evaluation (`evaluate_experiment`).
  """
  weights_type = proc.model_weights_type
  model_fn = getattr(proc, 'eval_model_fn', proc.model_fn)
  # The state evaluation sees (e.g. FedAvg+FT's: the global model to
  # fine-tune) and whether the process always fine-tunes before testing.
  state_type = getattr(proc, 'eval_client_state_type', proc.client_state_type)
  always_fine_tune = getattr(proc, 'eval_fine_tune', False)
  fine_tune_optimizer = (getattr(proc, 'eval_fine_tune_optimizer', None) or
                         _private_optimizer(config) or
                         make_client_optimizer(config)) if (
          config.eval_fine_tune or config.test_fine_tune or
          always_fine_tune) else None
  # Sharded evaluation reads the task's numpy batches where it has them
  # (examples in its wire form); otherwise its tf.data datasets.
  wire = getattr(task, 'wire_format', None)
  batches_eval = bool(num_shards) and hasattr(task, 'eval_batches')
  eval_data_fn = task.eval_batches if batches_eval else task.eval_datasets
  batches_train = bool(num_shards) and hasattr(task, 'train_batches')
  fine_tune_train_fn = (task.train_batches if batches_train else
                        task.train_datasets)
  if num_shards:  # The same per-user outputs, users packed in shards.
    personal_eval = sharded.ShardedPersonalEval(
        model_fn, num_shards, wire=wire if batches_eval else None)
    # Held-out test sets (test_datasets) are tf.data datasets.
    test_eval = (sharded.ShardedPersonalEval(model_fn, num_shards)
                 if batches_eval else personal_eval)
    fine_tune_eval = test_fine_tune_eval = None
    if fine_tune_optimizer is not None:
      fine_tune_eval = sharded.ShardedPersonalEval(
          model_fn, num_shards, fine_tune_optimizer=fine_tune_optimizer,
          wire=wire if batches_eval else None,
          train_wire=wire if batches_train else None)
      test_fine_tune_eval = (sharded.ShardedPersonalEval(
          model_fn, num_shards, fine_tune_optimizer=fine_tune_optimizer,
          train_wire=wire if batches_train else None)
                             if batches_eval else fine_tune_eval)
  else:
    personal_eval = test_eval = evaluation.build_personal_eval(
        model_fn, weights_type, state_type)
    fine_tune_eval = test_fine_tune_eval = (
        evaluation.build_cold_start_eval(
            model_fn, weights_type, state_type,
            fine_tune_optimizer) if fine_tune_optimizer is not None else None)
  if eval_ids is None:
    eval_ids = eval_client_ids(task.population, config.eval_clients,
                               config.seed)

  def outputs_of(state, datasets_fn, ids=eval_ids,
                 fine_tune=config.eval_fine_tune, test=False):
    fine_tune = fine_tune or always_fine_tune
    weights = proc.get_model_weights(state)
    plain, tuned = ((test_eval, test_fine_tune_eval) if test else
                    (personal_eval, fine_tune_eval))
    outputs = []
    for i in range(0, len(ids), config.eval_chunk):
      chunk = ids[i:i + config.eval_chunk]
      states = process_lib.eval_client_states(proc, weights,
                                              store.load(chunk))
      if not fine_tune:
        outputs.extend(plain(weights, states, datasets_fn(chunk)))
      else:  # The same fixed local pass at every evaluation.
        outputs.extend(tuned(
            weights, states, fine_tune_train_fn(chunk, config.rounds),
            datasets_fn(chunk)))
    return outputs

  def evaluate(state, datasets_fn, ids=eval_ids,
               fine_tune=config.eval_fine_tune, test=False):
    return task.evaluate(outputs_of(state, datasets_fn, ids, fine_tune, test),
                         ids)

  evaluate.outputs = outputs_of
  return evaluate, eval_ids, eval_data_fn


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


def _checked_eval_ids(eval_ids: Sequence[int], population: int) -> list[int]:
  """`eval_ids` as a sorted list of ints; refuses repeats, clients outside
  [0, population) and an empty list."""
  ids = [int(i) for i in eval_ids]
  if not ids:
    raise ConfigurationError('eval_ids is empty: give at least one client')
  if len(set(ids)) != len(ids):
    raise ConfigurationError('eval_ids repeats clients')
  outside = [i for i in ids if not 0 <= i < population]
  if outside:
    raise ConfigurationError(f'eval_ids {outside[:5]} are outside the '
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


def _holding_lock(create: bool):
  """Decorates `fn(task, config, ...)` to run holding the lock of
  `config.experiment_dir` (`run_lock.hold(..., create)`).

  The decorated function raises `run_lock.ExperimentLockedError`, before
  doing anything, when another process holds the lock. A run refused for
  its configuration (a `ValueError` before any work) leaves no directory it
  created behind.
  """
  def decorate(fn):
    @functools.wraps(fn)
    def holding(task, config, *args, **kwargs):
      existed = os.path.exists(config.experiment_dir)
      try:
        with run_lock.hold(config.experiment_dir, create=create):
          return fn(task, config, *args, **kwargs)
      except ValueError:
        if not existed:
          run_lock.remove_if_unused(config.experiment_dir)
        raise
    return holding
  return decorate


@_holding_lock(create=True)
def run_experiment(task, config: ExperimentConfig,
                   log_fn: Callable[[str], None] = print,
                   flag_values: Optional[dict[str, Any]] = None,
                   export_private_states: bool = False,
                   eval_ids: Optional[Sequence[int]] = None) -> dict:
  """Trains and evaluates; writes and returns the summary (summary.json).

  `eval_ids`: the clients every evaluation tests (sorted, distinct, in the
  population), e.g. a validation sample disjoint from the clients a report
  tests; None: `config.eval_clients` of them drawn by the seed.

  With `export_private_states`, the final private states of the evaluated
  clients are written to `private_states.npz` (ids and each private tensor)
  for analysis such as the t-SNE of user embeddings. This reads every
  client's state, which only a simulation can do; a deployment never would.
  """
  registry.check_compatible(config.algorithm, task, config.algorithm_options)
  population = task.population
  dp = validate(config, population)
  if eval_ids is not None:
    eval_ids = _checked_eval_ids(eval_ids, population)
    if config.curve_eval_clients > len(eval_ids):
      raise ConfigurationError(
          f'curve_eval_clients={config.curve_eval_clients} is more than the '
          f'{len(eval_ids)} eval_ids')
  _check_rounds_not_below_completed(config)
  resuming = bool(training_loop.checkpoint_rounds(config.experiment_dir))
  if resuming:  # Checks against the record; writes nothing.
    check_or_record_run_config(config, dp, flag_values)
    finished = _finished_summary(config)
    if finished is not None:
      log_fn(f'{config.experiment_dir} already finished its {config.rounds} '
             'rounds (summary.json); nothing was run and nothing was changed')
      return finished
  t_start = time.perf_counter()

  try:  # The builders check the rest of the configuration.
    built = build_process(task, config, privacy.build_aggregator(dp), dp)
  except ValueError as e:
    raise ConfigurationError(str(e)) from e
  proc = stages_lib.final_process(built)
  if isinstance(built, stages_lib.Staged):
    _check_stage_cohorts(built, config, population)
  per_group = isinstance(built, stages_lib.Staged) and built.per_group
  if per_group:  # Refused here, before any record or round.
    groups = group_members(task, config, built.stages[-1].grouping)
  if not resuming:  # A new run's record, once its process could be built.
    os.makedirs(config.experiment_dir, exist_ok=True)
    check_or_record_run_config(config, dp, flag_values)
  initial_state, earlier_noised = None, 0
  if isinstance(built, stages_lib.Staged):  # e.g. FedDVA: VAE, classifier
    initial_state, earlier_noised = _run_earlier_stages(task, built, config,
                                                        dp, log_fn)
  if per_group:  # e.g. GroupFL: one run of the last stage per group.
    return _run_per_group(task, proc, config, dp, groups, initial_state,
                          earlier_noised, log_fn, flag_values, eval_ids)
  train_proc, num_shards, store, train_data_fn = _training_parts(
      task, proc, config, dp, config.experiment_dir, log_fn)

  evaluate, eval_ids, eval_data_fn = _personal_evaluator(
      task, proc, config, store, num_shards, eval_ids)

  curve_ids = curve_eval_ids(eval_ids, config.curve_eval_clients,
                             config.seed)

  def eval_fn(state, round_num):
    if round_num < config.rounds:  # A point of the learning curve.
      return evaluate(state, eval_data_fn, ids=curve_ids)
    return evaluate(state, eval_data_fn)

  loop_config = _loop_config(config, config.experiment_dir, population)
  setup_seconds = time.perf_counter() - t_start
  try:
    result = training_loop.run_training(
        train_proc, store=store, train_data_fn=train_data_fn,
        config=loop_config, eval_fn=eval_fn, log_fn=log_fn,
        initial_state=initial_state)
    finals = _final_evaluations(task, proc, result.state, store, config,
                                evaluate, log_fn)
    if export_private_states:
      _export_private_states(store, eval_ids, config.experiment_dir)
  finally:
    store.close()

  # Every stage's shared update went through the run's aggregator.
  report = run_privacy_report(config, dp, result.rounds_completed,
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
      'eval': result.eval_metrics,
      **finals,
      'final_train_metrics': result.train_metrics,
  }
  return _write_summary(config, summary, report, flag_values, log_fn)


def _write_summary(config: ExperimentConfig, summary: dict,
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


def _loop_config(config: ExperimentConfig, directory: str, population: int,
                 rounds: int = 0, clients_per_round: int = 0,
                 eval_every: Optional[int] = None) -> training_loop.LoopConfig:
  """The loop's configuration of one run in `directory` (the experiment's,
  an earlier stage's or a group's): the experiment's settings, with a
  stage's own `rounds` and `clients_per_round` where given (0: the
  experiment's)."""
  return training_loop.LoopConfig(
      rounds=rounds or config.rounds,
      clients_per_round=clients_per_round or config.clients_per_round,
      population=population, experiment_dir=directory,
      sampling=config.sampling, seed=config.seed,
      checkpoint_every=config.checkpoint_every,
      keep_checkpoints=config.keep_checkpoints,
      eval_every=config.eval_every if eval_every is None else eval_every,
      resume=config.resume, release_unnoised=releases_unnoised(config))


GROUPS_DIRNAME = 'groups'


def group_directory(config: ExperimentConfig, group: str) -> str:
  """Where a per-group stage's run of `group` lives."""
  return os.path.join(config.experiment_dir, GROUPS_DIRNAME, group)


def _check_stage_cohorts(staged, config: ExperimentConfig,
                         population: int) -> None:
  """Refuses a stage cohort above the population, or one that differs from
  the experiment's under DP (one aggregator: its mean's denominator and the
  accounting are the experiment's cohort)."""
  for stage in staged.stages:
    m = stage.clients_per_round
    if not m or m == config.clients_per_round:
      continue
    if m > population:
      raise ConfigurationError(
          f'stage {stage.name!r} samples {m} clients per round from a '
          f'population of {population}')
    if config.dp.mechanism != 'none':
      raise ConfigurationError(
          f'under DP every stage samples the experiment\'s clients_per_round='
          f'{config.clients_per_round} (one aggregator and one accounting); '
          f'stage {stage.name!r} asks for {m}')


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


def _run_per_group(task, proc, config: ExperimentConfig, dp, groups,
                   initial_state, earlier_noised: int, log_fn,
                   flag_values, eval_ids=None) -> dict:
  """Runs a per-group last stage (`core/stages.py`) and writes the summary.

  Each group's run is the one loop on `core/task.TaskSubset(task, group)`
  in `group_directory` (its own checkpoints, store, metrics and resume),
  from `initial_state`. The evaluation tests each evaluated client with its
  group's final model and pools them with `task.evaluate`; each group's
  own metrics are in `summary['groups']` and its `eval_metrics.csv`.
  Privacy: a user took part in the earlier stages' rounds and in its own
  group's run only; epsilon is the largest over the groups of the two
  composed (`privacy.compute_epsilon_phases`).
  """
  if eval_ids is None:
    eval_ids = eval_client_ids(task.population, config.eval_clients,
                               config.seed)
  eval_set = set(eval_ids)
  curve_set = set(curve_eval_ids(eval_ids, config.curve_eval_clients,
                                 config.seed))
  outputs, per_group, results = {}, {}, {}
  for name, members in groups.items():
    glog = lambda s, n=name: log_fn(f'[group {n}] {s}')
    view = task_lib.TaskSubset(task, members, name=task_lib.task_name(task))
    directory = group_directory(config, name)
    train_proc, num_shards, store, train_data_fn = _training_parts(
        view, proc, config, dp, directory, glog)
    local_eval = [i for i, c in enumerate(members) if c in eval_set]
    local_curve = [i for i, c in enumerate(members) if c in curve_set]
    try:
      evaluate, _, eval_data_fn = _personal_evaluator(
          view, proc, config, store, num_shards, eval_ids=local_eval)

      def eval_fn(state, round_num, view=view, evaluate=evaluate,
                  eval_data_fn=eval_data_fn, local_eval=local_eval,
                  local_curve=local_curve, name=name):
        ids = local_curve if round_num < config.rounds else local_eval
        if not ids:
          return {}
        outs = evaluate.outputs(state, eval_data_fn, ids=ids)
        outputs[name] = (view.global_ids(ids), outs)
        return view.evaluate(outs, ids)

      result = training_loop.run_training(
          train_proc, store=store, train_data_fn=train_data_fn,
          config=_loop_config(config, directory, len(members)),
          eval_fn=eval_fn, log_fn=glog, initial_state=initial_state)
    finally:
      store.close()
    results[name] = result
    per_group[name] = {
        'clients': len(members), 'eval_clients': len(local_eval),
        'rounds_started': result.rounds_started,
        'resumed_from_round': result.resumed_from,
        'seconds_per_round': result.seconds_per_round,
        'eval': result.eval_metrics,
        'final_train_metrics': result.train_metrics}
  ids, outs = [], []
  for name in groups:
    if name in outputs:
      ids += outputs[name][0]
      outs += list(outputs[name][1])
  order = np.argsort(ids, kind='stable')
  eval_metrics = task.evaluate([outs[i] for i in order],
                               [ids[i] for i in order]) if ids else {}
  log_fn(f'evaluation, each client on its group\'s model: '
         f'{_short(eval_metrics)}')
  noised = {name: max(r.rounds_completed, r.rounds_started or 0)
            for name, r in results.items()}
  report = run_privacy_report(config, dp, config.rounds,
                              max(noised.values()), earlier_noised)
  if report is not None:
    report.update(_per_group_privacy(config, dp, groups, noised,
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
  return _write_summary(config, summary, report, flag_values, log_fn)


def _per_group_privacy(config: ExperimentConfig, dp, groups, noised,
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


def _training_parts(task, proc, config: ExperimentConfig, dp, directory: str,
                    log_fn):
  """`(train_proc, num_shards, store, train_data_fn)` of one process run
  in `directory` (its client-state store under `client_states/`)."""
  num_shards = sharded.resolve_num_shards(proc, config.simulation_shards, dp)
  # Tasks whose examples travel in a compact form (speech: uint8) say so.
  train_proc = sharded.maybe_shard(proc, num_shards, dp,
                                   getattr(task, 'wire_format', None))
  log_fn(f'simulation: {num_shards} shards per round' if num_shards else
         'simulation: one user per TFF client')
  rounds = training_loop.checkpoint_rounds(directory)
  if rounds and not config.resume:  # Before the store is opened: SQLite
    # would fold a killed run's write-ahead log into the database.
    raise training_loop.CheckpointError(
        f'{os.path.join(directory, "checkpoints")} already holds checkpoints '
        f'(rounds {rounds}); pass --resume to continue that run, or choose a '
        'new --experiment_name. Nothing was changed.')
  _check_store_present(config, task.population, directory)
  store = client_state_lib.make_store(
      config.client_state_backend, initial_client_state_fn(proc, config),
      population=task.population,
      directory=os.path.join(directory, 'client_states'))
  train_data_fn = (task.train_batches if num_shards and
                   hasattr(task, 'train_batches') else task.train_datasets)
  return train_proc, num_shards, store, train_data_fn


def load_client_states(proc, config: ExperimentConfig, population: int,
                       directory: str, rounds: int) -> list:
  """Every client's state as committed at round `rounds` by the run of
  `proc` in `directory` (its `client_states/` store), read only.

  For reading back a finished run (or a stage of one): the store is opened,
  restored to that round's snapshot, read and closed; nothing is written.
  """
  store = client_state_lib.make_store(
      config.client_state_backend, initial_client_state_fn(proc, config),
      population=population,
      directory=os.path.join(directory, 'client_states'))
  try:
    store.restore(rounds)
    return store.load(list(range(population)))
  finally:
    store.close()


def stage_directory(config: ExperimentConfig, name: str) -> str:
  """Where an earlier stage of a multi-stage algorithm runs."""
  return os.path.join(config.experiment_dir, 'stages', name)


def _run_earlier_stages(task, staged: stages_lib.Staged,
                        config: ExperimentConfig, dp, log_fn):
  """Runs every stage but the last with the one loop, each in its own
  directory (resumed from there with `config.resume`; a finished stage runs
  no round again). Returns the last stage's initial server state and the
  rounds the earlier stages noised (started, replays included)."""
  state, noised = None, 0
  for stage, following in zip(staged.earlier, staged.stages[1:]):
    directory = stage_directory(config, stage.name)
    stage_log = lambda s, name=stage.name: log_fn(f'[{name}] {s}')
    train_proc, _, store, train_data_fn = _training_parts(
        task, stage.process, config, dp, directory, stage_log)
    try:
      result = training_loop.run_training(
          train_proc, store=store, train_data_fn=train_data_fn,
          config=_loop_config(
              config, directory, task.population, rounds=stage.rounds,
              clients_per_round=stage.clients_per_round, eval_every=0),
          log_fn=stage_log, initial_state=state)
    finally:
      store.close()
    noised += max(result.rounds_completed, result.rounds_started or 0)
    state = following.handoff(result.state)
  return state, noised


def _earlier_stages_noised(config: ExperimentConfig) -> int:
  """The rounds a finished run's earlier stages noised (0 for a
  single-stage algorithm), read from their directories."""
  stages_dir = os.path.join(config.experiment_dir, 'stages')
  total = 0
  for name in (sorted(os.listdir(stages_dir)) if os.path.isdir(stages_dir)
               else ()):
    directory = os.path.join(stages_dir, name)
    completed = training_loop.completed_round(directory)
    total += max(completed or 0, training_loop.rounds_started(
        directory, required=completed is not None) or 0)
  return total


def run_privacy_report(config: ExperimentConfig, dp: privacy.DPConfig,
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
  noise = private_noise_of(config, dp)
  if noise is not None:
    report['personal_heads'] = private_noise.personal_report(
        noise, _personal_passes(config, noised),
        report['delta'], report['neighboring_relation'])
  report['released'] = released_values(config, dp)
  report['train_metrics_released'] = releases_train_metrics(config)
  report['unnoised_metrics_released'] = releases_unnoised(config)
  if releases_unnoised(config):
    report['notes'] = (report.get('notes', '') + ' Un-noised diagnostics '
                       '(--release_unnoised_metrics) are released and are not '
                       'covered by epsilon; see released.').strip()
  return report


def _finished_summary(config: ExperimentConfig) -> Optional[dict]:
  """summary.json of a resumed run that already finished `config.rounds`.

  None unless `config.resume`, the last checkpoint is of round
  `config.rounds` and summary.json records that round: then resuming has
  nothing to run, and the summary is returned as it is.
  """
  path = os.path.join(config.experiment_dir, 'summary.json')
  if not config.resume or not os.path.exists(path):
    return None
  rounds = training_loop.checkpoint_rounds(config.experiment_dir)
  if not rounds or rounds[-1] != config.rounds:
    return None
  summary = read_json_record(path, ResumeError)
  if summary.get('rounds_completed') != config.rounds:
    return None
  return summary


RELEASE_BASES = ('dp', 'public', 'timing', 'evaluation', 'unnoised',
                 'separate_dp')


def _released(name: str, basis: str, why: str) -> dict:
  return dict(name=name, covered=basis in ('dp', 'public'), basis=basis,
              why=why)


def released_values(config: ExperimentConfig, dp: privacy.DPConfig
                    ) -> list[dict]:
  """What a DP run releases, each `{name, covered, basis, why}`.

  `covered` says whether the (epsilon, delta) of the privacy report bounds
  what the value reveals about a user; `basis` says why or why not:
  'dp' (computed from the noised aggregate only: accounted in epsilon),
  'public' (depends on no user: covered trivially), 'timing' (wall time,
  which may depend on the users' data: not covered), 'evaluation' (the
  simulation's held-out evaluation: not covered), 'unnoised' (opt-in
  diagnostics, `release_unnoised_metrics`: not covered), 'separate_dp'
  (noised personal heads: bounded by their own epsilon, not the shared
  one). The list follows
  what the run writes to train_metrics.csv, eval_metrics.csv, TensorBoard,
  summary.json and its log.
  """
  released = [
      _released('shared model update', 'dp',
                f'clipped to {dp.clip_norm} and noised by the {dp.mechanism} '
                'DP aggregator; accounted in epsilon'),
      _released('aggregator and finalizer measurements', 'dp',
                'computed on the server from the noised aggregate (e.g. the '
                'adaptive clip, the server optimizer\'s state): '
                'post-processing'),
      _released('round number, configuration, epsilon and delta', 'public',
                'functions of the configuration and of the rounds run, not '
                'of any user\'s data')]
  unnoised = releases_unnoised(config)
  if releases_train_metrics(config):
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
  return released


def _check_rounds_not_below_completed(config: ExperimentConfig) -> None:
  """Checks a resume's records, and refuses fewer `rounds` than completed.

  Every run directory (the experiment's, each earlier stage's and each
  group's) must pass `training_loop.check_records` (the rounds-started
  record epsilon accounts; checkpoints that hold the round they are named
  for), before any client-state store is opened. The rounds that ran cannot
  be undone (their noise is spent, their client states are saved); a
  shorter resume would report fewer. Raises `training_loop.CheckpointError`
  or `ResumeError` before anything is written.
  """
  if not config.resume:
    return
  groups_dir = os.path.join(config.experiment_dir, GROUPS_DIRNAME)
  stages_dir = os.path.join(config.experiment_dir, 'stages')
  for parent in (stages_dir, groups_dir):  # Each stage's and group's run.
    for name in (sorted(os.listdir(parent)) if os.path.isdir(parent)
                 else ()):
      training_loop.check_records(os.path.join(parent, name))
  training_loop.check_records(config.experiment_dir)
  directories = [config.experiment_dir] + (
      [os.path.join(groups_dir, g) for g in sorted(os.listdir(groups_dir))]
      if os.path.isdir(groups_dir) else [])
  for directory in directories:  # A per-group stage's runs have their own.
    completed = training_loop.completed_round(directory)  # Its contents'.
    if completed is not None and completed > config.rounds:
      raise ResumeError(
          f'{directory} has completed {completed} rounds; '
          f'--rounds={config.rounds} is below that. Rounds that ran cannot be '
          f'undone: resume with --rounds >= {completed}, or re-evaluate the '
          'run with binaries.evaluate. Nothing was changed.')


def _check_store_present(config: ExperimentConfig, population: int,
                         directory: Optional[str] = None) -> None:
  """Refuses to resume checkpoints whose client-state store is gone.

  `directory`: where the checkpoints and the store are (default the
  experiment's; a multi-stage algorithm's earlier stages have their own).

  Opening a missing SQLite database creates an empty one, and a store without
  states loads every client's initial state: the run would continue with
  every user reset. Raises `training_loop.CheckpointError` naming the missing
  file and the round it should hold, before anything is written.
  """
  directory = directory or config.experiment_dir
  rounds = training_loop.checkpoint_rounds(directory)
  if not config.resume or not rounds or rounds[-1] == 0:
    return
  missing = client_state_lib.missing_store(
      config.client_state_backend, os.path.join(directory, 'client_states'),
      population)
  if missing is not None:
    raise training_loop.CheckpointError(
        f'the client-state store {missing} is missing or empty, but the '
        f'server checkpoints of {directory} reach round '
        f'{rounds[-1]}: the store should hold the client states committed at '
        f'round {rounds[-1]} (or at an earlier checkpoint of {rounds}). '
        'Resuming would reset every client to its initial state. Restore the '
        'store (with the run\'s own --client_state_backend), or start a new '
        '--experiment_name. Nothing was changed.')


def _personal_passes(config: ExperimentConfig, rounds: int) -> int:
  """An upper bound on the noised local passes of one user's personal head:
  one per round, one per intermediate evaluation (each fine-tunes from the
  stored state), and the final evaluation's, the held-out test's and the
  fine-tuned test's (a user who never trained has at most the evaluations').
  """
  intermediate = rounds // config.eval_every if config.eval_every else 0
  return rounds + intermediate + 3


RUN_CONFIG_FILENAME = 'run_config.json'
EVALUATIONS_DIRNAME = 'evaluations'
# Config fields that only shape evaluation: a re-evaluation
# (`evaluate_experiment`) may change them.
EVALUATION_FIELDS = ('eval_clients', 'curve_eval_clients', 'eval_chunk',
                     'eval_fine_tune', 'test_fine_tune', 'cold_start_epochs')
# What a resumed run may change: the evaluation fields, how the simulation
# runs and where the run lives (config fields and runtime flags), and
# `rounds` (to extend or shorten it; the noise multiplier is compared as
# resolved, so a DP run calibrated to a target epsilon for other rounds is
# refused, while one with a given noise multiplier may be extended and is
# accounted for all its rounds at that multiplier).
RESUMABLE_FIELDS = EVALUATION_FIELDS + (
    'simulation_shards', 'eval_every', 'checkpoint_every', 'keep_checkpoints',
    'resume', 'rounds',
    'root_output_dir', 'experiment_name', 'use_gpu', 'workers',
    'intra_op_threads', 'inter_op_threads', 'verify_data_checksums')


class ResumeError(training_loop.CheckpointError):
  """A run would resume under another configuration than it started with."""


def read_json_record(path: str, error=ValueError) -> dict:
  """The JSON object in `path` (e.g. summary.json, run_config.json).

  Raises `error` naming the file when it cannot be read or does not hold a
  JSON object (e.g. it was edited by hand or cut short).
  """
  try:
    with open(path, encoding='utf-8') as f:
      value = json.load(f)
  except (OSError, ValueError) as e:  # JSONDecodeError, UnicodeDecodeError.
    raise error(f'{path} is not valid JSON ({type(e).__name__}: {e}); '
                'restore it from a backup. Nothing was changed.') from e
  if not isinstance(value, dict):
    raise error(f'{path} is not valid JSON for this file: it holds a '
                f'{type(value).__name__}, not an object. Nothing was '
                'changed.')
  return value


def _as_json(value):
  """`value` as it reads back from JSON (tuples as lists, numpy as Python)."""
  return json.loads(json.dumps(value, default=training_loop._json_default))  # pylint: disable=protected-access


def _flat_flags(grouped: Optional[dict[str, Any]]) -> dict[str, Any]:
  """Flag name -> value from summary.json's grouped flags."""
  flat = {}
  for group in (grouped or {}).values():
    if isinstance(group, dict):
      flat.update(group)
  return flat


def _run_record(config: ExperimentConfig, dp: privacy.DPConfig,
                flag_values: Optional[dict[str, Any]]) -> dict:
  record = dataclasses.asdict(config)
  record['dp'] = {k: v for k, v in dataclasses.asdict(dp).items()
                  if k != 'rounds'}
  return _as_json({'config': record, 'flags': _flat_flags(flag_values)})


def _differences(old: dict, new: dict, prefix: str = '',
                 ignore=RESUMABLE_FIELDS) -> list[str]:
  lines = []
  for name in sorted(set(old) & set(new)):
    if name in ignore:
      continue
    a, b = old[name], new[name]
    if isinstance(a, dict) and isinstance(b, dict):
      lines += _differences(a, b, f'{prefix}{name}.', ignore)
    elif json.dumps(a, sort_keys=True, default=str) != json.dumps(
        b, sort_keys=True, default=str):
      lines.append(f'{prefix}{name}: {a!r} when the run started, {b!r} now')
  return lines


def flag_differences(recorded: dict[str, Any], current: dict[str, Any],
                     ignore) -> list[str]:
  """`--name: ...` lines for grouped flags (summary.json's) that differ,
  but those in `ignore`; flags one side lacks are not compared."""
  return _differences(_flat_flags(recorded), _flat_flags(_as_json(current)),
                      '--', ignore)


def check_or_record_run_config(config: ExperimentConfig,
                               dp: privacy.DPConfig,
                               flag_values: Optional[dict[str, Any]] = None
                               ) -> None:
  """Records a new run's configuration; refuses to resume under another.

  A run that has no checkpoint yet writes `run_config.json` (the config, the
  resolved DP config and the flags). Resuming (`config.resume` with
  checkpoints) compares against it everything but `RESUMABLE_FIELDS`, so
  that a resumed run is the run that started: e.g. another learning rate,
  client-state backend or a DP noise multiplier re-calibrated for other
  rounds (rounds 1..r noised at one multiplier and reported at another
  would under-report epsilon) raise `ResumeError` naming each difference,
  before anything is changed. Resuming checkpoints without `run_config.json`
  raises `ResumeError` naming the file.
  """
  path = os.path.join(config.experiment_dir, RUN_CONFIG_FILENAME)
  record = _run_record(config, dp, flag_values)
  stages_dir = os.path.join(config.experiment_dir, 'stages')
  started = training_loop.checkpoint_rounds(config.experiment_dir) or any(
      training_loop.checkpoint_rounds(os.path.join(stages_dir, name))
      for name in (os.listdir(stages_dir) if os.path.isdir(stages_dir)
                   else ()))
  if not started:
    os.makedirs(config.experiment_dir, exist_ok=True)
    training_loop.write_summary(path, record)
    return
  if not config.resume:
    return  # The loop refuses a rerun without resume.
  if not os.path.exists(path):
    raise ResumeError(
        f'{path} is missing: {config.experiment_dir} holds checkpoints, but '
        'without the record of the configuration it started with, a resumed '
        'run cannot be checked to be the same run (another client-state '
        'backend, learning rate or DP noise would go unnoticed). Restore the '
        'file from a backup, or start a new --experiment_name (the '
        'checkpoints can still be re-evaluated once the file is back). '
        'Nothing was changed.')
  old = read_json_record(path, ResumeError)
  lines = (_differences(old.get('config', {}), record['config']) +
           _differences(old.get('flags', {}), record['flags'], '--'))
  if lines:
    raise ResumeError(
        f'{config.experiment_dir} started with another configuration ({path}):'
        '\n  ' + '\n  '.join(lines) + '\nResume with the run\'s own '
        'settings, or start a new --experiment_name. Nothing was changed.')


class EvaluationError(ValueError):
  """A run cannot be re-evaluated as asked (names the file and why)."""


def evaluation_path(config: ExperimentConfig, eval_name: str) -> str:
  return os.path.join(config.experiment_dir, EVALUATIONS_DIRNAME,
                      f'{eval_name}.json')


@_holding_lock(create=False)
def evaluate_experiment(task, config: ExperimentConfig, eval_name: str,
                        log_fn: Callable[[str], None] = print,
                        overwrite: bool = False,
                        flag_values: Optional[dict[str, Any]] = None) -> dict:
  """Evaluates a finished run's final state again; writes nothing else.

  Needs `<experiment_dir>/summary.json` (a run writes it when it ends) and
  reads the latest server checkpoint (its round is the evaluated round) and
  the clients' private states as committed at that round, then runs the same evaluations as the end of
  training (`eval`; `test` / `test_fine_tuned` with a held-out split;
  `cold_start`) under this config's evaluation fields (`EVALUATION_FIELDS`:
  e.g. `eval_fine_tune`, `eval_clients`). The result goes to
  `<experiment_dir>/evaluations/<eval_name>.json` (refused if it exists,
  unless `overwrite`); the checkpoints, the client-state store and
  summary.json are only read. The config's other fields must be those the
  run recorded when it started (`run_config.json`, required; `rounds` is
  taken from the checkpoint); `binaries.evaluate` also compares its flags
  (the task's too) with summary.json. The record's privacy report is
  recomputed from run_config.json's DP configuration and the rounds the run
  started (`run_privacy_report`), not copied from summary.json.

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
  if not eval_name or os.sep in eval_name or eval_name.startswith('.'):
    raise EvaluationError(f'eval_name must be a plain file name, got '
                          f'{eval_name!r}')
  summary_path = os.path.join(config.experiment_dir, 'summary.json')
  if not os.path.exists(summary_path):
    raise EvaluationError(
        f'{summary_path} does not exist: the run in {config.experiment_dir} '
        'has not finished (resume it with binaries.train --resume); only '
        'finished runs are re-evaluated')
  out_path = evaluation_path(config, eval_name)
  if os.path.exists(out_path) and not overwrite:
    raise EvaluationError(f'{out_path} exists; choose another eval_name or '
                          'overwrite it on purpose')
  if os.path.isdir(os.path.join(config.experiment_dir, GROUPS_DIRNAME)):
    raise EvaluationError(
        f'{config.experiment_dir} ran its last stage once per group '
        f'({config.algorithm}); re-evaluating such a run is not supported: '
        'its evaluation is in summary.json, each group\'s in '
        f'{GROUPS_DIRNAME}/<group>/eval_metrics.csv')
  # The round is the last checkpoint's (the store must be committed there).
  rounds = training_loop.completed_round(config.experiment_dir)
  if not rounds:
    raise training_loop.CheckpointError(
        f'{config.experiment_dir} has no checkpoint of a trained round '
        f'(checkpoints: '
        f'{training_loop.checkpoint_rounds(config.experiment_dir) or "none"})')
  # The evaluation's local pass reads the data of the run's last round.
  config = dataclasses.replace(config, rounds=rounds)
  population = task.population
  dp = validate(config, population)
  record_path = os.path.join(config.experiment_dir, RUN_CONFIG_FILENAME)
  if not os.path.exists(record_path):
    raise EvaluationError(
        f'{record_path} is missing: without the record of the run\'s '
        'configuration, neither the configuration nor the privacy report '
        'of the run can be checked. Restore the file from a backup.')
  started = read_json_record(record_path, EvaluationError).get('config', {})
  lines = _differences(started, _run_record(config, dp, None)['config'])
  if lines:
    raise EvaluationError(
        f'{config.experiment_dir} was trained with another configuration '
        f'({record_path}):\n  ' + '\n  '.join(lines))
  # The run's guarantee, recomputed from its recorded DP configuration and
  # the rounds it ran (summary.json's copy is not trusted).
  run_dp = (privacy.DPConfig(**{**started['dp'], 'rounds': rounds})
            if started.get('dp') else dp)
  run_report = run_privacy_report(
      config, run_dp, rounds, training_loop.rounds_started(
          config.experiment_dir, required=True),
      _earlier_stages_noised(config))
  proc = stages_lib.final_process(
      build_process(task, config, privacy.build_aggregator(dp), dp))
  num_shards = sharded.resolve_num_shards(proc, config.simulation_shards, dp)
  state = training_loop.load_checkpoint(proc, config.experiment_dir, rounds)
  missing = client_state_lib.missing_store(
      config.client_state_backend,
      os.path.join(config.experiment_dir, 'client_states'), population)
  if missing is not None:
    raise client_state_lib.ClientStateStoreError(
        f'the client-state store {missing} is missing or empty; it should '
        f'hold the client states committed at round {rounds}')
  store = client_state_lib.make_store(
      config.client_state_backend, initial_client_state_fn(proc, config),
      population=population,
      directory=os.path.join(config.experiment_dir, 'client_states'))
  t_start = time.perf_counter()
  try:
    if isinstance(store, client_state_lib.InMemoryClientStateStore):
      store.restore(rounds)  # Loads snapshot `rounds`; writes nothing.
    elif store.committed_round() != rounds:
      raise client_state_lib.ClientStateStoreError(
          f'the client-state store in {config.experiment_dir} is committed at '
          f'round {store.committed_round()}, not at the run\'s last round '
          f'{rounds}')
    evaluate, _, eval_data_fn = _personal_evaluator(
        task, proc, config, store, num_shards)
    result = {'eval': evaluate(state, eval_data_fn)}
    log_fn(f'eval: {_short(result["eval"])}')
    result.update(_final_evaluations(task, proc, state, store, config,
                                     evaluate, log_fn))
  finally:
    store.close()
  record = {
      'eval_name': eval_name,
      'round': rounds,
      **result,
      'seconds': time.perf_counter() - t_start,
      'evaluation': {k: getattr(config, k) for k in EVALUATION_FIELDS},
      # The shared model's guarantee is the run's; evaluation metrics, like
      # training's, are simulation diagnostics.
      'privacy': run_report,
      'flags': flag_values if flag_values is not None else dataclasses.asdict(
          config),
  }
  os.makedirs(os.path.dirname(out_path), exist_ok=True)
  training_loop.write_summary(out_path, record)
  return record


def _final_evaluations(task, proc, state, store, config: ExperimentConfig,
                       evaluate, log_fn) -> dict:
  """The evaluations after the last round: `test`, `test_fine_tuned`,
  `cold_start` (None where the task or config has none)."""
  out = dict(test=None, test_fine_tuned=None, cold_start=None)
  if hasattr(task, 'test_datasets'):  # held-out test split, after training
    out['test'] = evaluate(state, task.test_datasets, test=True)
    log_fn(f'test: {_short(out["test"])}')
    if config.test_fine_tune:
      out['test_fine_tuned'] = evaluate(state, task.test_datasets,
                                        fine_tune=True, test=True)
      log_fn(f'test after one local pass of private state: '
             f'{_short(out["test_fine_tuned"])}')
  if getattr(task, 'cold_client_ids', None):
    out['cold_start'] = _cold_start(task, proc, state, store, config)
    log_fn(f'cold start ({len(task.cold_client_ids)} users never trained): '
           f'{_short(out["cold_start"])}')
  return out


def _short(metrics: dict) -> str:
  return ', '.join(f'{k} {v:.4f}' for k, v in metrics.items()
                   if isinstance(v, float))


def _cold_start(task, proc, state, store, config: ExperimentConfig) -> dict:
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
      _private_optimizer(config) or make_client_optimizer(config))
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


def _export_private_states(store, ids, directory) -> None:
  states = store.load(ids)
  arrays = {'ids': np.asarray(ids, np.int64)}
  for i in range(len(states[0]['private']) if states else 0):
    arrays[f'private_{i}'] = np.stack([s['private'][i] for s in states])
  if states and 'rounds_participated' in states[0]:
    arrays['rounds_participated'] = np.asarray(
        [s['rounds_participated'] for s in states], np.int64)
  np.savez(os.path.join(directory, 'private_states.npz'), **arrays)
