"""`program_state.FileProgramStateManager` stores what TFF's stores, in the
same names, and reads TFF's versions without their SavedModel."""

import collections
import os

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tff_personal.core import coroutines
from tff_personal.core import program_state


def _state(seed):
  rng = np.random.default_rng(seed)
  weights = collections.OrderedDict(
      trainable=[rng.random((4, 3), dtype=np.float32),
                 rng.random(3, dtype=np.float32)],
      non_trainable=[])
  server = collections.OrderedDict(
      global_model_weights=weights,
      optimizer=(np.int64(seed), rng.random((4, 3))),
      learning_rate=np.float32(0.1))
  server['schedule.step'] = np.int32(seed)  # TensorFlow escapes the '.'
  return {'server_state': server, 'round_num': seed}


def _tensors(path):
  prefix = os.path.join(path, 'variables', 'variables')
  reader = tf.train.load_checkpoint(prefix)
  return {name: reader.get_tensor(name)
          for name, _ in tf.train.list_variables(prefix)
          if not name.startswith('_CHECKPOINTABLE_OBJECT_GRAPH')}


def _equal(a, b):
  flat_a, flat_b = tf.nest.flatten(a), tf.nest.flatten(b)
  assert len(flat_a) == len(flat_b)
  for x, y in zip(flat_a, flat_b):
    assert np.asarray(x).dtype == np.asarray(y).dtype
    np.testing.assert_array_equal(x, y)


def test_same_variables_as_tff_and_each_reads_the_other(tmp_path, monkeypatch):
  ours = program_state.FileProgramStateManager(str(tmp_path / 'ours'))
  theirs = tff.program.FileProgramStateManager(str(tmp_path / 'tff'))
  state = _state(3)
  coroutines.run_sync(ours.save(state, 3))
  coroutines.run_sync(theirs.save(state, 3))
  got, want = (_tensors(str(tmp_path / d / 'program_state_3'))
               for d in ('ours', 'tff'))
  assert got.keys() == want.keys() and '_value/round_num/.ATTRIBUTES/' \
      'VARIABLE_VALUE' in got
  for name in want:
    assert got[name].dtype == want[name].dtype, name
    np.testing.assert_array_equal(got[name], want[name], err_msg=name)
  template = _state(0)
  want = coroutines.run_sync(theirs.load(3, template))
  _equal(want['server_state'], state['server_state'])
  # Ours reads TFF's version, and its own, as TFF reads (the same values,
  # dtypes and containers), without reading a SavedModel.
  monkeypatch.setattr(tff.program.FileProgramStateManager, 'load',
                      lambda *a: pytest.fail('read through the SavedModel'))
  from_tff = program_state.FileProgramStateManager(str(tmp_path / 'tff'))
  for got in (coroutines.run_sync(from_tff.load(3, template)),
              coroutines.run_sync(ours.load(3, template))):
    _equal(got, want)
    assert type(got['server_state']['optimizer']) is tuple


def test_versions_retention_and_errors_are_tff_s(tmp_path):
  ours = program_state.FileProgramStateManager(str(tmp_path), keep_total=2,
                                               keep_first=False)
  for version in (1, 2, 3):
    coroutines.run_sync(ours.save(_state(version), version))
  assert coroutines.run_sync(ours.get_versions()) == [2, 3]
  with pytest.raises(tff.program.ProgramStateExistsError):
    coroutines.run_sync(ours.save(_state(3), 3))
  with pytest.raises(tff.program.ProgramStateNotFoundError):
    coroutines.run_sync(ours.load(1, _state(0)))
  # Another structure than the one saved is refused, not half read.
  other = _state(0)
  other['server_state']['extra'] = np.zeros(2, np.float32)
  with pytest.raises(ValueError, match='does not hold the structure'):
    coroutines.run_sync(ours.load(3, other))
