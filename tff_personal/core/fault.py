"""Fault injection for the crash-consistency tests: SIGKILL at a named point.

A run started with the environment variable

  TFF_PERSONAL_FAULT=<point>[:<n>]

kills itself with SIGKILL (no clean-up, no `finally`, as `kill -9` does)
the `n`-th time (default 1) it reaches `<point>`, one of `POINTS`:

* 'mid_round': a round's client states are saved in the store, not yet
  committed; its metrics are not released and no checkpoint is written.
* 'mid_checkpoint': the server checkpoint is written to its temporary
  directory, not yet renamed into place (`tff.program`'s atomic rename).
* 'after_checkpoint': the server checkpoint is in place; the client-state
  store has not committed the round.
* 'mid_evaluation': an evaluation is computed, not yet released.
* 'mid_store_commit': inside the client-state store's commit: the memory
  store's snapshot is written to its temporary file, not yet renamed; the
  SQLite store's transaction has deleted superseded versions, not yet
  committed.

Without the variable every point is a no-op. The variable is read here
only. Standard library only.

A test in the same process can instead run its own action at a point,
`on(point, n, action)`: e.g. fill the disk after the n-th checkpoint, to
see the run's next write fail as it would in the field.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import signal
import sys
from typing import Any, Iterator

ENV = 'TFF_PERSONAL_FAULT'
POINTS = ('mid_round', 'mid_checkpoint', 'after_checkpoint',
          'mid_evaluation', 'mid_store_commit')

_hits: collections.Counter = collections.Counter()
_actions: dict[str, tuple[int, Any]] = {}


def on(name: str, n: int, action) -> None:
  """Runs `action()` the `n`-th time this process reaches point `name`."""
  if name not in POINTS:
    raise ValueError(f'unknown fault point {name!r}; known: {POINTS}')
  _actions[name] = (n, action)


def _target() -> tuple[str, int] | None:
  spec = os.environ.get(ENV)
  if not spec:
    return None
  name, _, count = spec.partition(':')
  if name not in POINTS or (count and not count.isdigit()) or (
      count and int(count) < 1):
    raise ValueError(f'{ENV}={spec!r}: expected <point>[:<n>] with point one '
                     f'of {POINTS} and n >= 1')
  return name, int(count or 1)


def point(name: str) -> None:
  """SIGKILLs this process if `TFF_PERSONAL_FAULT` names `name` and this is
  its n-th hit; otherwise does nothing."""
  if name not in POINTS:
    raise ValueError(f'unknown fault point {name!r}; known: {POINTS}')
  if name in _actions:
    _hits[name] += 1
    n, action = _actions[name]
    if _hits[name] == n:
      action()
    return
  target = _target()
  if target is None or target[0] != name:
    return
  _hits[name] += 1
  if _hits[name] == target[1]:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


@contextlib.contextmanager
def during(name: str, owner: Any, attribute: str) -> Iterator[None]:
  """Within the block, `owner.attribute(...)` first passes `point(name)`.

  For a point inside code that is not ours (e.g. the rename of TFF's
  checkpoint writer). Patches nothing unless `TFF_PERSONAL_FAULT` names
  `name`.
  """
  target = _target()
  if target is None or target[0] != name:
    yield
    return
  original = getattr(owner, attribute)

  @functools.wraps(original)
  def wrapped(*args, **kwargs):
    point(name)
    return original(*args, **kwargs)

  setattr(owner, attribute, wrapped)
  try:
    yield
  finally:
    setattr(owner, attribute, original)
