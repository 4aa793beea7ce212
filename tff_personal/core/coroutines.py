"""Runs a coroutine to completion from synchronous code.

`run_sync(coro)` is `asyncio.run(coro)` without its SIGINT handling. On the
main thread, Python 3.11's `asyncio.run` installs a SIGINT handler that holds
the main task, and `signal.signal` formats the handler it replaces with
`repr` (`signal._int_to_enum`). That repr includes the coroutine's
arguments: saving or loading a checkpoint printed the whole server state's
arrays to a string, twice per call, to throw the string away. A loop per
thread, reused, installs no handler; Ctrl-C interrupts it as it interrupts
any blocking call.

Usage:

  versions = coroutines.run_sync(manager.get_versions())
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Coroutine

_LOCAL = threading.local()


def run_sync(coro: Coroutine) -> Any:
  """Runs `coro` on this thread's event loop and returns its result.

  Args:
    coro: a coroutine, not yet awaited.

  Returns:
    What `coro` returns (its exception propagates).

  Raises:
    RuntimeError: called while an event loop runs on this thread (as
      `asyncio.run`).
  """
  loop = getattr(_LOCAL, 'loop', None)
  if loop is None or loop.is_closed():
    loop = _LOCAL.loop = asyncio.new_event_loop()
  try:
    return loop.run_until_complete(coro)
  except BaseException:
    # An error, or Ctrl-C in the middle: no task of this call may run on
    # in a later call. The loop's tasks are cancelled and the loop closed,
    # as `asyncio.run` does; the next call makes a new one.
    _LOCAL.loop = None
    try:
      tasks = asyncio.all_tasks(loop)
      for task in tasks:
        task.cancel()
      if tasks:
        loop.run_until_complete(
            asyncio.gather(*tasks, return_exceptions=True))
    finally:
      loop.close()
    raise
