"""The experiment's client and server optimizers do what their flags say."""

import re

import numpy as np
import pytest
import tensorflow as tf

from tff_personal.config import experiment


def _config(**kw):
  values = dict(algorithm='global', rounds=1, clients_per_round=1,
                root_output_dir='/tmp', experiment_name='x')
  values.update(kw)
  return experiment.ExperimentConfig(**values)


def _steps(optimizer, grads, x0):
  """Applies `optimizer` to the gradient sequence `grads` from `x0`."""
  x = (tf.constant(x0),)
  state = optimizer.initialize((tf.TensorSpec(x0.shape, tf.float32),))
  for g in grads:
    state, x = optimizer.next(state, x, (tf.constant(g),))
  return x[0].numpy()


def test_server_momentum_is_heavy_ball():
  x0 = np.array([1.0, -2.0], np.float32)
  g1 = np.array([0.5, 1.0], np.float32)
  g2 = np.array([-1.0, 0.25], np.float32)
  opt = experiment.make_server_optimizer('sgd', 0.5, 0.9)
  # m1 = g1, m2 = 0.9 m1 + g2; x2 = x0 - lr (m1 + m2).
  expected = x0 - 0.5 * (g1 + (0.9 * g1 + g2))
  np.testing.assert_allclose(_steps(opt, [g1, g2], x0), expected, rtol=1e-6)
  plain = experiment.make_server_optimizer('sgd', 0.5)
  np.testing.assert_allclose(_steps(plain, [g1, g2], x0),
                             x0 - 0.5 * (g1 + g2), rtol=1e-6)


@pytest.mark.parametrize('name,momentum,message', [
    ('sgd', 1.0, 'server_momentum must be in [0, 1)'),
    ('sgd', -0.1, 'server_momentum must be in [0, 1)'),
    ('adam', 0.9, "applies to server_optimizer='sgd' only"),
    ('rmsprop', 0.0, "server_optimizer must be 'adam' or 'sgd'"),
])
def test_bad_server_optimizer_is_named(name, momentum, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    experiment.make_server_optimizer(name, 1.0, momentum)


def test_client_sgd_steps_along_the_gradient_and_adam_does_not():
  x0 = np.array([1.0, -2.0, 0.0], np.float32)
  g = np.array([1e-3, 2.0, -0.5], np.float32)
  sgd = experiment.make_client_optimizer(
      _config(client_optimizer='sgd', client_learning_rate=0.1))
  np.testing.assert_allclose(_steps(sgd, [g], x0), x0 - 0.1 * g, rtol=1e-6)
  # Adam's first step moves every coordinate by about the learning rate.
  adam = experiment.make_client_optimizer(
      _config(client_optimizer='adam', client_learning_rate=0.1))
  np.testing.assert_allclose(_steps(adam, [g], x0), x0 - 0.1 * np.sign(g),
                             rtol=1e-4)


def test_unknown_client_optimizer_fails_validation():
  with pytest.raises(ValueError, match="client_optimizer must be 'adam' or "
                     "'sgd', got 'lamb'"):
    experiment.validate(_config(client_optimizer='lamb'), population=10)
