"""User-level DP over shards of users: each user clipped before a shard sums.

The sharded simulation (`core/sharded.py`) runs many users in one TFF
client. User-level DP clips each *user's* update, so a shard clips every
user with `clip_user_update` (the clipping of `tfp.GaussianSumQuery`) and
sends their sum; `build_sharded_aggregator` then noises the total once,
exactly as `privacy.build_aggregator` does over the users themselves.
"""

from __future__ import annotations

import tensorflow as tf
import tensorflow_federated as tff
import tensorflow_privacy as tfp

from tff_personal.core import privacy

AggregationFactory = privacy.AggregationFactory


class PreClippedGaussianSumQuery(tfp.GaussianSumQuery):
  """A Gaussian sum query whose records are sums of already-clipped records.

  For the sharded simulation (`core/sharded.py`): a shard clips each of its
  users' updates to `l2_norm_clip` and sends their sum as one record; this
  query sums the records without clipping them again and adds Gaussian noise
  of `stddev`, once, to the total, which is exactly what
  `tfp.GaussianSumQuery` computes over the users themselves. Written by
  hand: tensorflow-privacy has no query for pre-clipped partial sums.
  """

  def preprocess_record_impl(self, params, record):
    del params
    return record, tf.linalg.global_norm(tf.nest.flatten(record))

  def preprocess_record(self, params, record):
    return record


def clip_user_update(update, clip_norm: float):
  """One user's update clipped as `tfp.GaussianSumQuery` clips a record."""
  flat = tf.nest.flatten(update)
  clipped, _ = tf.clip_by_global_norm(flat, clip_norm)
  return tf.nest.pack_sequence_as(update, clipped)


def build_sharded_aggregator(config: privacy.DPConfig) -> AggregationFactory:
  """The aggregator for shards whose records are sums of clipped updates.

  Equals `build_aggregator(config)` applied to the users (per-user clip at
  `clip_norm`, Gaussian noise of std `noise_multiplier * clip_norm` on the
  sum, divided by `clients_per_round`), when each shard sends the sum of its
  users' updates clipped with `clip_user_update`. Only 'gaussian_fixed':
  adaptive clipping needs per-user clipped counts, which shards do not send,
  and distributed DP ('distributed_dgauss') is each user's own work
  (rotate, clip, round, noise) summed by secure aggregation over the users,
  which a shard's one record cannot carry; both run with one user per
  client (`sharded.resolve_num_shards` chooses that for them).
  """
  config = privacy.resolve(config)
  if config.mechanism != 'gaussian_fixed':
    raise ValueError(
        'the sharded simulation supports DP mechanism gaussian_fixed only '
        f'(got {config.mechanism!r}); run with one user per client '
        f'(simulation_shards=0) for {config.mechanism}')
  clip = float(config.clip_norm)
  query = tfp.NormalizedQuery(
      PreClippedGaussianSumQuery(
          l2_norm_clip=clip, stddev=clip * float(config.noise_multiplier)),
      denominator=float(config.clients_per_round))
  return tff.aggregators.DifferentiallyPrivateFactory(query)
