"""FedDVA's 'reference' client schedule (the authors' code's three passes).

Checks what each pass can move: with c drawn from the prior the c-encoder
gets no gradient and the decoder reads the prior draw; with z held fixed the
reconstruction gives the z-encoder no gradient; in a client round the
z-encoder moves only by pass 2 and the decoder by passes 1 and 3.
"""

import collections

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tff_personal.models import feddva as feddva_lib
from tff_personal.models import feddva_losses
from tff_personal.models import feddva_training

CONFIG = feddva_lib.FeddvaConfig(z_dim=2, c_dim=3, channels=(2, 2, 2, 3),
                                 hidden=5)
LOSS = feddva_losses.LossConfig()


def _x(seed=0, n=6):
  return tf.constant(np.random.default_rng(seed).uniform(
      size=(n, 28, 28, 1)).astype(np.float32))


def _eps(n, dim, seed):
  return tf.constant(np.random.default_rng(seed).normal(
      size=(n, dim)).astype(np.float32))


def _model(seed=0):
  tf.keras.utils.set_random_seed(seed)
  return feddva_lib.FeddvaModel(CONFIG)


def _grads(model, variables, **kwargs):
  x = _x()
  with tf.GradientTape() as tape:
    losses = model.loss(x, LOSS, eps_z=_eps(6, 2, 1), eps_c=_eps(6, 3, 2),
                        **kwargs)
  return losses, tape.gradient(losses['loss'], variables)


def _norm(grads):
  return sum(0.0 if g is None else float(tf.reduce_sum(tf.square(g)))
             for g in grads)


def test_c_from_prior_feeds_the_prior_draw_and_skips_the_c_encoder():
  model = _model()
  x, eps_z, eps_c = _x(), _eps(6, 2, 1), _eps(6, 3, 2)
  out = model.forward(x, eps_z, eps_c, c_from_prior=True)
  np.testing.assert_allclose(out['c'].numpy(), eps_c.numpy())
  np.testing.assert_allclose(
      out['logits'].numpy(),
      model.decoder([out['z'], eps_c], training=True).numpy(), atol=1e-6)
  losses, grads = _grads(model, model.encoder_c.trainable_variables,
                         c_from_prior=True)
  assert _norm(grads) == 0.0
  # R_c is the constant xi there (KLs of N(0, I) to itself are 0).
  assert float(losses['r_c']) == pytest.approx(LOSS.xi_for(CONFIG.c_dim))
  # ...while the default forward does send gradient into the c-encoder.
  _, grads = _grads(model, model.encoder_c.trainable_variables)
  assert _norm(grads) > 0.0


def test_stop_z_leaves_the_z_encoder_only_its_kl():
  model = _model()
  z_vars = model.encoder_z.trainable_variables
  _, stopped = _grads(model, z_vars, stop_z=True)
  # The gradient equals that of alpha * KL_z alone.
  with tf.GradientTape() as tape:
    mu, logvar = model.encoder_z(_x(), training=True)
    kl = LOSS.alpha * tf.reduce_mean(
        feddva_losses.kl_to_standard_normal(mu, logvar))
  kl_grads = tape.gradient(kl, z_vars)
  for g, k in zip(stopped, kl_grads):
    np.testing.assert_allclose(g.numpy(), k.numpy(), atol=1e-5)
  _, full = _grads(model, z_vars)
  assert max(float(tf.reduce_max(tf.abs(g - k)))
             for g, k in zip(full, kl_grads)) > 1e-4


def _round(schedule, decoder_lr, encoder_lr, seed=0):
  model = _model(seed)
  encoders = tuple(v.numpy() for v in model.shared_variables)
  decoder = tuple(v.numpy() for v in model.decoder_variables)
  data = tf.data.Dataset.from_tensor_slices(collections.OrderedDict(
      x=_x(3, 12), y=tf.zeros([12], tf.int32))).batch(6)
  sgd = tff.learning.optimizers.build_sgdm
  step = tf.function(lambda e, d, ds: feddva_training.client_update(
      model, sgd(decoder_lr), sgd(encoder_lr), e, d, ds, LOSS,
      schedule=schedule))
  update, weight, new_decoder, metrics = step(encoders, decoder, data)
  n_z = len(model.encoder_z.trainable_variables)
  moved = lambda parts: max(float(np.max(np.abs(np.asarray(p))))
                            for p in parts)
  return dict(
      z=moved(update[:n_z]), c=moved(update[n_z:]),
      decoder=moved([a - b for a, b in zip(new_decoder, decoder)]),
      weight=float(weight), metrics=metrics)


def test_reference_round_moves_what_its_passes_train():
  both = _round('reference', 0.05, 0.05)
  assert both['z'] > 0 and both['c'] > 0 and both['decoder'] > 0
  # 12 examples, one pass's worth (pass 3), as the paper schedule weighs.
  assert both['weight'] == 12.0
  assert int(both['metrics']['num_examples']) == 12
  # The decoder's own pass frozen: pass 3 (encoder optimizer) still moves
  # it; under the paper's schedule it stays.
  assert _round('reference', 0.0, 0.05)['decoder'] > 0
  assert _round('paper', 0.0, 0.05)['decoder'] == 0
  # Encoder optimizer frozen: only pass 1 moves anything (the decoder).
  frozen = _round('reference', 0.05, 0.0)
  assert frozen['z'] == 0 and frozen['c'] == 0 and frozen['decoder'] > 0


def test_unknown_schedule_is_refused_by_name():
  with pytest.raises(ValueError, match='schedule must be one of'):
    _round('alternating', 0.05, 0.05)
