"""HypCluster (Mansour et al., 2020): k shared models; each client trains
the one that fits it best, and that choice is private.

The process's shared weights are k copies of the task model (each its own
seeded initialisation) and k cluster *shares*. Each round a sampled client
computes every model's loss on its own data, keeps the index of the lowest
as private state (`choice`, an int; `ClusterModel.prepare_fn`), trains only
that model for one local pass (`core/split_training.local_train`; the
others' gradients are zero), and sends the update of the chosen model with
the one-hot of its choice in the share slots. Aggregated (weighted mean by
examples, or a DP aggregator, which clips and noises the update and the
one-hot together), slot j holds cluster j's share of the cohort;
`core/share_normalized.ShareNormalized` (the server optimizer's wrapper) divides each model's
mean update by its share, which makes it the mean over the clients that
chose it (HypCluster's per-cluster FedAvg), and leaves the shares at 0. The
server sees only aggregates: no client's choice reaches a server value.

Evaluation re-selects: each evaluated client picks the model with the lowest
loss on its own training data (the evaluator's fine-tuning pass, which here
trains nothing) and tests it, as HypCluster's inference does; a client
that never trained is served the same way.

With `num_clusters=1` it is FedAvg exactly (tested).

Example:
  proc = registry.build_for_task('hypcluster', task, client_optimizer=...,
                                 server_optimizer=..., num_clusters=3)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import tensorflow as tf
import tensorflow_federated as tff

from tff_personal.core import process as process_lib
from tff_personal.core import share_normalized
from tff_personal.core import split_model as split_model_lib
from tff_personal.core import split_training


class _Clusters(tf.keras.Model):
  """Holds the k member models, their shares and the client's choice."""

  def __init__(self, members, num_clusters: int):
    super().__init__()
    self.shares = [self.add_weight(name=f'share_{j}', shape=(),
                                   initializer='zeros', trainable=True)
                   for j in range(num_clusters)]
    self.choice = self.add_weight(name='choice', shape=(), dtype=tf.int32,
                                  initializer='zeros', trainable=False)
    self.members = members


@dataclasses.dataclass
class ClusterModel(split_model_lib.SplitModel):
  """A split model over k member models: its outputs are the chosen one's."""
  members: Any = ()
  choice: Any = None

  def forward(self, batch, training: bool) -> Any:
    if len(self.members) == 1:
      return self.members[0].forward(batch, training)
    return tf.switch_case(self.choice.read_value(), [
        (lambda m=m: m.forward(batch, training)) for m in self.members])

  def member_losses(self, dataset: tf.data.Dataset) -> tf.Tensor:
    """Each member's summed loss over `dataset` ([k])."""

    def add(sums, batch):
      n = tf.cast(tf.shape(tf.nest.flatten(batch)[0])[0], tf.float32)
      return sums + n * tf.stack([m.loss(batch, m.forward(batch, False))
                                  for m in self.members])

    return dataset.reduce(tf.zeros([len(self.members)]), add)


def cluster_model_fn(model_fn: split_model_lib.SplitModelFn,
                     num_clusters: int) -> split_model_lib.SplitModelFn:
  """HypCluster's model over `model_fn`'s (which must have no private
  variables): shared = shares + the members' variables, private = choice."""
  if num_clusters < 1:
    raise ValueError(f'hypcluster needs num_clusters >= 1, got {num_clusters}')

  def fn():
    members = [model_fn() for _ in range(num_clusters)]
    if members[0].private_variables:
      raise ValueError('hypcluster shares whole models: the task model must '
                       'have no private variables (use embedding_dim=0)')
    holder = _Clusters([m.model for m in members], num_clusters)
    model = ClusterModel(
        model=holder, private_variables=[holder.choice],
        loss_fn=members[0].loss_fn, input_spec=members[0].input_spec,
        predict_fn=members[0].predict_fn, eval_fn=members[0].eval_fn,
        members=members, choice=holder.choice)

    def prepare_fn(dataset):
      holder.choice.assign(tf.cast(tf.argmin(model.member_losses(dataset)),
                                   tf.int32))

    model.prepare_fn = prepare_fn
    return model

  return fn


def owners(model_fn: split_model_lib.SplitModelFn) -> list[tuple[str, int]]:
  """For each shared trainable weight of a `cluster_model_fn` model:
  ('share', j) or ('model', j)."""
  with tf.Graph().as_default():
    model = model_fn()
    holder = model.model
    share = {v.ref(): j for j, v in enumerate(holder.shares)}
    member = {v.ref(): j for j, m in enumerate(holder.members)
              for v in m.trainable_variables}
    return [('share', share[v.ref()]) if v.ref() in share else
            ('model', member[v.ref()])
            for v in model.shared_trainable_variables]


def hypcluster_client_step_factory(model_fn, client_optimizer, layout,
                                   metrics_fn=None):
  """`core.process.ClientStepFactory`: choose, train the chosen model, send
  its update with the one-hot of the choice in the share slots."""

  def make_step():
    model = model_fn()

    def step(weights, client_state, dataset):
      update, weight, new_private, metrics = split_training.local_train(
          model, client_optimizer, weights,
          tuple(client_state[process_lib.CLIENT_STATE_PRIVATE]), dataset,
          metrics_fn)
      onehot = tf.one_hot(new_private[0], len(model.members)) * tf.cast(
          weight > 0, tf.float32)
      update = tuple(onehot[j] if kind == 'share' else u
                     for u, (kind, j) in zip(update, layout))
      return process_lib.client_step_result(update, weight, new_private,
                                            client_state, metrics)

    return step

  return make_step


def build_hypcluster(model_fn_factory, *,
                     client_optimizer: tff.learning.optimizers.Optimizer,
                     server_optimizer: tff.learning.optimizers.Optimizer,
                     aggregator_factory=None, metrics_fn=None,
                     train_metrics: bool = True, seed: Optional[int] = None,
                     embedding_dim: int = 0, private_optimizer=None,
                     num_clusters: int = 2, min_share: float = 1e-3,
                     ) -> process_lib.StatefulClientProcess:
  """Builds HypCluster (module docstring).

  Args:
    model_fn_factory: the task's `embedding_dim -> model_fn`.
    client_optimizer: local optimizer of the chosen model.
    server_optimizer: applied to each cluster's mean update
      (`ShareNormalized` wraps it).
    aggregator_factory: `tff.aggregators` factory (default weighted mean).
    metrics_fn: per-batch training-metric sums.
    train_metrics: release training-metric sums.
    seed: initialisation seed (the k models differ).
    embedding_dim: must be 0.
    private_optimizer: unused (the choice is not trained).
    num_clusters: k, the number of shared models.
    min_share: a cluster whose aggregated share is at most this gets no
      update that round.

  Returns:
    A `StatefulClientProcess` whose client state is the choice.
  """
  del private_optimizer  # The choice is an argmin, not trained.
  if embedding_dim:
    raise ValueError('hypcluster shares whole models; it takes no personal '
                     f'embedding (got {embedding_dim})')
  model_fn = cluster_model_fn(model_fn_factory(0), num_clusters)
  layout = owners(model_fn)
  return process_lib.build_step_process(
      model_fn, hypcluster_client_step_factory(
          model_fn, client_optimizer, layout, metrics_fn),
      initial_weights=process_lib.initial_shared_weights(model_fn, seed),
      client_state_type=process_lib.split_client_state_type(model_fn),
      server_optimizer=share_normalized.ShareNormalized(
          server_optimizer, ['share' if kind == 'share' else ('part', j)
                             for kind, j in layout], min_share),
      aggregator_factory=aggregator_factory, train_metrics=train_metrics,
      eval_fine_tune=True,
      eval_fine_tune_optimizer=tff.learning.optimizers.build_sgdm(0.0))
