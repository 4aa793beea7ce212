"""FedRep (Collins et al., 2021): shared representation, personal heads.

A FedEmbed baseline (Table 1: "a shared feature encoder with personal model
heads and no regularization"). The task's model (`model_fn_factory(0)`: no
personal embedding by default) is split at its head layer: the head is
private (client state, never sent), the encoder is shared. Each round a
client first fits its head with the encoder frozen (`head_epochs` passes over
its data), then trains the encoder with its head frozen (one pass, which is
the task's `local_epochs`), and sends the encoder update; the server
aggregates it with the given aggregator (DP covers every shared parameter:
the whole encoder) and applies the server optimizer. The TF step is
`personal_head_training.fedrep_local_train`.

A new client's head starts from the client-state store's documented initial
state. Evaluation uses each client's own head (`core/evaluation.py`); with the
fine-tuned evaluation, users who never trained fit their head first, which is
FedRep's own evaluation protocol.

With `head_layer=None` nothing is private and the body pass trains every
variable: FedAvg exactly (tested against TFF's).
"""

from __future__ import annotations

from typing import Optional

import tensorflow_federated as tff

from tff_personal.algorithms import personal_head_training
from tff_personal.core import process as process_lib
from tff_personal.core import split_model as split_model_lib
from tff_personal.models import personal_head


def fedrep_client_step_factory(model_fn: split_model_lib.SplitModelFn,
                               body_optimizer, head_optimizer,
                               head_epochs: int, metrics_fn=None):
  """`core.process.ClientStepFactory` of FedRep's local update."""

  def make_step():
    model = model_fn()

    def step(weights, client_state, dataset):
      update, weight, new_private, metrics = (
          personal_head_training.fedrep_local_train(
              model, body_optimizer, head_optimizer, weights,
              tuple(client_state[process_lib.CLIENT_STATE_PRIVATE]), dataset,
              head_epochs, metrics_fn))
      return process_lib.client_step_result(
          update, weight, new_private, client_state, metrics)

    return step

  return make_step


def build_fedrep(model_fn_factory, *,
                 client_optimizer: tff.learning.optimizers.Optimizer,
                 server_optimizer: tff.learning.optimizers.Optimizer,
                 aggregator_factory=None, metrics_fn=None,
                 train_metrics: bool = True, seed: Optional[int] = None,
                 embedding_dim: int = 0, private_optimizer=None,
                 head_epochs: int = 2, head_layer: Optional[str] = 'head',
                 ) -> process_lib.StatefulClientProcess:
  """Builds FedRep (module docstring).

  Args:
    model_fn_factory: the task's `embedding_dim -> model_fn`.
    client_optimizer: optimizer of the body pass (and of the head pass when
      `private_optimizer` is None).
    server_optimizer: applied to the aggregated encoder update.
    aggregator_factory: `tff.aggregators` factory (default weighted mean).
    metrics_fn: per-batch training-metric sums.
    train_metrics: release training-metric sums.
    seed: initialisation seed.
    embedding_dim: a personal embedding besides the head (0: none, FedRep).
    private_optimizer: optimizer of the head pass.
    head_epochs: passes over the client data of the head pass (>= 0).
    head_layer: the task model's head layer (None: no personal head).
  """
  if head_epochs < 0:
    raise ValueError(f'head_epochs must be >= 0, got {head_epochs}')
  model_fn = personal_head.personal_head_model_fn(
      model_fn_factory(embedding_dim), head_layer)
  make_step = fedrep_client_step_factory(
      model_fn, client_optimizer, private_optimizer or client_optimizer,
      head_epochs, metrics_fn)
  return process_lib.build_split_step_process(
      model_fn, make_step, server_optimizer=server_optimizer,
      aggregator_factory=aggregator_factory, train_metrics=train_metrics,
      seed=seed)
