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
from typing import Any, Callable, Optional, Sequence

import numpy as np
import tensorflow as tf


@dataclasses.dataclass(frozen=True)
class WireFormat:
  """How a task's examples travel to the TFF runtime, and the model's form.

  `spec`: nested `tf.TensorSpec` of one batch as stored and serialised
  (e.g. uint8 spectrograms); `decode`: a TF function from such a batch to
  the batch the model reads (its `element_spec`), applied per batch inside
  the client computation. It must be elementwise along the batch axis (each
  example decoded on its own), so decoding then batching equals batching
  then decoding. Tasks whose examples are already in the model's form have
  no wire format (None).
  """
  spec: Any
  decode: Callable[[Any], Any]


@dataclasses.dataclass(frozen=True)
class ClientBatches:
  """A client's examples, once, and the batches local training visits.

  `examples`: nested numpy arrays [n, ...] (in `wire.spec`'s form when
  `wire` is given, else in `element_spec`'s); `index_batches`: for each
  batch in visiting order, the indices of its examples. Several local epochs
  thus reuse the same examples instead of copying them per epoch, so what
  the sharded simulation serialises per round is the examples once plus
  small index arrays.
  """
  examples: Any
  index_batches: tuple
  element_spec: Any
  wire: Optional[WireFormat] = None

  @classmethod
  def from_arrays(cls, examples, batch_size: int,
                  orders: Sequence[np.ndarray], element_spec,
                  wire: Optional[WireFormat] = None) -> 'ClientBatches':
    """Batches of `examples` (nested arrays [n, ...]) for each epoch's order.

    Every epoch visits `examples` in its order and is cut into batches of
    `batch_size` (the last batch of an epoch may be smaller), as
    `Dataset.shuffle(...).batch(b)` repeated per epoch does.
    """
    if batch_size < 1:
      raise ValueError(f'batch_size must be >= 1, got {batch_size}')
    examples = tf.nest.map_structure(np.asarray, examples)
    n = len(tf.nest.flatten(examples)[0])
    index_batches = []
    for order in orders:
      order = np.asarray(order, np.int64)
      if order.size and (order.min() < 0 or order.max() >= n):
        raise ValueError(f'an epoch order indexes outside the {n} examples')
      for start in range(0, len(order), batch_size):
        index_batches.append(order[start:start + batch_size])
    return cls(examples=examples, index_batches=tuple(index_batches),
               element_spec=element_spec, wire=wire)

  @property
  def batches(self) -> tuple:
    """The batches in visiting order (numpy; in the wire form if any)."""
    return tuple(tf.nest.map_structure(lambda a, i=idx: a[i], self.examples)
                 for idx in self.index_batches)

  @property
  def num_examples(self) -> int:
    return sum(len(idx) for idx in self.index_batches)

  def to_dataset(self) -> tf.data.Dataset:
    """The same batches as a `tf.data.Dataset` (for a TFF client).

    With a wire format the dataset holds the wire form and decodes each
    batch in a `map`, so its serialised graph carries the compact form too.
    """
    dataset = self._wire_dataset()
    return dataset.map(self.wire.decode) if self.wire else dataset

  def _wire_dataset(self) -> tf.data.Dataset:
    spec = self.wire.spec if self.wire else self.element_spec
    if not self.index_batches:
      return tf.data.Dataset.from_tensor_slices(tf.nest.map_structure(
          lambda s: np.zeros([0] + list(s.shape[1:]), s.dtype.as_numpy_dtype),
          spec)).batch(1)
    flat = [np.concatenate(parts) for parts in zip(
        *[tf.nest.flatten(b) for b in self.batches])]
    sizes = [len(tf.nest.flatten(b)[0]) for b in self.batches]
    examples = tf.data.Dataset.from_tensor_slices(
        tf.nest.pack_sequence_as(spec, flat))
    if len(set(sizes[:-1])) <= 1 and (len(sizes) == 1 or
                                      sizes[-1] <= sizes[0]):
      return examples.batch(sizes[0])
    # Ragged batches inside the sequence (several epochs of a size that
    # does not divide the batch size): rebuild batch by batch.
    bounds = np.cumsum([0] + sizes)
    starts = tf.data.Dataset.from_tensor_slices(
        (bounds[:-1].astype(np.int64), np.asarray(sizes, np.int64)))
    tensors = tf.nest.pack_sequence_as(
        spec, [tf.constant(a) for a in flat])
    return starts.map(lambda s, n: tf.nest.map_structure(
        lambda t: t[s:s + n], tensors))


def as_dataset(item) -> tf.data.Dataset:
  """`item` as a dataset (ClientBatches are converted; datasets returned)."""
  return item.to_dataset() if isinstance(item, ClientBatches) else item
