"""LG-FedAvg (Liang et al., 2020): local representations, a global head.

The reverse of FedPer's split (`models/personal_head.
personal_body_model_fn`): the layers named by `shared_layers` (by default
the task model's head) are shared and federated; every other trainable
variable (the representation) is private client state, trained jointly with
the head in one local pass (`core/split_training.local_train`) and never
sent. Only the head's update is aggregated (DP covers exactly it), so the
shared model, and the update each round releases, are small. A client that
never trained starts from the store's initial representation (a seeded draw
per client), as LG-FedAvg's new devices do before they fit it.

With `shared_layers` naming every layer that has trainable variables,
nothing is private: FedAvg exactly (tested, with FedPer, in
`tests/fedper_test.py`).

Example:
  proc = registry.build_for_task('lg_fedavg', task, client_optimizer=...,
                                 server_optimizer=..., shared_layers='head')
"""

from __future__ import annotations

from typing import Optional

import tensorflow_federated as tff

from tff_personal.core import process as process_lib
from tff_personal.models import personal_head


def build_lg_fedavg(model_fn_factory, *,
                    client_optimizer: tff.learning.optimizers.Optimizer,
                    server_optimizer: tff.learning.optimizers.Optimizer,
                    aggregator_factory=None, metrics_fn=None,
                    train_metrics: bool = True, seed: Optional[int] = None,
                    embedding_dim: int = 0, private_optimizer=None,
                    shared_layers: str = 'head',
                    ) -> process_lib.StatefulClientProcess:
  """Builds LG-FedAvg (module docstring).

  Args:
    model_fn_factory: the task's `embedding_dim -> model_fn`.
    client_optimizer: local optimizer of the shared head (and of the
      representation when `private_optimizer` is None).
    server_optimizer: applied to the aggregated head update.
    aggregator_factory: `tff.aggregators` factory (default weighted mean).
    metrics_fn: per-batch training-metric sums.
    train_metrics: release training-metric sums.
    seed: initialisation seed.
    embedding_dim: a personal embedding besides the representation.
    private_optimizer: optional optimizer of the representation.
    shared_layers: comma-separated names of the task model's layers that are
      global (LG-FedAvg's top layers).

  Returns:
    A `StatefulClientProcess` whose client state is the representation.
  """
  layers = [name.strip() for name in shared_layers.split(',') if name.strip()]
  return process_lib.build_split_model_process(
      personal_head.personal_body_model_fn(model_fn_factory(embedding_dim),
                                           layers),
      client_optimizer=client_optimizer, server_optimizer=server_optimizer,
      aggregator_factory=aggregator_factory, metrics_fn=metrics_fn,
      train_metrics=train_metrics, seed=seed,
      private_optimizer=private_optimizer)
