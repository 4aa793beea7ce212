"""FedBABU (Oh et al., 2022): the body trained under a fixed random head,
the whole model fine-tuned at evaluation.

Training: the task model's head layer is frozen at its (seeded, shared)
initialisation; each client trains only the body for one local pass and
sends the body's update, which the server aggregates (DP covers exactly the
body: the head is no trainable weight, so no update or noise ever reaches
it) and applies. Nothing is private during training.

Evaluation: as FedAvg+FT's (`fedavg_ft`), every evaluated client copies the
global model, head included, fine-tunes all of it for one local pass on its
own training data and tests the copy (`eval_fine_tune`); nothing leaves the
client. FedBABU's paper fine-tunes the entire model; the fine-tuning
optimizer is the experiment's private one (default: the client optimizer).

With `head_layer=None` nothing is frozen: FedAvg+FT exactly (tested).

Example:
  proc = registry.build_for_task('fedbabu', task, client_optimizer=...,
                                 server_optimizer=...)
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_personal.algorithms import ditto
from tff_personal.algorithms import fedavg_ft
from tff_personal.core import process as process_lib
from tff_personal.core import split_model as split_model_lib
from tff_personal.models import personal_head


def frozen_head_model_fn(model_fn: split_model_lib.SplitModelFn,
                         head_layer: str) -> split_model_lib.SplitModelFn:
  """`model_fn`'s model with the `head_layer` layer not trainable: its
  weights become shared non-trainable ones (broadcast, never updated)."""

  def fn():
    base = model_fn()
    personal_head.named_layer(base.model, head_layer).trainable = False
    return base

  return fn


def full_order(model_fn: split_model_lib.SplitModelFn, head_layer: str
               ) -> Callable[[process_lib.ModelWeights], tuple]:
  """`weights -> tuple`: the frozen-head model's (trainable, non-trainable)
  weights in the order of the unfrozen model's trainable variables (the
  evaluation's personal copy)."""
  with tf.Graph().as_default():
    base = model_fn()
    order = list(base.model.trainable_variables)
    personal_head.named_layer(base.model, head_layer).trainable = False
    where = {v.ref(): ('trainable', i)
             for i, v in enumerate(base.model.trainable_variables)}
    where.update({v.ref(): ('non_trainable', i)
                  for i, v in enumerate(base.model.non_trainable_variables)})
    slots = [where[v.ref()] for v in order]

  def to_full(weights):
    return tuple(getattr(weights, part)[i] for part, i in slots)

  return to_full


def build_fedbabu(model_fn_factory, *,
                  client_optimizer: tff.learning.optimizers.Optimizer,
                  server_optimizer: tff.learning.optimizers.Optimizer,
                  aggregator_factory=None, metrics_fn=None,
                  train_metrics: bool = True, seed: Optional[int] = None,
                  embedding_dim: int = 0, private_optimizer=None,
                  head_layer: Optional[str] = 'head',
                  ) -> process_lib.StatefulClientProcess:
  """Builds FedBABU (module docstring).

  Args:
    model_fn_factory: the task's `embedding_dim -> model_fn`.
    client_optimizer: local optimizer of the body.
    server_optimizer: applied to the aggregated body update.
    aggregator_factory: `tff.aggregators` factory (default weighted mean).
    metrics_fn: per-batch training-metric sums.
    train_metrics: release training-metric sums.
    seed: initialisation seed (the fixed head's too).
    embedding_dim: must be 0 (the evaluation fine-tunes a whole copy).
    private_optimizer: unused (the evaluation's optimizer is the
      experiment's private one).
    head_layer: the layer kept at its initialisation during training (None:
      none, which is FedAvg+FT).

  Returns:
    A `StatefulClientProcess` that declares its fine-tuned evaluation.
  """
  del private_optimizer  # The evaluation's optimizer is the experiment's.
  if embedding_dim:
    raise ValueError('fedbabu fine-tunes a copy of the whole model; it takes '
                     f'no personal embedding (got {embedding_dim})')
  model_fn = model_fn_factory(0)
  if head_layer is None:
    return fedavg_ft.build_fedavg_ft(
        model_fn, client_optimizer=client_optimizer,
        server_optimizer=server_optimizer,
        aggregator_factory=aggregator_factory, seed=seed,
        metrics_fn=metrics_fn, train_metrics=train_metrics)
  with tf.Graph().as_default():
    if model_fn().private_variables:
      raise ValueError('fedbabu needs a model without private variables')
  frozen = frozen_head_model_fn(model_fn, head_layer)
  weights = process_lib.initial_shared_weights(frozen, seed)
  to_full = full_order(model_fn, head_layer)
  return process_lib.build_step_process(
      frozen, process_lib.split_client_step_factory(
          frozen, client_optimizer, metrics_fn),
      initial_weights=weights,
      client_state_type=process_lib.split_client_state_type(frozen),
      server_optimizer=server_optimizer,
      aggregator_factory=aggregator_factory, train_metrics=train_metrics,
      eval_model_fn=ditto.all_private(model_fn),
      eval_private_fn=to_full,
      eval_client_state_type=ditto.personal_state_type(
          [np.asarray(w) for w in to_full(weights)]),
      eval_fine_tune=True)
