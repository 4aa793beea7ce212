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


@dataclasses.dataclass(frozen=True)
class PrivateNoise:
  """Gaussian noise on each local pass's change of a personal head.

  The change of the noised private variables (`SplitModel.
  noised_private_variables`, jointly) is clipped to L2 norm `clip_norm` and
  gets noise of standard deviation `noise_multiplier * clip_norm` per
  coordinate: the Gaussian mechanism of a one-user aggregate. Used to read
  FedEmbed's Algorithm 1 (line 22: every gradient a client computes is
  noised, personal embeddings excepted); `core/private_noise.py`.
  """
  clip_norm: float
  noise_multiplier: float

  def __post_init__(self):
    if not self.clip_norm > 0:
      raise ValueError(f'PrivateNoise.clip_norm must be > 0, got '
                       f'{self.clip_norm}')
    if not self.noise_multiplier >= 0:
      raise ValueError('PrivateNoise.noise_multiplier must be >= 0, got '
                       f'{self.noise_multiplier}')


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
    predict_fn: model outputs -> the prediction tensor evaluation reports
      and training metrics see; default: the outputs themselves.
    eval_fn: optional `(batch, outputs) -> tensor`, what evaluation reports
      per example when it needs the batch's targets to be small (e.g. a
      language model's per-speech token NLL sum and token count instead of
      its logits); default `predict_fn(outputs)`.
    prepare_fn: optional `(dataset) -> None`, run on the client before local
      training with the client's weights loaded (e.g. FedEmbed's
      sub-population assignment from the client's own data).
    embedding_variables: the private variables that are personal embeddings
      (FedEmbed section 3.2: updated locally without noise, so exempt from
      `private_noise`). A subset of `private_variables`.
    private_noise: None (default: private state is never noised; it never
      leaves the device), or a `PrivateNoise`: every local pass (training and
      evaluation fine-tuning) clips the change of the private trainable
      variables other than `embedding_variables` (a personal head) and adds
      Gaussian noise to it (`core/private_noise.py`).
    loss_terms_fn: optional `(batch, outputs) -> float [n, 2]`, `loss_fn`
      as pooled per-example terms: each example's (numerator, weight), the
      batch loss their summed numerators over their summed weights (at
      least 1), e.g. a language model's token NLL sum and token count.
      Batched training (`core/batched.py`) needs it for a loss that is not
      the mean over examples of a per-example loss.
  """
  model: tf.keras.Model
  private_variables: Sequence[tf.Variable]
  loss_fn: LossFn
  input_spec: Any
  predict_fn: Optional[Callable[[Any], tf.Tensor]] = None
  eval_fn: Optional[Callable[[Batch, Any], tf.Tensor]] = None
  prepare_fn: Optional[Callable[[tf.data.Dataset], Any]] = None
  embedding_variables: Sequence[tf.Variable] = ()
  private_noise: Optional['PrivateNoise'] = None
  loss_terms_fn: Optional[Callable[[Batch, Any], tf.Tensor]] = None

  def __post_init__(self):
    refs = {v.ref() for v in self.model.variables}
    for v in self.private_variables:
      if v.ref() not in refs:
        raise ValueError(
            f'Private variable {v.name!r} is not a variable of the model.')
    if len({v.ref() for v in self.private_variables}) != len(
        self.private_variables):
      raise ValueError('A private variable is listed twice.')
    private = self._private_refs
    for v in self.embedding_variables:
      if v.ref() not in private:
        raise ValueError(f'Embedding variable {v.name!r} is not a private '
                         'variable of the model.')

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

  @property
  def noised_private_variables(self) -> list[tf.Variable]:
    """The private variables `private_noise` noises: the trainable ones
    other than personal embeddings (none when `private_noise` is None)."""
    if self.private_noise is None:
      return []
    embeddings = {v.ref() for v in self.embedding_variables}
    return [v for v in self.private_trainable_variables
            if v.ref() not in embeddings]

  def forward(self, batch: Batch, training: bool) -> Any:
    return self.model(batch['x'], training=training)

  def predict(self, outputs: Any) -> tf.Tensor:
    return outputs if self.predict_fn is None else self.predict_fn(outputs)

  def eval_output(self, batch: Batch, outputs: Any) -> tf.Tensor:
    """What evaluation reports per example (`eval_fn`, else `predict`)."""
    if self.eval_fn is None:
      return self.predict(outputs)
    return self.eval_fn(batch, outputs)

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
