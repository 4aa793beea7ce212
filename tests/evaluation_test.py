"""Personalized evaluation computes what the Keras model computes, per client."""

import collections

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tff_personal.core import evaluation
from tff_personal.core import process
from tff_personal.models import fedembed_mnist

SPEC = collections.OrderedDict(
    x=tf.TensorSpec([None, 28, 28, 1], tf.float32),
    y=tf.TensorSpec([None], tf.int32))


def test_personal_eval_uses_each_clients_private_state():
  model_fn = lambda: fedembed_mnist.build_preference_model(28, input_spec=SPEC)
  weights = process.initial_shared_weights(model_fn, seed=5)
  weights_type = process.model_weights_type(weights)
  state_type = process.split_client_state_type(model_fn)
  personal_eval = evaluation.build_personal_eval(model_fn, weights_type,
                                                 state_type)
  rng = np.random.default_rng(0)
  xs = [rng.random((7, 28, 28, 1), dtype=np.float32) for _ in range(2)]
  ys = [rng.integers(0, 2, 7).astype(np.int32) for _ in range(2)]
  embeddings = [rng.normal(size=28).astype(np.float32) for _ in range(2)]
  states = [collections.OrderedDict(private=(e,), rounds_participated=np.int32(1))
            for e in embeddings]
  data = [tf.data.Dataset.from_tensor_slices(
      collections.OrderedDict(x=x, y=y)).batch(3) for x, y in zip(xs, ys)]
  out = personal_eval(weights, states, data)

  model = model_fn()
  for v, w in zip(model.shared_trainable_variables, weights.trainable):
    v.assign(w)
  for i in range(2):
    model.private_variables[0].assign(embeddings[i])
    expected = model.model(xs[i], training=False).numpy()
    np.testing.assert_allclose(out[i]['outputs'], expected, rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_array_equal(out[i]['labels'], ys[i])
  # Different private states give different outputs on the same data.
  assert not np.allclose(
      personal_eval(weights, states[:1], data[1:])[0]['outputs'],
      out[1]['outputs'])


def test_binary_metrics_against_sklearn():
  metrics = pytest.importorskip('sklearn.metrics')
  rng = np.random.default_rng(1)
  labels = rng.integers(0, 2, 200)
  scores = np.round(rng.normal(size=200) + labels, 1)  # ties on purpose
  preds = (scores > 0.5).astype(int)
  assert evaluation.binary_f1(labels, preds) == pytest.approx(
      metrics.f1_score(labels, preds))
  assert evaluation.roc_auc(labels, scores) == pytest.approx(
      metrics.roc_auc_score(labels, scores))
  assert evaluation.binary_f1([0, 0], [0, 0]) == 0.0


def test_macro_f1_matches_sklearn_and_prices_constant_answers_at_a_third():
  from sklearn import metrics  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(1)
  for _ in range(20):
    labels = rng.integers(0, 2, size=10)
    preds = rng.integers(0, 2, size=10)
    assert evaluation.macro_f1(labels, preds) == pytest.approx(
        metrics.f1_score(labels, preds, average='macro', labels=[0, 1],
                         zero_division=0))
  labels = np.array([1] * 5 + [0] * 5)
  # Either constant answer: 1/3 averaged over labels; F1 of "like" 2/3 or 0.
  for constant, like_f1 in ((1, 2 / 3), (0, 0.0)):
    preds = np.full(10, constant)
    assert evaluation.macro_f1(labels, preds) == pytest.approx(1 / 3)
    assert evaluation.binary_f1(labels, preds) == pytest.approx(like_f1)
  assert evaluation.macro_f1(labels, labels) == 1.0
  assert evaluation.macro_f1(labels, 1 - labels) == 0.0


def test_preference_metrics_average_users_then_groups():
  # Group 0: users with F1 1.0 and 0.0; group 1: one user with F1 0.5.
  def client(labels, preds):
    logits = np.stack([1 - np.asarray(preds), np.asarray(preds)], -1)
    return {'outputs': logits.astype(np.float32), 'labels': np.asarray(labels)}
  per_client = [client([1, 0], [1, 0]), client([1, 0], [0, 1]),
                client([1, 1, 0, 0], [1, 0, 0, 0])]
  m = evaluation.preference_metrics(per_client, [0, 0, 1])
  assert m['f1_per_group'] == {0: 0.5, 1: pytest.approx(2 / 3)}
  assert m['f1'] == pytest.approx((0.5 + 2 / 3) / 2)
  assert m['f1_user_mean'] == pytest.approx((1 + 0 + 2 / 3) / 3)
  assert m['accuracy'] == m['accuracy_pooled'] == pytest.approx(5 / 8)
  # Per user: 1.0, 0.0 and 0.75, then their mean.
  assert m['accuracy_client_mean'] == pytest.approx((1 + 0 + 0.75) / 3)
  # Macro F1 per user: 1.0, 0.0, (2/3 + 0.8) / 2; then groups, then mean.
  assert m['f1_macro_per_group'] == {0: 0.5,
                                     1: pytest.approx((2 / 3 + 0.8) / 2)}
  assert m['f1_macro'] == pytest.approx((0.5 + (2 / 3 + 0.8) / 2) / 2)
  with pytest.raises(ValueError, match='differ in length'):
    evaluation.preference_metrics(per_client, [0])


def test_eval_reads_the_input_spec_without_building_a_model_again():
  builds = []

  def model_fn():
    builds.append(1)
    return fedembed_mnist.build_preference_model(28, input_spec=SPEC)

  weights = process.initial_shared_weights(model_fn, seed=5)
  state_type = process.split_client_state_type(model_fn)
  assert len(builds) == 1  # The weights' model gave the types too.
  evaluation.build_personal_eval(
      model_fn, process.model_weights_type(weights), state_type)
  assert len(builds) == 2  # Only the computation's own model.
  assert process.model_input_spec(model_fn) == SPEC
