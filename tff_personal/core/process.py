"""The stateful-client process: TFF iterative processes with private client state.

TFF's `LearningProcess.next` takes exactly `(server_state, client_data)`, so it
cannot carry per-client state between rounds. TFF's own answer is the
`examples/stateful_clients` pattern, which this module generalises: a plain
`tff.templates.IterativeProcess` whose `next` has the type

    (<S@SERVER, {C}@CLIENTS, {D*}@CLIENTS> -> <S@SERVER, {C}@CLIENTS, M@SERVER>)

where `C` is the private client state. The driver (see `core/training_loop.py`)
reads the sampled clients' `C` from a client-state store, passes them in, and
writes the returned values back.

The process is composed from TFF's own parts: the distributor is
`tff.learning.templates.build_broadcast_process`, the aggregation is any
`tff.aggregators` factory (weighted mean, or the DP factories of
`core/privacy.py`), the finalizer is
`tff.learning.templates.build_apply_optimizer_finalizer` with a
`tff.learning.optimizers` server optimizer, and the server state is TFF's
`LearningAlgorithmState`. What TFF lacks, and is written here, is the client
work that takes and returns client state (its `ClientWorkProcess` has no
client-state input or output) and the wiring.

Privacy invariant (tested by reading type signatures): the only client-placed
values that reach the server are the shared update (through the named
aggregator) and the training-metric sums (through `federated_sum`; pass
`train_metrics=False` to release nothing but the aggregate). The client state
`C` is returned at CLIENTS and never aggregated.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any, Callable, Optional
import weakref

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_personal.core import split_model as split_model_lib
from tff_personal.core import split_training

ModelWeights = tff.learning.models.ModelWeights
LearningAlgorithmState = tff.learning.templates.LearningAlgorithmState

CLIENT_STATE_PRIVATE = 'private'
CLIENT_STATE_ROUNDS = 'rounds_participated'

# A client step factory: `make_step()` builds the model(s) the client work
# needs (variables) and returns `step(weights, client_state, dataset) ->
# OrderedDict(update, update_weight, client_state, metrics)`, pure TF logic that
# may be called repeatedly (once per user of a simulation shard, see
# `core/sharded.py`): it must (re)assign every variable it reads on entry.
# Steps are traced without AutoGraph (`tf.function(autograph=False)`: about
# half of a process's tracing time goes to AutoGraph's source conversion),
# so their graph loops are written out (`tf.while_loop`, `Dataset.reduce`)
# and Python `if`/`for` act at trace time only; a Python loop over a tensor
# fails loudly when the process is built.
ClientStepFactory = Callable[[], Callable[..., Any]]


@dataclasses.dataclass(frozen=True)
class Composition:
  """What a process was composed from; lets `core/sharded.py` re-wire it.

  `client_step` is the per-user TF logic (a `ClientStepFactory`), or None for
  processes whose client work was given only as a TFF computation.
  `server_step` and `selection_factory` are set by
  `core/statistics_process.compose_with_server_step` (the server's
  TF step after the aggregation, and the aggregator of the clients'
  `selected`, if any); None for plain processes. `client_work` is the
  one-user TFF computation the round runs on each client (the device part
  of its production form, `core/production.py`).
  """
  initial_model_weights: Any
  client_state_type: tff.Type
  client_data_type: tff.Type
  client_work_result_type: tff.Type
  aggregator_factory: Any
  server_optimizer: Any
  train_metrics: bool
  client_step: Optional[Callable[[], Callable[..., Any]]]
  server_step: Optional[tff.Computation] = None
  selection_factory: Any = None
  client_work: Optional[tff.Computation] = None


# Shared `ModelWeights` (numpy) -> a client's private tuple.
EvalPrivateFn = Callable[[ModelWeights], tuple]


class StatefulClientProcess(tff.templates.IterativeProcess):
  """An `IterativeProcess` whose clients keep private state between rounds.

  `next(server_state, client_states@CLIENTS, client_data@CLIENTS)` returns
  `(server_state, client_states@CLIENTS, metrics@SERVER)`.

  Beyond `initialize` and `next` it exposes the types a driver needs and the
  model-weights accessors that let stages compose (the output of one process
  is the initial state of the next).

  A process may be built lazily: with `build_fn` (and no `initialize_fn` /
  `next_fn`), its TFF computations are built on first use of `initialize`,
  `next` or `state_type`. A sharded run (`core/sharded.py`) rewires the
  process's `composition` and never uses them, so it skips their tracing.
  """

  def __init__(self, initialize_fn: tff.Computation | None,
               next_fn: tff.Computation | None,
               *, client_state_type: tff.Type,
               aggregation_value_type: tff.Type,
               model_fn: split_model_lib.SplitModelFn | None = None,
               composition: Composition | None = None,
               eval_private_fn: EvalPrivateFn | None = None,
               eval_model_fn: split_model_lib.SplitModelFn | None = None,
               initial_private: tuple | None = None,
               eval_client_state_type: tff.Type | None = None,
               eval_fine_tune: bool = False,
               eval_fine_tune_optimizer: (
                   tff.learning.optimizers.Optimizer | None) = None,
               global_private_fn: EvalPrivateFn | None = None,
               eval_fine_tune_steps: int | None = None,
               build_fn: Callable[[], tuple[tff.Computation,
                                            tff.Computation]] | None = None):
    if (build_fn is None) == (initialize_fn is None or next_fn is None):
      raise ValueError('give either initialize_fn and next_fn, or build_fn '
                       '(and a composition) to build them on first use')
    if build_fn is not None and composition is None:
      raise ValueError('a lazily built process (build_fn) needs its '
                       'composition, which gives its types before building')
    self._build_fn = build_fn
    if build_fn is None:
      super().__init__(initialize_fn, next_fn, next_is_multi_arg=True)
    self._client_state_type = client_state_type
    self._aggregation_value_type = aggregation_value_type
    self._model_fn = model_fn
    self._composition = composition
    self._eval_private_fn = eval_private_fn
    self._eval_model_fn = eval_model_fn
    self._initial_private = initial_private
    self._eval_client_state_type = eval_client_state_type
    self._eval_fine_tune = eval_fine_tune
    self._eval_fine_tune_optimizer = eval_fine_tune_optimizer
    self._global_private_fn = global_private_fn
    self._eval_fine_tune_steps = eval_fine_tune_steps

  def _built(self) -> None:
    """Builds `initialize` and `next` if not yet (a failed build raises
    again on the next use)."""
    if self._build_fn is not None:
      initialize_fn, next_fn = self._build_fn()
      super().__init__(initialize_fn, next_fn, next_is_multi_arg=True)
      self._build_fn = None

  @property
  def initialize(self) -> tff.Computation:
    self._built()
    return super().initialize

  @property
  def next(self) -> tff.Computation:
    self._built()
    return super().next

  @property
  def state_type(self) -> tff.Type:
    self._built()
    return super().state_type

  @property
  def initial_private(self) -> tuple | None:
    """None, or the private state (numpy tuple) every new client starts
    from (e.g. Ditto's personal model starts as the initial global model).
    None: the run's seeded draw per client id
    (`client_state.seeded_initial_state_fn`)."""
    return self._initial_private

  @property
  def eval_client_state_type(self) -> tff.Type:
    """The client state `model_fn`'s evaluation takes: `client_state_type`,
    unless `eval_private_fn` builds another (FedAvg+FT: the global model as
    the start of each client's fine-tuning)."""
    return self._eval_client_state_type or self._client_state_type

  @property
  def eval_fine_tune(self) -> bool:
    """Whether evaluation always fine-tunes the private state first (one
    local pass, shared weights frozen): FedAvg+FT's evaluation."""
    return self._eval_fine_tune

  @property
  def eval_fine_tune_steps(self) -> int | None:
    """None, or the steps of the evaluation's fine-tuning that the algorithm
    declares (Per-FedAvg's test-time adaptation: one step); None: one pass
    over the client's training data. A `fine_tune` strategy overrides it."""
    return self._eval_fine_tune_steps

  @property
  def eval_fine_tune_optimizer(self
                               ) -> tff.learning.optimizers.Optimizer | None:
    """None, or the optimizer of the evaluation's fine-tuning pass that the
    algorithm fixes (e.g. GroupPerFL's SGD at its personalization learning
    rate); None: the experiment's (its private learning rate, else its
    client optimizer)."""
    return self._eval_fine_tune_optimizer

  @property
  def composition(self) -> Composition | None:
    """The parts this process was composed from (None if not recorded)."""
    return self._composition

  @property
  def eval_private_fn(self) -> EvalPrivateFn | None:
    """None, or the private state a client evaluates from, as a function of
    the shared weights (numpy `ModelWeights` -> the private tuple).

    Set by processes whose private state restarts from the shared model
    every round (pFedMe as its authors' code runs it): a stored private
    state is then stale at evaluation, and evaluation starts from this one
    instead (`eval_client_states`).
    """
    return self._eval_private_fn

  @property
  def global_private_fn(self) -> EvalPrivateFn | None:
    """None, or the private state that corresponds to the shared weights
    (numpy `ModelWeights` -> the private tuple): Ditto's and APFL's personal
    model as the global one, pFedMe's head as the global head; by default
    `eval_private_fn`. A new user starts from it under
    `cold_start(start=global)`; None: the private state has no shared
    counterpart (FedRep's head, a personal embedding)."""
    return self._global_private_fn or self._eval_private_fn

  @property
  def model_fn(self) -> split_model_lib.SplitModelFn | None:
    """The split-model builder the process trains, if any: its shared part
    is aggregated, its private part (if any) is the client state."""
    return self._model_fn

  @property
  def eval_model_fn(self) -> split_model_lib.SplitModelFn | None:
    """The split model a client evaluates with: its shared part takes the
    broadcast weights, its private part the client's state. `model_fn`,
    unless the process sets another (Ditto's personal copy: every variable
    private, so the broadcast weights load into none)."""
    return self._eval_model_fn or self._model_fn

  @property
  def model_weights_type(self) -> tff.Type:
    """The unplaced type of the shared `ModelWeights`."""
    if self._composition is not None:  # Known without building `next`.
      return model_weights_type(self._composition.initial_model_weights)
    return self.next.type_signature.parameter[0].member.global_model_weights

  @property
  def client_state_type(self) -> tff.Type:
    """The (unplaced) type `C` of one client's private state."""
    return self._client_state_type

  @property
  def aggregation_value_type(self) -> tff.Type:
    """The type of the value each client hands to the server's aggregator."""
    return self._aggregation_value_type

  @property
  def client_data_type(self) -> tff.Type:
    if self._composition is not None:
      return self._composition.client_data_type
    return self.next.type_signature.parameter[2].member

  def get_model_weights(self, state) -> ModelWeights:
    return state.global_model_weights

  def set_model_weights(self, state, weights: ModelWeights):
    """A copy of `state` with the shared model weights replaced."""
    weights = ModelWeights(trainable=tuple(weights.trainable),
                           non_trainable=tuple(weights.non_trainable))
    return LearningAlgorithmState(
        global_model_weights=weights, distributor=state.distributor,
        client_work=state.client_work, aggregator=state.aggregator,
        finalizer=state.finalizer)


def model_weights_type(weights: ModelWeights) -> tff.Type:
  """The TFF type of numpy `ModelWeights`, keeping the `ModelWeights` container."""
  as_type = lambda values: tff.StructWithPythonType(
      [(None, tff.TensorType(np.asarray(v).dtype, np.shape(v)))
       for v in values], tuple)
  return tff.StructWithPythonType(
      [('trainable', as_type(weights.trainable)),
       ('non_trainable', as_type(weights.non_trainable))], ModelWeights)


def _metrics_finalizer(metric_sums_type: tff.Type):
  """Server-side: means over examples of every `*_sum`, plus counts."""

  @tff.tensorflow.computation(metric_sums_type)
  def finalize(sums):
    n = tf.maximum(tf.cast(sums['num_examples'], tf.float32), 1.0)
    out = collections.OrderedDict()
    for name in sums:
      value = sums[name]
      if name.endswith('_sum'):
        out[name[:-len('_sum')]] = tf.cast(value, tf.float32) / n
      else:
        out[name] = value
    return out

  return finalize


@dataclasses.dataclass(frozen=True)
class ProcessParts:
  """The TFF parts every composition here wires: built by `build_parts`.

  Shared by `compose_stateful_client_process` and
  `core/statistics_process.compose_with_server_step`, which differ only in
  what happens between aggregation and the new state.
  """
  weights_value: ModelWeights
  client_work: tff.Computation
  data_type: tff.Type
  result_type: tff.Type
  aggregation: tff.templates.AggregationProcess
  weighted: bool
  distributor: tff.templates.MeasuredProcess
  finalizer: tff.templates.MeasuredProcess
  finalize_metrics: tff.Computation
  initialize_fn: tff.Computation

  @property
  def state_type(self) -> tff.Type:
    return self.initialize_fn.type_signature.result


def check_parts(client_state_type: tff.Type, client_work: tff.Computation,
                aggregator_factory) -> None:
  """`build_parts`' checks, without building anything: the client work
  takes `client_state_type`, and the factory is a `tff.aggregators` one."""
  param = client_work.type_signature.parameter
  if not param[1].is_assignable_from(client_state_type):
    raise TypeError(
        f'client_work takes client state {param[1]}, not {client_state_type}')
  if not isinstance(aggregator_factory,
                    (tff.aggregators.WeightedAggregationFactory,
                     tff.aggregators.UnweightedAggregationFactory)):
    raise TypeError('aggregator_factory must be a tff.aggregators weighted or '
                    f'unweighted factory, got {type(aggregator_factory)}')


def build_parts(*, initial_model_weights: ModelWeights,
                client_state_type: tff.Type, client_work: tff.Computation,
                aggregator_factory,
                server_optimizer: tff.learning.optimizers.Optimizer
                ) -> ProcessParts:
  """Checks the client work against the state type; builds the TFF parts.

  The aggregation is created for the client work's whole `update` (weighted
  by `update_weight` when the factory is weighted); `initialize_fn` gives
  TFF's `LearningAlgorithmState` at SERVER.
  """
  weights_value = tf.nest.map_structure(np.asarray, initial_model_weights)
  weights_type = model_weights_type(weights_value)
  param = client_work.type_signature.parameter
  result_type = client_work.type_signature.result
  check_parts(client_state_type, client_work, aggregator_factory)
  if isinstance(aggregator_factory, tff.aggregators.WeightedAggregationFactory):
    aggregation = aggregator_factory.create(
        result_type.update, result_type.update_weight)
    weighted = True
  elif isinstance(aggregator_factory,
                  tff.aggregators.UnweightedAggregationFactory):
    aggregation = aggregator_factory.create(result_type.update)
    weighted = False
  else:
    raise TypeError('aggregator_factory must be a tff.aggregators weighted or '
                    f'unweighted factory, got {type(aggregator_factory)}')
  distributor = tff.learning.templates.build_broadcast_process(weights_type)
  finalizer = tff.learning.templates.build_apply_optimizer_finalizer(
      server_optimizer, weights_type)

  @tff.tensorflow.computation
  def initial_weights_fn():
    return tf.nest.map_structure(tf.constant, weights_value)

  @tff.federated_computation
  def initialize_fn():
    return tff.federated_zip(LearningAlgorithmState(
        global_model_weights=tff.federated_eval(initial_weights_fn, tff.SERVER),
        distributor=distributor.initialize(),
        client_work=tff.federated_value((), tff.SERVER),
        aggregator=aggregation.initialize(),
        finalizer=finalizer.initialize()))

  return ProcessParts(
      weights_value=weights_value, client_work=client_work,
      data_type=param[2], result_type=result_type, aggregation=aggregation,
      weighted=weighted, distributor=distributor, finalizer=finalizer,
      finalize_metrics=_metrics_finalizer(result_type.metrics),
      initialize_fn=initialize_fn)


def run_clients_and_aggregate(parts: ProcessParts, state, client_states,
                              client_data):
  """In a federated computation: broadcast, client work, aggregation.

  Returns `(distributed, outputs, aggregated)`: the distributor's output,
  the client work's outputs at CLIENTS and the aggregation's output.
  """
  distributed = parts.distributor.next(state.distributor,
                                       state.global_model_weights)
  outputs = tff.federated_map(
      parts.client_work, (distributed.result, client_states, client_data))
  if parts.weighted:
    aggregated = parts.aggregation.next(state.aggregator, outputs.update,
                                        outputs.update_weight)
  else:
    aggregated = parts.aggregation.next(state.aggregator, outputs.update)
  return distributed, outputs, aggregated


def next_state_and_measurements(parts: ProcessParts, state, distributed,
                                aggregated, finalized, global_model_weights,
                                outputs, train_metrics: bool, **extra):
  """In a federated computation: the new server state and measurements.

  `extra` measurements (SERVER-placed) go after the aggregator's and the
  finalizer's; the training-metric sums come last when `train_metrics`.
  """
  new_state = tff.federated_zip(LearningAlgorithmState(
      global_model_weights=global_model_weights,
      distributor=distributed.state,
      client_work=state.client_work,
      aggregator=aggregated.state,
      finalizer=finalized.state))
  measurements = collections.OrderedDict(
      aggregator=aggregated.measurements,
      finalizer=finalized.measurements, **extra)
  if train_metrics:
    measurements['train'] = tff.federated_map(
        parts.finalize_metrics, tff.federated_sum(outputs.metrics))
  return new_state, tff.federated_zip(measurements)


def compose_stateful_client_process(
    *,
    initial_model_weights: ModelWeights,
    client_state_type: tff.Type,
    client_work: tff.Computation,
    aggregator_factory,
    server_optimizer: tff.learning.optimizers.Optimizer,
    train_metrics: bool = True,
    model_fn: split_model_lib.SplitModelFn | None = None,
    client_step: ClientStepFactory | None = None,
    eval_private_fn: EvalPrivateFn | None = None,
    **eval_options,
) -> StatefulClientProcess:
  """Wires a client work with client state into a `StatefulClientProcess`.

  Args:
    initial_model_weights: numpy `ModelWeights` of the shared model (tuples).
    client_state_type: the unplaced type of one client's state.
    client_work: a TFF TensorFlow computation
      `(ModelWeights, C, D*) -> <update, update_weight, client_state, metrics>`
      (an OrderedDict with those keys). `metrics` must hold `num_examples`.
    aggregator_factory: a `tff.aggregators` weighted or unweighted factory for
      the shared update (for DP, an unweighted `DifferentiallyPrivateFactory`).
    server_optimizer: applied to the aggregated update by TFF's
      `build_apply_optimizer_finalizer`.
    train_metrics: release sums of training metrics to the server.
    model_fn: optional split-model builder, exposed for evaluation.
    client_step: optional per-user TF logic that `client_work` runs (see
      `ClientStepFactory`; `client_work_from_step` builds `client_work` from
      it). Recorded so that `core/sharded.py` can run many users inside one
      TFF client for fast simulation.
    eval_private_fn: see `StatefulClientProcess.eval_private_fn`.
    **eval_options: `eval_model_fn`, `initial_private`,
      `eval_client_state_type`, `eval_fine_tune` (see the
      `StatefulClientProcess` properties).

  Returns:
    A `StatefulClientProcess`, whose `initialize` and `next` are built
    (traced) on first use: a sharded run uses only its `composition`.
  """
  check_parts(client_state_type, client_work, aggregator_factory)

  def build():
    parts = build_parts(
        initial_model_weights=initial_model_weights,
        client_state_type=client_state_type, client_work=client_work,
        aggregator_factory=aggregator_factory,
        server_optimizer=server_optimizer)

    @tff.federated_computation(
        parts.state_type, tff.FederatedType(client_state_type, tff.CLIENTS),
        tff.FederatedType(parts.data_type, tff.CLIENTS))
    def next_fn(state, client_states, client_data):
      distributed, outputs, aggregated = run_clients_and_aggregate(
          parts, state, client_states, client_data)
      finalized = parts.finalizer.next(
          state.finalizer, state.global_model_weights, aggregated.result)
      new_state, measurements = next_state_and_measurements(
          parts, state, distributed, aggregated, finalized, finalized.result,
          outputs, train_metrics)
      return new_state, outputs.client_state, measurements

    return parts.initialize_fn, next_fn

  result_type = client_work.type_signature.result
  composition = Composition(
      initial_model_weights=tf.nest.map_structure(np.asarray,
                                                  initial_model_weights),
      client_state_type=client_state_type,
      client_data_type=client_work.type_signature.parameter[2],
      client_work_result_type=result_type,
      aggregator_factory=aggregator_factory, server_optimizer=server_optimizer,
      train_metrics=train_metrics, client_step=client_step,
      client_work=client_work)
  return StatefulClientProcess(
      None, None, build_fn=build, client_state_type=client_state_type,
      aggregation_value_type=result_type.update,
      model_fn=model_fn, composition=composition,
      eval_private_fn=eval_private_fn, **eval_options)


# What the types of a process are read from, per model function: its
# input spec and its private variables' specs. Building a model to read them
# costs as much as building it for its weights, so `initial_shared_weights`,
# `split_client_state_type` and `split_data_type` build it once between
# them. Kept while the model function lives.
_MODEL_FACTS = weakref.WeakKeyDictionary()
_MODEL_FACTS_LOCK = threading.Lock()


def _model_facts(model_fn: split_model_lib.SplitModelFn,
                 model: split_model_lib.SplitModel | None = None):
  """`(input_spec, private_weights_spec)` of `model_fn`'s models.

  Read from `model` if given (a model `model_fn` just built), else from a
  model built in a throwaway graph; remembered for `model_fn` where it can
  be weakly referenced.
  """
  with _MODEL_FACTS_LOCK:
    try:
      return _MODEL_FACTS[model_fn]
    except (KeyError, TypeError):
      pass
  if model is None:
    with tf.Graph().as_default():
      model = model_fn()
  facts = (model.input_spec, split_model_lib.private_weights_spec(model))
  with _MODEL_FACTS_LOCK:
    try:
      _MODEL_FACTS[model_fn] = facts
    except TypeError:  # Not weakly referenceable: read on each call.
      pass
  return facts


def model_input_spec(model_fn: split_model_lib.SplitModelFn):
  """The element spec of the datasets `model_fn`'s models train on.

  Read once per `model_fn` (from the model `initial_shared_weights` built,
  when it ran first) instead of building a model for it each time.

  Example:
    data_type = tff.SequenceType(tff.types.tensorflow_to_type(
        model_input_spec(model_fn)))
  """
  return _model_facts(model_fn)[0]


def initial_shared_weights(model_fn: split_model_lib.SplitModelFn,
                           seed: Optional[int] = None) -> ModelWeights:
  """Builds the model once, eagerly, and returns its shared weights (numpy).

  With a seed the initialisation is reproducible (Keras initialisers draw from
  the global seed set by `tf.keras.utils.set_random_seed`).
  """
  if seed is not None:
    tf.keras.utils.set_random_seed(seed)
  model = model_fn()
  _model_facts(model_fn, model)  # Its types, for the calls that follow.
  return ModelWeights(
      trainable=tuple(v.numpy() for v in model.shared_trainable_variables),
      non_trainable=tuple(
          v.numpy() for v in model.shared_non_trainable_variables))


def split_client_state_type(model_fn: split_model_lib.SplitModelFn) -> tff.Type:
  """Type of the client state of a split model: its private variables."""
  _, private = _model_facts(model_fn)
  return tff.types.to_type(collections.OrderedDict([
      (CLIENT_STATE_PRIVATE,
       tuple(tff.TensorType(s.dtype.as_numpy_dtype, s.shape) for s in private)),
      (CLIENT_STATE_ROUNDS, np.int32),
  ]))


def eval_client_states(proc: StatefulClientProcess, weights: ModelWeights,
                       states: list) -> list:
  """`states` as `proc` evaluates them: unchanged, or with the private part
  replaced by `proc.eval_private_fn(weights)` where the process sets one
  (the participation count is kept)."""
  eval_private_fn = getattr(proc, 'eval_private_fn', None)  # duck-typed too
  if eval_private_fn is None:
    return states
  private = tuple(eval_private_fn(weights))
  return [collections.OrderedDict([
      (CLIENT_STATE_PRIVATE, private),
      (CLIENT_STATE_ROUNDS, s[CLIENT_STATE_ROUNDS])]) for s in states]


def client_step_result(update, update_weight, new_private, client_state,
                       metrics) -> collections.OrderedDict:
  """A client step's output: the update, the new client state, the metrics.

  The new client state holds `new_private` and the client's participation
  count advanced by one; `metrics['clients']` counts this client once.
  """
  metrics['clients'] = tf.constant(1, tf.int32)
  new_state = collections.OrderedDict([
      (CLIENT_STATE_PRIVATE, new_private),
      (CLIENT_STATE_ROUNDS, client_state[CLIENT_STATE_ROUNDS] + 1),
  ])
  return collections.OrderedDict(
      update=update, update_weight=update_weight, client_state=new_state,
      metrics=metrics)


@dataclasses.dataclass(frozen=True)
class SplitClientStep:
  """`split_client_step_factory`'s step factory: calling it makes the step.

  Its fields say what the step trains, so that a simulation can train many
  users' steps together (`core/batched.py`).
  """
  model_fn: split_model_lib.SplitModelFn
  client_optimizer: tff.learning.optimizers.Optimizer
  metrics_fn: Any = None
  private_optimizer: Optional[tff.learning.optimizers.Optimizer] = None

  def __call__(self):
    model = self.model_fn()

    def step(weights, client_state, dataset):
      update, weight, new_private, metrics = split_training.local_train(
          model, self.client_optimizer, weights,
          tuple(client_state[CLIENT_STATE_PRIVATE]), dataset, self.metrics_fn,
          self.private_optimizer)
      return client_step_result(update, weight, new_private, client_state,
                                metrics)

    return step


def split_client_step_factory(
    model_fn: split_model_lib.SplitModelFn,
    client_optimizer: tff.learning.optimizers.Optimizer,
    metrics_fn=None,
    private_optimizer: tff.learning.optimizers.Optimizer | None = None,
) -> ClientStepFactory:
  """Joint local training of a split model's shared and private parts."""
  return SplitClientStep(model_fn, client_optimizer, metrics_fn,
                         private_optimizer)


# The name of leaf `i` of the new client state in a client work's graph
# (`name_new_client_state`): what a production form's device program fetches
# beside the upload (`core/production.py`).
NEW_CLIENT_STATE_NODE = 'tff_personal_new_client_state_{}'


def name_new_client_state(client_state) -> None:
  """Names each leaf of a client work's new `client_state` in its graph.

  Adds an identity of leaf `i` (in the order of the client state's TFF
  type) named `NEW_CLIENT_STATE_NODE.format(i)`, used by nothing: the
  compiled round's client computation, which drops the new client state
  from its outputs, still holds these nodes when compiled without Grappler,
  and a device program fetches them (`core/production.py`).
  """
  leaves = tff.structure.flatten(
      tff.structure.from_container(client_state, recursive=True))
  for i, leaf in enumerate(leaves):
    tf.identity(leaf, name=NEW_CLIENT_STATE_NODE.format(i))


def client_work_from_step(make_step: ClientStepFactory, weights_type: tff.Type,
                          client_state_type: tff.Type,
                          data_type: tff.Type) -> tff.Computation:
  """The one-user-per-TFF-client work: one call of the step per client."""

  @tff.tensorflow.computation(weights_type, client_state_type, data_type)
  def client_work(weights, client_state, dataset):
    # tf.function for automatic control dependencies between the variable
    # assignments and reads (TFF traces computations in graph mode); no
    # AutoGraph (`ClientStepFactory`).
    out = tf.function(make_step(), autograph=False)(weights, client_state,
                                                    dataset)
    name_new_client_state(out['client_state'])
    return out

  return client_work


def split_data_type(model_fn: split_model_lib.SplitModelFn) -> tff.Type:
  """`D*`: the sequence type of one client's batches, from the input spec."""
  input_spec, _ = _model_facts(model_fn)
  if input_spec is None:
    raise ValueError('model_fn() must return a SplitModel with input_spec')
  return tff.SequenceType(tff.types.tensorflow_to_type(input_spec))


def build_split_client_work(
    model_fn: split_model_lib.SplitModelFn,
    client_optimizer: tff.learning.optimizers.Optimizer,
    weights_type: tff.Type,
    client_state_type: tff.Type,
    metrics_fn=None,
    private_optimizer: tff.learning.optimizers.Optimizer | None = None,
) -> tff.Computation:
  """The client work of a split model: joint local training of both parts."""
  return client_work_from_step(
      split_client_step_factory(model_fn, client_optimizer, metrics_fn,
                                private_optimizer),
      weights_type, client_state_type, split_data_type(model_fn))


def build_split_model_process(
    model_fn: split_model_lib.SplitModelFn,
    *,
    client_optimizer: tff.learning.optimizers.Optimizer,
    server_optimizer: tff.learning.optimizers.Optimizer,
    aggregator_factory=None,
    metrics_fn=None,
    train_metrics: bool = True,
    seed: Optional[int] = None,
    private_optimizer: tff.learning.optimizers.Optimizer | None = None,
) -> StatefulClientProcess:
  """FedAvg of the shared variables; private variables are client state.

  This is Global+ (FedEmbed) and FURL's split personalization: shared and
  private variables are trained jointly on each client; the shared update is
  aggregated (weighted mean by examples by default, or any factory, DP
  included) and applied by the server optimizer; the private variables are
  returned as client state and never leave the client. With no private
  variables it is `tff.learning.algorithms.build_weighted_fed_avg`.
  `private_optimizer` optionally trains the private variables with their own
  optimizer (default: `client_optimizer` over both parts).
  """
  return build_split_step_process(
      model_fn, split_client_step_factory(
          model_fn, client_optimizer, metrics_fn, private_optimizer),
      server_optimizer=server_optimizer,
      aggregator_factory=aggregator_factory, train_metrics=train_metrics,
      seed=seed)


def build_split_step_process(
    model_fn: split_model_lib.SplitModelFn,
    make_step: ClientStepFactory,
    *,
    server_optimizer: tff.learning.optimizers.Optimizer,
    aggregator_factory=None,
    train_metrics: bool = True,
    seed: Optional[int] = None,
    eval_private_fn: EvalPrivateFn | None = None,
    global_private_fn: EvalPrivateFn | None = None,
) -> StatefulClientProcess:
  """The process of a split model trained on clients by `make_step`.

  The shared weights start from `model_fn` (seeded), the client state is the
  model's private variables, the client work runs `make_step()`'s step on
  each client (recorded, so that `core/sharded.py` can run it per user), and
  the shared update goes through `aggregator_factory` (default weighted
  mean) and `server_optimizer`. The algorithms differ only in `make_step`.
  """
  return build_step_process(
      model_fn, make_step, initial_weights=initial_shared_weights(
          model_fn, seed),
      client_state_type=split_client_state_type(model_fn),
      server_optimizer=server_optimizer,
      aggregator_factory=aggregator_factory, train_metrics=train_metrics,
      eval_private_fn=eval_private_fn, global_private_fn=global_private_fn)


def build_step_process(
    model_fn: split_model_lib.SplitModelFn,
    make_step: ClientStepFactory,
    *,
    initial_weights: ModelWeights,
    client_state_type: tff.Type,
    server_optimizer: tff.learning.optimizers.Optimizer,
    aggregator_factory=None,
    train_metrics: bool = True,
    eval_private_fn: EvalPrivateFn | None = None,
    **eval_options,
) -> StatefulClientProcess:
  """The process whose clients run `make_step` on `model_fn`'s input.

  Like `build_split_step_process`, for client states other than the
  model's private variables (e.g. Ditto's personal copy of the model).

  Args:
    model_fn: the model whose `input_spec` is the clients' data type.
    make_step: the per-user client step (`ClientStepFactory`).
    initial_weights: numpy `ModelWeights` of the shared model.
    client_state_type: the unplaced type of one client's state.
    server_optimizer, aggregator_factory, train_metrics: as in
      `compose_stateful_client_process` (default aggregator: weighted mean).
    eval_private_fn, **eval_options: see the `StatefulClientProcess`
      properties (`eval_model_fn`, `initial_private`, ...).
  """
  if aggregator_factory is None:
    aggregator_factory = tff.aggregators.MeanFactory()
  client_work = client_work_from_step(
      make_step, model_weights_type(
          tf.nest.map_structure(np.asarray, initial_weights)),
      client_state_type, split_data_type(model_fn))
  return compose_stateful_client_process(
      initial_model_weights=initial_weights,
      client_state_type=client_state_type, client_work=client_work,
      aggregator_factory=aggregator_factory,
      server_optimizer=server_optimizer, train_metrics=train_metrics,
      model_fn=model_fn, client_step=make_step,
      eval_private_fn=eval_private_fn, **eval_options)
