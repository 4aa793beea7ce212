"""A structure of fixed-shape tensors sent into and out of TFF as a few vectors.

The sharded simulation's TFF round (`core/sharded.ShardedProcess`) takes the
server state and the shards' results in this packed form.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf


def _packable(dtype: tf.DType) -> bool:
  return dtype.is_numpy_compatible and (dtype.is_bool or dtype.is_integer or
                                        dtype.is_floating or dtype.is_complex)


class FlatTransport:
  """A structure of fixed-shape tensors carried as one 1-D tensor per dtype.

  A value passed into or out of a TFF computation is serialised leaf by
  leaf, each leaf with its type, so a structure of many small tensors costs
  far more to send than the same numbers in a few vectors. `pack` and
  `unpack` (numpy, in the driver) and `pack_tensors` and `unpack_tensors`
  (TF, inside a computation) concatenate the leaves of each dtype in
  `tf.nest` order and split and reshape them back: the same values, bit for
  bit. Written by hand: TFF has no packed wire form for Python values.

  Example:
    transport = FlatTransport(collections.OrderedDict(
        a=tf.TensorSpec([2, 3], tf.float32), n=tf.TensorSpec([], tf.int32)))
    packed = transport.pack(value)        # (float32[6], int32[1]), numpy
    value_again = transport.unpack_tensors(packed)  # in a TF computation
  """

  def __init__(self, specs):
    """Args: specs: a structure of numeric or boolean `tf.TensorSpec`s,
    every shape known (strings have no fixed size to pack)."""
    flat = tf.nest.flatten(specs)
    for spec in flat:
      if not spec.shape.is_fully_defined():
        raise ValueError(f'FlatTransport needs fully known shapes, got {spec}')
      if not _packable(spec.dtype):
        raise ValueError(f'FlatTransport packs numbers and booleans, got {spec}')
    self._specs = specs
    self._shapes = [spec.shape.as_list() for spec in flat]
    self._sizes = [int(np.prod(shape, dtype=np.int64)) for shape in
                   self._shapes]
    self._dtypes = sorted({spec.dtype for spec in flat}, key=lambda d: d.name)
    self._groups = [[i for i, spec in enumerate(flat) if spec.dtype == d]
                    for d in self._dtypes]

  @classmethod
  def fits(cls, specs) -> bool:
    """Whether every leaf of `specs` has a fully known shape and a numeric
    or boolean dtype."""
    return all(s.shape.is_fully_defined() and _packable(s.dtype)
               for s in tf.nest.flatten(specs))

  @property
  def packed_spec(self) -> tuple:
    """The packed form's specs: one 1-D tensor per dtype (sorted by name)."""
    return tuple(tf.TensorSpec([sum(self._sizes[i] for i in group)], d)
                 for d, group in zip(self._dtypes, self._groups))

  def pack(self, value) -> tuple:
    """`value` (a structure as the specs, numpy values) packed, as numpy."""
    flat = [np.asarray(x) for x in tf.nest.flatten(value)]
    return tuple(
        np.concatenate([flat[i].astype(d.as_numpy_dtype, copy=False).ravel()
                        for i in group])
        for d, group in zip(self._dtypes, self._groups))

  def unpack(self, packed):
    """The structure `pack` was given (numpy; rank 0 as numpy scalars)."""
    flat = [None] * len(self._shapes)
    for vector, group in zip(packed, self._groups):
      offsets = np.cumsum([0] + [self._sizes[i] for i in group])
      for k, i in enumerate(group):
        part = np.asarray(vector)[offsets[k]:offsets[k + 1]].reshape(
            self._shapes[i])
        flat[i] = part[()] if not self._shapes[i] else part
    return tf.nest.pack_sequence_as(self._specs, flat)

  def pack_tensors(self, value) -> tuple:
    """TF: `value` (a structure as the specs) packed."""
    flat = tf.nest.flatten(value)
    return tuple(tf.concat([tf.reshape(flat[i], [-1]) for i in group], 0)
                 for group in self._groups)

  def unpack_tensors(self, packed):
    """TF: the structure `pack` or `pack_tensors` was given."""
    flat = [None] * len(self._shapes)
    for vector, group in zip(packed, self._groups):
      parts = tf.split(vector, [self._sizes[i] for i in group])
      for i, part in zip(group, parts):
        flat[i] = tf.reshape(part, self._shapes[i])
    return tf.nest.pack_sequence_as(self._specs, flat)


# Where `ShardedProcess` computes a local run's shards (`shards_in`).
