"""Helpers for tests that check which processes are alive."""

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
