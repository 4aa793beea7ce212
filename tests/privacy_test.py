"""Tests for `tff_personal.core.privacy`.

Expected epsilons are computed in the tests themselves, independently of the
module: from `DpEvent`s built here, from closed-form RDP of the Gaussian
mechanism, or from the analytic Gaussian mechanism (Balle & Wang 2018).
"""

import dataclasses
import math
import os
import subprocess
import sys
import textwrap

import dp_accounting
from dp_accounting.rdp import rdp_privacy_accountant
import numpy as np
import pytest
from scipy import optimize
from scipy import stats
import tensorflow_federated as tff
from tensorflow_federated.python.aggregators import differential_privacy as tff_dp

from tff_personal.core import privacy

_REPLACE_ONE = dp_accounting.NeighboringRelation.REPLACE_ONE


def _config(**kwargs) -> privacy.DPConfig:
  base = dict(mechanism='gaussian_fixed', noise_multiplier=1.0)
  base.update(kwargs)
  return privacy.DPConfig(**base)


def _analytic_gaussian_epsilon(mu: float, delta: float) -> float:
  """Exact epsilon of a Gaussian mechanism with sensitivity/std ratio mu.

  delta(eps) = Phi(mu/2 - eps/mu) - e^eps Phi(-mu/2 - eps/mu) (Balle & Wang
  2018, Thm. 8); T-fold composition of ratio m is ratio m * sqrt(T).

  Args:
    mu: L2 sensitivity divided by the noise standard deviation.
    delta: Target delta.

  Returns:
    The smallest epsilon at `delta`.
  """
  def delta_of(eps):
    return (stats.norm.cdf(mu / 2 - eps / mu) -
            math.exp(eps) * stats.norm.cdf(-mu / 2 - eps / mu))
  return optimize.brentq(lambda e: delta_of(e) - delta, 0.0, 500.0,
                         xtol=1e-12)


# 1. The aggregator: noise scale and user-level clipping, run in TFF.


def _run_aggregator(config, client_values, value_type):
  factory = privacy.build_aggregator(config)
  assert not privacy.is_weighted(factory)
  process = factory.create(value_type)
  return process.next(process.initialize(), client_values)


@pytest.mark.parametrize('mechanism', ['gaussian_fixed', 'gaussian_adaptive'])
def test_noise_std_matches_noise_multiplier(mechanism):
  z, clip, cohort, size = 0.7, 2.0, 10, 20000
  config = privacy.DPConfig(mechanism=mechanism, noise_multiplier=z,
                            clip_norm=clip, clients_per_round=cohort,
                            population=50)
  value_type = tff.types.to_type(
      [tff.TensorType(np.float32, [size]), tff.TensorType(np.float32)])
  zeros = [np.zeros([size], np.float32), np.float32(0.0)]
  output = _run_aggregator(config, [zeros] * cohort, value_type)

  if mechanism == 'gaussian_fixed':
    value_z = z
  else:
    # TFF documents that the value noise is larger than z: the clipped count
    # (std 0.05 * cohort on records of +-0.5) takes part of the budget.
    value_z = (z**-2 - (2 * 0.05 * cohort)**-2)**-0.5
  sigma = value_z * clip / cohort
  noise = np.concatenate([np.ravel(output.result[0]),
                          np.ravel(output.result[1])]).astype(np.float64)
  # With known mean 0, sum(x^2) / sigma^2 ~ chi2(n): two-sided 1e-6 bound
  # (about +-2.5% on the std for n = 20001).
  statistic = np.sum(noise**2) / sigma**2
  assert stats.chi2.ppf(1e-6, noise.size) < statistic
  assert statistic < stats.chi2.ppf(1 - 1e-6, noise.size)
  assert abs(np.std(noise) / sigma - 1) < 0.05
  assert abs(np.mean(noise)) < 5 * sigma / math.sqrt(noise.size)

  # The DpEvent TFF records for the round, composed here by hand, gives the
  # accounting of `compute_epsilon` (Poisson, add-or-remove-one).
  event = tff_dp.extract_dp_event_from_state(output.state)
  gaussians = (event.events if mechanism == 'gaussian_adaptive'
               else [event])
  gaussians = [dp_accounting.GaussianDpEvent(float(g.noise_multiplier))
               for g in gaussians]
  assert gaussians[0].noise_multiplier == pytest.approx(value_z, rel=1e-5)
  rounds, delta = 20, 1e-5
  poisson = dataclasses.replace(config, sampling='poisson', rounds=rounds,
                                target_delta=delta)
  expected = dp_accounting.rdp.RdpAccountant().compose(
      dp_accounting.SelfComposedDpEvent(
          dp_accounting.PoissonSampledDpEvent(
              cohort / 50, dp_accounting.ComposedDpEvent(gaussians)),
          rounds)).get_epsilon(delta)
  got = privacy.compute_epsilon(poisson, rounds)
  assert got['epsilon_rdp'] == pytest.approx(expected, rel=1e-4)
  assert got['noise_multiplier'] == z


def test_clipping_is_of_the_global_norm_of_the_whole_update():
  clip, cohort = 1.0, 3
  config = privacy.DPConfig(mechanism='gaussian_fixed', noise_multiplier=0.0,
                            clip_norm=clip, clients_per_round=cohort,
                            population=10)
  clients = [
      # Global norm 5: scaled by 1/5 (per-tensor clipping would give
      # [1, 0, 0], [1]).
      [np.array([3.0, 0.0, 0.0], np.float32), np.array([4.0], np.float32)],
      # Global norm 0.5 < clip: unchanged.
      [np.array([0.0, 0.3, 0.0], np.float32), np.array([0.4], np.float32)],
      # Global norm 13: scaled by 1/13.
      [np.array([0.0, 0.0, 12.0], np.float32), np.array([-5.0], np.float32)],
  ]
  value_type = tff.types.to_type([tff.TensorType(np.float32, [3]),
                                  tff.TensorType(np.float32, [1])])
  output = _run_aggregator(config, clients, value_type)

  def clipped(update):
    norm = math.sqrt(sum(float(np.sum(t**2)) for t in update))
    return [t * min(1.0, clip / norm) for t in update]

  expected = [sum(clipped(c)[i] for c in clients) / cohort for i in range(2)]
  np.testing.assert_allclose(output.result[0], expected[0], atol=1e-6)
  np.testing.assert_allclose(output.result[1], expected[1], atol=1e-6)
  # Not the unclipped mean.
  unclipped = sum(c[0] for c in clients) / cohort
  assert not np.allclose(output.result[0], unclipped, atol=1e-2)


def test_none_mechanism_is_weighted_mean_without_report():
  config = privacy.DPConfig()
  factory = privacy.build_aggregator(config)
  assert isinstance(factory, tff.aggregators.MeanFactory)
  assert privacy.is_weighted(factory)
  assert privacy.privacy_report(config, 5) is None
  assert privacy.compute_epsilon(config, 5)['epsilon'] == math.inf


# 2. Epsilons equal dp_accounting's, with events built here.


def test_poisson_epsilon_matches_dp_accounting():
  z, cohort, population, rounds, delta = 1.1, 10, 1000, 50, 1e-6
  config = _config(noise_multiplier=z, clients_per_round=cohort,
                   population=population, rounds=rounds, sampling='poisson',
                   target_delta=delta)
  event = dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(
          cohort / population, dp_accounting.GaussianDpEvent(z)), rounds)
  expected_rdp = dp_accounting.rdp.RdpAccountant().compose(event).get_epsilon(
      delta)
  expected_pld = dp_accounting.pld.PLDAccountant().compose(event).get_epsilon(
      delta)

  report = privacy.privacy_report(config, rounds)
  assert report['epsilon_rdp'] == pytest.approx(expected_rdp, rel=1e-9)
  assert report['epsilon_pld'] == pytest.approx(expected_pld, rel=1e-9)
  assert report['epsilon'] == report['epsilon_pld']
  assert report['accountant'] == 'pld'
  assert report['neighboring_relation'] == 'add_or_remove_one'
  assert report['delta'] == delta
  assert report['sampling_probability'] == pytest.approx(0.01)
  assert report['rounds'] == rounds and report['rounds_planned'] == rounds
  assert report['epsilon_pld'] <= report['epsilon_rdp'] + 1e-6
  assert 0 < report['epsilon'] < math.inf


def test_fixed_size_epsilon_matches_dp_accounting_replace_one():
  z, cohort, population, rounds, delta = 1.5, 10, 1000, 50, 1e-6
  config = _config(noise_multiplier=z, clients_per_round=cohort,
                   population=population, rounds=rounds, sampling='fixed_size',
                   target_delta=delta)
  # Replace-one sensitivity of the clipped sum is 2 * clip: multiplier z / 2.
  event = dp_accounting.SelfComposedDpEvent(
      dp_accounting.SampledWithoutReplacementDpEvent(
          population, cohort, dp_accounting.GaussianDpEvent(z / 2)), rounds)
  expected = dp_accounting.rdp.RdpAccountant(
      neighboring_relation=_REPLACE_ONE).compose(event).get_epsilon(delta)

  report = privacy.compute_epsilon(config, rounds)
  assert report['epsilon'] == pytest.approx(expected, rel=1e-9)
  assert report['epsilon_rdp'] == report['epsilon']
  assert report['epsilon_pld'] is None
  assert 'PLD' in report['notes']
  assert report['accountant'] == 'rdp'
  assert report['neighboring_relation'] == 'replace_one'


def test_default_delta_is_below_one_over_population():
  for population in (10, 100, 10**5, 10**7):
    config = privacy.resolve(_config(population=population,
                                     clients_per_round=1))
    assert 0 < config.target_delta < 1 / population
    assert config.target_delta <= 1e-5
    assert privacy.compute_epsilon(config, 1)['delta'] == config.target_delta


# 3. Sanity properties and closed forms.


@pytest.mark.parametrize('sampling', ['poisson', 'fixed_size'])
def test_epsilon_increases_with_rounds_decreases_with_noise(sampling):
  config = _config(sampling=sampling, clients_per_round=10, population=200,
                   target_delta=1e-5)
  by_rounds = [privacy.compute_epsilon(config, r)['epsilon']
               for r in (1, 10, 100)]
  assert by_rounds[0] < by_rounds[1] < by_rounds[2]
  assert privacy.compute_epsilon(config, 0)['epsilon'] == 0
  by_noise = [
      privacy.compute_epsilon(dataclasses.replace(config, noise_multiplier=z),
                              10)['epsilon'] for z in (0.8, 1.2, 2.0)]
  assert by_noise[0] > by_noise[1] > by_noise[2]


def test_fixed_size_full_cohort_is_gaussian_with_replace_one_sensitivity():
  z, clip, population, rounds, delta = 3.0, 0.5, 20, 10, 1e-5
  config = _config(noise_multiplier=z, clip_norm=clip,
                   clients_per_round=population, population=population,
                   rounds=rounds, target_delta=delta)
  report = privacy.compute_epsilon(config, rounds)

  # Replacing a client moves the sum by up to 2 * clip; noise std z * clip.
  ratio = 2 * clip / (z * clip)
  orders = np.array(rdp_privacy_accountant.DEFAULT_RDP_ORDERS)
  rdp = rounds * orders * ratio**2 / 2  # RDP of the Gaussian mechanism.
  expected_rdp, _ = rdp_privacy_accountant.compute_epsilon(orders, rdp, delta)
  assert report['epsilon_rdp'] == pytest.approx(expected_rdp, rel=1e-9)

  exact = _analytic_gaussian_epsilon(ratio * math.sqrt(rounds), delta)
  assert report['accountant'] == 'pld'
  assert exact - 1e-6 <= report['epsilon_pld'] <= exact * 1.01 + 1e-3
  assert report['epsilon'] == report['epsilon_pld']
  # With add-or-remove sensitivity (ratio 1 / z) it would be much smaller.
  assert report['epsilon'] > 1.5 * _analytic_gaussian_epsilon(
      math.sqrt(rounds) / z, delta)


def test_poisson_full_cohort_is_gaussian_with_add_remove_sensitivity():
  z, population, rounds, delta = 2.0, 20, 10, 1e-5
  config = _config(noise_multiplier=z, clients_per_round=population,
                   population=population, rounds=rounds, sampling='poisson',
                   target_delta=delta)
  report = privacy.compute_epsilon(config, rounds)
  exact = _analytic_gaussian_epsilon(math.sqrt(rounds) / z, delta)
  assert exact - 1e-6 <= report['epsilon_pld'] <= exact * 1.01 + 1e-3


def test_adaptive_accounts_like_fixed_at_the_same_effective_multiplier():
  for sampling in ('poisson', 'fixed_size'):
    fixed = _config(noise_multiplier=0.8, sampling=sampling, rounds=5,
                    target_delta=1e-5)
    adaptive = dataclasses.replace(fixed, mechanism='gaussian_adaptive')
    assert privacy.compute_epsilon(adaptive, 5)['epsilon'] == pytest.approx(
        privacy.compute_epsilon(fixed, 5)['epsilon'], rel=1e-6)


def test_zero_noise_has_infinite_epsilon():
  for sampling in ('poisson', 'fixed_size'):
    config = _config(noise_multiplier=0.0, sampling=sampling)
    assert privacy.compute_epsilon(config, 1)['epsilon'] == math.inf


# 4. Calibration.


@pytest.mark.parametrize('sampling', ['fixed_size', 'poisson'])
def test_calibrated_noise_multiplier_is_tight(sampling):
  target = 2.0
  config = privacy.DPConfig(mechanism='gaussian_fixed', target_epsilon=target,
                            clients_per_round=10, population=100, rounds=10,
                            sampling=sampling)
  resolved = privacy.resolve(config)
  z = resolved.noise_multiplier
  if sampling == 'fixed_size':  # (Calibration is slower with PLD.)
    assert privacy.calibrate_noise_multiplier(config) == z
  assert resolved.target_epsilon is None
  assert resolved.target_delta == privacy.default_target_delta(100)

  assert privacy.compute_epsilon(resolved, 10)['epsilon'] <= target
  looser = dataclasses.replace(resolved, noise_multiplier=z * (1 - 1e-2))
  assert privacy.compute_epsilon(looser, 10)['epsilon'] > target


def test_calibration_beyond_adaptive_limit_raises():
  config = privacy.DPConfig(mechanism='gaussian_adaptive', target_epsilon=0.1,
                            clients_per_round=10, population=100, rounds=100)
  with pytest.raises(ValueError, match='noise_multiplier'):
    privacy.calibrate_noise_multiplier(config)


# 5. Validation.


@pytest.mark.parametrize('kwargs, field', [
    (dict(mechanism='laplace'), 'mechanism'),
    (dict(sampling='shuffle'), 'sampling'),
    (dict(noise_multiplier=-0.1), 'noise_multiplier'),
    (dict(noise_multiplier=float('nan')), 'noise_multiplier'),
    (dict(noise_multiplier=float('inf')), 'noise_multiplier'),
    (dict(clip_norm=0.0), 'clip_norm'),
    (dict(clip_norm=-1.0), 'clip_norm'),
    (dict(clip_norm=float('nan')), 'clip_norm'),
    (dict(clients_per_round=0), 'clients_per_round'),
    (dict(clients_per_round=2.5), 'clients_per_round'),
    (dict(clients_per_round=101, population=100), 'clients_per_round'),
    (dict(population=0), 'population'),
    (dict(rounds=0), 'rounds'),
    (dict(target_delta=0.0), 'target_delta'),
    (dict(target_delta=1.0), 'target_delta'),
    (dict(target_delta=float('nan')), 'target_delta'),
    (dict(target_delta=0.02, population=100), 'target_delta'),
    (dict(noise_multiplier=None, target_epsilon=0.0), 'target_epsilon'),
    (dict(noise_multiplier=None, target_epsilon=-1.0), 'target_epsilon'),
    (dict(target_epsilon=2.0), 'target_epsilon'),
    (dict(noise_multiplier=None), 'noise_multiplier'),
    (dict(mechanism='none'), 'noise_multiplier'),
    (dict(target_unclipped_quantile=1.5), 'target_unclipped_quantile'),
    (dict(mechanism='gaussian_adaptive', noise_multiplier=1.0,
          clients_per_round=10), 'noise_multiplier'),
])
def test_validation_names_the_bad_field(kwargs, field):
  config = _config(**kwargs)
  with pytest.raises(ValueError, match=field):
    config.validate()
  with pytest.raises(ValueError, match=field):
    privacy.build_aggregator(config)


def test_valid_configs_pass_validation():
  for config in (
      privacy.DPConfig(),
      _config(),
      _config(noise_multiplier=None, target_epsilon=1.0),
      _config(mechanism='gaussian_adaptive', noise_multiplier=0.9,
              clients_per_round=10),
      _config(clients_per_round=100, population=100, target_delta=1e-3,
              sampling='poisson'),
  ):
    config.validate()


def test_pld_of_a_small_noise_multiplier_stays_in_bounded_memory():
  """PLD's privacy-loss grid grows as 1 / z^2: at z = 0.05 with every
  client in every round, the default discretisation needs over 20 GiB. The
  accountant widens it (`pld_discretization`) and the epsilon it reports
  is still at most RDP's (both are upper bounds). Run under a 3 GiB address
  space limit in a child process, so that a regression fails, not the
  machine."""
  assert privacy.pld_discretization(1.0) == 1e-4
  assert privacy.pld_discretization(0.05) == pytest.approx(1e-4 * 36)
  program = textwrap.dedent('''
      import resource
      resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
      from tff_personal.core import privacy
      report = privacy.compute_epsilon(privacy.DPConfig(
          mechanism='gaussian_fixed', noise_multiplier=0.05, clip_norm=1.0,
          clients_per_round=8, population=8, rounds=10), 10)
      print(report['accountant'], report['epsilon_pld'], report['epsilon_rdp'])
  ''')
  out = subprocess.run([sys.executable, '-c', program], capture_output=True,
                       text=True, timeout=300,
                       cwd=os.path.dirname(os.path.dirname(__file__)))
  assert out.returncode == 0, out.stderr[-2000:]
  accountant, pld, rdp = out.stdout.split()
  assert accountant == 'pld'
  assert 0 < float(pld) <= float(rdp)
