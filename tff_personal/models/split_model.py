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
from typing import Any, Callable, Mapping, Optional, Sequence

import tensorflow as tf

Batch = Mapping[str, tf.Tensor]
# loss_fn(batch, model_outputs) -> scalar mean loss over the batch.
LossFn = Callable[[Batch, Any], tf.Tensor]


@dataclasses.dataclass
class SplitModel:
  """A Keras model plus the declaration of which variables are private.

  Attributes:
    model: maps `batch['x']` to the model outputs (logits for classifiers, or
      a dict of outputs whose prediction `predict_fn` picks).
    private_variables: the variables that are client state: trainable ones
      (a personal embedding, a personal head) are optimised locally;
      non-trainable ones (e.g. a sub-population assignment) are set by
      `prepare_fn`. Must be variables of `model`, or empty (then the model is
      an ordinary federated model and every algorithm built on it reduces to
      FedAvg).
    loss_fn: scalar training loss of a batch given the model outputs.
    input_spec: the (batched) element spec of the client datasets.
    predict_fn: model outputs -> the prediction tensor evaluation reports;
      default: the outputs themselves.
    prepare_fn: optional `(dataset) -> None`, run on the client before local
      training with the client's weights loaded (e.g. FedEmbed's
      sub-population assignment from the client's own data).
  """
  model: tf.keras.Model
  private_variables: Sequence[tf.Variable]
  loss_fn: LossFn
  input_spec: Any
  predict_fn: Optional[Callable[[Any], tf.Tensor]] = None
  prepare_fn: Optional[Callable[[tf.data.Dataset], Any]] = None

  def __post_init__(self):
    refs = {v.ref() for v in self.model.variables}
    for v in self.private_variables:
      if v.ref() not in refs:
        raise ValueError(
            f'Private variable {v.name!r} is not a variable of the model.')
    if len({v.ref() for v in self.private_variables}) != len(
        self.private_variables):
      raise ValueError('A private variable is listed twice.')

  @property
  def _private_refs(self):
    return {v.ref() for v in self.private_variables}

  @property
  def shared_trainable_variables(self) -> list[tf.Variable]:
    private = self._private_refs
    return [v for v in self.model.trainable_variables
            if v.ref() not in private]

  @property
  def shared_non_trainable_variables(self) -> list[tf.Variable]:
    private = self._private_refs
    return [v for v in self.model.non_trainable_variables
            if v.ref() not in private]

  @property
  def private_trainable_variables(self) -> list[tf.Variable]:
    return [v for v in self.private_variables if v.trainable]

  def forward(self, batch: Batch, training: bool) -> Any:
    return self.model(batch['x'], training=training)

  def predict(self, outputs: Any) -> tf.Tensor:
    return outputs if self.predict_fn is None else self.predict_fn(outputs)

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
