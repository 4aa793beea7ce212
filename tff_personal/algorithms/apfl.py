"""APFL (Deng et al., 2020): each client's model is a learned mixture of a
local model and the global one.

A client keeps a personal model v (a whole copy of the task model) and a
mixing weight alpha in [0, 1] as private state; its personalized model is
the parameter mixture `alpha * v + (1 - alpha) * w` with the current global
model w. Each local step on a batch (APFL's Algorithm 1):

  * the local copy of w takes FedAvg's step on f(w);
  * v takes a step on f(alpha v + (1 - alpha) w) with respect to v (its
    gradient is alpha times the mixture's), w held at its pre-step value;
  * with `adaptive_alpha`, alpha takes an SGD step of `alpha_lr` on the
    same loss (gradient `<grad f(mixture), v - w>`), clipped to [0, 1].

The client sends w's update (`initial - final`), aggregated and applied as
FedAvg's (DP covers exactly w); v and alpha never leave it. A new client's
v starts as the initial global model and its alpha at `alpha`.
Evaluation tests each client's mixture with the current global model
(`MixtureModel.forward`); the evaluator's fine-tuning leaves it unchanged
(the personal model is the client state, as in Ditto).

The mixture's step is written here (TF): TFF has no mixture client work.
The global model's trajectory is FedAvg's whatever alpha (tested); with
alpha fixed at 0 the personalized model is the global one, and with alpha
fixed at 1 v trains alone on the client's data.

Example:
  proc = registry.build_for_task('apfl', task, client_optimizer=...,
                                 server_optimizer=..., alpha=0.25)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_personal.algorithms import personal_head_training as steps
from tff_personal.core import process as process_lib
from tff_personal.core import split_model as split_model_lib
from tff_personal.core import split_training


class _Pair(tf.keras.Model):
  """Holds the global and the personal model and alpha (their variables)."""

  def __init__(self, global_model, personal_model, alpha: float):
    super().__init__()
    self.global_model = global_model
    self.personal_model = personal_model
    self.alpha = self.add_weight(
        name='alpha', shape=(), trainable=True,
        initializer=tf.keras.initializers.Constant(alpha))


@dataclasses.dataclass
class MixtureModel(split_model_lib.SplitModel):
  """A split model whose shared part is the global model G, whose private
  part is a personal model P and alpha, and whose outputs are those of
  `alpha * P + (1 - alpha) * G` (computed in a third copy, M, whose
  variables are neither shared nor private)."""
  global_model: Any = None
  personal_model: Any = None
  mixed_model: Any = None
  alpha: Any = None

  def mix(self) -> None:
    """Sets M's variables to the current mixture."""
    a = self.alpha.read_value()
    for m, p, g in zip(self.mixed_model.model.trainable_variables,
                       self.personal_model.model.trainable_variables,
                       self.global_model.model.trainable_variables):
      m.assign(a * p + (1.0 - a) * g)

  def forward(self, batch, training: bool) -> Any:
    self.mix()
    return self.mixed_model.forward(batch, training)


def mixture_model_fn(model_fn: split_model_lib.SplitModelFn,
                     alpha: float) -> split_model_lib.SplitModelFn:
  """APFL's model over `model_fn`'s (which must have no private and no
  non-trainable variables)."""

  def fn():
    g, p, m = model_fn(), model_fn(), model_fn()
    if g.private_variables or g.model.non_trainable_variables:
      raise ValueError('apfl mixes whole models: the task model must have '
                       'no private and no non-trainable variables')
    pair = _Pair(g.model, p.model, alpha)
    return MixtureModel(
        model=pair,
        private_variables=list(p.model.trainable_variables) + [pair.alpha],
        loss_fn=g.loss_fn, input_spec=g.input_spec, predict_fn=g.predict_fn,
        eval_fn=g.eval_fn, global_model=g, personal_model=p, mixed_model=m,
        alpha=pair.alpha)

  return fn


def apfl_local_train(model: MixtureModel,
                     optimizer: tff.learning.optimizers.Optimizer,
                     personal_optimizer: tff.learning.optimizers.Optimizer,
                     initial_weights, private_weights, dataset: tf.data.Dataset,
                     adaptive_alpha: bool, alpha_lr: float, metrics_fn=None):
  """APFL's local pass (module docstring); returns what
  `core/split_training.local_train` returns. Metrics are the mixture's."""
  split_training.assign_weights(model, initial_weights, private_weights)
  g_vars = list(model.global_model.model.trainable_variables)
  p_vars = list(model.personal_model.model.trainable_variables)
  m_vars = list(model.mixed_model.model.trainable_variables)

  def reduce_fn(state, batch):
    g_state, p_state = state[3]
    g_grads, _, _ = steps.gradients(model.global_model, g_vars, batch)
    a = model.alpha.read_value()
    g_start = [v.read_value() for v in g_vars]
    p_start = [v.read_value() for v in p_vars]
    with tf.control_dependencies(g_grads):
      for m, p, g in zip(m_vars, p_start, g_start):
        m.assign(a * p + (1.0 - a) * g)
    m_grads, outputs, loss = steps.gradients(model.mixed_model, m_vars, batch)
    g_state, g_new = optimizer.next(g_state, tuple(g_start), tuple(g_grads))
    p_state, p_new = personal_optimizer.next(
        p_state, tuple(p_start), tuple(a * x for x in m_grads))
    for v, x in zip(g_vars + p_vars, list(g_new) + list(p_new)):
      v.assign(x)
    if adaptive_alpha:
      alpha_grad = tf.add_n([tf.reduce_sum(x * (p - g)) for x, p, g in
                             zip(m_grads, p_start, g_start)])
      model.alpha.assign(tf.clip_by_value(a - alpha_lr * alpha_grad,
                                          0.0, 1.0))
    return steps.accumulate(model, metrics_fn, state, batch, outputs,
                            loss) + ((g_state, p_state),)

  num_examples, loss_sum, sums, _ = dataset.reduce(
      (tf.constant(0, tf.int64), tf.constant(0.0),
       steps.metric_zeros(model, dataset, metrics_fn),
       (optimizer.initialize(steps.variable_specs(g_vars)),
        personal_optimizer.initialize(steps.variable_specs(p_vars)))),
      reduce_fn)
  return steps.step_result(model, initial_weights, private_weights,
                           num_examples, loss_sum, sums)


def apfl_client_step_factory(model_fn, optimizer, personal_optimizer,
                             adaptive_alpha: bool, alpha_lr: float,
                             metrics_fn=None):
  """`core.process.ClientStepFactory` of APFL's local pass."""

  def make_step():
    model = model_fn()

    def step(weights, client_state, dataset):
      update, weight, new_private, metrics = apfl_local_train(
          model, optimizer, personal_optimizer, weights,
          tuple(client_state[process_lib.CLIENT_STATE_PRIVATE]), dataset,
          adaptive_alpha, alpha_lr, metrics_fn)
      return process_lib.client_step_result(update, weight, new_private,
                                            client_state, metrics)

    return step

  return make_step


def build_apfl(model_fn_factory, *,
               client_optimizer: tff.learning.optimizers.Optimizer,
               server_optimizer: tff.learning.optimizers.Optimizer,
               aggregator_factory=None, metrics_fn=None,
               train_metrics: bool = True, seed: Optional[int] = None,
               embedding_dim: int = 0, private_optimizer=None,
               alpha: float = 0.5, adaptive_alpha: bool = True,
               alpha_lr: float = 0.01) -> process_lib.StatefulClientProcess:
  """Builds APFL (module docstring).

  Args:
    model_fn_factory: the task's `embedding_dim -> model_fn`.
    client_optimizer: the local optimizer of the global model's copy.
    server_optimizer: applied to the aggregated update.
    aggregator_factory: `tff.aggregators` factory (default weighted mean).
    metrics_fn: per-batch training-metric sums (of the mixture).
    train_metrics: release training-metric sums.
    seed: initialisation seed.
    embedding_dim: must be 0 (the personal model is a whole copy).
    private_optimizer: the personal model's optimizer (default
      `client_optimizer`).
    alpha: a new client's mixing weight of its personal model (the paper
      tries 0.25, 0.5 and 0.75 and learns it; 0.5 here).
    adaptive_alpha: learn alpha per client (APFL's adaptive variant).
    alpha_lr: alpha's SGD learning rate.

  Returns:
    A `StatefulClientProcess` whose client state is (v, alpha).
  """
  if embedding_dim:
    raise ValueError('apfl\'s personal model is a whole copy of the model; '
                     f'it takes no personal embedding (got {embedding_dim})')
  if not 0.0 <= alpha <= 1.0:
    raise ValueError(f'apfl alpha must be in [0, 1], got {alpha}')
  base_fn = model_fn_factory(0)
  model_fn = mixture_model_fn(base_fn, alpha)
  weights = process_lib.initial_shared_weights(model_fn, seed)
  return process_lib.build_step_process(
      model_fn, apfl_client_step_factory(
          model_fn, client_optimizer, private_optimizer or client_optimizer,
          adaptive_alpha, alpha_lr, metrics_fn),
      initial_weights=weights,
      client_state_type=process_lib.split_client_state_type(model_fn),
      server_optimizer=server_optimizer,
      aggregator_factory=aggregator_factory, train_metrics=train_metrics,
      initial_private=tuple(weights.trainable) + (np.float32(alpha),),
      # A new user's personal model as the global one, at the initial alpha.
      global_private_fn=lambda w: tuple(w.trainable) + (np.float32(alpha),))
