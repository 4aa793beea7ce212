"""`ditto`: personal models regularized toward the global one (Li et al. 2021).

Ditto (Algorithm 1 of "Ditto: Fair and Robust Federated Learning Through
Personalization") as a `StatefulClientProcess`. On each sampled client k,
with the broadcast global weights w:

* the global part is FedAvg's local training of a copy of w on the client's
  data (`core/split_training.local_train` on a model without private
  variables); its update is averaged weighted by examples;
* the personal model v_k (the client state; it never leaves the client)
  takes the same number of local steps on
  F_k(v) + lambda / 2 * ||v - w||^2, regularized toward the *broadcast* w
  (Ditto's w^t, not the locally updated copy).

A client's personal model starts as the initial global weights
(`initial_client_state`), as in Ditto's reference code. Evaluation uses the
personal model: `build_personal_eval` (each client evaluates its v_k).
The personal loop is written here (TF, `personal_train`) because TFF has no
proximal personal-model client work; the TFF wiring is `build_ditto`.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_personal.core import batched as batched_lib
from tff_personal.core import evaluation
from tff_personal.core import process as process_lib
from tff_personal.core import split_model as split_model_lib
from tff_personal.core import split_training

ModelWeights = tff.learning.models.ModelWeights


# ------------------------------------------------------------- TensorFlow


def personal_train(model: split_model_lib.SplitModel,
                   optimizer: tff.learning.optimizers.Optimizer,
                   global_weights, personal_weights, dataset: tf.data.Dataset,
                   lam: float):
  """Local steps on F_k(v) + lam/2 ||v - w||^2; returns (new v, loss sum)."""
  variables = model.model.trainable_variables
  for var, value in zip(variables, personal_weights):
    var.assign(value)
  specs = tuple(tf.TensorSpec(v.shape, v.dtype) for v in variables)

  def reduce_fn(state, batch):
    loss_sum, opt_state = state
    with tf.GradientTape() as tape:
      loss = model.loss(batch, model.forward(batch, training=True))
      proximal = tf.add_n([tf.reduce_sum(tf.square(v - w))
                           for v, w in zip(variables, global_weights)])
      objective = loss + 0.5 * lam * proximal
    grads = tape.gradient(objective, variables)
    opt_state, updated = optimizer.next(opt_state, tuple(variables),
                                        tuple(grads))
    for var, value in zip(variables, updated):
      var.assign(value)
    n = tf.cast(tf.shape(batch['y'])[0], tf.float32)
    return loss_sum + loss * n, opt_state

  loss_sum, _ = dataset.reduce(
      (tf.constant(0.0), optimizer.initialize(specs)), reduce_fn)
  return tuple(v.read_value() for v in variables), loss_sum


# -------------------------------------------------------------------- TFF


def all_private(model_fn: split_model_lib.SplitModelFn
                ) -> split_model_lib.SplitModelFn:
  """The same model with every trainable variable private (a personal model)."""

  def fn():
    model = model_fn()
    if model.model.non_trainable_variables:
      raise ValueError('personal models need a model without non-trainable '
                       'variables')
    return dataclasses.replace(
        model, private_variables=list(model.model.trainable_variables))

  return fn


def empty_weights() -> ModelWeights:
  return ModelWeights(trainable=(), non_trainable=())


def personal_state_type(weights) -> tff.Type:
  """Client state holding a personal model shaped like `weights`.

  `weights`: numpy arrays or `tff.TensorType`s.
  """
  as_type = lambda w: (w if isinstance(w, tff.TensorType) else
                       tff.TensorType(np.asarray(w).dtype, np.shape(w)))
  return tff.types.to_type(collections.OrderedDict([
      (process_lib.CLIENT_STATE_PRIVATE, tuple(as_type(w) for w in weights)),
      (process_lib.CLIENT_STATE_ROUNDS, np.int32)]))


def initial_client_state(global_weights) -> collections.OrderedDict:
  """A personal model equal to the given (initial) global weights."""
  return collections.OrderedDict([
      (process_lib.CLIENT_STATE_PRIVATE,
       tuple(np.asarray(w) for w in global_weights)),
      (process_lib.CLIENT_STATE_ROUNDS, np.int32(0))])


def ditto_client_step_factory(
    model_fn: split_model_lib.SplitModelFn,
    client_optimizer: tff.learning.optimizers.Optimizer,
    personal_optimizer: tff.learning.optimizers.Optimizer, lam: float,
    metrics_fn=None) -> process_lib.ClientStepFactory:
  """Ditto's per-user step: FedAvg's local pass, then the personal pass.

  The client state's private part is the personal model v_k (every
  trainable variable of `model_fn()`'s model). The step has a batched form
  (`core/batched.py`'s `BATCHED_TRAINER`) for the models `BatchedModel`
  covers, which `--simulation_batched` runs.
  """

  def make_step():
    global_model = model_fn()
    personal_model = model_fn()

    def step(global_weights, client_state, dataset):
      personal = tuple(client_state[process_lib.CLIENT_STATE_PRIVATE])
      update, weight, _, metrics = split_training.local_train(
          global_model, client_optimizer, global_weights, (), dataset,
          metrics_fn)
      # The personal pass reads the data after the global one (with a
      # reshuffling dataset, unordered passes would race for the orders).
      with tf.control_dependencies(tf.nest.flatten(update)):
        new_personal, personal_loss = personal_train(
            personal_model, personal_optimizer, global_weights.trainable,
            personal, dataset, lam)
      finite = tf.reduce_all(tf.stack(
          [tf.reduce_all(tf.math.is_finite(p)) for p in new_personal]))
      new_personal = tuple(tf.where(finite, n, o)
                           for n, o in zip(new_personal, personal))
      metrics['personal_loss_sum'] = tf.where(finite, personal_loss, 0.0)
      return process_lib.client_step_result(
          update, weight, new_personal, client_state, metrics)

    return step

  def batched_trainer():
    batched = batched_lib.BatchedModel(model_fn())

    def train(weights, private, shard, decode):
      broadcast = tuple(weights.trainable)
      out = batched_lib.batched_local_train(
          batched, client_optimizer, broadcast, shard, metrics_fn, decode)
      personal = batched_lib.batched_local_train(
          batched, personal_optimizer, broadcast, shard, decode=decode,
          proximal=(lam, broadcast), stacked=private)
      metrics = collections.OrderedDict(out.metrics)
      metrics['personal_loss_sum'] = tf.reduce_sum(personal.loss_sum)
      return out._replace(metrics=metrics, new_private=personal.new_private)

    return train

  # `core/batched.py` runs a shard's users together with it: both passes
  # are `batched_local_train`, the personal one from each user's own model.
  setattr(make_step, batched_lib.BATCHED_TRAINER, batched_trainer)
  return make_step


def build_ditto(model_fn: split_model_lib.SplitModelFn, *,
                lam: float = 0.1,
                client_optimizer: Optional[tff.learning.optimizers.Optimizer] = None,
                personal_optimizer: Optional[tff.learning.optimizers.Optimizer] = None,
                server_optimizer: Optional[tff.learning.optimizers.Optimizer] = None,
                aggregator_factory=None, train_metrics: bool = True,
                metrics_fn=None,
                seed: Optional[int] = 0) -> process_lib.StatefulClientProcess:
  """Ditto on a model without private variables (e.g. appendix G's CNN).

  Args:
    model_fn: the model; every variable shared (the personal model is a
      private copy of all of them).
    lam: Ditto's lambda; 0 trains the personal model alone, and as lambda
      grows it is held at the global model.
    client_optimizer: the global model's local optimizer (Adam 1e-3).
    personal_optimizer: the personal model's (default `client_optimizer`).
    server_optimizer: applied to the mean update (SGD lr 1: FedAvg).
    aggregator_factory: any `tff.aggregators` factory (DP included) for the
      global update; the personal model is never aggregated.
    train_metrics: release training-metric sums.
    metrics_fn: optional per-batch metric sums of the global pass.
    seed: initialisation seed.

  Returns:
    A `StatefulClientProcess` whose client state is the personal model and
    whose `model_fn` evaluates it (every variable private, so the broadcast
    weights load into none). A new client's personal model is the initial
    global model (`initial_private`), as in Ditto's reference code.
  """
  if lam < 0:
    raise ValueError(f'Ditto lambda must be >= 0, got {lam}')
  client_optimizer = (client_optimizer or
                      tff.learning.optimizers.build_adam(1e-3))
  personal_optimizer = personal_optimizer or client_optimizer
  server_optimizer = (server_optimizer or
                      tff.learning.optimizers.build_sgdm(1.0))
  with tf.Graph().as_default():
    if model_fn().private_variables:
      raise ValueError('ditto needs a model without private variables; the '
                       'personal model is the whole model')
  weights = process_lib.initial_shared_weights(model_fn, seed)
  if weights.non_trainable:
    raise ValueError('ditto needs a model without non-trainable variables')
  return process_lib.build_step_process(
      model_fn, ditto_client_step_factory(
          model_fn, client_optimizer, personal_optimizer, lam, metrics_fn),
      initial_weights=weights,
      client_state_type=personal_state_type(weights.trainable),
      server_optimizer=server_optimizer,
      aggregator_factory=aggregator_factory, train_metrics=train_metrics,
      eval_model_fn=all_private(model_fn),
      initial_private=tuple(weights.trainable),
      global_private_fn=lambda w: tuple(w.trainable))


def build_ditto_algorithm(model_fn_factory, *,
                          client_optimizer: tff.learning.optimizers.Optimizer,
                          server_optimizer: tff.learning.optimizers.Optimizer,
                          aggregator_factory=None, metrics_fn=None,
                          train_metrics: bool = True,
                          seed: Optional[int] = None, embedding_dim: int = 0,
                          private_optimizer=None, lam: float = 0.1
                          ) -> process_lib.StatefulClientProcess:
  """`build_ditto` on a task's model (`registry`'s uniform signature).

  The task's model without a personal embedding is the global model;
  `private_optimizer` (default `client_optimizer`) trains the personal one.
  """
  if embedding_dim:
    raise ValueError('ditto\'s personal model is a whole copy of the model; '
                     f'it takes no personal embedding (got {embedding_dim})')
  return build_ditto(model_fn_factory(0), lam=lam,
                     client_optimizer=client_optimizer,
                     personal_optimizer=private_optimizer,
                     server_optimizer=server_optimizer,
                     aggregator_factory=aggregator_factory,
                     train_metrics=train_metrics, metrics_fn=metrics_fn,
                     seed=seed)


def build_personal_model_eval(model_fn: split_model_lib.SplitModelFn,
                              process: process_lib.StatefulClientProcess):
  """Evaluation of each client's personal model (its state) on its data.

    (<ModelWeights()@SERVER, {C}@CLIENTS, {D*}@CLIENTS> -> {<outputs, labels>}@CLIENTS)

  Call with `empty_weights()` as the server value.
  """
  return evaluation.build_personal_eval(
      all_private(model_fn), process_lib.model_weights_type(empty_weights()),
      process.client_state_type)
