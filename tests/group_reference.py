"""The group paper's evaluation written by hand, as the paper states it.

An independent reference for the tests: the library evaluates GroupFL and
GroupPerFL through its one per-client evaluation (`runs.Run.client_outputs`,
the `fine_tune` strategy); `tests/group_stage_test.py` holds the two equal.
Algorithm 3 (local personalization, the personalized model kept at CLIENTS)
and per-client token sums of server- or client-placed models.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import tensorflow as tf
import tensorflow_federated as tff

from tff_personal.algorithms import group_fl
from tff_personal.core import federated_map
from tff_personal.core import split_model as split_model_lib
from tff_personal.core import split_training

ModelWeights = tff.learning.models.ModelWeights
_data_type = group_fl._data_type  # pylint: disable=protected-access
_chunks = group_fl._chunks  # pylint: disable=protected-access


def build_local_personalization(
    model_fn: split_model_lib.SplitModelFn,
    optimizer: tff.learning.optimizers.Optimizer,
    weights_type: tff.Type) -> tff.Computation:
  """Algorithm 3: `(ModelWeights@SERVER, D*@CLIENTS) -> ModelWeights@CLIENTS`.

  Each client trains the broadcast model on its dataset (K_l epochs: the
  dataset repeats) with `optimizer` and keeps the result; a client whose
  training turns non-finite keeps the broadcast model. Nothing is aggregated:
  the output stays at CLIENTS.
  """
  data_type = _data_type(model_fn)

  @tff.tensorflow.computation(weights_type, data_type)
  def personalize_client(weights, dataset):
    model = model_fn()
    train = tf.function(lambda w, d: split_training.local_train(
        model, optimizer, w, (), d))
    update, _, _, _ = train(weights, dataset)
    return ModelWeights(
        trainable=tuple(w - u for w, u in zip(weights.trainable, update)),
        non_trainable=tuple(weights.non_trainable))

  return federated_map.broadcast_map(
      personalize_client, weights_type, ('client_data', data_type))


def build_lm_evaluation(model_fn: split_model_lib.SplitModelFn,
                        sums_fn, weights_type: tff.Type,
                        weights_placement=tff.SERVER) -> tff.Computation:
  """Per-client sums of `sums_fn(batch, outputs)` over the client's data.

  `weights_placement=tff.SERVER`: one model broadcast to every client (FL,
  GroupFL); `tff.CLIENTS`: each client's own model (PerFL, GroupPerFL).
  Returns the sums at CLIENTS, e.g. token NLL sum and token count, from which
  the driver computes perplexities at any aggregation level.
  """
  data_type = _data_type(model_fn)

  @tff.tensorflow.computation(weights_type, data_type)
  def client_eval(weights, dataset):
    model = model_fn()

    @tf.function
    def run(weights, dataset):
      split_training.assign_weights(model, weights, ())
      empty = {k: tf.zeros([0] + s.shape[1:].as_list(), s.dtype)
               for k, s in dataset.element_spec.items()}
      # Static shapes only: the empty forward pass is pruned, never run.
      sample = sums_fn(empty, model.forward(empty, training=False))
      zeros = {k: tf.zeros(v.shape, v.dtype) for k, v in sample.items()}

      def add(acc, batch):
        sums = sums_fn(batch, model.forward(batch, training=False))
        return {k: acc[k] + sums[k] for k in acc}

      return dataset.reduce(zeros, add)

    return run(weights, dataset)

  return federated_map.broadcast_map(
      client_eval, weights_type, ('client_data', data_type),
      weights_placement=weights_placement)


def evaluate_global(evaluate: tff.Computation, weights: ModelWeights,
                    clients: Sequence[int], eval_dataset_fn, *,
                    chunk_size: int = 64) -> dict[int, dict]:
  """`{client: sums}` of one server model on each client's eval data."""
  out = {}
  for chunk in _chunks(clients, chunk_size):
    results = evaluate(weights, [eval_dataset_fn(c) for c in chunk])
    out.update({c: {k: float(v) for k, v in r.items()}
                for c, r in zip(chunk, results)})
  return out


def personalize_and_evaluate(
    personalize: tff.Computation, evaluate_personal: tff.Computation,
    weights: ModelWeights, clients: Sequence[int],
    train_dataset_fn: Callable[[int], tf.data.Dataset],
    eval_dataset_fn: Callable[[int], tf.data.Dataset], *,
    chunk_size: int = 64,
    keep_fn: Optional[Callable[[int, ModelWeights], None]] = None
) -> dict[int, dict]:
  """Personalizes every client from `weights`, then evaluates its own model.

  Clients go in chunks (the personalized models of a chunk are in memory at
  once); `keep_fn(client, personalized_weights)` may store each model.
  Returns `{client: sums}`.
  """
  out = {}
  for chunk in _chunks(clients, chunk_size):
    personal = personalize(weights, [train_dataset_fn(c) for c in chunk])
    if keep_fn is not None:
      for c, w in zip(chunk, personal):
        keep_fn(c, w)
    results = evaluate_personal(personal, [eval_dataset_fn(c) for c in chunk])
    out.update({c: {k: float(v) for k, v in r.items()}
                for c, r in zip(chunk, results)})
  return out
