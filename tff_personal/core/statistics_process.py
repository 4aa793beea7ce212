"""Stateful-client processes whose clients also send statistics for the server.

FedEmbed-SOM and PFedKM learn, besides the model, a server-side structure
from client statistics: a self-organising map and the head re-use counts
(SOM), k-means centroids (PFedKM). `compose_with_server_step` extends
`core.process.compose_stateful_client_process` for that:

    client work: (ModelWeights, C, D*) ->
        <update=<model=U, statistics=T>, update_weight, client_state, metrics
         [, selected=<score, value>]>

* `update` (the model update U *and* the statistics T) goes through the one
  aggregator given (weighted mean, or DP): with DP, the statistics are
  clipped jointly with the model update, noised, and covered by the same
  epsilon; no extra accounting is needed and nothing else about a client
  reaches the server through this path.
* The model part is applied by TFF's `build_apply_optimizer_finalizer` (the
  server optimizer), exactly as in `compose_stateful_client_process`.
* `server_step`, a TFF TensorFlow computation
  `(ModelWeights, mean T, cohort size[, selected]) -> <weights, measurements>`,
  then updates the weights from the statistics (e.g. the non-trainable SOM or
  centroid variables, a re-indexing of the heads). The cohort size is a
  `federated_sum` of ones (the server knows how many clients it sampled).
* Optionally `selected` goes through a second, stateless aggregator (the
  best-scoring selection of `best_scoring.py`), whose release is NOT covered
  by any DP accounting; `fedembed_som` refuses it under DP.

The server state is TFF's `LearningAlgorithmState` like every other process
of the project, so the training loop, checkpoints, evaluation and
`get/set_model_weights` work unchanged.

Sharded simulation (`core/sharded.py`): given the per-user `client_step`
that `client_work` runs, the process records it with `server_step` and the
selection factory in its `Composition`, and `ShardedProcess` re-composes the
process with this function around a shard's work (many users per TFF
client). The shard carries `update` (model and statistics, one joint update)
through the same per-user weighting or DP clipping as any update, selects
its best user with the selection's own rule, and reports how many users it
ran (`cohort_field`), so that the server step receives the cohort size in
users, not in shards.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_personal.core import process as process_lib


def compose_with_server_step(
    *,
    initial_model_weights: process_lib.ModelWeights,
    client_state_type: tff.Type,
    client_work: tff.Computation,
    aggregator_factory,
    server_optimizer: tff.learning.optimizers.Optimizer,
    server_step: tff.Computation,
    selection_factory: Optional[tff.aggregators.UnweightedAggregationFactory]
    = None,
    train_metrics: bool = True,
    model_fn=None,
    client_step: Optional[process_lib.ClientStepFactory] = None,
    cohort_field: Optional[str] = None,
) -> process_lib.StatefulClientProcess:
  """Composes the process described in the module docstring.

  Args:
    initial_model_weights: numpy `ModelWeights` of the shared model.
    client_state_type: unplaced type of one client's state.
    client_work: `(ModelWeights, C, D*) -> OrderedDict(update=OrderedDict(
      model=..., statistics=...), update_weight, client_state, metrics[,
      selected])`.
    aggregator_factory: weighted or unweighted `tff.aggregators` factory for
      the whole `update`.
    server_optimizer: applied to the aggregated model update.
    server_step: `(ModelWeights, statistics mean, float32 cohort size[,
      selected]) -> OrderedDict(weights=ModelWeights, measurements=...)`.
    selection_factory: unweighted factory for `selected` (required iff the
      client work returns `selected`).
    train_metrics: release sums of training metrics.
    model_fn: the split-model builder (for evaluation).
    client_step: the per-user TF logic `client_work` runs (e.g. built with
      `process_lib.client_work_from_step`); recorded, with `server_step` and
      `selection_factory`, so that `core/sharded.py` can run many users per
      TFF client.
    cohort_field: a float32 field of the client work's result holding how
      many users that client ran (a shard's); the cohort size is its
      `federated_sum`. None: each TFF client is one user.

  Returns:
    A `StatefulClientProcess`.
  """
  parts = process_lib.build_parts(
      initial_model_weights=initial_model_weights,
      client_state_type=client_state_type, client_work=client_work,
      aggregator_factory=aggregator_factory,
      server_optimizer=server_optimizer)
  result_type = parts.result_type
  has_selection = 'selected' in dir(result_type)
  if has_selection != (selection_factory is not None):
    raise ValueError('selection_factory must be given exactly when the client '
                     'work returns `selected`')
  selection = (selection_factory.create(result_type.selected)
               if has_selection else None)
  aggregated_type = parts.aggregation.next.type_signature.result.result.member

  @tff.tensorflow.computation(aggregated_type)
  def model_part(aggregated):
    return aggregated['model'] if isinstance(aggregated, dict) else (
        aggregated.model)

  @tff.tensorflow.computation(aggregated_type)
  def statistics_part(aggregated):
    return aggregated['statistics'] if isinstance(aggregated, dict) else (
        aggregated.statistics)

  if cohort_field is None:
    @tff.tensorflow.computation(result_type.update_weight)
    def users(_):
      return tf.constant(1.0, tf.float32)
  else:
    if getattr(result_type, cohort_field) != tff.TensorType(np.float32):
      raise TypeError(f'the client work\'s {cohort_field!r} must be a float32 '
                      f'scalar, got {getattr(result_type, cohort_field)}')

    @tff.tensorflow.computation(getattr(result_type, cohort_field))
    def users(count):
      return tf.identity(count)

  @tff.federated_computation(
      parts.state_type, tff.FederatedType(client_state_type, tff.CLIENTS),
      tff.FederatedType(parts.data_type, tff.CLIENTS))
  def next_fn(state, client_states, client_data):
    distributed, outputs, aggregated = process_lib.run_clients_and_aggregate(
        parts, state, client_states, client_data)
    finalized = parts.finalizer.next(
        state.finalizer, state.global_model_weights,
        tff.federated_map(model_part, aggregated.result))
    cohort = tff.federated_sum(tff.federated_map(
        users, outputs.update_weight if cohort_field is None else
        getattr(outputs, cohort_field)))
    step_args = [finalized.result,
                 tff.federated_map(statistics_part, aggregated.result), cohort]
    if selection is not None:
      selected = selection.next(selection.initialize(), outputs.selected)
      step_args.append(selected.result)
    stepped = tff.federated_map(server_step, tuple(step_args))
    new_state, measurements = process_lib.next_state_and_measurements(
        parts, state, distributed, aggregated, finalized, stepped.weights,
        outputs, train_metrics, server_step=stepped.measurements)
    return new_state, outputs.client_state, measurements

  composition = process_lib.Composition(
      initial_model_weights=parts.weights_value,
      client_state_type=client_state_type, client_data_type=parts.data_type,
      client_work_result_type=result_type,
      aggregator_factory=aggregator_factory, server_optimizer=server_optimizer,
      train_metrics=train_metrics, client_step=client_step,
      server_step=server_step, selection_factory=selection_factory,
      client_work=client_work)
  return process_lib.StatefulClientProcess(
      parts.initialize_fn, next_fn, client_state_type=client_state_type,
      aggregation_value_type=result_type.update, model_fn=model_fn,
      composition=composition)


def shared_variable_index(model_fn, name: str, trainable: bool) -> int:
  """Position of the shared variable `name` (e.g. 'som/nodes') in ModelWeights.

  Raises:
    ValueError: naming the variable when the model has none by that name.
  """
  with tf.Graph().as_default():
    model = model_fn()
    variables = (model.shared_trainable_variables if trainable else
                 model.shared_non_trainable_variables)
    names = [v.name for v in variables]
  matches = [i for i, n in enumerate(names)
             if n == f'{name}:0' or n.endswith(f'/{name}:0')]
  if len(matches) != 1:
    kind = 'trainable' if trainable else 'non-trainable'
    raise ValueError(f'the model has {len(matches)} shared {kind} variables '
                     f'named {name!r}; it has {names}')
  return matches[0]
