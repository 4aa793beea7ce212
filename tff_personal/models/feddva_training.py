"""FedDVA's client update (Algorithm 1, ClientUpdate), in TensorFlow.

On client k with broadcast encoders theta and its stored decoder phi_k:

1. one pass over the client's batches updating only the decoder phi_k
   (Eq. 9), the encoders fixed at theta;
2. then one pass over the batches updating only the encoders theta_k
   (Eq. 11), the new decoder fixed.

Returns the encoder update theta - theta_k (TFF's sign convention, weighted
by the number of examples of one pass: FedAvg with w_k = |D_k| / sum |D|),
the new decoder (the client state) and metric sums of pass 2. Local epochs
are the dataset's repeats (each pass goes over it once). Each pass starts a
fresh `tff.learning.optimizers` state (Adam by default); optimizer state is
not kept between rounds (the paper does not say; it is the FedAvg habit).
A non-finite result gives a zero update of weight 0 and keeps the old
decoder, as `core/split_training.py` does.

Randomness: the reparameterisation noise is stateless
(`tf.random.stateless_normal`), drawn from a seed per (client round, pass,
batch): `client_seed` derives the round's seed from the process seed, the
client's count of rounds participated and an order-free fingerprint of its
data, so a round run twice from the same state and data is bit-identical
(tests/determinism_test.py), while clients and rounds draw different noise.

`schedule='reference'` is the authors' public code's round (pysleepy/FedDVA,
read, not copied; the paper does not describe it), three passes instead of
two:

1. the decoder phi_k, as above;
2. the z-encoder f only, with c replaced by a draw from the prior N(0, I)
   (the c-encoder is not run), so z alone must let the decoder reconstruct x;
   loss: reconstruction + alpha R_z;
3. the c-encoder h and the decoder phi_k, with z held fixed (stop-gradient),
   by the encoder optimizer; loss: Eq. 4 (R_z gives no gradient there).

The update is the change of both encoders; the new decoder is the one after
pass 3; metrics and the example weight are pass 3's.

`schedule='authors'` is exactly the round of the authors' released client
(`FedClientDVAUnsupervised.py`, `fit`): as 'reference', except that pass 1
also reads c drawn from the prior (their decoder loop calls the model with
`on_c=False`), so the c-encoder is not run until pass 3. 'reference' is our
earlier reading (pass 1 on the encoders' c), kept for its recorded cells.

`resamples=r > 1` feeds every batch r times over, tiled (the authors'
`n_resamples`: each image gets r draws of z and c in one step, and the
client's mixture of Eq. 26 is over the tiled batch); the example weight and
the metrics count each image once.
"""

from __future__ import annotations

import collections
import functools

import tensorflow as tf
import tensorflow_federated as tff

from tff_personal.models import feddva as feddva_lib
from tff_personal.models import feddva_losses

SCHEDULES = ('paper', 'reference', 'authors')
METRIC_NAMES = ('loss', 'reconstruction', 'kl_z', 'r_c', 'kl_c_prior',
                'kl_c_mixture', 'constraint_met')


def _assign(variables, values):
  for var, value in zip(variables, values):
    var.assign(value)


def _all_finite(tensors) -> tf.Tensor:
  return tf.reduce_all(tf.stack(
      [tf.reduce_all(tf.math.is_finite(t)) for t in tensors]))


def client_seed(seed: int, rounds_participated, dataset: tf.data.Dataset
                ) -> tf.Tensor:
  """A client round's [2] int64 noise seed (module docstring).

  The fingerprint is the sum of the images' pixels on the 0-255 grid, an
  integer, so it does not depend on the order the batches come in; it costs
  one read of the data (no model pass). Our construction: clients have no
  identifier in TFF, and their data tells them apart.
  """
  fingerprint = dataset.reduce(
      tf.constant(0, tf.int64),
      lambda total, batch: total + tf.reduce_sum(
          tf.cast(tf.round(batch['x'] * 255.0), tf.int64)))
  base = tf.stack([tf.constant(seed, tf.int64),
                   tf.cast(rounds_participated, tf.int64)])
  return tf.random.experimental.stateless_fold_in(base, fingerprint)


def _optimise(loss_fn, variables, optimizer, dataset, with_metrics: bool,
              seed, resamples: int = 1):
  """One pass over `dataset` updating `variables` only.

  `loss_fn(x, seed)` returns the loss dict of `feddva_losses.feddva_loss`;
  batch i gets the seed `stateless_fold_in(seed, i)`; with `resamples` > 1
  the loss reads the batch tiled that many times (module docstring).
  """
  specs = tuple(tf.TensorSpec(v.shape, v.dtype) for v in variables)

  def reduce_fn(state, batch):
    num_examples, sums, opt_state, step = state
    batch_seed = (None if seed is None else
                  tf.random.experimental.stateless_fold_in(seed, step))
    x = batch['x']
    if resamples > 1:
      x = tf.tile(x, [resamples, 1, 1, 1])
    with tf.GradientTape() as tape:
      losses = loss_fn(x, seed=batch_seed)
    grads = tape.gradient(losses['loss'], variables)
    grads = tuple(tf.zeros_like(v) if g is None else g
                  for g, v in zip(grads, variables))
    opt_state, updated = optimizer.next(opt_state, tuple(variables), grads)
    _assign(variables, updated)
    n = tf.shape(batch['x'])[0]
    if with_metrics:
      w = tf.cast(n, tf.float32)
      sums = collections.OrderedDict(
          (k, sums[k] + losses[k] * w) for k in sums)
    return num_examples + tf.cast(n, tf.int64), sums, opt_state, step + 1

  zeros = collections.OrderedDict(
      (f'{k}_sum', tf.constant(0.0)) for k in METRIC_NAMES)
  sums = collections.OrderedDict((k[:-4], v) for k, v in zeros.items())
  num_examples, sums, _, _ = dataset.reduce(
      (tf.constant(0, tf.int64), sums, optimizer.initialize(specs),
       tf.constant(0, tf.int64)),
      reduce_fn)
  return num_examples, sums


def client_update(model: feddva_lib.FeddvaModel,
                  decoder_optimizer: tff.learning.optimizers.Optimizer,
                  encoder_optimizer: tff.learning.optimizers.Optimizer,
                  encoder_weights, decoder_weights, dataset: tf.data.Dataset,
                  loss_config: feddva_losses.LossConfig,
                  decoder_first: bool = True,
                  schedule: str = 'paper', seed=None, resamples: int = 1):
  """Algorithm 1's ClientUpdate; returns (update, weight, decoder, metrics).

  `seed`: the round's [2] integer noise seed (`client_seed`); pass k of
  the round folds in k. None draws stateful (unrepeatable) noise.

  `decoder_first=False` swaps the passes (encoders, then decoder); it exists
  only for the test that the order matters. `schedule`: 'paper' (Algorithm
  1's two passes), 'reference' or 'authors' (three passes, module
  docstring). `resamples`: copies of each batch per step (module docstring).
  """
  if schedule not in SCHEDULES:
    raise ValueError(f'schedule must be one of {SCHEDULES}, got {schedule!r}')
  if resamples < 1:
    raise ValueError(f'resamples must be >= 1, got {resamples}')
  encoders = model.shared_variables
  decoder = model.decoder_variables
  _assign(encoders, encoder_weights)
  _assign(decoder, decoder_weights)
  full_loss = functools.partial(model.loss, loss_config=loss_config)
  seeds = [None] * 3
  if seed is not None:
    seeds = [tf.random.experimental.stateless_fold_in(seed, k)
             for k in range(3)]
  optimise = functools.partial(_optimise, resamples=resamples)
  prior_c_loss = functools.partial(model.loss, loss_config=loss_config,
                                   c_from_prior=True)
  if schedule in ('reference', 'authors'):
    optimise(prior_c_loss if schedule == 'authors' else full_loss, decoder,
             decoder_optimizer, dataset, False, seeds[0])
    optimise(prior_c_loss, model.encoder_z.trainable_variables,
             encoder_optimizer, dataset, False, seeds[1])
    num_examples, sums = optimise(
        functools.partial(model.loss, loss_config=loss_config, stop_z=True),
        model.encoder_c.trainable_variables + decoder, encoder_optimizer,
        dataset, True, seeds[2])
  elif decoder_first:
    optimise(full_loss, decoder, decoder_optimizer, dataset, False, seeds[0])
    num_examples, sums = optimise(full_loss, encoders, encoder_optimizer,
                                  dataset, True, seeds[1])
  else:
    num_examples, sums = optimise(full_loss, encoders, encoder_optimizer,
                                  dataset, True, seeds[1])
    optimise(full_loss, decoder, decoder_optimizer, dataset, False, seeds[0])
  update = tuple(tf.subtract(a, b.read_value())
                 for a, b in zip(encoder_weights, encoders))
  new_decoder = tuple(v.read_value() for v in decoder)
  finite = tf.logical_and(_all_finite(update), _all_finite(new_decoder))
  update = tuple(tf.where(finite, u, tf.zeros_like(u)) for u in update)
  new_decoder = tuple(tf.where(finite, n, o)
                      for n, o in zip(new_decoder, decoder_weights))
  weight = tf.where(finite, tf.cast(num_examples, tf.float32), 0.0)
  metrics = collections.OrderedDict(
      (f'{k}_sum', tf.where(finite, v, 0.0)) for k, v in sums.items())
  metrics['num_examples'] = tf.where(finite, num_examples,
                                     tf.constant(0, tf.int64))
  metrics['nonfinite'] = tf.cast(tf.logical_not(finite), tf.int32)
  return update, weight, new_decoder, metrics
