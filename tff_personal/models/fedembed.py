"""FedEmbed's model (FedEmbed paper, sections 3.1 to 3.4, Algorithm 1).

Parts, with who owns them:

* e_u, the personal embedding (private, trainable): concatenated to the input
  as a diagonal channel and to the encoder's features.
* theta, the shared feature encoder (shared).
* phi_k, K sub-population heads (shared; one `[K, features, 2]` kernel): the
  client's assigned head classifies its samples. Only the assigned head is
  used in the forward pass, so the other heads get exactly zero gradient
  ("clients maintain zero-gradients for unused model-heads"); their (zero)
  update is still part of the shared update, so DP clips and noises every
  head, as the paper says.
* nu, the global preference head (shared): sees `[stop_gradient(f), e_u]`, so
  its loss trains nu and the personal embedding but never the encoder
  (section 3.2: "the gradients from the global classification head only update
  the personal embeddings ... preventing conflicting gradients ... from
  affecting the global feature encoder"). Our reading: nu itself is learned
  ("we learn a globally shared classification head").
* gamma, the k-way type head (shared): predicts the sample's type m (its
  digit) from `[f, e_u]`: the loss L_M of Algorithm 1, line 18.
* Prototypes (shared, `[K, D_E]`, prototype assignment only): the triplet loss
  of equation 1 (with the usual hinge, margin alpha) moves e_u towards the
  prototype of its positive sub-population and away from a random other one;
  its gradient also reaches the prototypes, which is how they are "continually
  updated alongside the global model". When its local training begins, the
  client first takes `assignment_triplet_steps` gradient steps of the triplet
  loss on e_u alone (step `assignment_step_size`; the negative is the nearest
  other prototype, the hinge's hardest case), then takes as its head the
  prototype nearest to e_u (Euclidean), kept for the round: Algorithm 1 does
  the triplet step (line 10) before the assignment (line 11). Without these
  steps a new user's embedding (drawn near 0) is nearest to whichever
  prototype has the smallest norm, and at 9,000 users almost every
  participation is a first one: one head then trained on every user's
  labels. At inference the nearest prototype is recomputed, which also
  serves users who never trained.
* Private non-trainable state: `positive_index`, the sub-population the client
  identifies from its own data (the type that is most frequent among its
  positive samples: Algorithm 1 line 9, "identify e_p from D_u"); `head`, the
  head assigned for the current round; and `draws` and `salt`, which seed
  the choice of the negative prototype, so that runs are reproducible and
  resumable. `draws` counts the client's triplet steps; `salt` is set once,
  at the client's first participation, from the bits of its initial
  embedding (a per-client integer, so clients draw apart). Neither depends on
  the embedding being trained: two compilations of the same step (sharded,
  batched, an exported SavedModel) then draw the same negatives even where
  their float rounding differs.

Assignment modes: 'prototype' (above), 'type' (the head is the client's
`positive_index`: its true sub-population, FedEmbed-Type's upper bound; no
prototypes), 'personal' (each client's head is private, trainable client
state; no shared sub-population heads), 'som' (section 3.3.1: the head is the
best-matching unit of e_u in a self-organising map whose nodes are shared
non-trainable variables, `som/active` the map the heads are indexed by and
`som/nodes` the map being learned; `algorithms/fedembed_som.py` learns them)
and 'kmeans' (PFedKM's assignment: the head is the k-means centroid nearest to
the client's probe feature, `kmeans_probe_feature`; the centroids are shared
non-trainable variables that `algorithms/pfedkm.py` learns). In 'som' and
'kmeans' modes `prepare_fn` assigns the head from the client's data (and,
at inference, 'som' recomputes the best-matching unit as 'prototype' does;
'kmeans' uses the head of the client's last assignment, kept as private
state, since its probe needs labelled data).

The loss is L_C(assigned head) + L_C(nu) + L_M(gamma) [+ triplet]; each step
applies one optimizer step to shared and private parameters jointly (the
paper's separate triplet step then classification steps, merged into one
step per batch: our reading).

With K=1, no personal embedding and a single shared head, the model is the
plain encoder+head network plus a K=1 type head whose loss is identically 0:
FedEmbed then reduces to FedAvg (tested).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Optional

import tensorflow as tf

from tff_personal.core import split_model
from tff_personal.models import fedembed_mnist
from tff_personal.models import som

ASSIGNMENTS = ('prototype', 'type', 'personal', 'som', 'kmeans')


@dataclasses.dataclass(frozen=True)
class FedEmbedConfig:
  # K, the number of sub-population heads. None: the task's number of types
  # (`with_task_subpopulations`, called by the tasks' model factories); a
  # model is never built with None.
  num_subpopulations: Optional[int] = None
  embedding_dim: int = 28
  assignment: str = 'prototype'
  triplet_margin: float = 1.0
  # Prototype assignment: gradient steps of the triplet loss on e_u taken
  # before the nearest prototype is chosen (Algorithm 1, lines 10 then 11).
  assignment_triplet_steps: int = 5
  assignment_step_size: float = 0.1
  use_type_head: bool = True
  use_global_head: bool = True

  def validate(self):
    if self.assignment not in ASSIGNMENTS:
      raise ValueError(f'assignment must be one of {ASSIGNMENTS}, got '
                       f'{self.assignment!r}')
    k = self.num_subpopulations
    if k is not None and k < 1:
      raise ValueError(f'num_subpopulations must be >= 1, got {k}')
    if (self.assignment == 'som' and self.embedding_dim == 0 and
        (k is None or k > 1)):
      raise ValueError('som assignment with K > 1 needs a personal embedding '
                       '(embedding_dim > 0)')
    if self.embedding_dim < 0:
      raise ValueError(f'embedding_dim must be >= 0, got {self.embedding_dim}')
    if self.assignment == 'prototype' and self.embedding_dim == 0:
      raise ValueError(f'{self.assignment} assignment needs a personal '
                       'embedding (embedding_dim > 0)')


def needs_every_type(config: FedEmbedConfig) -> bool:
  """Whether the model indexes K-sized parts by a sample's or a client's
  type (the type head's classes; the prototype or head of the client's
  `positive_index`), so that K must cover every type."""
  return config.use_type_head or config.assignment in ('prototype', 'type')


def with_task_subpopulations(config: FedEmbedConfig, num_types: int
                             ) -> FedEmbedConfig:
  """`config` with K set for a task whose samples have `num_types` types.

  K not given (None): `num_types`, one head per type. Given: kept, more
  heads than types included (e.g. Appendix B.2's 21 heads for 20 voices);
  fewer only where no part is indexed by type (`needs_every_type`).

  Raises:
    ValueError: K is smaller than `num_types` where types index K-sized
      parts (naming both).
  """
  k = config.num_subpopulations
  if k is None:
    return dataclasses.replace(config, num_subpopulations=num_types)
  if k < num_types and needs_every_type(config):
    indexed = (['the type head\'s classes'] if config.use_type_head else []) + (
        [f'the {config.assignment} assignment\'s '
         + ('prototypes' if config.assignment == 'prototype' else 'heads')]
        if config.assignment in ('prototype', 'type') else [])
    raise ValueError(
        f'num_subpopulations={k} is smaller than the task\'s {num_types} '
        f'types, which index {" and ".join(indexed)}; give at least '
        f'{num_types} (or leave it unset for one per type)')
  return config


class SubpopulationHeads(tf.keras.layers.Layer):
  """K binary heads in one kernel; `call(z, index)` applies head `index`."""

  def __init__(self, num_heads: int, num_outputs: int = 2, **kwargs):
    super().__init__(**kwargs)
    self.num_heads = num_heads
    self.num_outputs = num_outputs

  def build(self, input_shape):
    features = int(input_shape[-1])
    self.kernel = self.add_weight(
        name='kernel', shape=(self.num_heads, features, self.num_outputs),
        initializer=tf.keras.initializers.GlorotUniform())
    self.bias = self.add_weight(name='bias',
                                shape=(self.num_heads, self.num_outputs),
                                initializer='zeros')
    super().build(input_shape)

  def call(self, z, index):
    # index: [batch] head of each example (constant within a client).
    return tf.einsum('bf,bfo->bo', z, tf.gather(self.kernel, index)) + (
        tf.gather(self.bias, index))


class ClientAssignment(tf.keras.layers.Layer):
  """Private non-trainable state: positive sub-population, head, draw seed."""

  def build(self, input_shape):
    def scalar(name):
      return self.add_weight(name=name, shape=(), dtype=tf.int32,
                             trainable=False, initializer='zeros')
    self.positive_index = scalar('positive_index')
    self.head = scalar('head')
    self.draws = scalar('draws')
    self.salt = scalar('salt')
    super().build(input_shape)

  def call(self, x):
    zeros = tf.zeros_like(tf.reshape(x, [tf.shape(x)[0], -1])[:, 0], tf.int32)
    return zeros + self.positive_index, zeros + self.head


class Prototypes(tf.keras.layers.Layer):
  """Shared prototype embeddings, one per sub-population."""

  def __init__(self, num: int, dim: int, **kwargs):
    super().__init__(**kwargs)
    self.num, self.dim = num, dim

  def build(self, input_shape):
    self.vectors = self.add_weight(
        name='vectors', shape=(self.num, self.dim),
        initializer=tf.keras.initializers.RandomUniform(-1.0, 1.0))
    super().build(input_shape)

  def nearest(self, e):
    """Index of the prototype nearest to each row of `e` (Euclidean)."""
    d = tf.reduce_sum(tf.square(e[:, None, :] - self.vectors[None]), -1)
    return tf.argmin(d, axis=-1, output_type=tf.int32)

  def call(self, e, assigned_head, training=None):
    # Training uses the head assigned when local training began (Algorithm 1
    # assigns once per client update); inference uses the nearest prototype
    # now, which also serves users who never trained.
    if training:
      return assigned_head
    return self.nearest(e)


class SomMap(tf.keras.layers.Layer):
  """Shared non-trainable SOM state (section 3.3.1), learned by the server.

  `nodes`: the map being learned; `active`: the map the sub-population heads
  are indexed by (the previous map, see `algorithms/fedembed_som.py`);
  `steps`: how many map updates the server has applied (drives the decay of
  the learning rate and of the neighbourhood).
  """

  def __init__(self, num: int, dim: int, **kwargs):
    super().__init__(**kwargs)
    self.num, self.dim = num, dim

  def build(self, input_shape):
    init = lambda: tf.keras.initializers.RandomUniform(-1.0, 1.0)
    self.nodes = self.add_weight(name='nodes', shape=(self.num, self.dim),
                                 initializer=init(), trainable=False)
    self.active = self.add_weight(name='active', shape=(self.num, self.dim),
                                  initializer=init(), trainable=False)
    self.steps = self.add_weight(name='steps', shape=(), initializer='zeros',
                                 trainable=False)
    super().build(input_shape)

  def call(self, e, assigned_head, training=None):
    if training:
      return assigned_head
    return som.best_matching_units(self.active, e)


class KMeansCentroids(tf.keras.layers.Layer):
  """Shared non-trainable k-means state (PFedKM), learned by the server.

  `centroids` [K, P] in the space of probe features and `counts` [K], the
  running weight of each centroid (TFF's `build_fed_kmeans` keeps the same
  pair, starting from a pseudo-count of 1).
  """

  def __init__(self, num: int, dim: int, **kwargs):
    super().__init__(**kwargs)
    self.num, self.dim = num, dim

  def build(self, input_shape):
    normal = tf.keras.initializers.RandomNormal()
    # TFF's build_fed_kmeans draws centroids from N(0, 1); probes have unit
    # norm, so the draws are scaled to unit norm too: with N(0, 1) centroids
    # (norm ~ sqrt(dim)) the norm differences, not the directions, decide
    # the nearest centroid and one centroid takes every client.
    self.centroids = self.add_weight(
        name='centroids', shape=(self.num, self.dim), trainable=False,
        initializer=lambda shape, dtype=None: tf.math.l2_normalize(
            normal(shape, dtype), axis=-1))
    self.counts = self.add_weight(name='counts', shape=(self.num,),
                                  initializer='ones', trainable=False)
    super().build(input_shape)

  def nearest(self, point):
    """Index of the centroid nearest to `point` [P] (TFF's formula)."""
    d = tf.reduce_sum(tf.square(self.centroids - point[tf.newaxis]), axis=1)
    return tf.argmin(d, axis=0, output_type=tf.int32)

  def call(self, assigned_head):
    return assigned_head


def kmeans_probe_feature(model: split_model.SplitModel,
                         dataset: tf.data.Dataset) -> tf.Tensor:
  """PFedKM's probe: the client's normalised gradient of the mean head.

  The gradient over the client's whole dataset of the mean cross-entropy of
  the *mean* sub-population head `(mean_k W_k, mean_k b_k)` applied to the
  encoder features z, flattened and scaled to unit L2 norm. In closed form
  (softmax cross-entropy): `dW = z^T (p - onehot(y)) / n`,
  `db = sum(p - onehot(y)) / n`. Users of one sub-population label the same
  inputs alike, so their probes point the same way; this is the "k-means
  clustering over user gradients" of FedEmbed's description of PFedKM, on the
  part of the update that carries the preference (our reading).

  Args:
    model: a FedEmbed split model in 'kmeans' mode, weights loaded.
    dataset: the client's batches (with `x`, `y`).

  Returns:
    float32 [features * 2 + 2], unit norm (zero for an empty dataset).
  """
  heads = model.model.get_layer('heads')
  kernel = tf.reduce_mean(heads.kernel, axis=0)
  bias = tf.reduce_mean(heads.bias, axis=0)
  zeros = (tf.zeros_like(kernel), tf.zeros_like(bias), tf.constant(0.0))

  def reduce_fn(acc, batch):
    z = model.forward(batch, training=False)['features']
    p = tf.nn.softmax(tf.matmul(z, kernel) + bias)
    r = p - tf.one_hot(batch['y'], int(bias.shape[0]))
    n = tf.cast(tf.shape(z)[0], tf.float32)
    return (acc[0] + tf.matmul(z, r, transpose_a=True),
            acc[1] + tf.reduce_sum(r, axis=0), acc[2] + n)

  d_kernel, d_bias, n = dataset.reduce(zeros, reduce_fn)
  flat = tf.concat([tf.reshape(d_kernel, [-1]), d_bias], axis=0) / tf.maximum(
      n, 1.0)
  return tf.math.divide_no_nan(flat, tf.norm(flat))


def kmeans_probe_dim(feature_dim: int, num_outputs: int = 2) -> int:
  return feature_dim * num_outputs + num_outputs


def triplet_steps(e: tf.Tensor, prototypes: tf.Tensor, positive: tf.Tensor,
                  margin: float, steps: int, step_size: float) -> tf.Tensor:
  """`steps` gradient steps of equation 1's hinge on `e` alone.

  The negative of each step is the prototype nearest to `e` other than the
  positive one; while the hinge is active its gradient with respect to `e` is
  2 (n - p), so a step moves `e` by 2 * step_size * (p - n).
  """
  p = tf.gather(prototypes, positive)
  is_positive = tf.one_hot(positive, tf.shape(prototypes)[0], on_value=True,
                           off_value=False)
  for _ in range(steps):
    d = tf.reduce_sum(tf.square(e[None] - prototypes), -1)
    n = tf.gather(prototypes, tf.argmin(
        tf.where(is_positive, tf.fill(tf.shape(d), float('inf')), d)))
    active = (tf.reduce_sum(tf.square(e - p)) - tf.reduce_sum(
        tf.square(e - n)) + margin) > 0
    e = tf.where(active, e - step_size * 2.0 * (n - p), e)
  return e


def identify_positive_subpopulation(dataset: tf.data.Dataset,
                                    num_subpopulations: int) -> tf.Tensor:
  """The type most frequent among the client's positive samples (0 if none)."""
  counts = dataset.reduce(
      tf.zeros([num_subpopulations], tf.int32),
      lambda acc, b: acc + tf.math.bincount(
          tf.cast(b['type'], tf.int32), weights=tf.cast(b['y'], tf.int32),
          minlength=num_subpopulations, maxlength=num_subpopulations,
          dtype=tf.int32))
  return tf.cast(tf.argmax(counts), tf.int32)


def build_fedembed_model(
    config: FedEmbedConfig,
    *,
    encoder_fn: Callable[[int], tf.keras.Model] = (
        lambda channels: fedembed_mnist.build_encoder(channels=channels)),
    input_shape=fedembed_mnist.IMAGE_SHAPE,
    input_spec=None) -> split_model.SplitModel:
  """Builds FedEmbed's split model.

  Args:
    config: the FedEmbed configuration.
    encoder_fn: `channels -> Keras encoder` (MNIST's by default; the input gets
      one extra channel when there is a personal embedding, which must then
      have the image's height as its size).
    input_shape: one example's shape.
    input_spec: element spec of client datasets (with `x`, `y`, `type`).

  Returns:
    A `SplitModel` whose forward pass returns a dict of `logits` (the assigned
    head's), `global_logits` (nu), `type_logits` (gamma) and `head` (the
    assigned head index).
  """
  config.validate()
  if config.num_subpopulations is None:
    raise ValueError(
        'FedEmbedConfig.num_subpopulations is None (the task\'s number of '
        'types): a task\'s fedembed_model_fn_factory sets it '
        '(with_task_subpopulations); give it to build a model directly')
  k, dim = config.num_subpopulations, config.embedding_dim
  x = tf.keras.Input(shape=input_shape, name='x')
  assignment = ClientAssignment(name='assignment')
  positive, assigned_head = assignment(x)
  private = []
  if dim:
    personal = fedembed_mnist.PersonalEmbedding(
        dim, initializer=tf.keras.initializers.RandomUniform(-1.0, 1.0),
        name='personal')
    e = personal(x)
    # diag(e) on the first dim x dim block of an H x W channel: square for
    # MNIST (28 x 28), 200 x 375 for spectrograms (Appendix B.2).
    image = tf.keras.layers.Concatenate(axis=-1)(
        [x, tf.linalg.diag(e, num_rows=input_shape[0],
                           num_cols=input_shape[1])[..., tf.newaxis]])
    f = encoder_fn(input_shape[-1] + 1)(image)
    z = tf.keras.layers.Concatenate()([f, e])
    private.append(personal.embedding)
  else:
    f = encoder_fn(input_shape[-1])(x)
    z = f
  outputs = {}
  prototypes = som_map = centroids = None
  if config.assignment == 'prototype':
    prototypes = Prototypes(k, dim, name='prototypes')
    head = prototypes(e, assigned_head)
  elif config.assignment == 'som':
    # Without an embedding (dim 0) every user maps to node 0: the degenerate
    # case that reduces to FedAvg for K=1.
    som_map = SomMap(k, dim, name='som')
    head = som_map(e if dim else tf.zeros_like(f[:, :0]), assigned_head)
  elif config.assignment == 'kmeans':
    centroids = KMeansCentroids(
        k, kmeans_probe_dim(int(z.shape[-1])), name='kmeans')
    head = centroids(assigned_head)
  else:
    head = positive
  if config.assignment == 'personal':
    personal_head = tf.keras.layers.Dense(2, name='personal_head')
    outputs['logits'] = personal_head(z)
    private.extend(personal_head.weights)
  else:
    outputs['logits'] = SubpopulationHeads(k, name='heads')(z, head)
  if config.use_global_head and dim:
    outputs['global_logits'] = tf.keras.layers.Dense(2, name='global_head')(
        tf.keras.layers.Concatenate()([tf.stop_gradient(f), e]))
  if config.use_type_head:
    outputs['type_logits'] = tf.keras.layers.Dense(k, name='type_head')(z)
  outputs['head'] = head
  outputs['positive'] = positive  # the sub-population the client identified
  outputs['features'] = z  # what the heads see (PFedKM's probe reads it)
  model = tf.keras.Model(x, outputs)
  private.extend([assignment.positive_index, assignment.head,
                  assignment.draws, assignment.salt])

  ce = tf.keras.losses.sparse_categorical_crossentropy

  def loss_fn(batch, out):
    loss = tf.reduce_mean(ce(batch['y'], out['logits'], from_logits=True))
    if 'global_logits' in out:
      loss += tf.reduce_mean(
          ce(batch['y'], out['global_logits'], from_logits=True))
    if 'type_logits' in out:
      loss += tf.reduce_mean(ce(batch['type'], out['type_logits'],
                                from_logits=True))
    if prototypes is not None and k > 1:
      p = assignment.positive_index
      seed = tf.stack([assignment.draws, assignment.salt])
      offset = tf.random.stateless_uniform([], seed, minval=1, maxval=k,
                                           dtype=tf.int32)
      n = tf.math.floormod(p + offset, k)
      assignment.draws.assign_add(1)
      e_u = personal.embedding
      d_pos = tf.reduce_sum(tf.square(e_u - tf.gather(prototypes.vectors, p)))
      d_neg = tf.reduce_sum(tf.square(e_u - tf.gather(prototypes.vectors, n)))
      loss += tf.nn.relu(d_pos - d_neg + config.triplet_margin)
    return loss

  def prepare_fn(dataset):
    # Runs on the client before local training (and before cold-start
    # fine-tuning), with its weights loaded.
    assignment.positive_index.assign(identify_positive_subpopulation(
        dataset, k))
    if prototypes is not None:
      # The first participation fixes the salt (odd, so never 0 again) from
      # the embedding as the initial-state function made it.
      assignment.salt.assign(tf.where(
          tf.equal(assignment.salt, 0),
          tf.bitwise.bitwise_or(tf.bitcast(personal.embedding[0], tf.int32),
                                1),
          assignment.salt))
      if k > 1 and config.assignment_triplet_steps:
        personal.embedding.assign(triplet_steps(
            personal.embedding, prototypes.vectors,
            assignment.positive_index, config.triplet_margin,
            config.assignment_triplet_steps, config.assignment_step_size))
      assignment.head.assign(prototypes.nearest(personal.embedding[None])[0])
    elif som_map is not None:
      assignment.head.assign(som.best_matching_unit(
          som_map.active, personal.embedding if dim else tf.zeros([0])))
    elif centroids is not None:
      assignment.head.assign(
          centroids.nearest(kmeans_probe_feature(result, dataset)))
    else:
      assignment.head.assign(assignment.positive_index)

  model.fedembed_config = config  # What batched training reads.
  result = split_model.SplitModel(
      model=model, private_variables=private, loss_fn=loss_fn,
      input_spec=input_spec, predict_fn=lambda out: out['logits'],
      prepare_fn=prepare_fn,
      embedding_variables=[personal.embedding] if dim else [])
  return result
