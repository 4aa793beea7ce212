"""A client's local-training data as numpy batches, in visiting order.

Tasks hand the training loop one item per sampled client. A `tf.data`
dataset is what a TFF client computation consumes; `ClientBatches` is the
same data already cut into the batches local training visits, in order, as
numpy arrays. `to_dataset()` turns it into that dataset (for one user per
TFF client), and the sharded simulation (`core/sharded.py`) packs it into
dense tensors with numpy alone, which is much cheaper than iterating a
`tf.data` dataset per user in Python on every round.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np
import tensorflow as tf


@dataclasses.dataclass(frozen=True)
class ClientBatches:
  """Batches (nested structures of numpy arrays, leading batch axis)."""
  batches: tuple
  element_spec: Any

  @classmethod
  def from_arrays(cls, examples, batch_size: int,
                  orders: Sequence[np.ndarray], element_spec
                  ) -> 'ClientBatches':
    """Batches of `examples` (nested arrays [n, ...]) for each epoch's order.

    Every epoch visits `examples` in its order and is cut into batches of
    `batch_size` (the last batch of an epoch may be smaller), as
    `Dataset.shuffle(...).batch(b)` repeated per epoch does.
    """
    if batch_size < 1:
      raise ValueError(f'batch_size must be >= 1, got {batch_size}')
    flat = [np.asarray(a) for a in tf.nest.flatten(examples)]
    batches = []
    for order in orders:
      order = np.asarray(order)
      for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        batches.append(tf.nest.pack_sequence_as(examples,
                                                [a[idx] for a in flat]))
    return cls(batches=tuple(batches), element_spec=element_spec)

  @property
  def num_examples(self) -> int:
    return sum(len(tf.nest.flatten(b)[0]) for b in self.batches)

  def to_dataset(self) -> tf.data.Dataset:
    """The same batches as a `tf.data.Dataset` (for a TFF client)."""
    if not self.batches:
      return tf.data.Dataset.from_tensor_slices(tf.nest.map_structure(
          lambda s: np.zeros([0] + list(s.shape[1:]), s.dtype.as_numpy_dtype),
          self.element_spec)).batch(1)
    flat = [np.concatenate(parts) for parts in zip(
        *[tf.nest.flatten(b) for b in self.batches])]
    sizes = [len(tf.nest.flatten(b)[0]) for b in self.batches]
    examples = tf.data.Dataset.from_tensor_slices(
        tf.nest.pack_sequence_as(self.element_spec, flat))
    if len(set(sizes[:-1])) <= 1 and (len(sizes) == 1 or
                                      sizes[-1] <= sizes[0]):
      return examples.batch(sizes[0])
    # Ragged batches inside the sequence (several epochs of a size that
    # does not divide the batch size): rebuild batch by batch.
    bounds = np.cumsum([0] + sizes)
    starts = tf.data.Dataset.from_tensor_slices(
        (bounds[:-1].astype(np.int64), np.asarray(sizes, np.int64)))
    tensors = tf.nest.pack_sequence_as(
        self.element_spec, [tf.constant(a) for a in flat])
    return starts.map(lambda s, n: tf.nest.map_structure(
        lambda t: t[s:s + n], tensors))


def as_dataset(item) -> tf.data.Dataset:
  """`item` as a dataset (ClientBatches are converted; datasets returned)."""
  return item.to_dataset() if isinstance(item, ClientBatches) else item
