"""The structure of a client's private state: its codec and initial states.

A client state is a nested structure of numpy arrays described by a
template (`core/client_state.py` says what a template may be and how it is
flattened). `StateCodec` checks a state against its template, flattens it
and encodes it as bytes with a CRC (what the SQLite store keeps);
`seeded_initial_state_fn` and `constant_initial_state_fn` give a client that
was never saved its documented first state. The stores in
`core/client_state.py` use them; the errors they raise are defined here and
re-exported there.

Pure numpy and the standard library.
"""

from __future__ import annotations

import collections
import json
import zlib
from typing import Any, Callable, Iterator, Sequence

import numpy as np

Structure = Any

_CRC_BYTES = 4


class ClientStateStoreError(RuntimeError):
  """Base class of the errors raised by client-state stores."""


class StructureMismatchError(ClientStateStoreError, ValueError):
  """A state or a stored file does not match the store's structure template."""


class CorruptStateError(ClientStateStoreError):
  """Stored bytes (a SQLite blob or a snapshot file) fail validation."""


class SnapshotNotFoundError(ClientStateStoreError, FileNotFoundError):
  """`rollback`/`restore` asked for a snapshot that does not exist."""


# ----------------------------------------------------------------------------
# Structures.


def _is_namedtuple(x: Any) -> bool:
  return isinstance(x, tuple) and hasattr(x, '_fields')


def _flatten_with_paths(
    structure: Structure, prefix: str = '') -> Iterator[tuple[str, Any]]:
  """Yields (path, leaf) in `tf.nest` order (mappings by sorted key)."""
  if isinstance(structure, collections.abc.Mapping):
    try:
      keys = sorted(structure)
    except TypeError as e:
      raise StructureMismatchError(
          f'Mapping keys at {prefix or "<root>"!r} are not sortable: '
          f'{list(structure)}') from e
    for k in keys:
      yield from _flatten_with_paths(structure[k], f'{prefix}/{k}')
  elif _is_namedtuple(structure):
    for name, v in zip(structure._fields, structure):
      yield from _flatten_with_paths(v, f'{prefix}/{name}')
  elif isinstance(structure, (list, tuple)):
    for i, v in enumerate(structure):
      yield from _flatten_with_paths(v, f'{prefix}/{i}')
  else:
    yield (prefix or '/', structure)


def _pack(template: Structure, leaves: Iterator[Any]) -> Structure:
  """Rebuilds `template`'s containers around `leaves` (in flatten order)."""
  if isinstance(template, collections.abc.Mapping):
    packed = {k: _pack(template[k], leaves) for k in sorted(template)}
    items = [(k, packed[k]) for k in template]  # The template's key order.
    try:
      return type(template)(items)
    except TypeError:
      return dict(items)
  if _is_namedtuple(template):
    return type(template)(*[_pack(v, leaves) for v in template])
  if isinstance(template, (list, tuple)):
    return type(template)(_pack(v, leaves) for v in template)
  return next(leaves)


class _Mismatch(Exception):
  """Internal: the fast flattener cannot match; the general path decides."""


def _compile_flattener(template: Structure) -> Callable[[Structure, list],
                                                        None]:
  """`(state, out)` appending `state`'s leaves in `tf.nest` order.

  Accepts only states whose containers match the template's exactly
  (mappings with the same keys, namedtuples with the same fields, lists or
  tuples of the same length), which `_flatten_with_paths` gives the same
  paths; raises `_Mismatch` otherwise, and the caller falls back to the
  general path (which accepts what it accepts and names what it does not).
  Faster than the general path, which builds a path string per node; it
  runs for every client on every load and save.
  """
  if isinstance(template, collections.abc.Mapping):
    keys = sorted(template)
    subs = [_compile_flattener(template[k]) for k in keys]

    def flatten_mapping(x, out):
      if (not isinstance(x, collections.abc.Mapping) or len(x) != len(keys)):
        raise _Mismatch
      try:
        for k, sub in zip(keys, subs):
          sub(x[k], out)
      except KeyError as e:
        raise _Mismatch from e
    return flatten_mapping
  if _is_namedtuple(template):
    fields = template._fields
    subs = [_compile_flattener(v) for v in template]

    def flatten_namedtuple(x, out):
      if not _is_namedtuple(x) or x._fields != fields:
        raise _Mismatch
      for v, sub in zip(x, subs):
        sub(v, out)
    return flatten_namedtuple
  if isinstance(template, (list, tuple)):
    subs = [_compile_flattener(v) for v in template]

    def flatten_sequence(x, out):
      if (not isinstance(x, (list, tuple)) or _is_namedtuple(x)
          or len(x) != len(subs)):
        raise _Mismatch
      for v, sub in zip(x, subs):
        sub(v, out)
    return flatten_sequence

  def flatten_leaf(x, out):
    if isinstance(x, (collections.abc.Mapping, list, tuple)):
      raise _Mismatch
    out.append(x)
  return flatten_leaf


def _leaf_spec(path: str, leaf: Any) -> tuple[np.dtype, tuple[int, ...]]:
  """(dtype, shape) of a template leaf: an array, a scalar or a TensorSpec."""
  if isinstance(leaf, (np.ndarray, np.generic, int, float, bool, complex)):
    arr = np.asarray(leaf)
    dtype, shape = arr.dtype, arr.shape
  elif hasattr(leaf, 'shape') and hasattr(leaf, 'dtype'):  # tf.TensorSpec.
    dtype = np.dtype(getattr(leaf.dtype, 'as_numpy_dtype', leaf.dtype))
    dims = (leaf.shape.as_list() if hasattr(leaf.shape, 'as_list')
            else list(leaf.shape))
    if any(d is None for d in dims):
      raise StructureMismatchError(
          f'Template leaf {path!r} has a partially known shape {dims}; client '
          'states need fully defined shapes.')
    shape = tuple(int(d) for d in dims)
  else:
    arr = np.asarray(leaf)
    dtype, shape = arr.dtype, arr.shape
  if dtype.hasobject:
    raise StructureMismatchError(
        f'Template leaf {path!r} has dtype {dtype}; object arrays cannot be '
        'stored.')
  return dtype, shape


class StateCodec:
  """Validates, flattens, packs and (de)serializes states of one template.

  Blob encoding (SQLite backend): the raw C-order bytes of the flattened
  leaves in template order, each in the template's dtype (whose byte order is
  part of the signature), followed by a 4-byte little-endian CRC-32 of those
  bytes. Decoding is `np.frombuffer` (no pickling, no per-leaf headers); the
  length and the CRC are checked on every read.
  """

  def __init__(self, template: Structure):
    self.template = template
    flat = list(_flatten_with_paths(template))
    self.paths = [p for p, _ in flat]
    specs = [_leaf_spec(p, leaf) for p, leaf in flat]
    self.dtypes = [d for d, _ in specs]
    self.shapes = [s for _, s in specs]
    self.nbytes = [int(np.prod(s, dtype=np.int64)) * d.itemsize
                   for d, s in specs]
    self.payload_bytes = sum(self.nbytes)
    self._fast_flatten = _compile_flattener(template)

  def signature(self) -> str:
    """JSON describing paths, dtypes and shapes (not the container types)."""
    return json.dumps([[p, d.str, list(s)] for p, d, s in
                       zip(self.paths, self.dtypes, self.shapes)])

  def describe(self) -> str:
    return ', '.join(f'{p}: {d.str}{list(s)}' for p, d, s in
                     zip(self.paths, self.dtypes, self.shapes))

  def flatten(self, state: Structure, client_id: int) -> list[np.ndarray]:
    """Validated leaves of `state`, as fresh arrays in the template dtypes."""
    raw = []
    try:
      self._fast_flatten(state, raw)
    except _Mismatch:
      flat = list(_flatten_with_paths(state))
      paths = [p for p, _ in flat]
      if paths != self.paths:
        raise StructureMismatchError(
            f'State of client {client_id} has leaves {paths}, but the '
            f'template has {self.paths}.') from None
      raw = [leaf for _, leaf in flat]
    leaves = []
    for path, leaf, dtype, shape in zip(self.paths, raw, self.dtypes,
                                        self.shapes):
      arr = np.asarray(leaf)
      if arr.shape != shape:
        raise StructureMismatchError(
            f'State of client {client_id}: leaf {path!r} has shape '
            f'{arr.shape}, the template has {shape}.')
      if arr.dtype != dtype and not np.can_cast(arr.dtype, dtype, 'same_kind'):
        raise StructureMismatchError(
            f'State of client {client_id}: leaf {path!r} has dtype '
            f'{arr.dtype}, which cannot be cast to the template dtype {dtype}.')
      leaves.append(np.array(arr, dtype=dtype, copy=True))
    return leaves

  def pack(self, leaves: Sequence[np.ndarray]) -> Structure:
    """Builds a state from leaves; 0-d leaves become numpy scalars."""
    out = [leaf[()] if leaf.ndim == 0 else leaf for leaf in leaves]
    return _pack(self.template, iter(out))

  def payload(self, leaves: Sequence[np.ndarray]) -> bytes:
    """The raw C-order bytes of validated leaves, in template order."""
    return b''.join(leaf.tobytes() for leaf in leaves)

  def from_payload(self, payload) -> list[np.ndarray]:
    """Leaves (writable, sharing one copy) of `payload(...)` bytes."""
    buf = bytearray(payload)
    leaves, offset = [], 0
    for dtype, shape, nbytes in zip(self.dtypes, self.shapes, self.nbytes):
      count = nbytes // dtype.itemsize
      leaves.append(np.frombuffer(buf, dtype=dtype, count=count,
                                  offset=offset).reshape(shape))
      offset += nbytes
    return leaves

  def leaf_columns(self, payloads: Sequence[bytes]) -> list[np.ndarray]:
    """Per leaf, the stacked `(n,) + shape` array of n payloads (vectorized)."""
    n = len(payloads)
    table = np.frombuffer(b''.join(payloads), np.uint8).reshape(
        n, self.payload_bytes)
    columns, offset = [], 0
    for dtype, shape, nbytes in zip(self.dtypes, self.shapes, self.nbytes):
      column = np.ascontiguousarray(table[:, offset:offset + nbytes])
      columns.append(column.view(dtype).reshape((n,) + shape))
      offset += nbytes
    return columns

  def payloads_from_columns(self, columns: Sequence[np.ndarray],
                            n: int) -> list[bytes]:
    """Inverse of `leaf_columns`."""
    if n == 0:
      return []
    if not columns:
      return [b''] * n
    table = np.concatenate(
        [np.ascontiguousarray(c).reshape(n, -1).view(np.uint8)
         for c in columns], axis=1)
    return [row.tobytes() for row in table]

  def encode(self, leaves: Sequence[np.ndarray]) -> bytes:
    payload = self.payload(leaves)
    return payload + zlib.crc32(payload).to_bytes(_CRC_BYTES, 'little')

  def decode(self, blob: bytes, client_id: int) -> list[np.ndarray]:
    """Leaves (writable copies) of `blob`; raises `CorruptStateError`."""
    expected = self.payload_bytes + _CRC_BYTES
    if blob is None or len(blob) != expected:
      raise CorruptStateError(
          f'Stored state of client {client_id} is corrupt: blob has '
          f'{None if blob is None else len(blob)} bytes, expected {expected} '
          f'for the template ({self.describe()}).')
    payload = memoryview(blob)[:self.payload_bytes]
    crc = int.from_bytes(blob[self.payload_bytes:], 'little')
    if zlib.crc32(payload) != crc:
      raise CorruptStateError(
          f'Stored state of client {client_id} is corrupt: CRC-32 mismatch.')
    return self.from_payload(payload)


# ----------------------------------------------------------------------------
# Initial states.


class SeededInitialState:
  """The documented initial state of a client that was never saved.

  For client `i` the leaves of `template` (in `tf.nest` flatten order) are
  drawn from `np.random.default_rng([seed, i])`: floating-point leaves from
  N(0, stddev^2) (`init='normal'`, sampled in float64 then cast) or zeros
  (`init='zeros'`); integer, boolean and complex leaves start at 0. The result
  depends only on (template, seed, init, stddev, i): it is the same in every
  process, run and store, and differs between clients.

  Exposes `.template`, which stores use as their structure template.
  """

  def __init__(self, template: Structure, seed: int, init: str = 'normal',
               stddev: float = 0.01):
    if init not in ('normal', 'zeros'):
      raise ValueError(f"init must be 'normal' or 'zeros', got {init!r}.")
    if int(seed) < 0:
      raise ValueError(f'seed must be non-negative, got {seed}.')
    self._codec = StateCodec(template)
    self.template = template
    self.seed = int(seed)
    self.init = init
    self.stddev = float(stddev)

  def __call__(self, client_id: int) -> Structure:
    client_id = int(client_id)
    if client_id < 0:
      raise ValueError(f'client ids must be non-negative, got {client_id}.')
    rng = np.random.default_rng([self.seed, client_id])
    leaves = []
    for dtype, shape in zip(self._codec.dtypes, self._codec.shapes):
      if dtype.kind == 'f' and self.init == 'normal':
        leaves.append(rng.normal(0.0, self.stddev, size=shape).astype(dtype))
      else:
        leaves.append(np.zeros(shape, dtype))
    return self._codec.pack(leaves)


def seeded_initial_state_fn(template: Structure, seed: int,
                            init: str = 'normal',
                            stddev: float = 0.01) -> SeededInitialState:
  """Returns the documented, deterministic initial-state function.

  Args:
    template: structure of numpy arrays or `tf.TensorSpec`s.
    seed: non-negative experiment seed.
    init: 'normal' (float leaves ~ N(0, stddev^2)) or 'zeros'.
    stddev: standard deviation for `init='normal'`.

  Returns:
    A callable `client_id -> state` (see `SeededInitialState`) with a
    `.template` attribute.
  """
  return SeededInitialState(template, seed, init=init, stddev=stddev)


class ConstantInitialState:
  """Every never-saved client starts from the same `state` (checked against
  `template` once); each call returns fresh copies of its arrays. Exposes
  `.template`, like `SeededInitialState`."""

  def __init__(self, template: Structure, state: Structure):
    self._codec = StateCodec(template)
    self.template = template
    self._leaves = [np.array(leaf) for leaf in self._codec.flatten(state, 0)]

  def __call__(self, client_id: int) -> Structure:
    if int(client_id) < 0:
      raise ValueError(f'client ids must be non-negative, got {client_id}.')
    return self._codec.pack([leaf.copy() for leaf in self._leaves])


def constant_initial_state_fn(template: Structure, private: Any
                              ) -> ConstantInitialState:
  """The initial-state function of a process whose new clients all start
  from `private` (e.g. Ditto's personal model: the initial global model).

  Args:
    template: the client-state structure (a dict holding 'private' and,
      optionally, integer counters that start at 0).
    private: the private part every new client starts from.
  """
  codec = StateCodec(template)
  state = codec.pack([np.zeros(shape, dtype) for dtype, shape in
                      zip(codec.dtypes, codec.shapes)])
  state['private'] = tuple(np.asarray(p) for p in private)
  return ConstantInitialState(template, state)
