"""Local heads (every user alone) and the hand-made speech feature."""

import numpy as np
import pytest
from sklearn import linear_model
import tensorflow as tf

from tasks import speech_spectrogram
from tff_personal.core import evaluation
from tff_personal.models import local_head


def _user(rng, shift, n=20, m=10, d=6):
  """Two Gaussian classes `shift` apart along a user-specific direction."""
  direction = rng.normal(size=d)
  direction /= np.linalg.norm(direction)
  def draw(k):
    y = np.arange(k) % 2
    x = rng.normal(size=(k, d)) + np.outer(2 * y - 1, direction) * shift
    return x.astype(np.float32), y
  return draw(n), draw(m)


def test_separable_users_are_classified_exactly():
  rng = np.random.default_rng(0)
  users = [_user(rng, shift=8.0) for _ in range(5)]
  outputs = local_head.local_outputs([u[0] for u in users],
                                     [u[1] for u in users])
  for out, (_, (_, y)) in zip(outputs, users):
    np.testing.assert_array_equal(out['outputs'].argmax(-1), y)
    np.testing.assert_array_equal(out['labels'], y)
  metrics = evaluation.preference_metrics(outputs, [0, 1, 0, 1, 2])
  assert metrics['f1'] == 1.0 and metrics['accuracy'] == 1.0


def test_logits_are_sklearns_decision_and_prediction():
  rng = np.random.default_rng(1)
  (x, y), (tx, _) = _user(rng, shift=0.7)
  for c in (0.1, 1.0):
    logits = local_head.fit_predict(x, y, tx, c=c)
    ref = linear_model.LogisticRegression(C=c, max_iter=1000).fit(x, y)
    np.testing.assert_allclose(logits[:, 1] - logits[:, 0],
                               ref.decision_function(tx), rtol=1e-4,
                               atol=1e-4)
    np.testing.assert_array_equal(logits.argmax(-1), ref.predict(tx))
  # Stronger regularisation shrinks the decision function toward 0.
  weak = np.abs(local_head.fit_predict(x, y, tx, c=100.0)[:, 1]).mean()
  strong = np.abs(local_head.fit_predict(x, y, tx, c=0.001)[:, 1]).mean()
  assert strong < weak


def test_a_users_prediction_depends_on_its_own_data_only():
  rng = np.random.default_rng(2)
  users = [_user(rng, shift=0.5) for _ in range(4)]
  base = local_head.local_outputs([u[0] for u in users], [u[1] for u in users])
  # Replace every other user's data: user 0's outputs do not move.
  others = [_user(np.random.default_rng(9), shift=3.0) for _ in range(3)]
  moved = local_head.local_outputs(
      [users[0][0]] + [u[0] for u in others],
      [users[0][1]] + [u[1] for u in others])
  np.testing.assert_array_equal(base[0]['outputs'], moved[0]['outputs'])


def test_one_class_user_gets_that_class_and_bad_input_is_named():
  x = np.ones((4, 3), np.float32)
  tx = np.zeros((5, 3), np.float32)
  assert (local_head.fit_predict(x, np.ones(4, int), tx).argmax(-1) == 1).all()
  assert (local_head.fit_predict(x, np.zeros(4, int), tx).argmax(-1)
          == 0).all()
  with pytest.raises(ValueError, match='c must be > 0'):
    local_head.fit_predict(x, np.ones(4, int), tx, c=0.0)
  with pytest.raises(ValueError, match='0/1'):
    local_head.fit_predict(x, np.array([0, 1, 2, 1]), tx)
  with pytest.raises(ValueError, match='train_labels must be'):
    local_head.fit_predict(x, np.ones(3, int), tx)
  with pytest.raises(ValueError, match=r'\[n, d\] and \[m, d\]'):
    local_head.fit_predict(x, np.ones(4, int), np.zeros((5, 2)))
  with pytest.raises(ValueError, match='without training samples'):
    local_head.fit_predict(np.zeros((0, 3)), np.zeros(0, int), tx)
  with pytest.raises(ValueError, match='2 users with training data, 1'):
    local_head.local_outputs([(x, np.ones(4, int))] * 2,
                             [(tx, np.ones(5, int))])


def test_encode_batches_equal_one_call():
  encoder = tf.keras.Sequential([tf.keras.layers.Dense(3, input_shape=(5,))])
  x = np.random.default_rng(3).normal(size=(7, 5)).astype(np.float32)
  # Batches of 3 and one of 7 may block the matmul differently: equal up to
  # float32 rounding.
  np.testing.assert_allclose(local_head.encode(encoder, x, batch_size=3),
                             encoder(x).numpy(), rtol=1e-5, atol=1e-7)
  assert local_head.encode(encoder, x[:0]).shape == (0, 3)


def test_mean_loud_spectrum_averages_the_louder_frames_only():
  bins, frames = speech_spectrogram.SHAPE
  q = np.zeros((2, bins, frames), np.uint8)  # silence (DB_MIN) = padding
  rng = np.random.default_rng(4)
  loud = rng.integers(150, 256, size=(bins, 120)).astype(np.uint8)
  quiet = rng.integers(20, 60, size=(bins, 60)).astype(np.uint8)
  q[0, :, :120] = loud            # 120 loud frames, 60 quiet, 195 padding
  q[0, :, 120:180] = quiet
  q[1] = 77                       # every frame equally loud: all kept
  got = speech_spectrogram.mean_loud_spectrum(q)
  assert got.shape == (2, bins) and got.dtype == np.float32
  # A short utterance: the median frame level is a padding frame's (0), so
  # the louder frames are the 180 non-silent ones, never the padding.
  want0 = np.concatenate([loud, quiet], axis=1).mean(axis=1) / 255.0
  np.testing.assert_allclose(got[0], want0, rtol=1e-5)
  np.testing.assert_allclose(got[1], 77 / 255.0, rtol=1e-6)
  # Without padding the median splits loud from quiet frames.
  q2 = np.concatenate([np.repeat(loud, 2, axis=1)[:, :187],
                       np.repeat(quiet, 4, axis=1)[:, :188]], axis=1)[None]
  np.testing.assert_allclose(
      speech_spectrogram.mean_loud_spectrum(q2)[0],
      np.repeat(loud, 2, axis=1)[:, :187].mean(axis=1) / 255.0, rtol=1e-5)
  with pytest.raises(ValueError, match=r'\[n, 200, 375\]'):
    speech_spectrogram.mean_loud_spectrum(q[:, :10])
