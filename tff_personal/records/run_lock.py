"""An exclusive lock on an experiment directory, held for a whole run.

Training and re-evaluation both hold it, so that two programs never write
(or read half-written) checkpoints, client states or summaries of the same
experiment at once:

  with run_lock.hold(experiment_dir):
    ...  # train, resume or evaluate

The lock is `fcntl.flock(LOCK_EX | LOCK_NB)` on `<experiment_dir>/LOCK_FILENAME`.
The kernel releases it when its holder exits, however it exits (a SIGKILL
too), so a lock file left by a killed run never blocks. The holder writes its
PID into the file only so that a refused program can name it; the file is
emptied again on release. Holding is reentrant within a process (a binary
and the library function it calls may both hold it).

Standard library only: a helper process can take the lock without importing
TensorFlow.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import threading
from typing import Iterator

LOCK_FILENAME = 'experiment.lock'

_held: dict[str, list] = {}  # realpath -> [fd, depth]
_mutex = threading.Lock()


class ExperimentLockedError(RuntimeError):
  """Another live process holds the experiment directory's lock."""


def lock_path(experiment_dir: str) -> str:
  return os.path.join(experiment_dir, LOCK_FILENAME)


def remove_if_unused(experiment_dir: str,
                     also: tuple[str, ...] = ('worker_binary.log',)) -> None:
  """Removes `experiment_dir` if it holds nothing but the lock file (and the
  files named in `also`): what a run refused before any work leaves."""
  if os.path.isdir(experiment_dir) and set(os.listdir(experiment_dir)) <= {
      LOCK_FILENAME, *also}:
    shutil.rmtree(experiment_dir)


def _holder(fd: int) -> str:
  try:
    text = os.pread(fd, 64, 0).decode('ascii', 'replace').strip()
  except OSError:
    text = ''
  return f'PID {text}' if text.isdigit() else 'a process of unknown PID'


@contextlib.contextmanager
def hold(experiment_dir: str, create: bool = True) -> Iterator[None]:
  """Holds the directory's exclusive lock for the duration of the block.

  Args:
    experiment_dir: the experiment directory.
    create: make the directory and the lock file if they do not exist. If
      False and the lock file does not exist, nothing is locked and nothing
      is created: no training ever ran there (every training creates the
      file first), so a program that only reads a finished run finds
      nothing to read and says so.

  Raises:
    ExperimentLockedError: another process holds the lock; the message names
      its PID and the lock file. Nothing is changed.
  """
  path = lock_path(experiment_dir)
  if not create and not os.path.exists(path):
    yield
    return
  os.makedirs(experiment_dir, exist_ok=True)
  key = os.path.realpath(path)
  with _mutex:
    entry = _held.get(key)
    if entry is not None:
      entry[1] += 1
    else:
      fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except OSError as e:
        holder = _holder(fd)
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
          raise ExperimentLockedError(
              f'{experiment_dir} is in use by {holder} (lock file {path}): '
              'another training or evaluation of this experiment is running. '
              'Wait for it to end, or stop it; nothing was changed.') from e
        raise
      os.ftruncate(fd, 0)
      os.pwrite(fd, f'{os.getpid()}\n'.encode('ascii'), 0)
      _held[key] = [fd, 1]
  try:
    yield
  finally:
    with _mutex:
      entry = _held[key]
      entry[1] -= 1
      if entry[1] == 0:
        del _held[key]
        try:
          os.ftruncate(entry[0], 0)
        finally:
          os.close(entry[0])  # Closing the descriptor releases the flock.
