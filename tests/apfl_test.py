"""APFL: the global model follows FedAvg whatever alpha; alpha fixed at 1
trains the personal model alone (one client: FedAvg's round), at 0 leaves
it and evaluates the global model; the adaptive alpha takes the step of the
mixture loss's derivative (by finite differences here)."""

import collections

import numpy as np
import tensorflow as tf

from tests import method_testdata as data
from tff_personal.algorithms import apfl
from tff_personal.algorithms import fedavg
from tff_personal.core import evaluation


def _build(**options):
  return apfl.build_apfl(data.model_fn_factory,
                         client_optimizer=data.sgd(0.1),
                         server_optimizer=data.sgd(1.0), seed=3, **options)


def _fedavg():
  return fedavg.build_global(data.model_fn_factory,
                             client_optimizer=data.sgd(0.1),
                             server_optimizer=data.sgd(1.0), seed=3)


def _start(proc, num, alpha=None):
  private = list(proc.initial_private)
  if alpha is not None:
    private[-1] = np.float32(alpha)
  return data.states(private, num)


def test_fixed_alpha_reductions():
  clients = data.datasets(3, seed=1, flip=(2,))
  want, _ = data.run(_fedavg(), data.states((), 3), clients, rounds=2)
  for alpha in (0.0, 1.0):
    proc = _build(alpha=alpha, adaptive_alpha=False)
    got, states = data.run(proc, _start(proc, 3), clients, rounds=2)
    data.assert_same(got.global_model_weights, want.global_model_weights,
                     f'alpha={alpha}: the global model')
    personal = [np.asarray(x) for x in states[0]['private'][:-1]]
    initial = [np.asarray(x) for x in proc.initial_private[:-1]]
    assert float(states[0]['private'][-1]) == alpha
    if alpha == 0.0:  # no gradient reaches the personal model
      data.assert_same(personal, initial, 'alpha=0: v')
  # alpha = 1, one client: v trains alone, which is FedAvg's round.
  proc = _build(alpha=1.0, adaptive_alpha=False)
  one = [clients[0]]
  want, _ = data.run(_fedavg(), data.states((), 1), one)
  _, states = data.run(proc, _start(proc, 1), one)
  data.assert_same(states[0]['private'][:-1],
                   want.global_model_weights.trainable, 'alpha=1: v')


def test_alpha_zero_evaluates_the_global_model():
  proc = _build(alpha=0.0, adaptive_alpha=False)
  clients = data.datasets(2, seed=4)
  state, states = data.run(proc, _start(proc, 2), clients)
  ref = _fedavg()
  ref_state, _ = data.run(ref, data.states((), 2), clients)
  got = evaluation.build_personal_eval(
      proc.model_fn, proc.model_weights_type, proc.client_state_type)(
          proc.get_model_weights(state), states, clients)
  want = evaluation.build_personal_eval(
      ref.model_fn, ref.model_weights_type, ref.client_state_type)(
          ref.get_model_weights(ref_state), data.states((), 2), clients)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g['outputs'], w['outputs'], rtol=1e-5,
                               atol=1e-6)


def test_adaptive_alpha_steps_down_the_mixture_loss():
  proc = _build(alpha=0.5, alpha_lr=0.05)
  rng = np.random.default_rng(0)
  personal = [w + 0.3 * rng.normal(size=np.shape(w)).astype(np.float32)
              for w in proc.initial_private[:-1]]
  batch = collections.OrderedDict(
      x=rng.random((4, 28, 28, 1), dtype=np.float32),
      y=np.array([0, 1, 1, 0], np.int32))
  _, states, _ = proc.next(
      proc.initialize(), data.states(personal + [np.float32(0.5)], 1),
      [tf.data.Dataset.from_tensor_slices(batch).batch(4)])
  global_w = [np.asarray(w) for w in
              proc.get_model_weights(proc.initialize()).trainable]
  model = data.model_fn_factory(0)()

  def loss(a):
    for v, p, g in zip(model.model.trainable_variables, personal, global_w):
      v.assign(a * p + (1 - a) * g)
    return float(model.loss(batch, model.forward(batch, training=False)))

  eps = 1e-3
  derivative = (loss(0.5 + eps) - loss(0.5 - eps)) / (2 * eps)
  assert abs(derivative) > 1e-3
  np.testing.assert_allclose(float(states[0]['private'][-1]),
                             0.5 - 0.05 * derivative, rtol=0, atol=1e-3)
