"""`fedavg_ft`: FedAvg, then local fine-tuning on each client (Cheng et al.).

Training is FedAvg (`fedavg.build_global`'s process: a split model without
private variables, which equals TFF's `build_weighted_fed_avg`). Evaluation
fine-tunes a copy of the current global model on each client's own training
data (all weights, `epochs` passes, the given optimizer) and evaluates the
fine-tuned copy on the client's test data; nothing leaves the client and the
global model is unchanged. It reuses `core/evaluation.build_cold_start_eval`
on the model with every variable private, the global weights passed as each
client's "private state".
"""

from __future__ import annotations

from typing import Optional

import tensorflow_federated as tff

from tff_personal.algorithms import ditto
from tff_personal.algorithms import fedavg
from tff_personal.core import evaluation
from tff_personal.core import process as process_lib
from tff_personal.models import split_model as split_model_lib


def build_fedavg_ft(model_fn: split_model_lib.SplitModelFn, *,
                    client_optimizer: Optional[tff.learning.optimizers.Optimizer] = None,
                    server_optimizer: Optional[tff.learning.optimizers.Optimizer] = None,
                    aggregator_factory=None, seed: Optional[int] = 0,
                    ) -> process_lib.StatefulClientProcess:
  """The training process of FedAvg+FT (plain FedAvg)."""
  return fedavg.build_global(
      lambda _: model_fn,
      client_optimizer=(client_optimizer or
                        tff.learning.optimizers.build_adam(1e-3)),
      server_optimizer=(server_optimizer or
                        tff.learning.optimizers.build_sgdm(1.0)),
      aggregator_factory=aggregator_factory, seed=seed)


def build_fine_tune_eval(model_fn: split_model_lib.SplitModelFn,
                         process: process_lib.StatefulClientProcess,
                         optimizer: tff.learning.optimizers.Optimizer):
  """Fine-tune-then-evaluate computation.

    (<ModelWeights()@SERVER, {C}@CLIENTS, {D*}@CLIENTS (train), {D*}@CLIENTS (test)>
      -> {<outputs, labels>}@CLIENTS)

  C holds the global weights to start from (`fine_tune_states`); the server
  value is `ditto.empty_weights()`. Repeat the train data for more epochs.
  """
  weights_type = process.model_weights_type
  state_type = ditto.personal_state_type(list(weights_type.trainable))
  return evaluation.build_cold_start_eval(
      ditto.all_private(model_fn),
      process_lib.model_weights_type(ditto.empty_weights()), state_type,
      optimizer)


def fine_tune_states(process: process_lib.StatefulClientProcess, state,
                     num_clients: int) -> list:
  """Each client's starting point for fine-tuning: the global weights."""
  weights = process.get_model_weights(state)
  return [ditto.initial_client_state(weights.trainable)
          for _ in range(num_clients)]

