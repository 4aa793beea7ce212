"""How a user who never trained starts: the DP average of trained users' states.

A new user (one withheld from training, or never sampled) has no private
state of its own. `new_user_evaluation.evaluate_new_users` starts it from
either the process's initial private state or, as FedPerC's section 3.2
does, "the noisy-average of all known user embeddings": `build_dp_mean` is
that average as a TFF computation over the known users' private states at
CLIENTS,
through `tff.aggregators.DifferentiallyPrivateFactory` (each user's whole
state clipped to `clip_norm` in L2, Gaussian noise of std
`noise_multiplier * clip_norm` on the sum, divided by the number of users),
released once: `dp_mean_epsilon` is its (epsilon, delta) guarantee, and
`dp_clip_report` what the clip does to the known states. The noise is drawn
from a seed (`SeededGaussianSumQuery`), so that evaluating the same run
again gives the same average.

Example:

  dp_mean = build_dp_mean(private_type, noise_multiplier=1.0, clip_norm=1.0,
                          num_clients=len(states), seed=run_seed)
  average = dp_mean(states)  # In a TFF execution context.
"""

from __future__ import annotations

import math
from typing import Optional

import dp_accounting
import numpy as np
import tensorflow as tf
import tensorflow_federated as tff
import tensorflow_privacy as tfp


class SeededGaussianSumQuery(tfp.GaussianSumQuery):
  """tensorflow-privacy's `GaussianSumQuery`, its noise drawn from a seed.

  Clipping, the noise's scale and the DP event are the parent's; only the
  draw differs: `tf.random.stateless_normal` with seed `(seed, leaf index)`
  instead of an unseeded initializer, so that a one-off release (the
  new-user average of a finished run) is the same in every evaluation of
  the same run. tensorflow-privacy offers no seed, hence this subclass.
  Every call draws the same noise: use it for a value released once, never
  for a value released every round.
  """

  def __init__(self, l2_norm_clip: float, stddev: float, seed: int):
    super().__init__(l2_norm_clip, stddev)
    self._seed = int(seed)

  def get_noised_result(self, sample_state, global_state):
    leaves = tf.nest.flatten(sample_state)
    noised = [v + tf.cast(tf.random.stateless_normal(
        tf.shape(v), seed=tf.constant([self._seed, i], tf.int64),
        stddev=global_state.stddev), v.dtype) for i, v in enumerate(leaves)]
    event = dp_accounting.GaussianDpEvent(
        global_state.stddev / global_state.l2_norm_clip)
    return (tf.nest.pack_sequence_as(sample_state, noised), global_state,
            event)


def build_dp_mean(private_type: tff.Type, *, noise_multiplier: float,
                  clip_norm: float, num_clients: int,
                  seed: Optional[int] = None) -> tff.Computation:
  """`{private}@CLIENTS -> noisy mean@SERVER` through TFF's DP factory.

  Args:
    private_type: the type of one client's value.
    noise_multiplier: the Gaussian noise's stddev over `clip_norm`.
    clip_norm: each client's value is clipped to this L2 norm.
    num_clients: the mean's denominator (the number of clients).
    seed: draw the noise from this seed (`SeededGaussianSumQuery`: every
      call gives the same noise); None: TFF's `gaussian_fixed`, unseeded.

  Returns:
    A federated computation.
  """
  if noise_multiplier < 0 or clip_norm <= 0 or num_clients < 1:
    raise ValueError(
        f'DP mean needs noise_multiplier >= 0 (got {noise_multiplier}), '
        f'clip_norm > 0 (got {clip_norm}), num_clients >= 1 '
        f'(got {num_clients})')
  if seed is None:
    factory = tff.aggregators.DifferentiallyPrivateFactory.gaussian_fixed(
        noise_multiplier=noise_multiplier, clients_per_round=num_clients,
        clip=clip_norm)
  else:  # As gaussian_fixed builds it, with the seeded sum query.
    factory = tff.aggregators.DifferentiallyPrivateFactory(
        tfp.NormalizedQuery(
            SeededGaussianSumQuery(clip_norm, clip_norm * noise_multiplier,
                                   seed), denominator=num_clients))
  aggregation = factory.create(private_type)

  @tff.federated_computation(tff.FederatedType(private_type, tff.CLIENTS))
  def dp_mean(values):
    return aggregation.next(aggregation.initialize(), values).result

  return dp_mean


def dp_clip_report(values, clip_norm: float) -> dict:
  """What clipping at `clip_norm` does to the known users' states.

  Each user's state (a tuple of arrays) is clipped as one record, by its
  global L2 norm, as `build_dp_mean` clips it. A simulation diagnostic over
  the users' private states (it is not released by the DP mean and not
  covered by its epsilon).

  Returns:
    `{'clip_norm', 'num_users', 'fraction_clipped', 'median_norm',
    'median_norm_over_clip', 'max_norm'}`.
  """
  if not values:
    raise ValueError('dp_clip_report needs at least one user state')
  norms = np.asarray([
      math.sqrt(sum(float(np.sum(np.square(np.asarray(v, np.float64))))
                    for v in state)) for state in values])
  median = float(np.median(norms))
  return dict(clip_norm=float(clip_norm), num_users=len(values),
              fraction_clipped=float(np.mean(norms > clip_norm)),
              median_norm=median,
              median_norm_over_clip=median / float(clip_norm),
              max_norm=float(norms.max()))


def dp_mean_epsilon(noise_multiplier: float, delta: float) -> float:
  """Epsilon of one release of the DP mean (RDP, add-or-remove-one user)."""
  if noise_multiplier <= 0:
    return float('inf')
  accountant = dp_accounting.rdp.RdpAccountant()
  accountant.compose(dp_accounting.GaussianDpEvent(noise_multiplier))
  return float(accountant.get_epsilon(delta))
