"""`global` (FedAvg) and `global_plus` (FedAvg with private personal embeddings).

Both are FedEmbed's baselines (FedEmbed Table 1):

* Global: standard federated averaging with a single model head (McMahan et
  al., 2017). Built on the stateful-client process with no private variables,
  which is exactly `tff.learning.algorithms.build_weighted_fed_avg` (tested).
* Global+: federated averaging with a personal embedding per user. The
  embedding is the only private variable of the model; it is trained jointly
  with the shared model on the client and kept as client state. With DP, only
  the shared update is clipped and noised; the embedding never leaves.

Optimizers follow FedEmbed Appendix B.1: local Adam with PyTorch's default
parameters (lr 1e-3, betas 0.9/0.999, eps 1e-8), central Adam; the paper's
central learning rate is 1, which flags may override.
"""

from __future__ import annotations

from typing import Callable, Optional

import tensorflow_federated as tff

from tff_personal.algorithms import furl
from tff_personal.core import process as process_lib
from tff_personal.core import split_model as split_model_lib

# Task-provided factory: embedding_dim -> model_fn (0 means no embedding).
ModelFnFactory = Callable[[int], split_model_lib.SplitModelFn]


def adam(learning_rate: float) -> tff.learning.optimizers.Optimizer:
  """Adam with PyTorch's defaults (the papers' reference implementations)."""
  return tff.learning.optimizers.build_adam(
      learning_rate=learning_rate, beta_1=0.9, beta_2=0.999, epsilon=1e-8)


def build_global(model_fn_factory: ModelFnFactory, *,
                 client_optimizer: tff.learning.optimizers.Optimizer,
                 server_optimizer: tff.learning.optimizers.Optimizer,
                 aggregator_factory=None, metrics_fn=None,
                 train_metrics: bool = True,
                 seed: Optional[int] = None,
                 embedding_dim: int = 0,
                 private_optimizer=None) -> process_lib.StatefulClientProcess:
  """FedAvg with one shared head; clients keep no private parameters."""
  del embedding_dim, private_optimizer  # Global has no private parameters.
  return process_lib.build_split_model_process(
      model_fn_factory(0), client_optimizer=client_optimizer,
      server_optimizer=server_optimizer, aggregator_factory=aggregator_factory,
      metrics_fn=metrics_fn, train_metrics=train_metrics, seed=seed)


def build_global_plus(model_fn_factory: ModelFnFactory, *,
                      client_optimizer: tff.learning.optimizers.Optimizer,
                      server_optimizer: tff.learning.optimizers.Optimizer,
                      aggregator_factory=None, metrics_fn=None,
                      train_metrics: bool = True,
                      seed: Optional[int] = None,
                      embedding_dim: int = 28,
                      private_optimizer=None,
                      ) -> process_lib.StatefulClientProcess:
  """FedAvg plus a private personal embedding per user (client state).

  This is FURL's split personalization with FedEmbed's model (the embedding
  enters as an input channel and next to the features): `furl.build_furl`.
  """
  if embedding_dim <= 0:
    raise ValueError(
        f'global_plus needs a personal embedding; embedding_dim={embedding_dim}')
  return furl.build_furl(
      model_fn_factory, client_optimizer=client_optimizer,
      server_optimizer=server_optimizer, aggregator_factory=aggregator_factory,
      metrics_fn=metrics_fn, train_metrics=train_metrics, seed=seed,
      embedding_dim=embedding_dim, private_optimizer=private_optimizer)
