"""`fedavg_ft`: FedAvg, then local fine-tuning on each client (Cheng et al.).

Training is FedAvg (a split model without private variables, which equals
TFF's `build_weighted_fed_avg`). Evaluation fine-tunes a copy of the current
global model on each client's own training data (all weights, one local pass)
and evaluates the fine-tuned copy on the client's test data; nothing leaves
the client and the global model is unchanged. The process declares this
(`eval_fine_tune`, `eval_private_fn`), so the one run path evaluates it so;
`build_fine_tune_eval` is the same evaluation as a standalone computation
(any number of passes): `core/evaluation.build_cold_start_eval` on the model
with every variable private, the global weights as each client's "private
state".
"""

from __future__ import annotations

from typing import Optional

import tensorflow as tf
import tensorflow_federated as tff

from tff_personal.algorithms import ditto
from tff_personal.core import evaluation
from tff_personal.core import process as process_lib
from tff_personal.core import split_model as split_model_lib


def build_fedavg_ft(model_fn: split_model_lib.SplitModelFn, *,
                    client_optimizer: Optional[tff.learning.optimizers.Optimizer] = None,
                    server_optimizer: Optional[tff.learning.optimizers.Optimizer] = None,
                    aggregator_factory=None, seed: Optional[int] = 0,
                    metrics_fn=None, train_metrics: bool = True,
                    fine_tune_optimizer: Optional[
                        tff.learning.optimizers.Optimizer] = None,
                    ) -> process_lib.StatefulClientProcess:
  """FedAvg+FT: FedAvg's training process, fine-tuned at evaluation.

  Trains exactly FedAvg (clients keep nothing between rounds). The process
  declares its evaluation (`eval_fine_tune`): each evaluated client starts
  from the global model (`eval_private_fn`), fine-tunes every weight of a
  private copy for one local pass on its own training data, and tests the
  copy; nothing leaves the client and the global model is unchanged.
  `fine_tune_optimizer`: that pass's optimizer (None: the experiment's,
  `StatefulClientProcess.eval_fine_tune_optimizer`).
  """
  client_optimizer = (client_optimizer or
                      tff.learning.optimizers.build_adam(1e-3))
  server_optimizer = (server_optimizer or
                      tff.learning.optimizers.build_sgdm(1.0))
  with tf.Graph().as_default():
    if model_fn().private_variables:
      raise ValueError('fedavg_ft needs a model without private variables; '
                       'it fine-tunes a copy of the whole model')
  weights = process_lib.initial_shared_weights(model_fn, seed)
  return process_lib.build_step_process(
      model_fn, process_lib.split_client_step_factory(
          model_fn, client_optimizer, metrics_fn),
      initial_weights=weights,
      client_state_type=process_lib.split_client_state_type(model_fn),
      server_optimizer=server_optimizer,
      aggregator_factory=aggregator_factory, train_metrics=train_metrics,
      eval_model_fn=ditto.all_private(model_fn),
      eval_private_fn=lambda w: tuple(w.trainable),
      eval_client_state_type=ditto.personal_state_type(weights.trainable),
      eval_fine_tune=True, eval_fine_tune_optimizer=fine_tune_optimizer)


def build_fedavg_ft_algorithm(model_fn_factory, *,
                              client_optimizer: tff.learning.optimizers.Optimizer,
                              server_optimizer: tff.learning.optimizers.Optimizer,
                              aggregator_factory=None, metrics_fn=None,
                              train_metrics: bool = True,
                              seed: Optional[int] = None,
                              embedding_dim: int = 0, private_optimizer=None
                              ) -> process_lib.StatefulClientProcess:
  """`build_fedavg_ft` on a task's model (`registry`'s uniform signature).

  The evaluation's fine-tuning uses `private_optimizer` (the experiment's
  private learning rate) or else the client optimizer.
  """
  del private_optimizer  # The evaluation's optimizer is the experiment's.
  if embedding_dim:
    raise ValueError('fedavg_ft fine-tunes a copy of the whole model; it '
                     f'takes no personal embedding (got {embedding_dim})')
  return build_fedavg_ft(model_fn_factory(0),
                         client_optimizer=client_optimizer,
                         server_optimizer=server_optimizer,
                         aggregator_factory=aggregator_factory, seed=seed,
                         metrics_fn=metrics_fn, train_metrics=train_metrics)


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



class WholeModelView:
  """A process as FedAvg+FT evaluates it: every weight of a copy of the
  global model fine-tuned on each client before its test.

  The training process is `process` unchanged (its attributes are read
  through); only the evaluation attributes change: the model with every
  trainable variable private (`eval_model_fn`), each client's starting
  private state the global weights (`eval_private_fn`) and its type
  (`eval_client_state_type`). This is how a `fine_tune` strategy
  (`tff_personal/config/strategies.py`) tunes a process whose clients hold no
  private variables (FedAvg's): as TFF's personalization evaluation does,
  from the global model.

  Example:
    view = fedavg_ft.WholeModelView(fedavg.build_global(...))
    view.eval_model_fn   # every variable private
  """

  def __init__(self, process: process_lib.StatefulClientProcess):
    self._process = process
    weights_type = process.model_weights_type
    self.eval_model_fn = ditto.all_private(process.model_fn)
    self.eval_client_state_type = ditto.personal_state_type(
        list(weights_type.trainable))
    self.eval_fine_tune = True

  @staticmethod
  def eval_private_fn(weights) -> tuple:
    return tuple(weights.trainable)

  def __getattr__(self, name):
    return getattr(self._process, name)
