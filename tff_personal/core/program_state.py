"""TFF's file program-state manager, writing and reading without a SavedModel.

`FileProgramStateManager` is `tff.program.FileProgramStateManager` (the same
directories, `program_state_<version>`, written under a temporary name and
renamed; the same versions, retention and errors) with a faster on-disk form.
TFF writes each version as a SavedModel: a `tf.Module` holding the state's
leaves as variables plus a traced `tf.function` returning them, and reads it
back with `tf.saved_model.load`, which rebuilds that function. The trace and
the rebuild cost about ten times what writing the variables does, so a
checkpoint per round dominated small rounds (docs/performance.md).

This manager writes only the variables, with `tf.train.Checkpoint`, under the
same object path TFF's module gives them (`_value/...`): a version's
`variables/variables` checkpoint has the same names, dtypes and values as the
one TFF writes (tests/program_state_test.py). It reads each leaf of the given
structure by that name, so it reads what TFF wrote too, and returns what TFF's
reading returns (the stored values as NumPy values, in the structure's
containers). A state it cannot store so (a leaf that is not a tensor, a
container TensorFlow does not track, a key with a '/') is written, and read,
as TFF does.

Written by hand: TFF's manager has no option to skip the SavedModel.

Usage (as TFF's):

  manager = program_state.FileProgramStateManager(directory, keep_total=3)
  await manager.save({'server_state': state, 'round_num': 3}, 3)
  value = await manager.load(3, {'server_state': template, 'round_num': 0})
"""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff
import tree

from tensorflow.python.trackable import trackable_utils as _trackable_utils
from tensorflow_federated.python.program import structure_utils as _structure_utils
from tensorflow_federated.python.program import value_reference as _value_reference

_SAVED_MODEL_FILE = 'saved_model.pb'
_OBJECT_GRAPH = '_CHECKPOINTABLE_OBJECT_GRAPH'
# A variable's value in an object-based checkpoint, after its object path.
_VALUE_SUFFIX = '.ATTRIBUTES/VARIABLE_VALUE'
_NOT_A_VARIABLE = object()


def _variables(value) -> Any:
  """The structure with each leaf a `tf.Variable` (`_NOT_A_VARIABLE` where a
  leaf cannot be one, as TFF's `write_saved_model` keeps it)."""

  def wrap(leaf):
    try:
      return tf.Variable(initial_value=leaf, trainable=False)
    except (ValueError, TypeError):
      return _NOT_A_VARIABLE

  return _structure_utils.map_structure(wrap, value)


def _all_variables(variables) -> bool:
  return all(v is not _NOT_A_VARIABLE
             for v in _structure_utils.flatten(variables))


def stored_name(*steps) -> str:
  """The name of the leaf at `steps` (keys and indices from the state's
  root) in a version's checkpoint, as TFF's module (and this manager) store
  it: the object path from `_value`, each step escaped as TensorFlow escapes
  it. E.g. `stored_name('round_num')`."""
  return '/'.join(['_value'] + [_trackable_utils.escape_local_name(str(s))
                                for s in steps] + [_VALUE_SUFFIX])


def _keys(structure) -> list[str] | None:
  """Each leaf's `stored_name`, in `structure`'s order. None when a step has
  a '/' (TensorFlow's escaping would then not be undone by name alone)."""
  # pylint: disable=protected-access
  filtered = _structure_utils._filter_structure(structure)
  out = []
  for path, _ in tree.flatten_with_path_up_to(filtered, structure):
    if any('/' in str(step) for step in path):
      return None
    out.append(stored_name(*path))
  return out


def _as_numpy(value):
  """What TFF's reading returns for a stored tensor: a NumPy array, or a
  NumPy scalar for a scalar."""
  value = np.asarray(value)
  return value[()] if value.ndim == 0 else value


def _checkpoint_prefix(path: str) -> str:
  return os.path.join(path, 'variables', 'variables')


def _stored_count(prefix: str) -> int:
  """How many values the checkpoint at `prefix` holds."""
  return sum(1 for name, _ in tf.train.list_variables(prefix)
             if name != _OBJECT_GRAPH)


class FileProgramStateManager(tff.program.FileProgramStateManager):
  """`tff.program.FileProgramStateManager` without the SavedModel.

  Same constructor, `get_versions`, `save`, `load` and `remove_all`; see the
  module docstring for what is stored.
  """

  async def save(self, program_state, version: int) -> None:
    path = self._get_path_for_version(version)
    if tf.io.gfile.exists(path):
      raise tff.program.ProgramStateExistsError(version=version,
                                                path=self._root_dir)
    materialized = await _value_reference.materialize_value(program_state)
    variables = _variables(materialized)
    if not _all_variables(variables) or _keys(materialized) is None:
      await super().save(program_state, version)
      return
    temp = f'{path}_temp{random.randint(1000, 9999)}'
    if tf.io.gfile.exists(temp):
      tf.io.gfile.rmtree(temp)
    leaves = len(_structure_utils.flatten(variables))
    tf.train.Checkpoint(_value=variables).write(_checkpoint_prefix(temp))
    if _stored_count(_checkpoint_prefix(temp)) != leaves:
      # A container the checkpoint does not track (neither a dict, a list
      # nor a tuple) hid some leaves: TFF's writing, whatever it does.
      tf.io.gfile.rmtree(temp)
      await super().save(program_state, version)
      return
    tf.io.gfile.rename(temp, path)
    await self._remove_old_program_state()

  async def load(self, version: int, structure):
    path = self._get_path_for_version(version)
    if not tf.io.gfile.exists(path):
      raise tff.program.ProgramStateNotFoundError(version)
    keys = _keys(structure)
    reader = tf.train.load_checkpoint(_checkpoint_prefix(path))
    stored = set(reader.get_variable_to_shape_map()) - {_OBJECT_GRAPH}
    if keys is None or set(keys) != stored:
      if tf.io.gfile.exists(os.path.join(path, _SAVED_MODEL_FILE)):
        # TFF's reading, from the SavedModel, says what differs.
        return await super().load(version, structure)
      raise ValueError(
          f'{path} does not hold the structure given: it holds '
          f'{len(stored)} values, the structure has '
          f'{"unnamed" if keys is None else len(keys)} (e.g. '
          f'{sorted(stored ^ set(keys or ()))[:3]} differ)')
    return _structure_utils.unflatten_as(
        structure, [_as_numpy(reader.get_tensor(k)) for k in keys])
