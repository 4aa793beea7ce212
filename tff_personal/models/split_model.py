"""A Keras model whose variables are split into shared and private parts.

The split is declared by the model builder, not by the algorithm: a builder
returns a `SplitModel` that names which variables are private (client state
that never leaves the device: a personal embedding, a personal head) and the
rest of the model's variables are shared (aggregated by the server).

Builders are called inside TFF's TensorFlow computations, so they must create
a fresh Keras model (and fresh variables) on every call, as
`tff.learning.models.from_keras_model` requires of its `model_fn`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import tensorflow as tf

Batch = Mapping[str, tf.Tensor]
# loss_fn(batch, model_outputs) -> scalar mean loss over the batch.
LossFn = Callable[[Batch, Any], tf.Tensor]


@dataclasses.dataclass
class SplitModel:
  """A Keras model plus the declaration of which variables are private.

  Attributes:
    model: maps `batch['x']` to the model outputs (logits for classifiers).
    private_variables: the variables that are client state. Must be a subset
      of `model.trainable_variables`, or empty (then the model is an ordinary
      federated model and every algorithm built on it reduces to FedAvg).
    loss_fn: scalar training loss of a batch given the model outputs.
    input_spec: the (batched) element spec of the client datasets.
  """
  model: tf.keras.Model
  private_variables: Sequence[tf.Variable]
  loss_fn: LossFn
  input_spec: Any

  def __post_init__(self):
    trainable_refs = {v.ref() for v in self.model.trainable_variables}
    for v in self.private_variables:
      if v.ref() not in trainable_refs:
        raise ValueError(
            f'Private variable {v.name!r} is not a trainable variable of the '
            'model; private variables must be trainable model variables.')
    if len({v.ref() for v in self.private_variables}) != len(
        self.private_variables):
      raise ValueError('A private variable is listed twice.')

  @property
  def shared_trainable_variables(self) -> list[tf.Variable]:
    private = {v.ref() for v in self.private_variables}
    return [v for v in self.model.trainable_variables
            if v.ref() not in private]

  @property
  def shared_non_trainable_variables(self) -> list[tf.Variable]:
    return list(self.model.non_trainable_variables)

  def forward(self, batch: Batch, training: bool) -> Any:
    return self.model(batch['x'], training=training)

  def loss(self, batch: Batch, outputs: Any) -> tf.Tensor:
    loss = self.loss_fn(batch, outputs)
    if self.model.losses:
      loss += tf.add_n(self.model.losses)
    return loss


SplitModelFn = Callable[[], SplitModel]


def shared_weights_spec(model: SplitModel):
  """Specs of the shared weights, as `(trainable, non_trainable)` tuples."""
  spec = lambda v: tf.TensorSpec(v.shape, v.dtype)
  return (tuple(spec(v) for v in model.shared_trainable_variables),
          tuple(spec(v) for v in model.shared_non_trainable_variables))


def private_weights_spec(model: SplitModel):
  return tuple(tf.TensorSpec(v.shape, v.dtype) for v in model.private_variables)
