"""FedEmbed's baselines FedRep, pFedMe, PFedKM: reductions to FedAvg, the
Moreau inner problem, k-means assignment of a known population, privacy."""

import collections

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tests import fedembed_testdata
from tff_personal.algorithms import fedrep
from tff_personal.algorithms import pfedkm
from tff_personal.algorithms import pfedme
from tff_personal.algorithms import registry
from tff_personal.config import experiment
from tff_personal.core import privacy
from tff_personal.core import process
from tff_personal.core import split_training
from tff_personal.evaluation import run_evaluation
from tff_personal.models import fedembed as fedembed_model
from tff_personal.models import fedembed_mnist
from tff_personal.models import personal_head

SPEC = collections.OrderedDict(
    x=tf.TensorSpec([None, 28, 28, 1], tf.float32),
    y=tf.TensorSpec([None], tf.int32),
    type=tf.TensorSpec([None], tf.int32))
PLAIN_SPEC = collections.OrderedDict(x=SPEC['x'], y=SPEC['y'])


# The paper's models with a small encoder (`fedembed_testdata.tiny_encoder`):
# its feature count and trainable tensors.
FEATURES = fedembed_testdata.TINY_FEATURES
ENCODER = fedembed_testdata.TINY_ENCODER_TENSORS


def model_fn_factory(dim):
  return lambda: fedembed_mnist.build_preference_model(
      dim, input_spec=SPEC, encoder_fn=fedembed_testdata.tiny_encoder)


def fedembed_factory(config):
  return lambda: fedembed_model.build_fedembed_model(
      fedembed_testdata.with_k(config),
      encoder_fn=fedembed_testdata.tiny_encoder, input_spec=SPEC)


def sgd(lr):
  return tff.learning.optimizers.build_sgdm(lr)


def datasets(num, seed=0, n=4, flip=()):
  """Random images; label 1 for bright-left images (flipped for `flip`)."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(num):
    x = rng.random((n, 28, 28, 1), dtype=np.float32) * 0.2
    kind = np.arange(n) % 2
    x[kind == 1, :, :14] += 0.8
    y = (kind if i not in flip else 1 - kind).astype(np.int32)
    out.append(tf.data.Dataset.from_tensor_slices(collections.OrderedDict(
        x=x, y=y, type=np.zeros(n, np.int32))).batch(n // 2))
  return out


initial_states = fedembed_testdata.initial_states


def fedavg_process(client_opt):
  def tff_model_fn():
    return tff.learning.models.from_keras_model(
        model_fn_factory(0)().model,
        input_spec=PLAIN_SPEC,
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  return tff.learning.algorithms.build_weighted_fed_avg(
      tff_model_fn, client_optimizer_fn=client_opt,
      server_optimizer_fn=sgd(1.0))


ROUNDS, CLIENTS = 2, 3


def run_fedavg(initial, client_opt):
  """TFF's FedAvg from `initial` (trainable list) on the tests' data."""
  fedavg = fedavg_process(client_opt)
  state = fedavg.set_model_weights(
      fedavg.initialize(), tff.learning.models.ModelWeights(
          trainable=tuple(initial), non_trainable=()))
  for r in range(ROUNDS):
    state = fedavg.next(state, [d.map(lambda b: collections.OrderedDict(
        x=b['x'], y=b['y'])) for d in datasets(CLIENTS, seed=r)]).state
  return list(fedavg.get_model_weights(state).trainable)


@pytest.fixture(scope='module')
def fedavg_reference():
  """FedAvg (SGD 0.05) from the task model's seed-2 initial weights."""
  initial = process.initial_shared_weights(model_fn_factory(0), seed=2)
  return list(initial.trainable), run_fedavg(initial.trainable, sgd(0.05))


def run_both(proc, as_fedavg, client_opt, reference=None):
  """Runs `proc` and TFF's FedAvg from the same weights on the same data."""
  ours = proc.initialize()
  start = as_fedavg(ours.global_model_weights.trainable)
  if reference is None:
    theirs = run_fedavg(start, client_opt)
  else:
    for a, b in zip(start, reference[0]):
      np.testing.assert_array_equal(a, b)  # the reference's start
    theirs = reference[1]
  states = initial_states(proc, CLIENTS)
  for r in range(ROUNDS):
    ours, states, _ = proc.next(ours, states, datasets(CLIENTS, seed=r))
  return as_fedavg(ours.global_model_weights.trainable), theirs, states


def max_relative_error(a, b):
  return max(float(np.max(np.abs(x - y)) / (np.max(np.abs(y)) + 1e-12))
             for x, y in zip(a, b))


# --- FedRep -------------------------------------------------------------------

def test_fedrep_without_personal_head_is_fedavg(fedavg_reference):
  opt = sgd(0.05)
  proc = fedrep.build_fedrep(model_fn_factory, client_optimizer=opt,
                             server_optimizer=sgd(1.0), seed=2,
                             head_layer=None)
  ours, theirs, _ = run_both(proc, list, opt, fedavg_reference)
  for a, b in zip(ours, theirs):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_fedrep_trains_the_head_first_and_keeps_it_private():
  proc = fedrep.build_fedrep(model_fn_factory, client_optimizer=sgd(0.05),
                             server_optimizer=sgd(1.0), seed=2,
                             head_epochs=3)
  head = [tff.TensorType(np.float32, [FEATURES, 2]), tff.TensorType(np.float32, [2])]
  assert list(proc.client_state_type.private) == head
  shared = list(proc.aggregation_value_type)
  assert len(shared) == ENCODER and not set(map(str, head)) & set(map(str, shared))
  state = proc.initialize()
  states = initial_states(proc, 2)
  data = datasets(2)
  new_state, new_states, _ = proc.next(state, states, data)
  # Reproduce client 0 by hand: head passes (body frozen), then body pass.
  model = proc.model_fn()
  split_training.assign_weights(model, state.global_model_weights,
                                tuple(states[0]['private']))
  opt = sgd(0.05)
  head_vars = model.private_trainable_variables
  for batch in data[0].repeat(3):  # SGD: restarting its state is a no-op
    with tf.GradientTape() as tape:
      loss = model.loss(batch, model.forward(batch, training=True))
    grads = tape.gradient(loss, head_vars)
    for v, g in zip(head_vars, grads):
      v.assign_sub(0.05 * g)
  for v, e in zip(head_vars, new_states[0]['private']):
    np.testing.assert_allclose(v.numpy(), e, rtol=1e-4, atol=1e-6)
  del opt, new_state


def test_fedrep_refuses_a_model_with_nothing_shared_to_train():
  def frozen_body_fn():
    base = model_fn_factory(0)()
    for layer in base.model.layers:
      if layer.name != 'head':
        layer.trainable = False
    return base

  assert frozen_body_fn().shared_trainable_variables  # The head, shared.
  with pytest.raises(ValueError, match='no shared trainable variable'):
    personal_head.personal_head_model_fn(frozen_body_fn)()
  # The same model with a trainable body is accepted.
  assert personal_head.personal_head_model_fn(model_fn_factory(0))(
      ).shared_trainable_variables


# --- pFedMe -------------------------------------------------------------------

def _pfedme(lam, inner_steps=2, inner_lr=None, **kwargs):
  return pfedme.build_pfedme(
      model_fn_factory, client_optimizer=sgd(0.05),
      server_optimizer=sgd(1.0), seed=2, lam=lam, inner_steps=inner_steps,
      inner_learning_rate=inner_lr or 1.0 / lam, **kwargs)


def test_pfedme_tends_to_fedavg_as_lambda_grows(fedavg_reference):
  """lambda -> inf with inner steps at 1/lambda: theta -> w, pFedMe -> FedAvg."""
  errors = {}
  for lam in (1.0, 1e4):
    proc = _pfedme(lam)
    ours, theirs, _ = run_both(proc, list, sgd(0.05), fedavg_reference)
    errors[lam] = max_relative_error(ours, theirs)
  assert errors[1e4] < 1e-2, errors
  assert errors[1.0] > 10 * errors[1e4], errors


def test_pfedme_personal_head_solves_the_moreau_inner_problem():
  """With many inner steps theta satisfies grad f(theta) + lam(theta - w) = 0."""
  lam = 15.0
  proc = _pfedme(lam, inner_steps=60, inner_lr=0.05)
  state = proc.initialize()
  data = datasets(1, n=4)
  one_batch = data[0].unbatch().batch(4)
  _, new_states, _ = proc.next(state, initial_states(proc, 1), [one_batch])
  theta = tuple(new_states[0]['private'])
  model = proc.model_fn()
  split_training.assign_weights(model, state.global_model_weights, theta)
  batch = next(iter(one_batch))
  with tf.GradientTape() as tape:
    loss = model.loss(batch, model.forward(batch, training=True))
  grads = tape.gradient(loss, model.private_trainable_variables)
  assert max(float(tf.reduce_max(tf.abs(g))) for g in grads) < 1e-3
  # ... and it is not the global head (the problem is not trivial).
  w = state.global_model_weights.trainable
  assert np.max(np.abs(theta[0] - w[-2])) > 1e-3
  # The first participation starts theta from the global head, not the
  # stored random state: with tiny inner steps theta stays at w.
  big = _pfedme(1e4, inner_lr=1e-6)
  _, s, _ = big.next(big.initialize(), initial_states(big, 1), [one_batch])
  np.testing.assert_allclose(s[0]['private'][0],
                             big.initialize().global_model_weights
                             .trainable[-2], atol=5e-3)


def _with_rounds(states, rounds):
  return [collections.OrderedDict(private=s['private'],
                                  rounds_participated=np.int32(rounds))
          for s in states]


def test_pfedme_restart_starts_theta_from_the_global_head_every_round():
  """The authors' form: a returning client's stored theta is ignored (its
  round equals a first participation's); the default form uses it."""
  data = [datasets(1, seed=5)[0]]
  outputs = {}
  for restart in (False, True):
    proc = _pfedme(1.0, inner_lr=0.05, restart_personal_head=restart)
    state = proc.initialize()
    new = {}
    for seed, rounds in ((0, 0), (0, 3), (1, 3)):
      states = _with_rounds(initial_states(proc, 1, seed=seed), rounds)
      after, client_states, _ = proc.next(state, states, data)
      new[seed, rounds] = (after.global_model_weights.trainable,
                           client_states[0]['private'])
    outputs[restart] = new
  for restart, new in outputs.items():
    first = new[0, 0]
    for key in ((0, 3), (1, 3)):
      same = all(np.allclose(a, b, atol=1e-6) for part in (0, 1)
                 for a, b in zip(first[part], new[key][part]))
      # Restarting: every round is a first round. Kept: the stored (random)
      # theta is where the inner solver starts, so the result moves.
      assert same == restart, (restart, key)
  # At a first participation the two forms are the same algorithm.
  for a, b in zip(outputs[False][0, 0][1], outputs[True][0, 0][1]):
    np.testing.assert_allclose(a, b, atol=1e-6)


class _Store:
  """A client-state store serving fixed states (experiment's `load`)."""

  def __init__(self, states):
    self._states = states

  def load(self, ids):
    return [self._states[i] for i in ids]


class _Task:
  population = 3

  def eval_datasets(self, ids):
    return [datasets(3, seed=9)[i] for i in ids]

  train_datasets = eval_datasets  # (read only with a fine-tuning pass)

  def evaluate(self, outputs, ids):
    del ids
    return outputs


def _personal_outputs(proc, states):
  config = experiment.ExperimentConfig(
      algorithm='pfedme', rounds=1, clients_per_round=1,
      root_output_dir='unused', experiment_name='unused')
  # pylint: disable-next=protected-access
  evaluate, _, data_fn = run_evaluation.personal_evaluator(
      _Task(), proc, config, _Store(states), num_shards=0)
  return [np.asarray(o['outputs'])
          for o in evaluate.outputs(proc.initialize(), data_fn)]


def test_pfedme_restart_evaluates_from_the_current_global_head():
  """Evaluation of the authors' form ignores stored personal heads: it
  starts theta from the broadcast global head (so the outputs are the
  global model's); the default form evaluates each stored head."""
  keep = _pfedme(1.0)
  restart = _pfedme(1.0, restart_personal_head=True)
  w = restart.initialize().global_model_weights
  head = restart.eval_private_fn(w)
  for a, b in zip(head, w.trainable[-2:]):
    np.testing.assert_array_equal(a, b)
  one = _with_rounds(initial_states(restart, 3, seed=1), 4)
  two = _with_rounds(initial_states(restart, 3, seed=2), 4)
  as_global = [collections.OrderedDict(private=head,
                                       rounds_participated=np.int32(4))] * 3
  global_outputs = _personal_outputs(keep, as_global)
  for states in (one, two):
    for a, b in zip(_personal_outputs(restart, states), global_outputs):
      np.testing.assert_allclose(a, b, rtol=1e-6)
  kept = _personal_outputs(keep, one)
  assert max(float(np.max(np.abs(a - b)))
             for a, b in zip(kept, global_outputs)) > 1e-3
  assert keep.eval_private_fn is None
  assert process.eval_client_states(keep, w, one) is one


# --- PFedKM -------------------------------------------------------------------

def test_pfedkm_with_one_cluster_is_fedavg():
  opt = sgd(0.05)
  proc = pfedkm.build_pfedkm(fedembed_factory, client_optimizer=opt,
                             server_optimizer=sgd(1.0), seed=2,
                             num_subpopulations=1)
  # Shared trainable: the encoder, then heads kernel [1, F, 2], bias [1, 2].
  as_fedavg = lambda w: list(w[:ENCODER]) + [w[ENCODER][0], w[ENCODER + 1][0]]
  ours, theirs, _ = run_both(proc, as_fedavg, opt)
  for a, b in zip(ours, theirs):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_pfedkm_clusters_users_with_opposite_preferences():
  """Federated spherical k-means over probes recovers two opposite groups.

  The model is frozen (client lr 0) so that the probes are fixed and the
  right clustering is known; with training, the encoder moves under the
  probes of such a tiny population (6 users) and 3 rounds do not settle.
  """
  proc = pfedkm.build_pfedkm(fedembed_factory, client_optimizer=sgd(0.0),
                             server_optimizer=sgd(1.0), seed=5,
                             num_subpopulations=2)
  state = proc.initialize()
  states = initial_states(proc, 6)
  flip = (3, 4, 5)  # clients 3-5 prefer the opposite kind of image
  for r in range(3):
    state, states, metrics = proc.next(state, states,
                                       datasets(6, seed=r, flip=flip))
  heads = [int(s['private'][1]) for s in states]
  assert len(set(heads[:3])) == 1 and len(set(heads[3:])) == 1, heads
  assert heads[0] != heads[3], heads
  assert metrics['server_step']['clusters_used'] == 2


# --- DP and privacy -------------------------------------------------------------

@pytest.mark.parametrize('name', ['fedrep', 'pfedme', 'pfedme_restart',
                                  'pfedkm'])
def test_private_state_stays_on_clients_and_dp_covers_the_shared_update(name):
  dp = privacy.DPConfig(mechanism='gaussian_fixed', noise_multiplier=1.0,
                        clip_norm=1.0, clients_per_round=2, population=10)
  factory = fedembed_factory if name == 'pfedkm' else model_fn_factory
  proc = registry.build(name, factory, client_optimizer=sgd(0.05),
                        server_optimizer=sgd(1.0), seed=1,
                        aggregator_factory=privacy.build_aggregator(dp),
                        **({'num_subpopulations': 2} if name == 'pfedkm'
                           else {}))
  sig = proc.next.type_signature
  assert sig.parameter[1].placement is tff.CLIENTS
  assert sig.result[1].placement is tff.CLIENTS
  shared = list(sig.result[0].member.global_model_weights.trainable)
  value = proc.aggregation_value_type
  model_part = list(value.model) if name == 'pfedkm' else list(value)
  assert model_part == shared  # every shared parameter goes through DP
  if name in ('fedrep', 'pfedme', 'pfedme_restart'):
    # The personal head is client state; for pFedMe its global twin (the
    # same type) is shared, so the check is on the client-state type.
    assert tff.TensorType(np.float32, [FEATURES, 2]) in list(
        proc.client_state_type.private)
  if name == 'fedrep':
    assert tff.TensorType(np.float32, [FEATURES, 2]) not in shared
  state, _, _ = proc.next(proc.initialize(), initial_states(proc, 2),
                          datasets(2))
  for w in state.global_model_weights.trainable:
    assert np.all(np.isfinite(w))
