"""The plain pooled VAE that gives FedDVA's probes a scale."""

import numpy as np
import pytest
import tensorflow as tf

from tff_personal.algorithms import feddva
from tff_personal.models import feddva as feddva_lib
from tff_personal.models import pooled_vae

_CONFIG = feddva_lib.FeddvaConfig(z_dim=2, c_dim=3, channels=(4, 4, 4, 4),
                                  hidden=16)


def _bars(n, seed=0):
  """n images: the first half one vertical bar, the second half one
  horizontal bar, each within a pixel of the middle; labels 0 / 1."""
  rng = np.random.default_rng(seed)
  x = np.zeros((n, 28, 28, 1), np.float32)
  for i in range(n):
    p = 14 + rng.integers(-1, 2)
    if i < n // 2:
      x[i, 2:26, p - 2:p + 2] = 1.0
    else:
      x[i, p - 2:p + 2, 2:26] = 1.0
  return x, (np.arange(n) >= n // 2).astype(int)


def test_loss_is_bernoulli_nll_plus_alpha_kl_with_c_absent():
  """vae_loss against the negative ELBO written out in NumPy: the decoder
  sees [z; 0] with z drawn from the stateless seed."""
  tf.keras.utils.set_random_seed(3)
  model = feddva_lib.FeddvaModel(_CONFIG)
  x, _ = _bars(6)
  seed = tf.constant([5, 7], tf.int64)
  for alpha in (0.0, 0.6):
    loss, rec, kl = pooled_vae.vae_loss(model, x, alpha, seed)
    mu, logvar = (v.numpy() for v in model.encoder_z(x))
    eps = tf.random.stateless_normal(mu.shape, seed).numpy()
    z = mu + np.exp(0.5 * logvar) * eps
    logits = model.decoder([z, np.zeros((6, 3), np.float32)]).numpy()
    nll = (np.maximum(logits, 0) - logits * x
           + np.log1p(np.exp(-np.abs(logits)))).reshape(6, -1).sum(1)
    kl_np = 0.5 * (np.exp(logvar) + mu ** 2 - 1 - logvar).sum(1)
    np.testing.assert_allclose(rec.numpy(), nll.mean(), rtol=1e-5)
    np.testing.assert_allclose(kl.numpy(), kl_np.mean(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loss.numpy(), nll.mean() + alpha * kl_np.mean(),
                               rtol=1e-5)
  # A c other than zero would change what the decoder draws, so "c absent"
  # is a real choice, not a no-op.
  ones = model.decoder([z, np.ones((6, 3), np.float32)]).numpy()
  assert not np.allclose(ones, logits)


def test_trains_z_and_decoder_and_leaves_the_c_encoder_at_its_init():
  """Two kinds of image: a decoder without z can at best draw their
  overlay (about 133 nats); a VAE that learns puts the kind in z."""
  config = feddva_lib.FeddvaConfig(z_dim=2, c_dim=3, channels=(8,) * 4,
                                   hidden=32)
  x, kind = _bars(64)
  model, curve = pooled_vae.train(config, x, epochs=60, batch_size=8,
                                  learning_rate=3e-3, seed=1)
  assert len(curve) == 60
  assert curve[-1]['reconstruction'] < 100.0 < curve[0]['reconstruction']
  assert curve[-1]['kl_z'] > 0.5  # z carries something.
  # What z carries tells the two kinds of image apart (a threshold on one
  # coordinate of the posterior mean, the better of the two).
  mu = model.encoder_z(x)[0].numpy()
  best = max(max(np.mean((m > np.median(m)) == kind),
                 np.mean((m <= np.median(m)) == kind)) for m in mu.T)
  assert best > 0.9
  init_shared, _ = feddva.initial_weights(config, seed=1)
  n_z = len(model.encoder_z.trainable_variables)
  for got, want in zip(model.encoder_c.get_weights(), init_shared[n_z:]):
    np.testing.assert_array_equal(got, want)
  assert not all(np.array_equal(a, b) for a, b in zip(
      model.encoder_z.get_weights(), init_shared[:n_z]))


def test_same_seed_same_weights_other_seed_other_weights():
  x, _ = _bars(24)
  kw = dict(epochs=2, batch_size=8, learning_rate=1e-3)
  a, curve_a = pooled_vae.train(_CONFIG, x, seed=4, **kw)
  b, curve_b = pooled_vae.train(_CONFIG, x, seed=4, **kw)
  c, _ = pooled_vae.train(_CONFIG, x, seed=5, **kw)
  for wa, wb in zip(a.decoder.get_weights(), b.decoder.get_weights()):
    np.testing.assert_array_equal(wa, wb)
  assert curve_a == curve_b
  assert not all(np.array_equal(wa, wc) for wa, wc in zip(
      a.decoder.get_weights(), c.decoder.get_weights()))


def test_bad_input_is_named():
  x, _ = _bars(8)
  kw = dict(epochs=1, batch_size=4, learning_rate=1e-3)
  with pytest.raises(ValueError, match=r'\[n, 28, 28, 1\]'):
    pooled_vae.train(_CONFIG, x[..., 0], **kw)
  with pytest.raises(ValueError, match='no images'):
    pooled_vae.train(_CONFIG, x[:0], **kw)
  with pytest.raises(ValueError, match='epochs'):
    pooled_vae.train(_CONFIG, x, **{**kw, 'epochs': 0})
  with pytest.raises(ValueError, match='batch_size'):
    pooled_vae.train(_CONFIG, x, **{**kw, 'batch_size': 0})
  with pytest.raises(ValueError, match='learning_rate'):
    pooled_vae.train(_CONFIG, x, **{**kw, 'learning_rate': 0.0})
  with pytest.raises(ValueError, match='alpha'):
    pooled_vae.train(_CONFIG, x, alpha=float('nan'), **kw)
