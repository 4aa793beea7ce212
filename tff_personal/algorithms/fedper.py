"""FedPer (Arivazhagan et al., 2019): shared base layers, personal head.

The task's model is split at its head layer (`models/personal_head.
personal_head_model_fn`, as FedRep splits it): the head is private (client
state, never sent), every other trainable variable is shared. Unlike FedRep,
whose client fits the head first and then the body, FedPer trains both parts
*jointly*, in one local pass (`core/split_training.local_train`), and sends
the base layers' update; the server aggregates it (DP covers every shared
parameter) and applies the server optimizer. Evaluation uses each client's
own head; a client that never trained starts from the store's initial head.

With `head_layer=None` nothing is private: FedAvg exactly (tested).

Example:
  proc = registry.build_for_task('fedper', task, client_optimizer=...,
                                 server_optimizer=...)
"""

from __future__ import annotations

from typing import Optional

import tensorflow_federated as tff

from tff_personal.core import process as process_lib
from tff_personal.models import personal_head


def build_fedper(model_fn_factory, *,
                 client_optimizer: tff.learning.optimizers.Optimizer,
                 server_optimizer: tff.learning.optimizers.Optimizer,
                 aggregator_factory=None, metrics_fn=None,
                 train_metrics: bool = True, seed: Optional[int] = None,
                 embedding_dim: int = 0, private_optimizer=None,
                 head_layer: Optional[str] = 'head',
                 ) -> process_lib.StatefulClientProcess:
  """Builds FedPer (module docstring).

  Args:
    model_fn_factory: the task's `embedding_dim -> model_fn`.
    client_optimizer: local optimizer of the base layers (and of the head
      when `private_optimizer` is None).
    server_optimizer: applied to the aggregated base-layer update.
    aggregator_factory: `tff.aggregators` factory (default weighted mean).
    metrics_fn: per-batch training-metric sums.
    train_metrics: release training-metric sums.
    seed: initialisation seed.
    embedding_dim: a personal embedding besides the head (0: none, FedPer).
    private_optimizer: optional optimizer of the head.
    head_layer: the task model's personal layer (None: nothing personal,
      which is FedAvg).

  Returns:
    A `StatefulClientProcess` whose client state is the personal head.
  """
  return process_lib.build_split_model_process(
      personal_head.personal_head_model_fn(model_fn_factory(embedding_dim),
                                           head_layer),
      client_optimizer=client_optimizer, server_optimizer=server_optimizer,
      aggregator_factory=aggregator_factory, metrics_fn=metrics_fn,
      train_metrics=train_metrics, seed=seed,
      private_optimizer=private_optimizer)
