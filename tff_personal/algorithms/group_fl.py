"""Group personalized FL (Algorithms 1-3 of Group Personalized FL).

Three stages that compose through model weights:

1. Global FL (`fl`, Algorithm 1): FedAvg over every client (the `global`
   algorithm with the paper's client SGD and FedAdam server optimizer).
2. Group FL (`groupfl`, Algorithm 2): per group, a new FedAvg run from the
   global model (`initialize` then `set_model_weights`, so each group has
   its own, fresh server-optimizer state), cohorts drawn among the group's
   clients only. Groups are independent (no state is shared), so each may
   run in its own job.
3. Local personalization (`perfl` from the global model, `groupperfl` from
   the group model; Algorithm 3): each client fine-tunes the model on its
   own data; the personalized model stays at CLIENTS, never aggregated.

On the one run path (`runs.run_experiment`, `binaries.train`) these
are two registered multi-stage algorithms (`core/stages.py`): `groupfl` is
`fl_rounds` rounds of FedAvg over every client, then a per-group stage (one
FedAvg run per group from the FL model, each client evaluated with its
group's model); `groupperfl` is the same with the group stage's evaluation
fine-tuning the client's group model on its own data first (`fedavg_ft`'s
evaluation; the paper's `perfl` is `fedavg_ft`). Both take the experiment's
optimizers, aggregator (DP) and store. `grouping` gives the controls:
shuffled groups of the same sizes, or one group of everyone.

Besides, the paper's analysis (`papers/group.py`) takes from here client
updates for clustering clients by the direction of their updates (written
by hand: TFF lacks them), perplexity pooled from token sums, and the
costs. Its evaluation is the library's (`runs.Run.client_outputs`).
"""

from __future__ import annotations

import collections
from typing import Mapping, Optional, Sequence

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_personal.algorithms import fedavg
from tff_personal.algorithms import fedavg_ft
from tff_personal.core import federated_map
from tff_personal.core import process as process_lib
from tff_personal.core import split_model as split_model_lib
from tff_personal.core import split_training
from tff_personal.core import stages

ModelWeights = tff.learning.models.ModelWeights


SERVER_STATES = ('fresh', 'keep')


def _group_stages(model_fn_factory, *, personalize: bool, fl_rounds: int,
                  embedding_dim: int, fl_clients_per_round: int,
                  grouping: str, personalization_lr: float = 0.0,
                  server_state: str = 'fresh', group_server_lr: float = 0.0,
                  **common) -> stages.Staged:
  if group_server_lr < 0:
    raise ValueError('group_server_lr must be >= 0 (0: the experiment\'s '
                     f'server learning rate), got {group_server_lr}')
  if personalization_lr < 0:
    raise ValueError('personalization_lr must be >= 0 (0: the experiment\'s '
                     f'optimizer), got {personalization_lr}')
  if embedding_dim:
    raise ValueError('group personalization trains whole models; it takes '
                     f'no personal embedding (got embedding_dim '
                     f'{embedding_dim})')
  if fl_rounds < 1:
    raise ValueError(f'fl_rounds must be >= 1, got {fl_rounds}')
  if server_state not in SERVER_STATES:
    raise ValueError(f'server_state must be one of {SERVER_STATES}, got '
                     f'{server_state!r}')
  fl = fedavg.build_global(model_fn_factory, **common)
  if personalize:
    common = dict(common)
    common.pop('private_optimizer', None)
    group = fedavg_ft.build_fedavg_ft(
        model_fn_factory(0), **common,
        fine_tune_optimizer=tff.learning.optimizers.build_sgdm(
            personalization_lr) if personalization_lr else None)
  else:
    group = fedavg.build_global(model_fn_factory, **common)

  def handoff(fl_state):  # The FL model; the server optimizer's state
    # fresh, or the FL stage's carried on (e.g. Adam's moments and step).
    state = group.set_model_weights(group.initialize(),
                                    fl.get_model_weights(fl_state))
    if server_state == 'keep':
      state = state._replace(finalizer=fl_state.finalizer)
    if group_server_lr:
      state = state._replace(finalizer=_with_learning_rate(
          state.finalizer, group_server_lr))
    return state

  return stages.Staged((
      # The same FL stage for GroupFL, GroupPerFL and every grouping.
      stages.Stage('fl', fl, rounds=fl_rounds,
                   clients_per_round=fl_clients_per_round,
                   shared_as='fedavg_global'),
      stages.Stage('group', group, handoff=handoff, per_group=True,
                   grouping=grouping)))


def _with_learning_rate(optimizer_state, learning_rate: float):
  """A TFF optimizer's state (the finalizer's) with another learning rate:
  TFF's optimizers read it from their state at every step."""
  if not isinstance(optimizer_state, Mapping) or (
      'learning_rate' not in optimizer_state):
    raise ValueError('group_server_lr needs a server optimizer whose state '
                     'holds its learning rate (a tff.learning.optimizers '
                     f'optimizer); got state {type(optimizer_state).__name__}')
  state = collections.OrderedDict(optimizer_state)
  state['learning_rate'] = np.asarray(
      learning_rate, np.asarray(state['learning_rate']).dtype)
  return state


def build_groupfl_algorithm(model_fn_factory, *,
                            client_optimizer: tff.learning.optimizers.Optimizer,
                            server_optimizer: tff.learning.optimizers.Optimizer,
                            aggregator_factory=None, metrics_fn=None,
                            train_metrics: bool = True,
                            seed: Optional[int] = None,
                            embedding_dim: int = 0, private_optimizer=None,
                            fl_rounds: int = 20, fl_clients_per_round: int = 0,
                            grouping: str = 'task',
                            server_state: str = 'fresh',
                            group_server_lr: float = 0.0) -> stages.Staged:
  """GroupFL (Algorithms 1 and 2) as a multi-stage algorithm.

  Stage 'fl': `fl_rounds` rounds of FedAvg over every client, cohorts of
  `fl_clients_per_round` (0: the experiment's `clients_per_round`; under DP
  it must be). Stage 'group' (the experiment's rounds and cohort, T_g):
  per group, FedAvg from the FL model, cohorts among the group's clients,
  its server optimizer's state `server_state`: 'fresh' (a new optimizer
  state) or 'keep' (the FL stage's final state carried on: Adam's moments
  and step count, so its first group steps are not learning-rate sized),
  and its learning rate `group_server_lr` (0: the experiment's server
  learning rate). Each client is evaluated with its own group's model.
  `grouping`: 'task' (the task's groups), or a control: 'shuffled' (random
  groups of the same sizes), 'one' (one group of every client: FL
  continued with a fresh server optimizer).

  Example (what `binaries.train --algorithm=groupfl` runs):

    staged = build_groupfl_algorithm(task.model_fn_factory,
        client_optimizer=tff.learning.optimizers.build_sgdm(1.0),
        server_optimizer=tff.learning.optimizers.build_adam(0.03),
        fl_rounds=20)
  """
  del private_optimizer  # Nothing private.
  return _group_stages(
      model_fn_factory, personalize=False, fl_rounds=fl_rounds,
      fl_clients_per_round=fl_clients_per_round, grouping=grouping,
      server_state=server_state, group_server_lr=group_server_lr,
      embedding_dim=embedding_dim, client_optimizer=client_optimizer,
      server_optimizer=server_optimizer,
      aggregator_factory=aggregator_factory, metrics_fn=metrics_fn,
      train_metrics=train_metrics, seed=seed)


def build_groupperfl_algorithm(
    model_fn_factory, *,
    client_optimizer: tff.learning.optimizers.Optimizer,
    server_optimizer: tff.learning.optimizers.Optimizer,
    aggregator_factory=None, metrics_fn=None, train_metrics: bool = True,
    seed: Optional[int] = None, embedding_dim: int = 0,
    private_optimizer=None, fl_rounds: int = 20,
    fl_clients_per_round: int = 0, grouping: str = 'task',
    personalization_lr: float = 0.0,
    server_state: str = 'fresh', group_server_lr: float = 0.0
) -> stages.Staged:
  """GroupPerFL (Algorithms 1-3): GroupFL, then at evaluation each client
  fine-tunes its group's model on its own training data (one pass of the
  task's local epochs) and tests the result; nothing leaves the client.

  The fine-tuning is SGD at `personalization_lr` (the paper's), or with 0
  the experiment's private learning rate (Adam), else its client
  optimizer. The other options are `build_groupfl_algorithm`'s.
  """
  del private_optimizer  # personalization_lr, or the experiment's.
  return _group_stages(
      model_fn_factory, personalize=True, fl_rounds=fl_rounds,
      fl_clients_per_round=fl_clients_per_round, grouping=grouping,
      personalization_lr=personalization_lr, server_state=server_state,
      group_server_lr=group_server_lr, embedding_dim=embedding_dim,
      client_optimizer=client_optimizer,
      server_optimizer=server_optimizer,
      aggregator_factory=aggregator_factory, metrics_fn=metrics_fn,
      train_metrics=train_metrics, seed=seed)


def _data_type(model_fn):
  return tff.SequenceType(tff.types.tensorflow_to_type(
      process_lib.model_input_spec(model_fn)))


def build_client_updates(model_fn: split_model_lib.SplitModelFn,
                         optimizer: tff.learning.optimizers.Optimizer,
                         weights_type: tff.Type) -> tff.Computation:
  """`(ModelWeights@SERVER, D*@CLIENTS) -> update@CLIENTS` (no aggregation).

  The update a client would send in FL (initial minus trained weights), for
  clustering clients by the direction of their updates.
  """
  data_type = _data_type(model_fn)

  @tff.tensorflow.computation(weights_type, data_type)
  def client_update(weights, dataset):
    model = model_fn()
    train = tf.function(lambda w, d: split_training.local_train(
        model, optimizer, w, (), d))
    update, _, _, _ = train(weights, dataset)
    return update

  return federated_map.broadcast_map(
      client_update, weights_type, ('client_data', data_type))


def _chunks(items, size):
  items = list(items)
  for i in range(0, len(items), size):
    yield items[i:i + size]


def token_sums(output: Mapping[str, object]) -> dict[str, float]:
  """A client's evaluation outputs as the token sums `perplexity` pools.

  Args:
    output: a client's outputs (`runs.Run.client_outputs`), whose
      `outputs` are a word LM's per-example (sum of token NLLs, number of
      tokens) rows (`models.word_lm.per_example_nll`).

  Returns:
    `{'token_nll_sum': ..., 'tokens': ...}` over the client's examples.

  Example:
    sums = [token_sums(o) for o in run.client_outputs(ids)]
    perplexity(sums)
  """
  rows = np.asarray(output['outputs'], np.float64).reshape(-1, 2)
  return {'token_nll_sum': float(rows[:, 0].sum()),
          'tokens': float(rows[:, 1].sum())}


def perplexity(sums: Sequence[Mapping[str, float]],
               nll_key: str = 'token_nll_sum', count_key: str = 'tokens'
               ) -> float:
  """exp(total NLL / total tokens) over the given evaluation sums.

  Pooled over every target token of every evaluation sentence (speech), the
  usual corpus-level perplexity ("aggregated at sentence level": sentences
  of all clients together, not a mean of per-client perplexities).
  """
  nll = sum(s[nll_key] for s in sums)
  count = sum(s[count_key] for s in sums)
  if count <= 0:
    return float('nan')
  return float(np.exp(nll / count))


def communication_cost(participations: int) -> int:
  """Model-size transfers of one client: a download and an upload per round.

  Plus one download of the final model for inference (PerFL fine-tunes that
  download locally, so it costs the same as FL; as the paper's Table 4).
  """
  return 2 * participations + 1


def computation_cost(participations: int, local_epochs: int,
                     personalization_epochs: int = 0) -> int:
  """Local epochs of one client: K per round taken part in, plus K_l."""
  return participations * local_epochs + personalization_epochs
