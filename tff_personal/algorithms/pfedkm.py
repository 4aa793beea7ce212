"""PFedKM: sub-population heads assigned by federated k-means over user updates.

A FedEmbed baseline (Table 1: "a shared feature encoder with sub-population
model heads assigned by K-means clustering over user gradients", after Tang
et al., 2021). The model is FedEmbed's (`models/fedembed.py`) in 'kmeans'
mode without personal embedding, type head or global head: a shared encoder
and K shared sub-population heads. Each round a client

1. computes its probe, the unit-norm gradient of its loss with respect to the
   mean head at the broadcast weights (`fedembed.kmeans_probe_feature`: the
   "user gradient" clustered; the paper says "raw model weights and
   gradients" and we take the part of the gradient that carries the
   preference);
2. takes as head the k-means centroid nearest to its probe, trains as
   FedEmbed does (zero gradient on the other heads), and keeps the head index
   as private state (it is what evaluation uses);
3. sends, inside its shared update, the k-means statistics of its probe.

What is TFF's: the client statistics are TFF's own k-means client step
(`kmeans_clustering._compute_kmeans_step`, which also finds the closest
centroid with `_find_closest_centroid`'s formula) on the one-point dataset of
the probe, and the server's centroid update is TFF's mini-batch rule
(`kmeans_clustering._update_centroids`: new centroid = the weighted average
of the old one, with its running count, and the new points; counts start at
TFF's pseudo-count 1). What is not: `build_fed_kmeans` itself, because its
process clusters raw data points and its state is only the centroids; here the
points are computed from the model each round and the centroids live in the
model's non-trainable weights (broadcast with the model, checkpointed with
it), so the statistics travel in the model's aggregation
(`statistics_process.compose_with_server_step`). TFF's sum aggregator is
replaced by the model's (mean or DP) aggregator, and the server turns its
mean back into the sum over the cohort that k-means counts each probe once
in: an unweighted mean (DP's) times the cohort size; under a mean weighted
by examples, each client divides its statistics by its weight and also
sends that inverse weight, whose mean is the cohort size over the total
weight, so the weights cancel (exactly when every sampled client trains: a
client with no examples, or one left out as non-finite, has weight 0 in
the mean but still counts in the cohort size, which then scales the sums
by cohort / trained clients). With DP the statistics are clipped
with the model update, noised (noisy counts below 0 are clamped to 0) and
covered by the same epsilon. Since probes are unit directions, the
clustering is spherical k-means: centroids start as TFF's normal draws scaled
to unit norm (`fedembed.KMeansCentroids`) and are renormalised after TFF's
update, so that the nearest centroid is the one of largest cosine (Euclidean
k-means on directions lets a short centroid near the mean of all probes win
every client).

Privacy: the probe is a gradient of the user's loss; without DP the server
sees the sum of probes per cluster of the cohort (not one user's).
"""

from __future__ import annotations

import collections
from typing import Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff
# TFF's k-means client step and centroid update (not exported under
# tff.learning; see the module docstring).
from tensorflow_federated.python.learning.algorithms import kmeans_clustering

from tff_personal.core import process as process_lib
from tff_personal.core import split_training
from tff_personal.core import statistics_process
from tff_personal.models import fedembed as fedembed_model


def build_pfedkm(model_factory, *,
                 client_optimizer: tff.learning.optimizers.Optimizer,
                 server_optimizer: tff.learning.optimizers.Optimizer,
                 aggregator_factory=None, metrics_fn=None,
                 train_metrics: bool = True, seed: Optional[int] = None,
                 embedding_dim: int = 0,
                 num_subpopulations: Optional[int] = None,
                 private_optimizer=None,
                 statistics_scale: float = 0.1,
                 ) -> process_lib.StatefulClientProcess:
  """Builds PFedKM (module docstring).

  Args:
    model_factory: `FedEmbedConfig -> model_fn` (a task's
      `fedembed_model_fn_factory`).
    client_optimizer: local optimizer.
    server_optimizer: applied to the aggregated model update.
    aggregator_factory: `tff.aggregators` factory for the shared update and the
      k-means statistics (default: weighted mean).
    metrics_fn: per-batch training-metric sums.
    train_metrics: release training-metric sums.
    seed: initialisation seed.
    embedding_dim: a personal embedding (0: none, PFedKM).
    num_subpopulations: K, the number of clusters and heads (default: the
      task's).
    private_optimizer: optimizer of a personal embedding, if any.
    statistics_scale: factor on the k-means statistics in the shared update.
  """
  if statistics_scale <= 0:
    raise ValueError(f'statistics_scale must be positive, got '
                     f'{statistics_scale}')
  if aggregator_factory is None:
    aggregator_factory = tff.aggregators.MeanFactory()
  # A mean weighted by examples would count each probe n_k U / sum(n)
  # times: its statistics are sent over the client's weight (module
  # docstring).
  weighted = isinstance(aggregator_factory,
                        tff.aggregators.WeightedAggregationFactory)
  config = fedembed_model.FedEmbedConfig(
      assignment='kmeans', embedding_dim=embedding_dim, use_type_head=False,
      use_global_head=False,
      num_subpopulations=num_subpopulations)  # None: the task's
  config.validate()
  model_fn = model_factory(config)
  i_centroids = statistics_process.shared_variable_index(
      model_fn, 'kmeans/centroids', False)
  i_counts = statistics_process.shared_variable_index(
      model_fn, 'kmeans/counts', False)
  weights = process_lib.initial_shared_weights(model_fn, seed)
  weights_type = process_lib.model_weights_type(weights)
  client_state_type = process_lib.split_client_state_type(model_fn)
  data_type = process_lib.split_data_type(model_fn)
  scale = statistics_scale

  def make_step():  # a process_lib.ClientStepFactory (sharding: sharded.py)
    model = model_fn()

    def step(weights, client_state, dataset):
      private = tuple(client_state[process_lib.CLIENT_STATE_PRIVATE])
      split_training.assign_weights(model, weights, private)
      probe = fedembed_model.kmeans_probe_feature(model, dataset)
      result, _ = kmeans_clustering._compute_kmeans_step(  # pylint: disable=protected-access
          weights.non_trainable[i_centroids],
          tf.data.Dataset.from_tensors(probe))
      sums, counts = result.update
      update, weight, new_private, metrics = split_training.local_train(
          model, client_optimizer, weights, private, dataset, metrics_fn,
          private_optimizer)
      ok = tf.cast(weight > 0, tf.float32) * scale
      statistics = collections.OrderedDict(sums=sums * ok, counts=counts * ok)
      if weighted:
        inverse = tf.math.divide_no_nan(1.0, tf.cast(weight, tf.float32))
        statistics = collections.OrderedDict(
            sums=statistics['sums'] * inverse,
            counts=statistics['counts'] * inverse, inverse_weight=ok * inverse)
      metrics['clients'] = tf.constant(1, tf.int32)
      return collections.OrderedDict(
          update=collections.OrderedDict(model=update, statistics=statistics),
          update_weight=weight,
          client_state=collections.OrderedDict([
              (process_lib.CLIENT_STATE_PRIVATE, new_private),
              (process_lib.CLIENT_STATE_ROUNDS,
               client_state[process_lib.CLIENT_STATE_ROUNDS] + 1)]),
          metrics=metrics)

    return step

  client_work = process_lib.client_work_from_step(
      make_step, weights_type, client_state_type, data_type)
  statistics_type = client_work.type_signature.result.update.statistics

  @tff.tensorflow.computation(weights_type, statistics_type,
                              tff.TensorType(np.float32))
  def server_step(weights, statistics, cohort):
    non_trainable = list(weights.non_trainable)
    # Means over the cohort -> sums over the cohort (TFF's k-means sums):
    # unweighted, times U; weighted, times U over the mean inverse weight
    # (U / sum(n) times the scale), which gives sum(n).
    if weighted:
      to_sum = tf.math.divide_no_nan(cohort, statistics['inverse_weight'])
    else:
      to_sum = cohort / scale
    counts = tf.maximum(statistics['counts'] * to_sum, 0.0)
    sums = statistics['sums'] * to_sum
    sums = tf.where(counts[:, tf.newaxis] > 0, sums, tf.zeros_like(sums))
    centroids, totals = kmeans_clustering._update_centroids(  # pylint: disable=protected-access
        non_trainable[i_centroids], non_trainable[i_counts], sums, counts)
    # Spherical k-means: probes are directions, so centroids are kept at
    # unit norm (a short centroid near the mean of all probes would be the
    # nearest to every client and starve the others).
    non_trainable[i_centroids] = tf.math.l2_normalize(centroids, axis=-1)
    non_trainable[i_counts] = totals
    return collections.OrderedDict(
        weights=process_lib.ModelWeights(trainable=tuple(weights.trainable),
                                         non_trainable=tuple(non_trainable)),
        measurements=collections.OrderedDict(
            clusters_used=tf.reduce_sum(tf.cast(counts > 0.5, tf.int32))))

  return statistics_process.compose_with_server_step(
      initial_model_weights=weights, client_state_type=client_state_type,
      client_work=client_work, aggregator_factory=aggregator_factory,
      server_optimizer=server_optimizer, server_step=server_step,
      train_metrics=train_metrics, model_fn=model_fn, client_step=make_step)
