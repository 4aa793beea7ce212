"""Helpers for tests that run binaries and check which processes are alive."""

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time


def alive(pid: int) -> bool:
  """True if `pid` exists and is not a zombie."""
  try:
    with open(f'/proc/{pid}/status') as f:
      return not any(line.startswith('State:\tZ') for line in f)
  except OSError:
    return False


def wait_dead(pid: int, seconds: float = 10) -> bool:
  """Waits until `pid` is gone (or a zombie); returns whether it is."""
  deadline = time.monotonic() + seconds
  while alive(pid) and time.monotonic() < deadline:
    time.sleep(0.05)
  return not alive(pid)


# Imports a binary's module once (and defines its flags, as its `__main__`
# block does), then runs each job in a forked child: `app.run(main)` on the
# job's argv, stdout and stderr to the job's files; replies the child's PID,
# then its exit code. One job at a time. A child is a process of its own (its
# own flags, PID, stdout, stderr and exit code) that does not pay
# TensorFlow's import again.
_FORK_SERVER = r"""
import importlib, json, os, sys, traceback
reply = os.fdopen(os.dup(1), 'w')  # Only replies go to the parent's pipe;
os.dup2(2, 1)                       # what imports print goes to stderr.
module_name = sys.argv[1]
from absl import app
module = importlib.import_module(module_name)
if hasattr(module, 'define_flags'):
  module.define_flags()  # What the binary's `__main__` block does.
reply.write('ready\n')
reply.flush()
for line in sys.stdin:
  job = json.loads(line)
  sys.stdout.flush()
  sys.stderr.flush()
  pid = os.fork()
  if pid == 0:
    code = 1
    try:
      reply.close()
      null = os.open(os.devnull, os.O_RDONLY)
      os.dup2(null, 0)
      os.close(null)
      for fd, path in ((1, job['stdout']), (2, job['stderr'])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(out, fd)
        os.close(out)
      os.chdir(job['cwd'])
      app.run(module.main, argv=[module_name] + job['argv'])
      code = 0
    except SystemExit as e:  # What `python -m` makes of it.
      if e.code is None or isinstance(e.code, int):
        code = e.code or 0
      else:
        print(e.code, file=sys.stderr)
    except BaseException:  # pylint: disable=broad-except
      traceback.print_exc()
    finally:
      sys.stdout.flush()
      sys.stderr.flush()
      os._exit(code)
  reply.write(f'{pid}\n')
  reply.flush()
  _, status = os.waitpid(pid, 0)
  reply.write(f'{os.waitstatus_to_exitcode(status)}\n')
  reply.flush()
"""


class ForkServer:
  """`python -m <module>` runs that share one import of the module.

  `run(argv)` returns a `subprocess.CompletedProcess` like
  `subprocess.run([sys.executable, '-m', module, *argv], capture_output=True,
  text=True)` would. Use as a context manager (or call `close()`).
  """

  def __init__(self, module: str, cwd: str, env=None):
    self._module = module
    self._cwd = cwd
    self._tmp = tempfile.mkdtemp(prefix='fork_server_')
    self._count = 0
    self._err = open(os.path.join(self._tmp, 'server.err'), 'w')
    self._proc = subprocess.Popen(
        [sys.executable, '-c', _FORK_SERVER, module], cwd=cwd, env=env,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err,
        text=True)
    if self._readline(300) != 'ready\n':
      self.close()
      with open(os.path.join(self._tmp, 'server.err')) as f:
        raise RuntimeError(f'fork server for {module} did not start: '
                           f'{f.read()[-3000:]}')

  def _readline(self, timeout):
    ready, _, _ = select.select([self._proc.stdout], [], [], timeout)
    if not ready:
      self._proc.kill()
      self._proc.wait()
      raise subprocess.TimeoutExpired(self._module, timeout)
    return self._proc.stdout.readline()

  def run(self, argv, cwd=None, timeout=600):
    self._count += 1
    out = os.path.join(self._tmp, f'{self._count}.out')
    err = os.path.join(self._tmp, f'{self._count}.err')
    self._proc.stdin.write(json.dumps(dict(
        argv=list(argv), stdout=out, stderr=err,
        cwd=cwd or self._cwd)) + '\n')
    self._proc.stdin.flush()
    child = self._readline(60)
    if not child:
      raise RuntimeError(f'fork server for {self._module} died')
    child = int(child)
    try:
      line = self._readline(timeout)
    except subprocess.TimeoutExpired:
      os.kill(child, signal.SIGKILL)
      raise
    if not line:
      raise RuntimeError(f'fork server for {self._module} died')
    with open(out) as f_out, open(err) as f_err:
      return subprocess.CompletedProcess(
          [self._module, *argv], int(line), f_out.read(), f_err.read())

  def close(self):
    if self._proc.poll() is None:
      self._proc.stdin.close()
      try:
        self._proc.wait(timeout=60)
      except Exception:  # pylint: disable=broad-except
        self._proc.kill()
        self._proc.wait()
    self._proc.stdout.close()
    self._err.close()
    shutil.rmtree(self._tmp, ignore_errors=True)

  def __enter__(self):
    return self

  def __exit__(self, *unused):
    self.close()
