"""Batched local training: a cohort's clients trained together.

The sharded simulation (`core/sharded.py`) runs a shard's users one after
another, each with its own small steps (about 20 examples in batches of 10),
so every op is tiny and its fixed cost dominates. Here a shard's users train
*together*: their weights are stacked along a leading client axis, and each
local step is one computation over all of them, every layer batched over the
client axis by hand (a dense layer is a batched matmul with per-client
kernels; a convolution is `tf.image.extract_patches` followed by a batched
matmul with per-client filters). Ragged users are padded to the longest and
masked: a user's padded examples carry no loss, and once its batches are
done its weights and optimizer slots stop changing, so each user's result
is what it would have been alone (up to float rounding of the batched ops).

Written by hand: TFF, Keras and `tf.vectorized_map` have no batched form of
a model with per-client weights (under `vectorized_map` a convolution whose
filter differs per client, and its filter gradient, fall back to a loop).

What it covers (anything else is refused with the layer's or the model's
name): Keras models whose layers form a chain (nested `Sequential` or
functional chains included) of `Dense`, `Conv2D` (channels-last, no
dilation or groups), `ZeroPadding2D`, `LayerNormalization`, `Activation`,
`ReLU`, `Flatten`, `MaxPooling2D`, `Dropout` at rate 0, `Embedding`
(without `mask_zero`) and an LSTM (`RNN(LSTMCell)` or `LSTM`, returning
sequences, without dropout); private variables only if trainable (a
FedPer head, an LG-FedAvg body; they ride along stacked), no shared
non-trainable variables, no private noise and no `prepare_fn`; a loss
that is the mean over a batch of a per-example loss (the client step's
loss is applied to one example at a time), or one the model states as
pooled per-example terms (`SplitModel.loss_terms_fn`, e.g. a language
model's token-weighted loss); an element-wise
`tff.learning.optimizers.Optimizer` (SGD, Adam, ...). A client step may
instead declare a batched form of its own (`BATCHED_TRAINER`; FedPerC's
embedding variant, FedEmbed and Ditto do), which `shard_loop` runs in
place of `batched_local_train`; the masked step loop
every trainer shares is `train_steps`.

Example:
  model = model_fn()                       # a SplitModel, e.g. `global`'s
  batched = BatchedModel(model)
  out = batched_local_train(batched, optimizer, weights.trainable, shard)
  out.updates       # per user, stacked: initial weights - final weights
  out.num_examples  # per user
"""

from __future__ import annotations

import collections
from typing import Any, Callable, NamedTuple, Optional, Sequence

import tensorflow as tf
import tensorflow_federated as tff

from tff_personal.core import process as process_lib
from tff_personal.core import shard_packing
from tff_personal.core import split_model as split_model_lib

# Layers applied per example whatever the client (no weights).
_PER_EXAMPLE = (tf.keras.layers.ZeroPadding2D, tf.keras.layers.MaxPooling2D)


def _chain(layer: tf.keras.layers.Layer) -> list[tf.keras.layers.Layer]:
  """The leaf layers of `layer` in order (nested models flattened)."""
  if not isinstance(layer, tf.keras.Model):
    return [layer]
  return [leaf for inner in layer.layers
          if not isinstance(inner, tf.keras.layers.InputLayer)
          for leaf in _chain(inner)]


def _check_chain(layers):
  """Each layer takes one input, the previous layer's output shape."""
  for before, after in zip(layers[:-1], layers[1:]):
    try:
      chained = not isinstance(after.input_shape, list) and (
          tuple(before.output_shape) == tuple(after.input_shape))
    except AttributeError:  # A layer used more than once.
      chained = False
    if not chained:
      raise ValueError(
          f'batched training needs a chain of layers; {after.name!r} does '
          f'not take {before.name!r}\'s output alone')


class BatchedModel:
  """A `SplitModel`'s Keras model, applied with per-client weights.

  `apply(weights, x)` takes each trainable variable's values stacked along
  a leading client axis (`[clients, *variable.shape]`, in `variables`
  order: the shared trainable variables, then the private ones) and inputs
  `[clients, batch, ...]`, and returns the model's outputs `[clients,
  batch, ...]`, client c's computed with client c's weights.

  Raises:
    ValueError: naming the first thing the batched form does not cover (see
      the module docstring).
  """

  def __init__(self, model: split_model_lib.SplitModel):
    fixed = [v.name for v in model.private_variables if not v.trainable]
    if fixed:
      raise ValueError('batched training does not cover non-trainable '
                       f'private variables ({", ".join(fixed)})')
    if model.private_noise is not None:
      raise ValueError('batched training does not cover private noise')
    if list(model.shared_non_trainable_variables):
      raise ValueError('batched training does not cover non-trainable '
                       'variables; the model has '
                       f'{len(model.shared_non_trainable_variables)}')
    if model.prepare_fn is not None:
      raise ValueError('batched training does not cover a model with a '
                       'prepare_fn')
    if type(model).forward is not split_model_lib.SplitModel.forward:
      raise ValueError('batched training does not cover a model with its own '
                       f'forward ({type(model).__name__})')
    if model.model.losses:
      raise ValueError('batched training does not cover models with added '
                       'losses (regularizers)')
    self.model = model
    self.variables = (list(model.shared_trainable_variables) +
                      list(model.private_variables))
    self._chain = BatchedLayers(model.model, self.variables)
    if self._chain.used != list(range(len(self.variables))):
      raise ValueError('the model has trainable variables outside its chain '
                       'of layers')

  def apply(self, weights: Sequence[tf.Tensor], x: tf.Tensor) -> tf.Tensor:
    return self._chain.apply(weights, x)


class BatchedLayers:
  """A chain of Keras layers (a layer, or a model of a chain of them)
  applied with per-client weights: the building block of `BatchedModel`,
  and of a client step's own batched form whose model holds such a chain
  (FedEmbed's encoder).

  `apply(weights, x)`: `weights` stacked per variable of `variables`
  ([clients, ...] each; the chain reads its own), x [clients, batch, ...].

  Raises:
    ValueError: naming the first layer the batched form does not cover, or
      a weight of the chain that is not in `variables`.
  """

  def __init__(self, root: tf.keras.layers.Layer,
               variables: Sequence[tf.Variable]):
    self.layers = _chain(root)
    for layer in self.layers:
      _check_layer(layer)
    _check_chain(self.layers)
    index = {v.ref(): i for i, v in enumerate(variables)}
    self._slots = []
    for layer in self.layers:
      try:
        self._slots.append([index[v.ref()] for v in layer.trainable_weights])
      except KeyError:
        raise ValueError(f'layer {layer.name!r} has a weight that is not a '
                         'trainable variable of the model') from None
    # The indices into `variables` the chain reads, sorted.
    self.used = sorted(i for slots in self._slots for i in slots)

  def apply(self, weights: Sequence[tf.Tensor], x: tf.Tensor) -> tf.Tensor:
    h = x
    for layer, slots in zip(self.layers, self._slots):
      h = _apply_layer(layer, [weights[i] for i in slots], h)
    return h


def _check_layer(layer):
  supported = (tf.keras.layers.Dense, tf.keras.layers.Conv2D,
               tf.keras.layers.LayerNormalization, tf.keras.layers.Activation,
               tf.keras.layers.ReLU, tf.keras.layers.Flatten,
               tf.keras.layers.Dropout, tf.keras.layers.Embedding,
               tf.keras.layers.RNN, tf.keras.layers.LSTM) + _PER_EXAMPLE
  if type(layer) not in supported:  # pylint: disable=unidiomatic-typecheck
    raise ValueError(f'batched training does not cover layer {layer.name!r} '
                     f'({type(layer).__name__})')
  if isinstance(layer, tf.keras.layers.Embedding) and layer.mask_zero:
    raise ValueError(f'batched training does not cover masking embeddings '
                     f'({layer.name!r} has mask_zero)')
  if isinstance(layer, tf.keras.layers.RNN):
    cell = layer.cell
    lstm_cell = type(cell) is tf.keras.layers.LSTMCell  # pylint: disable=unidiomatic-typecheck
    if (not lstm_cell or
        not layer.return_sequences or layer.return_state or
        layer.go_backwards or layer.stateful or not cell.use_bias or
        cell.dropout or cell.recurrent_dropout):
      raise ValueError(
          f'batched training covers an RNN of one LSTMCell with bias, '
          f'return_sequences and no dropout, state or reversal; '
          f'{layer.name!r} is not')
  if isinstance(layer, tf.keras.layers.Dropout) and layer.rate != 0:
    raise ValueError(f'batched training does not cover dropout ({layer.name!r}'
                     f' has rate {layer.rate})')
  if isinstance(layer, tf.keras.layers.Conv2D) and (
      layer.data_format != 'channels_last' or
      tuple(layer.dilation_rate) != (1, 1) or layer.groups != 1 or
      layer.padding not in ('valid', 'same')):
    raise ValueError(f'batched training covers channels-last Conv2D without '
                     f'dilation or groups; {layer.name!r} is not')
  if isinstance(layer, _PER_EXAMPLE) and getattr(
      layer, 'data_format', 'channels_last') != 'channels_last':
    raise ValueError(f'{layer.name!r}: batched training needs channels-last')


def _per_example(fn: Callable[[tf.Tensor], tf.Tensor], h: tf.Tensor):
  """`fn` on `h` [clients, batch, ...] with the two axes merged."""
  shape = tf.shape(h)
  out = fn(tf.reshape(h, tf.concat([[-1], shape[2:]], 0)))
  return tf.reshape(out, tf.concat([shape[:2], tf.shape(out)[1:]], 0))


def client_matmul(h: tf.Tensor, kernel: tf.Tensor) -> tf.Tensor:
  """h [clients, ..., i] times each client's kernel [clients, i, o].

  One batched `tf.matmul` over [clients, rows, i], whose gradients are two
  batched matmuls (`tf.einsum`'s kernel gradient transposes `h` first;
  docs/performance.md has the profile).
  """
  shape = tf.shape(h)
  rows = tf.reshape(h, tf.stack([shape[0], -1, shape[-1]]))
  out = tf.reshape(tf.matmul(rows, kernel),
                   tf.concat([shape[:-1], tf.shape(kernel)[-1:]], 0))
  out.set_shape(h.shape[:-1].concatenate(kernel.shape[-1:]))
  return out


def _apply_layer(layer, w, h):
  """One layer on [clients, batch, ...] with weights [clients, ...]."""
  if isinstance(layer, tf.keras.layers.Dense):
    h = client_matmul(h, w[0])
    if layer.use_bias:
      h += tf.reshape(w[1], [tf.shape(w[1])[0], 1] + [1] * (
          h.shape.rank - 3) + [w[1].shape[-1]])
    return layer.activation(h)
  if isinstance(layer, tf.keras.layers.Conv2D):
    kh, kw = layer.kernel_size
    sh, sw = layer.strides
    if layer.padding == 'valid' and (kh, kw) == tuple(h.shape[2:4]):
      # The kernel covers the whole input: one patch, the input itself.
      patches = tf.reshape(h, tf.concat([tf.shape(h)[:2], [1, 1, -1]], 0))
    else:
      patches = _per_example(lambda t: tf.image.extract_patches(
          t, sizes=[1, kh, kw, 1], strides=[1, sh, sw, 1],
          rates=[1, 1, 1, 1], padding=layer.padding.upper()), h)
    # Patches hold (row, column, channel) in the kernel's order.
    kernel = tf.reshape(w[0], [tf.shape(w[0])[0], -1, w[0].shape[-1]])
    h = client_matmul(patches, kernel)
    if layer.use_bias:
      h += w[1][:, None, None, None, :]
    return layer.activation(h)
  if isinstance(layer, tf.keras.layers.LayerNormalization):
    rank = h.shape.rank - 1  # An example's rank, its batch axis included.
    axes = [a % rank for a in layer.axis]
    stacked_axes = [a + 1 for a in axes]
    mean, variance = tf.nn.moments(h, stacked_axes, keepdims=True)
    h = (h - mean) * tf.math.rsqrt(variance + layer.epsilon)
    shape = [-1, 1] + [h.shape[a + 1] if a in axes else 1
                       for a in range(1, rank)]
    i = 0
    if layer.scale:
      h *= tf.reshape(w[i], shape)
      i += 1
    if layer.center:
      h += tf.reshape(w[i], shape)
    return h
  if isinstance(layer, tf.keras.layers.Embedding):
    return tf.gather(w[0], h, batch_dims=1)
  if isinstance(layer, tf.keras.layers.RNN):
    return _lstm(layer.cell, w, h)
  if isinstance(layer, tf.keras.layers.Flatten):
    shape = tf.shape(h)
    return tf.reshape(h, tf.concat([shape[:2], [-1]], 0))
  if isinstance(layer, tf.keras.layers.Dropout):
    return h
  if isinstance(layer, _PER_EXAMPLE + (tf.keras.layers.Activation,
                                       tf.keras.layers.ReLU)):
    return _per_example(layer, h) if isinstance(layer, _PER_EXAMPLE) else (
        layer(h))
  raise AssertionError(type(layer))


def _lstm(cell: tf.keras.layers.LSTMCell, w, h):
  """An LSTM over h [clients, batch, time, in] with per-client weights.

  `LSTMCell`'s math (its `implementation=2`: gates i, f, c, o from one
  product), the input product for every time step in one batched matmul,
  then one scan over time; returns every step's output [clients, batch,
  time, units].
  """
  kernel, recurrent, bias = w
  units = cell.units
  inputs = client_matmul(h, kernel) + bias[:, None, None, :]
  steps = tf.transpose(inputs, [2, 0, 1, 3])  # [time, clients, batch, 4u]
  zeros = tf.zeros_like(steps[0][..., :units])
  gate, act = cell.recurrent_activation, cell.activation

  def step(carry, x):
    h_prev, c_prev = carry
    z = x + tf.matmul(h_prev, recurrent)
    i, f, c, o = tf.split(z, 4, axis=-1)
    c = gate(f) * c_prev + gate(i) * act(c)
    return gate(o) * act(c), c

  outputs, _ = tf.scan(step, steps, initializer=(zeros, zeros))
  return tf.transpose(outputs, [1, 2, 0, 3])


class BatchedResult(NamedTuple):
  """What `batched_local_train` returns, one row per user.

  Attributes:
    updates: per shared trainable variable, [users, ...]: initial weights
      minus final weights, as `split_training.local_train` (TFF's sign: the
      server optimizer applies it as a gradient); zero for a user whose
      training went non-finite.
    num_examples: int64 [users], the examples a user trained on (0 when
      non-finite), the update's weight.
    loss_sum: float32 [users], the sum over batches of the batch loss times
      the batch size (as `split_training.local_train`).
    nonfinite: int32 [users], 1 for a user whose weights went non-finite.
    metrics: `metrics_fn`'s sums over every user's examples (an empty
      dict without one; a user whose training went non-finite is counted
      in them, unlike in `split_training.local_train`).
    new_private: per private variable, [users, ...]: each user's new
      private state (its old one when non-finite); None when the training
      has no private state (the client states' private part is kept).
  """
  updates: tuple
  num_examples: tf.Tensor
  loss_sum: tf.Tensor
  nonfinite: tf.Tensor
  metrics: Any
  new_private: Optional[tuple] = None


def stack_users(t: tf.Tensor, num_users: tf.Tensor) -> tf.Tensor:
  """`t` repeated along a new leading user axis."""
  return tf.tile(t[None], tf.concat(
      [[num_users], tf.ones([t.shape.rank], tf.int32)], 0))


def _rank(t) -> int:
  """A tensor's rank; 0 for a Python number (an optimizer's constant)."""
  return t.shape.rank if tf.is_tensor(t) else 0


def mask_state(new, old, active):
  """Keeps `old` for inactive users: in the weights, and in an element-wise
  optimizer's state every tensor but its scalars (hyper-parameters and
  Adam's step, shared by all users) is shaped as the stacked weights."""
  def pick(n, o):
    if _rank(n):
      mask = tf.reshape(active, [-1] + [1] * (n.shape.rank - 1))
      return tf.where(mask, n, o)
    return n
  return tf.nest.map_structure(pick, new, old)


def user_example_counts(shard) -> tf.Tensor:
  """int64 [users]: the real examples in each user's batches."""
  num_batches = shard[shard_packing.SHARD_NUM_BATCHES]
  sizes = shard[shard_packing.SHARD_BATCH_SIZES]
  real = tf.range(tf.shape(sizes)[1])[None, :] < num_batches[:, None]
  return tf.cast(tf.reduce_sum(tf.where(real, sizes, 0), 1), tf.int64)


def finite_users(tensors: Sequence[tf.Tensor]) -> tf.Tensor:
  """bool [users]: the users whose rows of every stacked tensor are finite."""
  return tf.reduce_all(tf.stack(
      [tf.reduce_all(tf.math.is_finite(
          tf.reshape(t, tf.stack([tf.shape(t)[0], -1]))), 1)
       for t in tensors], 1), 1)


def where_users(keep: tf.Tensor, new, old):
  """Per user, `new`'s row where `keep` is true, else `old`'s."""
  return tf.nest.map_structure(
      lambda n, o: tf.where(
          tf.reshape(keep, [-1] + [1] * (n.shape.rank - 1)), n, o), new, old)


def train_steps(shard: Any, optimizer: tff.learning.optimizers.Optimizer,
                weights: tuple, user_loss: Callable[..., Any],
                decode: Callable[[Any], Any] | None = None,
                accumulate: Callable[..., Any] | None = None,
                sums: Any = (),
                penalty: Callable[[tuple], tf.Tensor] | None = None,
                active_only: bool = False):
  """The masked local steps of a shard's users, trained together.

  The loop every batched trainer shares (`batched_local_train` and the
  client steps' own `BATCHED_TRAINER`s): step s takes each user's s-th
  batch (its own order, `shard_packing.pack_datasets`), padded to the
  widest; `user_loss` scores it; one gradient of the sum of the users'
  losses is each user's own gradient, since a user's loss reads only its
  own rows; `optimizer` (element-wise, its state stacked as the weights)
  steps every user. A user whose batches are done keeps its weights and
  optimizer slots (`mask_state`), so it ends where it would alone.

  Args:
    shard: one packed shard (`shard_packing.pack_datasets`).
    optimizer: an element-wise TFF optimizer.
    weights: the stacked trained tensors, each [users, ...].
    user_loss: `(weights, batch, real, step) -> (loss [users], aux)`:
      `batch` is the step's decoded batch with the user and example axes
      merged ([users * width, ...], a user's rows together), `real` is
      float [users, width], 1 on a user's real examples, `step` the step's
      index (a user's step-th batch); `loss` is each user's mean loss over
      its real examples (a user without any: anything finite).
    decode: the task's wire decoding of a batch, if any.
    accumulate: optional `(sums, batch, aux, real) -> sums`, run each step.
    sums: `accumulate`'s initial sums.
    penalty: optional `weights -> [users]`, a regularizer added to each
      user's loss for its gradient (a proximal term), not to its loss sum.
    active_only: a step where some users are done computes only the
      others: their weights, optimizer slots and batches are gathered,
      stepped and scattered back, so padded steps cost nothing (users of
      1 to 15 batches in one group). Needs `user_loss`, `accumulate` and
      `penalty` to read the users only through their arguments (their
      leading axis is then the active users), as `batched_local_train`'s
      do; without it every user is computed and the done ones masked.

  Returns:
    (final stacked weights, loss sums [users] (a batch's loss times its
    real examples, summed), the accumulated `sums`).
  """
  num_batches = shard[shard_packing.SHARD_NUM_BATCHES]
  num_users = tf.shape(num_batches)[0]
  decode = decode or (lambda b: b)
  examples = shard[shard_packing.SHARD_EXAMPLES]
  indices = shard[shard_packing.SHARD_INDICES]
  sizes = shard[shard_packing.SHARD_BATCH_SIZES]
  width = tf.shape(indices)[2]
  flat = lambda t: tf.reshape(t, tf.concat([[-1], tf.shape(t)[2:]], 0))
  opt_state = optimizer.initialize(tuple(
      tf.TensorSpec(w.shape[1:], w.dtype) for w in weights))
  opt_state = tf.nest.map_structure(
      lambda t: stack_users(t, num_users) if _rank(t) else t, opt_state)

  def users_step(s, users, weights, opt_state, sums):
    """One step of the users `users` (None: all), on their rows of
    `weights` and `opt_state`: (new weights, new state, loss, batch
    sizes, sums)."""
    pick = (lambda t: t) if users is None else (
        lambda t: tf.gather(t, users))
    idx = pick(indices[:, s])
    batch = decode(tf.nest.map_structure(
        lambda t: flat(tf.gather(pick(t), idx, batch_dims=1)), examples))
    size = tf.where(pick(s < num_batches), pick(sizes[:, s]), 0)
    real = tf.cast(tf.range(width)[None, :] < size[:, None], tf.float32)
    with tf.GradientTape() as tape:
      tape.watch(weights)
      loss, aux = user_loss(weights, batch, real, s)
      total = tf.reduce_sum(loss)
      if penalty is not None:
        total += tf.reduce_sum(penalty(weights))
    grads = tape.gradient(total, weights)
    new_state, new_weights = optimizer.next(opt_state, weights, grads)
    if accumulate is not None:
      sums = accumulate(sums, batch, aux, real)
    return tuple(new_weights), new_state, loss, size, sums

  def masked(s, weights, opt_state, loss_sum, sums):
    active = s < num_batches
    new_weights, new_state, loss, size, sums = users_step(
        s, None, weights, opt_state, sums)
    # A step where every user is active (equal users, the common case)
    # skips the selects, a pass over every stacked tensor each.
    new_weights, new_state = tf.cond(
        tf.reduce_all(active), lambda: (new_weights, new_state),
        lambda: (mask_state(new_weights, weights, active),
                 mask_state(new_state, opt_state, active)))
    loss_sum += tf.where(active, loss * tf.cast(size, tf.float32), 0.0)
    return new_weights, new_state, loss_sum, sums

  def gathered(s, weights, opt_state, loss_sum, sums):
    users = tf.where(s < num_batches)[:, 0]
    at = users[:, None]
    rows = lambda t: tf.gather(t, users) if _rank(t) else t
    new_weights, new_state, loss, size, sums = users_step(
        s, users, tuple(rows(w) for w in weights),
        tf.nest.map_structure(rows, opt_state), sums)
    back = lambda old, new: (tf.tensor_scatter_nd_update(old, at, new)
                             if _rank(old) else new)
    return (tuple(back(o, n) for o, n in zip(weights, new_weights)),
            tf.nest.map_structure(back, opt_state, new_state),
            tf.tensor_scatter_nd_add(
                loss_sum, at, loss * tf.cast(size, tf.float32)), sums)

  def step(s, weights, opt_state, loss_sum, sums):
    if active_only:
      out = tf.cond(tf.reduce_all(s < num_batches),
                    lambda: masked(s, weights, opt_state, loss_sum, sums),
                    lambda: gathered(s, weights, opt_state, loss_sum, sums))
    else:
      out = masked(s, weights, opt_state, loss_sum, sums)
    return (s + 1,) + tuple(out)

  max_steps = tf.reduce_max(tf.concat([num_batches, [0]], 0))
  # One step at a time: a step may read model variables (a frozen
  # backbone) that the shard assigns around the loop
  # (`shard_packing.PackedBatches.reduce`).
  _, final, _, loss_sum, sums = tf.while_loop(
      lambda s, *_: s < max_steps, step,
      (tf.constant(0), tuple(weights), opt_state, tf.zeros([num_users]),
       sums), parallel_iterations=1)
  return final, loss_sum, sums


def batched_local_train(batched: BatchedModel,
                        optimizer: tff.learning.optimizers.Optimizer,
                        initial_weights: Sequence[tf.Tensor],
                        shard: Any, metrics_fn=None,
                        decode: Callable[[Any], Any] | None = None,
                        proximal: tuple[float, Sequence[tf.Tensor]] | None
                        = None, stacked: Sequence[tf.Tensor] | None = None,
                        private: Sequence[tf.Tensor] = ()
                        ) -> BatchedResult:
  """Every user of a packed shard trains from `initial_weights` together.

  Each user sees its batches in its own order (`shard_packing.pack_datasets`
  keeps them), with its own optimizer state, as
  `split_training.local_train` trains it alone (up to float rounding of
  the batched ops); the loss of a batch is the model's
  `loss_terms_fn` pooled over its real examples, or without one the mean
  over them of the model's loss on each example.

  Args:
    batched: the model (`BatchedModel`).
    optimizer: an element-wise TFF optimizer (its state's tensors either
      scalars shared by all users, like Adam's step, or shaped like the
      weights).
    initial_weights: the broadcast shared trainable weights (unstacked).
    shard: one packed shard (`shard_packing.pack_datasets`).
    metrics_fn: optional `(batch, predictions) -> dict` of per-batch sums
      (as `split_training.local_train`'s); their sums over every user's
      real examples are `BatchedResult.metrics`.
    decode: the task's wire decoding of a batch, when the shard's examples
      are in wire form (`client_data.WireFormat.decode`).
    proximal: optional `(lam, anchors)`: each user's objective adds
      lam / 2 * ||w - anchors||^2 (Ditto's personal objective; the loss
      sums leave it out).
    stacked: optional per-user starting weights, [users, ...] each, in
      place of `initial_weights` repeated (Ditto's personal models); the
      updates are then each user's own start minus its end.
    private: the users' private variables (the model's
      `private_variables`), stacked [users, ...] each, trained with the
      shared ones by `optimizer` (a FedPer head, an LG-FedAvg body).

  Returns:
    A `BatchedResult`; with `stacked`, its `new_private` is each user's
    final weights (its starting ones when they went non-finite); with
    `private`, each user's final private values.
  """
  num_users = tf.shape(shard[shard_packing.SHARD_NUM_BATCHES])[0]
  width = tf.shape(shard[shard_packing.SHARD_INDICES])[2]
  model = batched.model
  weights = tuple(stacked) if stacked is not None else tuple(
      stack_users(w, num_users) for w in initial_weights)
  flat = lambda t: tf.reshape(t, tf.concat([[-1], tf.shape(t)[2:]], 0))
  # The users of a step (all, or the active ones): the rows of `real`.
  unflat = lambda t, real: tf.reshape(t, tf.concat(
      [[tf.shape(real)[0], width], tf.shape(t)[1:]], 0))

  def per_example_loss(batch, outputs):
    return tf.vectorized_map(
        lambda e: model.loss(
            tf.nest.map_structure(lambda t: t[None], e[0]), e[1][None]),
        (batch, outputs))

  def user_loss(weights, batch, real, step):
    del step  # The model's loss does not read it.
    users = tf.shape(real)[0]
    outputs = batched.apply(weights, unflat(batch['x'], real))
    if model.loss_terms_fn is not None:
      terms = tf.reshape(model.loss_terms_fn(batch, flat(outputs)),
                         [users, -1, 2])
      numerators, denominators = terms[..., 0], terms[..., 1]
    else:
      numerators = tf.reshape(per_example_loss(batch, flat(outputs)),
                              [users, -1])
      denominators = tf.ones_like(numerators)
    return tf.reduce_sum(numerators * real, 1) / tf.maximum(
        tf.reduce_sum(denominators * real, 1), 1.0), outputs

  def proximal_term(weights):
    lam, anchors = proximal
    return 0.5 * lam * tf.add_n([
        tf.reduce_sum(tf.reshape(tf.square(w - a[None]),
                                 [tf.shape(w)[0], -1]), 1)
        for w, a in zip(weights, anchors)])

  def predictions(batch):  # One user's, for the metrics' structure.
    one_user = tf.nest.map_structure(lambda t: t[None], batch)
    zeros = [tf.zeros([1] + v.shape.as_list(), v.dtype)
             for v in batched.variables]
    return model.predict(batched.apply(zeros, one_user['x'])[0])

  num_shared = len(weights)
  final, loss_sum, sums = train_steps(
      shard, optimizer, weights + tuple(private), user_loss, decode,
      metric_accumulator(metrics_fn, lambda o: model.predict(flat(o))),
      metric_zeros(metrics_fn, shard, decode, predictions),
      proximal_term if proximal is not None else None, active_only=True)
  final, final_private = tuple(final[:num_shared]), tuple(
      final[num_shared:])
  updates = tuple(w - f for f, w in zip(final, weights))
  finite = finite_users(updates + final_private)
  new_private = None
  if stacked is not None:
    new_private = where_users(finite, final, weights)
  elif private:
    new_private = where_users(finite, final_private, tuple(private))
  return BatchedResult(
      new_private=new_private,
      updates=where_users(finite, updates, tuple(
          tf.zeros_like(u) for u in updates)),
      num_examples=tf.where(finite, user_example_counts(shard),
                            tf.constant(0, tf.int64)),
      loss_sum=tf.where(finite, loss_sum, 0.0),
      nonfinite=tf.cast(tf.logical_not(finite), tf.int32),
      metrics=sums)


def metric_accumulator(metrics_fn, predict: Callable[[Any], tf.Tensor]):
  """`train_steps`' `accumulate` for a `metrics_fn` of per-batch sums (as
  `split_training.local_train`'s), summed over every user's real examples;
  `predict(aux)` gives the step's predictions, [users * width, ...]. None
  without a `metrics_fn`."""
  if metrics_fn is None:
    return None

  def accumulate(sums, batch, aux, real):
    keep = tf.reshape(real > 0, [-1])
    step_sums = metrics_fn(
        tf.nest.map_structure(lambda t: tf.boolean_mask(t, keep), batch),
        tf.boolean_mask(predict(aux), keep))
    return collections.OrderedDict((k, sums[k] + step_sums[k]) for k in sums)

  return accumulate


def metric_zeros(metrics_fn, shard, decode,
                 predictions: Callable[[Any], tf.Tensor]):
  """Zeros shaped as `metrics_fn`'s sums: traced (never run) on one batch's
  spec, with `predictions(batch)` as the model's predictions of it."""
  if metrics_fn is None:
    return collections.OrderedDict()
  decode = decode or (lambda b: b)
  spec = tf.nest.map_structure(
      lambda t: tf.TensorSpec([None] + t.shape[2:].as_list(), t.dtype),
      shard[shard_packing.SHARD_EXAMPLES])

  def sums(batch):
    batch = decode(batch)
    return metrics_fn(batch, predictions(batch))

  out = tf.function(sums, autograph=False).get_concrete_function(
      spec).structured_outputs
  return collections.OrderedDict(
      (k, tf.zeros(v.shape, v.dtype)) for k, v in out.items())


# A client step factory's attribute: `() -> train(weights, private, shard,
# decode) -> BatchedResult`, its own batched training (e.g. FedPerC's,
# `models/fedperc_training.batched_local_train`, or Ditto's). `private` is
# the stacked private client states, [users, ...] per variable. Called once
# per trace; raises ValueError when it cannot cover the model.
BATCHED_TRAINER = 'batched_trainer'


def unsupported_reason(make_step) -> Optional[str]:
  """None when a process's client step can run batched, else why not.

  Args:
    make_step: the process's `Composition.client_step`.
  """
  own = getattr(make_step, BATCHED_TRAINER, None)
  if own is not None:
    try:
      with tf.Graph().as_default():
        own()  # Builds the trainer's model, refusing what it cannot cover.
    except ValueError as e:
      return str(e)
    return None
  if not isinstance(make_step, process_lib.SplitClientStep):
    return ('its client step is neither the joint local training of a '
            'split model (process.split_client_step_factory) nor a step '
            f'with a batched form of its own (`{BATCHED_TRAINER}`)')
  if make_step.private_optimizer is not None:
    return 'it trains private variables with an optimizer of their own'
  try:
    BatchedModel(make_step.model_fn())
  except ValueError as e:
    return str(e)
  return None


def shard_loop(make_step: process_lib.ClientStepFactory, spec,
               user_clip_norm: Optional[float] = None, wire=None,
               count_users: bool = False):
  """A shard's client work with its users trained together.

  The batched counterpart of `core/sharded.py`'s per-user shard loop, with
  the same result: the weighted mean of the users' updates (weights: their
  example counts) and its total weight or, with `user_clip_norm`, the sum of
  their updates each clipped to that L2 norm (as
  `sharded_privacy.clip_user_update`)
  and the user count; the stacked new client states; the summed metrics.

  Args:
    make_step: the process's client step (`unsupported_reason` is None:
      a `process.SplitClientStep`, or a step with its own
      `BATCHED_TRAINER`).
    spec: the tensor specs of one user's step result.
    user_clip_norm: the DP clip of each user's update, or None.
    wire: the task's `WireFormat` when the shard's examples are in it.
    count_users: add the shard's user count (`shard_packing.SHARD_USERS`).

  Returns:
    `run(weights, states, shard) -> OrderedDict`, to be traced.
  """
  if 'selected' in spec:
    raise ValueError('batched training does not cover a selection')
  decode = wire.decode if wire is not None else None
  own = getattr(make_step, BATCHED_TRAINER, None)
  if own is not None:
    train = own()
  else:
    batched = BatchedModel(make_step.model_fn())
    train = lambda weights, private, shard, decode: batched_local_train(
        batched, make_step.client_optimizer, tuple(weights.trainable), shard,
        make_step.metrics_fn, decode, private=private)

  def run(weights, states, shard):
    out = train(weights, tuple(states[process_lib.CLIENT_STATE_PRIVATE]),
                shard, decode)
    num_users = tf.shape(shard[shard_packing.SHARD_NUM_BATCHES])[0]
    if user_clip_norm is None:
      w = tf.cast(out.num_examples, tf.float32)
      total_weight = tf.reduce_sum(w)
      update = tuple(tf.math.divide_no_nan(tf.tensordot(w, u, 1),
                                           total_weight)
                     for u in out.updates)
    else:
      squares = tf.add_n([tf.reduce_sum(tf.reshape(u * u, [num_users, -1]), 1)
                          for u in out.updates])
      scale = user_clip_norm * tf.minimum(tf.math.rsqrt(squares),
                                          1.0 / user_clip_norm)
      update = tuple(tf.tensordot(scale, u, 1) for u in out.updates)
      total_weight = tf.cast(num_users, tf.float32)
    metrics = dict(out.metrics)
    metrics.update(
        loss_sum=tf.reduce_sum(out.loss_sum),
        num_examples=tf.reduce_sum(out.num_examples),
        nonfinite=tf.reduce_sum(out.nonfinite),
        clients=tf.cast(num_users, tf.int32))
    if set(metrics) != set(spec['metrics']):
      raise ValueError(f'batched metrics {sorted(metrics)} are not the '
                       f'step\'s {sorted(spec["metrics"])}')
    private = states[process_lib.CLIENT_STATE_PRIVATE]
    if out.new_private is not None:
      private = tf.nest.pack_sequence_as(private, list(out.new_private))
    new_states = collections.OrderedDict([
        (process_lib.CLIENT_STATE_PRIVATE, private),
        (process_lib.CLIENT_STATE_ROUNDS,
         states[process_lib.CLIENT_STATE_ROUNDS] + 1)])
    result = collections.OrderedDict(
        update=tf.nest.pack_sequence_as(spec['update'], list(update)),
        update_weight=total_weight, client_state=new_states,
        metrics=collections.OrderedDict(
            (k, metrics[k]) for k in spec['metrics']))
    if count_users:
      result[shard_packing.SHARD_USERS] = tf.cast(num_users, tf.float32)
    return result

  return run
