"""User-level differential privacy for federated aggregation, with accounting.

What this module does
---------------------
`build_aggregator` turns a `DPConfig` into a TFF aggregation factory that the
federated algorithms use to average client model updates:

* `'none'`: `tff.aggregators.MeanFactory()` (weighted mean, no privacy).
* `'gaussian_fixed'`: `tff.aggregators.DifferentiallyPrivateFactory.
  gaussian_fixed`, i.e. tensorflow-privacy's `GaussianSumQuery` wrapped in a
  `NormalizedQuery`: every client update is clipped to L2 norm `clip_norm`
  *jointly over all of its tensors* (`tf.clip_by_global_norm` of the whole
  update structure), the clipped updates are summed, Gaussian noise of standard
  deviation `noise_multiplier * clip_norm` is added to every coordinate of the
  sum, and the result is divided by the *expected* cohort size
  `clients_per_round`. Clipping the whole update of a client bounds that
  client's (the user's) total influence: this is user-level DP.
* `'gaussian_adaptive'`: `DifferentiallyPrivateFactory.gaussian_adaptive`
  (tensorflow-privacy's `QuantileAdaptiveClipSumQuery`, Andrew et al. 2021,
  https://arxiv.org/abs/1905.03871), whose clip norm starts at `clip_norm` and
  tracks the `target_unclipped_quantile` of the update norms, estimated with a
  noised count of unclipped clients.
* `'distributed_dgauss'`: distributed DP with secure aggregation,
  TFF's `DistributedDpSumFactory(mechanism='distributed_dgauss')`
  (the distributed discrete Gaussian of Kairouz, Liu, Steinke 2021,
  https://arxiv.org/abs/2102.06387) under TFF's `UnweightedMeanFactory`.
  On each device the update is flattened, rotated (randomized DFT), clipped
  to L2 norm `clip_norm`, scaled by a factor s, stochastically rounded to
  integers, and noised with a discrete Gaussian share; the shares and
  updates are summed modulo 2^`DDP_BITS` by secure aggregation (the
  compiled forms' `secure_sum_*` pieces), so no one, the server included,
  sees a single update or the sum before noise. The server divides the sum
  (and the securely summed count of clients) out. See "Distributed DP"
  below for its accounting and trust model.
* `'distributed_skellam'`: the same with Skellam shares (difference of two
  Poisson variables; Agarwal, Kairouz, Liu 2021,
  https://arxiv.org/abs/2110.04995), `mechanism='distributed_skellam'`.

`compute_epsilon` / `privacy_report` account the privacy cost of running such
an aggregator for a number of rounds with `dp_accounting`, and
`calibrate_noise_multiplier` finds the noise multiplier meeting a target
epsilon.

What is hand-written and what is not
------------------------------------
The mechanisms (clipping, noising, adaptive-clip estimation) are entirely
TFF's and tensorflow-privacy's; the privacy analyses (RDP of the Poisson
subsampled Gaussian and of the Gaussian sampled without replacement, PLD of
the Poisson subsampled Gaussian) are entirely `dp_accounting`'s, and the root
finder is scipy's `brentq`. Written here by hand is only the glue:
configuration and its validation, the choice of `DpEvent` and neighbouring
relation for each sampling scheme, the conversion of TFF's noise multiplier
into the one those events expect (the factor 1/2 under replace-one, below),
the effective noise multiplier of the adaptive mechanism, and the bracketing
for calibration.

Trust model and scope
---------------------
This is central DP as in DP-FedAvg (McMahan et al. 2018): the clipped updates
are summed by `tff.federated_sum` (in a deployment, a trusted aggregator or
secure aggregation, so that no one sees the sum before noise) and the server's
training logic receives only the noisy mean. The guarantee covers exactly what
flows through this aggregator. Client-local private state (personalized
layers, per-client optimizer state, data) never goes through this path: it
stays on the client and is neither clipped, noised nor released. Anything else
the algorithm releases from clients (e.g. non-private training metrics) is not
covered by the epsilon reported here.

Accounting choices
------------------
The noise multiplier z of TFF/tensorflow-privacy is `stddev / clip_norm`, i.e.
noise std relative to the L2 sensitivity of the sum under *add-or-remove-one*
(adding or removing one client changes the sum of clipped updates by at most
`clip_norm`). The `dp_accounting` events take "the ratio of the standard
deviation of the Gaussian noise to the l2-sensitivity of the function to which
it is added" (`rdp_privacy_accountant._compute_rdp_sample_wor_gaussian`; the
`GaussianDpEvent` docstring: "If the norms of the values are bounded
||v_i|| <= C, the noise_multiplier is defined as s / C").

* `sampling='poisson'` (each client joins a round independently with
  probability q = clients_per_round / population):
  `SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(z)), rounds)`
  under add-or-remove-one; both the RDP and the PLD accountant are run and the
  (tighter) PLD epsilon is reported.
* `sampling='fixed_size'` (exactly clients_per_round of population clients,
  uniformly without replacement): `dp_accounting` supports this only as
  `SampledWithoutReplacementDpEvent` with the RDP accountant and
  `NeighboringRelation.REPLACE_ONE` (Wang, Balle, Kasiviswanathan 2019, Thm.
  27); the PLD accountant has no such event, so `epsilon_pld` is None, except
  for the unsampled case clients_per_round == population, where the mechanism
  is a plain Gaussian and PLD is reported as well. Replacing one client's
  update v by v' changes the sum by ||v - v'|| <= 2 * clip_norm, so the L2
  sensitivity is twice the add-or-remove one and the event gets the
  noise multiplier z / 2. Replace-one epsilons are therefore much larger than
  Poisson ones at equal z, and the two are guarantees for different
  neighbouring relations (the population size is public under replace-one).
* `mechanism='gaussian_adaptive'`: TFF splits the requested z into a larger
  noise multiplier z_v for the update sum and a noise multiplier 2 * sigma_b
  for the count of unclipped clients (std sigma_b, default
  0.05 * clients_per_round, on records of +-0.5, sensitivity 0.5), such that
  z_v**-2 + (2 * sigma_b)**-2 == z**-2 (`adaptive_clip_noise_params`). Both
  queries see the same sampled clients, so the pair is one Gaussian mechanism
  with the effective multiplier (z_v**-2 + (2 sigma_b)**-2)**-0.5 (Mironov et
  al. 2019, Sec. 3; what `dp_accounting` itself does for a `ComposedDpEvent`
  of Gaussians). It is recomputed here from TFF's own split and used in place
  of z; the count's sensitivity doubles under replace-one as well (-0.5 to
  +0.5), so the same factor 1/2 applies.

The accounting is planned from the configuration; it assumes the training loop
samples clients exactly as `sampling` says and that the aggregator divides by
the expected cohort `clients_per_round` (as TFF's factories do).

Distributed DP (`DISTRIBUTED_MECHANISMS`)
-----------------------------------------
Trust: the server (and whoever runs the aggregation) is not trusted with
any update: secure aggregation must reveal the sum only. Trusted instead:
the secure aggregation protocol; every sampled device to add its noise
share (the guarantee assumes all `clients_per_round` shares; if k devices
drop out or collude with the server, the noise left is that of n - k
shares); and the server to sample cohorts uniformly and secretly and to
send the devices the configured noise and clip. The simulation runs the
secure sums as plain sums (TFF's test backend lowering, `core/runtime.py`),
so it computes the mechanism but protects nothing itself.

Sampling: `sampling='fixed_size'` only. The noise is split among exactly
`clients_per_round` devices; under Poisson sampling a smaller cohort would
add less noise than the accounting assumes, and TFF's factory has no
remedy. Neighbouring relation: replace-one, as for the fixed-size Gaussian.

Per-round bound, in TFF's scaled integer domain (`DistributedDpSumFactory`
with `bits=DDP_BITS`, `rotation_type='dft'`, `beta=0`, `modclip_prob=1e-4`,
so k = sqrt(2) erfcinv(1e-4) standard deviations), for n =
clients_per_round, clip c, noise multiplier z and a padded dimension d (the
accounting uses the bound `DDP_MAX_DIMENSION`; the aggregator refuses an
update with more coordinates; every quantity below grows with d, so the
bound is an upper bound for any smaller update):

* scale s = min(sqrt(2^(2b) - n k^2) / (2k sqrt(c^2 n^2 / d + z^2 c^2)),
  1e6) (TFF's `_heuristic_scale_factor` and `MAX_SCALE_FACTOR`);
* the inflation: rotation is orthogonal and the clip comes after it (no
  inflation); unconditional stochastic rounding moves each coordinate by
  less than 1, so a record's L2 norm is at most
  L2 = (c + sqrt(d) / s + 1e-5) s (TFF's `inflated_l2_norm_bound` at
  beta=0 plus its 1e-5 leeway; the query asserts it on every record), and
  its L1 norm at most L1 = ceil(L2 min(sqrt(d), L2)) (integer entries);
* replace-one sensitivities Delta2 = 2 L2, Delta1 = 2 L1;
* each of the n shares has parameter (standard deviation) at least
  sigma = z c s / sqrt(n) (1 - 2^-23) (TFF passes z c s / sqrt(n) to
  tensorflow-privacy in float32, which the factor covers; the discrete
  Gaussian sampler rounds it up);
* 'distributed_dgauss': Kairouz et al. 2021, Proposition 14 (the RDP form of their Theorem 1),
  for sigma >= 1/2, tau = 10 sum_{k=1}^{n-1} exp(-2 pi^2 sigma^2 k/(k+1)):
  eps(a) = min(a/2 Delta2^2/(n sigma^2) + tau d,
               a/2 (Delta2^2/(n sigma^2) + 2 Delta1 tau/(sqrt(n) sigma)
                    + tau^2 d),
               a/2 (Delta2/(sqrt(n) sigma) + tau sqrt(d))^2);
  sigma < 1/2 has no stated bound: epsilon is infinite.
* 'distributed_skellam': the n shares sum to one Skellam variable of
  variance mu = n sigma^2 per coordinate (Skellam variables add up), and
  Agarwal, Kairouz, Liu 2021, Theorem 3.5 (Corollary 3.6 for the sum),
  for integer a > 1:
  eps(a) = a Delta2^2 / (2 mu) + min(((2a - 1) Delta2^2 + 6 Delta1)
                                     / (4 mu^2), 3 Delta1 / (2 mu)).
* sampling clients_per_round of population without replacement: the
  general bound of Wang, Balle, Kasiviswanathan 2019, Theorem 9, for an
  integer order a >= 2, q = clients_per_round / population, and a
  mechanism with eps(inf) = inf:
  eps'(a) = 1/(a-1) log(1 + q^2 C(a,2) min(4 (e^eps(2) - 1), 2 e^eps(2))
                        + sum_{j=3}^a 2 q^j C(a,j) e^((j-1) eps(j))),
  and min(eps'(a), eps(a)) (dp_accounting's own subsampled-Gaussian bounds
  use the Gaussian's shape and do not apply); no sampling
  (clients_per_round == population): eps(a).

Rounds compose by adding the RDP curves (integer orders `_DDP_ORDERS`), and
`dp_accounting.rdp.compute_epsilon` converts the total to (epsilon, delta).
Written here by hand: the bounds' formulas above (dp_accounting has no
event for the distributed discrete Gaussian or Skellam and no general
subsampled-RDP bound); the mechanism is entirely TFF's and tensorflow-privacy's.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Callable, Optional, Sequence, Union
import warnings
import weakref

import dp_accounting
from dp_accounting import pld as dp_pld
from dp_accounting import rdp as dp_rdp
import numpy as np
from scipy import optimize
from scipy import special
import tensorflow as tf
import tensorflow_federated as tff
# TFF's own split of the noise multiplier between the update sum and the
# adaptive-clip count (not exported under `tff.aggregators`).
from tensorflow_federated.python.aggregators import differential_privacy as _tff_dp
# TFF 0.87 ships `DistributedDpSumFactory` but does not export it under
# `tff.aggregators`.
from tensorflow_federated.python.aggregators import distributed_dp as _tff_ddp
# How TFF's `DistributedDpSumFactory.create` counts an update's coordinates.
from tensorflow_federated.python.core.impl.types import array_shape as _tff_shape
from tensorflow_federated.python.core.impl.compiler import transformations as _tff_transformations
from tensorflow_federated.python.core.impl.computation import computation_impl as _tff_computation
from tensorflow_federated.python.core.impl.context_stack import context_stack_impl as _tff_context_stack
from tensorflow_federated.python.core.impl.types import type_conversions as _tff_types

from tff_personal.core import moved

MECHANISMS = ('none', 'gaussian_fixed', 'gaussian_adaptive',
              'distributed_dgauss', 'distributed_skellam')
SAMPLING_SCHEMES = ('fixed_size', 'poisson')

_DP_MECHANISMS = ('gaussian_fixed', 'gaussian_adaptive', 'distributed_dgauss',
                  'distributed_skellam')
# Mechanisms whose noise is added on the devices and whose sums go through
# secure aggregation (TFF's `DistributedDpSumFactory`).
DISTRIBUTED_MECHANISMS = ('distributed_dgauss', 'distributed_skellam')
# The paper each distributed mechanism's RDP bound is from.
DDP_BOUNDS = {
    'distributed_dgauss': 'Kairouz, Liu, Steinke 2021, Prop. 14',
    'distributed_skellam': 'Agarwal, Kairouz, Liu 2021, Thm. 3.5',
}
# The secure aggregation's bit width (TFF's own default in
# `tff.learning.ddp_secure_aggregator`) and the largest padded dimension of
# an update that the accounting covers (the aggregator refuses larger ones).
DDP_BITS = 20
DDP_MAX_DIMENSION = 2**24
# TFF's defaults for the modular wrapping probability and its cap on the
# scale factor (`distributed_dp.MAX_SCALE_FACTOR`).
_DDP_MODCLIP_PROB = 1e-4
_DDP_MAX_SCALE = 1e6
# Integer RDP orders of the distributed accounting (the subsampling bound
# holds for integer orders).
_DDP_ORDERS = tuple(range(2, 257)) + (384, 512, 768, 1024)
# Relative precision of `calibrate_noise_multiplier`.
_CALIBRATION_RTOL = 1e-3


def _adaptive_z_limit(clients_per_round: int) -> float:
  """TFF's `gaussian_adaptive` requires z < this (for z > 0).

  Its default `clipped_count_stddev` is 0.05 * clients_per_round and
  `adaptive_clip_noise_params` rejects noise_multiplier >= 2 * that; computed
  the same way, so that the float comparison agrees with TFF's.

  Args:
    clients_per_round: The expected cohort size.

  Returns:
    The exclusive upper bound on the noise multiplier.
  """
  return 2 * (0.05 * float(clients_per_round))

AggregationFactory = Union[tff.aggregators.UnweightedAggregationFactory,
                           tff.aggregators.WeightedAggregationFactory]


def default_target_delta(population: int) -> float:
  """Default delta: `min(1e-5, population ** -1.1)`.

  Strictly below 1 / population (a delta of about 1/n allows releasing one
  user's data outright), with the usual cap of 1e-5 for small populations.

  Args:
    population: Number of clients (users) the cohorts are drawn from.

  Returns:
    The default target delta.
  """
  return min(1e-5, float(population) ** -1.1)


def _is_int(value) -> bool:
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value) -> bool:
  return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class DPConfig:
  """Configuration of the user-level DP aggregation and of its accounting.

  Attributes:
    mechanism: One of `MECHANISMS`.
    noise_multiplier: Noise std / clip norm (add-or-remove-one sensitivity), as
      in TFF's `DifferentiallyPrivateFactory`. For 'gaussian_adaptive' it is
      the effective multiplier including the clip estimation; for
      the distributed mechanisms it is TFF's `DistributedDpSumFactory`'s: the
      total noise std over the clip, before rounding inflates the
      sensitivity, split among `clients_per_round` devices. None when
      `target_epsilon` is given (then `resolve` calibrates it). 0 is allowed
      (no noise, epsilon is infinite).
    clip_norm: L2 clip of a client's whole update; the initial clip for
      'gaussian_adaptive'.
    target_delta: Delta of the reported (epsilon, delta). None means
      `default_target_delta(population)`. Must be < 1 / population.
    target_epsilon: If set, `resolve` calibrates `noise_multiplier` so that
      `rounds` rounds cost at most this epsilon.
    clients_per_round: Cohort size (expected cohort size under Poisson
      sampling); also the denominator of the mean.
    population: Number of clients the cohorts are drawn from.
    rounds: Planned number of training rounds.
    sampling: One of `SAMPLING_SCHEMES`, how the training loop picks cohorts
      ('fixed_size' for the distributed mechanisms).
    target_unclipped_quantile: Quantile tracked by 'gaussian_adaptive'.
  """
  mechanism: str = 'none'
  noise_multiplier: Optional[float] = None
  clip_norm: float = 1.0
  target_delta: Optional[float] = None
  target_epsilon: Optional[float] = None
  clients_per_round: int = 10
  population: int = 100
  rounds: int = 1
  sampling: str = 'fixed_size'
  target_unclipped_quantile: float = 0.5

  @property
  def is_private(self) -> bool:
    """Whether the mechanism is a DP one."""
    return self.mechanism in _DP_MECHANISMS

  @property
  def is_distributed(self) -> bool:
    """Whether the noise is added on the devices (secure aggregation)."""
    return self.mechanism in DISTRIBUTED_MECHANISMS

  @property
  def sampling_probability(self) -> float:
    """clients_per_round / population."""
    return self.clients_per_round / self.population

  def validate(self) -> None:
    """Checks every field.

    Raises:
      ValueError: naming the offending field and its value.
    """
    if self.mechanism not in MECHANISMS:
      raise ValueError(
          f'mechanism must be one of {MECHANISMS}, got {self.mechanism!r}.')
    if self.sampling not in SAMPLING_SCHEMES:
      raise ValueError(
          f'sampling must be one of {SAMPLING_SCHEMES}, got {self.sampling!r}.')
    for name in ('clients_per_round', 'population', 'rounds'):
      value = getattr(self, name)
      if not _is_int(value) or value < 1:
        raise ValueError(f'{name} must be an integer >= 1, got {value!r}.')
    if self.clients_per_round > self.population:
      raise ValueError(
          f'clients_per_round ({self.clients_per_round}) must not exceed '
          f'population ({self.population}).')
    if (not _is_real(self.clip_norm) or not math.isfinite(self.clip_norm) or
        self.clip_norm <= 0):
      raise ValueError(
          f'clip_norm must be a finite number > 0, got {self.clip_norm!r}.')
    if self.noise_multiplier is not None and (
        not _is_real(self.noise_multiplier) or
        not math.isfinite(self.noise_multiplier) or self.noise_multiplier < 0):
      raise ValueError('noise_multiplier must be a finite number >= 0 or None, '
                       f'got {self.noise_multiplier!r}.')
    if self.target_epsilon is not None and (
        not _is_real(self.target_epsilon) or
        not math.isfinite(self.target_epsilon) or self.target_epsilon <= 0):
      raise ValueError('target_epsilon must be a finite number > 0 or None, '
                       f'got {self.target_epsilon!r}.')
    if self.target_delta is not None:
      if (not _is_real(self.target_delta) or
          not 0 < self.target_delta < 1):
        raise ValueError('target_delta must be a number in (0, 1) or None, '
                         f'got {self.target_delta!r}.')
      if self.target_delta >= 1 / self.population:
        raise ValueError(
            f'target_delta ({self.target_delta!r}) must be < 1 / population '
            f'(= {1 / self.population:.3g}).')
    if (not _is_real(self.target_unclipped_quantile) or
        not 0 <= self.target_unclipped_quantile <= 1):
      raise ValueError('target_unclipped_quantile must be in [0, 1], got '
                       f'{self.target_unclipped_quantile!r}.')
    if not self.is_private:
      for name in ('noise_multiplier', 'target_epsilon'):
        if getattr(self, name) is not None:
          raise ValueError(
              f'{name} must be None when mechanism is {self.mechanism!r} '
              f'(got {getattr(self, name)!r}); choose a DP mechanism.')
      return
    if self.noise_multiplier is not None and self.target_epsilon is not None:
      raise ValueError(
          f'noise_multiplier ({self.noise_multiplier!r}) and target_epsilon '
          f'({self.target_epsilon!r}) are mutually exclusive: give one.')
    if self.noise_multiplier is None and self.target_epsilon is None:
      raise ValueError(
          f'mechanism {self.mechanism!r} needs noise_multiplier or '
          'target_epsilon; both are None.')
    if self.is_distributed and self.sampling != 'fixed_size':
      raise ValueError(
          f'mechanism {self.mechanism!r} needs sampling=\'fixed_size\', got '
          f'{self.sampling!r}: its noise is split among exactly '
          'clients_per_round devices, and a smaller Poisson cohort would add '
          'less noise than accounted.')
    if self.mechanism == 'gaussian_adaptive' and (
        self.noise_multiplier is not None and
        self.noise_multiplier > 0 and
        self.noise_multiplier >= _adaptive_z_limit(self.clients_per_round)):
      raise ValueError(
          f'noise_multiplier ({self.noise_multiplier!r}) must be < 0.1 * '
          'clients_per_round (= '
          f'{_adaptive_z_limit(self.clients_per_round):.3g}) for '
          "'gaussian_adaptive': TFF's clip estimation uses count noise "
          'std 0.05 * clients_per_round; use more clients per round.')


def resolve(config: DPConfig) -> DPConfig:
  """Returns a validated, fully explicit copy of `config`.

  Fills `target_delta` with `default_target_delta(population)` if it is None
  and, if `target_epsilon` is set, replaces it by the calibrated
  `noise_multiplier` (`calibrate_noise_multiplier`): the result has
  `target_epsilon=None`, since the two fields are mutually exclusive. A
  resolved config resolves to itself.

  Args:
    config: The configuration.

  Returns:
    The resolved configuration.

  Raises:
    ValueError: if the configuration is invalid.
  """
  config.validate()
  # Memoized: calibration takes seconds and reports call this every round.
  return _resolve_cached(config)


@functools.lru_cache(maxsize=64)
def _resolve_cached(config: DPConfig) -> DPConfig:
  """`resolve` after validation."""
  if config.target_delta is None:
    config = dataclasses.replace(
        config, target_delta=default_target_delta(config.population))
  if config.is_private and config.noise_multiplier is None:
    z = calibrate_noise_multiplier(config)
    config = dataclasses.replace(config, noise_multiplier=z,
                                 target_epsilon=None)
  config.validate()
  return config


def check_accountable(config: DPConfig) -> None:
  """Refuses a configuration whose epsilon the accountant cannot give.

  `compute_epsilon` of the planned `config.rounds` is computed once per
  configuration (memoized), before any round runs: a noise multiplier so
  large or so small that dp_accounting's arithmetic overflows, or a round
  count whose composition it cannot hold, would otherwise fail only when
  the run reports its epsilon.

  Raises:
    ValueError: naming the noise multiplier, the rounds and what failed.
  """
  config = resolve(config)
  if not config.is_private:
    return
  failure = _accounting_failure(config)
  if failure:
    raise ValueError(
        f'noise_multiplier={config.noise_multiplier!r} over rounds='
        f'{config.rounds} cannot be accounted ({failure}): dp_accounting '
        'gives no epsilon for it; choose another noise multiplier or fewer '
        'rounds')


@functools.lru_cache(maxsize=64)
def _accounting_failure(config: DPConfig) -> Optional[str]:
  """What `compute_epsilon(config, config.rounds)` raises, as a line (None
  when it gives an epsilon)."""
  try:
    with warnings.catch_warnings():  # Overflowing logs warn, then raise.
      warnings.simplefilter('ignore', RuntimeWarning)
      compute_epsilon(config, config.rounds)
  except (ArithmeticError, ValueError, MemoryError) as e:
    return f'{type(e).__name__}: {" ".join(str(e).split())[:200]}'
  return None


def build_aggregator(config: DPConfig) -> AggregationFactory:
  """Builds the TFF aggregation factory for the client model updates.

  Args:
    config: The configuration (resolved here if it is not already).

  Returns:
    'none': `tff.aggregators.MeanFactory()` (weighted by the client weight).
    'gaussian_fixed': `DifferentiallyPrivateFactory.gaussian_fixed(
      noise_multiplier, clients_per_round, clip_norm)` (unweighted: mean over
      the expected cohort of updates clipped by their global L2 norm).
    'gaussian_adaptive': `DifferentiallyPrivateFactory.gaussian_adaptive(
      noise_multiplier, clients_per_round, initial_l2_norm_clip=clip_norm,
      target_unclipped_quantile=target_unclipped_quantile)`.
    'distributed_dgauss', 'distributed_skellam': `UnweightedMeanFactory`
      over TFF's `DistributedDpSumFactory(noise_multiplier,
      clients_per_round, bits=DDP_BITS, l2_clip=clip_norm,
      mechanism=mechanism, rotation_type='dft')`, whose count is a secure sum too; creating its
      process refuses an update of more than `DDP_MAX_DIMENSION`
      coordinates (padded), the dimension the accounting covers.
    Use `is_weighted` to know whether to pass client weights.

  Raises:
    ValueError: if the configuration is invalid.
  """
  config = resolve(config)
  if config.mechanism == 'none':
    return tff.aggregators.MeanFactory()
  dp_factory = tff.aggregators.DifferentiallyPrivateFactory
  if config.mechanism == 'gaussian_fixed':
    factory = dp_factory.gaussian_fixed(
        noise_multiplier=float(config.noise_multiplier),
        clients_per_round=float(config.clients_per_round),
        clip=float(config.clip_norm))
  elif config.is_distributed:
    factory = tff.aggregators.UnweightedMeanFactory(
        value_sum_factory=_BoundedDistributedDpSumFactory(
            noise_multiplier=float(config.noise_multiplier),
            expected_clients_per_round=int(config.clients_per_round),
            bits=DDP_BITS, l2_clip=float(config.clip_norm),
            mechanism=config.mechanism, rotation_type='dft'),
        count_sum_factory=tff.aggregators.SecureSumFactory(
            upper_bound_threshold=1, lower_bound_threshold=0))
  else:
    factory = dp_factory.gaussian_adaptive(
        noise_multiplier=float(config.noise_multiplier),
        clients_per_round=float(config.clients_per_round),
        initial_l2_norm_clip=float(config.clip_norm),
        target_unclipped_quantile=float(config.target_unclipped_quantile))
  _BUILT_FROM[factory] = config
  return factory


# The resolved config each DP factory of `build_aggregator` was built from.
_BUILT_FROM = weakref.WeakKeyDictionary()


def ddp_padded_dimension(dimension: int) -> int:
  """The padded dimension TFF's 'dft' rotation gives `dimension`
  coordinates (an even number; at least 2)."""
  return math.ceil(max(1, dimension) / 2) * 2


def _call_dominant(comp):
  """`comp` in TFF's call-dominant form (`to_call_dominant`, what TFF's
  MapReduce compiler does first), with its own type signature.

  TFF's `DistributedDpSumFactory` nests eight aggregators, so its `next`
  is a computation about 93 protocol-buffer levels deep; inside an
  algorithm's round it passes protobuf's nesting limit of 100 ("Error
  parsing message" when TFF builds the round). The call-dominant form is
  the same computation about 38 levels deep (as deep as the Gaussian
  aggregator's). Written by hand: TFF applies the transformation only
  when it compiles.
  """
  flat = _tff_transformations.to_call_dominant(comp.to_building_block())
  return _tff_computation.ConcreteComputation(
      computation_proto=flat.proto,
      context_stack=_tff_context_stack.context_stack,
      annotated_type=comp.type_signature)


class _BoundedDistributedDpSumFactory(_tff_ddp.DistributedDpSumFactory):
  """TFF's `DistributedDpSumFactory` that refuses an update larger than
  the accounting covers (`DDP_MAX_DIMENSION`) and whose process is in
  call-dominant form (`_call_dominant`). Written by hand: TFF's factory
  takes any dimension, and its scale factor (hence the rounding's
  sensitivity inflation) depends on it."""

  def create(self, value_type):
    # Counted as TFF's `create` counts them.
    sizes = tf.nest.flatten(_tff_types.structure_from_tensor_type_tree(
        lambda t: _tff_shape.num_elements_in_shape(t.shape), value_type))
    padded = ddp_padded_dimension(sum(sizes))
    if padded > DDP_MAX_DIMENSION:
      raise ValueError(
          f'the update has {sum(sizes)} coordinates (padded {padded}), more '
          f'than the {DDP_MAX_DIMENSION} distributed DP is accounted for '
          '(privacy.DDP_MAX_DIMENSION); aggregate a smaller update')
    process = super().create(value_type)
    return tff.templates.AggregationProcess(
        _call_dominant(process.initialize), _call_dominant(process.next))


def config_of(factory: AggregationFactory) -> Optional[DPConfig]:
  """The resolved `DPConfig` a DP factory of `build_aggregator` was built
  from; None for a factory without DP (a weighted one).

  DP is decided once, into the aggregator: what runs the aggregator's work
  in another form (the sharded simulation clips each user before summing a
  shard) reads the mechanism from the factory it is given, not from a
  config passed beside it.

  Raises:
    ValueError: for an unweighted factory not made by `build_aggregator`
      (its clip and noise are unknown here).

  Example:
    factory = build_aggregator(DPConfig(mechanism='gaussian_fixed', ...))
    assert config_of(factory).clip_norm == 1.0
  """
  if is_weighted(factory):
    return None
  try:
    return _BUILT_FROM[factory]
  except (KeyError, TypeError):
    raise ValueError(
        f'the aggregator {type(factory).__name__} is unweighted (DP) but was '
        'not made by privacy.build_aggregator, so its clip norm and noise '
        'are unknown; build it with privacy.build_aggregator(DPConfig(...))'
    ) from None


def is_weighted(factory: AggregationFactory) -> bool:
  """Whether `factory` is a weighted one (its process takes client weights)."""
  return isinstance(factory, tff.aggregators.WeightedAggregationFactory)


def effective_noise_multiplier(config: DPConfig,
                               noise_multiplier: Optional[float] = None
                              ) -> float:
  """Effective add-or-remove-one noise multiplier of one round's release.

  For 'gaussian_fixed' this is z itself. For 'gaussian_adaptive' it is
  recomputed from TFF's split of z into the value noise multiplier and the
  clipped-count stddev (sensitivity 0.5):
  `(z_value**-2 + (2 * count_stddev)**-2) ** -0.5`, which is z up to rounding.

  Args:
    config: The configuration.
    noise_multiplier: Overrides `config.noise_multiplier` (for calibration).

  Returns:
    The effective noise multiplier (0 means no noise).
  """
  z = config.noise_multiplier if noise_multiplier is None else noise_multiplier
  z = float(z)
  if config.mechanism != 'gaussian_adaptive' or z == 0:
    return z
  with warnings.catch_warnings():
    # TFF warns when the value noise is much larger than z; irrelevant here.
    warnings.simplefilter('ignore', UserWarning)
    value_z, count_stddev = _tff_dp.adaptive_clip_noise_params(
        z, float(config.clients_per_round))
  return (value_z**-2 + (2 * count_stddev)**-2)**-0.5


def _round_event(config: DPConfig, z_eff: float) -> dp_accounting.DpEvent:
  """The `DpEvent` of one round, in the units of the accountant used."""
  if config.sampling == 'poisson':
    return dp_accounting.PoissonSampledDpEvent(
        config.sampling_probability, dp_accounting.GaussianDpEvent(z_eff))
  # Replace-one: the L2 sensitivity of the clipped sum is 2 * clip_norm.
  gaussian = dp_accounting.GaussianDpEvent(z_eff / 2)
  if config.clients_per_round == config.population:
    return gaussian
  return dp_accounting.SampledWithoutReplacementDpEvent(
      config.population, config.clients_per_round, gaussian)


def _neighboring_relation(
    config: DPConfig) -> dp_accounting.NeighboringRelation:
  if config.sampling == 'poisson':
    return dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
  return dp_accounting.NeighboringRelation.REPLACE_ONE


def _pld_supported(config: DPConfig) -> bool:
  if config.is_distributed:  # A bound on its RDP, not its loss distribution.
    return False
  return (config.sampling == 'poisson' or
          config.clients_per_round == config.population)


# PLD's default discretisation interval, and the noise multiplier below
# which it is widened: the privacy-loss grid grows as 1 / z^2.
_PLD_INTERVAL = 1e-4
_PLD_FINE_Z = 0.3


def pld_discretization(z_eff: float) -> float:
  """The PLD accountant's value discretisation interval for multiplier
  `z_eff`: dp_accounting's 1e-4, widened by (0.3 / z)^2 below z = 0.3 so
  that the grid (hence memory: about 0.6 GiB at z = 0.3) stays bounded for
  small multipliers. A wider interval gives a larger epsilon, still an
  upper bound (dp_accounting's discretisation is pessimistic)."""
  return _PLD_INTERVAL * max(1.0, (_PLD_FINE_Z / z_eff) ** 2)


def _make_accountant(config: DPConfig, kind: str, z_eff: float = 1.0
                    ) -> dp_accounting.PrivacyAccountant:
  relation = _neighboring_relation(config)
  if kind == 'pld':
    return dp_pld.PLDAccountant(
        neighboring_relation=relation,
        value_discretization_interval=pld_discretization(z_eff))
  return dp_rdp.RdpAccountant(neighboring_relation=relation)


@dataclasses.dataclass(frozen=True)
class DdpBound:
  """One round of a distributed mechanism, as accounted (module docstring,
  "Distributed DP"): TFF's scaled integer domain at the padded dimension
  bound.

  Attributes:
    mechanism: one of `DISTRIBUTED_MECHANISMS`.
    dimension: the padded dimension accounted (`DDP_MAX_DIMENSION`).
    bits: the secure aggregation's bit width.
    scale: TFF's scale factor s at that dimension.
    l2_sensitivity: replace-one L2 sensitivity of the scaled, rounded sum
      (2 (c + sqrt(d)/s + 1e-5) s).
    l1_sensitivity: replace-one L1 sensitivity (2 ceil(L2 min(sqrt(d), L2))).
    local_sigma: each device's noise parameter (z c s / sqrt(n) (1 -
      2^-23), a lower bound on the sampler's).
    shares: n, the devices adding noise.
    tau: Kairouz et al.'s deviation term (discrete Gaussian; 0 for
      Skellam, whose shares sum to a Skellam variable).
    inflation: (c + sqrt(d)/s + 1e-5) / c, the rounding's sensitivity
      inflation.
  """
  mechanism: str
  dimension: int
  bits: int
  scale: float
  l2_sensitivity: float
  l1_sensitivity: float
  local_sigma: float
  shares: int
  tau: float
  inflation: float

  def rdp(self, orders: Sequence[int]) -> np.ndarray:
    """One round's RDP at integer `orders` > 1: Kairouz et al. 2021, Prop.
    14 for 'distributed_dgauss' (inf where sigma < 1/2, which the bound
    does not cover), Agarwal et al. 2021, Thm. 3.5 for
    'distributed_skellam'."""
    orders = np.asarray(orders, dtype=float)
    if self.mechanism == 'distributed_skellam':
      mu = self.shares * self.local_sigma**2
      l2, l1 = self.l2_sensitivity, self.l1_sensitivity
      return orders * l2**2 / (2 * mu) + np.minimum(
          ((2 * orders - 1) * l2**2 + 6 * l1) / (4 * mu**2),
          3 * l1 / (2 * mu))
    if self.local_sigma < 0.5:
      return np.full(orders.shape, math.inf)
    central = math.sqrt(self.shares) * self.local_sigma
    l2, l1 = self.l2_sensitivity / central, self.l1_sensitivity / central
    tau, d = self.tau, float(self.dimension)
    return np.minimum.reduce([
        orders / 2 * l2**2 + tau * d,
        orders / 2 * (l2**2 + 2 * l1 * tau + tau**2 * d),
        orders / 2 * (l2 + tau * math.sqrt(d))**2])


def ddp_bound(config: DPConfig, noise_multiplier: Optional[float] = None,
              dimension: int = DDP_MAX_DIMENSION) -> DdpBound:
  """The accounted round of `config`'s distributed mechanism (module
  docstring); `noise_multiplier` overrides the config's (calibration);
  `dimension`: the padded dimension (the accounting uses the bound
  `DDP_MAX_DIMENSION`; an aggregator created for d coordinates runs with
  `ddp_bound(config, dimension=ddp_padded_dimension(d))`'s scale and
  half its sensitivities as its norm bound)."""
  z = float(config.noise_multiplier if noise_multiplier is None
            else noise_multiplier)
  c, n, d = float(config.clip_norm), config.clients_per_round, int(dimension)
  k = math.sqrt(2) * special.erfcinv(_DDP_MODCLIP_PROB)
  scale = math.sqrt(2.0**(2 * DDP_BITS) - n * k**2) / (
      2 * k * math.sqrt(c**2 * n**2 / d + z**2 * c**2))
  scale = min(scale, _DDP_MAX_SCALE)
  l2 = (c + math.sqrt(d) / scale + 1e-5) * scale
  l1 = math.ceil(l2 * min(math.sqrt(d), l2))
  sigma = z * c * scale / math.sqrt(n) * (1 - 2.0**-23)
  tau = 0.0 if config.mechanism == 'distributed_skellam' else 10 * sum(
      math.exp(-2 * math.pi**2 * sigma**2 * j / (j + 1)) for j in range(1, n))
  return DdpBound(mechanism=config.mechanism, dimension=d, bits=DDP_BITS,
                  scale=scale,
                  l2_sensitivity=2 * l2, l1_sensitivity=2 * l1,
                  local_sigma=sigma, shares=n, tau=tau,
                  inflation=l2 / (c * scale))


def _subsampled_rdp(rdp: np.ndarray, orders: Sequence[int], q: float
                    ) -> np.ndarray:
  """Wang, Balle, Kasiviswanathan 2019, Thm. 9: RDP at integer `orders`
  of a mechanism with RDP `rdp` (at orders 2, 3, ..., max(orders), and
  eps(inf) = inf) run on a sample without replacement of a fraction `q`;
  at most `rdp` itself."""
  if q >= 1:
    return np.array([rdp[a - 2] for a in orders])
  out = []
  for a in orders:
    j = np.arange(2, a + 1)
    log_comb = (special.gammaln(a + 1) - special.gammaln(j + 1) -
                special.gammaln(a - j + 1))
    eps_j = rdp[j - 2]
    terms = np.log(2) + j * math.log(q) + log_comb + (j - 1) * eps_j
    eps2 = rdp[0]
    # j = 2: min(4 (e^eps(2) - 1), 2 e^eps(2)).
    terms[0] = (2 * math.log(q) + log_comb[0] +
                min(math.log(4) + eps2 + math.log(-math.expm1(-eps2))
                    if eps2 > 0 else -math.inf, math.log(2) + eps2))
    total = special.logsumexp(np.concatenate([[0.0], terms]))
    out.append(min(total / (a - 1), rdp[a - 2]))
  return np.array(out)


def ddp_rdp(config: DPConfig, rounds: int,
            noise_multiplier: Optional[float] = None) -> np.ndarray:
  """RDP at `_DDP_ORDERS` of `rounds` rounds of `config`'s distributed
  mechanism with its sampling (module docstring)."""
  all_orders = np.arange(2, max(_DDP_ORDERS) + 1)
  with np.errstate(over='ignore'):
    rdp = ddp_bound(config, noise_multiplier).rdp(all_orders)
    if not np.all(np.isfinite(rdp)):
      return np.full(len(_DDP_ORDERS), math.inf)
    per_round = _subsampled_rdp(rdp, _DDP_ORDERS,
                                config.clients_per_round / config.population)
  return rounds * per_round


def _ddp_epsilon(rdp: np.ndarray, delta: float) -> float:
  if not np.all(np.isfinite(rdp)):
    return math.inf
  if not np.any(rdp):
    return 0.0
  return float(dp_rdp.compute_epsilon(_DDP_ORDERS, rdp, delta)[0])


def _epsilon(config: DPConfig, z_eff: float, rounds: int, delta: float,
             kind: str) -> float:
  if rounds == 0:
    return 0.0
  if z_eff == 0:
    return math.inf
  if config.is_distributed:
    return _ddp_epsilon(ddp_rdp(config, rounds, z_eff), delta)
  event = dp_accounting.SelfComposedDpEvent(_round_event(config, z_eff),
                                            rounds)
  return float(_make_accountant(config, kind, z_eff).compose(
      event).get_epsilon(delta))


def compute_epsilon(config: DPConfig, rounds: int) -> dict:
  """(epsilon, delta) of `rounds` rounds, at `target_delta`.

  See the module docstring for the events and neighbouring relations.

  Args:
    config: The configuration (resolved here if it is not already).
    rounds: Number of rounds run (>= 0).

  Returns:
    A dict with 'epsilon' (PLD where available, else RDP), 'delta',
    'epsilon_rdp', 'epsilon_pld' (None if PLD does not apply), 'accountant'
    ('pld' or 'rdp'), 'neighboring_relation' ('add_or_remove_one' or
    'replace_one'), 'mechanism', 'noise_multiplier', 'clip_norm',
    'clients_per_round', 'population', 'rounds', 'sampling',
    'sampling_probability', 'notes', and for a distributed mechanism
    'distributed' (`DdpBound`'s fields, the bound and the subsampling
    theorem). For mechanism 'none' epsilon is inf.

  Raises:
    ValueError: if the configuration or `rounds` is invalid.
  """
  if not _is_int(rounds) or rounds < 0:
    raise ValueError(f'rounds must be an integer >= 0, got {rounds!r}.')
  config = resolve(config)
  delta = config.target_delta
  notes = []
  relation = ('add_or_remove_one' if config.sampling == 'poisson'
              else 'replace_one')
  if not config.is_private:
    eps_rdp, eps_pld, accountant = math.inf, None, 'rdp'
    notes.append("mechanism 'none': no differential privacy.")
  else:
    z_eff = effective_noise_multiplier(config)
    if config.is_distributed:
      bound = ddp_bound(config)
      notes.append(
          f'{config.mechanism}: distributed DP (noise added on the devices, '
          'sums by secure aggregation), accounted with '
          f'{DDP_BOUNDS[config.mechanism]}, at padded dimension '
          f'{bound.dimension}, bits {bound.bits}, scale {bound.scale:.6g}: '
          'replace-one sensitivities L2 '
          f'{bound.l2_sensitivity:.6g}, L1 {bound.l1_sensitivity:.6g} '
          f'(rounding inflates the clip by {bound.inflation:.6g}x; '
          f'rotation by none), {bound.shares} noise shares of sigma '
          f'{bound.local_sigma:.6g}, tau {bound.tau:.3g}; fixed-size '
          f'sampling {config.clients_per_round} of {config.population} by '
          'Wang, Balle, Kasiviswanathan 2019, Thm. 9; RDP composed over '
          'rounds, converted by dp_accounting.')
    elif config.sampling == 'poisson':
      notes.append(
          f'Poisson sampling q={config.sampling_probability:.6g}: '
          'PoissonSampledDpEvent(q, GaussianDpEvent(z)), add-or-remove-one.')
    else:
      notes.append(
          f'Fixed-size sampling {config.clients_per_round} of '
          f'{config.population} without replacement, replace-one: '
          'sensitivity 2*clip, so GaussianDpEvent(z/2) '
          f'(= {z_eff / 2:.6g}).')
    if config.mechanism == 'gaussian_adaptive':
      notes.append(
          'gaussian_adaptive: update noise and clipped-count noise combined '
          f'into effective z={z_eff:.6g} (TFF split).')
    if z_eff == 0:
      notes.append('noise_multiplier 0: epsilon is infinite.')
    eps_rdp = _epsilon(config, z_eff, rounds, delta, 'rdp')
    if _pld_supported(config):
      eps_pld = _epsilon(config, z_eff, rounds, delta, 'pld')
      accountant = 'pld'
      if config.sampling == 'fixed_size':
        notes.append('clients_per_round == population: no sampling, plain '
                     'Gaussian, PLD applies.')
    elif config.is_distributed:
      eps_pld, accountant = None, 'rdp'
    else:
      eps_pld, accountant = None, 'rdp'
      notes.append('PLD: None, dp_accounting PLD does not support sampling '
                   'without replacement (SampledWithoutReplacementDpEvent).')
  report = {
      'epsilon': eps_pld if eps_pld is not None else eps_rdp,
      'delta': delta,
      'epsilon_rdp': eps_rdp,
      'epsilon_pld': eps_pld,
      'accountant': accountant,
      'neighboring_relation': relation,
      'mechanism': config.mechanism,
      'noise_multiplier': config.noise_multiplier,
      'clip_norm': config.clip_norm,
      'clients_per_round': config.clients_per_round,
      'population': config.population,
      'rounds': rounds,
      'sampling': config.sampling,
      'sampling_probability': config.sampling_probability,
      'notes': ' '.join(notes),
  }
  if config.is_distributed:
    report['distributed'] = dict(
        dataclasses.asdict(ddp_bound(config)),
        bound=DDP_BOUNDS[config.mechanism],
        subsampling='Wang, Balle, Kasiviswanathan 2019, Thm. 9')
  return report


def _find_bracket(eps: Callable[[float], float], target: float, start: float,
                  factor: float, z_max: float) -> Optional[tuple[float, float]]:
  """Geometric search for lo < hi with eps(lo) > target >= eps(hi).

  Args:
    eps: Epsilon as a function of the noise multiplier (decreasing).
    target: Target epsilon.
    start: First point tried.
    factor: Ratio between successive points.
    z_max: Largest noise multiplier allowed.

  Returns:
    The bracket, with eps(lo) finite; None if eps(z) <= target already for
    z < 1e-6.

  Raises:
    ValueError: if eps(z_max) > target.
  """
  hi = min(start, z_max)
  if eps(hi) > target:
    lo = hi
    while eps(hi) > target:
      if hi >= z_max:
        raise ValueError(
            f'target_epsilon {target!r} is not reachable with '
            f'noise_multiplier <= {z_max:.4g}.')
      lo, hi = hi, min(hi * factor, z_max)
  else:
    lo = hi / factor
    while eps(lo) <= target:
      if lo < 1e-6:
        return None
      lo, hi = lo / factor, lo
  while not math.isfinite(eps(lo)):
    mid = math.sqrt(lo * hi)
    if eps(mid) <= target:
      hi = mid
    else:
      lo = mid
  return lo, hi


def _solve(eps: Callable[[float], float], target: float,
           bracket: tuple[float, float]) -> float:
  """Brent's method on eps(z) = target, then the nearest z meeting it."""
  lo, hi = bracket
  xtol = 0.5 * _CALIBRATION_RTOL * lo
  z = optimize.brentq(lambda x: eps(x) - target, lo, hi, xtol=xtol)
  step = xtol
  while eps(z) > target:  # Terminates: eps(hi) <= target.
    z = min(z + step, hi)
    step *= 2
  return z


def calibrate_noise_multiplier(config: DPConfig) -> float:
  """Smallest z with epsilon <= target_epsilon after `config.rounds` rounds.

  Uses the same events and accountant as `compute_epsilon` (PLD where it
  applies, else RDP). Root finding is Brent's method (`scipy.optimize.brentq`,
  the algorithm of `dp_accounting.calibrate_dp_mechanism`, here on a memoized
  epsilon function, since one PLD evaluation takes about a second) inside a
  bracket from a geometric search, to an absolute tolerance of 5e-4 times the
  bracket's lower end (better than 1e-3 relative), followed by a step up to
  the nearest z that meets the target. For PLD, the RDP solution (cheap, and
  an upper bound in practice) seeds a narrow bracket.

  Args:
    config: A configuration with a DP mechanism and `target_epsilon` set;
      `noise_multiplier` is ignored.

  Returns:
    The noise multiplier.

  Raises:
    ValueError: if the configuration is invalid, has no target epsilon, or the
      target needs a noise multiplier larger than 'gaussian_adaptive' allows
      (< 0.1 * clients_per_round).
  """
  if config.target_epsilon is None:
    raise ValueError('target_epsilon must be set to calibrate the noise '
                     'multiplier, got None.')
  if not config.is_private:
    raise ValueError(f'mechanism {config.mechanism!r} has no noise to '
                     'calibrate.')
  dataclasses.replace(config, noise_multiplier=None).validate()
  if config.target_delta is None:
    config = dataclasses.replace(
        config, target_delta=default_target_delta(config.population))
  target = float(config.target_epsilon)
  delta = float(config.target_delta)
  if config.mechanism == 'gaussian_adaptive':
    z_max = _adaptive_z_limit(config.clients_per_round) * (1 - 1e-9)
  else:
    z_max = 1e6

  def make_eps(kind: str) -> Callable[[float], float]:
    @functools.lru_cache(maxsize=None)
    def eps(z: float) -> float:
      return _epsilon(config, effective_noise_multiplier(config, z),
                      config.rounds, delta, kind)
    return eps

  try:
    eps_rdp = make_eps('rdp')
    bracket = _find_bracket(eps_rdp, target, 1.0, 2.0, z_max)
    if bracket is None:
      return 1e-6
    z = _solve(eps_rdp, target, bracket)
    if _pld_supported(config):
      eps_pld = make_eps('pld')
      bracket = _find_bracket(eps_pld, target, z, 1.1, z_max)
      if bracket is None:
        return 1e-6
      z = _solve(eps_pld, target, bracket)
  except ValueError as e:
    raise ValueError(f'{e} (mechanism {config.mechanism!r}, '
                     f'clients_per_round {config.clients_per_round}, '
                     f'rounds {config.rounds}); for gaussian_adaptive use '
                     'more clients per round, else more epsilon.') from e
  return float(z)


def compute_epsilon_phases(phases: Sequence[tuple[DPConfig, int]]) -> dict:
  """(epsilon, delta) of one user over phases run one after another.

  Each phase is `(config, rounds)`: `rounds` rounds of the Gaussian
  mechanism with that configuration's sampling (its `clients_per_round` of
  its `population`). The phases are composed in one accountant (RDP, and PLD
  where every phase supports it), the same events as `compute_epsilon`
  (which is the one-phase case). E.g. a per-group stage
  (`core/stages.py`): a user of group g took part in the first stage's
  rounds sampled from everyone, then in its group's runs sampled from the
  group's clients only.

  Args:
    phases: at least one `(config, rounds)`; the configurations must share
      `mechanism`, `sampling` and `target_delta` (the first one's is
      reported).

  Returns:
    A dict with 'epsilon' (PLD where available, else RDP), 'epsilon_rdp',
    'epsilon_pld' (None where PLD does not apply), 'accountant' and 'delta'.
  """
  if not phases:
    raise ValueError('compute_epsilon_phases needs at least one phase')
  configs = [resolve(c) for c, _ in phases]
  first = configs[0]
  for c in configs[1:]:
    for field in ('mechanism', 'sampling', 'target_delta'):
      if getattr(c, field) != getattr(first, field):
        raise ValueError(f'phases differ in {field}: '
                         f'{getattr(first, field)!r} and {getattr(c, field)!r}')
  for _, rounds in phases:
    if not _is_int(rounds) or rounds < 0:
      raise ValueError(f'rounds must be an integer >= 0, got {rounds!r}.')
  delta = first.target_delta
  if not first.is_private:
    return dict(epsilon=math.inf, epsilon_rdp=math.inf, epsilon_pld=None,
                accountant='rdp', delta=delta)
  zs = [effective_noise_multiplier(c) for c in configs]

  def epsilon(kind):
    if not any(r for _, r in phases):
      return 0.0
    if any(z == 0 and r for z, (_, r) in zip(zs, phases)):
      return math.inf
    if first.is_distributed:  # The phases' RDP curves add up.
      return _ddp_epsilon(sum(ddp_rdp(config, rounds) for config, (_, rounds)
                              in zip(configs, phases)), delta)
    accountant = _make_accountant(first, kind, min(zs))
    for config, z, (_, rounds) in zip(configs, zs, phases):
      if rounds:
        accountant.compose(dp_accounting.SelfComposedDpEvent(
            _round_event(config, z), rounds))
    return float(accountant.get_epsilon(delta))

  eps_rdp = epsilon('rdp')
  eps_pld = (epsilon('pld') if all(_pld_supported(c) for c in configs)
             else None)
  return dict(epsilon=eps_pld if eps_pld is not None else eps_rdp,
              epsilon_rdp=eps_rdp, epsilon_pld=eps_pld,
              accountant='pld' if eps_pld is not None else 'rdp', delta=delta)


def privacy_report(config: DPConfig, rounds_completed: int) -> Optional[dict]:
  """Privacy spent after `rounds_completed` rounds, for logs and summaries.

  Args:
    config: The configuration (resolved here if it is not already).
    rounds_completed: Rounds run so far.

  Returns:
    None for mechanism 'none'; otherwise `compute_epsilon(config,
    rounds_completed)` plus 'rounds_planned' (`config.rounds`).
  """
  config.validate()
  if config.mechanism == 'none':
    return None
  report = compute_epsilon(config, rounds_completed)
  report['rounds_planned'] = config.rounds
  return report


# Names that moved away raise an error naming their new place.
__getattr__ = moved.module_getattr(__name__)
