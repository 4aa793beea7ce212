"""TensorFlow logic of local training for models with private variables.

This is the client side of every "shared + private parameters" algorithm
(Global+, FURL, and the personal parts of FedEmbed): one pass of local
optimisation over the client's dataset that updates shared and private
variables jointly, then returns

* the shared update `initial - final` (TFF's sign convention, so the server
  optimizer treats it as a gradient), zeroed with weight 0 if any value is
  non-finite, exactly as `tff.learning.templates.build_model_delta_client_work`
  does;
* the new private variables (the client state), or the old ones unchanged if
  training produced non-finite values;
* sums for training metrics.

It mirrors TFF's `build_model_delta_update_with_tff_optimizer` (a
`dataset.reduce` over batches with a functional `tff.learning.optimizers`
optimizer), so that with no private variables it computes bit-for-bit what
`tff.learning.algorithms.build_weighted_fed_avg` computes. The difference TFF
lacks is the private variables: they are assigned from, and returned to, the
client state.

Only TensorFlow here; the federated orchestration is in `core/process.py`.
"""

from __future__ import annotations

import collections
from typing import Any

import tensorflow as tf
import tensorflow_federated as tff

from tff_personal.core import private_noise
from tff_personal.core import split_model as split_model_lib


def _assign(variables, values):
  for var, value in zip(variables, values):
    var.assign(value)


def _all_finite(structure) -> tf.Tensor:
  flat = [tf.reduce_all(tf.math.is_finite(t)) for t in tf.nest.flatten(structure)]
  return tf.reduce_all(tf.stack(flat)) if flat else tf.constant(True)


def local_train(model: split_model_lib.SplitModel,
                optimizer: tff.learning.optimizers.Optimizer,
                initial_weights: tff.learning.models.ModelWeights,
                private_weights: tuple[Any, ...],
                dataset: tf.data.Dataset,
                metrics_fn=None,
                private_optimizer: tff.learning.optimizers.Optimizer | None = None):
  """Runs local training; returns (update, weight, new_private, metric sums).

  Must be called inside a TFF TensorFlow computation (graph mode) with a
  freshly built `model`.

  Args:
    model: the split model (fresh variables).
    optimizer: a `tff.learning.optimizers.Optimizer` applied to the shared
      trainable and the private variables together (it is element-wise, so
      this equals one optimizer per group with the same hyper-parameters).
    initial_weights: the broadcast shared weights (`ModelWeights` of tuples).
    private_weights: the client's private variables (tuple of tensors).
    dataset: batches of the client's data.
    metrics_fn: optional `(batch, outputs) -> dict` of per-batch metric sums.
    private_optimizer: optional separate optimizer for the private trainable
      variables (e.g. a larger learning rate for personal embeddings, which
      see only a few local steps per participation); default: `optimizer`.

  Returns:
    `(update, update_weight, new_private_weights, metrics)` where `metrics` is
    an OrderedDict with `loss_sum`, `num_examples`, `nonfinite` and the sums of
    `metrics_fn`.
  """
  shared = model.shared_trainable_variables
  shared_nt = model.shared_non_trainable_variables
  private = list(model.private_variables)
  _assign(shared, initial_weights.trainable)
  _assign(shared_nt, initial_weights.non_trainable)
  _assign(private, private_weights)
  if model.prepare_fn is not None:
    model.prepare_fn(dataset)
  noise_start = private_noise.start_values(model)
  private_trainable = model.private_trainable_variables
  # One optimizer over everything, or one per group.
  groups = ([(optimizer, shared + private_trainable)]
            if private_optimizer is None else
            [(optimizer, shared), (private_optimizer, private_trainable)])
  trainable = [v for _, variables in groups for v in variables]

  def metric_zeros():
    if metrics_fn is None:
      return collections.OrderedDict()
    # The metrics' structure and static shapes, from a forward pass traced
    # (never run) on the batches' spec. Not on a tensor of zero examples:
    # Keras' LSTM cannot be traced on a batch whose size is statically 0.
    sample = tf.function(
        lambda b: metrics_fn(b, model.predict(model.forward(
            b, training=False))), autograph=False).get_concrete_function(
                dataset.element_spec).structured_outputs
    return collections.OrderedDict(
        (k, tf.zeros(v.shape, v.dtype)) for k, v in sample.items())

  def reduce_fn(state, batch):
    num_examples, loss_sum, sums, opt_state = state
    with tf.GradientTape() as tape:
      outputs = model.forward(batch, training=True)
      loss = model.loss(batch, outputs)
    grads = tape.gradient(loss, trainable)
    grads = [tf.zeros_like(v) if g is None else g
             for g, v in zip(grads, trainable)]
    new_opt_state, start = [], 0
    for (opt, variables), state_i in zip(groups, opt_state):
      group_grads = grads[start:start + len(variables)]
      start += len(variables)
      state_i, updated = opt.next(state_i, tuple(variables), tuple(group_grads))
      _assign(variables, updated)
      new_opt_state.append(state_i)
    opt_state = tuple(new_opt_state)
    batch_size = tf.shape(tf.nest.flatten(batch)[0])[0]
    num_examples += tf.cast(batch_size, tf.int64)
    loss_sum += loss * tf.cast(batch_size, tf.float32)
    if metrics_fn is not None:
      batch_sums = metrics_fn(batch, model.predict(outputs))
      sums = collections.OrderedDict(
          (k, sums[k] + batch_sums[k]) for k in sums)
    return num_examples, loss_sum, sums, opt_state

  initial_state = (tf.constant(0, tf.int64), tf.constant(0.0, tf.float32),
                   metric_zeros(),
                   tuple(opt.initialize(tuple(tf.TensorSpec(v.shape, v.dtype)
                                              for v in variables))
                         for opt, variables in groups))
  num_examples, loss_sum, sums, _ = dataset.reduce(initial_state, reduce_fn)
  private_noise.finish_pass(model, noise_start)

  update = tuple(tf.subtract(a, b.read_value())
                 for a, b in zip(initial_weights.trainable, shared))
  new_private = tuple(v.read_value() for v in private)
  finite = tf.logical_and(
      _all_finite(update),
      _all_finite([p for p in new_private if p.dtype.is_floating]))
  update = tuple(tf.where(finite, u, tf.zeros_like(u)) for u in update)
  new_private = tuple(tf.where(finite, n, tf.cast(p, n.dtype))
                      for n, p in zip(new_private, private_weights))
  update_weight = tf.where(finite, tf.cast(num_examples, tf.float32), 0.0)
  metrics = collections.OrderedDict(
      loss_sum=tf.where(finite, loss_sum, 0.0),
      num_examples=tf.where(finite, num_examples, tf.constant(0, tf.int64)),
      nonfinite=tf.cast(tf.logical_not(finite), tf.int32),
  )
  for k, v in sums.items():
    metrics[k] = tf.where(finite, v, tf.zeros_like(v))
  return update, update_weight, new_private, metrics


def assign_weights(model: split_model_lib.SplitModel,
                   weights: tff.learning.models.ModelWeights,
                   private_weights: tuple[Any, ...]) -> None:
  """Loads shared and private values into a freshly built model."""
  _assign(model.shared_trainable_variables, weights.trainable)
  _assign(model.shared_non_trainable_variables, weights.non_trainable)
  _assign(model.private_variables, private_weights)


def fine_tune_private(model: split_model_lib.SplitModel,
                      optimizer: tff.learning.optimizers.Optimizer,
                      dataset: tf.data.Dataset) -> tf.Tensor:
  """Trains only the private variables over `dataset` (shared ones frozen).

  Used for cold start and test-time personalization: a user who never took
  part in training adapts its own private state locally; nothing is sent.
  With `model.private_noise`, the pass's change of a personal head is
  clipped and noised as in training (`core/private_noise.py`).
  Returns the number of examples seen.
  """
  if model.prepare_fn is not None:
    model.prepare_fn(dataset)
  noise_start = private_noise.start_values(model)
  private = model.private_trainable_variables
  specs = tuple(tf.TensorSpec(v.shape, v.dtype) for v in private)

  def reduce_fn(state, batch):
    num_examples, opt_state = state
    with tf.GradientTape() as tape:
      loss = model.loss(batch, model.forward(batch, training=True))
    grads = tape.gradient(loss, private)
    grads = [tf.zeros_like(v) if g is None else g
             for g, v in zip(grads, private)]
    opt_state, updated = optimizer.next(opt_state, tuple(private), tuple(grads))
    _assign(private, updated)
    batch_size = tf.shape(tf.nest.flatten(batch)[0])[0]
    return num_examples + tf.cast(batch_size, tf.int64), opt_state

  num_examples, _ = dataset.reduce(
      (tf.constant(0, tf.int64), optimizer.initialize(specs)), reduce_fn)
  private_noise.finish_pass(model, noise_start)
  return num_examples
