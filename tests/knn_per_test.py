"""kNN-Per: with lam 0 its evaluation is FedAvg's; otherwise its
predictions are the mixture of the global model's and a kNN over the first
`capacity` training examples' features, computed here in numpy."""

import numpy as np
import tensorflow as tf

from tests import method_testdata as data
from tff_personal.algorithms import knn_per
from tff_personal.core import evaluation
from tff_personal.core import process


def _build(**options):
  return knn_per.build_knn_per(data.model_fn_factory,
                               client_optimizer=data.sgd(0.1),
                               server_optimizer=data.sgd(1.0), seed=3,
                               **options)


def _evaluate(proc, state, train, test):
  weights = proc.get_model_weights(state)
  states = process.eval_client_states(proc, weights,
                                      data.states((), len(train)))
  return evaluation.build_cold_start_eval(
      proc.eval_model_fn, proc.model_weights_type,
      proc.eval_client_state_type, proc.eval_fine_tune_optimizer)(
          weights, states, train, test)


def _softmax(z):
  z = np.exp(z - z.max(-1, keepdims=True))
  return z / z.sum(-1, keepdims=True)


def test_lam_zero_is_fedavg_and_the_mixture_is_the_knn_by_hand():
  clients = data.datasets(2, seed=1, n=8, flip=(1,))
  tests = data.datasets(2, seed=5, n=6, flip=(1,))
  proc = _build(lam=0.0)
  state, _ = data.run(proc, data.states((), 2), clients, rounds=2)
  plain = evaluation.build_personal_eval(
      proc.model_fn, proc.model_weights_type, proc.client_state_type)(
          proc.get_model_weights(state), data.states((), 2), tests)
  got = _evaluate(proc, state, clients, tests)
  for g, p in zip(got, plain):
    np.testing.assert_allclose(np.exp(g['outputs']), _softmax(p['outputs']),
                               rtol=1e-5, atol=1e-6)
  proc = _build(lam=0.5, neighbors=3, temperature=2.0, capacity=5)
  got = _evaluate(proc, state, clients, tests)
  # The same in numpy: features of the head's input, the first 5 examples.
  model = data.model_fn_factory(0)()
  for v, w in zip(model.model.trainable_variables,
                  proc.get_model_weights(state).trainable):
    v.assign(w)
  head = model.model.get_layer('head')
  both = tf.keras.Model(model.model.inputs, [head.input, model.model.output])
  for u in range(2):
    train = next(iter(clients[u].unbatch().batch(100)))
    test = next(iter(tests[u].unbatch().batch(100)))
    keys = both(train['x'])[0].numpy()[:5]
    labels = train['y'].numpy()[:5]
    features, logits = (t.numpy() for t in both(test['x']))
    d = ((features[:, None, :] - keys[None]) ** 2).sum(-1)
    near = np.argsort(d, axis=1)[:, :3]
    w = np.exp(-np.take_along_axis(d, near, 1) / 2.0)
    knn = np.zeros_like(logits)
    for i in range(len(features)):
      for j, weight in zip(near[i], w[i]):
        knn[i, labels[j]] += weight
    knn /= knn.sum(-1, keepdims=True)
    want = 0.5 * knn + 0.5 * _softmax(logits)
    np.testing.assert_allclose(np.exp(got[u]['outputs']), want, rtol=1e-4,
                               atol=1e-5)
    assert not np.allclose(want, _softmax(logits), atol=1e-3)
