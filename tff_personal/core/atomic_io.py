"""Atomic file writes: a temp file in the same directory, fsync, rename.

A reader (or a resumed run) sees either the old file or the new one, never a
partial one, whatever moment the writer is killed at. `write_json`,
`read_json` and `cached_json` are the JSON files built on it (analysis
caches, records); a file that cannot be read raises one error naming it.

Example:

  from tff_personal.core import atomic_io
  result = atomic_io.cached_json('out/eval_seed0.json', expensive_fn)
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from typing import IO, Any, Callable, Iterator


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


def write_json(path: str, value: Any, sort_keys: bool = True) -> None:
  """Writes `value` to `path` as indented JSON, atomically."""
  with atomic_write(path) as f:
    f.write(json.dumps(value, indent=1, sort_keys=sort_keys))


def read_json(path: str) -> Any:
  """The JSON value in `path`.

  Raises:
    ValueError: naming `path`, when it cannot be read or is not JSON (for
      example a file cut short on a full disk, or edited by hand).
  """
  try:
    with open(path, encoding='utf-8') as f:
      return json.load(f)
  except (OSError, ValueError, RecursionError) as e:  # JSONDecodeError,
    # UnicodeDecodeError; RecursionError: arrays or objects nested deeper
    # than Python's stack.
    raise ValueError(f'{path} is not valid JSON ({type(e).__name__}: {e}); '
                     'nothing was changed: restore it, or remove it if it '
                     'is a cache to compute again') from e


def cached_json(path: str, compute: Callable[[], Any],
                sort_keys: bool = True) -> Any:
  """`path`'s JSON value when the file exists; else `compute()`, written to
  `path` atomically (`write_json`) and returned as it reads back.

  For results that are costly to make and a pure function of what keys the
  path (a digest-keyed directory, say): a killed computation leaves no file,
  so it is computed again; a file that cannot be read raises (`read_json`),
  and is never silently replaced.
  """
  if os.path.exists(path):
    return read_json(path)
  write_json(path, compute(), sort_keys=sort_keys)
  return read_json(path)
