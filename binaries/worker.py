r"""Serves TFF's executor service (the pip package's `worker_binary`) on a port.

  python -m binaries.worker --port=8000 [--max_concurrent_computation_calls=-1]
      [--intra_op_threads=1 --inter_op_threads=0]

Start one per machine (or several per machine on different ports), then point
a training binary at them with `--workers=host1:8000,host2:8000`: each round's
clients are split across the workers (see `tff_personal/core/runtime.py` and
docs/scale.md). The service listens on all interfaces, without TLS or
authentication: run it only on a trusted network.

Stays up until SIGTERM or SIGINT (Ctrl-C), which it forwards to the service
and then waits for it to exit (killing it after --shutdown_timeout_s). If this
wrapper is killed outright, the kernel ends the service too
(PR_SET_PDEATHSIG). Exits with the service's exit code if the service dies on
its own. Prints `worker ready on port N (pid P)` once the service accepts
calls; refuses a port already in use (TFF's service would otherwise keep
running without listening, and the readiness check would reach the other
process).
"""

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time

from absl import app
from absl import flags
import grpc

from tff_personal.core import parent_death
from tff_personal.core import worker_threads

_PORT = flags.DEFINE_integer('port', None, 'Port to serve on.', lower_bound=1,
                             upper_bound=65535)
_MAX_CONCURRENT = flags.DEFINE_integer(
    'max_concurrent_computation_calls', -1,
    'Maximum parallel calls of one computation in the service (e.g. clients '
    'trained at once); -1: no limit.')
_INTRA = flags.DEFINE_integer(
    'intra_op_threads', worker_threads.DEFAULT_INTRA_OP_THREADS,
    'TensorFlow threads per op in the service; -1: TensorFlow\'s default. '
    '1 suits concurrent client computations (tff_personal/core/'
    'worker_threads.py).')
_INTER = flags.DEFINE_integer(
    'inter_op_threads', worker_threads.DEFAULT_INTER_OP_THREADS,
    'Ops run at once in the service; 0: the CPU count; -1: TensorFlow\'s '
    'default.')
_LOG_PATH = flags.DEFINE_string(
    'log_path', None, "File for the service's output (default: this "
    "process's stderr).")
_READY_TIMEOUT_S = flags.DEFINE_float(
    'ready_timeout_s', 60.0, 'Seconds to wait for the service to accept calls.')
_SHUTDOWN_TIMEOUT_S = flags.DEFINE_float(
    'shutdown_timeout_s', 10.0,
    'Seconds to wait for the service to exit after SIGINT before killing it.')




class _Stop(Exception):
  pass


def worker_binary_path() -> str:
  """The pip package's `worker_binary`, found without importing TFF.

  Importing TensorFlow Federated would cost this wrapper seconds and hundreds
  of MiB for nothing; `tff_personal.core.runtime.worker_binary_path` returns
  the same file.
  """
  spec = importlib.util.find_spec('tensorflow_federated')
  if spec is None or spec.origin is None:
    raise RuntimeError('tensorflow-federated is not installed')
  path = os.path.join(os.path.dirname(spec.origin), 'data', 'worker_binary')
  if not os.path.isfile(path):
    raise RuntimeError(f'TFF worker binary not found at {path}')
  return path


def _raise_stop(signum, frame):
  del frame
  raise _Stop(signum)


def _check_port_free(port: int) -> None:
  """Raises if `port` is taken: the service would then run without listening.

  (A second `worker_binary` on a used port keeps running, and a readiness
  check on localhost reaches the first one.)
  """
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    try:
      s.bind(('', port))
    except OSError as e:
      raise RuntimeError(f'port {port} is already in use ({e.strerror})') from e


def _wait_ready(proc: subprocess.Popen, port: int, timeout_s: float) -> None:
  channel = grpc.insecure_channel(f'localhost:{port}')
  ready = grpc.channel_ready_future(channel)
  deadline = time.monotonic() + timeout_s
  try:
    while True:
      try:
        ready.result(timeout=0.5)
        return
      except grpc.FutureTimeoutError:
        if proc.poll() is not None:
          raise RuntimeError(
              f'worker_binary exited with code {proc.returncode} before '
              f'serving (is port {port} in use?)') from None
        if time.monotonic() > deadline:
          raise RuntimeError(
              f'worker_binary did not accept connections on port {port} '
              f'within {timeout_s} s') from None
  finally:
    channel.close()


def _stop(proc: subprocess.Popen, timeout_s: float) -> int:
  if proc.poll() is None:
    proc.send_signal(signal.SIGINT)
    try:
      proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()
  return proc.returncode


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if _PORT.value is None:
    print('error: --port is required', file=sys.stderr)
    return 2
  signal.signal(signal.SIGTERM, _raise_stop)
  signal.signal(signal.SIGINT, _raise_stop)
  try:
    env = worker_threads.worker_env(_INTRA.value, _INTER.value)
  except ValueError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  out = open(_LOG_PATH.value, 'ab') if _LOG_PATH.value else None
  proc = None
  try:
    _check_port_free(_PORT.value)
    proc = parent_death.popen(
        [worker_binary_path(), f'--port={_PORT.value}',
         f'--max_concurrent_computation_calls={_MAX_CONCURRENT.value}'],
        stdin=subprocess.DEVNULL, stdout=out or sys.stderr,
        stderr=subprocess.STDOUT, env=env)
    _wait_ready(proc, _PORT.value, _READY_TIMEOUT_S.value)
    print(f'worker ready on port {_PORT.value} (pid {proc.pid})', flush=True)
    while proc.poll() is None:
      time.sleep(0.5)
    print(f'error: worker_binary exited with code {proc.returncode}',
          file=sys.stderr)
    return proc.returncode or 1
  except _Stop:
    code = _stop(proc, _SHUTDOWN_TIMEOUT_S.value) if proc else 0
    print(f'worker on port {_PORT.value} stopped (service exit code {code})',
          flush=True)
    return 0
  except RuntimeError as e:
    print(f'error: {e}', file=sys.stderr)
    return 1
  finally:
    if proc is not None and proc.poll() is None:
      proc.kill()
      proc.wait()
    if out is not None:
      out.close()


if __name__ == '__main__':
  app.run(main)
