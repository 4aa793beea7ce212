"""`coroutines.run_sync`: `asyncio.run`'s result, without formatting its
arguments, and no task of a failed call left to run in a later one."""

import asyncio
import signal

import pytest

from tff_personal.core import coroutines


class _CountsRepr:

  def __init__(self):
    self.reprs = 0

  def __repr__(self):
    self.reprs += 1
    return 'counted'


async def _identity(value):
  await asyncio.sleep(0)
  return value


def test_result_is_asyncio_run_s_and_no_argument_is_formatted():
  arg = _CountsRepr()
  # What it avoids (on the main thread, where pytest runs tests): the
  # handler `asyncio.run` installs, while SIGINT has Python's default one,
  # is formatted with the task's arguments when it is replaced. (Another
  # test in this process may have left its own handler: set the default.)
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    assert coroutines.run_sync(_identity(arg)) is arg
    assert arg.reprs == 0
    asyncio.run(_identity(arg))
  finally:
    signal.signal(signal.SIGINT, previous)
  assert arg.reprs > 0


def test_a_failed_call_leaves_no_task_for_the_next():
  finished = []

  async def background():
    await asyncio.sleep(0.05)
    finished.append(True)

  async def fails():
    asyncio.get_running_loop().create_task(background())
    await asyncio.sleep(0)
    raise ValueError('boom')

  with pytest.raises(ValueError, match='boom'):
    coroutines.run_sync(fails())
  # The next call runs on a new loop, long enough for the old task to
  # finish had it been left pending.
  coroutines.run_sync(asyncio.sleep(0.1))
  assert not finished
