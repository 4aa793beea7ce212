"""FedEmbed-SOM: sub-populations from a federated self-organising map (3.3.1).

The model is FedEmbed's (`models/fedembed.py`, assignment 'som': encoder,
K sub-population heads, global head nu, type head gamma, private personal
embedding e_u). The SOM has one node per head; its nodes are shared
non-trainable model variables, so clients receive them with the model and
evaluation assigns heads with them. The map arithmetic is `models/som.py`.

One round (our reading of section 3.3.1, whose text is short):

1. Clients receive the model with two maps: `active` (the map the heads are
   indexed by) and `nodes` (the map being learned).
2. Each client takes as head the best-matching unit of e_u in `active`
   (Algorithm 1 line 13, "assigned by Psi(e_u)") and trains as FedEmbed does
   (zero gradient on the other heads; every head in the shared update).
3. With its embedding after training it computes the Kohonen update of
   `nodes` it asks for and its similarity score, and its cluster in the old
   (`active`) and the new (`nodes`) map, as a one-hot K x K count.
4. The server applies the model update (server optimizer), then moves
   `nodes` by the selected SOM update times a decaying learning rate, and
   re-uses heads: new cluster j takes the head of the old cluster it overlaps
   most (`som.head_sources` over the summed counts), after which the current
   map becomes `active`. So the heads are always indexed by the map the
   clients of the next round assign with, and each map is compared with its
   successor on the same users, as the paper describes ("comparing user
   cluster membership in the new versus old SOMs").

SOM update selection, `som_update`:

* 'best' (the paper, default without DP): each client sends `<score, update>`
  and `best_scoring.BestScoringFactory` (a TFF aggregation) hands the server
  the update of the best-scoring client, applied to every node. Which score
  is "best" is our choice, `winner`: 'least_similar' (default) takes the
  client whose embedding the map represents worst (largest squared distance
  to its best-matching unit), 'most_similar' the best represented one. With
  'most_similar' the map only refines where it already fits and never
  reaches a sub-population no node is near; the least similar client is
  what a learning map needs to see.
  What this reveals, and why it is not DP: see `best_scoring.py` (one
  client's update per round, hence its embedding, is released exactly).
  **This is the exception to the library's rule that nothing of a client's
  private state reaches the server**: the best-scoring client's Kohonen
  update, computed from its private embedding, is handed to the server
  verbatim. So 'best' is refused unless the caller passes
  `allow_unprotected_best_client=True` (from the binaries:
  `--algorithm_options=allow_unprotected_best_client=True`), and it is
  refused under DP in any case. Where the claim must hold, run FedEmbed-SOM
  with `--dp` (then the update is 'mean', clipped, noised and covered by
  epsilon), or build it with `SomConfig(update='mean')`, whose cohort mean
  reaches the server only as an aggregate, like every model update.
* 'mean' (default with a DP aggregator, which refuses 'best'): the SOM
  update is the mean over the cohort of the clients' Kohonen updates (a
  mini-batch SOM). It travels inside the shared update through the same
  aggregator, so DP clips it jointly with the model update, noises it and
  the epsilon of `core/privacy.py` covers it. The membership counts travel
  the same way in both modes (with DP: noised).

Statistics are multiplied by `statistics_scale` before aggregation and
divided after, so that under DP they take a bounded share of the joint clip
norm (an embedding-space update has norm of order 1).

Not done: the server optimizer's state (e.g. Adam moments) is not re-indexed
with the heads; with the default server SGD there is none.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_personal.core import best_scoring
from tff_personal.core import process as process_lib
from tff_personal.core import split_training
from tff_personal.core import statistics_process
from tff_personal.models import fedembed as fedembed_model
from tff_personal.models import som

SOM_UPDATES = ('best', 'mean')
WINNERS = ('least_similar', 'most_similar')


@dataclasses.dataclass(frozen=True)
class SomConfig:
  """Hyper-parameters of the federated SOM.

  Attributes:
    update: 'best', 'mean' or None (None: 'mean' with a DP aggregator, else
      'best').
    winner: which score is best for 'best' (module docstring).
    learning_rate: initial SOM learning rate (decays to `final_learning_rate`
      over `decay_rounds` map updates).
    final_learning_rate: final SOM learning rate.
    sigma: initial neighbourhood width in grid units.
    final_sigma: final neighbourhood width.
    decay_rounds: rounds over which both decay (exponentially).
    statistics_scale: factor on the statistics sent to the aggregator.
    reuse_heads: re-index heads by maximal cluster overlap each round.
    init_scale: the nodes start uniform in [-init_scale, init_scale].
  """
  update: Optional[str] = None
  winner: str = 'least_similar'
  learning_rate: float = 0.5
  final_learning_rate: float = 0.05
  sigma: float = 1.0
  final_sigma: float = 0.1
  decay_rounds: float = 100.0
  statistics_scale: float = 0.1
  reuse_heads: bool = True
  init_scale: float = 1.0

  def resolve(self, aggregator_factory) -> 'SomConfig':
    dp = isinstance(aggregator_factory,
                    tff.aggregators.DifferentiallyPrivateFactory)
    update = self.update or ('mean' if dp else 'best')
    if update not in SOM_UPDATES:
      raise ValueError(f'som update must be one of {SOM_UPDATES}, got '
                       f'{update!r}')
    if self.winner not in WINNERS:
      raise ValueError(f'winner must be one of {WINNERS}, got {self.winner!r}')
    if dp and update == 'best':
      raise ValueError(
          "som update 'best' releases one client's SOM update exactly and is "
          "not differentially private; use 'mean' with a DP aggregator")
    for name in ('learning_rate', 'final_learning_rate', 'sigma',
                 'final_sigma', 'decay_rounds', 'statistics_scale',
                 'init_scale'):
      if getattr(self, name) <= 0:
        raise ValueError(f'som {name} must be positive, got '
                         f'{getattr(self, name)}')
    return dataclasses.replace(self, update=update)


def build_fedembed_som(model_factory, *,
                       client_optimizer: tff.learning.optimizers.Optimizer,
                       server_optimizer: tff.learning.optimizers.Optimizer,
                       aggregator_factory=None, metrics_fn=None,
                       train_metrics: bool = True, seed: Optional[int] = None,
                       embedding_dim: int = 28,
                       num_subpopulations: Optional[int] = None,
                       private_optimizer=None,
                       som_config: SomConfig = SomConfig(),
                       allow_unprotected_best_client: bool = False,
                       ) -> process_lib.StatefulClientProcess:
  """Builds FedEmbed-SOM (module docstring).

  Args:
    model_factory: `FedEmbedConfig -> model_fn` (a task's
      `fedembed_model_fn_factory`).
    client_optimizer: local optimizer of the shared (and, without
      `private_optimizer`, the private) variables.
    server_optimizer: applied to the aggregated model update.
    aggregator_factory: `tff.aggregators` factory for the shared update and the
      SOM statistics (default: weighted mean).
    metrics_fn: per-batch training-metric sums.
    train_metrics: release training-metric sums.
    seed: initialisation seed.
    embedding_dim: personal embedding size (> 0).
    num_subpopulations: K (default: the task's).
    private_optimizer: optional separate optimizer of the personal embedding.
    som_config: the SOM's hyper-parameters.
    allow_unprotected_best_client: required True for SOM update 'best' (the
      default without a DP aggregator), which hands the server one client's
      embedding-derived update verbatim (module docstring).

  Raises:
    ValueError: 'best' without `allow_unprotected_best_client`, or under DP.
  """
  if aggregator_factory is None:
    aggregator_factory = tff.aggregators.MeanFactory()
  cfg = som_config.resolve(aggregator_factory)
  if cfg.update == 'best' and not allow_unprotected_best_client:
    raise ValueError(
        "fedembed_som's SOM update 'best' (the paper's, the default without "
        "DP) hands the best-scoring client's embedding-derived update to "
        'the server verbatim: the one exception to private state never '
        'reaching the server. Run with --dp (the update is then the noised '
        'cohort mean), or opt in explicitly with '
        '--algorithm_options=allow_unprotected_best_client=True '
        '(allow_unprotected_best_client=True).')
  config = fedembed_model.FedEmbedConfig(
      assignment='som', embedding_dim=embedding_dim,
      num_subpopulations=num_subpopulations)  # None: the task's
  config.validate()
  model_fn = model_factory(config)
  index = lambda name, trainable: statistics_process.shared_variable_index(
      model_fn, name, trainable)
  i_nodes, i_active, i_steps = (index('som/nodes', False),
                                index('som/active', False),
                                index('som/steps', False))
  i_kernel, i_bias = index('heads/kernel', True), index('heads/bias', True)
  weights = process_lib.initial_shared_weights(model_fn, seed)
  non_trainable = list(weights.non_trainable)
  k = non_trainable[i_nodes].shape[0]
  non_trainable[i_nodes] = non_trainable[i_nodes] * np.float32(cfg.init_scale)
  non_trainable[i_active] = np.copy(non_trainable[i_nodes])  # same start
  weights = process_lib.ModelWeights(trainable=weights.trainable,
                                     non_trainable=tuple(non_trainable))
  weights_type = process_lib.model_weights_type(weights)
  client_state_type = process_lib.split_client_state_type(model_fn)
  data_type = process_lib.split_data_type(model_fn)
  scale = cfg.statistics_scale
  best = cfg.update == 'best'
  sign = -1.0 if cfg.winner == 'least_similar' else 1.0

  def make_step():  # a process_lib.ClientStepFactory (sharding: sharded.py)
    model = model_fn()

    def step(weights, client_state, dataset):
      update, weight, new_private, metrics = split_training.local_train(
          model, client_optimizer, weights,
          tuple(client_state[process_lib.CLIENT_STATE_PRIVATE]), dataset,
          metrics_fn, private_optimizer)
      nodes = weights.non_trainable[i_nodes]
      active = weights.non_trainable[i_active]
      sigma = som.decayed(cfg.sigma, cfg.final_sigma,
                          weights.non_trainable[i_steps], cfg.decay_rounds)
      # The personal embedding after local training (none: dim 0, K = 1).
      e = new_private[0] if embedding_dim else tf.zeros([0])
      delta, similarity, bmu = som.kohonen_update(nodes, e, sigma)
      counts = som.membership_counts(k, som.best_matching_unit(active, e), bmu)
      ok = tf.cast(weight > 0, tf.float32)  # 0: non-finite training
      statistics = collections.OrderedDict(counts=counts * (scale * ok))
      if not best:
        statistics['som'] = delta * (scale * ok)
      metrics['clients'] = tf.constant(1, tf.int32)
      # Sum over the cohort (not per example) of the squared distance of
      # each embedding to its best-matching unit: divide by `clients`.
      metrics['som_squared_distance'] = -similarity * ok
      out = collections.OrderedDict(
          update=collections.OrderedDict(model=update, statistics=statistics),
          update_weight=weight,
          client_state=collections.OrderedDict([
              (process_lib.CLIENT_STATE_PRIVATE, new_private),
              (process_lib.CLIENT_STATE_ROUNDS,
               client_state[process_lib.CLIENT_STATE_ROUNDS] + 1)]),
          metrics=metrics)
      if best:
        out['selected'] = collections.OrderedDict(
            score=tf.where(ok > 0, sign * similarity, float('-inf')),
            value=delta)
      return out

    return step

  client_work = process_lib.client_work_from_step(
      make_step, weights_type, client_state_type, data_type)
  statistics_type = client_work.type_signature.result.update.statistics
  step_types = [weights_type, statistics_type, tff.TensorType(np.float32)]
  if best:
    step_types.append(client_work.type_signature.result.selected)

  def step(weights, statistics, selected):
    trainable = list(weights.trainable)
    non_trainable = list(weights.non_trainable)
    nodes, steps = non_trainable[i_nodes], non_trainable[i_steps]
    if best:
      delta = tf.where(tf.math.is_finite(selected['score']),
                       selected['value'], tf.zeros_like(selected['value']))
    else:
      delta = statistics['som'] / scale
    rate = som.decayed(cfg.learning_rate, cfg.final_learning_rate, steps,
                       cfg.decay_rounds)
    counts = statistics['counts'] / scale
    if cfg.reuse_heads:
      sources = som.head_sources(counts)
    else:
      sources = tf.range(k, dtype=tf.int32)
    trainable[i_kernel] = tf.gather(trainable[i_kernel], sources)
    trainable[i_bias] = tf.gather(trainable[i_bias], sources)
    non_trainable[i_active] = nodes
    non_trainable[i_nodes] = nodes + rate * delta
    non_trainable[i_steps] = steps + 1.0
    measurements = collections.OrderedDict(
        reused_heads=tf.reduce_sum(tf.cast(
            sources != tf.range(k, dtype=tf.int32), tf.int32)),
        som_learning_rate=rate)
    return collections.OrderedDict(
        weights=process_lib.ModelWeights(trainable=tuple(trainable),
                                         non_trainable=tuple(non_trainable)),
        measurements=measurements)

  # The cohort size is unused: the SOM and the counts work with means.
  if best:
    server_step = tff.tensorflow.computation(
        lambda w, s, n, sel: step(w, s, sel), *step_types)
  else:
    server_step = tff.tensorflow.computation(
        lambda w, s, n: step(w, s, None), *step_types)

  return statistics_process.compose_with_server_step(
      initial_model_weights=weights, client_state_type=client_state_type,
      client_work=client_work, aggregator_factory=aggregator_factory,
      server_optimizer=server_optimizer, server_step=server_step,
      selection_factory=best_scoring.BestScoringFactory() if best else None,
      train_metrics=train_metrics, model_fn=model_fn, client_step=make_step)


def som_alone(embeddings: np.ndarray, initial_nodes: np.ndarray, *,
              rounds: int, cohort_size: int, config, seed: int = 0,
              cohorts=None) -> np.ndarray:
  """FedEmbed-SOM's map learned on fixed embeddings: the SOM alone.

  Replays this algorithm's map update with the arithmetic of
  `models/som.py`, the embeddings held fixed (no model, no
  heads), so that the map can be judged apart from the embeddings it is
  trained with. Round r (r = 0, 1, ...) draws a cohort, takes each cohort
  embedding's Kohonen update at sigma `decayed(sigma, final_sigma, r)`
  and moves every node by `decayed(learning_rate, final_learning_rate, r)`
  times the update of the best-scoring embedding (`config.update` 'best',
  best by `config.winner`, the first one on ties) or the cohort's mean
  update ('mean', every embedding weighted alike).

  Args:
    embeddings: float [N, D] personal embeddings.
    initial_nodes: float [K, D] the map's start.
    rounds: map updates.
    cohort_size: embeddings drawn per round (without replacement).
    config: a resolved `fedembed_som.SomConfig` (`update` set).
    seed: seed of the cohort draws.
    cohorts: optional explicit cohorts, one sequence of row indices per
      round (then `cohort_size` and `seed` are unused).

  Returns:
    float32 [K, D] the map after `rounds` updates.
  """
  if config.update not in ('best', 'mean'):
    raise ValueError(f"config.update must be 'best' or 'mean' (a resolved "
                     f'SomConfig), got {config.update!r}')
  embeddings = np.asarray(embeddings, np.float32)
  nodes = tf.constant(np.asarray(initial_nodes, np.float32))
  rng = np.random.default_rng(seed)
  sign = -1.0 if config.winner == 'least_similar' else 1.0
  for r in range(rounds):
    cohort = (cohorts[r] if cohorts is not None else rng.choice(
        len(embeddings), min(cohort_size, len(embeddings)), replace=False))
    sigma = som.decayed(config.sigma, config.final_sigma, r,
                        config.decay_rounds)
    rate = som.decayed(config.learning_rate, config.final_learning_rate, r,
                       config.decay_rounds)
    updates = [som.kohonen_update(nodes, tf.constant(embeddings[i]), sigma)
               for i in cohort]
    if config.update == 'best':
      scores = [sign * float(similarity) for _, similarity, _ in updates]
      delta = updates[int(np.argmax(scores))][0]
    else:
      delta = tf.add_n([d for d, _, _ in updates]) / float(len(updates))
    nodes = nodes + rate * delta
  return nodes.numpy()


def node_assignment(nodes: np.ndarray, embeddings: np.ndarray) -> np.ndarray:
  """int64 [N] each embedding's best-matching unit among `nodes` [K, D]."""
  d = np.sum((np.asarray(embeddings)[:, None, :] - nodes[None]) ** 2, -1)
  return np.argmin(d, axis=-1).astype(np.int64)
