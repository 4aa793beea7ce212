"""The worker_binary's TensorFlow thread pools follow the runtime's settings."""

import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tff_personal.core import runtime
from tff_personal.core import worker_threads

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_MATRIX = tff.TensorType(np.float32, [32, 32])


@tff.tensorflow.computation(_MATRIX)
def _square_sum(x):
  return tf.reduce_sum(tf.matmul(x, x))


@tff.federated_computation(tff.FederatedType(_MATRIX, tff.CLIENTS))
def _federated_square_sum(x):
  return tff.federated_sum(tff.federated_map(_square_sum, x))


def test_worker_env_sets_explicit_counts_and_keeps_the_rest():
  base = {'PATH': '/bin', worker_threads.INTRA_VAR: '7'}
  env = worker_threads.worker_env(1, 3, base=base)
  assert env == {'PATH': '/bin', worker_threads.INTRA_VAR: '1',
                 worker_threads.INTER_VAR: '3'}
  assert base[worker_threads.INTRA_VAR] == '7'  # the input is not modified


def test_minus_one_leaves_the_environment_and_zero_is_the_cpu_count():
  base = {worker_threads.INTRA_VAR: '7'}
  env = worker_threads.worker_env(-1, 0, base=base)
  assert env[worker_threads.INTRA_VAR] == '7'
  assert env[worker_threads.INTER_VAR] == str(worker_threads.cpu_count())
  assert worker_threads.cpu_count() == len(os.sched_getaffinity(0))
  assert worker_threads.worker_env(None, None, base={}) == {}


@pytest.mark.parametrize('bad', [-2, 1.5, True, '2'])
def test_bad_counts_are_refused_by_name(bad):
  with pytest.raises(ValueError, match='inter_op_threads must be'):
    worker_threads.worker_env(1, bad, base={})
  with pytest.raises(ValueError, match='intra_op_threads must be'):
    runtime.LocalCppRuntime(intra_op_threads=bad)


def _worker_threads_and_env(intra, inter):
  with runtime.LocalCppRuntime(intra_op_threads=intra,
                               inter_op_threads=inter) as rt:
    ones = np.ones([32, 32], np.float32)
    assert _federated_square_sum([ones] * 3) == pytest.approx(3 * 32**3)
    pid = rt.worker_pid
    threads = len(os.listdir(f'/proc/{pid}/task'))
    with open(f'/proc/{pid}/environ', 'rb') as f:
      env = dict(item.split(b'=', 1) for item in f.read().split(b'\0')
                 if b'=' in item)
  return threads, env


def test_the_worker_creates_the_thread_pools_it_is_given():
  # TensorFlow in the worker reads TF_NUM_INTRAOP/INTEROP_THREADS when it
  # creates its pools: 4 more threads in each pool show up as threads of
  # the process (the rest of the worker's threads are the same).
  few, few_env = _worker_threads_and_env(1, 1)
  many, many_env = _worker_threads_and_env(5, 5)
  assert few_env[b'TF_NUM_INTRAOP_THREADS'] == b'1'
  assert many_env[b'TF_NUM_INTEROP_THREADS'] == b'5'
  assert many - few >= 6, (few, many)


_SHOW = ('import os; from tff_personal.core import worker_threads as w; '
         'print(os.environ.get(w.INTRA_VAR), os.environ.get(w.INTER_VAR), '
         'w.worker_env(-1, -1).get(w.INTRA_VAR))')


@pytest.mark.parametrize('given,printed', [
    ({}, f'1 {len(os.sched_getaffinity(0))} None'),
    ({worker_threads.INTRA_VAR: '3'}, f'3 {len(os.sched_getaffinity(0))} 3'),
])
def test_the_import_gives_this_process_the_default_pools(given, printed):
  """Importing the module sets this process's thread variables to the
  project's defaults unless they are set (so that TensorFlow, started
  later by a program's own work, computes as the binaries do); -1 still
  gives a worker the program's own environment."""
  env = {k: v for k, v in os.environ.items()
         if k not in (worker_threads.INTRA_VAR, worker_threads.INTER_VAR)}
  out = subprocess.run([sys.executable, '-c', _SHOW], capture_output=True,
                       text=True, env=dict(env, PYTHONPATH=_REPO, **given),
                       cwd=_REPO, check=True).stdout
  assert out.split() == printed.split()
