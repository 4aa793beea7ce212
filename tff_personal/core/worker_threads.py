"""TensorFlow thread pools of a TFF `worker_binary`, set through its environment.

A TFF simulation runs its client computations concurrently inside the C++
`worker_binary` (`max_concurrent_computation_calls=-1`; the sharded
simulation runs one shard per CPU, `core/sharded.py`). TensorFlow's defaults
then give *each* op of *each* concurrent computation an intra-op thread pool
as wide as the machine, so concurrent shards fight over the same cores for
ops too small to split (the FedEmbed MNIST CNN at batch 10). The data-parallel
setting is one intra-op thread per op and one inter-op thread per CPU: the
concurrency then comes from the concurrent computations, not from splitting
tiny ops.

What the settings change in throughput: docs/performance.md.

The worker reads the standard TensorFlow variables `TF_NUM_INTRAOP_THREADS`
and `TF_NUM_INTEROP_THREADS` when it creates its thread pools, so this module
builds the child's environment, and sets this process's defaults the same
way when it is imported (`set_process_defaults`); it imports nothing heavy
(the worker launcher `binaries/worker.py` uses it without importing
TensorFlow). Written by hand because TFF's context factories expose no
thread settings.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

INTRA_VAR = 'TF_NUM_INTRAOP_THREADS'
INTER_VAR = 'TF_NUM_INTEROP_THREADS'

# The project's default: one thread per op, one inter-op thread per CPU.
DEFAULT_INTRA_OP_THREADS = 1
DEFAULT_INTER_OP_THREADS = 0


def cpu_count() -> int:
  """CPUs this process may run on (its affinity mask, not the machine's)."""
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:  # Not Linux.
    return os.cpu_count() or 1


def resolve(threads: Optional[int], name: str) -> Optional[int]:
  """`threads` as the worker will get it: None (TF's default) or n >= 1.

  Args:
    threads: n >= 1: exactly n; 0: the CPU count; None or -1: leave the
      variable to the environment (TensorFlow's own default if unset).
    name: The setting's name, for the error message.

  Raises:
    ValueError: for other values.
  """
  if threads is None or threads == -1:
    return None
  if not isinstance(threads, int) or isinstance(threads, bool) or threads < 0:
    raise ValueError(f'{name} must be -1 (TensorFlow\'s default), 0 (the CPU '
                     f'count) or a positive number of threads; got {threads!r}')
  return threads or cpu_count()


def worker_env(intra_op_threads: Optional[int] = DEFAULT_INTRA_OP_THREADS,
               inter_op_threads: Optional[int] = DEFAULT_INTER_OP_THREADS,
               base: Optional[Mapping[str, str]] = None) -> dict[str, str]:
  """The environment of a `worker_binary` with the given thread pools.

  Args:
    intra_op_threads: Threads one op may use (see `resolve`).
    inter_op_threads: Ops run at once across the worker's computations.
    base: The environment to start from (default: this process's).

  Returns:
    A copy of `base` with `TF_NUM_INTRAOP_THREADS` / `TF_NUM_INTEROP_THREADS`
    set where a count was given (an explicit count overrides `base`).
  """
  env = dict(os.environ if base is None else base)
  for var, value, name in ((INTRA_VAR, intra_op_threads, 'intra_op_threads'),
                           (INTER_VAR, inter_op_threads, 'inter_op_threads')):
    n = resolve(value, name)
    if n is not None:
      env[var] = str(n)
    elif base is None:  # The caller's own environment, not our default.
      restore_environment(var, env)
  return env


# This process's thread variables before `set_process_defaults`.
_ORIGINAL = {var: os.environ.get(var) for var in (INTRA_VAR, INTER_VAR)}


def restore_environment(var: str, env=None) -> None:
  """Sets `var` in `env` (default: `os.environ`) back to what the program
  was started with (unset if it was), undoing `set_process_defaults`: a
  count of -1 means TensorFlow's own default, or the caller's variable."""
  env = os.environ if env is None else env
  if _ORIGINAL[var] is None:
    env.pop(var, None)
  else:
    env[var] = _ORIGINAL[var]


def set_process_defaults() -> None:
  """Gives this process's TensorFlow the project's thread pools (one thread
  per op, one inter-op thread per CPU) through `TF_NUM_INTRAOP_THREADS` /
  `TF_NUM_INTEROP_THREADS`, unless the environment sets them already.

  TensorFlow reads them when its context starts, at its first op. Run at
  the import of this module (so by `core/runtime.py`'s) and of the task
  modules (`tasks/registry.py`, `tasks/client_data_task.py`), so that a
  program that starts TensorFlow before it enters
  `runtime.local_runtime()` computes with the pools a binary sets before
  it loads data: the same settings give the same weights on both paths.
  Idempotent.
  """
  os.environ.setdefault(INTRA_VAR, str(resolve(DEFAULT_INTRA_OP_THREADS,
                                               INTRA_VAR)))
  os.environ.setdefault(INTER_VAR, str(resolve(DEFAULT_INTER_OP_THREADS,
                                               INTER_VAR)))


def from_environment(var: str) -> Optional[int]:
  """The thread count `var` sets in this process's environment (None when
  unset or not a positive number): what TensorFlow takes for a pool left
  at 0 in its configuration."""
  try:
    n = int(os.environ.get(var, ''))
  except ValueError:
    return None
  return n if n > 0 else None


set_process_defaults()
