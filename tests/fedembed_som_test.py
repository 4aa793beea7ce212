"""FedEmbed-SOM: map arithmetic, best-scoring aggregation, FedAvg reduction,
clustering of a known synthetic population, the SOM alone of the paper
module against the algorithm's map, DP, privacy."""

import collections
import functools

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tests import fedembed_testdata
from tff_personal.algorithms import fedembed_som
from tff_personal.algorithms import registry
from tff_personal.core import best_scoring
from tff_personal.core import privacy
from tff_personal.models import fedembed_mnist
from tff_personal.models import som

SPEC = fedembed_testdata.SPEC
factory = fedembed_testdata.factory
datasets = functools.partial(fedembed_testdata.datasets, n=4)


def states_with_embeddings(proc, embeddings):
  specs = tff.types.type_to_tf_tensor_specs(proc.client_state_type)
  out = []
  for e in embeddings:
    s = tf.nest.map_structure(
        lambda spec: np.zeros(spec.shape, spec.dtype.as_numpy_dtype), specs)
    if np.size(e):  # the embedding is the first private variable
      s['private'] = (np.asarray(e, np.float32),) + tuple(s['private'][1:])
    out.append(s)
  return out


def sgd(lr):
  return tff.learning.optimizers.build_sgdm(lr)


# --- map arithmetic ---------------------------------------------------------

def test_grid_and_kohonen_update_match_the_formulas():
  assert som.grid_shape(10) == (2, 5)
  assert som.grid_shape(7) == (1, 7)
  rng = np.random.default_rng(0)
  nodes = rng.normal(size=(10, 3)).astype(np.float32)
  e = rng.normal(size=3).astype(np.float32)
  delta, score, bmu = som.kohonen_update(tf.constant(nodes), tf.constant(e),
                                         0.7)
  d2 = ((nodes - e) ** 2).sum(-1)
  assert int(bmu) == int(np.argmin(d2))
  np.testing.assert_allclose(float(score), -d2.min(), rtol=1e-5)
  coords = np.array([(i // 5, i % 5) for i in range(10)], np.float32)
  h = np.exp(-((coords - coords[np.argmin(d2)]) ** 2).sum(-1) / (2 * 0.49))
  np.testing.assert_allclose(delta.numpy(), h[:, None] * (e - nodes),
                             rtol=1e-5, atol=1e-6)


def test_head_sources_take_the_maximally_overlapping_old_head():
  counts = np.zeros((4, 4), np.float32)
  counts[0, 0] = 3          # cluster 0 stays
  counts[2, 1] = 5          # new cluster 1 is mostly old cluster 2
  counts[1, 1] = 1
  counts[3, 3] = 2          # tie with another old cluster: keep own head
  counts[2, 3] = 2
  # new cluster 2: nobody counted -> keeps its head
  assert som.head_sources(tf.constant(counts)).numpy().tolist() == [0, 2, 2, 3]


def test_best_scoring_aggregation_selects_the_best_clients_value():
  value_type = tff.types.to_type(collections.OrderedDict(
      score=np.float32, value=tff.TensorType(np.float32, [2])))
  proc = best_scoring.BestScoringFactory().create(value_type)
  values = [collections.OrderedDict(score=np.float32(s),
                                    value=np.float32([s, -s]))
            for s in (0.5, 2.0, -1.0, 2.0)]
  out = proc.next(proc.initialize(), values)
  assert float(out.result['score']) == 2.0
  np.testing.assert_array_equal(out.result['value'], [2.0, -2.0])
  with pytest.raises(TypeError, match='score'):
    best_scoring.BestScoringFactory().create(
        tff.types.to_type(collections.OrderedDict(value=np.float32)))


# --- the process --------------------------------------------------------------

def test_one_subpopulation_without_embedding_is_fedavg():
  client_opt = sgd(0.05)
  proc = fedembed_som.build_fedembed_som(
      factory, client_optimizer=client_opt, server_optimizer=sgd(1.0),
      seed=4, embedding_dim=0, num_subpopulations=1,
      allow_unprotected_best_client=True)
  plain_spec = collections.OrderedDict(x=SPEC['x'], y=SPEC['y'])

  def tff_model_fn():
    return tff.learning.models.from_keras_model(
        fedembed_mnist.build_preference_model(0).model, input_spec=plain_spec,
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))

  fedavg = tff.learning.algorithms.build_weighted_fed_avg(
      tff_model_fn, client_optimizer_fn=client_opt,
      server_optimizer_fn=sgd(1.0))
  with tf.Graph().as_default():
    names = [v.name for v in proc.model_fn().shared_trainable_variables]

  def as_fedavg(weights):
    named = dict(zip(names, weights.trainable))
    encoder = [w for n, w in named.items()
               if not n.startswith(('heads/', 'type_head/'))]
    return encoder + [named['heads/kernel:0'][0], named['heads/bias:0'][0]]

  ours = proc.initialize()
  theirs = fedavg.set_model_weights(
      fedavg.initialize(), tff.learning.models.ModelWeights(
          trainable=tuple(as_fedavg(ours.global_model_weights)),
          non_trainable=()))
  states = states_with_embeddings(proc, [np.zeros(0)] * 3)
  for r in range(2):
    data = datasets([0, 0, 0], seed=r, other=0)  # one type: L_M is 0
    ours, states, _ = proc.next(ours, states, data)
    theirs = fedavg.next(theirs, [d.map(lambda b: collections.OrderedDict(
        x=b['x'], y=b['y'])) for d in data]).state
  for a, b in zip(as_fedavg(ours.global_model_weights),
                  fedavg.get_model_weights(theirs).trainable):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope='module')
def clustered():
  """Two well-separated groups of fixed embeddings (private lr 0)."""
  rng = np.random.default_rng(3)
  centres = np.zeros((2, 28), np.float32)
  centres[0, :14], centres[1, 14:] = 1.5, 1.5
  groups = [0, 0, 0, 1, 1, 1]
  embeddings = [centres[g] + 0.05 * rng.normal(size=28) for g in groups]
  return groups, embeddings


@pytest.mark.parametrize('update', ['best', 'mean'])
def test_som_separates_a_known_clustering(clustered, update):
  groups, embeddings = clustered
  proc = fedembed_som.build_fedembed_som(
      factory, client_optimizer=sgd(0.0), server_optimizer=sgd(1.0), seed=0,
      num_subpopulations=4, private_optimizer=sgd(0.0),
      som_config=fedembed_som.SomConfig(update=update, decay_rounds=8),
      allow_unprotected_best_client=update == 'best')
  state = proc.initialize()
  states = states_with_embeddings(proc, embeddings)
  for r in range(8):
    state, states, _ = proc.next(state, states, datasets([1] * 6, seed=r))
  for s, e in zip(states, embeddings):  # the embeddings did not move
    np.testing.assert_allclose(s['private'][0], e, rtol=1e-6)
  with tf.Graph().as_default():
    names = [v.name for v in proc.model_fn().shared_non_trainable_variables]
  active = dict(zip(names, state.global_model_weights.non_trainable))[
      'som/active:0']
  bmus = [int(np.argmin(((active - e) ** 2).sum(-1))) for e in embeddings]
  first, second = set(bmus[:3]), set(bmus[3:])
  assert len(first) == 1 and len(second) == 1 and first != second, bmus
  # The head a client trains with in the last round is its cluster's.
  heads = [int(s['private'][2]) for s in states]
  assert len(set(heads[:3])) == 1 and len(set(heads[3:])) == 1, heads
  assert heads[0] != heads[3]


@pytest.mark.parametrize('update,winner', [('best', 'least_similar'),
                                           ('best', 'most_similar'),
                                           ('mean', 'least_similar')])
def test_som_alone_replays_the_algorithms_map(update, winner):
  """`fedembed_som.som_alone` on fixed embeddings moves the map as the
  process does when nothing else trains (every client in every round, past
  the end of the decay)."""
  rng = np.random.default_rng(5)
  embeddings = rng.normal(0.0, 0.5, (6, 28)).astype(np.float32)
  cfg = fedembed_som.SomConfig(update=update, winner=winner, decay_rounds=3)
  proc = fedembed_som.build_fedembed_som(
      factory, client_optimizer=sgd(0.0), server_optimizer=sgd(1.0), seed=2,
      num_subpopulations=4, private_optimizer=sgd(0.0), som_config=cfg,
      allow_unprotected_best_client=update == 'best')
  with tf.Graph().as_default():
    names = [v.name for v in proc.model_fn().shared_non_trainable_variables]
  state = proc.initialize()
  start = dict(zip(names, state.global_model_weights.non_trainable))[
      'som/nodes:0']
  states = states_with_embeddings(proc, embeddings)
  rounds = 5
  for r in range(rounds):
    state, states, _ = proc.next(state, states, datasets([1] * 6, seed=r))
  ours = dict(zip(names, state.global_model_weights.non_trainable))[
      'som/nodes:0']
  alone = fedembed_som.som_alone(
      embeddings, start, rounds=rounds, cohort_size=6,
      config=cfg.resolve(tff.aggregators.MeanFactory()),
      cohorts=[range(6)] * rounds)
  assert not np.allclose(alone, start)
  np.testing.assert_allclose(alone, ours, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(
      fedembed_som.node_assignment(alone, embeddings),
      [int(np.argmin(((ours - e) ** 2).sum(-1))) for e in embeddings])

def test_dp_refuses_best_scoring_and_covers_the_som_statistics():
  dp = privacy.DPConfig(mechanism='gaussian_fixed', noise_multiplier=1.0,
                        clip_norm=1.0, clients_per_round=2, population=10)
  aggregator = privacy.build_aggregator(dp)
  with pytest.raises(ValueError, match='not differentially private'):
    fedembed_som.build_fedembed_som(
        factory, client_optimizer=sgd(0.05), server_optimizer=sgd(1.0),
        aggregator_factory=aggregator,
        som_config=fedembed_som.SomConfig(update='best'))
  proc = fedembed_som.build_fedembed_som(
      factory, client_optimizer=sgd(0.05), server_optimizer=sgd(1.0),
      aggregator_factory=aggregator, seed=1)
  value = proc.aggregation_value_type
  # Model update, SOM update and overlap counts all go through the DP
  # aggregator; every head's update, used or not, is in it.
  assert tff.TensorType(np.float32, [10, 92, 2]) in list(value.model)
  assert value.statistics.som == tff.TensorType(np.float32, [10, 28])
  assert value.statistics.counts == tff.TensorType(np.float32, [10, 10])
  sig = proc.next.type_signature
  assert 'selected' not in str(sig)
  state = proc.initialize()
  rng = np.random.default_rng(0)
  state, _, _ = proc.next(
      state, states_with_embeddings(proc, rng.uniform(-1, 1, (2, 28))),
      datasets([3, 3]))
  assert np.all(np.isfinite(state.global_model_weights.non_trainable[0]))


def test_best_client_update_needs_an_explicit_opt_in_or_dp():
  """'best' hands one client's embedding-derived update to the server
  verbatim: refused unless asked for by name; 'mean' needs no opt-in."""
  with pytest.raises(ValueError, match='allow_unprotected_best_client=True'):
    fedembed_som.build_fedembed_som(
        factory, client_optimizer=sgd(0.05), server_optimizer=sgd(1.0))
  with pytest.raises(ValueError, match='allow_unprotected_best_client'):
    registry.build('fedembed_som', factory, client_optimizer=sgd(0.05),
                   server_optimizer=sgd(1.0),
                   som_config=fedembed_som.SomConfig(update='best'))
  assert 'allow_unprotected_best_client' in registry.algorithm_options(
      'fedembed_som')
  proc = fedembed_som.build_fedembed_som(
      factory, client_optimizer=sgd(0.05), server_optimizer=sgd(1.0),
      som_config=fedembed_som.SomConfig(update='mean'))
  assert 'selected' not in str(proc.next.type_signature)


def test_personal_embeddings_never_reach_a_server_value():
  """No server-placed value has the embedding's type; client state stays put.

  (The best-scoring selection does release one client's [K, 28] SOM update
  per round, from which its embedding can be solved: documented in
  best_scoring.py; with DP it is refused.)
  """
  proc = fedembed_som.build_fedembed_som(
      factory, client_optimizer=sgd(0.05), server_optimizer=sgd(1.0), seed=1,
      allow_unprotected_best_client=True)
  sig = proc.next.type_signature
  assert sig.parameter[1].placement is tff.CLIENTS
  assert sig.result[1].placement is tff.CLIENTS
  assert proc.client_state_type.private[0] == tff.TensorType(np.float32, [28])
  for server_type in (sig.result[0].member, sig.result[2].member,
                      proc.aggregation_value_type):
    for spec in tf.nest.flatten(
        tff.types.type_to_tf_tensor_specs(server_type)):
      assert tuple(spec.shape) != (28,)
