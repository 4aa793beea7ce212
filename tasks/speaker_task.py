"""The `speaker_context` task as the training loop sees it (FURL's analogue).

Client ids 0..W-1 are the users that take part in training ("warm"); a
seeded `cold_fraction` of the users is held out of training entirely and
evaluated with cold start (their documented initial embedding plus a few
local steps on their own training documents; FURL's stated future work).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Sequence

import numpy as np
import tensorflow as tf

from tasks import preference_task
from tasks import speaker_context
from tff_personal.core import client_data
from tff_personal.core import evaluation
from tff_personal.core import split_model
from tff_personal.models import furl_text


@dataclasses.dataclass
class SpeakerTask:
  """Users, their document datasets, the FURL document model, metrics."""
  data: speaker_context.SpeakerData
  model_config: furl_text.DocumentModelConfig
  batch_size: int = 16
  local_epochs: int = 1
  seed: int = 0
  cold_fraction: float = 0.1
  name: str = 'speaker_context'

  def __post_init__(self):
    if not 0.0 <= self.cold_fraction < 1.0:
      raise ValueError(
          f'cold_fraction must be in [0, 1), got {self.cold_fraction}')
    if self.local_epochs < 1:
      raise ValueError(f'local_epochs must be >= 1, got {self.local_epochs}')
    rng = np.random.default_rng([self.seed, 0xC01D])
    order = rng.permutation(self.data.num_users)
    num_cold = int(round(self.cold_fraction * self.data.num_users))
    warm = np.sort(order[num_cold:])
    cold = np.sort(order[:num_cold])
    # Client id -> user index: warm users first, then the cold ones.
    self._users = np.concatenate([warm, cold])
    self.cold_client_ids = list(range(len(warm), self.data.num_users))

  @property
  def population(self) -> int:
    """Users that take part in training."""
    return self.data.num_users - len(self.cold_client_ids)

  @property
  def element_spec(self):
    return speaker_context.element_spec(self.data.max_chars)

  def user_of(self, client_id: int) -> int:
    return int(self._users[client_id])

  def model_fn_factory(self, embedding_dim: int) -> split_model.SplitModelFn:
    config = dataclasses.replace(self.model_config,
                                 user_embedding_dim=embedding_dim)
    spec = self.element_spec
    return lambda: furl_text.build_federated_model(config, input_spec=spec)

  metrics_fn = staticmethod(furl_text.accuracy_sums)
  # model_fn_factory(d > 0) adds a private personal embedding.
  supports_personal_embedding = True

  def _dataset(self, cid: int, split: str, shuffle: int | None = None):
    return speaker_context.client_dataset(
        self.data, self.user_of(cid), split, self.batch_size,
        shuffle_seed=shuffle)

  def train_batches(self, client_ids: Sequence[int],
                    round_num: int) -> list[client_data.ClientBatches]:
    """Each client's local-training batches for a round, in visiting order.

    Every local epoch visits the user's documents in a fresh permutation
    drawn from (seed, round, client), so resumed runs repeat exactly.
    """
    out = []
    for cid in client_ids:
      x, y = self.data.arrays(self.user_of(cid), 'train')
      rng = np.random.default_rng(
          preference_task.shuffle_seed(self.seed, round_num, cid))
      orders = [rng.permutation(len(y)) for _ in range(self.local_epochs)]
      out.append(client_data.ClientBatches.from_arrays(
          collections.OrderedDict(x=x, y=y), self.batch_size, orders,
          self.element_spec))
    return out

  def train_datasets(self, client_ids: Sequence[int],
                     round_num: int) -> list[tf.data.Dataset]:
    """`train_batches` as `tf.data` datasets (one user per TFF client)."""
    return [b.to_dataset() for b in self.train_batches(client_ids, round_num)]

  def eval_datasets(self, client_ids: Sequence[int]) -> list[tf.data.Dataset]:
    return [self._dataset(cid, 'eval') for cid in client_ids]

  def test_datasets(self, client_ids: Sequence[int]) -> list[tf.data.Dataset]:
    return [self._dataset(cid, 'test') for cid in client_ids]

  def cold_start_datasets(self, client_ids: Sequence[int], epochs: int):
    train = [self._dataset(cid, 'train', shuffle=cid).repeat(epochs)
             for cid in client_ids]
    return train, self.test_datasets(client_ids)

  def pooled(self, client_ids: Sequence[int], split: str, batch_size: int,
             shuffle_seed: int | None = None) -> tf.data.Dataset:
    """The clients' documents pooled for centralized training: batches of
    `x`, `y` and `user` (the client id), shuffled when `shuffle_seed` is
    given."""
    xs, ys, users = [], [], []
    for cid in client_ids:
      x, y = self.data.arrays(self.user_of(cid), split)
      xs.append(x)
      ys.append(y)
      users.append(np.full(len(y), cid, np.int32))
    ds = tf.data.Dataset.from_tensor_slices(collections.OrderedDict(
        x=np.concatenate(xs), y=np.concatenate(ys).astype(np.int32),
        user=np.concatenate(users)))
    if shuffle_seed is not None:
      ds = ds.shuffle(sum(len(y) for y in ys), seed=shuffle_seed)
    return ds.batch(batch_size)

  def communities(self, client_ids: Sequence[int]) -> np.ndarray:
    return np.asarray(self.data.user_community)[self._users[list(client_ids)]]

  def evaluate(self, per_client_outputs, client_ids) -> dict:
    del client_ids
    return evaluation.classification_metrics(per_client_outputs)


def speaker_context_task(data_dir: str | None, *, seed: int = 0,
                         batch_size: int = 16, local_epochs: int = 1,
                         min_docs: int = speaker_context.DEFAULT_MIN_DOCS,
                         max_docs: int = speaker_context.DEFAULT_MAX_DOCS,
                         max_chars: int = 100,
                         cold_fraction: float = 0.1,
                         char_embedding_dim: int = 16,
                         lstm_units: int = 32,
                         mlp_units: int = 64,
                         **unused) -> SpeakerTask:
  """Builds the task from `data_dir`, the folder holding friends/,
  game_of_thrones/ and shakespeare/ (e.g. ../shared/data)."""
  del unused  # flags of other tasks (num_users, population)
  if data_dir is None:
    raise ValueError('speaker_context needs --data_dir: the folder holding '
                     'friends/, game_of_thrones/ and shakespeare/ (e.g. '
                     '../shared/data)')
  data = speaker_context.load_task_data(
      data_dir, min_docs=min_docs, max_docs=max_docs, max_chars=max_chars,
      seed=seed)
  config = furl_text.DocumentModelConfig(
      vocab_size=data.vocab_size, num_classes=data.num_classes,
      max_chars=data.max_chars, char_embedding_dim=char_embedding_dim,
      lstm_units=lstm_units, mlp_units=mlp_units)
  return SpeakerTask(data=data, model_config=config, batch_size=batch_size,
                     local_epochs=local_epochs, seed=seed,
                     cold_fraction=cold_fraction)
