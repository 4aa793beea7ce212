"""The in-process round: a process's production form run as TensorFlow here.

`production.production_form(process)` compiles a round to TFF's
`MapReduceForm`, whose pieces are TensorFlow computations. Called as
`tff.Computation`s, each goes through TFF's runtime (the C++ worker,
serialization, gRPC) at every call. `build(process)` turns the same
compiled pieces into TensorFlow functions of this Python process and runs
them in the order a MapReduce platform does:

* `initialize`: the state-initialization computation TFF compiles from
  `process.initialize` (`get_state_initialization_computation`);
* `prepare` at the server;
* each device's program (`ProductionForm.device_program()`: `work` and the
  new client state from the same graph), once per client;
* `zero`, `accumulate` over the uploads, `report`, the secure sums added up
  (`production._reduce`, shared with `ProductionForm.run_map_reduce_round`),
  and `update`, which holds the aggregator as compiled (clipping, DP noise).

Nothing here executes through TFF's runtime: compiling to MapReduceForm
traces and transforms only, and the pieces run as TensorFlow functions, so
no `worker_binary` is started or needed (`runtime.local_runtime()` is for
`process.next`, the reference). Results come back in the Python containers
TFF's execution context gives for the process's own types (`process.next`'s
result), so a state of either round feeds the other.

Each piece is imported once by TFF's own
`tensorflow_utils.deserialize_and_call_tf_computation` into a graph of its
own (over placeholders for its flattened parameter) and run in one
`tf.compat.v1.Session`, as TFF's TensorFlow executor runs it: its
initialization before every call, a dataset fed as its serialized graph
(`DatasetToGraphV2`, as TFF serializes a sequence), Grappler off because
the graph is compiled already (optimizing its functions again at every call
cost most of a call). A dataset that cannot be serialized (one with Python
state) runs through the same import stamped into a
`tf.compat.v1.wrap_function` instead, its variant tensor passed as it is.
Written by hand, because TFF has no in-process executor for TensorFlow
computations since its Python executors were removed: that wrapping, the
flattening of arguments by type, and the round's order (its reduction is
`production._reduce`).

A multi-stage algorithm (`core/stages.py`) runs one process per stage: each
stage's process gets its own in-process round (`build(stage.process)`), as
the run path does (`run/training.py`).

Example:

  round_ = inprocess.build(process)
  state = round_.initialize()
  state, client_states, metrics = round_.next(state, client_states,
                                              datasets)
  # The same contract as process.next; states feed either.
"""

from __future__ import annotations

import collections
import itertools
from typing import Any, Callable, Mapping, Sequence

import attrs
import numpy as np
import tensorflow as tf
import tensorflow_federated as tff
from tensorflow.core.protobuf import config_pb2
from tensorflow_federated.python.core.impl.computation import computation_impl
from tensorflow_federated.python.core.impl.computation import function_utils
from tensorflow_federated.python.core.impl.types import type_conversions
from tensorflow_federated.python.core.impl.utils import tensorflow_utils

from tff_personal.core import production


class NotInProcessError(ValueError):
  """A process's round cannot run in process; the message says why."""


# The MapReduceForm pieces the round runs, in the order it runs them. Of
# the secure sums' bounds only the modulus enters the sums (`% modulus`);
# the bitwidth and maximum input bound what a platform's secure aggregation
# accepts, and a plain sum of the same integers needs neither.
PIECES = ('prepare', 'device', 'zero', 'accumulate', 'merge', 'report',
          'secure_modular_sum_modulus', 'update')

_STAMPS = itertools.count()


def _type_leaves(type_spec) -> list:
  """The leaves (tensor and sequence types) of a TFF type, in order."""
  if type_spec is None:
    return []
  if isinstance(type_spec, tff.StructType):
    return [leaf for _, element in tff.structure.iter_elements(type_spec)
            for leaf in _type_leaves(element)]
  return [type_spec]


def _element(value, index: int, name: str | None):
  """Element `index` (named `name`) of a value of a struct type."""
  if isinstance(value, tff.structure.Struct):
    return value[index]
  if isinstance(value, Mapping):
    return value[name] if name is not None else list(value.values())[index]
  if attrs.has(type(value)):
    return getattr(value, name) if name else getattr(
        value, attrs.fields(type(value))[index].name)
  if isinstance(value, (list, tuple)):
    return value[index]
  raise TypeError(f'{type(value).__name__} is not a value of a struct type')


def value_leaves(value, type_spec) -> list:
  """`value`'s leaves in `type_spec`'s order (walked by the type: a
  mapping is read by the type's names, not its own order)."""
  if isinstance(type_spec, tff.FederatedType):
    type_spec = type_spec.member
  if isinstance(type_spec, tff.StructType):
    elements = list(tff.structure.iter_elements(type_spec))
    if len(elements) != _length(value):
      raise TypeError(f'a value of {len(elements)} elements is expected '
                      f'for {type_spec}, got {_length(value)}')
    return [leaf for i, (name, t) in enumerate(elements)
            for leaf in value_leaves(_element(value, i, name), t)]
  return [value]


def _length(value) -> int:
  if attrs.has(type(value)):
    return len(attrs.fields(type(value)))
  try:
    return len(value)
  except TypeError:
    return -1


class _Leaf(int):
  """A leaf's position in a container template (`_packer`)."""


_PACKERS = {}


def _packer(type_spec) -> Callable[[Sequence[Any]], Any]:
  """A function of a type's leaves that builds the Python containers
  TFF's execution context returns for `type_spec` (`type_to_py_container`),
  made once per type: `type_to_py_container` builds a template of leaf
  positions, which each call fills in."""
  key = id(type_spec)
  if key in _PACKERS and _PACKERS[key][0] is type_spec:
    return _PACKERS[key][1]
  positions = itertools.count()

  def build(t):
    if isinstance(t, tff.StructType):
      return tff.structure.Struct(
          [(name, build(e)) for name, e in tff.structure.iter_elements(t)])
    return _Leaf(next(positions))

  template = type_conversions.type_to_py_container(build(type_spec),
                                                   type_spec)

  def fill(t, leaves):
    if isinstance(t, _Leaf):
      return leaves[t]
    if isinstance(t, tff.structure.Struct):
      return tff.structure.Struct(
          [(n, fill(v, leaves)) for n, v in tff.structure.iter_elements(t)])
    if isinstance(t, Mapping):
      return type(t)((k, fill(v, leaves)) for k, v in t.items())
    if attrs.has(type(t)):
      return type(t)(**{f.name: fill(getattr(t, f.name), leaves)
                        for f in attrs.fields(type(t)) if f.init})
    if isinstance(t, tuple) and hasattr(t, '_fields'):  # A namedtuple.
      return type(t)(*(fill(v, leaves) for v in t))
    if isinstance(t, (list, tuple)):
      return type(t)(fill(v, leaves) for v in t)
    raise TypeError(f'{type(t).__name__} in the containers of {type_spec}')

  def pack(leaves):
    return fill(template, leaves)

  _PACKERS[key] = (type_spec, pack)
  return pack


def packed(leaves: Sequence[Any], type_spec):
  """`leaves` in `type_spec`'s structure, in the Python containers TFF's
  execution context returns for that type (`type_to_py_container`)."""
  leaves, count = list(leaves), len(_type_leaves(type_spec))
  if len(leaves) != count:
    raise ValueError(f'{len(leaves)} values for the {count} leaves of '
                     f'{type_spec}')
  return _packer(type_spec)(leaves)


def _tensor_spec(leaf) -> tf.TensorSpec:
  if isinstance(leaf, tff.SequenceType):
    return tf.TensorSpec([], tf.variant)
  if not isinstance(leaf, tff.TensorType):
    raise NotInProcessError(f'a parameter leaf of type {leaf} is neither a '
                            'tensor nor a sequence')
  return tf.TensorSpec(leaf.shape, leaf.dtype)


def _element_spec(type_spec):
  """A sequence element type's `tf.TensorSpec`s (an `OrderedDict` for a
  named struct, a tuple for an unnamed one)."""
  if isinstance(type_spec, tff.StructType):
    elements = list(tff.structure.iter_elements(type_spec))
    if all(name for name, _ in elements):
      return collections.OrderedDict(
          (name, _element_spec(t)) for name, t in elements)
    return tuple(_element_spec(t) for _, t in elements)
  return tf.TensorSpec(type_spec.shape, type_spec.dtype)


def _fed(value, leaf):
  """One argument leaf as the tensor its placeholder takes."""
  if isinstance(leaf, tff.SequenceType):
    if not isinstance(value, tf.data.Dataset):
      raise TypeError(f'a tf.data.Dataset is expected for {leaf}, got '
                      f'{type(value).__name__}')
    return tf.data.experimental.to_variant(value)
  return tf.convert_to_tensor(np.asarray(value, leaf.dtype))


class InProcessComputation:
  """A TensorFlow `tff.Computation` as a TensorFlow function of this
  process: called with the arguments TFF takes, it returns what TFF's
  execution context returns (numpy leaves in the type's containers).

  Its initialization (variables, tables) runs before every call, as TFF's
  TensorFlow executor runs a computation's `initialize_op`. Its graph is
  imported on the first call (a session's), and again into an eager
  function only for a dataset that cannot be serialized.
  """

  def __init__(self, computation: tff.Computation, name: str = ''):
    proto = computation_impl.ConcreteComputation.get_proto(computation)
    if proto.WhichOneof('computation') != 'tensorflow':
      raise NotInProcessError(
          f'{name or "the computation"} is a {proto.WhichOneof("computation")}'
          ' computation, not one TensorFlow computation')
    self.name = name
    self.type_signature = computation.type_signature
    self.calls = 0
    parameter = self.type_signature.parameter
    self._leaves = _type_leaves(parameter)
    result_leaves = _type_leaves(self.type_signature.result)
    if any(not isinstance(t, tff.TensorType) for t in result_leaves):
      raise NotInProcessError(f'{name}: its result {self.type_signature.result}'
                              ' holds more than tensors')
    self._proto = proto
    self._session = None  # Both built on first use.
    self._eager = None

  def _eager_form(self):
    """`(call, init)`: the computation imported into a
    `tf.compat.v1.wrap_function` of its flattened parameter (built once)."""
    if self._eager is not None:
      return self._eager
    proto, parameter = self._proto, self.type_signature.parameter
    result_leaves = _type_leaves(self.type_signature.result)
    stamped = {}

    def body(*placeholders):
      graph = tf.compat.v1.get_default_graph()
      arg = None
      if parameter is not None:
        it = iter(placeholders)

        def build(t):
          if isinstance(t, tff.StructType):
            return tff.structure.Struct(
                [(n, build(e)) for n, e in tff.structure.iter_elements(t)])
          if isinstance(t, tff.SequenceType):
            return tf.data.experimental.from_variant(
                next(it), _element_spec(t.element))
          return next(it)

        arg = build(parameter)
      token = tf.constant('inprocess', tf.string)
      # A unique suffix: the shared names of this stamp's variables are
      # its own in this process's resource manager.
      init_op, result = tensorflow_utils.deserialize_and_call_tf_computation(
          proto, arg, graph, f'inprocess_{next(_STAMPS)}', token)
      stamped['init_op'] = init_op
      outputs = (tff.structure.flatten(result) if isinstance(
          result, tff.structure.Struct) else [result])
      return [tf.identity(t) for t in outputs]

    wrapped = tf.compat.v1.wrap_function(
        body, [_tensor_spec(t) for t in self._leaves])
    call = (wrapped.prune(wrapped.inputs, wrapped.outputs)
            if result_leaves else None)
    init = None
    if stamped['init_op'] is not None:
      init = wrapped.prune(wrapped.inputs, stamped['init_op'])
    self._eager = (call, init)
    return self._eager

  def __call__(self, *args, **kwargs):
    self.calls += 1
    parameter = self.type_signature.parameter
    arg = function_utils.pack_args(parameter, args, kwargs)
    values = [] if parameter is None else value_leaves(arg, parameter)
    if self._session is None:
      self._session = _SessionForm(self._proto, parameter, self._leaves)
    outputs = self._session(values)
    if outputs is None:  # A dataset that cannot be serialized: eagerly.
      call, init = self._eager_form()
      feeds = [_fed(v, t) for v, t in zip(values, self._leaves, strict=True)]
      if init is not None:
        init(*feeds)
      outputs = [] if call is None else [t.numpy() for t in call(*feeds)]
    return packed(list(outputs), self.type_signature.result)


# A session's graph is already compiled (TFF's MapReduceForm compiler, and
# `production` compiles without Grappler): optimizing its functions again at
# every call cost most of a device program's call (docs/performance.md).
_SESSION_CONFIG = tf.compat.v1.ConfigProto()
_SESSION_CONFIG.graph_options.rewrite_options.disable_meta_optimizer = True
_NO_DATA_OPTIMIZATION = tf.data.Options()
_NO_DATA_OPTIMIZATION.experimental_optimization.apply_default_optimizations = (
    False)


class _SessionForm:
  """A TensorFlow computation imported once into a graph of its own and run
  in one `tf.compat.v1.Session`, as TFF's TensorFlow executor runs it: its
  initialization before every call, a dataset fed as its serialized graph
  (`DatasetToGraphV2`, as TFF serializes a sequence). Returns None for a
  dataset that cannot be serialized (e.g. one with Python state), which the
  caller then runs eagerly."""

  def __init__(self, proto, parameter, leaves):
    self._leaves = leaves
    self._graph = tf.Graph()
    with self._graph.as_default():
      self._placeholders = []

      def build(t):
        if isinstance(t, tff.StructType):
          return tff.structure.Struct(
              [(n, build(e)) for n, e in tff.structure.iter_elements(t)])
        if isinstance(t, tff.SequenceType):
          placeholder = tf.compat.v1.placeholder(tf.string, [])
          self._placeholders.append(placeholder)
          return tf.data.experimental.from_variant(
              tf.raw_ops.DatasetFromGraph(graph_def=placeholder),
              _element_spec(t.element))
        placeholder = tf.compat.v1.placeholder(t.dtype, t.shape)
        self._placeholders.append(placeholder)
        return placeholder

      arg = None if parameter is None else build(parameter)
      token = tf.constant('inprocess', tf.string)
      self._init, result = tensorflow_utils.deserialize_and_call_tf_computation(
          proto, arg, self._graph, f'session_{next(_STAMPS)}', token)
      self._outputs = (tff.structure.flatten(result) if isinstance(
          result, tff.structure.Struct) else [result])
    self._session = tf.compat.v1.Session(graph=self._graph,
                                         config=_SESSION_CONFIG)

  def __call__(self, values):
    feed = {}
    for placeholder, value, leaf in zip(self._placeholders, values,
                                        self._leaves, strict=True):
      if isinstance(leaf, tff.SequenceType):
        if not isinstance(value, tf.data.Dataset):
          raise TypeError(f'a tf.data.Dataset is expected for {leaf}, got '
                          f'{type(value).__name__}')
        try:
          value = tf.raw_ops.DatasetToGraphV2(
              input_dataset=tf.data.experimental.to_variant(
                  value.with_options(_NO_DATA_OPTIMIZATION)),
              external_state_policy=2).numpy()  # 2: fail on Python state.
        except (tf.errors.FailedPreconditionError,
                tf.errors.InvalidArgumentError, tf.errors.UnimplementedError):
          return None
      else:
        value = np.asarray(value, leaf.dtype)
      feed[placeholder] = value
    if self._init is not None:
      self._session.run(self._init, feed)
    return self._session.run(self._outputs, feed) if self._outputs else []


_SAME_LEAVES = {}


def _as(value, from_type, to_type):
  """`value` (of `from_type`) in `to_type`'s containers: the same leaves
  (checked once per pair of types)."""
  _check_same_leaves(from_type, to_type)
  return packed(value_leaves(value, from_type), to_type)


def _check_same_leaves(from_type, to_type):
  """Raises NotInProcessError unless the two types have the same leaves
  (checked once per pair of types)."""
  key = (id(from_type), id(to_type))
  if key not in _SAME_LEAVES:
    got, want = _type_leaves(from_type), _type_leaves(to_type)
    if len(got) != len(want) or any(
        not a.is_equivalent_to(b) for a, b in zip(got, want)):
      raise NotInProcessError(f'the compiled form gives {from_type} where '
                              f'the process gives {to_type}')
    _SAME_LEAVES[key] = (from_type, to_type)  # Keeps the ids in use.


class InProcessRound:
  """A process's round, its production form run in this Python process.

  `initialize()` and `next(state, client_states, datasets)` keep
  `StatefulClientProcess`'s contract (`core/process.py`), which the
  training loop calls. `pieces` maps each of `PIECES` to its
  `InProcessComputation` (`calls` counts its calls).

  Attributes:
    process: the `StatefulClientProcess` it was made from.
    form: its `production.ProductionForm`.
  """

  def __init__(self, process):
    self.process = process
    try:
      self.form = production.production_form(process)
      mrf = self.form.map_reduce_form()
      initialize = (
          tff.backends.mapreduce.get_state_initialization_computation(
              process.initialize,
              grappler_config=production._NO_GRAPPLER))  # pylint: disable=protected-access
      device = self.form.device_program()
    except (production.NotProductionReadyError, TypeError) as e:
      raise NotInProcessError(
          f'{type(process).__name__} has no in-process round: {e}') from e
    self.pieces = collections.OrderedDict(
        [('initialize', InProcessComputation(initialize, 'initialize'))] +
        [(name, InProcessComputation(
            device if name == 'device' else getattr(mrf, name), name))
         for name in PIECES])
    signature = process.next.type_signature
    self._state_type = signature.result[0].member
    self._client_state_type = signature.result[1].member
    self._metrics_type = signature.result[2].member
    self._form_state_type = mrf.prepare.type_signature.parameter
    self._mrf = mrf
    self._device = device
    self._fused = {}  # Cohort size -> its `_FusedRound`, built on use.
    # Whether `next` runs the round as one graph where it can (clients'
    # inputs of tensors only, one accumulator); False: piece by piece.
    self.fuse = not any(isinstance(t, tff.SequenceType) for t in _type_leaves(
        device.type_signature.parameter[0]))

  def __getattr__(self, name):
    # Read-only views of the process (its types, model functions) for code
    # that takes a process: only `initialize` and `next` run differently.
    if name in ('process', 'form', 'pieces') or name.startswith('_'):
      raise AttributeError(name)
    return getattr(self.process, name)

  def initialize(self):
    """The server's initial state, as `process.initialize()` gives it."""
    init = self.pieces['initialize']
    return _as(init(), init.type_signature.result, self._state_type)

  def next(self, state, client_states: Sequence[Any],
           datasets: Sequence[Any], merge_after: int = 0):
    """One round: `(new_state, new_client_states, metrics)`, as
    `process.next(state, client_states, datasets)` gives them.

    Args:
      state: the server state (of either round).
      client_states: each client's state.
      datasets: each client's `tf.data.Dataset`.
      merge_after: the first accumulator takes this many clients and a
        second the rest, joined by `merge` (0: one accumulator).
    """
    client_states, datasets = list(client_states), list(datasets)
    if len(client_states) != len(datasets):
      raise ValueError(f'{len(client_states)} client states for '
                       f'{len(datasets)} datasets')
    if self.fuse and not merge_after:
      return self._next_fused(state, client_states, datasets)
    p = self.pieces
    state = _as(state, self._state_type, self._form_state_type)
    broadcast = p['prepare'](state)
    uploads, new_client_states = [], []
    result_type = p['device'].type_signature.result
    for client_state, data in zip(client_states, datasets):
      out = p['device']({'client_state': client_state, 'data': data},
                        broadcast)
      uploads.append(out['upload'] if isinstance(out, Mapping) else out[0])
      new_client_states.append(_as(
          out['client_state'] if isinstance(out, Mapping) else out[1],
          result_type.client_state, self._client_state_type))
    new_state, metrics = production._reduce(  # pylint: disable=protected-access
        _Pieces(p), state, uploads, merge_after)
    update_result = p['update'].type_signature.result
    return (_as(new_state, update_result[0], self._state_type),
            new_client_states,
            _as(metrics, update_result[1], self._metrics_type))

  def _next_fused(self, state, client_states, datasets):
    """`next` as one session call (`_FusedRound`, one per cohort size)."""
    count = len(datasets)
    update_result = self._mrf.update.type_signature.result
    client_type = self._device.type_signature.result[1]
    if count not in self._fused:
      for pair in ((self._state_type, self._form_state_type),
                   (update_result[0], self._state_type),
                   (client_type, self._client_state_type),
                   (update_result[1], self._metrics_type)):
        _check_same_leaves(*pair)
      self._fused[count] = _FusedRound(self._mrf, self._device, count)
    inputs = self._device.type_signature.parameter[0]
    state_leaves = value_leaves(state, self._state_type)
    client_leaves = [
        value_leaves({'client_state': c, 'data': d}, inputs)
        for c, d in zip(client_states, datasets)]
    new_state, metrics, new_clients = self._fused[count](state_leaves,
                                                         client_leaves)
    return (packed(new_state, self._state_type),
            [packed(c, self._client_state_type) for c in new_clients],
            packed(metrics, self._metrics_type))


def _callable(session, feeds, fetches, targets=()):
  """`session`'s callable of `feeds` (placeholders) to `fetches` (a list
  of numpy arrays), running `targets` too: TensorFlow's own callable
  (`Session._make_callable_from_options`, as Keras's graph functions use),
  without `Session.run`'s per-call handling of feeds and fetches."""
  options = config_pb2.CallableOptions()
  options.feed.extend(t.name for t in feeds)
  options.fetch.extend(t.name for t in fetches)
  options.target.extend(op.name for op in targets)
  return session._make_callable_from_options(options)  # pylint: disable=protected-access


def _struct(type_spec, values):
  """`values` (one per element of the struct type `type_spec`) as a
  `tff.structure.Struct` named as the type."""
  return tff.structure.Struct(
      [(name, v) for (name, _), v in zip(
          tff.structure.iter_elements(type_spec), values, strict=True)])


def _flat(value) -> list:
  """The leaves of a value a stamped computation returned."""
  if isinstance(value, tff.structure.Struct):
    return tff.structure.flatten(value)
  return [value]


class _FusedRound:
  """A round of `clients` clients as one graph, run in one session call.

  The compiled pieces are stamped into one graph in the round's order:
  `prepare` on the server state; the device program once per client on
  its input and the broadcast; `zero`, then `accumulate` over the uploads
  in client order; `report`; each secure sum as the plain sum of the
  clients' summands (the modular one `% modulus`); `update` on the state
  and those. The same pieces and order as `InProcessRound.next`'s piece by
  piece path (which `production._reduce` shares with
  `ProductionForm.run_map_reduce_round`); one call instead of one per
  piece. Every stamp's initialization runs before each call. Clients'
  inputs must be tensors (a sharded round's); sequences take the piece by
  piece path.

  Called with the state's leaves and each client's input leaves (in the
  types' order), it returns `(state leaves, metrics leaves, [each client's
  new state leaves])`.
  """

  def __init__(self, mrf, device, clients: int):
    graph = tf.Graph()
    placeholders = []
    inits = []
    token_holder = []

    def feed(t):
      if isinstance(t, tff.StructType):
        return _struct(t, [feed(e) for _, e in
                           tff.structure.iter_elements(t)])
      if not isinstance(t, tff.TensorType):
        raise NotInProcessError(f'a fused round takes tensors, not {t}')
      placeholder = tf.compat.v1.placeholder(t.dtype, t.shape)
      placeholders.append(placeholder)
      return placeholder

    def call(computation, arg):
      proto = computation_impl.ConcreteComputation.get_proto(computation)
      init, result = tensorflow_utils.deserialize_and_call_tf_computation(
          proto, arg, graph, f'fused_{next(_STAMPS)}', token_holder[0])
      if init is not None:
        inits.append(init)
      return result

    def pair(computation, first, second):
      return call(computation, _struct(
          computation.type_signature.parameter, [first, second]))

    with graph.as_default():
      token_holder.append(tf.constant('inprocess', tf.string))
      state = feed(mrf.prepare.type_signature.parameter)
      inputs = [feed(device.type_signature.parameter[0])
                for _ in range(clients)]
      self._state_count = len(_flat(state))
      broadcast = call(mrf.prepare, state)
      outs = [pair(device, i, broadcast) for i in inputs]
      accumulator = call(mrf.zero, None)
      for out in outs:
        accumulator = pair(mrf.accumulate, accumulator, out[0][0])
      update_arg = mrf.update.type_signature.parameter
      secure = []
      for kind in (1, 2, 3):
        summands = [_flat(out[0][kind]) for out in outs]
        sums = [tf.math.add_n(list(leaf)) if len(leaf) > 1 else leaf[0]
                for leaf in zip(*summands)]
        if kind == 3 and sums:
          moduli = _flat(call(mrf.secure_modular_sum_modulus, None))
          if len(moduli) == 1:
            moduli = moduli * len(sums)
          sums = [v % tf.cast(m, v.dtype) for v, m in zip(sums, moduli,
                                                          strict=True)]
        it = iter(sums)

        def build(t, it=it):
          if isinstance(t, tff.StructType):
            return _struct(t, [build(e) for _, e in
                               tff.structure.iter_elements(t)])
          return next(it)

        secure.append(build(update_arg[1][kind]))
      report = call(mrf.report, accumulator)
      new_state, metrics = pair(
          mrf.update, state, _struct(update_arg[1], [report, *secure]))
      self._counts = (len(_flat(new_state)), len(_flat(metrics)))
      fetches = _flat(new_state) + _flat(metrics)
      self._client_count = len(_flat(outs[0][1])) if outs else 0
      for out in outs:
        fetches += _flat(out[1])
      fetches = [tf.identity(t) for t in fetches]
      init = tf.group(*inits) if inits else None
    self._session = tf.compat.v1.Session(graph=graph, config=_SESSION_CONFIG)
    self._run = _callable(self._session, placeholders, fetches)
    self._init = (_callable(self._session, placeholders, [], [init])
                  if init is not None else None)
    self._feed_types = [(p.dtype.as_numpy_dtype) for p in placeholders]

  def __call__(self, state_leaves, client_leaves):
    values = [np.asarray(v, t) for v, t in zip(
        list(state_leaves) + [x for c in client_leaves for x in c],
        self._feed_types, strict=True)]
    if self._init is not None:
      self._init(*values)
    out = self._run(*values)
    states, metrics = self._counts
    rest = out[states + metrics:]
    k = self._client_count
    return (out[:states], out[states:states + metrics],
            [rest[i * k:(i + 1) * k] for i in range(len(client_leaves))])


class _Pieces:
  """The in-process pieces under `MapReduceForm`'s attribute names, for
  `production._reduce`."""

  def __init__(self, pieces: Mapping[str, Callable]):
    self.__dict__.update(pieces)


def build(process) -> InProcessRound:
  """The in-process round of a `StatefulClientProcess` (module docstring).

  Raises:
    NotInProcessError: its round does not compile to MapReduceForm, or a
      piece is not one TensorFlow computation (the message says why).
  """
  return InProcessRound(process)
