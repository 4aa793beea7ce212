"""Distributed DP with secure aggregation (`privacy.DISTRIBUTED_MECHANISMS`).

The accounting is held to the bound computed here independently: the scale
and the rounding's inflation from TFF's own functions, Kairouz, Liu, Steinke
2021 Prop. 14 (distributed discrete Gaussian), Agarwal, Kairouz, Liu 2021
Thm. 3.5 (Skellam) and Wang, Balle, Kasiviswanathan 2019 Thm. 9 written out
with Python integers and `math`, composition and the RDP-to-DP conversion (Canonne,
Kamath, Steinke 2020, Prop. 12) written out too. The mechanism is held to
what the bound assumes (TFF's scale, norm bound and noise, run), and every
registered algorithm either runs it, its production form carrying secure
sums, or the registry says why and a run of it is refused.
"""

import dataclasses
import math
import types

from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib
import numpy as np
import pytest
from scipy import special
import tensorflow as tf
import tensorflow_federated as tff
from tensorflow_federated.python.aggregators import discretization
from tensorflow_federated.python.aggregators import distributed_dp as tff_ddp

from tests import conformance_test as conformance
from tests import fedembed_testdata
from tests import fedperc_testdata
from tff_personal.algorithms import registry
from tff_personal.config import experiment
from tff_personal.core import privacy
from tff_personal.core import production
from tff_personal.core import runtime
from tff_personal.core import sharded
from tff_personal.records import run_privacy

_ORDERS = list(range(2, 257)) + [384, 512, 768, 1024]


def _config(**kwargs) -> privacy.DPConfig:
  base = dict(mechanism='distributed_dgauss', noise_multiplier=1.0,
              clip_norm=1.0, clients_per_round=10, population=100, rounds=5)
  base.update(kwargs)
  return privacy.DPConfig(**base)


# 1. The accounting, held to an independent computation of the bound.


def _round_parameters(z, c, n, d, bits=20):
  """(L2, L1, sigma) of one round in TFF's scaled domain: TFF's own scale
  and inflation functions, replace-one sensitivities, and the stated lower
  bound on the shares' parameter (TFF hands it over in float32)."""
  k = math.sqrt(2) * special.erfcinv(1e-4)
  sigma_local = z * c / math.sqrt(n)
  scale = float(tff_ddp._heuristic_scale_factor(  # pylint: disable=protected-access
      sigma_local, c, bits, n, d, k).numpy())
  scale = min(scale, tff_ddp.MAX_SCALE_FACTOR)
  # TFF computes the inflated bound in float32; recomputed in float64 from
  # its formula at beta = 0 (the float32 value is checked to agree).
  inflated = c + math.sqrt(d) / scale
  tff_inflated = float(discretization.inflated_l2_norm_bound(
      l2_norm_bound=c, gamma=1.0 / scale, beta=0.0, dim=d).numpy())
  assert abs(tff_inflated - inflated) <= 1e-6 * inflated
  l2 = (inflated + 1e-5) * scale
  l1 = math.ceil(l2 * min(math.sqrt(d), l2))
  return 2 * l2, 2 * l1, sigma_local * scale * (1 - 2.0**-23)


def _prop14(alpha, l2, l1, sigma, n, d):
  """Kairouz et al. 2021, Prop. 14, written out."""
  if sigma < 0.5:
    return math.inf
  tau = 10 * math.fsum(
      math.exp(-2 * math.pi**2 * sigma**2 * k / (k + 1)) for k in range(1, n))
  s = math.sqrt(n) * sigma
  return min(alpha / 2 * (l2 / s)**2 + tau * d,
             alpha / 2 * ((l2 / s)**2 + 2 * (l1 / s) * tau + tau**2 * d),
             alpha / 2 * (l2 / s + tau * math.sqrt(d))**2)


def _skellam35(alpha, l2, l1, sigma, n):
  """Agarwal et al. 2021, Thm. 3.5, for the sum of n Skellam shares of
  variance sigma^2 (one Skellam variable of variance n sigma^2)."""
  mu = n * sigma**2
  return alpha * l2**2 / (2 * mu) + min(
      ((2 * alpha - 1) * l2**2 + 6 * l1) / (4 * mu**2), 3 * l1 / (2 * mu))


def _wbk9(alpha, q, eps):
  """Wang, Balle, Kasiviswanathan 2019, Thm. 9 with eps(inf) = inf,
  written out term by term (log of a sum of positive terms, the largest
  factored out); at most eps(alpha)."""
  logs = [0.0]
  e2 = eps(2)
  logs.append(2 * math.log(q) + math.log(math.comb(alpha, 2)) +
              min(math.log(4 * math.expm1(e2)), math.log(2) + e2))
  for j in range(3, alpha + 1):
    logs.append(math.log(2) + j * math.log(q) +
                math.log(math.comb(alpha, j)) + (j - 1) * eps(j))
  top = max(logs)
  total = top + math.log(math.fsum(math.exp(x - top) for x in logs))
  return min(total / (alpha - 1), eps(alpha))


def _independent_epsilon(mechanism, z, c, n, population, rounds, delta,
                         d=privacy.DDP_MAX_DIMENSION):
  l2, l1, sigma = _round_parameters(z, c, n, d)
  if mechanism == 'distributed_dgauss':
    eps = lambda a: _prop14(a, l2, l1, sigma, n, d)
  else:
    eps = lambda a: _skellam35(a, l2, l1, sigma, n)
  q = n / population
  best = math.inf
  for a in _ORDERS:
    rdp = rounds * (eps(a) if q == 1 else _wbk9(a, q, eps))
    # Canonne, Kamath, Steinke 2020, Prop. 12.
    best = min(best, rdp + math.log1p(-1 / a) - math.log(delta * a) / (a - 1))
  return best


@pytest.mark.parametrize('mechanism', privacy.DISTRIBUTED_MECHANISMS)
@pytest.mark.parametrize('z,c,n,population,rounds', [
    (1.0, 1.0, 10, 100, 5),
    (0.7, 0.5, 3, 10, 20),
    (2.0, 1.0, 10, 10, 3),      # No sampling.
    (1.0, 0.1, 50, 5000, 200),
])
def test_reported_epsilon_is_the_independent_bound(mechanism, z, c, n,
                                                   population, rounds):
  config = _config(mechanism=mechanism, noise_multiplier=z, clip_norm=c,
                   clients_per_round=n, population=population,
                   rounds=rounds)
  report = privacy.compute_epsilon(config, rounds)
  want = _independent_epsilon(mechanism, z, c, n, population, rounds,
                              report['delta'])
  assert report['epsilon'] == pytest.approx(want, rel=1e-9)
  assert report['epsilon_pld'] is None and report['accountant'] == 'rdp'
  assert report['neighboring_relation'] == 'replace_one'
  # The report states the bound and the inflation it accounts.
  ddp = report['distributed']
  paper = ('Prop. 14' if mechanism == 'distributed_dgauss' else
           'Thm. 3.5')
  assert paper in ddp['bound'] and 'Thm. 9' in ddp['subsampling']
  assert ddp['dimension'] == privacy.DDP_MAX_DIMENSION
  assert ddp['inflation'] > 1


def test_tau_term_is_the_independent_bound():
  """Where the shares are narrow (sigma near 1), tau counts: Prop. 14's
  three terms, held to the written-out bound, and above the continuous
  Gaussian's RDP at the same sensitivity and total noise."""
  bound = privacy.DdpBound(mechanism='distributed_dgauss', dimension=1000,
                           bits=20, scale=1.0,
                           l2_sensitivity=6.0, l1_sensitivity=40.0,
                           local_sigma=0.9, shares=5, tau=10 * math.fsum(
                               math.exp(-2 * math.pi**2 * 0.81 * k / (k + 1))
                               for k in range(1, 5)), inflation=1.0)
  orders = np.arange(2, 50)
  got = bound.rdp(orders)
  want = [_prop14(int(a), 6.0, 40.0, 0.9, 5, 1000) for a in orders]
  np.testing.assert_allclose(got, want, rtol=1e-12)
  gaussian = orders / 2 * (6.0 / (math.sqrt(5) * 0.9))**2
  assert bound.tau > 1e-7 and np.all(got > gaussian)
  narrow = dataclasses.replace(bound, local_sigma=0.4)
  assert np.all(np.isinf(narrow.rdp(orders)))  # No bound below 1/2.
  # Skellam has no such term: its shares sum to one Skellam variable.
  skellam = dataclasses.replace(bound, mechanism='distributed_skellam',
                                local_sigma=0.4, tau=0.0)
  np.testing.assert_allclose(
      skellam.rdp(orders),
      [_skellam35(int(a), 6.0, 40.0, 0.4, 5) for a in orders], rtol=1e-12)


def test_subsampling_bound_against_dp_accountings_gaussian():
  """For a Gaussian's RDP curve, Thm. 9 (general) is at least dp_accounting's
  strengthened bound for the Gaussian (WBK Thm. 27) and at most the
  unsampled curve, and it shrinks with q."""
  sigma = 1.5
  all_orders = np.arange(2, 65)
  curve = all_orders / (2 * sigma**2)
  orders = [2, 3, 8, 16, 32, 64]
  for q in (0.01, 0.1, 0.5):
    ours = privacy._subsampled_rdp(curve, orders, q)  # pylint: disable=protected-access
    theirs = rdp_lib._compute_rdp_sample_wor_gaussian(q, sigma, orders)  # pylint: disable=protected-access
    assert np.all(ours >= theirs - 1e-12)
    assert np.all(ours <= curve[np.array(orders) - 2] + 1e-12)
  small = privacy._subsampled_rdp(curve, orders, 0.01)  # pylint: disable=protected-access
  large = privacy._subsampled_rdp(curve, orders, 0.1)  # pylint: disable=protected-access
  assert np.all(small < large)


def test_epsilon_grows_with_the_dimension_so_the_bound_covers_smaller():
  """The accounting uses DDP_MAX_DIMENSION: epsilon (and the inflation)
  grow with the dimension, so an update with fewer coordinates is
  covered."""
  config = _config()
  orders = np.arange(2, 65)
  previous = None
  for d in (2, 1000, 10**5, 10**7, privacy.DDP_MAX_DIMENSION):
    bound = privacy.ddp_bound(config, dimension=d)
    rdp = bound.rdp(orders)
    if previous is not None:
      assert bound.inflation >= previous[0]
      assert np.all(rdp >= previous[1])
    previous = (bound.inflation, rdp)


@pytest.mark.parametrize('mechanism', privacy.DISTRIBUTED_MECHANISMS)
def test_calibration_meets_the_target(mechanism):
  config = _config(mechanism=mechanism, noise_multiplier=None,
                   target_epsilon=4.0, rounds=10)
  z = privacy.resolve(config).noise_multiplier
  spent = privacy.compute_epsilon(privacy.resolve(config), 10)['epsilon']
  assert spent <= 4.0 and spent == pytest.approx(4.0, rel=0.01)
  below = privacy.compute_epsilon(_config(
      mechanism=mechanism, noise_multiplier=z * 0.99, rounds=10),
                                  10)['epsilon']
  assert below > 4.0


def test_phases_add_their_rdp():
  """Two phases of the same configuration account as one of their total
  rounds."""
  config = privacy.resolve(_config())
  two = privacy.compute_epsilon_phases([(config, 3), (config, 4)])
  assert two['epsilon'] == pytest.approx(
      privacy.compute_epsilon(config, 7)['epsilon'], rel=1e-12)


def test_poisson_sampling_is_refused():
  with pytest.raises(ValueError, match="needs sampling='fixed_size'"):
    _config(sampling='poisson').validate()


# 2. The mechanism is what the accounting assumes.


@pytest.mark.parametrize('mechanism', privacy.DISTRIBUTED_MECHANISMS)
def test_tff_mechanism_runs_with_the_accounted_parameters(mechanism):
  """One round of the aggregator on d coordinates: TFF's scale, norm bound
  and noise are `ddp_bound`'s at that (padded) dimension, the result is the
  mean of the clipped updates plus noise of std z c / n per coordinate, and
  an update inside the clip comes back up to the noise."""
  n, z, c, d = 4, 0.5, 1.0, 3999
  config = _config(mechanism=mechanism, noise_multiplier=z, clip_norm=c,
                   clients_per_round=n, population=40)
  factory = privacy.build_aggregator(config)
  assert privacy.config_of(factory) == privacy.resolve(config)
  proc = factory.create(tff.TensorType(np.float32, [d]))
  rng = np.random.default_rng(0)
  values = [(0.01 * rng.normal(size=d)).astype(np.float32) for _ in range(n)]
  with runtime.local_runtime():
    out = proc.next(proc.initialize(), values)
  measured = out.measurements['mean_value']
  bound = privacy.ddp_bound(config,
                            dimension=privacy.ddp_padded_dimension(d))
  assert measured['padded_dim'] == bound.dimension == 4000
  assert measured['actual_num_clients'] == n
  assert measured['scale_factor'] == pytest.approx(bound.scale, rel=1e-6)
  assert measured['scaled_inflated_l2'] == pytest.approx(
      bound.l2_sensitivity / 2, rel=1e-6)
  assert measured['scaled_local_stddev'] == pytest.approx(
      bound.local_sigma, rel=1e-6)
  error = np.asarray(out.result) - np.mean(values, axis=0)
  assert np.std(error) == pytest.approx(z * c / n, rel=0.1)
  assert abs(np.mean(error)) < 5 * z * c / n / math.sqrt(d)


def test_an_update_larger_than_the_accounted_dimension_is_refused(
    monkeypatch):
  monkeypatch.setattr(privacy, 'DDP_MAX_DIMENSION', 64)
  factory = privacy.build_aggregator(_config())
  factory.create(tff.TensorType(np.float32, [64]))
  with pytest.raises(ValueError, match='65 coordinates'):
    factory.create(tff.TensorType(np.float32, [65]))


def test_release_labels_say_who_is_trusted(tmp_path):
  config = experiment.ExperimentConfig(
      algorithm='fedembed_prototype', rounds=2, clients_per_round=3,
      root_output_dir=str(tmp_path), experiment_name='x',
      dp=_config(clients_per_round=3, population=10))
  dp = experiment.validate(config, 10)
  labels = {r['name']: r for r in run_privacy.released_values(config, dp)}
  update = labels['shared model update']
  assert update['covered'] and update['basis'] == 'dp'
  assert 'secure aggregation' in update['trusted']
  assert 'noise share' in update['trusted']
  assert 'plain sums' in update['trusted']
  central = run_privacy.released_values(
      config, privacy.resolve(_config(mechanism='gaussian_fixed',
                                      clients_per_round=3, population=10)))
  assert 'un-noised update' in central[0]['trusted']


def test_the_sharded_simulation_runs_it_one_user_per_client():
  """Automatic sharding picks one user per client for it; shards asked
  for explicitly are refused, naming the mechanism."""
  proc = conformance._build(  # pylint: disable=protected-access
      'global', aggregator_factory=privacy.build_aggregator(_config()))
  assert sharded.resolve_num_shards(proc, sharded.AUTO) == 0
  with pytest.raises(ValueError, match='simulation_shards=0.*distributed'):
    sharded.ShardedProcess(proc, 2)


@pytest.mark.parametrize('mechanism', ['distributed_dgauss',
                                       'gaussian_adaptive'])
def test_explicit_shards_are_refused_before_the_run(mechanism, tmp_path):
  config = experiment.ExperimentConfig(
      algorithm='global', rounds=2, clients_per_round=3,
      root_output_dir=str(tmp_path), experiment_name='x',
      simulation_shards=2, dp=_config(mechanism=mechanism,
                                      noise_multiplier=0.1,
                                      clients_per_round=3, population=10))
  with pytest.raises(ValueError, match='simulation_shards=2'):
    experiment.validate(config, 10)
  experiment.validate(dataclasses.replace(config, simulation_shards=-1), 10)


# 3. Every registered algorithm runs it, or the registry says why.


def _build(name, factory):
  if 'groups' in registry.spec(name).needs:
    task = vars(conformance._TASK)  # pylint: disable=protected-access
    grouped = types.SimpleNamespace(**task,
                                    groups=lambda ids: [i % 2 for i in ids])
    return registry.build_for_task(
        name, grouped, seed=2,
        client_optimizer=tff.learning.optimizers.build_sgdm(0.1),
        server_optimizer=tff.learning.optimizers.build_sgdm(1.0),
        aggregator_factory=factory)
  overrides = {'aggregator_factory': factory}
  if name == 'feddva':  # Small encoders.
    overrides.update(pretrain_rounds=2, dim=2, channels='2,2,2,3', hidden=5)
  return conformance._build(name, **overrides)  # pylint: disable=protected-access


_SIZES = [4, 7, 5]


def _one_per_family() -> list[str]:
  first = {}
  for name, spec in registry.SPECS.items():
    first.setdefault(spec.family, name)
  return sorted(first.values())


# The distributed aggregator wraps the process's update whatever the
# algorithm, so one algorithm of each family runs the discrete Gaussian,
# and so does each whose round aggregates an update of its own structure
# (K cluster models, APFL's mixing weight, pFedMe's moving local model, a
# staged algorithm's second stage); the registry's refusal (fedembed_som)
# runs too. The Skellam aggregator differs from the discrete Gaussian's in
# the aggregator alone: one single-stage and one staged algorithm run it.
_DGAUSS = sorted(set(_one_per_family()) | {
    'apfl', 'hypcluster', 'pfedme', 'groupperfl', 'fedembed_prototype',
    'fedembed_som', 'meta_learning'})


@pytest.mark.parametrize('name,mechanism', [
    (n, 'distributed_dgauss') for n in _DGAUSS] + [
        (n, 'distributed_skellam') for n in ('global', 'groupfl')])
def test_algorithms_run_distributed_dp(name, mechanism):
  """Built with the distributed aggregator, every stage's production form
  compiles to MapReduceForm with secure-sum pieces, and one round runs in
  the simulation (secure sums lowered to plain sums) and moves the shared
  weights; or the registry states why the algorithm does not run it, and
  building or running it does fail."""
  factory = privacy.build_aggregator(_config(
      mechanism=mechanism, noise_multiplier=0.1,
      clients_per_round=len(_SIZES), population=30))
  reason = registry.spec(name).distributed_dp
  if reason:
    with pytest.raises(ValueError):
      _run_one_round(name, factory)
    return
  _run_one_round(name, factory)


@pytest.mark.parametrize('mechanism', privacy.DISTRIBUTED_MECHANISMS)
@pytest.mark.parametrize('name', sorted(
    n for n, s in registry.SPECS.items() if s.distributed_dp))
def test_a_run_of_an_algorithm_that_does_not_run_it_is_refused(
    name, mechanism, tmp_path):
  """The binaries' and `run_experiment`'s validation refuses the
  algorithms the registry excludes, with the registry's reason, even
  where an option would let the builder go on (fedembed_som's
  allow_unprotected_best_client)."""
  options = ({'allow_unprotected_best_client': True}
             if name == 'fedembed_som' else {})
  config = experiment.ExperimentConfig(
      algorithm=name, algorithm_options=options, rounds=2,
      clients_per_round=3, root_output_dir=str(tmp_path),
      experiment_name='x', dp=_config(mechanism=mechanism,
                                      clients_per_round=3, population=10))
  with pytest.raises(ValueError, match='does not run dp mechanism'):
    experiment.validate(config, 10)


def _run_one_round(name, factory):
  built = _build(name, factory)
  for _, form in production.production_forms(built):
    mrf = form.map_reduce_form()
    secure = [tf.nest.flatten(getattr(mrf, piece)()) for piece in (
        'secure_sum_bitwidth', 'secure_sum_max_input',
        'secure_modular_sum_modulus')]
    assert any(secure), f'{name}: no secure-sum piece'
  proc = production.production_forms(built)[-1][1].process
  typed = hasattr(proc.client_data_type.element, 'type')
  if conformance._is_fedperc(name):  # pylint: disable=protected-access
    data = fedperc_testdata.datasets(_SIZES, 0)
  else:
    data = conformance._datasets(_SIZES, 0, typed)  # pylint: disable=protected-access
  clients = fedembed_testdata.initial_states(proc, len(_SIZES), seed=4)
  with runtime.local_runtime():
    state = proc.initialize()
    before = [np.asarray(w) for w in tf.nest.flatten(
        proc.get_model_weights(state))]
    state, _, _ = proc.next(state, clients, data)
    after = [np.asarray(w) for w in tf.nest.flatten(
        proc.get_model_weights(state))]
  assert all(np.all(np.isfinite(w)) for w in after)
  assert any(not np.array_equal(a, b) for a, b in zip(before, after))
