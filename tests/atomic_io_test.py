"""`atomic_io`'s JSON caches: the first call returns what later calls read
back, a failed computation leaves no file, and an unreadable file is one
error naming it, never silently replaced."""

import os

import pytest

from tff_personal.core import atomic_io


def test_cached_json_computes_once_and_returns_what_it_reads_back(tmp_path):
  path = os.path.join(tmp_path, 'deep', 'step.json')
  calls = []

  def compute():
    calls.append(1)
    return {'3': (1.5, 2), 'b': [None, True]}

  first = atomic_io.cached_json(path, compute)
  second = atomic_io.cached_json(path, compute)
  assert calls == [1]
  # JSON's view (lists for tuples) on both calls, so a caller sees one
  # type whether or not the step ran in this process.
  assert first == second == {'3': [1.5, 2], 'b': [None, True]}


def test_a_failed_computation_leaves_no_file(tmp_path):
  path = os.path.join(tmp_path, 'step.json')

  def fails():
    raise RuntimeError('killed')

  with pytest.raises(RuntimeError):
    atomic_io.cached_json(path, fails)
  assert os.listdir(tmp_path) == []
  assert atomic_io.cached_json(path, lambda: [1]) == [1]


def test_an_unreadable_cache_names_its_path_and_is_kept(tmp_path):
  path = os.path.join(tmp_path, 'step.json')
  with open(path, 'w') as f:
    f.write('{"cut": [1, 2')  # As a full disk might leave a plain write.
  with pytest.raises(ValueError, match=f'{path} is not valid JSON'):
    atomic_io.cached_json(path, lambda: pytest.fail('computed again'))
  with open(path) as f:
    assert f.read() == '{"cut": [1, 2'
