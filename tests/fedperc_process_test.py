"""FedPerC TFF processes: frozen backbone, privacy of psi, DP new-user prior."""


import numpy as np
import pytest
import tensorflow_federated as tff

from tasks import tv_shows
from tff_personal.algorithms import fedperc as fedperc_alg
from tff_personal.core import new_users
from tff_personal.core import process as process_lib
from tff_personal.models import bpe_trainer
from tff_personal.models import fedperc
from tff_personal.models import fedperc_backbone

TEXTS = ['How you doin? We were on a break!', 'Winter is coming.',
         'A Lannister always pays his debts.', 'I think we must go north.',
         'Could this BE any more awkward?', 'You know nothing, Jon Snow.']
MAX_TOKENS = 10
HIDDEN = 8


@pytest.fixture(scope='module')
def spec():
  vocabulary, merges = bpe_trainer.train_bpe(TEXTS * 3, 300)
  return fedperc_backbone.random_backbone(
      vocabulary, merges, hidden_dim=HIDDEN, num_heads=2, intermediate_dim=16,
      max_sequence_length=12, seed=2)


@pytest.fixture(scope='module')
def arrays(spec):
  out, _ = tv_shows.encode(spec.tokenizer(), TEXTS, 1, MAX_TOKENS,
                           spec.vocabulary[bpe_trainer.END_TOKEN])
  return out


def _config(variant):
  return fedperc.FedPercConfig(variant, num_contexts=2, max_tokens=MAX_TOKENS,
                               generator_heads=2, generator_utterances=2)


class _SpyFactory(tff.aggregators.UnweightedAggregationFactory):
  """Records the value type the process asks it to aggregate."""

  def __init__(self):
    self.value_types = []
    self._inner = tff.aggregators.UnweightedMeanFactory()

  def create(self, value_type):
    self.value_types.append(value_type)
    return self._inner.create(value_type)


def _run_rounds(process, private, arrays, rounds=2, clients=2):
  states = [fedperc_alg.initial_client_state(private)] * clients
  state = process.initialize()
  for r in range(rounds):
    data = [tv_shows.round_dataset(arrays, steps=2, batch_size=4,
                                   rng=np.random.default_rng([r, c]))
            for c in range(clients)]
    state, states, metrics = process.next(state, states, data)
  return state, states, metrics


def _process(spec, config, **kwargs):
  """The registered process of `config.variant` (per-user client step)."""
  return fedperc_alg.build_step_process(
      fedperc_alg.make_model_fn(spec, config, 0), 'none',
      client_optimizer=tff.learning.optimizers.build_adam(0.05),
      server_optimizer=tff.learning.optimizers.build_sgdm(1.0), **kwargs)


@pytest.mark.parametrize('variant', [fedperc.EMBEDDING, fedperc.SPLIT])
def test_backbone_frozen_personal_state_private(spec, arrays, variant):
  config = _config(variant)
  spy = _SpyFactory()
  process = _process(spec, config, aggregator_factory=spy)
  weights, private = fedperc_alg.initial_weights(spec, config)
  # Privacy, from the types: client state enters and leaves at CLIENTS; the
  # only aggregated value is the shared trainable update (context
  # embeddings or context heads), never the private state.
  signature = process.next.type_signature
  assert signature.parameter[1].placement == tff.CLIENTS
  assert signature.result[1].placement == tff.CLIENTS
  shared_type = tff.types.to_type(tuple(
      tff.TensorType(w.dtype, w.shape) for w in weights.trainable))
  assert len(spy.value_types) == 1
  assert spy.value_types[0].is_equivalent_to(shared_type)
  private_shapes = [p.shape for p in private]
  assert [tuple(t.shape) for t in spy.value_types[0]] != private_shapes
  for leaf in tff.structure.flatten(signature.result[2].member):
    assert leaf.shape.rank == 0 if hasattr(leaf.shape, 'rank') else (
        len(leaf.shape) == 0)  # Metrics are scalars only.
  state, states, metrics = _run_rounds(process, private, arrays)
  assert metrics['train']['num_examples'] == 2 * 2 * 4
  trained = process.get_model_weights(state)
  # The frozen backbone is broadcast and comes back bit for bit.
  for a, b in zip(trained.non_trainable, weights.non_trainable):
    np.testing.assert_array_equal(a, b)
  # What is learned moved: shared on the server, private on the clients.
  assert any(not np.allclose(a, b)
             for a, b in zip(trained.trainable, weights.trainable))
  for s in states:
    new = s[process_lib.CLIENT_STATE_PRIVATE]
    assert any(not np.allclose(a, b) for a, b in zip(new, private))
    assert s[process_lib.CLIENT_STATE_ROUNDS] == 2


def test_generated_variant_generates_personal_state(spec, arrays):
  config = _config(fedperc.GENERATED)
  process = _process(spec, config)
  weights, private = fedperc_alg.initial_weights(spec, config)
  state, states, _ = _run_rounds(process, private, arrays, rounds=1)
  new = states[0][process_lib.CLIENT_STATE_PRIVATE]
  assert new[0].shape == (HIDDEN,)
  assert not np.allclose(new[0], private[0])
  trained = process.get_model_weights(state)
  for a, b in zip(trained.non_trainable, weights.non_trainable):
    np.testing.assert_array_equal(a, b)


def test_new_user_initialisation_is_the_dp_aggregate():
  value_type = tff.types.to_type((tff.TensorType(np.float32, [HIDDEN]),))
  rng = np.random.default_rng(0)
  values = [(rng.normal(size=HIDDEN).astype(np.float32) * 0.1,)
            for _ in range(4)]
  exact = new_users.build_dp_mean(value_type, noise_multiplier=0.0,
                                    clip_norm=100.0, num_clients=4)
  # Known users' states go in at CLIENTS; only the aggregate is at SERVER.
  assert exact.type_signature.parameter.placement == tff.CLIENTS
  assert exact.type_signature.result.placement == tff.SERVER
  np.testing.assert_allclose(exact(values)[0], np.mean([v[0] for v in values],
                                                       0), rtol=1e-5)
  # Clipping: a huge state counts with norm clip_norm only.
  big = values[:3] + [(np.full(HIDDEN, 100.0, np.float32),)]
  clipped = new_users.build_dp_mean(value_type, noise_multiplier=0.0,
                                      clip_norm=1.0, num_clients=4)(big)[0]
  expected = (np.sum([v[0] for v in values[:3]], 0) +
              np.full(HIDDEN, 1.0 / np.sqrt(HIDDEN))) / 4
  np.testing.assert_allclose(clipped, expected, rtol=1e-4, atol=1e-6)
  # Noise: std noise_multiplier * clip / n per coordinate.
  noisy = new_users.build_dp_mean(value_type, noise_multiplier=2.0,
                                    clip_norm=1.0, num_clients=4)
  mean = np.mean([v[0] for v in values], 0)
  draws = np.stack([noisy(values)[0] - mean for _ in range(25)])
  assert 0.35 < draws.std() < 0.65  # 2 * 1 / 4 = 0.5, 200 draws.
  # A new user's state is built from the released value alone.
  release = noisy(values)
  state = fedperc_alg.new_user_private_state(release)
  np.testing.assert_array_equal(
      state[process_lib.CLIENT_STATE_PRIVATE][0], release[0])
  assert state[process_lib.CLIENT_STATE_ROUNDS] == 0
  assert new_users.dp_mean_epsilon(2.0, 1e-5) > 0
  with pytest.raises(ValueError, match='clip_norm'):
    new_users.build_dp_mean(value_type, noise_multiplier=1.0, clip_norm=0.0,
                              num_clients=4)


def test_dp_clip_is_per_variant_and_its_effect_is_reported():
  assert fedperc_alg.dp_clip_norm('embedding') == 1.0
  assert fedperc_alg.dp_clip_norm('generated') == 16.0
  assert fedperc_alg.dp_clip_norm('generated', 2.5) == 2.5
  with pytest.raises(ValueError, match="variant 'split' has no new-user"):
    fedperc_alg.dp_clip_norm('split')
  with pytest.raises(ValueError, match='clip_norm must be > 0'):
    fedperc_alg.dp_clip_norm('generated', 0.0)
  # Norms 3, 5 (a two-tensor state: clipped by its global norm), 20, 30.
  states = [(np.array([3.0, 0.0]),), (np.array([3.0]), np.array([4.0])),
            (np.array([0.0, 20.0]),), (np.array([30.0, 0.0]),)]
  report = new_users.dp_clip_report(states, 16.0)
  assert report == dict(clip_norm=16.0, num_users=4, fraction_clipped=0.5,
                        median_norm=12.5, median_norm_over_clip=12.5 / 16,
                        max_norm=30.0)


def test_the_new_user_dp_average_is_seeded_and_has_the_stated_noise():
  """A seed fixes the new-user average's noise (two evaluations of one run
  give the same withheld-user numbers); another seed draws other noise, of
  stddev z * C / n per coordinate, as TFF's gaussian_fixed."""
  n, dim, z, clip = 5, 4096, 2.0, 1.0
  value_type = tff.types.to_type((tff.TensorType(np.float32, [dim]),))
  states = [(np.zeros(dim, np.float32),) for _ in range(n)]
  first, again, other = (
      new_users.build_dp_mean(value_type, noise_multiplier=z, clip_norm=clip,
                              num_clients=n, seed=s)(states)[0]
      for s in (7, 7, 8))
  np.testing.assert_array_equal(first, again)
  assert not np.allclose(first, other)
  for noise in (first, other):  # The mean of zeros is the noise alone.
    assert np.std(noise) == pytest.approx(z * clip / n, rel=0.05)
    assert abs(np.mean(noise)) < 4 * z * clip / n / np.sqrt(dim)
