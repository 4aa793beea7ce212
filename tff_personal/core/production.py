"""A process's production forms: what a TFF production pipeline executes.

A simulation's round is `(S@SERVER, {C}@CLIENTS, {D*}@CLIENTS) ->
(S@SERVER, {C}@CLIENTS, M@SERVER)`: the driver keeps every client's private
state `C` in a store. A production platform keeps no client-placed value
between rounds: the device holds its own private state, reads it with its
data, trains, writes it back locally, and sends only what is aggregated.
`production_form(process)` gives that split of any `StatefulClientProcess`:

* `next`: `(S@SERVER, {<client_state=C, data=D*>}@CLIENTS) -> (S@SERVER,
  M@SERVER)`, the simulation's round with the new client states dropped
  from its outputs; its clients take their state as input and every output
  is server-placed, the shape `tff.backends.mapreduce` compiles to
  `MapReduceForm` and `DistributeAggregateForm` (`map_reduce_form()`,
  `distribute_aggregate_form()`).
* `device`: the client's part as a plain TensorFlow computation, `(shared
  weights, C, D*) -> <update, update_weight, client_state, metrics, ...>`:
  the same client work the round runs. Its `client_state` output is what
  the device writes back; everything else is the input of an aggregation.
* `initialize`: the server's initial state.

A multi-stage algorithm (`core/stages.py`) has one form per stage
(`production_forms`). The DP and secure aggregators are the process's own:
build the process with the aggregator the run uses (`privacy.
build_aggregator`). Written here because TFF's learning templates have no
client-state input; the compilation is TFF's.

Example:

  form = production.production_form(process)
  mrf = form.map_reduce_form()
  new_state, metrics = form.next(state, [{'client_state': c, 'data': d}
                                         for c, d in zip(states, datasets)])
  out = form.device(form.broadcast_weights(state), states[0], datasets[0])
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping, Sequence

import tensorflow as tf
import tensorflow_federated as tff

from tff_personal.core import process as process_lib
from tff_personal.core import split_training
from tff_personal.core import stages as stages_lib


class NotProductionReadyError(ValueError):
  """A process cannot be put in a production form; the message says why."""


# (algorithm, DP mechanism) pairs whose round does not compile, and why
# (docs/production.md gives the nearest form that does).
NOT_COMPILED: dict[tuple[str, str], str] = {
    ('fedembed_som', 'none'): (
        'compiles to MapReduceForm, not to DistributeAggregateForm: the '
        'paper\'s best-scoring SOM update is chosen by an aggregation whose '
        'merge step is a function placed at the server, which that form '
        'cannot hold (and it hands one client\'s update to the server '
        'verbatim); with gaussian_fixed its noised SOM average compiles to '
        'both'),
}


@dataclasses.dataclass(frozen=True)
class ProductionForm:
  """One process's production split (module docstring).

  Attributes:
    process: the `StatefulClientProcess` it was made from.
    initialize: `() -> S@SERVER`, the process's own.
    next: `(S@SERVER, {<client_state=C, data=D*>}@CLIENTS) -> (S@SERVER,
      M@SERVER)`.
    device: the client's TensorFlow computation, `(ModelWeights, C, D*) ->
      <update, update_weight, client_state, metrics, ...>`.
  """
  process: Any
  initialize: tff.Computation
  next: tff.Computation
  device: tff.Computation

  @functools.cached_property
  def _map_reduce_form(self):
    return _compiled(
        tff.backends.mapreduce.get_map_reduce_form_for_computation,
        self.next, 'MapReduceForm')

  def map_reduce_form(self) -> tff.backends.mapreduce.MapReduceForm:
    """`next` compiled to TFF's `MapReduceForm` (cached)."""
    return self._map_reduce_form

  @functools.cached_property
  def _distribute_aggregate_form(self):
    return _compiled(
        tff.backends.mapreduce.get_distribute_aggregate_form_for_computation,
        self.next, 'DistributeAggregateForm')

  def distribute_aggregate_form(
      self) -> tff.backends.mapreduce.DistributeAggregateForm:
    """`next` compiled to TFF's `DistributeAggregateForm` (cached)."""
    return self._distribute_aggregate_form

  def broadcast_weights(self, state):
    """What the server sends each device: the global model weights."""
    if isinstance(state, Mapping):  # As `initialize` and `update` give it.
      weights = state['global_model_weights']
      if isinstance(weights, Mapping):
        weights = process_lib.ModelWeights(
            trainable=tuple(weights['trainable']),
            non_trainable=tuple(weights['non_trainable']))
      return weights
    return self.process.get_model_weights(state)

  def run_map_reduce_round(self, state, client_states: Sequence[Any],
                           datasets: Sequence[Any], merge_after: int = 0):
    """One round of `map_reduce_form()` run piece by piece, and `device`
    run on each client for the state it writes back.

    Returns:
      `(new server state, server output, new client states)`.
    """
    new_client_states = [
        self.device(self.broadcast_weights(state), c, d)['client_state']
        for c, d in zip(client_states, datasets, strict=True)]
    new_state, output = run_map_reduce_round(
        self.map_reduce_form(), state,
        [{'client_state': c, 'data': d}
         for c, d in zip(client_states, datasets)], merge_after)
    return new_state, output, new_client_states


def _compiled(compile_fn, computation, form: str):
  """`compile_fn(computation)`; TFF's refusal as `NotProductionReadyError`."""
  try:
    return compile_fn(computation)
  except (ValueError, TypeError) as e:
    raise NotProductionReadyError(
        f'the round does not compile to {form}: {e}') from e


def production_form(process) -> ProductionForm:
  """The production split of a `StatefulClientProcess`.

  Raises:
    NotProductionReadyError: the process records no per-user client step
      (its client work was given only as a TFF computation), so its device
      part cannot be taken out.
  """
  composition = process.composition
  if composition is None or composition.client_step is None:
    raise NotProductionReadyError(
        f'{type(process).__name__} records no per-user client step '
        '(compose_stateful_client_process(client_step=...)), so its device '
        'part cannot be taken out of its round')
  state_type = process.state_type
  client_type = tff.StructType([
      ('client_state', process.client_state_type),
      ('data', process.client_data_type)])
  round_fn = process.next

  @tff.federated_computation(state_type,
                             tff.FederatedType(client_type, tff.CLIENTS))
  def next_fn(state, clients):
    new_state, _, measurements = round_fn(state, clients.client_state,
                                          clients.data)
    return new_state, measurements

  # The device runs the round's own client work where it was recorded with
  # the process's types (its parameters' names aside); else the same step
  # is traced here.
  device = composition.client_work
  want = (process.model_weights_type, process.client_state_type,
          process.client_data_type)
  if device is None or not _takes(device, want):
    device = process_lib.client_work_from_step(
        composition.client_step, process.model_weights_type,
        process.client_state_type, process.client_data_type)
  return ProductionForm(process=process, initialize=process.initialize,
                        next=next_fn, device=device)


def _takes(computation: tff.Computation, types: Sequence[tff.Type]) -> bool:
  """Whether `computation`'s parameters are of `types`, in order."""
  parameter = computation.type_signature.parameter
  return (isinstance(parameter, tff.StructType) and
          len(parameter) == len(types) and
          all(p.is_equivalent_to(t) for p, t in zip(parameter, types)))


def production_forms(built) -> list[tuple[str, ProductionForm]]:
  """`(stage name, form)` for each stage of a built algorithm (one
  `('train', form)` for a single-stage one), in the order they run."""
  if isinstance(built, stages_lib.Staged):
    return [(stage.name, production_form(stage.process))
            for stage in built.stages]
  return [('train', production_form(built))]


def run_map_reduce_round(mrf: tff.backends.mapreduce.MapReduceForm, state,
                         client_inputs: Sequence[Any], merge_after: int = 0):
  """One round of `mrf` run piece by piece, as a MapReduce platform does.

  `prepare` at the server, `work` on each client, `zero`/`accumulate` over
  the client updates (two accumulators joined by `merge` when `merge_after`
  splits the cohort), `report`, the secure sums added up here, `update`.

  Args:
    mrf: a `MapReduceForm`.
    state: the server state.
    client_inputs: each client's data (`<client_state, data>` for a
      `ProductionForm`).
    merge_after: the first accumulator takes this many clients and a second
      the rest, then `merge` joins them (0: one accumulator).

  Returns:
    `(new server state, server output)`.
  """
  client_input = mrf.prepare(state)
  outputs = [mrf.work(data, client_input) for data in client_inputs]
  parts = [outputs[:merge_after], outputs[merge_after:]] if (
      merge_after) else [outputs]
  accumulators = []
  for part in parts:
    accumulator = mrf.zero()
    for out in part:
      accumulator = mrf.accumulate(accumulator, out[0])
    accumulators.append(accumulator)
  accumulator = accumulators[0]
  for other in accumulators[1:]:
    accumulator = mrf.merge(accumulator, other)
  secure = [_secure_sum([out[i] for out in outputs]) for i in (1, 2, 3)]
  modulus = mrf.secure_modular_sum_modulus()
  secure[2] = _map(lambda v, m: v % m, secure[2], modulus)
  return mrf.update(state, (mrf.report(accumulator), *secure))


def _secure_sum(values):
  """The plain sum of the clients' secure-sum inputs (the platform's
  secure aggregation computes the same sum without seeing them)."""
  if not values:
    return ()
  total = values[0]
  for value in values[1:]:
    total = _map(lambda a, b: a + b, total, value)
  return total


def _map(fn, *structures):
  return tf.nest.map_structure(fn, *structures)


def _tracked_module(build):
  """`(tf.Module tracking every variable `build()` creates, its result)`."""
  created = []

  def creator(next_creator, **kwargs):
    variable = next_creator(**kwargs)
    created.append(variable)
    return variable

  with tf.variable_creator_scope(creator):
    result = build()
  module = tf.Module()
  module.created_variables = created
  return module, result


def _example_specs(data_type: tff.Type) -> dict:
  """One example's specs (the batch dimension dropped) of a `D*` type."""
  batch = tff.types.type_to_tf_tensor_specs(data_type.element)
  return tf.nest.map_structure(
      lambda s: tf.TensorSpec([None] + list(s.shape[1:]), s.dtype), batch)


def export_device_update(form: ProductionForm, path: str,
                         batch_size: int) -> None:
  """Writes the device's part as a TF SavedModel at `path`.

  Its `local_update(trainable, non_trainable, private, rounds_participated,
  examples)` takes the broadcast shared weights (two tuples), the client's
  private state (a tuple) and participation count, and the client's
  examples as one dict of tensors (batched here by `batch_size`, in order,
  as the simulation's datasets are); it returns a dict: `update` and
  `update_weight` (to aggregate), `private` and `rounds_participated` (to
  write back on the device), `metrics`. It runs the process's own client
  step, so it equals `form.device` on the same inputs. Loading it needs
  TensorFlow only.
  """
  process = form.process
  module, step = _tracked_module(process.composition.client_step)
  weights = tff.types.type_to_tf_tensor_specs(process.model_weights_type)
  state = tff.types.type_to_tf_tensor_specs(process.client_state_type)
  step_fn = tf.function(step, autograph=False)

  @tf.function(input_signature=[
      tuple(weights.trainable), tuple(weights.non_trainable),
      tuple(state[process_lib.CLIENT_STATE_PRIVATE]),
      state[process_lib.CLIENT_STATE_ROUNDS],
      _example_specs(process.client_data_type)], autograph=False)
  def local_update(trainable, non_trainable, private, rounds, examples):
    dataset = tf.data.Dataset.from_tensor_slices(examples).batch(batch_size)
    out = step_fn(
        tff.learning.models.ModelWeights(trainable, non_trainable),
        {process_lib.CLIENT_STATE_PRIVATE: private,
         process_lib.CLIENT_STATE_ROUNDS: rounds}, dataset)
    new_state = out['client_state']
    return {'update': out['update'], 'update_weight': out['update_weight'],
            'private': tuple(new_state[process_lib.CLIENT_STATE_PRIVATE]),
            'rounds_participated': new_state[process_lib.CLIENT_STATE_ROUNDS],
            'metrics': dict(out['metrics'])}

  module.local_update = local_update
  tf.saved_model.save(module, path)


def export_personalized_model(model_fn, weights, private: Sequence[Any],
                              path: str) -> None:
  """Writes one client's personalized model as a TF SavedModel at `path`.

  The model of `model_fn` (a `SplitModel` builder: the process's
  evaluation model) with the shared `weights` and the client's `private`
  state (as evaluation takes it, `process.eval_client_states`) loaded;
  `predict(x)` gives what the library's evaluation reports per example
  (`SplitModel.predict` of the forward pass, training off). Loading it
  needs TensorFlow only.
  """
  module, model = _tracked_module(model_fn)
  if model.eval_fn is not None:
    raise NotProductionReadyError(
        'the model reports an evaluation output that needs the targets '
        '(eval_fn), not a prediction: export its device part instead')
  split_training.assign_weights(model, weights, tuple(private))
  x_spec = process_lib.model_input_spec(model_fn)['x']

  @tf.function(input_signature=[tf.TensorSpec(x_spec.shape, x_spec.dtype)])
  def predict(x):
    return model.predict(model.forward({'x': x}, training=False))

  module.predict = predict
  tf.saved_model.save(module, path)
