"""A process's production forms: what a TFF production pipeline executes.

A simulation's round is `(S@SERVER, {C}@CLIENTS, {D*}@CLIENTS) ->
(S@SERVER, {C}@CLIENTS, M@SERVER)`: the driver keeps every client's private
state `C` in a store. A production platform keeps no client-placed value
between rounds: the device holds its own private state, reads it with its
data, trains once, writes the new state back locally, and uploads only what
the round aggregates. `production_form(process)` gives that split of any
`StatefulClientProcess`:

* `next`: `(S@SERVER, {<client_state=C, data=D*>}@CLIENTS) -> (S@SERVER,
  M@SERVER)`, the simulation's round with the new client states dropped
  from its outputs; its clients take their state as input and every output
  is server-placed, the shape `tff.backends.mapreduce` compiles to
  `MapReduceForm` and `DistributeAggregateForm` (`map_reduce_form()`,
  `distribute_aggregate_form()`).
* `device_program()`: the one computation a device runs per round,
  `(<client_state=C, data=D*>, broadcast) -> <upload, client_state=C>`:
  the compiled form's own client computation (`MapReduceForm.work`), which
  trains once and gives the upload (the update as the process's aggregator
  prepares it on the client: clipped under DP, encoded under secure
  aggregation; the training-metric sums only where the round releases
  them), with the new client state, read from the same graph, as a second
  output. Only `upload` may leave the device.
* `client_work`: the client's training step alone (`(ModelWeights, C, D*)
  -> <update, update_weight, client_state, metrics>`): its update is not
  clipped or noised and its metrics are not released, so it is never what
  a device sends.
* `initialize`: the server's initial state.

A multi-stage algorithm (`core/stages.py`) has one form per stage
(`production_forms`). The DP and secure aggregators are the process's own:
build the process with the aggregator the run uses (`privacy.
build_aggregator`). Written here because TFF's learning templates have no
client-state input; the compilation is TFF's.

Example:

  form = production.production_form(process)
  new_state, metrics, new_states = form.run_map_reduce_round(
      state, client_states, datasets)
  out = form.device_program()(
      {'client_state': client_states[0], 'data': datasets[0]},
      form.map_reduce_form().prepare(state))
  upload, new_client_state = out.upload, out.client_state
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import re
from typing import Any, Mapping, Sequence

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff
# TFF's own serialization of TensorFlow computations, read and extended
# here: a device program is a compiled client computation with one more
# output (`_with_new_client_state`).
from tensorflow_federated.proto.v0 import computation_pb2 as pb
from tensorflow_federated.python.core.backends.mapreduce import (
    compiler as mapreduce_compiler)
from tensorflow_federated.python.core.impl.computation import computation_impl
from tensorflow_federated.python.core.impl.context_stack import (
    context_stack_impl)
from tensorflow_federated.python.core.impl.types import type_serialization
from tensorflow_federated.python.tensorflow_libs import graph_utils
from tensorflow_federated.python.tensorflow_libs import serialization_utils

from tff_personal.core import process as process_lib
from tff_personal.core import split_training
from tff_personal.core import stages as stages_lib


class NotProductionReadyError(ValueError):
  """A process cannot be put in a production form; the message says why."""


# (algorithm, DP mechanism) pairs whose round does not compile, and why
# (docs/production.md gives the nearest form that does).
NOT_COMPILED: dict[tuple[str, str], str] = {
    ('fedembed_som', 'none'): (
        'compiles to MapReduceForm, not to DistributeAggregateForm: the '
        'paper\'s best-scoring SOM update is chosen by an aggregation whose '
        'merge step is a function placed at the server, which that form '
        'cannot hold (and it hands one client\'s update to the server '
        'verbatim); with gaussian_fixed its noised SOM average compiles to '
        'both'),
}

# The forms' TensorFlow is compiled as traced, without Grappler: Grappler
# would prune the new client state, which the round's client computation
# computes but does not output, and the device program reads it from that
# graph. (TensorFlow's runtime still optimizes a graph when it runs it.)
_NO_GRAPPLER = tf.compat.v1.ConfigProto()
_NO_GRAPPLER.graph_options.rewrite_options.disable_meta_optimizer = True


@dataclasses.dataclass(frozen=True)
class ProductionForm:
  """One process's production split (module docstring).

  Attributes:
    process: the `StatefulClientProcess` it was made from.
    initialize: `() -> S@SERVER`, the process's own.
    next: `(S@SERVER, {<client_state=C, data=D*>}@CLIENTS) -> (S@SERVER,
      M@SERVER)`.
    client_work: the client's training step, `(ModelWeights, C, D*) ->
      <update, update_weight, client_state, metrics, ...>`: its update is
      neither clipped nor noised; a device uploads `device_program()`'s
      `upload`, never this.
  """
  process: Any
  initialize: tff.Computation
  next: tff.Computation
  client_work: tff.Computation

  @functools.cached_property
  def _map_reduce_form(self):
    return _compiled(
        functools.partial(
            tff.backends.mapreduce.get_map_reduce_form_for_computation,
            grappler_config=_NO_GRAPPLER),
        self.next, 'MapReduceForm')

  def map_reduce_form(self) -> tff.backends.mapreduce.MapReduceForm:
    """`next` compiled to TFF's `MapReduceForm` (cached)."""
    return self._map_reduce_form

  @functools.cached_property
  def _distribute_aggregate_form(self):
    return _compiled(
        tff.backends.mapreduce.get_distribute_aggregate_form_for_computation,
        self.next, 'DistributeAggregateForm')

  def distribute_aggregate_form(
      self) -> tff.backends.mapreduce.DistributeAggregateForm:
    """`next` compiled to TFF's `DistributeAggregateForm` (cached)."""
    return self._distribute_aggregate_form

  @functools.cached_property
  def _device_programs(self):
    return {}

  def device_program(self, form: str = 'map_reduce') -> tff.Computation:
    """The computation a device runs once per round (cached).

    `(<client_state=C, data=D*>, broadcast) -> <upload, client_state=C>`:
    the compiled form's client computation (`MapReduceForm.work`, or
    `DistributeAggregateForm.client_work` as one TensorFlow computation)
    with the new client state it computes as a second output. `upload` is
    exactly that computation's output, all that leaves the device;
    `client_state` is written back on the device.

    Args:
      form: 'map_reduce' (`broadcast` is `map_reduce_form().prepare`'s
        output) or 'distribute_aggregate' (`broadcast` is what
        `server_to_client_broadcast` hands each client).

    Raises:
      NotProductionReadyError: the round does not compile to that form.
    """
    if form not in self._device_programs:
      if form == 'map_reduce':
        client = self.map_reduce_form().work
      elif form == 'distribute_aggregate':
        client = _as_tensorflow(self.distribute_aggregate_form().client_work)
      else:
        raise ValueError(f'form must be map_reduce or distribute_aggregate, '
                         f'got {form!r}')
      self._device_programs[form] = _with_new_client_state(
          client, self.process.client_state_type)
    return self._device_programs[form]

  def broadcast_weights(self, state):
    """The global model weights of a server state."""
    if isinstance(state, Mapping):  # As `initialize` and `update` give it.
      weights = state['global_model_weights']
      if isinstance(weights, Mapping):
        weights = process_lib.ModelWeights(
            trainable=tuple(weights['trainable']),
            non_trainable=tuple(weights['non_trainable']))
      return weights
    return self.process.get_model_weights(state)

  def run_map_reduce_round(self, state, client_states: Sequence[Any],
                           datasets: Sequence[Any], merge_after: int = 0):
    """One round of `map_reduce_form()` run piece by piece, as a MapReduce
    platform does, with each client's `device_program()` run once.

    `prepare` at the server; on each device, its program (its upload and
    its new state); `zero`/`accumulate` over the uploads (two accumulators
    joined by `merge` when `merge_after` splits the cohort), `report`, the
    secure sums added up here, `update`.

    Returns:
      `(new server state, server output, new client states)`.
    """
    mrf = self.map_reduce_form()
    broadcast = mrf.prepare(state)
    uploads, new_client_states = self._run_devices(
        'map_reduce', broadcast, client_states, datasets)
    new_state, output = _reduce(mrf, state, uploads, merge_after)
    return new_state, output, new_client_states

  def run_distribute_aggregate_round(self, state,
                                     client_states: Sequence[Any],
                                     datasets: Sequence[Any]):
    """One round of `distribute_aggregate_form()` run piece by piece, with
    each client's `device_program('distribute_aggregate')` run once.

    `server_prepare`, `server_to_client_broadcast`, each device's program,
    `client_to_server_aggregation` over the uploads, `server_result`.

    Returns:
      `(new server state, server output, new client states)`.
    """
    daf = self.distribute_aggregate_form()
    to_broadcast, temporary = _elements(daf.server_prepare(state))
    # `server_to_client_broadcast` holds broadcasts only (the form's
    # contract): each device receives the server's values as they are.
    _check_broadcasts(daf.server_to_client_broadcast)
    broadcast = to_broadcast
    uploads, new_client_states = self._run_devices(
        'distribute_aggregate', broadcast, client_states, datasets)
    upload_type = daf.client_to_server_aggregation.type_signature.parameter[1]
    aggregated = daf.client_to_server_aggregation(
        temporary, _at_clients(uploads, upload_type))
    new_state, output = _elements(daf.server_result(temporary, aggregated))
    return new_state, output, new_client_states

  def _run_devices(self, form: str, broadcast, client_states, datasets):
    """`([upload], [new client state])`: each device's program, once."""
    program = self.device_program(form)
    uploads, new_client_states = [], []
    for client_state, data in zip(client_states, datasets, strict=True):
      out = program({'client_state': client_state, 'data': data}, broadcast)
      uploads.append(_field(out, 'upload'))
      new_client_states.append(_field(out, 'client_state'))
    return uploads, new_client_states


def _compiled(compile_fn, computation, form: str):
  """`compile_fn(computation)`; TFF's refusal as `NotProductionReadyError`."""
  try:
    return compile_fn(computation)
  except (ValueError, TypeError) as e:
    raise NotProductionReadyError(
        f'the round does not compile to {form}: {e}') from e


def _as_tensorflow(computation: tff.Computation) -> tff.Computation:
  """A CLIENTS-placed federated computation (`DistributeAggregateForm`'s
  `client_work`) as one TensorFlow computation of one client, compiled by
  TFF's MapReduce compiler without Grappler."""
  block = mapreduce_compiler.consolidate_and_extract_local_processing(
      computation.to_building_block(), _NO_GRAPPLER)
  return computation_impl.ConcreteComputation(
      computation_proto=block.proto,
      context_stack=context_stack_impl.context_stack)


def _type_leaves(type_spec: tff.Type) -> list:
  """The leaves (tensor and sequence types) of a TFF type, in order."""
  if isinstance(type_spec, tff.StructType):
    return [leaf for _, element in tff.structure.iter_elements(type_spec)
            for leaf in _type_leaves(element)]
  return [type_spec]


def _binding_leaves(binding) -> list[str]:
  """The tensor names of a TensorFlow computation's binding, in order
  (a sequence's variant tensor for a sequence)."""
  kind = binding.WhichOneof('binding')
  if kind == 'struct':
    return [name for element in binding.struct.element
            for name in _binding_leaves(element)]
  if kind == 'tensor':
    return [binding.tensor.tensor_name]
  if kind == 'sequence':
    return [binding.sequence.variant_tensor_name]
  raise NotProductionReadyError(f'unexpected binding {kind!r}')


def _bound_as(type_spec: tff.Type, names) -> pb.TensorFlow.Binding:
  """The binding of `type_spec` (tensors only) to the next of `names`."""
  if isinstance(type_spec, tff.StructType):
    return pb.TensorFlow.Binding(struct=pb.TensorFlow.StructBinding(
        element=[_bound_as(t, names)
                 for _, t in tff.structure.iter_elements(type_spec)]))
  return pb.TensorFlow.Binding(
      tensor=pb.TensorFlow.TensorBinding(tensor_name=next(names)))


_STATE_NODE = re.compile(
    '(?:.*/)?' + process_lib.NEW_CLIENT_STATE_NODE.format(r'(\d+)'))


def _state_nodes(graph_def, count: int) -> list[str]:
  """The tensor names of the new client state's `count` leaves, named in
  the client work's graph (`process.name_new_client_state`)."""
  found = collections.defaultdict(list)
  for node in graph_def.node:
    match = _STATE_NODE.fullmatch(node.name)
    if match:
      found[int(match.group(1))].append(node.name)
  if sorted(found) != list(range(count)) or any(
      len(names) != 1 for names in found.values()):
    raise NotProductionReadyError(
        f'the round\'s client computation holds {dict(found)} as its new '
        f'client state, not one node for each of its {count} leaves: its '
        'client work was not built by process.client_work_from_step, or '
        'runs it more or less than once')
  return [found[i][0] + ':0' for i in range(count)]


def _with_new_client_state(client: tff.Computation,
                           client_state_type: tff.Type) -> tff.Computation:
  """`client` (a TensorFlow computation) with the new client state as a
  second output: `(...) -> <upload=client's result, client_state>`.

  The same graph, fetched at one more place: the upload is what `client`
  computes, and the new state comes from the same single pass.
  """
  proto = computation_impl.ConcreteComputation.get_proto(client)
  if proto.WhichOneof('computation') != 'tensorflow':
    raise NotProductionReadyError(
        'the round\'s client computation is not one TensorFlow computation')
  graph_def = serialization_utils.unpack_graph_def(proto.tensorflow.graph_def)
  names = _state_nodes(graph_def, len(_type_leaves(client_state_type)))
  function_type = client.type_signature
  out = pb.Computation()
  out.CopyFrom(proto)
  out.type.CopyFrom(type_serialization.serialize_type(tff.FunctionType(
      function_type.parameter, tff.StructType([
          ('upload', function_type.result),
          ('client_state', client_state_type)]))))
  out.tensorflow.result.CopyFrom(pb.TensorFlow.Binding(
      struct=pb.TensorFlow.StructBinding(element=[
          proto.tensorflow.result,
          _bound_as(client_state_type, iter(names))])))
  return computation_impl.ConcreteComputation(
      computation_proto=out, context_stack=context_stack_impl.context_stack)


def _check_broadcasts(computation: tff.Computation) -> None:
  """Raises unless `computation` hands each client its server values
  unchanged (each result element the parameter's, now at CLIENTS)."""
  signature = computation.type_signature
  ins = [t.member for _, t in tff.structure.iter_elements(signature.parameter)]
  outs = [t for _, t in tff.structure.iter_elements(signature.result)]
  if len(ins) != len(outs) or not all(
      o.placement == tff.CLIENTS and o.all_equal and o.member.is_equivalent_to(
          i) for i, o in zip(ins, outs)):
    raise NotProductionReadyError(
        f'server_to_client_broadcast is {signature}, not a broadcast of its '
        'arguments')


def _elements(value) -> list:
  """The elements of a TFF result, in order (of a named one, its values)."""
  return list(value.values()) if isinstance(value, Mapping) else list(value)


def _field(value, name: str):
  """A named field of a TFF result (an `OrderedDict` or a `Struct`)."""
  return value[name] if isinstance(value, Mapping) else getattr(value, name)


def _at_clients(uploads: Sequence[Any], upload_type: tff.Type):
  """The clients' uploads as a value of `upload_type`: one list where it
  is CLIENTS-placed, else (a struct of CLIENTS-placed values) one list per
  element."""
  if isinstance(upload_type, tff.FederatedType):
    return list(uploads)
  return [_at_clients([u[i] for u in uploads], t) for i, (_, t) in enumerate(
      tff.structure.iter_elements(upload_type))]


def production_form(process) -> ProductionForm:
  """The production split of a `StatefulClientProcess`.

  Raises:
    NotProductionReadyError: the process records neither a per-user client
      step nor a client work of its own types (its client work was given
      only inside its round), so its device part cannot be taken out.
  """
  composition = process.composition
  # The round's own client work where it was recorded with the process's
  # types (its parameters' names aside); else the same step traced here.
  client_work = None if composition is None else composition.client_work
  want = (process.model_weights_type, process.client_state_type,
          process.client_data_type)
  if client_work is None or not _takes(client_work, want):
    if composition is None or composition.client_step is None:
      raise NotProductionReadyError(
          f'{type(process).__name__} records no per-user client step '
          '(compose_stateful_client_process(client_step=...)), so its '
          'device part cannot be taken out of its round')
    client_work = process_lib.client_work_from_step(
        composition.client_step, process.model_weights_type,
        process.client_state_type, process.client_data_type)
  state_type = process.state_type
  client_type = tff.StructType([
      ('client_state', process.client_state_type),
      ('data', process.client_data_type)])
  round_fn = process.next

  @tff.federated_computation(state_type,
                             tff.FederatedType(client_type, tff.CLIENTS))
  def next_fn(state, clients):
    new_state, _, measurements = round_fn(state, clients.client_state,
                                          clients.data)
    return new_state, measurements

  return ProductionForm(process=process, initialize=process.initialize,
                        next=next_fn, client_work=client_work)


def _takes(computation: tff.Computation, types: Sequence[tff.Type]) -> bool:
  """Whether `computation`'s parameters are of `types`, in order."""
  parameter = computation.type_signature.parameter
  return (isinstance(parameter, tff.StructType) and
          len(parameter) == len(types) and
          all(p.is_equivalent_to(t) for p, t in zip(parameter, types)))


def production_forms(built) -> list[tuple[str, ProductionForm]]:
  """`(stage name, form)` for each stage of a built algorithm (one
  `('train', form)` for a single-stage one), in the order they run."""
  if isinstance(built, stages_lib.Staged):
    return [(stage.name, production_form(stage.process))
            for stage in built.stages]
  return [('train', production_form(built))]


def run_map_reduce_round(mrf: tff.backends.mapreduce.MapReduceForm, state,
                         client_inputs: Sequence[Any], merge_after: int = 0):
  """One round of `mrf` run piece by piece, as a MapReduce platform does.

  `prepare` at the server, `work` on each client, `zero`/`accumulate` over
  the client updates (two accumulators joined by `merge` when `merge_after`
  splits the cohort), `report`, the secure sums added up here, `update`.
  (A `ProductionForm`'s round, whose devices also keep their new state:
  `ProductionForm.run_map_reduce_round`.)

  Args:
    mrf: a `MapReduceForm`.
    state: the server state.
    client_inputs: each client's data (`<client_state, data>` for a
      `ProductionForm`).
    merge_after: the first accumulator takes this many clients and a second
      the rest, then `merge` joins them (0: one accumulator).

  Returns:
    `(new server state, server output)`.
  """
  client_input = mrf.prepare(state)
  uploads = [mrf.work(data, client_input) for data in client_inputs]
  return _reduce(mrf, state, uploads, merge_after)


def _reduce(mrf: tff.backends.mapreduce.MapReduceForm, state,
            uploads: Sequence[Any], merge_after: int):
  """`mrf`'s server side over the clients' `work` outputs: `(new server
  state, server output)`."""
  parts = [uploads[:merge_after], uploads[merge_after:]] if (
      merge_after) else [uploads]
  accumulators = []
  for part in parts:
    accumulator = mrf.zero()
    for out in part:
      accumulator = mrf.accumulate(accumulator, out[0])
    accumulators.append(accumulator)
  accumulator = accumulators[0]
  for other in accumulators[1:]:
    accumulator = mrf.merge(accumulator, other)
  secure = [_secure_sum([out[i] for out in uploads]) for i in (1, 2, 3)]
  modulus = mrf.secure_modular_sum_modulus()
  secure[2] = _map(lambda v, m: v % m, secure[2], modulus)
  return mrf.update(state, (mrf.report(accumulator), *secure))


def secure_sum_bits(mrf: tff.backends.mapreduce.MapReduceForm,
                    clients: int, scalars: bool = True) -> dict[str, int]:
  """What one client uploads on `mrf`'s secure-sum path, in bits.

  `tff`: as TFF's tensors hold it (`work`'s outputs 1 to 3: each
  coordinate is an int32 or int64). `secagg`: under secure aggregation's
  modulus, for a cohort of `clients`: a `federated_secure_sum_bitwidth`
  summand of bitwidth b is masked modulo 2^(b + ceil(log2 clients)), the
  sum's range; one of `federated_secure_sum` with maximum input m modulo
  the sum's range, (m + 1) * clients; one of
  `federated_secure_modular_sum` modulo its modulus. (SecAgg's own key
  agreement and masking messages come on top.)

  Args:
    mrf: a `MapReduceForm` (`ProductionForm.map_reduce_form()`).
    clients: the cohort's size.
    scalars: count the 0-d summands too (False: the tensors with a shape,
      an update's coordinates).

  Returns:
    `{'tff': bits, 'secagg': bits}`.
  """
  result = mrf.work.type_signature.result
  bounds = (mrf.secure_sum_bitwidth(), mrf.secure_sum_max_input(),
            mrf.secure_modular_sum_modulus())
  headroom = math.ceil(math.log2(clients)) if clients > 1 else 0
  modulus_bits = (
      lambda bound: int(bound) + headroom,
      lambda bound: math.ceil(math.log2((int(bound) + 1) * clients)),
      lambda bound: math.ceil(math.log2(int(bound))))
  total = {'tff': 0, 'secagg': 0}
  for kind in range(3):
    leaves = _type_leaves(result[kind + 1])
    limits = tf.nest.flatten(bounds[kind])
    if len(limits) == 1 and len(leaves) > 1:
      limits = limits * len(leaves)
    for leaf, bound in zip(leaves, limits, strict=True):
      if not scalars and not leaf.shape:
        continue
      count = int(np.prod(leaf.shape, dtype=np.int64))
      total['tff'] += count * np.dtype(leaf.dtype).itemsize * 8
      total['secagg'] += count * modulus_bits[kind](bound)
  return total


# How the secure aggregators lay an update out on the secure-sum path, as
# compiled (tests/production_test.py): (bits of TFF's integer, bitwidth).
# `tff.learning.secure_aggregator()` quantizes each coordinate to 32 bits in
# an int64; `privacy`'s distributed_dgauss pads the update
# (`privacy.ddp_padded_dimension`) and sums int32s of `privacy.DDP_BITS`.
SECURE_LAYOUTS = {'secure_aggregator': (64, 32),
                  'distributed_dgauss': (32, 20)}


def update_secure_sum_bits(coordinates: int, clients: int,
                           layout: str) -> dict[str, int]:
  """`secure_sum_bits(mrf, clients, scalars=False)` of a form whose update
  has `coordinates` coordinates (padded, for distributed_dgauss) on the
  secure-sum path laid out as `SECURE_LAYOUTS[layout]`, without compiling
  it: `{'tff': bits, 'secagg': bits}`."""
  tff_bits, bitwidth = SECURE_LAYOUTS[layout]
  headroom = math.ceil(math.log2(clients)) if clients > 1 else 0
  return {'tff': coordinates * tff_bits,
          'secagg': coordinates * (bitwidth + headroom)}


def _secure_sum(values):
  """The plain sum of the clients' secure-sum inputs (the platform's
  secure aggregation computes the same sum without seeing them)."""
  if not values:
    return ()
  total = values[0]
  for value in values[1:]:
    total = _map(lambda a, b: a + b, total, value)
  return total


def _map(fn, *structures):
  return tf.nest.map_structure(fn, *structures)


def _tracked_module(build):
  """`(tf.Module tracking every variable `build()` creates, its result)`."""
  created = []

  def creator(next_creator, **kwargs):
    variable = next_creator(**kwargs)
    created.append(variable)
    return variable

  with tf.variable_creator_scope(creator):
    result = build()
  module = tf.Module()
  module.created_variables = created
  return module, result


# The serving signatures the exports write.
DEVICE_SIGNATURE = 'local_update'
PREDICT_SIGNATURE = 'predict'


def _leaf_paths(type_spec: tff.Type, prefix: str) -> list[str]:
  """Each leaf's path in a TFF type (`prefix.name[0]`), in order."""
  if isinstance(type_spec, tff.StructType):
    return [path for i, (name, element) in enumerate(
        tff.structure.iter_elements(type_spec)) for path in _leaf_paths(
            element, f'{prefix}.{name}' if name else f'{prefix}[{i}]')]
  return [prefix]


def device_signature(form: ProductionForm) -> dict:
  """The names of `export_device_program`'s `local_update` signature.

  Returns:
    `{'inputs': {name: (what it is, dtype, shape)}, 'outputs': {...}}`:
    `broadcast_<i>` is leaf i of what the server broadcasts
    (`map_reduce_form().prepare`'s output), `state_<i>` leaf i of the
    client state (in and out), `example_<key>` the client's examples
    (unbatched; the program batches them), `upload_<i>` leaf i of the
    upload.
  """
  program = form.device_program()
  parameter, result = (program.type_signature.parameter,
                       program.type_signature.result)
  state_type = parameter[0].client_state
  spec = lambda t: (t.dtype.name, [None if d is None else int(d)
                                   for d in t.shape])
  inputs, outputs = {}, {}
  for kind, type_spec, names in (
      ('broadcast', parameter[1], inputs), ('state', state_type, inputs),
      ('upload', result.upload, outputs), ('state', result.client_state,
                                           outputs)):
    for i, (path, leaf) in enumerate(zip(
        _leaf_paths(type_spec, kind), _type_leaves(type_spec), strict=True)):
      names[f'{kind}_{i:03d}'] = (path,) + spec(leaf)
  element = tff.types.type_to_tf_tensor_specs(
      form.process.client_data_type.element)
  for key, leaf in _example_items(element):
    inputs[f'example_{key}'] = (f'data.{key}', leaf.dtype.name,
                                [None] + list(leaf.shape[1:]))
  return {'inputs': inputs, 'outputs': outputs}


def _example_items(element) -> list:
  """`(key, spec)` of a batch's element specs (a dict, or a tuple/one
  tensor indexed)."""
  if isinstance(element, Mapping):
    return list(element.items())
  return list(enumerate(tf.nest.flatten(element)))


def device_inputs(form: ProductionForm, broadcast, client_state,
                  examples: Mapping[Any, np.ndarray]) -> dict:
  """The `local_update` inputs of one device, as numpy arrays by name.

  Args:
    form: the production form the device program was exported from.
    broadcast: what the server sends (`map_reduce_form().prepare(state)`).
    client_state: the device's client state.
    examples: the device's examples, each key's unbatched array.
  """
  program = form.device_program()
  out = broadcast_inputs(form, broadcast)
  out.update(_named_leaves('state', client_state,
                           program.type_signature.parameter[0].client_state))
  for key, value in examples.items():
    out[f'example_{key}'] = np.asarray(value)
  return out


def broadcast_inputs(form: ProductionForm, broadcast) -> dict:
  """`broadcast` (`map_reduce_form().prepare(state)`) as the
  `broadcast_<i>` inputs of `local_update`."""
  return _named_leaves('broadcast', broadcast,
                       form.device_program().type_signature.parameter[1])


def _named_leaves(kind: str, value, type_spec: tff.Type) -> dict:
  leaves = _value_leaves(value)
  if len(leaves) != len(_type_leaves(type_spec)):
    raise ValueError(f'{kind}: {len(leaves)} leaves, the device program '
                     f'takes {len(_type_leaves(type_spec))}')
  return {f'{kind}_{i:03d}': np.asarray(leaf)
          for i, leaf in enumerate(leaves)}


def _value_leaves(value) -> list:
  """A TFF value's leaves in its type's order (a `Struct`, or Python
  containers: a mapping's insertion order, not sorted)."""
  return tff.structure.flatten(tff.structure.from_container(
      value, recursive=True)) if not isinstance(
          value, (np.ndarray, np.generic, tf.Tensor, int, float)) else [value]


def device_outputs(form: ProductionForm, outputs: Mapping[str, Any]):
  """`local_update`'s named outputs as `(upload leaves, new client state)`:
  the upload's leaves in order, and the client state in its own type."""
  signature = device_signature(form)['outputs']
  upload = [np.asarray(outputs[k]) for k in sorted(signature)
            if k.startswith('upload_')]
  state = [np.asarray(outputs[k]) for k in sorted(signature)
           if k.startswith('state_')]
  state_type = form.device_program().type_signature.result.client_state
  return upload, tff.structure.to_odict_or_tuple(
      tff.structure.pack_sequence_as(
          _type_structure(state_type), state), recursive=True)


def _type_structure(type_spec: tff.Type):
  """A `Struct` shaped as `type_spec` (its leaves `None`), for packing."""
  if isinstance(type_spec, tff.StructType):
    return tff.structure.Struct([
        (name, _type_structure(t))
        for name, t in tff.structure.iter_elements(type_spec)])
  return None


def _record_variable_shapes(graph_def) -> None:
  """Writes each variable's dtype and shape into the resource arguments of
  the library functions it reaches (their `handle_data`), in place, and
  renames those functions (`<name>_device`).

  TFF's graphs leave it out; without it a loaded SavedModel infers the
  shapes in those functions from nothing, and some ops' shape functions
  refuse unknown shapes (`MatrixDiagV3` of a diagonal of unknown length).
  Follows the variables through function calls, `If`/`While` and the
  captured arguments of dataset functions (`Targuments`).
  """
  # New names: this process may hold TFF's functions of the same name, and
  # a definition now differs from theirs.
  renamed = {f.signature.name: f'{f.signature.name}_device'
             for f in graph_def.library.function}
  for node in list(graph_def.node) + [n for f in graph_def.library.function
                                      for n in f.node_def]:
    node.op = renamed.get(node.op, node.op)
    for attr in node.attr.values():
      if attr.HasField('func'):
        attr.func.name = renamed.get(attr.func.name, attr.func.name)
      for f in attr.list.func:
        f.name = renamed.get(f.name, f.name)
  for f in graph_def.library.function:
    f.signature.name = renamed[f.signature.name]
  for gradient in graph_def.library.gradient:
    gradient.function_name = renamed.get(gradient.function_name,
                                         gradient.function_name)
  library = {f.signature.name: f for f in graph_def.library.function}
  resource = tf.resource.as_datatype_enum

  def ref(name):
    name = name.split(':')[0]
    return name

  def visit(nodes, known):
    for node in nodes:
      inputs = [i for i in node.input if not i.startswith('^')]
      infos = [known.get(ref(i)) for i in inputs]
      if node.op == 'Identity' and infos and infos[0]:
        known[node.name] = infos[0]
      for attr in node.attr.values():
        names = ([attr.func.name] if attr.HasField('func') else
                 [f.name for f in attr.list.func])
        for name in names:
          if name not in library:
            continue
          args = list(library[name].signature.input_arg)
          if 'Targuments' in node.attr:  # A dataset function's captures.
            count = len(node.attr['Targuments'].list.type)
            pairs = zip(infos[len(infos) - count:], args[len(args) - count:])
          elif node.op in ('If', 'StatelessIf'):
            pairs = zip(infos[1:], args)
          else:  # Calls, While: argument i is input i.
            pairs = zip(infos, args)
          inner = {}
          for i, (info, arg) in enumerate(pairs):
            if info is not None and arg.type == resource:
              if not arg.handle_data:
                arg.handle_data.add(dtype=info[0], shape=info[1])
              index = args.index(arg)
              attrs = library[name].arg_attr[index].attr
              attrs['_handle_dtypes'].list.type[:] = [info[0]]
              attrs['_handle_shapes'].list.shape.add().CopyFrom(info[1])
              inner[arg.name] = info
          if inner:
            _shape_reads(library[name], inner)
            visit(library[name].node_def, inner)

  visit(graph_def.node, {
      node.name: (node.attr['dtype'].type, node.attr['shape'].shape)
      for node in graph_def.node if node.op == 'VarHandleOp'})


def _shape_reads(function, known: dict) -> None:
  """Follows each read of a resource argument of `function` whose shape is
  `known` by an `EnsureShape` of that shape, which its readers take
  instead (in place).

  A loaded SavedModel imports a function before it sets its arguments'
  handle data, so a read's shape is unknown at import; `EnsureShape` gives
  it (and checks it when run), and computes the identity.
  """
  renamed = {}
  for node in list(function.node_def):
    if (node.op == 'ReadVariableOp' and node.input and
        node.input[0] in known):
      shaped = function.node_def.add(
          name=f'{node.name}/shaped', op='EnsureShape',
          input=[f'{node.name}:value:0'])
      shaped.attr['T'].type = node.attr['dtype'].type
      shaped.attr['shape'].shape.CopyFrom(known[node.input[0]][1])
      renamed[f'{node.name}:value:0'] = f'{shaped.name}:output:0'
  if not renamed:
    return
  for node in function.node_def:
    if node.op != 'EnsureShape' or not node.name.endswith('/shaped'):
      node.input[:] = [renamed.get(i, i) for i in node.input]
  for key, value in list(function.ret.items()):
    function.ret[key] = renamed.get(value, value)


def export_device_program(form: ProductionForm, path: str,
                          batch_size: int) -> dict:
  """Writes `form.device_program()` as a TF SavedModel at `path`.

  Its serving signature `local_update` (`DEVICE_SIGNATURE`) takes named
  tensors (`device_signature`): the server's broadcast, the client state
  and the client's examples (batched here by `batch_size`, in order, as the
  simulation's datasets are); it returns the upload (`upload_<i>`, all
  that leaves the device) and the new client state (`state_<i>`, kept on
  the device). It is the device program's own graph, imported: its upload
  is `map_reduce_form().work`'s output. Loading it needs TensorFlow only;
  it converts to TensorFlow Lite with Select TF ops and resource variables
  (docs/production.md).

  Example:
    export_device_program(form, '/tmp/device', batch_size=10)
    device = tf.saved_model.load('/tmp/device')
    out = device.signatures['local_update'](**device_inputs(
        form, form.map_reduce_form().prepare(state), client_state,
        examples))

  Returns:
    `device_signature(form)`.
  """
  program = form.device_program()
  proto = computation_impl.ConcreteComputation.get_proto(program)
  graph_def = serialization_utils.unpack_graph_def(proto.tensorflow.graph_def)
  parameter_names = _binding_leaves(proto.tensorflow.parameter)
  result_names = _binding_leaves(proto.tensorflow.result)
  # What the outputs need (not the initializers: the client step assigns
  # every variable it reads on entry, `process.ClientStepFactory`).
  graph_def = tf.compat.v1.graph_util.extract_sub_graph(
      graph_def, sorted({name.split(':')[0] for name in result_names}))
  token = proto.tensorflow.session_token_tensor_name
  signature = device_signature(form)
  element = tff.types.type_to_tf_tensor_specs(
      form.process.client_data_type.element)
  keys = [key for key, _ in _example_items(element)]
  specs = {name: tf.TensorSpec(shape, dtype, name=name)
           for name, (_, dtype, shape) in signature['inputs'].items()}
  order = ([n for n in signature['inputs'] if n.startswith('state_')] +
           ['dataset'] +
           [n for n in signature['inputs'] if n.startswith('broadcast_')])
  if len(order) != len(parameter_names):
    raise NotProductionReadyError(
        f'the device program takes {len(parameter_names)} tensors, its '
        f'signature names {len(order)}')
  outputs = list(signature['outputs'])
  # The graph's variables, owned by the SavedModel (TensorFlow Lite
  # converts a model's own variables, not ones its function creates). Their
  # saved values are zeros: the client step assigns every variable it
  # reads on entry (`process.ClientStepFactory`).
  _record_variable_shapes(graph_def)
  kept = {node.name for node in graph_def.node}
  module = tf.Module()
  module.variables_by_node = {}
  for node in graph_def.node:
    if node.op == 'VarHandleOp':  # Becomes an input, the variable's handle.
      module.variables_by_node[node.name] = tf.Variable(tf.zeros(
          [d.size for d in node.attr['shape'].shape.dim],
          tf.dtypes.as_dtype(node.attr['dtype'].type)), name=node.name)
      node.op = 'Placeholder'
      node.ClearField('attr')
      node.attr['dtype'].type = tf.resource.as_datatype_enum

  @tf.function(input_signature=[specs], autograph=False)
  def local_update(inputs):
    examples = [inputs[f'example_{key}'] for key in keys]
    examples = (dict(zip(keys, examples)) if isinstance(element, Mapping)
                else tf.nest.pack_sequence_as(element, examples))
    dataset = tf.data.Dataset.from_tensor_slices(examples).batch(batch_size)
    feeds = dict(inputs, dataset=tf.data.experimental.to_variant(dataset))
    input_map = graph_utils.add_control_dep_mappings(
        {name: feeds[key] for name, key in zip(parameter_names, order)})
    input_map.update({f'{name}:0': variable.handle for name, variable in
                      module.variables_by_node.items()})
    if token:
      input_map[token] = tf.constant('device')
    input_map = {k: v for k, v in input_map.items()
                 if k.lstrip('^').split(':')[0] in kept}
    fetched = tf.graph_util.import_graph_def(
        graph_def, input_map=input_map, return_elements=result_names,
        name='device')
    return {name: tf.identity(t, name=name)
            for name, t in zip(outputs, fetched, strict=True)}

  module.local_update = local_update
  tf.saved_model.save(module, path, signatures={
      DEVICE_SIGNATURE: local_update.get_concrete_function()})
  return signature


def export_personalized_model(model_fn, weights, private: Sequence[Any],
                              path: str) -> None:
  """Writes one client's personalized model as a TF SavedModel at `path`.

  The model of `model_fn` (a `SplitModel` builder: the process's
  evaluation model) with the shared `weights` and the client's `private`
  state (as evaluation takes it, `process.eval_client_states`) loaded.
  Its serving signature `predict` (`PREDICT_SIGNATURE`: `x` ->
  `prediction`), also `predict(x)` of the loaded object, gives what the
  library's evaluation reports per example (`SplitModel.predict` of the
  forward pass, training off). Loading it needs TensorFlow only; it
  converts to TensorFlow Lite with Select TF ops (docs/production.md).

  Example:
    export_personalized_model(proc.eval_model_fn, weights, private, path)
    predict = tf.saved_model.load(path).signatures['predict']
    predictions = predict(x=images)['prediction']
  """
  module, model = _tracked_module(model_fn)
  if model.eval_fn is not None:
    raise NotProductionReadyError(
        'the model reports an evaluation output that needs the targets '
        '(eval_fn), not a prediction: export its device program instead')
  split_training.assign_weights(model, weights, tuple(private))
  x_spec = process_lib.model_input_spec(model_fn)['x']

  @tf.function(input_signature=[tf.TensorSpec(x_spec.shape, x_spec.dtype)])
  def predict(x):
    return model.predict(model.forward({'x': x}, training=False))

  module.predict = predict
  tf.saved_model.save(module, path, signatures={
      PREDICT_SIGNATURE: tf.function(
          lambda x: {'prediction': predict(x)},
          input_signature=[tf.TensorSpec(x_spec.shape, x_spec.dtype,
                                         name='x')]).get_concrete_function()})
