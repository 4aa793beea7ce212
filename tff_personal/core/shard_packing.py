"""Users packed into shards: the arrays a shard carries and their reading.

The sharded simulation (`core/sharded.py`) runs many users inside one TFF
client. `pack_datasets` packs their batches into one structure of arrays
(each user's examples once, index batches into them, batch sizes and
counts, padded to the largest user); `shard_data_type` is its TFF type;
`PackedBatches` gives a client step one user's batches from it with the
`tf.data.Dataset` members steps use (`reduce`, `element_spec`);
`stack_states` stacks the users' client states along a leading axis.
"""

from __future__ import annotations

import collections
from typing import Any, Sequence

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_personal.core import client_data

SHARD_EXAMPLES = 'examples'
SHARD_INDICES = 'indices'
SHARD_BATCH_SIZES = 'batch_sizes'
SHARD_NUM_BATCHES = 'num_batches'
# The shard work's count of the users it ran (for the server step's cohort).
SHARD_USERS = 'users'


def stacked_type(t: tff.Type) -> tff.Type:
  """`t` with a leading unknown-size (user) axis on every tensor."""

  def add_axis(tensor_type):
    return tff.TensorType(tensor_type.dtype, [None] + list(tensor_type.shape))

  return tff.types.type_transformations.transform_type_postorder(
      t, lambda x: (add_axis(x), True) if isinstance(x, tff.TensorType)
      else (x, False))[0]


def shard_data_type(data_type: tff.SequenceType,
                    wire: client_data.WireFormat | None = None) -> tff.Type:
  """The TFF type of one shard's data, from one user's dataset type.

  `examples`: every tensor of an example, stacked as [users, examples, ...]
  (zero-padded; in `wire.spec`'s form when a wire format is given), each
  user's examples once however many epochs visit them; `indices`: [users,
  batches, batch] the examples of each batch in visiting order;
  `batch_sizes`: [users, batches] true sizes; `num_batches`: [users] true
  counts. Batch boundaries and order are kept exactly, so the per-user
  batches rebuilt inside the shard are the original ones.
  """
  element = (data_type.element if wire is None else
             tff.types.tensorflow_to_type(wire.spec))

  def add_axes(tensor_type):
    return tff.TensorType(tensor_type.dtype,
                          [None, None] + list(tensor_type.shape[1:]))

  examples = tff.types.type_transformations.transform_type_postorder(
      element, lambda x: (add_axes(x), True) if isinstance(x, tff.TensorType)
      else (x, False))[0]
  return tff.types.to_type(collections.OrderedDict([
      (SHARD_EXAMPLES, examples),
      (SHARD_INDICES, tff.TensorType(np.int32, [None, None, None])),
      (SHARD_BATCH_SIZES, tff.TensorType(np.int32, [None, None])),
      (SHARD_NUM_BATCHES, tff.TensorType(np.int32, [None])),
  ]))


class PackedBatches:
  """One user's batches of a packed shard, as the client step sees them.

  It offers the two members of `tf.data.Dataset` that client steps use,
  `element_spec` and `reduce(initial_state, reduce_fn)`, implemented with a
  `tf.while_loop` over the batch index. A real `tf.data` dataset per user
  would instantiate (and optimise) the dataset's functions on every user of
  every round, which is far slower (docs/performance.md). A batch is
  gathered from the user's examples by index and, with a wire format,
  decoded.
  """

  def __init__(self, shard, u, element_spec,
               wire: client_data.WireFormat | None = None):
    self._nb = shard[SHARD_NUM_BATCHES][u]
    self._examples = tf.nest.map_structure(lambda t: t[u],
                                           shard[SHARD_EXAMPLES])
    self._indices = shard[SHARD_INDICES][u]
    self._sizes = shard[SHARD_BATCH_SIZES][u]
    self._decode = wire.decode if wire is not None else (lambda b: b)
    self.element_spec = element_spec

  def batch(self, j):
    idx = self._indices[j, :self._sizes[j]]
    return self._decode(tf.nest.map_structure(
        lambda t: tf.gather(t, idx), self._examples))

  def reduce(self, initial_state, reduce_fn):
    """`tf.data.Dataset.reduce` over the user's batches, one at a time.

    A graph loop's iterations may overlap (`tf.while_loop`'s default
    `parallel_iterations` is 10): a step's variable reads and assignments are
    ordered only within its own iteration, so with overlap a read-only pass
    over the model (PFedKM's probe) was still reading when the next pass's
    first assignment ran, and a sharded round differed between runs. Hence
    `parallel_iterations=1`, as `Dataset.reduce` runs its steps.
    """
    def body(j, state):
      return j + 1, reduce_fn(state, self.batch(j))

    _, state = tf.while_loop(lambda j, _: j < self._nb, body,
                             (tf.constant(0), initial_state),
                             parallel_iterations=1)
    return state


def _user_examples_and_batches(item, wire):
  """(examples as flat numpy list, index batches) of one shard item."""
  if isinstance(item, client_data.ClientBatches):
    if (item.wire is None) != (wire is None) or (
        wire is not None and item.wire.spec != wire.spec):
      raise ValueError(
          'client data and shard disagree on the wire format: the data are '
          f'in {"wire" if item.wire else "model"} form, the shard expects '
          f'{"wire" if wire else "model"} form (pass the task\'s wire_format '
          'to the sharded process)')
    return ([np.asarray(a) for a in tf.nest.flatten(item.examples)],
            [np.asarray(i) for i in item.index_batches])
  if wire is not None:
    raise ValueError('a shard in wire form needs ClientBatches in that form, '
                     f'got {type(item).__name__}')
  batches = [[np.asarray(t) for t in tf.nest.flatten(b)] for b in item]
  if not batches:
    return None, []
  flat = [np.concatenate(parts) for parts in zip(*batches)]
  bounds = np.cumsum([0] + [len(b[0]) for b in batches])
  return flat, [np.arange(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def pack_datasets(datasets: Sequence[Any], element_spec,
                  wire: client_data.WireFormat | None = None):
  """Packs users' examples and batch indices into one shard's dense tensors.

  Items are `client_data.ClientBatches` (packed with numpy alone, each
  user's examples once) or batched `tf.data` datasets, each iterated once,
  eagerly, in the order it yields batches (so shuffling and repetition done
  by the task are kept; this costs milliseconds per user, which is why tasks
  offer `ClientBatches`). With `wire`, items must be `ClientBatches` in that
  wire form, and the examples travel in it.
  """
  per_user = [_user_examples_and_batches(d, wire) for d in datasets]
  num_users = len(per_user)
  max_batches = max([len(b) for _, b in per_user] + [1])
  max_size = max([len(i) for _, b in per_user for i in b] + [1])
  max_examples = max([len(f[0]) for f, _ in per_user if f] + [1])
  sizes = np.zeros([num_users, max_batches], np.int32)
  indices = np.zeros([num_users, max_batches, max_size], np.int32)
  for u, (_, batches) in enumerate(per_user):
    for j, idx in enumerate(batches):
      sizes[u, j] = len(idx)
      indices[u, j, :len(idx)] = idx
  flat_spec = tf.nest.flatten(wire.spec if wire is not None else element_spec)
  flat_out = []
  for i, spec in enumerate(flat_spec):
    shape = next((f[i].shape[1:] for f, _ in per_user if f), None)
    if shape is None:
      shape = tuple(0 if d is None else d for d in spec.shape[1:])
    arr = np.zeros([num_users, max_examples] + list(shape),
                   spec.dtype.as_numpy_dtype)
    for u, (flat, _) in enumerate(per_user):
      if flat:
        arr[u, :len(flat[i])] = flat[i]
    flat_out.append(arr)
  return collections.OrderedDict([
      (SHARD_EXAMPLES, tf.nest.pack_sequence_as(
          wire.spec if wire is not None else element_spec, flat_out)),
      (SHARD_INDICES, indices),
      (SHARD_BATCH_SIZES, sizes),
      (SHARD_NUM_BATCHES, np.asarray([len(b) for _, b in per_user],
                                     np.int32)),
  ])


def shard_ranges(num_users: int, num_shards: int) -> list[range]:
  """Contiguous, near-equal user index ranges, one per non-empty shard."""
  k = min(num_shards, num_users)
  bounds = np.linspace(0, num_users, k + 1).round().astype(int)
  return [range(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def stack_states(states: Sequence[Any]):
  return tf.nest.map_structure(lambda *xs: np.stack([np.asarray(x) for x in xs]),
                               *states)


def unstack_states(stacked, num_users: int, template) -> list:
  """`stack_states`' inverse: the first `num_users` states, shaped like
  `template`."""
  flat = [np.asarray(x) for x in tf.nest.flatten(stacked)]
  return [tf.nest.pack_sequence_as(template, [x[u] for x in flat])
          for u in range(num_users)]
