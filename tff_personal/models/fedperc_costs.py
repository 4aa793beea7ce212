"""On-device costs of FedPerC models: pass times and per-user memory.

A *train pass* is one local step on a batch: forward, backward and an Adam
update of what the variant trains on device (the generated variant: its
shared generators; the others: the user's private state or, for the head
baseline, the head). A *test pass* scores the batch (the generated variant
first generates its embeddings). Every model is timed in one process,
interleaved round-robin after a warm-up, so load on a shared machine hits
all alike. Memory is what a user holds beyond the frozen backbone
(`FedPercModel.per_user_parameters`), at 4 bytes a parameter.

Example:
  costs = fedperc_costs.pass_costs(
      spec, {'fedperc': fedperc.FedPercConfig(variant='embedding', ...)},
      batch, repeats=20)
  costs['fedperc']['train_ms'], costs['fedperc']['bytes_per_user']
"""

from __future__ import annotations

import time
from typing import Mapping

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_personal.models import fedperc
from tff_personal.models import fedperc_training


def _passes(model: fedperc.FedPercModel, batch, prompt_tokens: int):
  """(train pass, test pass) of `model` on `batch`, as tf.functions."""
  variant = model.config.variant
  if variant == fedperc.GENERATED:
    variables = list(model.shared_trainable_variables)
    loss_fn = lambda: fedperc_training.generated_step_loss(model, batch)[0]
  else:
    variables = ([model.personal_offset, model.context_embeddings]
                 if variant == fedperc.EMBEDDING else
                 [model.personal_head, model.context_heads]
                 if variant == fedperc.SPLIT else [model.head])
    loss_fn = lambda: model.loss(batch)
  optimizer = tff.learning.optimizers.build_adam(1e-3)
  opt_state = optimizer.initialize(
      tuple(tf.TensorSpec(v.shape, v.dtype) for v in variables))

  def train_pass():
    with tf.GradientTape() as tape:
      loss = loss_fn()
    grads = tape.gradient(loss, variables)
    _, updated = optimizer.next(opt_state, tuple(variables), tuple(grads))
    for v, u in zip(variables, updated):
      v.assign(u)
    return loss

  def test_pass():
    if variant == fedperc.GENERATED:
      fedperc_training.generate_embeddings(model, batch)
    return model.nll(batch, prompt_tokens)[0]

  return tf.function(train_pass), tf.function(test_pass)


def pass_costs(spec, configs: Mapping[str, fedperc.FedPercConfig], batch,
               *, repeats: int, seed: int = 0, warmup: int = 3,
               prompt_tokens: int = 3) -> dict[str, dict[str, float]]:
  """Train / test pass time and per-user memory of each named model.

  Args:
    spec: the backbone (`fedperc_backbone.BackboneSpec`); its weights are
      loaded into every model.
    configs: name -> the model's `FedPercConfig`.
    batch: a dict of tensors (a batch of the task's examples).
    repeats: timed passes of each kind per model.
    seed: the models' initialisation seed.
    warmup: untimed passes first (tracing).
    prompt_tokens: tokens given as a prompt in the test pass.

  Returns:
    name -> {'train_ms', 'train_ms_std', 'test_ms', 'test_ms_std' (mean and
    std over the repeats), 'parameters_per_user', 'bytes_per_user'}.
  """
  passes, out = {}, {}
  for name, config in configs.items():
    model = fedperc.FedPercModel(spec, config, seed)
    model.backbone.set_weights(spec.weights)
    passes[name] = _passes(model, batch, prompt_tokens)
    parameters = model.per_user_parameters()
    out[name] = dict(parameters_per_user=parameters,
                     bytes_per_user=4 * parameters)
  for _ in range(warmup):
    for fns in passes.values():
      for fn in fns:
        fn().numpy()
  times = {name: ([], []) for name in configs}
  for _ in range(repeats):
    for name, fns in passes.items():  # Round-robin.
      for kept, fn in zip(times[name], fns):
        start = time.perf_counter()
        fn().numpy()
        kept.append(1000 * (time.perf_counter() - start))
  for name, (train, test) in times.items():
    out[name].update(train_ms=float(np.mean(train)),
                     train_ms_std=float(np.std(train)),
                     test_ms=float(np.mean(test)),
                     test_ms_std=float(np.std(test)))
  return out
