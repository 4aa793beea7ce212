"""Threads that run shard loops at once, each on its own model, on one trace.

The sharded simulation (`core/sharded.py`) computes a round's shards in this
process, one thread per shard (`sharded.DriverShardWork`), and so does its
evaluation (`core/sharded_eval.ShardedPersonalEval`). A thread never shares
a model: each shard loop has its own variables. Tracing a loop costs
seconds, so `SharedTrace` traces the first and runs each further loop on
that trace with its own variables; `run_concurrently` runs the loops in the
process's pool of threads (`shard_pool`).

Example:

  trace, runs = SharedTrace(), []
  outputs = run_concurrently(
      runs, lambda call: trace.build(make_loop, signature_of(call)), calls)
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from typing import Sequence

import tensorflow as tf
# For `SharedTrace`: TF has no public way to run one traced function over
# another set of variables.
from tensorflow.python.eager.polymorphic_function import function_type_utils  # pylint: disable=g-direct-tensorflow-import


# Random ops whose state lives in their kernel (seeded per op), not in a
# variable or an argument; `Stateless*` ops are not among them.
_OP_SEEDED_RANDOM_OPS = frozenset([
    'Multinomial', 'ParameterizedTruncatedNormal', 'TruncatedNormal'])


def _draws_op_seeded_randoms(graph_def) -> bool:
  """Whether a graph, or a function in its library, has an op-seeded
  random op."""
  nodes = list(graph_def.node)
  for function in graph_def.library.function:
    nodes.extend(function.node_def)
  return any(n.op.startswith('Random') or n.op in _OP_SEEDED_RANDOM_OPS
             for n in nodes)


class SharedTrace:
  """Traces a shard loop once and runs each further shard's loop on it.

  Concurrent shards each need their own model variables (a thread never
  shares a model), but their loops are the same TF program: tracing one
  costs seconds (the per-user step, the model's forward and backward pass),
  and a sharded run used to trace it once per shard at start-up. Here the
  first `build` traces; each later one builds the loop's Python (its model,
  so fresh variables, in the order the first build created them) and
  returns the first trace called with the new variables in place of the
  first build's (`ConcreteFunction._call_flat` with other captured inputs;
  TF offers no public API for it, hence this class).

  It falls back to tracing whenever that would not be the same program: a
  traced resource input that is not one of the variables the build
  created (a variable created while tracing, say), builds that create
  variables of other shapes, dtypes or number, or another signature. It
  also traces each loop whose program draws from op-seeded random ops
  (`tf.random.uniform`, Keras dropout): one program's kernels, and so their
  random state, are shared by its concurrent calls, which would make the
  draws depend on the threads' timing.
  """

  def __init__(self):
    self._planned = False
    self._template = None  # (signature, concrete function, plan, specs)

  def build(self, make_fn, signature, **function_kwargs):
    """`make_fn()`'s function, as a callable traced for `signature`.

    Args:
      make_fn: Builds the loop's model (eagerly) and returns the Python
        function to trace over it.
      signature: The `tf.function` input signature.
      **function_kwargs: Passed to `tf.function` (e.g. `autograph`).

    Returns:
      A callable taking the signature's arguments.
    """
    created = []

    def record(next_creator, **kwargs):
      v = next_creator(**kwargs)
      created.append(v)
      return v

    with tf.variable_creator_scope(record):
      fn = make_fn()
    if self._template is not None:
      run = self._rebound(signature, created)
      if run is not None:
        return run
    traced = tf.function(fn, input_signature=signature, **function_kwargs)
    concrete = traced.get_concrete_function()  # Traced now, not in a thread.
    if not self._planned:  # The first trace only, rebindable or not.
      self._planned = True
      self._template = self._plan(signature, concrete, created)
    return traced

  @staticmethod
  def _plan(signature, concrete, created):
    """For each captured input of `concrete`: the index of the created
    variable it is the handle of, or the input itself (a constant); None
    if a resource input is not a created variable's."""
    if _draws_op_seeded_randoms(concrete.graph.as_graph_def()):
      return None
    index = {id(v.handle): i for i, v in enumerate(created)}
    plan = []
    for t in concrete.captured_inputs:
      if id(t) in index:
        plan.append(index[id(t)])
      elif t.dtype == tf.resource:
        return None
      else:
        plan.append(t)
    specs = [(v.dtype, tuple(v.shape)) for v in created]
    return signature, concrete, plan, specs

  def _rebound(self, signature, created):
    old_signature, concrete, plan, specs = self._template
    if ([(v.dtype, tuple(v.shape)) for v in created] != specs or
        signature != old_signature):
      return None
    captures = [created[p].handle if isinstance(p, int) else p for p in plan]

    def run(*args):
      bound = function_type_utils.canonicalize_function_inputs(
          args, {}, concrete.function_type)
      return concrete._call_flat(  # pylint: disable=protected-access
          concrete.function_type.unpack_inputs(bound), captures)

    run.variables = created  # Kept alive as long as the loop.
    return run


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


def run_concurrently(runs: list, build, calls: Sequence[tuple]) -> list:
  """`[runs[i](*calls[i]) for each call]`, the calls run at once in threads.

  Each run is a traced shard loop on its own model (a thread never shares
  one). Missing runs are first appended to `runs` by `build(calls[0])`, one
  at a time in this thread (tracing is not done in threads).
  """
  while len(runs) < len(calls):
    runs.append(build(calls[0]))
  if len(calls) == 1:
    return [runs[0](*calls[0])]
  futures = [shard_pool().submit(runs[i], *calls[i])
             for i in range(len(calls))]
  return [f.result() for f in futures]
