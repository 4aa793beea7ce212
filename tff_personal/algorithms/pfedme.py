"""pFedMe (Dinh et al., 2020): personal models regularised by Moreau envelopes.

A FedEmbed baseline, as FedEmbed's Table 1 describes it: "a shared feature
encoder with personal model heads regularized to minimize parameter
difference from a global model head". The model
(`models/personal_head.personal_copy_model_fn`) is the task's model, whose
head w is shared (the global head), plus a private personal head theta
(client state) on the same features. Per batch the client solves pFedMe's
inner problem for theta and takes an outer step of its local copy of the
global model along the Moreau envelope's gradient
(`personal_head_training.pfedme_local_train`). The server's "beta mixing"
`w <- (1 - beta) w + beta mean(w_local)` is server SGD with learning rate beta
on the model delta `w - w_local` (TFF's sign convention); pass `beta` to get
it, otherwise the given server optimizer is used. DP covers every shared
parameter (encoder and global head).

Readings: only the head is personal (a full personal model per user would
cost 440 kB of client state per user, 4 GB for FedEmbed's 9,000 users, and
FedEmbed describes personal heads); a client's personal head starts from the
global head at its first participation (`rounds_participated == 0`) and is
then kept, warm-starting the inner solver; the inner solver is plain gradient
descent with `inner_learning_rate` (pFedMe's "personal learning rate"), or
`private_optimizer` when given (its state restarts every batch).

`restart_personal_head=True` (`pfedme_restart`, `build_pfedme_restart`) runs
it as the authors' code does (CharlieDinh/pFedMe, `userbase.set_parameters`:
each round sets the personal model to the new global model): theta starts
from the broadcast global head every round, warm-starting only across one
round's batches, and evaluation starts theta from the current global head
(`StatefulClientProcess.eval_private_fn`), so a user's personal head never
outlives a round. FedEmbed does not say which form it ran; under DP the two
differ (a kept theta is trained on the user's data alone across rounds and
never noised; a restarted one starts from the noised global head).

Limits (tested): as lambda -> infinity with inner steps at rate 1/lambda,
theta -> w and the envelope gradient -> the plain gradient, so pFedMe tends
to FedAvg of the task model.
"""

from __future__ import annotations

import inspect
from typing import Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_personal.algorithms import personal_head_training
from tff_personal.core import process as process_lib
from tff_personal.core import split_model as split_model_lib
from tff_personal.models import personal_head


def pfedme_client_step_factory(model_fn: split_model_lib.SplitModelFn,
                               optimizer, inner_optimizer, *, lam: float,
                               inner_steps: int, head_layer: str,
                               metrics_fn=None,
                               restart_personal_head: bool = False):
  """`core.process.ClientStepFactory` of pFedMe's local update (theta from
  the global head at a client's first round, or every round with
  `restart_personal_head`)."""

  def make_step():
    model = model_fn()
    global_head = model.model.get_layer(head_layer).trainable_weights
    positions = _global_head_positions(model, head_layer)

    def step(weights, client_state, dataset):
      w_values = tuple(weights.trainable[i] for i in positions)
      if restart_personal_head:
        theta = w_values
      else:
        stored = tuple(client_state[process_lib.CLIENT_STATE_PRIVATE])
        first = tf.equal(client_state[process_lib.CLIENT_STATE_ROUNDS], 0)
        theta = tuple(tf.where(first, g, t) for g, t in zip(w_values, stored))
      update, weight, new_private, metrics = (
          personal_head_training.pfedme_local_train(
              model, optimizer, inner_optimizer, weights, theta, dataset,
              global_head=global_head, lam=lam, inner_steps=inner_steps,
              metrics_fn=metrics_fn))
      return process_lib.client_step_result(
          update, weight, new_private, client_state, metrics)

    return step

  return make_step


def build_pfedme(model_fn_factory, *,
                 client_optimizer: tff.learning.optimizers.Optimizer,
                 server_optimizer: tff.learning.optimizers.Optimizer,
                 aggregator_factory=None, metrics_fn=None,
                 train_metrics: bool = True, seed: Optional[int] = None,
                 embedding_dim: int = 0, private_optimizer=None,
                 lam: float = 1.0, inner_steps: int = 5,
                 inner_learning_rate: float = 0.05,
                 beta: Optional[float] = None, head_layer: str = 'head',
                 restart_personal_head: bool = False,
                 ) -> process_lib.StatefulClientProcess:
  """Builds pFedMe (module docstring).

  Args:
    model_fn_factory: the task's `embedding_dim -> model_fn`.
    client_optimizer: outer optimizer (encoder and local global head).
    server_optimizer: used unless `beta` is given.
    aggregator_factory: `tff.aggregators` factory (default weighted mean).
    metrics_fn: per-batch training-metric sums.
    train_metrics: release training-metric sums.
    seed: initialisation seed.
    embedding_dim: must be 0 (pFedMe personalises the head only).
    private_optimizer: the inner solver (default: SGD at
      `inner_learning_rate`).
    lam: lambda, the strength of the pull of theta to w (> 0). Default 1
      rather than pFedMe's MNIST value 15: on the MNIST preference task
      conflicting labels make the global head a poor anchor
      (docs/papers/fedembed_notes.md).
    inner_steps: inner solver steps per batch (>= 1).
    inner_learning_rate: the inner SGD's learning rate.
    beta: pFedMe's server mixing; sets the server optimizer to SGD(beta).
    head_layer: the task model's head layer.
    restart_personal_head: theta restarts from the global head every round
      and at evaluation (the authors' code; module docstring); default: kept
      between rounds.
  """
  if embedding_dim:
    raise ValueError(f'pfedme has no personal embedding; embedding_dim must '
                     f'be 0, got {embedding_dim}')
  if lam <= 0 or inner_steps < 1 or inner_learning_rate <= 0:
    raise ValueError('pfedme needs lam > 0, inner_steps >= 1 and '
                     f'inner_learning_rate > 0; got lam={lam}, '
                     f'inner_steps={inner_steps}, '
                     f'inner_learning_rate={inner_learning_rate}')
  if beta is not None:
    if beta <= 0:
      raise ValueError(f'beta must be positive, got {beta}')
    server_optimizer = tff.learning.optimizers.build_sgdm(learning_rate=beta)
  model_fn = personal_head.personal_copy_model_fn(
      model_fn_factory(0), lam, head_layer)
  inner = private_optimizer or tff.learning.optimizers.build_sgdm(
      learning_rate=inner_learning_rate)
  make_step = pfedme_client_step_factory(
      model_fn, client_optimizer, inner, lam=lam, inner_steps=inner_steps,
      head_layer=head_layer, metrics_fn=metrics_fn,
      restart_personal_head=restart_personal_head)
  return process_lib.build_split_step_process(
      model_fn, make_step, server_optimizer=server_optimizer,
      aggregator_factory=aggregator_factory, train_metrics=train_metrics,
      seed=seed, eval_private_fn=(_global_head_fn(model_fn, head_layer)
                                  if restart_personal_head else None),
      global_private_fn=_global_head_fn(model_fn, head_layer))


def build_pfedme_restart(model_fn_factory, **kwargs
                         ) -> process_lib.StatefulClientProcess:
  """pFedMe whose personal head restarts from the global head every round
  (the authors' code; module docstring). Arguments as `build_pfedme`."""
  return build_pfedme(model_fn_factory, restart_personal_head=True, **kwargs)


# What `build_pfedme_restart` accepts (read by `registry.algorithm_options`).
_SIGNATURE = inspect.signature(build_pfedme)
build_pfedme_restart.__signature__ = _SIGNATURE.replace(parameters=[
    p for p in _SIGNATURE.parameters.values()
    if p.name != 'restart_personal_head'])


def _global_head_positions(model, head_layer: str) -> list[int]:
  """Where the global head w sits in the shared trainable weights, in
  theta's order."""
  index = {v.ref(): i for i, v in enumerate(model.shared_trainable_variables)}
  return [index[v.ref()]
          for v in model.model.get_layer(head_layer).trainable_weights]


def _global_head_fn(model_fn, head_layer: str):
  """Shared weights -> the global head w, in theta's order."""
  with tf.Graph().as_default():
    model = model_fn()
    positions = _global_head_positions(model, head_layer)
    private_shapes = [tuple(v.shape) for v in
                      model.private_trainable_variables]

  def global_head(weights):
    head = tuple(np.asarray(weights.trainable[i]) for i in positions)
    if [h.shape for h in head] != private_shapes:
      raise ValueError(f'global head shapes {[h.shape for h in head]} differ '
                       f'from the personal head\'s {private_shapes}')
    return head

  return global_head
