"""Per-FedAvg (Fallah et al., 2020): FedAvg of a model-agnostic meta-learner.

Every local step meta-trains the shared model w for one step of adaptation
(MAML) on the client's own data. With each batch split into two halves D
and D' (a one-example batch serves as both):

  1. adapt: `w' = w - alpha * grad f(w; D)` (the inner step, plain SGD);
  2. first-order (FO, the default): the meta-gradient is `grad f(w'; D')`;
     Hessian-free (HF, `hessian_free=True`): it is
     `(I - alpha * H f(w; D)) grad f(w'; D')`, the Hessian-vector product
     computed exactly by autodiff on D (the paper estimates it on a third
     batch; the halves keep each step's data at one batch);
  3. the client optimizer (the paper's beta) applies the meta-gradient to w.

The client sends `initial - final` of w, weighted by its D' examples, and the
server aggregates and applies it as in FedAvg (DP covers every weight).
Nothing is private during training. Evaluation is the paper's test-time
adaptation (Fallah et al. 2020, Sec. 5): each evaluated client copies the
global model, takes `test_steps` SGD steps at `inner_lr` (the step the model
was meta-trained for; one by default) on batches of its own training data,
and tests the copy; `test_steps=0` adapts for one whole local pass instead,
and a `fine_tune` strategy overrides either.

TF written here: TFF has no meta-learning client work. With `inner_lr=0`
the step is FedAvg's on the D' halves (tested).

Example:
  proc = registry.build_for_task('per_fedavg', task, client_optimizer=...,
                                 server_optimizer=..., inner_lr=0.01)
"""

from __future__ import annotations

from typing import Optional

import tensorflow as tf
import tensorflow_federated as tff

from tff_personal.algorithms import ditto
from tff_personal.algorithms import personal_head_training as steps
from tff_personal.core import process as process_lib
from tff_personal.core import split_model as split_model_lib
from tff_personal.core import split_training


def halves(batch):
  """`(D, D')`: a batch's first and second halves (a batch of one example
  is both)."""
  n = tf.shape(tf.nest.flatten(batch)[0])[0]
  h = tf.maximum(n // 2, 1)
  first = tf.nest.map_structure(lambda t: t[:h], batch)
  second = tf.nest.map_structure(lambda t: t[tf.minimum(h, n - 1):], batch)
  return first, second


def _hessian_vector(model, variables, batch, vector):
  """H f(w; batch) @ vector, by differentiating grad f . vector."""
  with tf.GradientTape() as outer:
    grads, _, _ = steps.gradients(model, variables, batch)
    dot = tf.add_n([tf.reduce_sum(g * tf.stop_gradient(v))
                    for g, v in zip(grads, vector)])
  hvp = outer.gradient(dot, variables)
  return [tf.zeros_like(v) if h is None else tf.convert_to_tensor(h)
          for h, v in zip(hvp, variables)]


def per_fedavg_local_train(model: split_model_lib.SplitModel,
                           optimizer: tff.learning.optimizers.Optimizer,
                           initial_weights, dataset: tf.data.Dataset,
                           inner_lr: float, hessian_free: bool = False,
                           metrics_fn=None):
  """Per-FedAvg's local pass (module docstring); returns what
  `core/split_training.local_train` returns. The model has no private
  variables; its metrics are those of the adapted model on D'."""
  split_training.assign_weights(model, initial_weights, ())
  variables = list(model.shared_trainable_variables)

  def reduce_fn(state, batch):
    opt_state = state[3]
    first, second = halves(batch)
    start = [v.read_value() for v in variables]
    grads, _, _ = steps.gradients(model, variables, first)
    with tf.control_dependencies(grads):
      for v, w, g in zip(variables, start, grads):
        v.assign(w - inner_lr * g)
    meta, outputs, loss = steps.gradients(model, variables, second)
    with tf.control_dependencies(meta):
      for v, w in zip(variables, start):
        v.assign(w)
    if hessian_free:
      hvp = _hessian_vector(model, variables, first, meta)
      meta = [m - inner_lr * h for m, h in zip(meta, hvp)]
    opt_state, updated = optimizer.next(opt_state, tuple(start), tuple(meta))
    for v, u in zip(variables, updated):
      v.assign(u)
    return steps.accumulate(model, metrics_fn, state, second, outputs,
                            loss) + (opt_state,)

  num_examples, loss_sum, sums = steps.reduce_batches(
      model, dataset, metrics_fn, optimizer, variables, reduce_fn)
  return steps.step_result(model, initial_weights, (), num_examples,
                           loss_sum, sums)


def per_fedavg_client_step_factory(model_fn, optimizer, inner_lr: float,
                                   hessian_free: bool, metrics_fn=None):
  """`core.process.ClientStepFactory` of Per-FedAvg's local pass."""

  def make_step():
    model = model_fn()

    def step(weights, client_state, dataset):
      update, weight, _, metrics = per_fedavg_local_train(
          model, optimizer, weights, dataset, inner_lr, hessian_free,
          metrics_fn)
      return process_lib.client_step_result(update, weight, (), client_state,
                                            metrics)

    return step

  return make_step


def build_per_fedavg(model_fn_factory, *,
                     client_optimizer: tff.learning.optimizers.Optimizer,
                     server_optimizer: tff.learning.optimizers.Optimizer,
                     aggregator_factory=None, metrics_fn=None,
                     train_metrics: bool = True, seed: Optional[int] = None,
                     embedding_dim: int = 0, private_optimizer=None,
                     inner_lr: float = 0.01, hessian_free: bool = False,
                     test_steps: int = 1,
                     ) -> process_lib.StatefulClientProcess:
  """Builds Per-FedAvg (module docstring).

  Args:
    model_fn_factory: the task's `embedding_dim -> model_fn`.
    client_optimizer: the meta-step's optimizer (the paper's beta).
    server_optimizer: applied to the aggregated update.
    aggregator_factory: `tff.aggregators` factory (default weighted mean).
    metrics_fn: per-batch training-metric sums.
    train_metrics: release training-metric sums.
    seed: initialisation seed.
    embedding_dim: must be 0 (nothing is private).
    private_optimizer: unused (the evaluation adapts with SGD at
      `inner_lr`).
    inner_lr: the adaptation step alpha (0.01, as in the public
      re-implementations; the paper tunes it per data set).
    hessian_free: the HF variant (module docstring); default FO.
    test_steps: the evaluation's adaptation steps (the paper's: 1); 0: one
      whole pass over the client's training data.

  Returns:
    A `StatefulClientProcess` that declares its fine-tuned evaluation.
  """
  del private_optimizer  # The evaluation adapts at inner_lr.
  if embedding_dim:
    raise ValueError('per_fedavg meta-trains the whole model; it takes no '
                     f'personal embedding (got {embedding_dim})')
  if inner_lr < 0:
    raise ValueError(f'per_fedavg inner_lr must be >= 0, got {inner_lr}')
  if test_steps < 0:
    raise ValueError(f'per_fedavg test_steps must be >= 0, got {test_steps}')
  model_fn = model_fn_factory(0)
  with tf.Graph().as_default():
    if model_fn().private_variables:
      raise ValueError('per_fedavg needs a model without private variables')
  weights = process_lib.initial_shared_weights(model_fn, seed)
  return process_lib.build_step_process(
      model_fn, per_fedavg_client_step_factory(
          model_fn, client_optimizer, inner_lr, hessian_free, metrics_fn),
      initial_weights=weights,
      client_state_type=process_lib.split_client_state_type(model_fn),
      server_optimizer=server_optimizer,
      aggregator_factory=aggregator_factory, train_metrics=train_metrics,
      eval_model_fn=ditto.all_private(model_fn),
      eval_private_fn=lambda w: tuple(w.trainable),
      eval_client_state_type=ditto.personal_state_type(weights.trainable),
      eval_fine_tune=True,
      eval_fine_tune_optimizer=tff.learning.optimizers.build_sgdm(inner_lr),
      eval_fine_tune_steps=test_steps or None)
