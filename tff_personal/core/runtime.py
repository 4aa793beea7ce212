"""TFF execution contexts whose `worker_binary` never outlives the program.

TFF's `tff.backends.native.set_sync_local_cpp_execution_context` starts the C++
`worker_binary` on first use and relies on a `__del__` to stop it; at
interpreter exit that handler fails (`'NoneType' object has no attribute
'Popen'`) and the worker keeps running, holding the parent's stdout open. TFF
has no public handle on that process, so this module builds the same context
from TFF's own parts (the remote executor, its gRPC stub and the sync execution
context, exactly as `executor_factory.local_cpp_executor_factory` does) but owns
the subprocess:

* the worker is started with `PR_SET_PDEATHSIG=SIGKILL`, so the kernel ends it
  when the Python process dies for any reason, `kill -9` included;
* its stdout/stderr go to a log file (or /dev/null), never to the parent's
  stdout, so `python -m binaries.train ... | tail` terminates;
* `LocalCppRuntime.close()` (also run by `atexit`, by the context manager and by
  SIGTERM) stops it explicitly.

Written by hand because TFF lacks it; everything else is TFF's.

Two per-call costs of TFF's context are cut, both by hand (TFF has neither):
TFF's remote executor sends the invoked computation to the worker with
every call (for a process's `next`, about 200 KB to serialise, send and
parse each round); `_CachingExecutor` keeps the worker's copy of each
computation for as long as the worker-side executor lives. And TFF's
compiler cache hashes the whole computation proto on every call;
`_IdentityCompilerPipeline` looks the compiled form up by the computation
object first.

Secure sums: TFF's C++ worker cannot run `federated_secure_sum*` (the
distributed DP aggregator's, `core/privacy.py`), so every runtime here
compiles them as TFF's test backend does (`tff.backends.test`), to plain
sums (`lower_secure_intrinsics`): the simulation computes what secure
aggregation would, without its protection.

Multi-worker runs (`WorkersRuntime`, or `local_runtime(workers=[...])`): the
computations run on already running `worker_binary` services (start one per
machine with `python -m binaries.worker --port=N`), through TFF's remote
executor and TFF's mergeable-computation form
(`tff.backends.native.compile_to_mergeable_comp_form`). A call's
`CLIENTS`-placed arguments are split into one contiguous slice per worker;
each worker runs `up_to_merge` (client work and the accumulation of the single
aggregation) on its slice; the partial accumulators are merged in worker
order; each worker then runs `after_merge` on its slice, and the
`CLIENTS`-placed results are concatenated in worker order (server-placed
results are the first worker's). Why it runs `StatefulClientProcess.next`:
`next` has exactly one logical aggregation (the aggregator's sums, the metric
sums and the adaptive-clipping counts are parallel, none depends on another),
and its client-state output is `CLIENTS`-placed, which `after_merge` may
produce from its own slice and the merged aggregate. A plain remote context
over one worker would not split clients; TFF's C++ worker has no composing
executor to spread one call over several services.

Two things are written by hand here, both small: the ordering (TFF 0.87's
`MergeableCompExecutionContext` concatenates `after_merge` results and merges
partials in *completion* order, so with two workers client states can come
back attached to the wrong clients; docs/scale.md) and the worker
connection (TFF 0.87 dropped its remote-context factory). Computations whose
aggregations depend on one another have no mergeable form; TFF raises on
their first call (checked: the `next` of every algorithm in
`algorithms/registry.py`, built on mnist_preference, compiles to it). The cost of the form, stated in docs/scale.md: `after_merge`
recomputes the client work (force-aligned TFF computations pass nothing from
before the aggregation to after it except through the aggregation), so each
client would be trained twice. Sharded rounds avoid it: `worker_map` runs
each shard's work once on one worker, and the process then aggregates the
shards' results (`core/sharded.py`); only one-user-per-client rounds train
twice. Results equal the local run's only if the client
work is deterministic given its inputs, which holds for this project's
algorithms (seeded shuffling, no unseeded randomness in client work).
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import concurrent.futures
import contextlib
import os
import signal
import subprocess
import threading
import time
import weakref
from typing import Iterator, Optional, Sequence

from absl import logging
import grpc
import portpicker
import tensorflow_federated as tff

from tff_personal.core import coroutines
from tff_personal.core import parent_death
from tff_personal.core import worker_threads

# TFF internals: the same pieces TFF's own `local_cpp_executor_factory` uses.
from tensorflow_federated.python.common_libs import structure as _structure
from tensorflow_federated.python.core.backends.native import compiler as _native_compiler
from tensorflow_federated.python.core.backends.native import mergeable_comp_compiler as _mergeable_compiler
from tensorflow_federated.python.core.backends.test import compiler as _test_compiler
from tensorflow_federated.python.core.environments.tensorflow_frontend import tensorflow_computation as _tf_computation
from tensorflow_federated.python.core.impl.computation import computation_base as _computation_base
from tensorflow_federated.python.core.impl.computation import computation_impl as _computation_impl
from tensorflow_federated.python.core.impl.context_stack import context_base as _context_base
from tensorflow_federated.python.core.impl.context_stack import context_stack_impl as _context_stack_impl
from tensorflow_federated.python.core.impl.execution_contexts import async_execution_context as _async_execution_context
from tensorflow_federated.python.core.impl.execution_contexts import compiler_pipeline as _compiler_pipeline
from tensorflow_federated.python.core.impl.execution_contexts import mergeable_comp_execution_context as _mergeable_context
from tensorflow_federated.python.core.impl.execution_contexts import sync_execution_context as _sync_execution_context
from tensorflow_federated.python.core.impl.executor_stacks import python_executor_stacks as _python_executor_stacks
from tensorflow_federated.python.core.impl.executors import remote_executor as _remote_executor
from tensorflow_federated.python.core.impl.executors import remote_executor_grpc_stub as _remote_executor_grpc_stub
from tensorflow_federated.python.core.impl.types import computation_types as _computation_types
from tensorflow_federated.python.core.impl.types import type_analysis as _type_analysis
from tensorflow_federated.python.core.impl.types import type_conversions as _type_conversions

_GRPC_MAX_MESSAGE_LENGTH_BYTES = 2 * 1000 * 1000 * 1000
_GRPC_CHANNEL_OPTIONS = [
    ('grpc.max_message_length', _GRPC_MAX_MESSAGE_LENGTH_BYTES),
    ('grpc.max_receive_message_length', _GRPC_MAX_MESSAGE_LENGTH_BYTES),
    ('grpc.max_send_message_length', _GRPC_MAX_MESSAGE_LENGTH_BYTES),
    # A fresh worker is not listening yet when the channel first tries it;
    # gRPC's default reconnect backoff (1 s) then made every start wait
    # about a second for a worker that was up after about 0.1 s.
    ('grpc.initial_reconnect_backoff_ms', 20),
    ('grpc.min_reconnect_backoff_ms', 20),
    ('grpc.max_reconnect_backoff_ms', 200),
]
_READY_POLL_SECONDS = 0.01


def _release_tff_import_time_context() -> None:
  """Drops the context TFF installs at import, before interpreter teardown.

  `import tensorflow_federated` installs a local C++ context whose
  `ServiceManager.__del__` runs during interpreter teardown, when the
  `subprocess` module is already gone, and prints an AttributeError traceback.
  Releasing it from an atexit hook (which runs before teardown) lets `__del__`
  run while it still can; a worker it started, if any, is then stopped too.
  """
  import gc  # pylint: disable=g-import-not-at-top
  from tensorflow_federated.python.core.impl.context_stack import runtime_error_context  # pylint: disable=g-import-not-at-top
  stack = _context_stack_impl.context_stack
  if not isinstance(stack._stack[0], _sync_execution_context.SyncExecutionContext) or any(  # pylint: disable=protected-access
      rt.context is stack._stack[0] for rt in _RUNTIMES):  # pylint: disable=protected-access
    return
  stack.set_default_context(runtime_error_context.RuntimeErrorContext())
  gc.collect()


_RUNTIMES = []
atexit.register(_release_tff_import_time_context)
# The context `import tensorflow_federated` installed (the stack's default
# when this module is imported): a computation run on it starts a worker
# this program does not own, which can hang and outlive it.
_TFF_IMPORT_TIME_CONTEXT = _context_stack_impl.context_stack._stack[0]  # pylint: disable=protected-access


def installed() -> bool:
  """Whether TFF's current context was installed on purpose: one of this
  module's runtimes, or any other context a program set; False for TFF's
  import-time context (and for the error context it is replaced by at
  exit), on which computations must not run (`ensure_runtime`)."""
  from tensorflow_federated.python.core.impl.context_stack import runtime_error_context  # pylint: disable=g-import-not-at-top
  current = _context_stack_impl.context_stack.current
  return not (current is _TFF_IMPORT_TIME_CONTEXT or isinstance(
      current, runtime_error_context.RuntimeErrorContext))


@contextlib.contextmanager
def ensure_runtime() -> Iterator[None]:
  """The block runs in a runtime: the installed one, else a
  `local_runtime()` of the default settings started for the block (its
  worker stopped at the end, and with this process on any exit).

  For library calls that execute TFF computations (`runs.Run.evaluate`,
  `runs.run_experiment`, ...): called outside `local_runtime()`, they
  would otherwise run on TFF's import-time context, whose worker this
  program does not own.
  """
  if installed():
    yield
    return
  with local_runtime():
    yield


# How many compiled computations a context keeps by identity
# (`_IdentityCompilerPipeline`; TFF's own pipeline keeps 128 by hash).
_COMPILED_BY_IDENTITY = 128


class _IdentityCompilerPipeline(_compiler_pipeline.CompilerPipeline):
  """TFF's compiler pipeline, which first looks a computation up by identity.

  TFF's pipeline caches compiled computations by the computation's hash,
  which serialises its whole protocol buffer on every call (about 2 ms for
  a process's `next`). A program calls the same computation object every
  round, so this pipeline keeps the newest `_COMPILED_BY_IDENTITY` by
  object and falls back to TFF's cache (and compiler) on a miss. Written by
  hand: TFF's pipeline has no identity cache.
  """

  def __init__(self, compiler_fn):
    super().__init__(compiler_fn)
    self._by_identity = collections.OrderedDict()

  def compile(self, comp):
    hit = self._by_identity.get(id(comp))
    if hit is not None and hit[0] is comp:
      self._by_identity.move_to_end(id(comp))
      return hit[1]
    compiled = super().compile(comp)
    self._by_identity[id(comp)] = (comp, compiled)
    while len(self._by_identity) > _COMPILED_BY_IDENTITY:
      self._by_identity.popitem(last=False)
    return compiled


def lower_secure_intrinsics(comp):
  """`comp` with TFF's secure sums replaced by plain sums, as TFF's test
  backend compiles them (`tff.backends.test`'s
  `replace_secure_intrinsics_with_bodies`); `comp` itself when it has none.

  TFF's C++ worker cannot run `federated_secure_sum*`: a simulation runs
  what secure aggregation would compute (the sum, modular where the
  aggregator asks for it), without its protection. The production forms
  (`core/production.py`) keep the secure sums. Written by hand only to
  leave computations without secure sums untouched.
  """
  lowered, found = _test_compiler._replace_secure_intrinsics_with_insecure_bodies(  # pylint: disable=protected-access
      comp.to_building_block())
  if not found:
    return comp
  return _computation_impl.ConcreteComputation(
      computation_proto=lowered.proto,
      context_stack=_context_stack_impl.context_stack)


def _simulation_compile(comp):
  """The runtimes' compiler: TFF's native one after
  `lower_secure_intrinsics`."""
  return _native_compiler.desugar_and_transform_to_native(
      lower_secure_intrinsics(comp))


def _simulation_compile_mergeable(comp):
  """TFF's mergeable-form compiler after `lower_secure_intrinsics`."""
  return _mergeable_compiler.compile_to_mergeable_comp_form(
      lower_secure_intrinsics(comp))


def _compile_by_identity(context) -> None:
  """Gives a TFF sync or async execution context `_IdentityCompilerPipeline`
  (the pipeline is private to TFF's contexts; set where they are built)."""
  inner = getattr(context, '_async_context', context)
  inner._compiler_pipeline = _IdentityCompilerPipeline(  # pylint: disable=protected-access
      _simulation_compile)


# How many computations an executor keeps on its worker (`_CachingExecutor`).
_CACHED_COMPUTATIONS = 16


class _CachingExecutor(_remote_executor.RemoteExecutor):
  """TFF's `RemoteExecutor`, sending each computation to its worker once.

  TFF's execution context creates the invoked computation as a new value on
  every call, so the whole compiled computation (for a process's `next`,
  about 200 KB of protocol buffer) was serialised, sent and parsed by the
  worker on every round. This executor keeps the worker's value of the
  last `_CACHED_COMPUTATIONS` computations it created, keyed by the
  computation object (the context's compiler cache hands the same object
  to every call of one computation), for as long as its executor on the
  worker lives: new cardinalities or `close` start a new executor and
  drop them. A function value is immutable, so calling it again is the
  same as creating it again. Written by hand: TFF's remote executor has no
  such cache.
  """

  def __init__(self, stub):
    super().__init__(stub)
    self._computations = collections.OrderedDict()
    self._worker_stopped = False

  def set_cardinalities(self, cardinalities):
    self._computations.clear()
    super().set_cardinalities(cardinalities)

  def forget_worker(self):
    """The worker is stopping: the values it holds need no disposal.

    TFF disposes a remote value when it is collected, in batches of 20
    over gRPC; values still alive at interpreter exit are disposed then,
    after the worker has stopped, and each batch printed a gRPC traceback.
    The executor is otherwise left as it is: used again (TFF's context
    keeps one per cardinalities), its calls fail as retryable, and the
    context then builds a new executor on a new worker.
    """
    self._worker_stopped = True
    self._computations.clear()

  def _dispose(self, value_ref, value_executor_id):
    if not self._worker_stopped:
      super()._dispose(value_ref, value_executor_id)

  def close(self):
    self._computations.clear()
    super().close()

  async def create_value(self, value, type_spec=None):
    if not isinstance(value, _computation_base.Computation):
      return await super().create_value(value, type_spec)
    cached = self._computations.get(id(value))
    if cached is not None and cached[0] is value:
      self._computations.move_to_end(id(value))
      return cached[1]
    remote = await super().create_value(value, type_spec)
    self._computations[id(value)] = (value, remote)
    while len(self._computations) > _CACHED_COMPUTATIONS:
      self._computations.popitem(last=False)  # The worker's copy is disposed.
    return remote


def worker_binary_path() -> str:
  """Path of the `worker_binary` shipped inside the TFF pip package."""
  return os.path.join(os.path.dirname(tff.__file__), 'data', 'worker_binary')


class LocalCppRuntime:
  """Owns one local `worker_binary` and the sync TFF context that talks to it.

  Usage:

    with LocalCppRuntime() as runtime:   # installs itself as TFF's context
      process.next(...)
    # worker stopped here, whatever happened inside.

  The worker's TensorFlow thread pools default to one thread per op and one
  inter-op thread per CPU (`worker_threads`: concurrent client computations
  make the parallelism); -1 leaves TensorFlow's defaults (or the caller's
  `TF_NUM_*_THREADS` environment) in place.
  """

  def __init__(self,
               default_num_clients: int = 0,
               max_concurrent_computation_calls: int = -1,
               log_path: Optional[str] = None,
               intra_op_threads: Optional[int] = (
                   worker_threads.DEFAULT_INTRA_OP_THREADS),
               inter_op_threads: Optional[int] = (
                   worker_threads.DEFAULT_INTER_OP_THREADS)):
    self._default_num_clients = default_num_clients
    self._max_concurrent = max_concurrent_computation_calls
    self._log_path = log_path
    # Validated now: a bad count is an error before any worker starts.
    self._worker_env = worker_threads.worker_env(intra_op_threads,
                                                 inter_op_threads)
    self._process: Optional[subprocess.Popen] = None
    self._stub = None
    self._executors = weakref.WeakSet()  # Those on the current worker.
    self._lock = threading.Lock()
    self._closed = False
    self._previous_default = None
    factory = _python_executor_stacks.ResourceManagingExecutorFactory(
        executor_stack_fn=self._stack_fn)
    self.context = _sync_execution_context.SyncExecutionContext(
        executor_fn=factory,
        compiler_fn=_simulation_compile,
        transform_args=_tf_computation.transform_args,
        transform_result=_tf_computation.transform_result,
    )
    _compile_by_identity(self.context)
    atexit.register(self.close)
    _RUNTIMES.append(self)

  @property
  def worker_pid(self) -> Optional[int]:
    return self._process.pid if self._process is not None else None

  def _start_worker(self):
    binary = worker_binary_path()
    if not os.path.isfile(binary):
      raise RuntimeError(f'TFF worker binary not found at {binary}; is '
                         'tensorflow-federated installed?')
    port = portpicker.pick_unused_port()
    out = (open(self._log_path, 'ab') if self._log_path
           else subprocess.DEVNULL)
    # Without a fork of this process: it may run gRPC threads (a restart).
    self._process = parent_death.popen(
        [binary, f'--port={port}',
         f'--max_concurrent_computation_calls={self._max_concurrent}'],
        stdout=out, stderr=subprocess.STDOUT if self._log_path else out,
        stdin=subprocess.DEVNULL, env=self._worker_env)
    if self._log_path:
      out.close()
    channel = grpc.insecure_channel(f'localhost:{port}', _GRPC_CHANNEL_OPTIONS)
    self._stub = _remote_executor_grpc_stub.RemoteExecutorGrpcStub(channel)
    deadline = time.monotonic() + 60
    while not self._stub.is_ready:
      if self._process.poll() is not None:
        raise RuntimeError(
            f'TFF worker_binary exited with code {self._process.returncode} '
            'before it was ready')
      if time.monotonic() > deadline:
        self.close()
        raise RuntimeError('TFF worker_binary did not become ready in 60 s')
      time.sleep(_READY_POLL_SECONDS)
    logging.info('Started TFF worker_binary pid=%d port=%d',
                 self._process.pid, port)

  def _stack_fn(self, cardinalities):
    with self._lock:
      if self._closed:
        raise RuntimeError('LocalCppRuntime is closed')
      if self._stub is None or not self._stub.is_ready:
        if self._process is not None:
          self._stop_worker()
        self._start_worker()
    if cardinalities.get(tff.CLIENTS) is None:
      cardinalities[tff.CLIENTS] = self._default_num_clients
    ex = _CachingExecutor(self._stub)
    ex.set_cardinalities(cardinalities)
    self._executors.add(ex)
    return ex

  def _stop_worker(self):
    proc, self._process, self._stub = self._process, None, None
    for executor in list(self._executors):
      executor.forget_worker()
    self._executors = weakref.WeakSet()
    if proc is None or proc.poll() is not None:
      return
    proc.send_signal(signal.SIGINT)
    try:
      proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()

  def install(self) -> 'LocalCppRuntime':
    """Makes this runtime TFF's default context (until `close`)."""
    stack = _context_stack_impl.context_stack
    if self._previous_default is None:
      self._previous_default = stack._stack[0]  # pylint: disable=protected-access
    stack.set_default_context(self.context)
    return self

  def close(self) -> None:
    """Stops the worker and restores the previous default context.

    Idempotent; safe from atexit and signal handlers.
    """
    with self._lock:
      self._closed = True
      self._stop_worker()
      stack = _context_stack_impl.context_stack
      if (self._previous_default is not None and
          stack._stack[0] is self.context):  # pylint: disable=protected-access
        stack.set_default_context(self._previous_default)
      self._previous_default = None

  def __enter__(self) -> 'LocalCppRuntime':
    return self.install()

  def __exit__(self, *exc) -> None:
    self.close()


def parse_workers(workers) -> list[str]:
  """Validated `host:port` addresses from `'h1:p1,h2:p2'` or a sequence."""
  if isinstance(workers, str):
    items = [w.strip() for w in workers.split(',')]
  else:
    items = [str(w).strip() for w in workers]
  if not items or any(not w for w in items):
    raise ValueError(f'--workers={workers!r}: expected a comma-separated list '
                     'of host:port with no empty entries.')
  for w in items:
    host, sep, port = w.rpartition(':')
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
      raise ValueError(f'--workers: {w!r} is not host:port with a port in '
                       '1..65535.')
  if len(set(items)) != len(items):
    raise ValueError(f'--workers={workers!r} lists a worker twice; each '
                     'worker would get two slices of the clients.')
  return items


def _concurrently(calls: Sequence) -> list:
  """Runs `[ctx.invoke(comp, arg) for ctx, comp, arg in calls]`, one thread
  (and event loop) per call, and returns the results in order.

  TFF's remote executor makes blocking gRPC calls inside its coroutines, so
  workers awaited on one event loop compute one after the other; a thread
  each lets them compute at once.
  """
  if len(calls) == 1:
    ctx, comp, arg = calls[0]
    return [coroutines.run_sync(ctx.invoke(comp, arg))]
  with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
    futures = [pool.submit(lambda c=c: asyncio.run(c[0].invoke(c[1], c[2])))
               for c in calls]
    return [f.result() for f in futures]


class _OrderedMergeableContext(_context_base.SyncContext):
  """TFF's mergeable-computation execution, with results in worker order.

  The same steps as TFF's `MergeableCompExecutionContext` (its compiler, its
  argument split and its result repackaging are used as they are), except
  that partial aggregates are merged, and `CLIENTS`-placed results are
  concatenated, in the order of the slices rather than the order in which the
  workers finish. See the module docstring.
  """

  def __init__(self, async_contexts: Sequence[_context_base.AsyncContext]):
    self._contexts = list(async_contexts)
    self._pipeline = _compiler_pipeline.CompilerPipeline(
        _simulation_compile_mergeable)

  def invoke(self, comp, arg=None):
    form = self._pipeline.compile(comp)
    if arg is None:
      slices = [None]  # No CLIENTS-placed input: nothing to split.
    else:
      slices = _mergeable_context._split_value_into_subrounds(  # pylint: disable=protected-access
          arg, form.up_to_merge.type_signature.parameter, len(self._contexts))
    result = self._run(form, slices)
    result = _type_conversions.type_to_py_container(
        result, form.after_merge.type_signature.result)
    return _tf_computation.transform_result(result)

  def map_unplaced(self, comp, args: Sequence) -> list:
    """`[comp(*a) for a in args]`, the calls spread over the workers.

    `comp` takes no placed values (e.g. a TensorFlow computation). The
    calls go to the workers in contiguous blocks (the first
    `ceil(len / workers)` to the first worker, and so on), each worker's
    in order on a thread of its own, the workers concurrently, and the
    results come back in the order of `args`. What the sharded
    simulation runs its shards with (`core/sharded.py`): each shard's work
    once, on one worker.
    """
    args = list(args)
    if not args:
      return []
    per = -(-len(args) // len(self._contexts))
    blocks = [list(range(i, min(i + per, len(args))))
              for i in range(0, len(args), per)]
    results = [None] * len(args)

    def run_block(ctx, block):
      # Each worker in a thread of its own, with its own event loop: TFF's
      # remote executor makes blocking gRPC calls inside its coroutines, so
      # workers awaited on one loop would compute one after the other.
      for i in block:
        a = args[i]
        results[i] = asyncio.run(ctx.invoke(
            comp, _structure.Struct.unnamed(*a) if len(a) > 1 else a[0]))

    with concurrent.futures.ThreadPoolExecutor(len(blocks)) as pool:
      for future in [pool.submit(run_block, ctx, block)
                     for ctx, block in zip(self._contexts, blocks)]:
        future.result()
    return [_tf_computation.transform_result(
        _type_conversions.type_to_py_container(
            r, comp.type_signature.result)) for r in results]

  def _run(self, form, slices):
    contexts = self._contexts[:len(slices)]
    partials = _concurrently([(ctx, form.up_to_merge, a)
                              for ctx, a in zip(contexts, slices)])
    merged = partials[0]
    for partial in partials[1:]:
      merged = coroutines.run_sync(contexts[0].invoke(
          form.merge, _structure.Struct.unnamed(merged, partial)))

    def after_arg(a):
      return merged if a is None else _structure.Struct.unnamed(a, merged)

    result_type = form.after_merge.type_signature.result
    if _type_analysis.contains_only(
        result_type, lambda t: not isinstance(
            t, _computation_types.FederatedType) or t.all_equal):
      # No per-client result: every slice would return the same value.
      return coroutines.run_sync(contexts[0].invoke(form.after_merge,
                                            after_arg(slices[0])))
    results = _concurrently([(ctx, form.after_merge, after_arg(a))
                             for ctx, a in zip(contexts, slices)])
    return _mergeable_context._repackage_partitioned_values(  # pylint: disable=protected-access
        list(results), result_type)


class WorkersRuntime:
  """Runs TFF computations on running `worker_binary` services.

  Connects to every address (waiting up to `connect_timeout_s` for all to be
  ready; an unreachable one is an error naming it), and installs a context
  that splits each call's clients across the workers (module docstring). The
  workers are not owned: `close` disposes of this program's executors on them
  and closes the channels, and the services keep running for the next program.
  """

  def __init__(self, workers, connect_timeout_s: float = 60.0):
    self.addresses = parse_workers(workers)
    self._channels = []
    self._executors = []
    self._lock = threading.Lock()
    self._closed = False
    self._previous_default = None
    stubs = []
    for address in self.addresses:
      channel = grpc.insecure_channel(address, _GRPC_CHANNEL_OPTIONS)
      self._channels.append(channel)
      stubs.append(_remote_executor_grpc_stub.RemoteExecutorGrpcStub(channel))
    deadline = time.monotonic() + connect_timeout_s
    while not all(stub.is_ready for stub in stubs):
      if time.monotonic() > deadline:
        down = [a for a, stub in zip(self.addresses, stubs)
                if not stub.is_ready]
        self._close_channels()
        raise ConnectionError(
            f'TFF worker(s) {down} not reachable after {connect_timeout_s:.0f}'
            ' s. Start one on each host with `python -m binaries.worker '
            '--port=N` and check the host:port and the firewall.')
      time.sleep(_READY_POLL_SECONDS)
    self.context = _OrderedMergeableContext(
        [self._async_context(stub) for stub in stubs])
    logging.info('Connected to TFF workers %s', self.addresses)
    atexit.register(self.close)

  def _async_context(self, stub):
    def stack_fn(cardinalities):
      with self._lock:
        if self._closed:
          raise RuntimeError('WorkersRuntime is closed')
      if cardinalities.get(tff.CLIENTS) is None:
        cardinalities[tff.CLIENTS] = 0
      ex = _CachingExecutor(stub)
      ex.set_cardinalities(cardinalities)
      self._executors.append(ex)
      return ex

    context = _async_execution_context.AsyncExecutionContext(
        executor_fn=_python_executor_stacks.ResourceManagingExecutorFactory(
            executor_stack_fn=stack_fn),
        compiler_fn=_simulation_compile,
        transform_args=_tf_computation.transform_args,
        transform_result=_tf_computation.transform_result)
    _compile_by_identity(context)
    return context

  def install(self) -> 'WorkersRuntime':
    """Makes this runtime TFF's default context (until `close`)."""
    stack = _context_stack_impl.context_stack
    if self._previous_default is None:
      self._previous_default = stack._stack[0]  # pylint: disable=protected-access
    stack.set_default_context(self.context)
    return self

  def _close_channels(self):
    for channel in self._channels:
      channel.close()
    self._channels = []

  def close(self) -> None:
    """Releases this program's executors and channels; idempotent."""
    with self._lock:
      if self._closed:
        return
      self._closed = True
    for ex in self._executors:
      try:
        ex.close()  # Disposes of the executor on the (still running) worker.
      except Exception:  # pylint: disable=broad-except
        pass  # The worker may be gone already; nothing is left to release.
    self._executors = []
    self._close_channels()
    stack = _context_stack_impl.context_stack
    if (self._previous_default is not None and
        stack._stack[0] is self.context):  # pylint: disable=protected-access
      stack.set_default_context(self._previous_default)
    self._previous_default = None

  def __enter__(self) -> 'WorkersRuntime':
    return self.install()

  def __exit__(self, *exc) -> None:
    self.close()


_default_workers: list[str] = []


@contextlib.contextmanager
def default_workers(workers) -> Iterator[None]:
  """Within the block, `local_runtime()` called without `workers` runs on
  these services (validated by `parse_workers`; empty: a local worker).

  What `binaries.reproduce --workers` uses: the paper modules open their
  runtimes themselves.
  """
  global _default_workers
  previous = _default_workers
  _default_workers = parse_workers(workers) if workers else []
  try:
    yield
  finally:
    _default_workers = previous


def worker_map():
  """The installed multi-worker context's `map_unplaced`, or None.

  None when TFF's current context is not a `WorkersRuntime`'s (a local
  run): callers then run their work in one call.
  """
  context = _context_stack_impl.context_stack.current
  return context.map_unplaced if isinstance(
      context, _OrderedMergeableContext) else None


def configure_driver_threads(intra_op_threads: Optional[int],
                             inter_op_threads: Optional[int]) -> bool:
  """Gives this process's TensorFlow the local worker's thread pools.

  A local sharded run computes its shards in this process
  (`sharded.DriverShardWork`), so the data-parallel setting of the worker
  (`worker_threads`: one thread per op, concurrency from the concurrent
  shards) applies here too; importing the library gives it by default
  (`worker_threads.set_process_defaults`). TensorFlow fixes its pools when
  its context starts; if it has started with other pools, this logs a
  warning saying how to set them and changes nothing (the run is correct,
  its float reductions may be ordered differently and its shards slower).
  Returns whether the pools match.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  threading_config = tf.config.threading
  ok = True
  for value, name, var, get, set_ in (
      (intra_op_threads, 'intra_op_threads', worker_threads.INTRA_VAR,
       threading_config.get_intra_op_parallelism_threads,
       threading_config.set_intra_op_parallelism_threads),
      (inter_op_threads, 'inter_op_threads', worker_threads.INTER_VAR,
       threading_config.get_inter_op_parallelism_threads,
       threading_config.set_inter_op_parallelism_threads)):
    n = worker_threads.resolve(value, f'--{name}')
    if n is None:  # TensorFlow's default (or the caller's variable).
      worker_threads.restore_environment(var)
      continue
    current = get() or worker_threads.from_environment(var)
    if current == n:
      continue
    try:
      set_(n)
    except RuntimeError:
      ok = False
      logging.warning(
          'TensorFlow started in this process before the runtime, with '
          '%s=%s, not %d: shards computed here use those pools, so results '
          'may differ from a binary\'s in the last digits. Give it the '
          'pools before its first op: call runtime.configure_driver_threads'
          '(...) first, or import tasks.registry or tff_personal.run.runs '
          'first '
          '(they set %s to the default) and leave %s unset.',
          name, current or 'its default', n, var, var)
  return ok


def thread_settings() -> dict[str, dict[str, Optional[int]]]:
  """The TensorFlow pools a run computes with, as a run records them
  (run_config.json's `threads`): `driver`, this process's as configured;
  `worker`, the installed local runtime's worker's (None for remote
  workers or another context). A count of None is TensorFlow's default."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  threading_config = tf.config.threading
  driver = {
      'intra_op_threads': (
          threading_config.get_intra_op_parallelism_threads() or
          worker_threads.from_environment(worker_threads.INTRA_VAR)),
      'inter_op_threads': (
          threading_config.get_inter_op_parallelism_threads() or
          worker_threads.from_environment(worker_threads.INTER_VAR))}
  current = _context_stack_impl.context_stack.current
  worker = None
  for rt in _RUNTIMES:
    if rt.context is current:
      env = rt._worker_env  # pylint: disable=protected-access
      worker = {name: int(env[var]) if env.get(var) else None
                for name, var in (
                    ('intra_op_threads', worker_threads.INTRA_VAR),
                    ('inter_op_threads', worker_threads.INTER_VAR))}
  return {'driver': driver, 'worker': worker}


@contextlib.contextmanager
def local_runtime(log_path: Optional[str] = None,
                  handle_sigterm: bool = True,
                  workers=None,
                  intra_op_threads: Optional[int] = (
                      worker_threads.DEFAULT_INTRA_OP_THREADS),
                  inter_op_threads: Optional[int] = (
                      worker_threads.DEFAULT_INTER_OP_THREADS),
                  ) -> Iterator[LocalCppRuntime | WorkersRuntime]:
  """Installs a `LocalCppRuntime` for the block and always stops its worker.

  `intra_op_threads` / `inter_op_threads` set the local worker's TensorFlow
  thread pools (`LocalCppRuntime`); remote workers get theirs from
  `binaries.worker`'s flags of the same names.

  With `handle_sigterm`, SIGTERM becomes `SystemExit` so that the `finally`
  clauses of the program (checkpoint files, the store) run before exit.

  With `workers` (`'host:port,...'` or a sequence; see `parse_workers`;
  default: those of an enclosing `default_workers` block), no local worker
  is started: the block runs on those services through a `WorkersRuntime`,
  released at the end of the block.
  """
  if workers is None:
    workers = _default_workers or None
  previous = None
  if handle_sigterm and threading.current_thread() is threading.main_thread():
    def _on_sigterm(signum, frame):
      raise SystemExit(128 + signum)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
  if not workers:
    configure_driver_threads(intra_op_threads, inter_op_threads)
  try:
    runtime = (LocalCppRuntime(log_path=log_path,
                               intra_op_threads=intra_op_threads,
                               inter_op_threads=inter_op_threads)
               if not workers else WorkersRuntime(workers))
  except BaseException:
    if previous is not None:
      signal.signal(signal.SIGTERM, previous)
    raise
  try:
    with runtime:
      yield runtime
  finally:
    runtime.close()
    if previous is not None:
      signal.signal(signal.SIGTERM, previous)
