"""TFF execution contexts whose `worker_binary` never outlives the program.

TFF's `tff.backends.native.set_sync_local_cpp_execution_context` starts the C++
`worker_binary` on first use and relies on a `__del__` to stop it; at
interpreter exit that handler fails (`'NoneType' object has no attribute
'Popen'`) and the worker keeps running, holding the parent's stdout open. TFF
has no public handle on that process, so this module builds the same context
from TFF's own parts (the remote executor, its gRPC stub and the sync execution
context, exactly as `executor_factory.local_cpp_executor_factory` does) but owns
the subprocess:

* the worker is started with `PR_SET_PDEATHSIG=SIGKILL`, so the kernel ends it
  when the Python process dies for any reason, `kill -9` included;
* its stdout/stderr go to a log file (or /dev/null), never to the parent's
  stdout, so `python -m binaries.train ... | tail` terminates;
* `LocalCppRuntime.close()` (also run by `atexit`, by the context manager and by
  SIGTERM) stops it explicitly.

Written by hand because TFF lacks it; everything else is TFF's.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import subprocess
import threading
import time
from typing import Iterator, Optional

from absl import logging
import grpc
import portpicker
import tensorflow_federated as tff

# TFF internals: the same pieces TFF's own `local_cpp_executor_factory` uses.
from tensorflow_federated.python.core.backends.native import compiler as _native_compiler
from tensorflow_federated.python.core.environments.tensorflow_frontend import tensorflow_computation as _tf_computation
from tensorflow_federated.python.core.impl.context_stack import context_stack_impl as _context_stack_impl
from tensorflow_federated.python.core.impl.execution_contexts import sync_execution_context as _sync_execution_context
from tensorflow_federated.python.core.impl.executor_stacks import python_executor_stacks as _python_executor_stacks
from tensorflow_federated.python.core.impl.executors import remote_executor as _remote_executor
from tensorflow_federated.python.core.impl.executors import remote_executor_grpc_stub as _remote_executor_grpc_stub

_GRPC_MAX_MESSAGE_LENGTH_BYTES = 2 * 1000 * 1000 * 1000
_GRPC_CHANNEL_OPTIONS = [
    ('grpc.max_message_length', _GRPC_MAX_MESSAGE_LENGTH_BYTES),
    ('grpc.max_receive_message_length', _GRPC_MAX_MESSAGE_LENGTH_BYTES),
    ('grpc.max_send_message_length', _GRPC_MAX_MESSAGE_LENGTH_BYTES),
]
_PR_SET_PDEATHSIG = 1


def _release_tff_import_time_context() -> None:
  """Drops the context TFF installs at import, before interpreter teardown.

  `import tensorflow_federated` installs a local C++ context whose
  `ServiceManager.__del__` runs during interpreter teardown, when the
  `subprocess` module is already gone, and prints an AttributeError traceback.
  Releasing it from an atexit hook (which runs before teardown) lets `__del__`
  run while it still can; a worker it started, if any, is then stopped too.
  """
  import gc  # pylint: disable=g-import-not-at-top
  from tensorflow_federated.python.core.impl.context_stack import runtime_error_context  # pylint: disable=g-import-not-at-top
  stack = _context_stack_impl.context_stack
  if not isinstance(stack._stack[0], _sync_execution_context.SyncExecutionContext) or any(  # pylint: disable=protected-access
      rt.context is stack._stack[0] for rt in _RUNTIMES):  # pylint: disable=protected-access
    return
  stack.set_default_context(runtime_error_context.RuntimeErrorContext())
  gc.collect()


_RUNTIMES = []
atexit.register(_release_tff_import_time_context)


def worker_binary_path() -> str:
  """Path of the `worker_binary` shipped inside the TFF pip package."""
  return os.path.join(os.path.dirname(tff.__file__), 'data', 'worker_binary')


def _die_with_parent() -> None:  # Runs in the child between fork and exec.
  libc = ctypes.CDLL('libc.so.6', use_errno=True)
  libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class LocalCppRuntime:
  """Owns one local `worker_binary` and the sync TFF context that talks to it.

  Usage:

    with LocalCppRuntime() as runtime:   # installs itself as TFF's context
      process.next(...)
    # worker stopped here, whatever happened inside.
  """

  def __init__(self,
               default_num_clients: int = 0,
               max_concurrent_computation_calls: int = -1,
               log_path: Optional[str] = None):
    self._default_num_clients = default_num_clients
    self._max_concurrent = max_concurrent_computation_calls
    self._log_path = log_path
    self._process: Optional[subprocess.Popen] = None
    self._stub = None
    self._lock = threading.Lock()
    self._closed = False
    self._previous_default = None
    factory = _python_executor_stacks.ResourceManagingExecutorFactory(
        executor_stack_fn=self._stack_fn)
    self.context = _sync_execution_context.SyncExecutionContext(
        executor_fn=factory,
        compiler_fn=_native_compiler.desugar_and_transform_to_native,
        transform_args=_tf_computation.transform_args,
        transform_result=_tf_computation.transform_result,
    )
    atexit.register(self.close)
    _RUNTIMES.append(self)

  @property
  def worker_pid(self) -> Optional[int]:
    return self._process.pid if self._process is not None else None

  def _start_worker(self):
    binary = worker_binary_path()
    if not os.path.isfile(binary):
      raise RuntimeError(f'TFF worker binary not found at {binary}; is '
                         'tensorflow-federated installed?')
    port = portpicker.pick_unused_port()
    out = (open(self._log_path, 'ab') if self._log_path
           else subprocess.DEVNULL)
    self._process = subprocess.Popen(
        [binary, f'--port={port}',
         f'--max_concurrent_computation_calls={self._max_concurrent}'],
        stdout=out, stderr=subprocess.STDOUT if self._log_path else out,
        stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
    if self._log_path:
      out.close()
    channel = grpc.insecure_channel(f'localhost:{port}', _GRPC_CHANNEL_OPTIONS)
    self._stub = _remote_executor_grpc_stub.RemoteExecutorGrpcStub(channel)
    deadline = time.monotonic() + 60
    while not self._stub.is_ready:
      if self._process.poll() is not None:
        raise RuntimeError(
            f'TFF worker_binary exited with code {self._process.returncode} '
            'before it was ready')
      if time.monotonic() > deadline:
        self.close()
        raise RuntimeError('TFF worker_binary did not become ready in 60 s')
      time.sleep(0.2)
    logging.info('Started TFF worker_binary pid=%d port=%d',
                 self._process.pid, port)

  def _stack_fn(self, cardinalities):
    with self._lock:
      if self._closed:
        raise RuntimeError('LocalCppRuntime is closed')
      if self._stub is None or not self._stub.is_ready:
        if self._process is not None:
          self._stop_worker()
        self._start_worker()
    if cardinalities.get(tff.CLIENTS) is None:
      cardinalities[tff.CLIENTS] = self._default_num_clients
    ex = _remote_executor.RemoteExecutor(self._stub)
    ex.set_cardinalities(cardinalities)
    return ex

  def _stop_worker(self):
    proc, self._process, self._stub = self._process, None, None
    if proc is None or proc.poll() is not None:
      return
    proc.send_signal(signal.SIGINT)
    try:
      proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()

  def install(self) -> 'LocalCppRuntime':
    """Makes this runtime TFF's default context (until `close`)."""
    stack = _context_stack_impl.context_stack
    if self._previous_default is None:
      self._previous_default = stack._stack[0]  # pylint: disable=protected-access
    stack.set_default_context(self.context)
    return self

  def close(self) -> None:
    """Stops the worker and restores the previous default context.

    Idempotent; safe from atexit and signal handlers.
    """
    with self._lock:
      self._closed = True
      self._stop_worker()
      stack = _context_stack_impl.context_stack
      if (self._previous_default is not None and
          stack._stack[0] is self.context):  # pylint: disable=protected-access
        stack.set_default_context(self._previous_default)
      self._previous_default = None

  def __enter__(self) -> 'LocalCppRuntime':
    return self.install()

  def __exit__(self, *exc) -> None:
    self.close()


@contextlib.contextmanager
def local_runtime(log_path: Optional[str] = None,
                  handle_sigterm: bool = True) -> Iterator[LocalCppRuntime]:
  """Installs a `LocalCppRuntime` for the block and always stops its worker.

  With `handle_sigterm`, SIGTERM becomes `SystemExit` so that the `finally`
  clauses of the program (checkpoint files, the store) run before exit.
  """
  previous = None
  if handle_sigterm and threading.current_thread() is threading.main_thread():
    def _on_sigterm(signum, frame):
      raise SystemExit(128 + signum)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
  runtime = LocalCppRuntime(log_path=log_path)
  try:
    with runtime:
      yield runtime
  finally:
    runtime.close()
    if previous is not None:
      signal.signal(signal.SIGTERM, previous)
