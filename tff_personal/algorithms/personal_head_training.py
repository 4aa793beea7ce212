"""TF client steps of FedRep and pFedMe (no TFF here; see fedrep.py, pfedme.py),
and the pass helpers other hand-written client steps share (`train_pass`,
`gradients`, `reduce_batches`, `metric_zeros`, `accumulate`,
`step_result`; Per-FedAvg, APFL).

Both return what `core.split_training.local_train` returns, `(update,
update_weight, new_private, metrics)`, with the same conventions: the update
is `initial - final` shared trainable weights; a client whose update or
private state is non-finite sends a zero update with weight 0 and keeps its
old private state; metrics hold `loss_sum`, `num_examples`, `nonfinite` and the
sums of `metrics_fn`.

FedRep (Collins et al., 2021, Algorithm 1): with the body (shared) frozen,
`head_epochs` passes over the client data train the personal head (private);
then, with the head frozen, one pass trains the body. Client datasets are
used only through `reduce` and `element_spec`, so that the steps also run in
the sharded simulation of `core/sharded.py`. Only the body update is
sent. (The pass over the data is the task's, which may already repeat the
data `local_epochs` times.)

pFedMe (Dinh et al., 2020, Algorithm 1), with the personal part restricted to
the head (FedEmbed's description): for every batch,
  1. inner problem: `theta <- argmin f(theta; enc) + lam/2 ||theta - w||^2`,
     approximated by `inner_steps` steps of the inner optimizer started from
     the current theta (the client's persistent personal head: a warm start
     of a strongly convex problem whose solution does not depend on it);
  2. outer step on the local copy of the global model: the gradient of the
     Moreau envelope F(enc, w) = min_theta f + lam/2 ||theta - w||^2 is
     `lam (w - theta)` for the head and `grad_enc f(enc, theta)` for the
     encoder (envelope theorem); the client optimizer applies it.
The metrics' `loss` is the Moreau objective at the end of the inner problem.

With `model.private_noise` (the paper's DP reading, `core/private_noise.py`)
both steps clip and noise the pass's change of the personal head at its end;
the body / global-model update sent to the server is computed before and is
unchanged.
"""

from __future__ import annotations

import collections
from typing import Any, Sequence

import tensorflow as tf
import tensorflow_federated as tff

from tff_personal.core import private_noise
from tff_personal.core import split_model as split_model_lib
from tff_personal.core import split_training


def _assign(variables, values):
  for var, value in zip(variables, values):
    var.assign(value)


def _all_finite(structure) -> tf.Tensor:
  flat = [tf.reduce_all(tf.math.is_finite(t))
          for t in tf.nest.flatten(structure)]
  return tf.reduce_all(tf.stack(flat)) if flat else tf.constant(True)


def metric_zeros(model, dataset, metrics_fn):
  """Zero sums shaped like `metrics_fn`'s on `dataset`'s batches."""
  if metrics_fn is None:
    return collections.OrderedDict()
  # The structure and static shapes from a forward pass traced (never run)
  # on the batches' spec, as `core/split_training.local_train` does: Keras'
  # LSTM cannot be traced on a batch whose size is statically 0.
  sample = tf.function(
      lambda b: metrics_fn(b, model.predict(model.forward(
          b, training=False))), autograph=False).get_concrete_function(
              dataset.element_spec).structured_outputs
  return collections.OrderedDict(
      (k, tf.zeros(v.shape, v.dtype)) for k, v in sample.items())


def variable_specs(variables):
  """The `tf.TensorSpec`s of `variables` (an optimizer's `initialize`)."""
  return tuple(tf.TensorSpec(v.shape, v.dtype) for v in variables)


def _batch_size(batch):
  return tf.shape(tf.nest.flatten(batch)[0])[0]


def accumulate(model, metrics_fn, state, batch, outputs, loss):
  """(num_examples, loss_sum, sums) of `state` plus this batch's (its
  `outputs` and mean `loss`)."""
  num_examples, loss_sum, sums = state[:3]
  n = _batch_size(batch)
  if metrics_fn is not None:
    batch_sums = metrics_fn(batch, model.predict(outputs))
    sums = collections.OrderedDict(
        (k, sums[k] + batch_sums[k]) for k in sums)
  return (num_examples + tf.cast(n, tf.int64),
          loss_sum + loss * tf.cast(n, tf.float32), sums)


def reduce_batches(model, dataset, metrics_fn, optimizer, variables,
                   reduce_fn):
  """Runs `reduce_fn` over `dataset` from zero sums and a fresh optimizer
  state for `variables`; returns (num_examples, loss_sum, sums)."""
  num_examples, loss_sum, sums, _ = dataset.reduce(
      (tf.constant(0, tf.int64), tf.constant(0.0),
       metric_zeros(model, dataset, metrics_fn),
       optimizer.initialize(variable_specs(variables))), reduce_fn)
  return num_examples, loss_sum, sums


def gradients(model, variables, batch):
  """`(grads, outputs, loss)` of `model`'s loss on `batch` with respect to
  `variables`: zeros for a variable the loss does not reach, dense tensors
  for an embedding's (IndexedSlices)."""
  with tf.GradientTape() as tape:
    outputs = model.forward(batch, training=True)
    loss = model.loss(batch, outputs)
  grads = tape.gradient(loss, variables)
  return [tf.zeros_like(v) if g is None else tf.convert_to_tensor(g)
          for g, v in zip(grads, variables)], outputs, loss


def train_pass(model: split_model_lib.SplitModel,
               optimizer: tff.learning.optimizers.Optimizer,
               variables: Sequence[tf.Variable], dataset: tf.data.Dataset,
               metrics_fn=None):
  """One pass over `dataset` training only `variables`.

  Returns `(num_examples int64, loss_sum float32, metric sums)`.
  """
  variables = list(variables)

  def reduce_fn(state, batch):
    opt_state = state[3]
    with tf.GradientTape() as tape:
      outputs = model.forward(batch, training=True)
      loss = model.loss(batch, outputs)
    grads = tape.gradient(loss, variables)
    grads = tuple(tf.zeros_like(v) if g is None else g
                  for g, v in zip(grads, variables))
    opt_state, updated = optimizer.next(opt_state, tuple(variables), grads)
    _assign(variables, updated)
    return accumulate(model, metrics_fn, state, batch, outputs,
                      loss) + (opt_state,)

  return reduce_batches(model, dataset, metrics_fn, optimizer, variables,
                        reduce_fn)


def step_result(model, initial_weights, private_weights, num_examples,
                loss_sum, sums):
  """A client step's `(update, weight, new_private, metrics)` from `model`'s
  variables after training: the shared update `initial - final`; a
  non-finite update or private state sends nothing (weight 0) and keeps the
  old private state."""
  shared = model.shared_trainable_variables
  update = tuple(tf.subtract(a, b.read_value())
                 for a, b in zip(initial_weights.trainable, shared))
  new_private = tuple(v.read_value() for v in model.private_variables)
  finite = tf.logical_and(
      _all_finite(update),
      _all_finite([p for p in new_private if p.dtype.is_floating]))
  update = tuple(tf.where(finite, u, tf.zeros_like(u)) for u in update)
  new_private = tuple(tf.where(finite, n, tf.cast(p, n.dtype))
                      for n, p in zip(new_private, private_weights))
  metrics = collections.OrderedDict(
      loss_sum=tf.where(finite, loss_sum, 0.0),
      num_examples=tf.where(finite, num_examples, tf.constant(0, tf.int64)),
      nonfinite=tf.cast(tf.logical_not(finite), tf.int32))
  for k, v in sums.items():
    metrics[k] = tf.where(finite, v, tf.zeros_like(v))
  weight = tf.where(finite, tf.cast(num_examples, tf.float32), 0.0)
  return update, weight, new_private, metrics


def fedrep_local_train(model: split_model_lib.SplitModel,
                       body_optimizer: tff.learning.optimizers.Optimizer,
                       head_optimizer: tff.learning.optimizers.Optimizer,
                       initial_weights, private_weights: tuple[Any, ...],
                       dataset: tf.data.Dataset, head_epochs: int,
                       metrics_fn=None):
  """FedRep's local update (module docstring)."""
  split_training.assign_weights(model, initial_weights, private_weights)
  if model.prepare_fn is not None:
    model.prepare_fn(dataset)
  noise_start = private_noise.start_values(model)
  head = model.private_trainable_variables
  # Passes one by one (client datasets may offer only `reduce` and
  # `element_spec`, see core/sharded.py); the head optimizer's state restarts
  # every pass.
  for _ in range(head_epochs if head else 0):
    train_pass(model, head_optimizer, head, dataset)
  num_examples, loss_sum, sums = train_pass(
      model, body_optimizer, model.shared_trainable_variables, dataset,
      metrics_fn)
  private_noise.finish_pass(model, noise_start)
  return step_result(model, initial_weights, private_weights, num_examples,
                     loss_sum, sums)


def pfedme_local_train(model: split_model_lib.SplitModel,
                       optimizer: tff.learning.optimizers.Optimizer,
                       inner_optimizer: tff.learning.optimizers.Optimizer,
                       initial_weights, private_weights: tuple[Any, ...],
                       dataset: tf.data.Dataset, *,
                       global_head: Sequence[tf.Variable], lam: float,
                       inner_steps: int, metrics_fn=None):
  """pFedMe's local update (module docstring).

  Args:
    model: a `models.personal_head.personal_copy_model_fn` model: private
      variables are the personal head theta, `global_head` its shared twin w.
    optimizer: client optimizer of the encoder and the local copy of w.
    inner_optimizer: the inner solver (its state restarts every batch).
    initial_weights: broadcast shared weights.
    private_weights: the client's theta.
    dataset: the client's batches.
    global_head: the shared head variables w, in theta's order.
    lam: pFedMe's lambda.
    inner_steps: steps of the inner solver per batch.
    metrics_fn: per-batch metric sums.
  """
  split_training.assign_weights(model, initial_weights, private_weights)
  noise_start = private_noise.start_values(model)
  theta = list(model.private_trainable_variables)
  w = list(global_head)
  w_refs = {v.ref() for v in w}
  encoder = [v for v in model.shared_trainable_variables
             if v.ref() not in w_refs]
  outer = encoder + w

  def reduce_fn(state, batch):
    opt_state = state[3]

    def inner_step(i, inner_state):
      with tf.GradientTape() as tape:
        loss = model.loss(batch, model.forward(batch, training=True))
      grads = tape.gradient(loss, theta)
      inner_state, updated = inner_optimizer.next(inner_state, tuple(theta),
                                                  tuple(grads))
      _assign(theta, updated)
      return i + 1, inner_state

    # A graph loop written out (steps are traced without AutoGraph), one
    # step at a time: each step reads what the last one assigned
    # (`shard_packing.PackedBatches.reduce`).
    tf.while_loop(lambda i, _: i < inner_steps, inner_step,
                  (tf.constant(0),
                   inner_optimizer.initialize(variable_specs(theta))),
                  parallel_iterations=1)
    with tf.GradientTape() as tape:
      outputs = model.forward(batch, training=True)
      loss = model.loss(batch, outputs)
    grads = tape.gradient(loss, encoder)
    grads = [tf.zeros_like(v) if g is None else g
             for g, v in zip(grads, encoder)]
    grads += [lam * (wi - ti) for wi, ti in zip(w, theta)]
    opt_state, updated = optimizer.next(opt_state, tuple(outer), tuple(grads))
    _assign(outer, updated)
    return accumulate(model, metrics_fn, state, batch, outputs,
                      loss) + (opt_state,)

  num_examples, loss_sum, sums = reduce_batches(model, dataset, metrics_fn,
                                                optimizer, outer, reduce_fn)
  private_noise.finish_pass(model, noise_start)
  return step_result(model, initial_weights, private_weights, num_examples,
                     loss_sum, sums)
