"""Atomic file writes: a temp file in the same directory, fsync, rename.

A reader (or a resumed run) sees either the old file or the new one, never a
partial one, whatever moment the writer is killed at.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import IO, Iterator


def fsync_dir(directory: str) -> None:
  """Makes a rename in `directory` durable (no-op where unsupported)."""
  try:
    fd = os.open(directory, os.O_RDONLY)
  except OSError:
    return
  try:
    os.fsync(fd)
  except OSError:
    pass
  finally:
    os.close(fd)


@contextlib.contextmanager
def atomic_write(path: str, mode: str = 'w',
                 encoding: str | None = 'utf-8') -> Iterator[IO]:
  """Yields a file to write; on success it replaces `path` atomically."""
  directory = os.path.dirname(path) or '.'
  os.makedirs(directory, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=directory,
                             prefix='.' + os.path.basename(path) + '.',
                             suffix='.tmp')
  try:
    with os.fdopen(fd, mode, encoding=None if 'b' in mode else encoding) as f:
      yield f
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise
  fsync_dir(directory)
