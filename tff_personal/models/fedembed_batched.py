"""FedEmbed's local training for a shard's users at once (batched form).

`batched_local_train` is `split_training.local_train` on FedEmbed's model
(`models/fedembed.py`, the `prototype` and `type` assignments, with a
personal embedding) for every user of a packed shard together: the shared
weights are stacked along a user axis, each step is one computation over
every user (the encoder through `core/batched.BatchedLayers`, each user's
assigned head gathered from its own copy of the K heads), and each user's
personal embedding, assignment and draw counter ride along stacked. The
model's `prepare_fn` (the positive sub-population, the salt, the triplet
steps on the embedding, the nearest prototype) is computed for every user
from the shard, before the steps. Each user's result equals `local_train`
alone, up to float rounding of the batched ops.

Written by hand (as `core/batched.py`): the model's layers are applied
with per-user weights, which Keras and TFF have no form of.

Example (what `algorithms/fedembed.py` declares as its step's batched
trainer):

  model = model_fn()
  out = batched_local_train(model, optimizer, weights, private, shard,
                            metrics_fn)
  out.updates, out.new_private   # per user, stacked
"""

from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf
import tensorflow_federated as tff

from tff_personal.core import batched as batched_lib
from tff_personal.core import shard_packing
from tff_personal.core import split_model as split_model_lib
from tff_personal.models import fedembed

ASSIGNMENTS = ('prototype', 'type')


class _Parts:
  """Where each part of FedEmbed's model sits among its variables."""

  def __init__(self, model: split_model_lib.SplitModel):
    config = getattr(model.model, 'fedembed_config', None)
    if not isinstance(config, fedembed.FedEmbedConfig):
      raise ValueError('batched FedEmbed needs a model built by '
                       'fedembed.build_fedembed_model')
    self.config = config
    if config.assignment not in ASSIGNMENTS:
      raise ValueError('batched FedEmbed covers the assignments '
                       f'{ASSIGNMENTS}, not {config.assignment!r}')
    if not config.embedding_dim:
      raise ValueError('batched FedEmbed needs a personal embedding '
                       '(embedding_dim > 0)')
    if model.private_noise is not None:
      raise ValueError('batched FedEmbed does not cover private noise')
    keras = model.model
    get = keras.get_layer
    shared = model.shared_trainable_variables
    index = {v.ref(): i for i, v in enumerate(shared)}
    encoders = [l for l in keras.layers if isinstance(l, tf.keras.Model)]
    if len(encoders) != 1:
      raise ValueError('batched FedEmbed needs the encoder as one nested '
                       f'model; the model has {len(encoders)}')
    self.encoder = batched_lib.BatchedLayers(encoders[0], shared)
    self.image_shape = tuple(encoders[0].input_shape[1:])
    heads = get('heads')
    self.heads = (index[heads.kernel.ref()], index[heads.bias.ref()])
    self.k, self.num_outputs = heads.num_heads, heads.num_outputs
    self.prototypes = None
    if config.assignment == 'prototype':
      self.prototypes = index[get('prototypes').vectors.ref()]
    dense = lambda name: tuple(index[v.ref()] for v in get(name).weights)
    self.global_head = dense('global_head') if (
        config.use_global_head) else None
    self.type_head = dense('type_head') if config.use_type_head else None
    used = set(self.encoder.used) | set(self.heads) | set(
        self.global_head or ()) | set(self.type_head or ())
    if self.prototypes is not None:
      used.add(self.prototypes)
    if used != set(range(len(shared))):
      raise ValueError('the FedEmbed model has shared variables the batched '
                       'form does not know')
    assignment = get('assignment')
    private = [v.ref() for v in model.private_variables]
    expected = [get('personal').embedding.ref(),
                assignment.positive_index.ref(), assignment.head.ref(),
                assignment.draws.ref(), assignment.salt.ref()]
    if private != expected:
      raise ValueError('batched FedEmbed needs the private state (personal '
                       'embedding, positive index, head, draws, salt)')


def check_model(model: split_model_lib.SplitModel) -> None:
  """Raises ValueError naming what the batched form does not cover."""
  _Parts(model)


def _dense(w, h, slots):
  kernel, bias = (w[i] for i in slots)
  return batched_lib.client_matmul(h, kernel) + bias[:, None, :]


def _prepare(parts, weights, embedding, private, shard, decode):
  """`prepare_fn` for every user: (positive, head, salt, embedding)."""
  config, k = parts.config, parts.k
  _, _, _, _, salt = private
  num_batches = shard[shard_packing.SHARD_NUM_BATCHES]
  indices = shard[shard_packing.SHARD_INDICES]
  sizes = shard[shard_packing.SHARD_BATCH_SIZES]
  steps, width = tf.shape(indices)[1], tf.shape(indices)[2]
  num_users = tf.shape(num_batches)[0]
  every = tf.reshape(indices, [num_users, -1])
  batch = decode(tf.nest.map_structure(
      lambda t: tf.reshape(tf.gather(t, every, batch_dims=1),
                           tf.concat([[-1], tf.shape(t)[2:]], 0)),
      shard[shard_packing.SHARD_EXAMPLES]))
  real = tf.logical_and(
      tf.range(steps)[None, :, None] < num_batches[:, None, None],
      tf.range(width)[None, None, :] < sizes[:, :, None])
  weight = tf.reshape(tf.cast(real, tf.int32), [-1]) * tf.cast(
      batch['y'], tf.int32)
  counts = tf.reduce_sum(tf.reshape(
      tf.one_hot(tf.cast(batch['type'], tf.int32), k, dtype=tf.int32) *
      weight[:, None], [num_users, -1, k]), 1)
  positive = tf.argmax(counts, 1, output_type=tf.int32)
  if parts.prototypes is None:
    return positive, positive, salt, embedding
  salt = tf.where(tf.equal(salt, 0), tf.bitwise.bitwise_or(
      tf.bitcast(embedding[:, 0], tf.int32), 1), salt)
  prototypes = weights[parts.prototypes]  # [users, K, d], the broadcast ones
  e = embedding
  if k > 1 and config.assignment_triplet_steps:
    # `fedembed.triplet_steps` per user.
    p = tf.gather(prototypes, positive, batch_dims=1)
    is_positive = tf.one_hot(positive, k, on_value=True, off_value=False)
    for _ in range(config.assignment_triplet_steps):
      d = tf.reduce_sum(tf.square(e[:, None] - prototypes), -1)
      n = tf.gather(prototypes, tf.argmin(
          tf.where(is_positive, tf.fill(tf.shape(d), float('inf')), d), 1,
          output_type=tf.int32), batch_dims=1)
      active = (tf.reduce_sum(tf.square(e - p), -1) - tf.reduce_sum(
          tf.square(e - n), -1) + config.triplet_margin) > 0
      e = tf.where(active[:, None],
                   e - config.assignment_step_size * 2.0 * (n - p), e)
  head = tf.argmin(tf.reduce_sum(tf.square(e[:, None] - prototypes), -1), 1,
                   output_type=tf.int32)
  return positive, head, salt, e


def batched_local_train(model: split_model_lib.SplitModel,
                        optimizer: tff.learning.optimizers.Optimizer,
                        initial_weights, private: tuple[Any, ...], shard,
                        metrics_fn=None,
                        decode: Callable[[Any], Any] | None = None
                        ) -> batched_lib.BatchedResult:
  """`split_training.local_train` of FedEmbed for a shard's users at once.

  Args:
    model: FedEmbed's model (`fedembed.build_fedembed_model`, whose
      configuration it reads), built once per trace; `check_model` says
      what is covered.
    optimizer: an element-wise TFF optimizer over the shared and the
      private trainable variables together.
    initial_weights: the broadcast `ModelWeights`.
    private: the stacked private states, in the model's order (personal
      embedding [users, d], positive index, head, draws, salt [users]).
    shard: one packed shard (`core/shard_packing.pack_datasets`).
    metrics_fn: optional per-batch metric sums on the predictions.
    decode: the task's wire decoding of a batch, if any.

  Returns:
    A `core/batched.BatchedResult` with each user's new private state.
  """
  parts = _Parts(model)
  config = parts.config
  decode = decode or (lambda b: b)
  num_batches = shard[shard_packing.SHARD_NUM_BATCHES]
  num_users = tf.shape(num_batches)[0]
  width = tf.shape(shard[shard_packing.SHARD_INDICES])[2]
  shared0 = tuple(batched_lib.stack_users(w, num_users)
                  for w in initial_weights.trainable)
  embedding0, _, _, draws0, _ = private
  positive, head, salt, embedding = _prepare(
      parts, shared0, embedding0, private, shard, decode)
  k = parts.k
  rows, cols = parts.image_shape[0], parts.image_shape[1]

  def forward(weights, x):
    *w, e = weights
    x = tf.reshape(x, tf.concat([[num_users, width], tf.shape(x)[1:]], 0))
    diag = tf.linalg.diag(e, num_rows=rows, num_cols=cols)[:, None, ..., None]
    image = tf.concat([x, tf.broadcast_to(
        diag, tf.concat([tf.shape(x)[:-1], [1]], 0))], -1)
    f = parts.encoder.apply(w, image)
    e_rows = tf.broadcast_to(e[:, None, :], tf.concat(
        [tf.shape(f)[:2], tf.shape(e)[1:]], 0))
    z = tf.concat([f, e_rows], -1)
    kernel, bias = (tf.gather(w[i], head, batch_dims=1) for i in parts.heads)
    out = {'logits': batched_lib.client_matmul(z, kernel) + bias[:, None, :]}
    if parts.global_head:
      out['global_logits'] = _dense(
          w, tf.concat([tf.stop_gradient(f), e_rows], -1), parts.global_head)
    if parts.type_head:
      out['type_logits'] = _dense(w, z, parts.type_head)
    return out

  def user_loss(weights, batch, real, step):
    out = forward(weights, batch['x'])
    ce = lambda labels, logits: tf.reshape(
        tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=tf.reshape(labels, [num_users, -1]), logits=logits),
        [num_users, -1])
    mean = lambda t: tf.reduce_sum(t * real, 1) / tf.maximum(
        tf.reduce_sum(real, 1), 1.0)
    loss = mean(ce(batch['y'], out['logits']))
    if 'global_logits' in out:
      loss += mean(ce(batch['y'], out['global_logits']))
    if 'type_logits' in out:
      loss += mean(ce(batch['type'], out['type_logits']))
    if parts.prototypes is not None and k > 1:
      # The model's random negative: a draw per loss call, seeded by the
      # user's draw count and salt.
      seeds = tf.stack([draws0 + step, salt], 1)
      offset = tf.vectorized_map(lambda seed: tf.random.stateless_uniform(
          [], seed, minval=1, maxval=k, dtype=tf.int32), seeds)
      negative = tf.math.floormod(positive + offset, k)
      prototypes, e = weights[parts.prototypes], weights[-1]
      distance = lambda i: tf.reduce_sum(tf.square(
          e - tf.gather(prototypes, i, batch_dims=1)), -1)
      loss += tf.nn.relu(distance(positive) - distance(negative) +
                         config.triplet_margin)
    return loss, out

  predictions = lambda batch: tf.zeros(
      [tf.shape(batch['y'])[0], parts.num_outputs], tf.float32)
  flat = lambda t: tf.reshape(t, tf.concat([[-1], tf.shape(t)[2:]], 0))
  final, loss_sum, sums = batched_lib.train_steps(
      shard, optimizer, shared0 + (embedding,), user_loss, decode,
      batched_lib.metric_accumulator(
          metrics_fn, lambda out: model.predict(
              {'logits': flat(out['logits'])})),
      batched_lib.metric_zeros(metrics_fn, shard, decode, predictions))
  *shared, new_embedding = final
  updates = tuple(w0 - w for w0, w in zip(shared0, shared))
  finite = batched_lib.finite_users(updates + (new_embedding,))
  draws = draws0 + num_batches if (
      parts.prototypes is not None and k > 1) else draws0  # A draw a step.
  new_private = (new_embedding, positive, head, draws, salt)
  return batched_lib.BatchedResult(
      updates=batched_lib.where_users(
          finite, updates, tuple(tf.zeros_like(u) for u in updates)),
      num_examples=tf.where(finite, batched_lib.user_example_counts(shard),
                            tf.constant(0, tf.int64)),
      loss_sum=tf.where(finite, loss_sum, 0.0),
      nonfinite=tf.cast(tf.logical_not(finite), tf.int32),
      metrics=sums,
      new_private=batched_lib.where_users(
          finite, new_private, tuple(private)))
