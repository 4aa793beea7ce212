"""FURL: federated and private parameters (Bui et al., "Federated User
Representation Learning", sections 3 and 4).

Any model whose variables are split, by its builder, into federated and
private parts (`models.split_model.SplitModel`): the private parameters (a
user-embedding row, user-specific weights) are client state, trained jointly
with the federated ones and never sent; the federated ones are aggregated with
FedAvg or any TFF aggregator, DP included.

FURL section 3.4: for private parameters "the global update rule ... is to
simply keep the locally trained value from user u" (the identity function),
which is exactly keeping them on the client. `tests/furl_test.py` checks the
split-personalization constraint: with full participation, training the user
embedding table as a shared parameter with that identity rule gives the same
federated parameters, round after round, as keeping each row on its client.
"""

from __future__ import annotations

from typing import Callable, Optional

import tensorflow_federated as tff

from tff_personal.core import process as process_lib
from tff_personal.core import split_model as split_model_lib


def build_furl(model_fn_factory: Callable[[int], split_model_lib.SplitModelFn],
               *,
               client_optimizer: tff.learning.optimizers.Optimizer,
               server_optimizer: tff.learning.optimizers.Optimizer,
               aggregator_factory=None, metrics_fn=None,
               train_metrics: bool = True, seed: Optional[int] = None,
               embedding_dim: int = 32,
               private_optimizer: Optional[tff.learning.optimizers.Optimizer]
               = None) -> process_lib.StatefulClientProcess:
  """FedAvg of the federated parameters; private ones are client state.

  Args:
    model_fn_factory: `embedding_dim -> model_fn`; the task's model builder,
      which declares which variables are private.
    client_optimizer: local optimizer (FURL: SGD), applied to federated and
      private parameters jointly.
    server_optimizer: applied to the aggregated federated update (SGD with
      learning rate 1 is FedAvg).
    aggregator_factory: any `tff.aggregators` factory; default weighted mean.
    metrics_fn: training-metric sums of the task.
    train_metrics: release training-metric sums.
    seed: seed of the initial federated parameters.
    embedding_dim: size of the private user embedding; must be positive
      (`global` is the same model with none).
    private_optimizer: optional optimizer of the private parameters (default:
      `client_optimizer`).

  Returns:
    A `StatefulClientProcess`.
  """
  if embedding_dim <= 0:
    raise ValueError(
        f'FURL needs private parameters; embedding_dim={embedding_dim}')
  return process_lib.build_split_model_process(
      model_fn_factory(embedding_dim), client_optimizer=client_optimizer,
      server_optimizer=server_optimizer, aggregator_factory=aggregator_factory,
      metrics_fn=metrics_fn, train_metrics=train_metrics, seed=seed,
      private_optimizer=private_optimizer)
