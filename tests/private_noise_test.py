"""Noise on the personal heads (the paper's DP reading, core/private_noise.py):
the stated clip and scale, what is exempt, what still never changes, and the
accounting against the exact Gaussian mechanism."""

import collections
import dataclasses
import math

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tests import fedembed_testdata
from tff_personal.algorithms import fedembed
from tff_personal.algorithms import fedrep
from tff_personal.algorithms import pfedme
from tff_personal.config import experiment
from tff_personal.core import privacy
from tff_personal.core import private_noise
from tff_personal.core import process as process_lib
from tff_personal.core import split_model
from tff_personal.core import split_training
from tff_personal.models import fedembed as fedembed_model
from tff_personal.models import fedembed_mnist
from tff_personal.models import personal_head

SPEC = fedembed_testdata.SPEC


def model_fn_factory(dim):
  return lambda: fedembed_mnist.build_preference_model(dim, input_spec=SPEC)


def sgd(lr):
  return tff.learning.optimizers.build_sgdm(lr)


def data(seed=0, n=8):
  return fedembed_testdata.datasets([3], seed=seed, n=n)[0]


# --- the TF arithmetic --------------------------------------------------------

def test_without_noise_a_large_change_is_clipped_to_the_norm_in_its_direction():
  rng = np.random.default_rng(0)
  start = [rng.normal(size=(4, 3)).astype(np.float32),
           rng.normal(size=(3,)).astype(np.float32)]
  change = [3.0 * rng.normal(size=s.shape).astype(np.float32) for s in start]
  end = [s + c for s, c in zip(start, change)]
  out = private_noise.clip_and_noise(
      start, end, split_model.PrivateNoise(clip_norm=0.5, noise_multiplier=0))
  moved = np.concatenate([np.ravel(o - s) for o, s in zip(out, start)])
  direction = np.concatenate([np.ravel(c) for c in change])
  assert np.linalg.norm(moved) == pytest.approx(0.5, rel=1e-5)
  np.testing.assert_allclose(
      moved, 0.5 * direction / np.linalg.norm(direction), atol=1e-6)
  # A change inside the clip is kept as it is.
  small = [s + 1e-3 * c for s, c in zip(start, change)]
  out = private_noise.clip_and_noise(
      start, small, split_model.PrivateNoise(clip_norm=0.5, noise_multiplier=0))
  for o, e in zip(out, small):
    np.testing.assert_allclose(o, e, atol=1e-6)


def test_noise_has_std_multiplier_times_clip_and_no_mean():
  start = [np.zeros((200, 100), np.float32)]
  out = private_noise.clip_and_noise(
      start, start, split_model.PrivateNoise(clip_norm=0.4,
                                             noise_multiplier=1.5))[0].numpy()
  assert out.std() == pytest.approx(0.6, rel=0.03)  # 20,000 draws
  assert abs(out.mean()) < 4 * 0.6 / math.sqrt(out.size)


def test_private_noise_refuses_bad_settings():
  with pytest.raises(ValueError, match='clip_norm'):
    split_model.PrivateNoise(clip_norm=0.0, noise_multiplier=1.0)
  with pytest.raises(ValueError, match='noise_multiplier'):
    split_model.PrivateNoise(clip_norm=1.0, noise_multiplier=-1.0)


# --- the accounting -----------------------------------------------------------

def _phi(x):
  return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def _exact_gaussian_epsilon(z, delta):
  """The exact epsilon of one Gaussian mechanism of sensitivity 1 and std z
  (Balle and Wang 2018, Theorem 8), by bisection."""
  def delta_of(eps):
    return (_phi(1 / (2 * z) - eps * z)
            - math.exp(eps) * _phi(-1 / (2 * z) - eps * z))
  lo, hi = 0.0, 100.0
  for _ in range(200):
    mid = (lo + hi) / 2
    lo, hi = (mid, hi) if delta_of(mid) > delta else (lo, mid)
  return hi


@pytest.mark.parametrize('z', [1.0, 2.0])
def test_one_pass_epsilon_bounds_the_exact_gaussian_mechanism(z):
  exact = _exact_gaussian_epsilon(z, 1e-5)
  rdp = private_noise.personal_epsilon(z, 1, 1e-5)
  assert exact <= rdp <= 1.6 * exact


def test_epsilon_composes_and_follows_the_relation():
  eps = [private_noise.personal_epsilon(1.451, p, 1e-3) for p in (1, 5, 30)]
  assert eps[0] < eps[1] < eps[2]
  # Replace-one doubles the sensitivity: as add/remove at half the noise.
  assert private_noise.personal_epsilon(
      2.0, 7, 1e-3, 'replace_one') == pytest.approx(
          private_noise.personal_epsilon(1.0, 7, 1e-3))
  assert private_noise.personal_epsilon(0.0, 3, 1e-3) == math.inf
  assert private_noise.personal_epsilon(1.0, 0, 1e-3) == 0.0
  with pytest.raises(ValueError, match='relation'):
    private_noise.personal_epsilon(1.0, 1, 1e-3, 'replace_two')


# --- client steps -------------------------------------------------------------

def _client_step(build, factory, noise, **kwargs):
  if noise is not None:
    factory = private_noise.with_private_noise(factory, noise)
  proc = build(factory, client_optimizer=sgd(0.1),
               server_optimizer=sgd(1.0), seed=1, **kwargs)
  return proc, tf.function(proc.composition.client_step())


def _run(build, factory, noise, seed=0):
  proc, step = _client_step(build, factory, noise)
  weights = proc.get_model_weights(proc.initialize())
  state = fedembed_testdata.initial_states(proc, 1, seed=seed)[0]
  state = collections.OrderedDict(state)
  state[process_lib.CLIENT_STATE_ROUNDS] = np.int32(1)  # a returning user
  out = step(weights, state, data())
  return (state, [np.asarray(u) for u in out['update']],
          [np.asarray(p) for p in
           out['client_state'][process_lib.CLIENT_STATE_PRIVATE]])


@pytest.mark.parametrize('build', [fedrep.build_fedrep, pfedme.build_pfedme],
                         ids=['fedrep', 'pfedme'])
def test_a_personal_head_gets_the_clipped_change_plus_the_stated_noise(build):
  factory = model_fn_factory
  state, update, plain = _run(build, factory, None)
  start = [np.asarray(p) for p in state[process_lib.CLIENT_STATE_PRIVATE]]
  # No noise and a clip nobody reaches: the un-noised algorithm (the head
  # up to float32 rounding of start + (end - start)).
  _, update_0, private_0 = _run(
      build, factory, split_model.PrivateNoise(1e6, 0.0))
  for a, b in zip(update, update_0):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(plain, private_0):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
  clip, z = 0.05, 2.0
  _, update_n, noised = _run(build, factory,
                             split_model.PrivateNoise(clip, z))
  # What is sent is computed before the noise, and does not change.
  for a, b in zip(update, update_n):
    np.testing.assert_array_equal(a, b)
  change = np.concatenate([np.ravel(p - s) for p, s in zip(plain, start)])
  assert np.linalg.norm(change) > clip  # the clip binds
  clipped = change * clip / np.linalg.norm(change)
  residual = np.concatenate([np.ravel(n - s) for n, s in zip(noised, start)]
                            ) - clipped
  assert residual.size > 100
  assert residual.std() == pytest.approx(z * clip, rel=0.15)


def test_pfedme_restart_clips_the_change_from_the_global_head():
  # With a clip of 1e-6 and no noise, the restarted head ends where it
  # started: the broadcast global head (which evaluation also starts from),
  # not the client's stored head.
  proc, step = _client_step(pfedme.build_pfedme, model_fn_factory,
                            split_model.PrivateNoise(1e-6, 0.0),
                            restart_personal_head=True)
  weights = proc.get_model_weights(proc.initialize())
  state = fedembed_testdata.initial_states(proc, 1)[0]
  new = step(weights, state, data())['client_state'][
      process_lib.CLIENT_STATE_PRIVATE]
  global_head = proc.eval_private_fn(weights)
  stored = state[process_lib.CLIENT_STATE_PRIVATE]
  assert max(np.max(np.abs(np.asarray(s) - g))
             for s, g in zip(stored, global_head)) > 1e-2
  for n, g in zip(new, global_head):
    np.testing.assert_allclose(np.asarray(n), g, atol=2e-6)


def test_personal_embeddings_are_exempt():
  # FedEmbed-Prototype's private state is an embedding (and assignment
  # integers): with noise on, its client step computes exactly what it did.
  build = fedembed.build_fedembed_prototype
  outs = [_run(build, fedembed_testdata.factory, noise)
          for noise in (None, split_model.PrivateNoise(0.01, 5.0))]
  for a, b in zip(outs[0][1] + outs[0][2], outs[1][1] + outs[1][2]):
    np.testing.assert_array_equal(a, b)
  # FedEmbed-Personal: its personal head is noised, its embedding is not.
  build = fedembed.build_fedembed_personal
  plain = _run(build, fedembed_testdata.factory, None)[2]
  noised = _run(build, fedembed_testdata.factory,
                split_model.PrivateNoise(0.01, 5.0))[2]
  with tf.Graph().as_default():
    split = fedembed_testdata.factory(
        fedembed_model.FedEmbedConfig(assignment='personal'))()
    names = [v.name for v in split.private_variables]
    embedding = {v.name for v in split.embedding_variables}
  changed = {n for n, a, b in zip(names, plain, noised)
             if not np.array_equal(a, b)}
  assert embedding and not changed & embedding
  assert {n for n in changed if 'personal_head' in n} == {
      n for n in names if 'personal_head' in n}


def test_the_evaluation_fine_tuning_pass_is_noised_too():
  model = personal_head.personal_head_model_fn(model_fn_factory(0))()
  start = [np.full(v.shape, 0.1, np.float32) for v in model.private_variables]

  def fine_tuned(split):
    @tf.function
    def run():
      for v, s in zip(split.private_variables, start):
        v.assign(s)
      split_training.fine_tune_private(split, sgd(0.5), data())
      return [v.read_value() for v in split.private_variables]
    return [np.asarray(v) for v in run()]

  plain = fine_tuned(model)
  noised = fine_tuned(dataclasses.replace(
      model, private_noise=split_model.PrivateNoise(1e-3, 10.0)))
  change = np.concatenate([np.ravel(p - s) for p, s in zip(plain, start)])
  residual = np.concatenate([np.ravel(n - s) for n, s in zip(noised, start)])
  assert np.linalg.norm(change) > 1e-3
  # A clipped change of norm 1e-3 plus noise of std 1e-2 per coordinate.
  assert residual.std() == pytest.approx(1e-2, rel=0.15)


# --- the experiment's contract ------------------------------------------------

def _config(tmp_path, **kwargs):
  return experiment.ExperimentConfig(
      algorithm='pfedme', rounds=2, clients_per_round=2,
      root_output_dir=str(tmp_path), experiment_name='x', **kwargs)


def test_noised_heads_need_fixed_gaussian_dp(tmp_path):
  with pytest.raises(ValueError, match="needs dp mechanism 'gaussian_fixed'"):
    experiment.validate(_config(tmp_path, dp_personal_heads='noised'), 4)
  with pytest.raises(ValueError, match="needs dp mechanism 'gaussian_fixed'"):
    experiment.validate(_config(
        tmp_path, dp_personal_heads='noised',
        dp=privacy.DPConfig(mechanism='gaussian_adaptive',
                            noise_multiplier=1.0)), 4)
  with pytest.raises(ValueError, match='dp_personal_heads must be one of'):
    experiment.validate(_config(tmp_path, dp_personal_heads='all'), 4)
  config = _config(tmp_path, dp_personal_heads='noised',
                   dp=privacy.DPConfig(mechanism='gaussian_fixed',
                                       noise_multiplier=1.3, clip_norm=0.7))
  dp = experiment.validate(config, 4)
  assert experiment.private_noise_of(config, dp) == split_model.PrivateNoise(
      clip_norm=0.7, noise_multiplier=1.3)
  assert experiment.private_noise_of(
      dataclasses.replace(config, dp_personal_heads='exempt'), dp) is None
