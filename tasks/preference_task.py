"""FedEmbed-style preference tasks as the training loop sees them.

A task is federated data + a model builder + metrics + defaults. It builds
`tf.data` datasets and Keras model builders; it never builds TFF computations.
This class serves any preference data set with MNIST's `PreferenceData`
interface (`user_arrays`, `subpopulation`, `num_subpopulations`).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, Sequence

import numpy as np
import tensorflow as tf

from tasks import mnist_preference
from tff_personal.core import client_data
from tff_personal.core import evaluation
from tff_personal.core import split_model
from tff_personal.models import fedembed
from tff_personal.models import fedembed_mnist


def accuracy_sums(batch, logits):
  """Training-metric sums for binary preference logits (`accuracy_sum`)."""
  correct = tf.cast(tf.equal(tf.argmax(logits, axis=-1, output_type=tf.int32),
                             batch['y']), tf.float32)
  return collections.OrderedDict(accuracy_sum=tf.reduce_sum(correct))


def shuffle_seed(seed: int, round_num: int, client_id: int) -> int:
  """A per-(seed, round, client) shuffle seed, stable across runs."""
  return int(np.random.default_rng([seed, round_num, client_id]).integers(
      0, 2**31 - 1))


@dataclasses.dataclass
class PreferenceTask:
  """A preference task: users, their datasets, the model and the metrics."""
  name: str
  data: Any  # mnist_preference.PreferenceData or compatible.
  model_builder: Callable[..., split_model.SplitModel]
  batch_size: int = 10
  local_epochs: int = 1
  seed: int = 0

  def __post_init__(self):
    if self.local_epochs < 1:
      raise ValueError(f'local_epochs must be >= 1, got {self.local_epochs}')
    if self.batch_size < 1:
      raise ValueError(f'batch_size must be >= 1, got {self.batch_size}')

  @property
  def population(self) -> int:
    return self.data.num_users

  @property
  def element_spec(self):
    return mnist_preference.element_spec(self.batch_size)

  def model_fn_factory(self, embedding_dim: int) -> split_model.SplitModelFn:
    spec = self.element_spec
    return lambda: self.model_builder(embedding_dim, input_spec=spec)

  def fedembed_model_fn_factory(
      self, config: fedembed.FedEmbedConfig) -> split_model.SplitModelFn:
    config = fedembed.with_task_subpopulations(
        config, self.data.num_subpopulations)
    spec = self.element_spec
    return lambda: fedembed.build_fedembed_model(config, input_spec=spec)

  metrics_fn = staticmethod(accuracy_sums)
  # model_fn_factory(d > 0) adds a private personal embedding.
  supports_personal_embedding = True
  has_named_head = True  # the model's output layer is 'head'

  @property
  def wire_format(self) -> client_data.WireFormat | None:
    """How `train_batches` stores examples (None: in `element_spec` form)."""
    return None

  def _arrays(self, user: int, split: str):
    """One user's `(x, y, type)` of `split` in `wire_format`'s form."""
    return self.data.user_arrays(user, split)

  def _dataset(self, user: int, split: str, shuffle: int | None):
    return mnist_preference.client_dataset(
        self.data, user, split, self.batch_size, shuffle_seed=shuffle)

  def train_batches(self, client_ids: Sequence[int],
                    round_num: int) -> list[client_data.ClientBatches]:
    """Each client's local-training batches for a round, in visiting order.

    Every local epoch visits the client's training samples in a fresh
    permutation drawn from (seed, round, client): deterministic, so a resumed
    run trains on exactly what the uninterrupted run did.
    """
    out = []
    spec, wire = self.element_spec, self.wire_format
    for cid in client_ids:
      x, y, types = self._arrays(cid, 'train')
      rng = np.random.default_rng(shuffle_seed(self.seed, round_num, cid))
      orders = [rng.permutation(len(y)) for _ in range(self.local_epochs)]
      out.append(client_data.ClientBatches.from_arrays(
          collections.OrderedDict(x=x, y=y, type=types), self.batch_size,
          orders, spec, wire=wire))
    return out

  def train_datasets(self, client_ids: Sequence[int],
                     round_num: int) -> list[tf.data.Dataset]:
    """`train_batches` as `tf.data` datasets (one user per TFF client)."""
    return [b.to_dataset() for b in self.train_batches(client_ids, round_num)]

  def eval_datasets(self, client_ids: Sequence[int]) -> list[tf.data.Dataset]:
    return [self._dataset(cid, 'test', None) for cid in client_ids]

  def eval_batches(self, client_ids: Sequence[int]
                   ) -> list[client_data.ClientBatches]:
    """`eval_datasets` as numpy batches (the same batches, in order)."""
    spec, wire = self.element_spec, self.wire_format
    out = []
    for cid in client_ids:
      x, y, types = self._arrays(cid, 'test')
      out.append(client_data.ClientBatches.from_arrays(
          collections.OrderedDict(x=x, y=y, type=types), self.batch_size,
          [np.arange(len(y))], spec, wire=wire))
    return out

  def groups(self, client_ids: Sequence[int]) -> np.ndarray:
    return np.asarray(self.data.subpopulation)[np.asarray(client_ids)]

  def evaluate(self, per_client_outputs, client_ids) -> dict:
    return evaluation.preference_metrics(per_client_outputs,
                                         self.groups(client_ids))


def mnist_preference_task(data_dir: str | None, *, num_users: int = 9000,
                          population: str = 'balanced', seed: int = 0,
                          batch_size: int = 10,
                          local_epochs: int = 1,
                          activation: str = 'relu') -> PreferenceTask:
  """FedEmbed section 4.2: users who each prefer one MNIST digit."""
  data = mnist_preference.load_task_data(
      data_dir, num_users=num_users, population=population, seed=seed)
  builder = lambda dim, input_spec: fedembed_mnist.build_preference_model(
      dim, activation=activation, input_spec=input_spec)
  return PreferenceTask(name='mnist_preference', data=data,
                        model_builder=builder, batch_size=batch_size,
                        local_epochs=local_epochs, seed=seed)
