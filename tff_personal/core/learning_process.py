"""A production form as TFF's `tff.learning.templates.LearningProcess`.

A `StatefulClientProcess` is not a `LearningProcess`: its `next` takes the
clients' states beside their data and returns them, and its model-weights
accessors are Python methods. Its production form
(`production.production_form`) is: its `next` takes each client's state as
part of the client's data and returns only server-placed values, the shape
TFF's learning programs drive. `learning_process(form)` wraps it:

* `initialize`: `() -> S@SERVER`, the process's own;
* `next`: `(S@SERVER, {<client_state=C, data=D*>}@CLIENTS) ->
  LearningProcessOutput(state=S@SERVER, metrics=M@SERVER)`, the form's round
  (the new client states are not outputs: a device keeps its own, as the
  device program gives it, `ProductionForm.device_program`);
* `get_model_weights`: `S -> ModelWeights` and `set_model_weights`:
  `<S, ModelWeights> -> S`, TensorFlow computations.

The metrics are TFF's learning layout: the training metrics (where the
round releases them) under `client_work/train`, where
`tff.learning.programs.train_model` and TFF's metric release read them, and
the aggregator's and finalizer's measurements (and any of the process's
own) under their names.

TFF 0.87's `tff.program.NativeFederatedContext` refuses client data that is
a struct holding a sequence (`{<C, D*>}@CLIENTS`; docs/production.md gives a
reproduction). `packed_learning_process(form)` is the same process for that
context: each client's data is one sequence whose every element carries the
client state beside a batch (`{<client_state=C, data=B>*}@CLIENTS`, built
by `pack_client_data`); the round reads the state from the first element
and runs on the batches. Its `next` is the same round.

Every stage of every registered algorithm has a production form, so each
has its learning process (a staged algorithm: one per stage,
`learning_processes`). Written by hand: TFF builds `LearningProcess`es only
from its own client work, which has no client state.

Example:

  lp = learning_process.learning_process(production.production_form(proc))
  state = lp.initialize()
  output = lp.next(state, [{'client_state': c, 'data': d}
                           for c, d in zip(client_states, datasets)])
  weights = lp.get_model_weights(output.state)
"""

from __future__ import annotations

import collections
import copy
import pickle
import random
from typing import Any, Mapping, Sequence

import numpy as np

import tensorflow as tf
import tensorflow_federated as tff

# TFF's serialization of types in its program state, as its own data
# sources use it.
from tensorflow_federated.python.program import (
    serialization_utils as _program_serialization)

from tff_personal.core import process as process_lib
from tff_personal.core import production

LearningProcessOutput = tff.learning.templates.LearningProcessOutput


def _learning_metrics_fn(measurements_type: tff.Type) -> tff.Computation:
  """`M -> M'`: the process's measurements in TFF's learning layout
  (`client_work/train` for the training metrics, the rest by name)."""
  names = [name for name, _ in tff.structure.iter_elements(measurements_type)]

  @tff.tensorflow.computation(measurements_type)
  def learning_metrics(measurements):
    values = {name: (measurements[name] if isinstance(measurements, Mapping)
                     else getattr(measurements, name)) for name in names}
    out = collections.OrderedDict(
        client_work=collections.OrderedDict(
            [('train', values['train'])] if 'train' in values else []))
    for name in names:
      if name != 'train':
        out[name] = values[name]
    return out

  return learning_metrics


def _weights_accessors(form: production.ProductionForm):
  """`(get_model_weights, set_model_weights)` as TensorFlow computations
  of the form's (unplaced) server state."""
  state_type = form.initialize.type_signature.result.member
  weights_type = form.process.model_weights_type

  @tff.tensorflow.computation(state_type)
  def get_model_weights(state):
    weights = state.global_model_weights
    return process_lib.ModelWeights(
        trainable=tuple(weights.trainable),
        non_trainable=tuple(weights.non_trainable))

  @tff.tensorflow.computation(state_type, weights_type)
  def set_model_weights(state, weights):
    return process_lib.LearningAlgorithmState(
        global_model_weights=process_lib.ModelWeights(
            trainable=tuple(weights.trainable),
            non_trainable=tuple(weights.non_trainable)),
        distributor=state.distributor, client_work=state.client_work,
        aggregator=state.aggregator, finalizer=state.finalizer)

  return get_model_weights, set_model_weights


def _build(form: production.ProductionForm, client_type: tff.Type,
           to_clients) -> tff.learning.templates.LearningProcess:
  """A `LearningProcess` whose `next` runs `form.next` on
  `to_clients(clients)` (clients of `client_type` at CLIENTS)."""
  state_type = form.initialize.type_signature.result
  round_fn = form.next
  learning_metrics = _learning_metrics_fn(
      round_fn.type_signature.result[1].member)

  @tff.federated_computation(state_type,
                             tff.FederatedType(client_type, tff.CLIENTS))
  def next_fn(state, clients):
    new_state, measurements = round_fn(state, to_clients(clients))
    return LearningProcessOutput(
        state=new_state,
        metrics=tff.federated_map(learning_metrics, measurements))

  get_model_weights, set_model_weights = _weights_accessors(form)
  return tff.learning.templates.LearningProcess(
      form.initialize, next_fn, get_model_weights, set_model_weights)


def learning_process(
    form: production.ProductionForm) -> tff.learning.templates.LearningProcess:
  """The form's round as a `LearningProcess` (module docstring).

  Its client data is `<client_state=C, data=D*>`: each client's state read
  with its data, as a device does.

  Args:
    form: a `production.ProductionForm` (`production_form(process)`).

  Returns:
    A `tff.learning.templates.LearningProcess`.
  """
  return _build(form, form.next.type_signature.parameter[1].member,
                lambda clients: clients)


def packed_element_type(form: production.ProductionForm) -> tff.Type:
  """The element type of `packed_learning_process`'s client sequences:
  `<client_state=C, data=B>`."""
  return tff.StructType([
      ('client_state', form.process.client_state_type),
      ('data', form.process.client_data_type.element)])


def pack_client_data(client_state, dataset: tf.data.Dataset
                     ) -> tf.data.Dataset:
  """One client's data as `packed_learning_process` takes it: each batch
  of `dataset` with `client_state` beside it.

  Args:
    client_state: the client's state (a structure of tensors or arrays).
    dataset: the client's batches; it must hold at least one batch (the
      round reads the state from the first element).

  Returns:
    A dataset of `{'client_state': client_state, 'data': batch}`.
  """
  state = tf.nest.map_structure(tf.convert_to_tensor, client_state)
  # Zipped, not mapped: no function in the dataset's graph, so it can be
  # copied (`train_model` deep-copies its data iterator every round).
  return tf.data.Dataset.zip(collections.OrderedDict(
      client_state=tf.data.Dataset.from_tensors(state).repeat(),
      data=dataset))


def packed_learning_process(
    form: production.ProductionForm) -> tff.learning.templates.LearningProcess:
  """The form's round as a `LearningProcess` whose client data is one
  sequence, `{<client_state=C, data=B>*}@CLIENTS` (`pack_client_data`):
  what TFF 0.87's `tff.program.NativeFederatedContext` accepts, and so what
  `tff.learning.programs.train_model` can run there.

  Each client's state is read from its sequence's first element (a client
  with no batch has no state to read: do not sample one); the round is
  `form.next`'s on `<client_state, data=the batches>`.

  Args:
    form: a `production.ProductionForm`.

  Returns:
    A `tff.learning.templates.LearningProcess`.
  """
  element_type = packed_element_type(form)
  state_type = form.process.client_state_type
  specs = tff.types.type_to_tf_tensor_specs(state_type)

  @tff.tensorflow.computation(tff.SequenceType(element_type))
  def unpack(sequence):
    zeros = tf.nest.map_structure(
        lambda spec: tf.zeros(spec.shape, spec.dtype), specs)
    state = sequence.take(1).reduce(
        zeros, lambda _, element: element['client_state'])
    return collections.OrderedDict(
        client_state=state, data=sequence.map(lambda e: e['data']))

  return _build(form, tff.SequenceType(element_type),
                lambda clients: tff.federated_map(unpack, clients))


class PackedClientDataSourceIterator(
    tff.program.FederatedDataSourceIterator):
  """The iterator of `PackedClientDataSource`: `select(k)` gives `k`
  distinct clients drawn by Python's `random` (as TFF's
  `DatasetDataSourceIterator` draws), each packed (`pack_client_data`)."""

  def __init__(self, clients: Sequence[tuple[Any, Mapping[str, Any]]],
               batch_size: int, federated_type: tff.FederatedType):
    self._clients = [(tf.nest.map_structure(np.asarray, state),
                      collections.OrderedDict(
                          (k, np.asarray(v)) for k, v in examples.items()))
                     for state, examples in clients]
    self._batch_size = int(batch_size)
    self._federated_type = federated_type

  @property
  def federated_type(self) -> tff.FederatedType:
    return self._federated_type

  def select(self, k: int | None = None) -> list[tf.data.Dataset]:
    if k is None or not 0 < k <= len(self._clients):
      raise ValueError(f'k must be in [1, {len(self._clients)}], got {k}')
    return [pack_client_data(state, tf.data.Dataset.from_tensor_slices(
        examples).batch(self._batch_size))
            for state, examples in random.sample(self._clients, k)]

  def to_bytes(self) -> bytes:
    # The clients (NumPy arrays in Python containers) pickled: read back
    # only from this program's own state directory.
    return (_program_serialization.pack_type_spec(self._federated_type) +
            pickle.dumps((self._clients, self._batch_size)))

  @classmethod
  def from_bytes(cls, buffer: bytes) -> 'PackedClientDataSourceIterator':
    federated_type, offset = _program_serialization.unpack_type_spec_from(
        buffer)
    clients, batch_size = pickle.loads(buffer[offset:])
    return cls(clients, batch_size, federated_type)

  def __deepcopy__(self, memo):
    # Immutable but for the clients' list: TFF types and datasets do not
    # deep-copy (`train_model` copies its iterator every round).
    return type(self)(self._clients, self._batch_size, self._federated_type)

  def __eq__(self, other) -> bool:
    if not isinstance(other, PackedClientDataSourceIterator):
      return NotImplemented
    # pylint: disable=protected-access
    return (self._batch_size == other._batch_size and
            self._federated_type.is_equivalent_to(other._federated_type) and
            len(self._clients) == len(other._clients) and
            all(_same(a, b) for a, b in zip(self._clients, other._clients)))


def _same(a, b) -> bool:
  flat_a, flat_b = tf.nest.flatten(a), tf.nest.flatten(b)
  return len(flat_a) == len(flat_b) and all(
      np.array_equal(x, y) for x, y in zip(flat_a, flat_b))


class PackedClientDataSource(tff.program.FederatedDataSource):
  """A `tff.program.FederatedDataSource` of `packed_learning_process`'s
  client data, for `tff.learning.programs.train_model`.

  Each client is its state and its examples (unbatched NumPy arrays by
  key), batched by `batch_size` when selected. Written by hand: TFF's
  `DatasetDataSource` holds `tf.data.Dataset`s, which `train_model`'s copy
  of its iterator cannot deep-copy (TensorFlow 2.14: "cannot pickle
  'Graph' object"); this one holds arrays.

  The states are the ones given: `train_model` returns no client state, so
  they do not change from round to round (docs/production.md).
  """

  def __init__(self, form: production.ProductionForm,
               clients: Sequence[tuple[Any, Mapping[str, Any]]],
               batch_size: int):
    self._iterator = PackedClientDataSourceIterator(
        clients, batch_size, tff.FederatedType(
            tff.SequenceType(packed_element_type(form)), tff.CLIENTS))

  @property
  def federated_type(self) -> tff.FederatedType:
    return self._iterator.federated_type

  def iterator(self) -> PackedClientDataSourceIterator:
    return copy.deepcopy(self._iterator)


def learning_processes(built) -> list[tuple[str, Any]]:
  """`(stage name, learning process)` for each stage of a built algorithm
  (`production.production_forms`), in the order the stages run."""
  return [(name, learning_process(form))
          for name, form in production.production_forms(built)]
