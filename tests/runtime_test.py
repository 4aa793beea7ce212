"""The project's TFF runtime never leaves a worker_binary behind."""

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import tensorflow_federated as tff

from tests import process_utils
from tff_personal.core import runtime

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@tff.federated_computation(tff.FederatedType(np.float32, tff.CLIENTS))
def _mean(x):
  return tff.federated_mean(x)


def test_close_stops_worker_and_restores_context():
  outer = tff.framework.get_context_stack().current
  rt = runtime.LocalCppRuntime()
  with rt:
    assert _mean([1.0, 2.0, 6.0]) == 3.0
    pid = rt.worker_pid
    assert process_utils.alive(pid)
  assert process_utils.wait_dead(pid)
  assert tff.framework.get_context_stack().current is outer
  assert _mean([2.0, 4.0]) == 3.0  # the outer (session) runtime still works


def test_close_on_error_path():
  rt = runtime.LocalCppRuntime()
  try:
    with rt:
      _mean([1.0])
      pid = rt.worker_pid
      raise KeyError('boom')
  except KeyError:
    pass
  assert process_utils.wait_dead(pid)


_CHILD = textwrap.dedent('''
    import os, sys, time
    import numpy as np
    import tensorflow_federated as tff
    from tff_personal.core import runtime
    @tff.federated_computation(tff.FederatedType(np.float32, tff.CLIENTS))
    def f(x):
      return tff.federated_mean(x)
    with runtime.local_runtime() as rt:
      f([1.0])
      print(rt.worker_pid, flush=True)
      mode = sys.argv[1]
      if mode == 'exit':
        pass
      elif mode == 'raise':
        raise RuntimeError('failing on purpose')
      else:
        time.sleep(60)
    ''')


def _child(mode):
  proc = subprocess.Popen([sys.executable, '-c', _CHILD, mode], cwd=REPO,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)
  worker = int(proc.stdout.readline())
  return proc, worker


def test_worker_ends_with_program_on_every_exit_path():
  for mode, sig in (('exit', None), ('raise', None), ('sleep', signal.SIGTERM),
                    ('sleep', signal.SIGKILL)):
    proc, worker = _child(mode)
    if sig is not None:
      proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert process_utils.wait_dead(worker), (mode, sig)
    # Nothing but our own error is printed at exit (no TFF __del__ traceback).
    assert "'NoneType' object has no attribute 'Popen'" not in err
    if mode == 'exit':
      assert proc.returncode == 0
    if sig == signal.SIGTERM:
      assert proc.returncode == 128 + signal.SIGTERM


@tff.federated_computation(tff.FederatedType(np.float32, tff.CLIENTS))
def _sum(x):
  return tff.federated_sum(x)


def _count_sent_computations(monkeypatch):
  """Counts CreateValue requests that carry a computation to the worker."""
  from tensorflow_federated.python.core.impl.executors import remote_executor_grpc_stub  # pylint: disable=g-import-not-at-top
  sent = []
  original = remote_executor_grpc_stub.RemoteExecutorGrpcStub.create_value

  def create_value(self, request):
    if request.value.WhichOneof('value') == 'computation':
      sent.append(request.value.computation.type.SerializeToString())
    return original(self, request)

  monkeypatch.setattr(remote_executor_grpc_stub.RemoteExecutorGrpcStub,
                      'create_value', create_value)
  return sent


def test_a_computation_is_sent_to_the_worker_once_per_executor(monkeypatch):
  sent = _count_sent_computations(monkeypatch)
  with runtime.LocalCppRuntime():
    for values in ([1.0, 2.0, 6.0], [3.0, 0.0, 0.0], [4.0, 5.0, 0.0]):
      assert _mean(values) == np.mean(values)
    assert len(sent) == 1  # three calls, one copy on the worker
    # New cardinalities: a new executor on the worker, the computation again.
    assert _mean([1.0, 3.0]) == 2.0
    assert _mean([5.0, 7.0]) == 6.0
    assert len(sent) == 2
    # Another computation on the same executor does not replace the first.
    assert _sum([1.0, 3.0]) == 4.0
    assert _mean([2.0, 4.0]) == 3.0
    assert len(sent) == 3


def test_values_alive_when_the_worker_stops_are_not_disposed(monkeypatch):
  """Remote values still alive when the runtime closes (at interpreter exit,
  say) are not sent to the stopped worker for disposal: TFF batches 20
  disposals into one gRPC call, which then failed and printed its
  traceback at exit."""
  from tensorflow_federated.proto.v0 import executor_pb2  # pylint: disable=g-import-not-at-top
  from tensorflow_federated.python.core.impl.executors import remote_executor_grpc_stub  # pylint: disable=g-import-not-at-top
  disposed = []
  monkeypatch.setattr(remote_executor_grpc_stub.RemoteExecutorGrpcStub,
                      'dispose', lambda self, request: disposed.append(request))
  rt = runtime.LocalCppRuntime()
  with rt:
    assert _mean([1.0, 3.0]) == 2.0
    executors = [(ex, ex._executor_id) for ex in rt._executors]  # pylint: disable=protected-access
  assert executors
  for ex, executor_id in executors:
    for i in range(25):  # More than one batch of values.
      ex._dispose(executor_pb2.ValueRef(id=str(i)), executor_id)  # pylint: disable=protected-access
  assert not disposed


def test_a_killed_worker_is_replaced_for_every_cardinality():
  """After the worker dies, the next call starts a new one, and the
  executors TFF's context keeps for other cardinalities (whose values the
  restart stopped disposing) still compute, on the new worker. The restart
  runs while this process's gRPC threads do (`parent_death`: no fork)."""
  with runtime.LocalCppRuntime() as rt:
    assert _mean([1.0, 3.0]) == 2.0
    assert _mean([1.0, 2.0, 6.0]) == 3.0
    for _ in range(25):  # A forked restart failed within 25 (3 of 3 runs).
      first = rt.worker_pid
      os.kill(first, signal.SIGKILL)
      assert process_utils.wait_dead(first)
      assert _mean([1.0, 2.0, 3.0, 6.0]) == 3.0  # new cardinalities
      assert _mean([1.0, 3.0]) == 2.0  # an executor kept from before
      assert rt.worker_pid not in (None, first)


def test_the_executor_keeps_its_newest_computations(monkeypatch):
  sent = _count_sent_computations(monkeypatch)
  monkeypatch.setattr(runtime, '_CACHED_COMPUTATIONS', 1)
  with runtime.LocalCppRuntime():
    assert _mean([1.0, 3.0]) == 2.0
    assert _sum([1.0, 3.0]) == 4.0  # the mean's copy is dropped
    assert _mean([2.0, 6.0]) == 4.0  # and sent again: still right
    assert _mean([0.0, 6.0]) == 3.0
    assert len(sent) == 3


def test_a_computation_is_compiled_and_hashed_once(monkeypatch):
  from tensorflow_federated.python.core.impl.computation import computation_impl  # pylint: disable=g-import-not-at-top
  hashed = []
  original = computation_impl.ConcreteComputation.__hash__

  def counting_hash(self):
    hashed.append(1)
    return original(self)

  monkeypatch.setattr(computation_impl.ConcreteComputation, '__hash__',
                      counting_hash)
  with runtime.LocalCppRuntime():
    assert _mean([1.0, 3.0]) == 2.0
    hashed.clear()
    # Hashing a computation serialises all of it; repeated calls look the
    # compiled form up by identity instead.
    assert _mean([2.0, 6.0]) == 4.0
    assert _sum([2.0, 6.0]) == 8.0  # another computation: compiled, hashed
    assert _mean([0.0, 6.0]) == 3.0
    assert _sum([1.0, 6.0]) == 7.0
    assert len(hashed) == 1
