"""Tests of the stateful-client process: types, privacy invariant, FedAvg reduction.

The privacy invariant on the types of every registered algorithm is checked
by `conformance_test`, on the processes it builds.
"""

import collections

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tests import fedembed_testdata
from tff_personal.core import process
from tff_personal.models import fedembed_mnist

SPEC = collections.OrderedDict(
    x=tf.TensorSpec([None, 28, 28, 1], tf.float32),
    y=tf.TensorSpec([None], tf.int32))


def model_fn(embedding_dim):
  # The paper's model with a small encoder (`fedembed_testdata.tiny_encoder`).
  return lambda: fedembed_mnist.build_preference_model(
      embedding_dim, input_spec=SPEC,
      encoder_fn=fedembed_testdata.tiny_encoder)


def make_datasets(num_clients, seed, n=20, batch=10):
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(num_clients):
    data = collections.OrderedDict(
        x=rng.random((n, 28, 28, 1), dtype=np.float32),
        y=rng.integers(0, 2, n).astype(np.int32))
    out.append(tf.data.Dataset.from_tensor_slices(data).batch(batch))
  return out


def client_states(num_clients, dim, seed=0):
  rng = np.random.default_rng(seed)
  return [collections.OrderedDict(
      private=((rng.normal(size=dim) * 0.1).astype(np.float32),) if dim else (),
      rounds_participated=np.int32(0)) for _ in range(num_clients)]


class SpyFactory(tff.aggregators.WeightedAggregationFactory):
  """A weighted mean that records the value type it is asked to aggregate."""

  def __init__(self):
    self.value_types = []
    self._inner = tff.aggregators.MeanFactory()

  def create(self, value_type, weight_type):
    self.value_types.append(value_type)
    return self._inner.create(value_type, weight_type)


def build(dim, **kwargs):
  kwargs.setdefault('client_optimizer', tff.learning.optimizers.build_adam(1e-3))
  kwargs.setdefault('server_optimizer', tff.learning.optimizers.build_sgdm(1.0))
  return process.build_split_model_process(model_fn(dim), seed=3, **kwargs)


def test_type_signature_keeps_client_state_at_clients():
  spy = SpyFactory()
  proc = build(28, aggregator_factory=spy)
  param = proc.next.type_signature.parameter
  result = proc.next.type_signature.result
  private_type = tff.TensorType(np.float32, [28])
  assert param[0].placement is tff.SERVER
  assert param[1].placement is tff.CLIENTS
  assert param[1].member == proc.client_state_type
  assert result[0].placement is tff.SERVER
  assert result[1].placement is tff.CLIENTS
  assert result[1].member == proc.client_state_type
  assert result[2].placement is tff.SERVER
  assert list(proc.client_state_type.private) == [private_type]
  # The server state holds the shared weights only: a head over the
  # features and the 28 embedding inputs, but no [28] personal embedding
  # tensor.
  server_weights = param[0].member.global_model_weights.trainable
  assert private_type not in list(server_weights)
  # The only thing aggregated is the shared update, with the shared shapes.
  assert len(spy.value_types) == 1
  agg_type = spy.value_types[0]
  assert agg_type == proc.aggregation_value_type
  assert list(agg_type) == list(server_weights)
  assert private_type not in list(agg_type)
  with tf.Graph().as_default():
    model = model_fn(28)()
    shared_shapes = [tuple(v.shape) for v in model.shared_trainable_variables]
  assert [tuple(t.shape) for t in agg_type] == shared_shapes


def test_private_state_is_trained_and_only_for_participants():
  proc = build(28)
  state = proc.initialize()
  states = client_states(3, 28)
  before = [s['private'][0].copy() for s in states]
  _, new_states, metrics = proc.next(state, states, make_datasets(3, 0))
  for old, new in zip(before, new_states):
    assert new['rounds_participated'] == 1
    assert not np.allclose(old, new['private'][0])
  assert metrics['train']['clients'] == 3
  assert metrics['train']['num_examples'] == 60
  assert metrics['train']['nonfinite'] == 0


def test_degenerate_case_equals_tff_weighted_fed_avg():
  """No private parameters: exactly `tff.learning.algorithms.build_weighted_fed_avg`."""
  client_opt = tff.learning.optimizers.build_adam(1e-3)
  server_opt = tff.learning.optimizers.build_adam(0.05)
  proc = build(0, client_optimizer=client_opt, server_optimizer=server_opt)

  def tff_model_fn():
    keras_model = model_fn(0)().model
    return tff.learning.models.from_keras_model(
        keras_model, input_spec=SPEC,
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))

  fedavg = tff.learning.algorithms.build_weighted_fed_avg(
      tff_model_fn, client_optimizer_fn=client_opt,
      server_optimizer_fn=server_opt)
  ours = proc.initialize()
  theirs = fedavg.set_model_weights(fedavg.initialize(),
                                    proc.get_model_weights(ours))
  states = client_states(4, 0)
  for r in range(3):
    data = make_datasets(4, seed=r, n=20 + 5 * r)
    ours, states, ours_metrics = proc.next(ours, states, data)
    out = fedavg.next(theirs, data)
    theirs = out.state
  ours_w = proc.get_model_weights(ours).trainable
  theirs_w = fedavg.get_model_weights(theirs).trainable
  assert len(ours_w) == len(theirs_w)
  moved = 0.0
  init = proc.get_model_weights(proc.initialize()).trainable
  for a, b, c in zip(ours_w, theirs_w, init):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    moved += float(np.abs(a - c).sum())
  assert moved > 1.0  # the models trained; equality is not of two no-ops
  np.testing.assert_allclose(
      ours_metrics['train']['loss'], out.metrics['client_work']['train']['loss'],
      rtol=1e-5)


def test_nonfinite_client_is_left_out_and_keeps_its_state():
  proc = build(28)
  state = proc.initialize()
  data = make_datasets(3, 1)
  bad = collections.OrderedDict(
      x=np.full((20, 28, 28, 1), np.nan, np.float32),
      y=np.zeros(20, np.int32))
  bad_ds = tf.data.Dataset.from_tensor_slices(bad).batch(10)
  states = client_states(3, 28)
  s_clean, _, _ = proc.next(state, states[:2], data[:2])
  s_bad, new_states, metrics = proc.next(
      state, states[:2] + [states[2]], data[:2] + [bad_ds])
  assert metrics['train']['nonfinite'] == 1
  assert metrics['train']['num_examples'] == 40
  np.testing.assert_array_equal(new_states[2]['private'][0],
                                states[2]['private'][0])
  for a, b in zip(proc.get_model_weights(s_clean).trainable,
                  proc.get_model_weights(s_bad).trainable):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_set_model_weights_round_trips():
  proc = build(0)
  state = proc.initialize()
  weights = proc.get_model_weights(state)
  doubled = tff.learning.models.ModelWeights(
      trainable=tuple(2 * w for w in weights.trainable), non_trainable=())
  state2 = proc.set_model_weights(state, doubled)
  for a, b in zip(proc.get_model_weights(state2).trainable, doubled.trainable):
    np.testing.assert_array_equal(a, b)
  # And the process accepts it.
  proc.next(state2, client_states(1, 0), make_datasets(1, 0))


def test_bad_aggregator_is_rejected():
  with pytest.raises(TypeError, match='aggregator_factory'):
    build(0, aggregator_factory=object())


def test_computations_are_built_on_first_use_and_sharding_skips_them():
  """A sharded run rewires the composition: the one-user process's
  aggregator and `next` are never built. Its types are known before."""
  from tff_personal.core import sharded  # pylint: disable=g-import-not-at-top
  spy = SpyFactory()
  proc = build(28, aggregator_factory=spy)
  assert not spy.value_types  # nothing built yet
  weights_type, data_type = proc.model_weights_type, proc.client_data_type
  train = sharded.ShardedProcess(proc, 2)
  train.initialize()
  assert len(spy.value_types) == 1  # the sharded form's aggregator only
  # Built on first use, with the types given before.
  param = proc.next.type_signature.parameter
  assert len(spy.value_types) == 2
  assert param[0].member.global_model_weights == weights_type
  assert param[2].member == data_type
  assert proc.state_type == param[0]


def test_a_process_needs_its_computations_or_a_builder():
  proc = build(0)
  with pytest.raises(ValueError, match='either initialize_fn and next_fn'):
    process.StatefulClientProcess(
        None, None, client_state_type=proc.client_state_type,
        aggregation_value_type=proc.aggregation_value_type)
  with pytest.raises(ValueError, match='needs its composition'):
    process.StatefulClientProcess(
        None, None, build_fn=lambda: None,
        client_state_type=proc.client_state_type,
        aggregation_value_type=proc.aggregation_value_type)
