"""Threads that run shard loops at once, each on its own model and trace.

The sharded simulation (`core/sharded.py`) computes a round's shards in this
process, one thread per shard (`sharded.DriverShardWork`), and so does its
evaluation (`core/sharded_eval.ShardedPersonalEval`). A thread never shares
a model or a traced program: `trace_loop` traces each shard's loop over its
own variables, and `run_concurrently` runs the loops in the process's pool
of threads (`shard_pool`).

Example:

  runs = []
  outputs = run_concurrently(
      runs, lambda call: trace_loop(make_loop, signature_of(call)), calls)
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from typing import Sequence

import tensorflow as tf


def trace_loop(make_fn, signature, **function_kwargs):
  """`make_fn()`'s function traced for `signature`, in this thread.

  Each concurrent shard loop is traced on its own, with its own model: the
  kernels of one traced program are shared by its concurrent calls, and
  running one trace on several threads with other variables bound in its
  place (`ConcreteFunction._call_flat` with other captured inputs, which
  saved a trace per shard) corrupted memory in FedPerC's evaluation
  ("double free") and changed bits of sharded rounds. A trace costs
  seconds, once per shard per run.

  Args:
    make_fn: Builds the loop's model (eagerly) and returns the Python
      function to trace over it.
    signature: The `tf.function` input signature.
    **function_kwargs: Passed to `tf.function` (e.g. `autograph`).

  Returns:
    A `TracedLoop` of the traced `tf.function` (its concrete function made
    now, not in a thread).
  """
  return TracedLoop(tf.function(make_fn(), input_signature=signature,
                                **function_kwargs))


class TracedLoop:
  """A traced shard loop. Called, it runs the `tf.function`'s one concrete
  function directly: the function has an input signature, so matching the
  call to a trace at every call (a millisecond or more of Python per call,
  a round's fixed cost) finds the same one each time.

  Attributes:
    function: the `tf.function` (e.g. to inspect its graphs).
  """

  def __init__(self, function):
    self.function = function
    self._concrete = function.get_concrete_function()

  def __call__(self, *args):
    return self._concrete(*args)


_POOL = None
_POOL_LOCK = threading.Lock()


def _forget_pool_in_child() -> None:
  """A forked child has none of the parent's threads: it starts its own
  pool on first use."""
  global _POOL, _POOL_LOCK
  _POOL, _POOL_LOCK = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool_in_child)


def shard_pool() -> concurrent.futures.ThreadPoolExecutor:
  """The process's threads for concurrent shard loops, started on first use
  and kept, so that a round does not pay for starting threads. Up to
  max(8, CPU count) loops run at once; more wait for a free thread."""
  global _POOL
  with _POOL_LOCK:
    if _POOL is None:
      _POOL = concurrent.futures.ThreadPoolExecutor(
          max_workers=max(8, os.cpu_count() or 1),
          thread_name_prefix='tff_personal_shard')
    return _POOL


def run_concurrently(runs: list, build, calls: Sequence[tuple],
                     lanes: int | None = None) -> list:
  """`[runs[lane(i)](*calls[i]) for each call]`, lanes run at once in
  threads.

  Each run is a traced shard loop on its own model (a thread never shares
  one). With `lanes` (at most that many runs at once), the calls are dealt
  to the lanes in a snake order (0, 1, ..., L-1, L-1, ..., 0, 0, ...), so
  that calls sorted by size load the lanes about evenly, and each lane
  runs its calls one after another on its own run; without, each call has
  a lane of its own. Missing runs are first appended to `runs` by
  `build(calls[0])`, one at a time in this thread (tracing is not done in
  threads).
  """
  count = len(calls) if lanes is None else max(1, min(lanes, len(calls)))
  while len(runs) < count:
    runs.append(build(calls[0]))
  lane_of = [i % count if (i // count) % 2 == 0 else count - 1 - i % count
             for i in range(len(calls))]
  if count == 1:
    return [runs[0](*c) for c in calls]

  def run_lane(k):
    return [(i, runs[k](*calls[i])) for i in range(len(calls))
            if lane_of[i] == k]

  futures = [shard_pool().submit(run_lane, k) for k in range(count)]
  results = [None] * len(calls)
  for f in futures:
    for i, r in f.result():
      results[i] = r
  return results
