"""A plain VAE trained on pooled images: the reference for FedDVA's probes.

Neither federated nor FedDVA. It answers one question the FedDVA probes
raise: how much of the digit (and of the client) does a linear probe read
from the latent of an ordinary VAE trained on the same images, with the
same encoder, the same latent size and as many passes over every image as
FedDVA's encoders get? Without it, "digit from z" has no scale.

The model is FedDVA's z-encoder q(z|x) (`feddva.build_encoder_z`) and a
decoder of FedDVA's architecture fed [z; 0]: there is no c, so p(x|z) is an
ordinary VAE's decoder. The loss per image is the negative ELBO with R_z
weighted as FedDVA weights it, Bernoulli NLL + alpha KL(q(z|x) || N(0, I))
(`feddva_losses`), minimised by Keras Adam on shuffled batches of all the
images together. The c-encoder of the returned `FeddvaModel` is never
trained; only z means anything.

Written by hand: a VAE's training step is these few lines, and no library
in our stack has one that takes FedDVA's networks.

Determinism: the weights are initialised from `seed`
(`tf.keras.utils.set_random_seed`, which also sets Python's and NumPy's
global seeds, as `algorithms.feddva.initial_weights` does), batches are
shuffled by `seed`, and step i draws its noise statelessly from (seed, i):
the same call gives the same weights.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from tff_personal.models import feddva as feddva_lib
from tff_personal.models import feddva_losses


def vae_loss(model: feddva_lib.FeddvaModel, x, alpha: float, seed):
  """(mean loss, mean reconstruction NLL, mean KL_z) of a batch."""
  mu, logvar = model.encoder_z(x, training=True)
  eps = tf.random.stateless_normal(tf.shape(mu), seed)
  z = mu + tf.exp(0.5 * logvar) * eps
  no_c = tf.zeros([tf.shape(x)[0], model.config.c_dim])
  logits = model.decoder([z, no_c], training=True)
  reconstruction = tf.reduce_mean(feddva_losses.bernoulli_nll(x, logits))
  kl_z = tf.reduce_mean(feddva_losses.kl_to_standard_normal(mu, logvar))
  return reconstruction + alpha * kl_z, reconstruction, kl_z


def train(config: feddva_lib.FeddvaConfig, images: np.ndarray, *,
          epochs: int, batch_size: int, learning_rate: float,
          alpha: float = 1.0, seed: int = 0, log_every: int = 0):
  """Trains the plain VAE on `images` ([n, 28, 28, 1] in [0, 1]).

  Returns (model, curve): a `FeddvaModel` whose z-encoder and decoder are
  trained (its c-encoder is not), and per epoch the mean training loss,
  reconstruction NLL and KL_z (nats per image).
  """
  images = np.asarray(images, np.float32)
  if images.ndim != 4 or images.shape[1:] != feddva_lib.IMAGE_SHAPE:
    raise ValueError(f'pooled_vae: images must be [n, 28, 28, 1], got '
                     f'{images.shape}')
  if len(images) == 0:
    raise ValueError('pooled_vae: no images to train on')
  for name, value in (('epochs', epochs), ('batch_size', batch_size)):
    if int(value) < 1:
      raise ValueError(f'pooled_vae: {name} must be >= 1, got {value}')
  if not learning_rate > 0:
    raise ValueError(f'pooled_vae: learning_rate must be > 0, got '
                     f'{learning_rate}')
  if not alpha >= 0:
    raise ValueError(f'pooled_vae: alpha must be >= 0, got {alpha}')
  tf.keras.utils.set_random_seed(seed)
  model = feddva_lib.FeddvaModel(config)
  variables = (model.encoder_z.trainable_variables
               + model.decoder.trainable_variables)
  optimizer = tf.keras.optimizers.Adam(learning_rate)
  base_seed = tf.constant([seed, 0], tf.int64)

  @tf.function
  def step(x, i):
    with tf.GradientTape() as tape:
      loss, rec, kl = vae_loss(
          model, x, alpha,
          tf.random.experimental.stateless_fold_in(base_seed, i))
    optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
    return loss, rec, kl

  # repeat() after shuffle(reshuffle_each_iteration=True): a new order each
  # epoch (re-iterating one shuffled dataset would repeat the first order).
  data = tf.data.Dataset.from_tensor_slices(images).shuffle(
      len(images), seed=seed, reshuffle_each_iteration=True).batch(
          batch_size).repeat(int(epochs))
  steps_per_epoch = -(-len(images) // int(batch_size))
  curve, sums, n = [], np.zeros(3), 0
  for i, x in enumerate(data):
    values = step(x, tf.constant(i, tf.int64))
    sums += np.array([float(v) for v in values]) * len(x)
    n += len(x)
    if (i + 1) % steps_per_epoch == 0:
      curve.append(dict(zip(('loss', 'reconstruction', 'kl_z'),
                            (float(v) for v in sums / n))))
      sums, n = np.zeros(3), 0
      epoch = len(curve)
      if log_every and (epoch % log_every == 0 or epoch == epochs):
        print(f'pooled VAE epoch {epoch}/{epochs}: loss '
              f'{curve[-1]["loss"]:.1f} (reconstruction '
              f'{curve[-1]["reconstruction"]:.1f}, KL_z '
              f'{curve[-1]["kl_z"]:.1f})', flush=True)
  return model, curve
