"""TensorFlow logic of FedPerC's client steps: local training, test-time
adaptation (fine-tuning or generation) and perplexity.

Only TensorFlow here; the TFF wiring is in `tff_personal/algorithms/fedperc.py`.

Local training (Algorithm 1 lines 7-12, Algorithm 2 lines 9-16): one step
per batch of the client's dataset (the driver gives 10 batches of 15
sampled utterances), Adam (`tff.learning.optimizers`, functional) on the
variant's trainable variables, plus FedProx's proximal term
`mu/2 * ||w - w_global||^2` on the shared trainable variables (Appendix B,
mu = 1). The private state has no global value, so no proximal term. Like
`core/split_training.py`, the shared update is `initial - final`, zeroed with
weight 0 if anything is non-finite, and the old private state is kept then.
"""

from __future__ import annotations

import collections
from typing import Any

import tensorflow as tf
import tensorflow_federated as tff

from tff_personal.core import batched as batched_lib
from tff_personal.core import shard_packing
from tff_personal.models import fedperc


def _assign(variables, values):
  for var, value in zip(variables, values):
    var.assign(value)


def _all_finite(structure) -> tf.Tensor:
  flat = [tf.reduce_all(tf.math.is_finite(t))
          for t in tf.nest.flatten(structure)]
  return tf.reduce_all(tf.stack(flat)) if flat else tf.constant(True)


def assign_weights(model: fedperc.FedPercModel, weights, private) -> None:
  _assign(model.shared_trainable_variables, weights.trainable)
  _assign(model.shared_non_trainable_variables, weights.non_trainable)
  _assign(model.private_variables, private)


def proximal_term(variables, anchors, mu: float) -> tf.Tensor:
  if not variables or mu == 0.0:
    return tf.constant(0.0)
  return 0.5 * mu * tf.add_n([tf.reduce_sum(tf.square(v - a))
                              for v, a in zip(variables, anchors)])


def _split_for_generator(batch, count: int):
  head = {k: v[:count] for k, v in batch.items()}
  tail = {k: v[count:] for k, v in batch.items()}
  return head, tail


def generated_step_loss(model: fedperc.FedPercModel, batch):
  """Algorithm 2, one step: generate from the batch's first utterances and
  score the rest with the generated embeddings. Returns (loss, new offset)."""
  gen_batch, target = _split_for_generator(
      batch, model.config.generator_utterances)
  offset, table = model.generate(model.personal_offset, gen_batch)
  prefix = model.preference_embeddings(target['context'], offset, table)
  return model.loss(target, prefix), offset


def local_train(model: fedperc.FedPercModel,
                optimizer: tff.learning.optimizers.Optimizer,
                initial_weights, private_weights: tuple[Any, ...],
                dataset: tf.data.Dataset, mu: float):
  """Runs local training; returns (update, weight, new_private, metric sums)."""
  shared = model.shared_trainable_variables
  private = list(model.private_variables)
  assign_weights(model, initial_weights, private_weights)
  generated = model.config.variant == fedperc.GENERATED
  # Generated embeddings are predicted, not trained: only shared variables
  # (generators and context embeddings) take gradient steps.
  trainable = shared if generated else shared + private
  anchors = tuple(tf.identity(w) for w in initial_weights.trainable)
  specs = tuple(tf.TensorSpec(v.shape, v.dtype) for v in trainable)

  def reduce_fn(state, batch):
    num_examples, loss_sum, opt_state = state
    with tf.GradientTape() as tape:
      if generated:
        loss, offset = generated_step_loss(model, batch)
      else:
        loss = model.loss(batch)
      total = loss + proximal_term(shared, anchors, mu)
    grads = tape.gradient(total, trainable)
    grads = [tf.zeros_like(v) if g is None else g
             for g, v in zip(grads, trainable)]
    opt_state, updated = optimizer.next(opt_state, tuple(trainable),
                                        tuple(grads))
    _assign(trainable, updated)
    if generated:  # psi_d <- Gamma(theta_d, psi_d, B_d)
      model.personal_offset.assign(tf.stop_gradient(offset))
    batch_size = tf.shape(batch['ids'])[0]
    return (num_examples + tf.cast(batch_size, tf.int64),
            loss_sum + loss * tf.cast(batch_size, tf.float32), opt_state)

  num_examples, loss_sum, _ = dataset.reduce(
      (tf.constant(0, tf.int64), tf.constant(0.0), optimizer.initialize(specs)),
      reduce_fn)
  update = tuple(tf.subtract(a, v.read_value())
                 for a, v in zip(initial_weights.trainable, shared))
  new_private = tuple(v.read_value() for v in private)
  finite = tf.logical_and(_all_finite(update), _all_finite(new_private))
  update = tuple(tf.where(finite, u, tf.zeros_like(u)) for u in update)
  new_private = tuple(tf.where(finite, n, p)
                      for n, p in zip(new_private, private_weights))
  weight = tf.where(finite, tf.cast(num_examples, tf.float32), 0.0)
  metrics = collections.OrderedDict(
      loss_sum=tf.where(finite, loss_sum, 0.0),
      num_examples=tf.where(finite, num_examples, tf.constant(0, tf.int64)),
      nonfinite=tf.cast(tf.logical_not(finite), tf.int32))
  return update, weight, new_private, metrics


# ------------------------------------------------------------ test time


def adaptable_variables(model: fedperc.FedPercModel) -> list[tf.Variable]:
  """What a user fine-tunes locally at test time (local copies, never sent).

  FedPerC: psi and the context embeddings; Split-Learning: the personal head
  and the context heads; Meta-Learning: the shared output layer.
  """
  if model.config.variant == fedperc.EMBEDDING:
    return [model.personal_offset, model.context_embeddings]
  if model.config.variant == fedperc.SPLIT:
    return [model.personal_head, model.context_heads]
  if model.config.variant == fedperc.META:
    return [model.head]
  raise ValueError('the generated variant adapts by generation, not by '
                   'fine-tuning')


def fine_tune(model: fedperc.FedPercModel,
              optimizer: tff.learning.optimizers.Optimizer,
              batches: tf.data.Dataset) -> tf.Tensor:
  """Local Adam steps on the adaptable variables, one per batch."""
  variables = adaptable_variables(model)
  specs = tuple(tf.TensorSpec(v.shape, v.dtype) for v in variables)

  def reduce_fn(state, batch):
    steps, opt_state = state
    with tf.GradientTape() as tape:
      loss = model.loss(batch)
    grads = tape.gradient(loss, variables)
    opt_state, updated = optimizer.next(opt_state, tuple(variables),
                                        tuple(grads))
    _assign(variables, updated)
    return steps + 1, opt_state

  steps, _ = batches.reduce((tf.constant(0), optimizer.initialize(specs)),
                            reduce_fn)
  return steps


def generate_embeddings(model: fedperc.FedPercModel, batch) -> None:
  """FedPerC (Generated) at test time: forward passes over the user's
  fine-tuning utterances set psi and the context embeddings."""
  offset, table = model.generate(model.personal_offset, batch)
  model.personal_offset.assign(offset)
  model.context_embeddings.assign(table)


def nll_sums(model: fedperc.FedPercModel, dataset: tf.data.Dataset,
             prompt: int = 3) -> tuple[tf.Tensor, tf.Tensor]:
  """Sum of token NLLs and token count over a dataset of batches."""

  def reduce_fn(state, batch):
    total, count = model.nll(batch, prompt)
    return state[0] + total, state[1] + count

  return dataset.reduce((tf.constant(0.0), tf.constant(0.0)), reduce_fn)


def next_token_logits(model: fedperc.FedPercModel, ids: list[int],
                      context: int) -> tf.Tensor:
  """Logits of the token after `ids` for one utterance in `context`."""
  length = len(ids)
  batch = dict(ids=tf.constant([ids + [0]], tf.int32),
               mask=tf.ones([1, length + 1], tf.int32),
               context=tf.constant([context], tf.int32))
  logits = model.logits_and_targets(batch)[0]  # causal: the pad is not seen
  return logits[0, length if model.has_prefix else length - 1]


def sample_continuation(model: fedperc.FedPercModel, prompt_ids: list[int],
                        context: int, *, end_id: int, max_new_tokens: int,
                        rng, top_k: int = 10) -> list[int]:
  """Top-k sampling of a continuation (Table 4); stops at the end token."""
  ids = list(prompt_ids)
  out = []
  for _ in range(max_new_tokens):
    logits = next_token_logits(model, ids, context).numpy()
    top = logits.argsort()[-top_k:]
    p = tf.nn.softmax(logits[top]).numpy().astype('float64')
    token = int(top[rng.choice(top_k, p=p / p.sum())])
    if token == end_id:
      break
    ids.append(token)
    out.append(token)
  return out


# ------------------------------------------------------------ batched


def batched_local_train(model: fedperc.FedPercModel,
                        optimizer: tff.learning.optimizers.Optimizer,
                        initial_weights, private: tuple[Any, ...], shard,
                        mu: float, decode=None):
  """`local_train` for every user of a packed shard at once.

  The `embedding` variant only: its learned parts are small (the context
  table and the personal offset), so each user's copies are stacked along
  a user axis, and each step runs the frozen backbone once over every
  user's batch, the prefix of each utterance read from its user's copies.
  A user's loss depends on its own copies only, so the gradient of the sum
  of the users' losses is each user's own; an element-wise optimizer then
  steps each user as `local_train` would alone. Ragged users are padded
  and masked (`core/batched.py`): padded utterances score no token, and a
  user whose batches are done keeps its weights and optimizer slots. Equal
  to `local_train` per user up to float rounding of the batched ops.

  Args:
    model: the FedPerC model (variant `embedding`), built once per trace.
    optimizer: an element-wise TFF optimizer (Adam, SGD).
    initial_weights: the broadcast `ModelWeights` (the frozen backbone as
      its non-trainable part).
    private: the stacked private states: (personal offsets [users, H],).
    shard: one packed shard (`core/shard_packing.pack_datasets`).
    mu: FedProx's mu on the shared trainable variables.
    decode: the task's wire decoding of a batch, if any.

  Returns:
    A `core/batched.BatchedResult` with the users' new private states.
  """
  if model.config.variant != fedperc.EMBEDDING:
    raise ValueError('batched FedPerC training covers the embedding variant, '
                     f'not {model.config.variant!r}')
  _assign(model.shared_non_trainable_variables, initial_weights.non_trainable)
  num_users = tf.shape(shard[shard_packing.SHARD_NUM_BATCHES])[0]
  (table0,) = tuple(initial_weights.trainable)
  (offset0,) = private

  def user_loss(weights, batch, real, step):
    del step
    table, offset = weights
    contexts = tf.reshape(batch['context'], tf.shape(real))
    prefix = (1.0 + offset)[:, None, :] * tf.gather(table, contexts,
                                                    batch_dims=1)
    logits, targets, _, mask = model.logits_and_targets(
        batch, tf.reshape(prefix, [-1, tf.shape(prefix)[-1]]))
    mask *= tf.reshape(real, [-1, 1])
    nll = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=targets, logits=logits) * mask
    per_user = lambda t: tf.reduce_sum(tf.reshape(t, [num_users, -1]), 1)
    return per_user(nll) / tf.maximum(per_user(mask), 1.0), ()

  def proximal(weights):  # FedProx on the shared context table.
    return 0.5 * mu * tf.reduce_sum(tf.square(weights[0] - table0[None]),
                                    [1, 2])

  (table, offset), loss_sum, _ = batched_lib.train_steps(
      shard, optimizer, (batched_lib.stack_users(table0, num_users), offset0),
      user_loss, decode, penalty=proximal)
  update = table0[None] - table
  finite = batched_lib.finite_users((update, offset))
  return batched_lib.BatchedResult(
      updates=(batched_lib.where_users(finite, update,
                                       tf.zeros_like(update)),),
      num_examples=tf.where(finite, batched_lib.user_example_counts(shard),
                            tf.constant(0, tf.int64)),
      loss_sum=tf.where(finite, loss_sum, 0.0),
      nonfinite=tf.cast(tf.logical_not(finite), tf.int32),
      metrics=collections.OrderedDict(),
      new_private=(batched_lib.where_users(finite, offset, offset0),))
