"""kNN-Per (Marfoq et al., 2022): the global model's features plus a local
kNN memory at evaluation.

Training is FedAvg (nothing private). At evaluation each client builds a
memory of its own training examples, as the global model's features (the
input of the task model's head layer) and labels (`KnnModel.prepare_fn`,
the evaluator's fine-tuning pass, which here trains nothing), and predicts

  p(y | x) = lam * p_kNN(y | x) + (1 - lam) * softmax(logits(x)),
  p_kNN(y | x) ∝ sum over the k nearest stored features f_i of
                 exp(-||f(x) - f_i||^2 / temperature) [y_i = y];

its outputs are `log p` (class scores for the task's metrics). The memory
never leaves the client; it holds the first `capacity` examples the pass
reads. A client with no training example is served the global model.

For classifiers whose outputs are [batch, classes] and whose labels are
class indices. With `lam=0` the evaluation is FedAvg's (tested).

The kNN is written here (TF): neither TFF nor Keras has one.

Example:
  proc = registry.build_for_task('knn_per', task, client_optimizer=...,
                                 server_optimizer=..., neighbors=10)
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_personal.core import process as process_lib
from tff_personal.core import split_model as split_model_lib
from tff_personal.models import personal_head


class _Memory(tf.keras.Model):
  """Holds the feature model and the client's memory (its variables)."""

  def __init__(self, features_model, capacity: int, dim: int):
    super().__init__()
    self.features_model = features_model
    self.keys = self.add_weight(name='keys', shape=(capacity, dim),
                                initializer='zeros', trainable=False)
    self.labels = self.add_weight(name='labels', shape=(capacity,),
                                  dtype=tf.int32, initializer='zeros',
                                  trainable=False)
    self.count = self.add_weight(name='count', shape=(), dtype=tf.int32,
                                 initializer='zeros', trainable=False)


@dataclasses.dataclass
class KnnModel(split_model_lib.SplitModel):
  """The task model whose predictions mix in a kNN over a private memory."""
  memory: Any = None
  neighbors: int = 10
  lam: float = 0.5
  temperature: float = 1.0

  def forward(self, batch, training: bool) -> Any:
    features, logits = self.memory.features_model(batch['x'],
                                                  training=training)
    probs = tf.nn.softmax(logits)
    count = self.memory.count.read_value()
    capacity = self.memory.keys.shape[0]
    distances = (tf.reduce_sum(tf.square(features), -1, keepdims=True)
                 - 2.0 * tf.matmul(features, self.memory.keys, transpose_b=True)
                 + tf.reduce_sum(tf.square(self.memory.keys), -1)[None, :])
    distances = tf.maximum(distances, 0.0)
    stored = tf.range(capacity) < count
    scores = tf.where(stored[None, :], -distances / self.temperature,
                      -np.inf)
    top, index = tf.math.top_k(scores, k=min(self.neighbors, capacity))
    weights = tf.where(tf.math.is_finite(top), tf.exp(top - top[:, :1]), 0.0)
    votes = tf.one_hot(tf.gather(self.memory.labels.read_value(), index),
                       tf.shape(logits)[-1])
    knn = tf.reduce_sum(weights[..., None] * votes, 1)
    knn = knn / tf.maximum(tf.reduce_sum(knn, -1, keepdims=True), 1e-12)
    mixed = tf.where(count > 0, self.lam * knn + (1 - self.lam) * probs,
                     probs)
    return tf.math.log(tf.maximum(mixed, 1e-12))


def knn_model_fn(model_fn: split_model_lib.SplitModelFn, head_layer: str,
                 capacity: int, neighbors: int, lam: float,
                 temperature: float) -> split_model_lib.SplitModelFn:
  """kNN-Per's evaluation model over `model_fn`'s (module docstring)."""

  def fn():
    base = model_fn()
    if base.private_variables:
      raise ValueError('knn_per needs a model without private variables')
    head = personal_head.named_layer(base.model, head_layer)
    both = tf.keras.Model(base.model.inputs, [head.input, base.model.output])
    if len(both.outputs[1].shape) != 2:
      raise ValueError('knn_per needs a classifier with [batch, classes] '
                       f'outputs; the task model gives {both.outputs[1].shape}')
    memory = _Memory(both, capacity, int(both.outputs[0].shape[-1]))
    model = KnnModel(
        model=memory,
        private_variables=[memory.keys, memory.labels, memory.count],
        loss_fn=base.loss_fn, input_spec=base.input_spec, memory=memory,
        neighbors=neighbors, lam=lam, temperature=temperature)

    def prepare_fn(dataset):
      def add(state, batch):
        keys, labels, count = state
        features, _ = both(batch['x'], training=False)
        rows = count + tf.range(tf.shape(features)[0])
        keep = rows < capacity
        rows = tf.boolean_mask(rows, keep)[:, None]
        keys = tf.tensor_scatter_nd_update(
            keys, rows, tf.boolean_mask(features, keep))
        labels = tf.tensor_scatter_nd_update(
            labels, rows, tf.boolean_mask(tf.cast(batch['y'], tf.int32),
                                          keep))
        return keys, labels, count + tf.shape(rows)[0]

      keys, labels, count = dataset.reduce(
          (tf.zeros_like(memory.keys), tf.zeros_like(memory.labels),
           tf.constant(0)), add)
      memory.keys.assign(keys)
      memory.labels.assign(labels)
      memory.count.assign(count)

    model.prepare_fn = prepare_fn
    return model

  return fn


def build_knn_per(model_fn_factory, *,
                  client_optimizer: tff.learning.optimizers.Optimizer,
                  server_optimizer: tff.learning.optimizers.Optimizer,
                  aggregator_factory=None, metrics_fn=None,
                  train_metrics: bool = True, seed: Optional[int] = None,
                  embedding_dim: int = 0, private_optimizer=None,
                  head_layer: str = 'head', neighbors: int = 10,
                  lam: float = 0.5, temperature: float = 1.0,
                  capacity: int = 512) -> process_lib.StatefulClientProcess:
  """Builds kNN-Per (module docstring).

  Args:
    model_fn_factory: the task's `embedding_dim -> model_fn`.
    client_optimizer, server_optimizer, aggregator_factory, metrics_fn,
      train_metrics, seed: FedAvg's training.
    embedding_dim: must be 0.
    private_optimizer: unused (the memory is not trained).
    head_layer: the layer whose input is the features.
    neighbors: k.
    lam: the kNN's weight in the mixture (the paper tunes it per client on
      validation data; 0.5 here).
    temperature: the kernel's temperature over squared distances.
    capacity: the most examples a client's memory holds.

  Returns:
    A `StatefulClientProcess` (FedAvg) that declares kNN-Per's evaluation.
  """
  del private_optimizer  # Nothing is trained at evaluation.
  if embedding_dim:
    raise ValueError(f'knn_per takes no personal embedding (got '
                     f'{embedding_dim})')
  if not 0.0 <= lam <= 1.0:
    raise ValueError(f'knn_per lam must be in [0, 1], got {lam}')
  if neighbors < 1 or capacity < 1 or not temperature > 0:
    raise ValueError('knn_per needs neighbors >= 1, capacity >= 1 and '
                     'temperature > 0')
  model_fn = model_fn_factory(0)
  weights = process_lib.initial_shared_weights(model_fn, seed)
  eval_fn = knn_model_fn(model_fn, head_layer, capacity, neighbors, lam,
                         temperature)
  with tf.Graph().as_default():
    memory = [tff.TensorType(v.dtype.as_numpy_dtype, v.shape)
              for v in eval_fn().private_variables]
  empty = tuple(np.zeros(t.shape, t.dtype) for t in memory)
  return process_lib.build_step_process(
      model_fn, process_lib.split_client_step_factory(
          model_fn, client_optimizer, metrics_fn),
      initial_weights=weights,
      client_state_type=process_lib.split_client_state_type(model_fn),
      server_optimizer=server_optimizer,
      aggregator_factory=aggregator_factory, train_metrics=train_metrics,
      eval_model_fn=eval_fn, eval_private_fn=lambda w: empty,
      eval_client_state_type=tff.types.to_type(collections.OrderedDict([
          (process_lib.CLIENT_STATE_PRIVATE, tuple(memory)),
          (process_lib.CLIENT_STATE_ROUNDS, np.int32)])),
      eval_fine_tune=True,
      eval_fine_tune_optimizer=tff.learning.optimizers.build_sgdm(0.0))
