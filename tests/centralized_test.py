"""Centralized (server) training: its learning curve and its invariants."""

import numpy as np
import pytest
import tensorflow as tf

from tff_personal.algorithms import centralized


def _data(n=60, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, 5)).astype(np.float32)
  y = (x[:, 0] + 0.3 * x[:, 1] > 0).astype(np.int32)
  return tf.data.Dataset.from_tensor_slices({'x': x, 'y': y})


def _model():
  inputs = {'x': tf.keras.Input((5,), name='x')}
  hidden = tf.keras.layers.Dense(8, activation='relu')(inputs['x'])
  return tf.keras.Model(inputs, tf.keras.layers.Dense(2)(hidden))


def _train(evals_per_epoch):
  tf.keras.utils.set_random_seed(3)
  model = _model()
  result = centralized.train_centralized(
      model, _data().batch(6), _data(seed=1).batch(20), epochs=2,
      learning_rate=0.05, optimizer='adam', seed=3,
      log_fn=lambda line: None, evals_per_epoch=evals_per_epoch,
      test_data=_data(seed=2).batch(20))
  return result


def test_evaluations_within_an_epoch_do_not_change_training():
  once, thrice = _train(1), _train(3)
  for a, b in zip(once.model.get_weights(), thrice.model.get_weights()):
    np.testing.assert_array_equal(a, b)
  assert once.eval_accuracy_per_epoch == thrice.eval_accuracy_per_epoch
  # 10 batches per epoch: evaluated after batches 3 and 7, and at the end.
  assert [e for e, _ in thrice.curve] == pytest.approx(
      [0.3, 0.7, 1.0, 1.3, 1.7, 2.0])
  assert [e for e, _ in once.curve] == [1.0, 2.0]
  # The epoch ends are Keras' own evaluations.
  assert [a for e, a in thrice.curve if e in (1.0, 2.0)] == (
      thrice.eval_accuracy_per_epoch)
  assert len(set(a for _, a in thrice.curve)) > 1  # a curve, not a constant


def test_within_epoch_accuracy_is_keras_accuracy():
  result = _train(1)
  evaluation = _data(seed=1).batch(20).map(lambda d: ({'x': d['x']}, d['y']))
  assert centralized._accuracy(result.model, evaluation) == pytest.approx(
      result.model.evaluate(evaluation, verbose=0, return_dict=True)[
          'accuracy'])
  # The test accuracy is the trained model's on the test data.
  test = _data(seed=2).batch(20).map(lambda d: ({'x': d['x']}, d['y']))
  assert result.test_accuracy == pytest.approx(
      centralized._accuracy(result.model, test))


def test_bad_evals_per_epoch_is_refused():
  with pytest.raises(ValueError, match='evals_per_epoch must be >= 1'):
    centralized.train_centralized(_model(), _data().batch(6), None, epochs=1,
                                  learning_rate=0.1, evals_per_epoch=0)
  with pytest.raises(ValueError, match='known, finite cardinality'):
    centralized.train_centralized(
        _model(), _data().batch(6).filter(lambda d: True),
        _data().batch(6), epochs=1, learning_rate=0.1, evals_per_epoch=2)
