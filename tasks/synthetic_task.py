"""A generated task of any population: the whole loop at population scale.

Each user's examples are drawn on demand from (seed, user id), so a task of
a million users holds nothing per user: a user exists once sampled. A user
has `examples` training and as many evaluation examples of `features`
standard normal features; its label is whether the features' projection on
the shared direction plus the user's own direction is positive, so a
personal embedding can learn the user's part. The model: the features (and
the personal embedding, if any) through a dense layer of 16 to two logits
(`head`).

What it is for: `binaries.benchmark --population_scale` runs the one loop
(`binaries.train --task=synthetic --num_users=N`) at 10,000 and 1,000,000
users with the SQLite
client-state store and compares round time and peak memory
(docs/scale.md). The numbers mean nothing as learning results.

Example:

  task = synthetic_task('', num_users=1_000_000, seed=0)
  batches = task.train_batches([3, 999_999], round_num=1)
"""

from __future__ import annotations

import collections
from typing import Optional, Sequence

import numpy as np
import tensorflow as tf

from tasks import client_data_task
from tff_personal.core import client_data
from tff_personal.core import split_model
from tff_personal.models import fedembed_mnist

_TRAIN, _EVAL, _DIRECTION = 0, 1, 2


class SyntheticTask:
  """The generated task (module docstring); build with `synthetic_task`."""

  name = 'synthetic'
  supports_personal_embedding = True
  has_named_head = True

  def __init__(self, population: int, examples: int, features: int,
               batch_size: int, local_epochs: int, seed: int):
    if population < 1:
      raise ValueError(f'population must be >= 1, got {population}')
    if examples < 1 or features < 1:
      raise ValueError('examples and features must be >= 1, got '
                       f'{examples} and {features}')
    if batch_size < 1 or local_epochs < 1:
      raise ValueError('batch_size and local_epochs must be >= 1')
    self._population = population
    self.examples = examples
    self.features = features
    self.batch_size = batch_size
    self.local_epochs = local_epochs
    self.seed = seed
    self._shared = np.random.default_rng([seed, _DIRECTION]).normal(
        size=features)
    # A batch's spec (what the model takes and a TFF client's data holds).
    self.element_spec = collections.OrderedDict(
        x=tf.TensorSpec([None, features], tf.float32),
        y=tf.TensorSpec([None], tf.int32))

  @property
  def population(self) -> int:
    return self._population

  def _check_ids(self, client_ids: Sequence[int]) -> list[int]:
    ids = [int(c) for c in client_ids]
    bad = [c for c in ids if not 0 <= c < self._population]
    if bad:
      raise ValueError(f'client ids {bad[:5]} are outside the population '
                       f'[0, {self._population})')
    return ids

  def _arrays(self, user: int, split: int) -> collections.OrderedDict:
    own = np.random.default_rng([self.seed, user, _DIRECTION]).normal(
        size=self.features)
    x = np.random.default_rng([self.seed, user, split]).normal(
        size=(self.examples, self.features)).astype(np.float32)
    y = (x @ (self._shared + own) > 0).astype(np.int32)
    return collections.OrderedDict(x=x, y=y)

  def model_fn_factory(self, embedding_dim: int):
    """`embedding_dim -> SplitModelFn`: the dense model, with a private
    personal embedding of that size when it is positive."""
    features = self.features

    def model_fn() -> split_model.SplitModel:
      x = tf.keras.Input(shape=(features,), name='x')
      inputs, private = x, []
      if embedding_dim:
        personal = fedembed_mnist.PersonalEmbedding(embedding_dim,
                                                    name='personal')
        inputs = tf.keras.layers.Concatenate()([x, personal(x)])
        private = [personal.embedding]
      hidden = tf.keras.layers.Dense(16, activation='relu')(inputs)
      logits = tf.keras.layers.Dense(2, name='head')(hidden)
      return split_model.SplitModel(
          model=tf.keras.Model(inputs=x, outputs=logits),
          private_variables=private, loss_fn=client_data_task.sparse_ce,
          input_spec=self.element_spec,
          embedding_variables=private)

    return model_fn

  def metrics_fn(self, batch, outputs):
    return client_data_task.accuracy_sums(batch, outputs)

  def train_batches(self, client_ids: Sequence[int], round_num: int
                    ) -> list[client_data.ClientBatches]:
    out = []
    for user in self._check_ids(client_ids):
      rng = np.random.default_rng([self.seed, user, round_num])
      orders = [rng.permutation(self.examples)
                for _ in range(self.local_epochs)]
      out.append(client_data.ClientBatches.from_arrays(
          self._arrays(user, _TRAIN), self.batch_size, orders,
          self.element_spec))
    return out

  def train_datasets(self, client_ids: Sequence[int], round_num: int
                     ) -> list[tf.data.Dataset]:
    return [b.to_dataset() for b in self.train_batches(client_ids, round_num)]

  def eval_batches(self, client_ids: Sequence[int]
                   ) -> list[client_data.ClientBatches]:
    order = [np.arange(self.examples)]
    return [client_data.ClientBatches.from_arrays(
        self._arrays(user, _EVAL), self.batch_size, order, self.element_spec)
            for user in self._check_ids(client_ids)]

  def eval_datasets(self, client_ids: Sequence[int]) -> list[tf.data.Dataset]:
    return [b.to_dataset() for b in self.eval_batches(client_ids)]

  def evaluate(self, per_client_outputs, client_ids) -> dict:
    return client_data_task.classification_metrics(per_client_outputs,
                                                   client_ids)


def synthetic_task(data_dir: Optional[str], *, num_users: int = 1_000_000,
                   examples: int = 20, features: int = 8, batch_size: int = 10,
                   local_epochs: int = 1, seed: int = 0) -> SyntheticTask:
  """Builds the generated task (module docstring); `data_dir` is unused."""
  del data_dir  # Nothing is read.
  return SyntheticTask(num_users, examples, features, batch_size,
                       local_epochs, seed)
