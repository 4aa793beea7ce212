"""FedEmbed: FedAvg reduction, head masking, DP over all heads, assignment, privacy."""

import collections

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tests import fedembed_testdata
from tff_personal.algorithms import fedembed
from tff_personal.core import privacy
from tff_personal.core import process
from tff_personal.models import fedembed as fedembed_model
from tff_personal.models import fedembed_mnist

SPEC = fedembed_testdata.SPEC
factory = fedembed_testdata.factory
datasets = fedembed_testdata.datasets


def initial_states(proc, num, seed=0):
  specs = tff.types.type_to_tf_tensor_specs(proc.client_state_type)
  rng = np.random.default_rng(seed)
  def init(spec):
    if spec.dtype.is_floating:
      return rng.uniform(-1, 1, spec.shape).astype(spec.dtype.as_numpy_dtype)
    return np.zeros(spec.shape, spec.dtype.as_numpy_dtype)
  return [tf.nest.map_structure(init, specs) for _ in range(num)]


def build(assignment, optimizer=None, **kwargs):
  return fedembed.build_fedembed(
      factory, assignment=assignment,
      client_optimizer=optimizer or tff.learning.optimizers.build_sgdm(0.05),
      server_optimizer=tff.learning.optimizers.build_sgdm(1.0), seed=4,
      **kwargs)


_NOT_ENCODER = ('heads/', 'type_head/', 'global_head/', 'prototypes/')


def _named_weights(proc, state):
  with tf.Graph().as_default():
    model = proc.model_fn()
    names = [v.name for v in model.shared_trainable_variables]
  return dict(zip(names, proc.get_model_weights(state).trainable))


def test_one_subpopulation_without_embedding_is_fedavg():
  """K=1, no embedding: encoder + head train exactly as TFF's FedAvg."""
  config = fedembed_model.FedEmbedConfig(num_subpopulations=1,
                                         embedding_dim=0, assignment='type')
  client_opt = tff.learning.optimizers.build_sgdm(0.05)
  proc = process.build_split_model_process(
      factory(config), client_optimizer=client_opt,
      server_optimizer=tff.learning.optimizers.build_sgdm(1.0), seed=4)
  plain_spec = collections.OrderedDict(x=SPEC['x'], y=SPEC['y'])

  def tff_model_fn():
    return tff.learning.models.from_keras_model(
        fedembed_mnist.build_preference_model(0).model, input_spec=plain_spec,
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))

  fedavg = tff.learning.algorithms.build_weighted_fed_avg(
      tff_model_fn, client_optimizer_fn=client_opt,
      server_optimizer_fn=tff.learning.optimizers.build_sgdm(1.0))
  ours = proc.initialize()
  named = _named_weights(proc, ours)
  encoder = [w for n, w in named.items() if not n.startswith(_NOT_ENCODER)]
  assert len(encoder) == 12  # 3 x (conv kernel, bias, LayerNorm gamma, beta)
  heads = named['heads/kernel:0'][0], named['heads/bias:0'][0]
  theirs = fedavg.set_model_weights(
      fedavg.initialize(),
      tff.learning.models.ModelWeights(trainable=tuple(encoder) + heads,
                                       non_trainable=()))
  states = initial_states(proc, 3)
  for r in range(2):
    data = datasets([0, 0, 0], seed=r, other=0)  # one type: L_M is 0
    ours, states, _ = proc.next(ours, states, data)
    theirs = fedavg.next(
        theirs, [d.map(lambda b: collections.OrderedDict(x=b['x'], y=b['y']))
                 for d in data]).state
  named = _named_weights(proc, ours)
  ours_flat = [w for n, w in named.items()
               if not n.startswith(_NOT_ENCODER)] + [
      named['heads/kernel:0'][0], named['heads/bias:0'][0]]
  for a, b in zip(ours_flat, fedavg.get_model_weights(theirs).trainable):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  # The type head with K=1 has zero loss, so it never moved.
  init = _named_weights(proc, proc.initialize())
  np.testing.assert_array_equal(named['type_head/kernel:0'],
                                init['type_head/kernel:0'])


@pytest.mark.parametrize('assignment', ['type', 'prototype'])
def test_unused_heads_get_zero_update(assignment):
  proc = build(assignment)
  state = proc.initialize()
  before = _named_weights(proc, state)
  states = initial_states(proc, 2)
  state, new_states, _ = proc.next(state, states, datasets([3, 3]))
  after = _named_weights(proc, state)
  moved = np.abs(after['heads/kernel:0'] - before['heads/kernel:0']).sum(
      axis=(1, 2))
  if assignment == 'type':
    # Both clients identified sub-population 3 from their data.
    assert [int(s['private'][1]) for s in new_states] == [3, 3]
    assert moved[3] > 0
    assert np.all(moved[np.arange(10) != 3] == 0)
  else:
    heads = sorted({int(s['private'][2]) for s in new_states})
    assert np.flatnonzero(moved).tolist() == heads  # one head per client


def test_dp_covers_every_head():
  dp = privacy.DPConfig(mechanism='gaussian_fixed', noise_multiplier=1.0,
                        clip_norm=1.0, clients_per_round=2, population=10)
  proc = build('type', aggregator_factory=privacy.build_aggregator(dp))
  # The DP aggregator sees the full [K, 92, 2] kernel, unused heads included.
  shapes = [tuple(t.shape) for t in proc.aggregation_value_type]
  assert (10, 92, 2) in shapes
  state = proc.initialize()
  before = _named_weights(proc, state)
  state, _, _ = proc.next(state, initial_states(proc, 2), datasets([3, 3]))
  moved = np.abs(_named_weights(proc, state)['heads/kernel:0'] -
                 before['heads/kernel:0']).sum(axis=(1, 2))
  assert np.all(moved > 0)  # noise reached the heads nobody used


def test_prototype_assignment_recovers_known_subpopulations():
  """Two groups of clients; the triplet loss pulls each to its prototype."""
  proc = build('prototype',
               optimizer=tff.learning.optimizers.build_sgdm(0.2))
  state = proc.initialize()
  states = initial_states(proc, 4, seed=1)
  groups = [2, 2, 7, 7]
  for r in range(6):
    state, states, _ = proc.next(state, states, datasets(groups, seed=r))
  protos = _named_weights(proc, state)['prototypes/vectors:0']
  for s, g in zip(states, groups):
    e = s['private'][0]
    nearest = int(np.argmin(((protos - e) ** 2).sum(-1)))
    assert int(s['private'][1]) == g  # identified from its own data
    assert nearest == g               # and nearest to that prototype


def test_personal_embeddings_never_reach_a_server_value():
  for assignment in ('prototype', 'type', 'personal'):
    proc = build(assignment)
    sig = proc.next.type_signature
    private = list(proc.client_state_type.private)
    assert sig.result[1].placement is tff.CLIENTS
    shared = list(sig.result[0].member.global_model_weights.trainable)
    assert list(proc.aggregation_value_type) == shared
    for t in private:
      if t.dtype == np.float32 and t.shape == (28,):
        assert t not in shared  # the personal embedding
    if assignment == 'personal':
      assert tff.TensorType(np.float32, [92, 2]) in private
      assert tff.TensorType(np.float32, [10, 92, 2]) not in shared


def test_triplet_steps_bring_new_users_to_their_own_prototype():
  """Algorithm 1 line 10 before line 11: a new user's embedding (near 0) is
  nearest to its positive prototype after the triplet steps, for every
  sub-population (without them, every new user lands on one prototype)."""
  rng = np.random.default_rng(0)
  protos = rng.uniform(-1, 1, (10, 28)).astype(np.float32)
  before, after = set(), []
  for positive in range(10):
    e = (rng.normal(size=28) * 0.1).astype(np.float32)
    before.add(int(np.argmin(np.sum((e[None] - protos) ** 2, -1))))
    moved = fedembed_model.triplet_steps(
        tf.constant(e), tf.constant(protos), tf.constant(positive), 1.0, 5,
        0.1).numpy()
    after.append(int(np.argmin(np.sum((moved[None] - protos) ** 2, -1))))
  assert after == list(range(10))
  # Near 0, new users share a few small-norm prototypes instead.
  assert len(before) < 10


def test_triplet_steps_leave_a_satisfied_embedding_alone():
  protos = np.eye(3, dtype=np.float32) * 5.0
  e = protos[1].copy()  # d_pos = 0, d_neg = 50: the hinge is inactive
  moved = fedembed_model.triplet_steps(
      tf.constant(e), tf.constant(protos), tf.constant(1), 1.0, 5, 0.1)
  np.testing.assert_array_equal(moved.numpy(), e)


def test_assigned_head_mean_is_each_heads_mean_over_its_users():
  """head_mean='assigned': a head moves by the mean over the clients that
  used it, i.e. by `cohort / share`; everything else as the paper's
  cohort mean, and the shares carry no weight of their own."""
  clients = datasets([3, 3, 5, 7, 7, 7])  # shares 2/6, 1/6, 3/6
  cohort, assigned = build('type'), build('type', head_mean='assigned')
  states = initial_states(cohort, 6)
  start = _named_weights(cohort, cohort.initialize())
  state = assigned.set_model_weights(
      assigned.initialize(), process.ModelWeights(
          trainable=tuple(start[n] if n in start else np.zeros(10, np.float32)
                          for n in _named_weights(
                              assigned, assigned.initialize())),
          non_trainable=assigned.get_model_weights(
              assigned.initialize()).non_trainable))
  want = _named_weights(cohort, cohort.next(cohort.initialize(), states,
                                            clients)[0])
  got = _named_weights(assigned, assigned.next(state, states, clients)[0])
  share = np.zeros(10)
  share[[3, 5, 7]] = [2 / 6, 1 / 6, 3 / 6]
  for name in ('heads/kernel:0', 'heads/bias:0'):
    moved = want[name] - start[name]
    scaled = np.where(share.reshape((-1,) + (1,) * (moved.ndim - 1)) > 0,
                      moved / np.maximum(share, 1e-9).reshape(
                          (-1,) + (1,) * (moved.ndim - 1)), 0)
    np.testing.assert_allclose(got[name] - start[name], scaled, rtol=1e-4,
                               atol=1e-6)
  for name in start:
    if not name.startswith('heads/'):
      np.testing.assert_allclose(got[name], want[name], rtol=1e-5,
                                 atol=1e-6)
  shares = [v for n, v in got.items() if n.startswith('head_shares')]
  assert len(shares) == 1 and not np.any(shares[0])
