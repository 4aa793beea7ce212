r"""Simulation benchmark: TFF's FedAvg, the project's processes, plain Keras.

  python -m binaries.benchmark --output_dir=/tmp/bench \
    [--cohorts=50,200] [--rounds=12] [--systems=...] [--peer_python=PATH] \
    [--memory_rounds=200] [--families=...] [--worker_pairs=4]

One workload for every system (FedEmbed Appendix B.1's MNIST CNN; clients of
20 generated 28x28 examples; local batch 10; one local epoch; local Adam
1e-3; server SGD 1, i.e. FedAvg; a population of 1,000 clients; the cohort
of each round drawn from (seed, round)). Systems:

* `tff_fedavg`: `tff.learning.algorithms.build_weighted_fed_avg` on the
  Keras model, one TFF client per user (the in-framework reference), with
  TensorFlow's default thread pools in the worker as TFF's own local context
  runs it (`--reference_threads=project` gives it the project's).
* `global`, `global_plus`, `fedembed_prototype`: the project's processes
  (`--simulation_shards`: -1 auto = sharded, 0 = one user per TFF client;
  the worker's thread pools from `--intra_op_threads` / `--inter_op_threads`,
  by default one thread per op and one inter-op thread per CPU),
  driven as `binaries.train` drives them: a client-state store, per-user
  `tf.data` datasets, `next`, states saved back (no checkpoints, no eval).
* `tf_ceiling`: the arithmetic ceiling. FedAvg's arithmetic on each
  cohort (every client: the global weights, local Adam over its batches,
  its delta; the mean delta applied with SGD 1) as one `tf.function` of
  `tf.while_loop`s in one process: no federation, no TFF, no `tf.data`
  (`build_ceiling_round`; a test holds it equal to the `global` process's
  round). Every system is reported as a fraction of it.
* `keras_central`: Keras `fit` once per round over the cohort's examples
  (the same batches, one pass, one optimizer state): what plain Keras costs,
  per-call set-up included. Not a ceiling.
* `pfl_fedavg` (with `--peer_python`): Apple's pfl-research on the same
  workload, run by `bench/peers/pfl_fedavg.py` in its own environment.

`--worker_pairs=N` adds the multi-worker rows (`binaries/benchmark_workers.py`):
N pairs of a project system on one `binaries.worker` pinned to a core,
then on two pinned to a core each, each pair beside the machine's own
two-core speed-up measured just before it, with the two runs' final
weights compared.

Each (system, cohort) runs in a fresh subprocess, so `startup_s` covers the
interpreter start, imports, building/tracing and the first round, and
`peak_rss_mib` is the peak of the summed RSS of the subprocess and all its
children (TFF's `worker_binary` included), sampled every 200 ms (more often
costs the machine measurable CPU).
`--memory_rounds=N` also runs `fedembed_prototype` at the first cohort for N
rounds and records the RSS after round 20 and after round N.

Writes `<output_dir>/benchmark.json` (a list of records: name, cohort,
client_updates_per_s, examples_per_s, seconds_per_round, startup_s,
peak_rss_mib, ...; family rows also have workload, form, stage),
`benchmark_run.json` (machine, command and the records: what
`tools/readme_tables.py` reads from `docs/benchmark/`) and `benchmark.md`,
and prints the tables (`binaries/benchmark_report.py`) with ratios against
`tff_fedavg` (the reference), `tf_ceiling` (the arithmetic ceiling) and
pfl.
"""

from __future__ import annotations

import collections
import json
import os
import platform
import subprocess
import sys
import threading
import time
from typing import Sequence

from absl import app
from absl import flags
import numpy as np
import psutil
import tensorflow as tf
import tensorflow_federated as tff

from binaries import benchmark_families
from binaries import benchmark_report
from binaries import benchmark_workers
from tasks import preference_task
from tff_personal.algorithms import fedavg
from tff_personal.algorithms import registry
from tff_personal.core import client_data
from tff_personal.core import client_state
from tff_personal.core import runtime
from tff_personal.core import sharded
from tff_personal.core import training_loop
from tff_personal.core import worker_threads
from tff_personal.models import fedembed_mnist

FLAGS = flags.FLAGS

PROJECT_SYSTEMS = ('global', 'global_plus', 'fedembed_prototype')
SYSTEMS = ('tff_fedavg', *PROJECT_SYSTEMS, 'tf_ceiling', 'keras_central')
CEILING = benchmark_report.CEILING
render_markdown = benchmark_report.render_markdown
LOCAL_LEARNING_RATE = 1e-3
EXAMPLES_PER_CLIENT = 20
BATCH_SIZE = 10
POPULATION = 1000

def define_flags():
  """Defines the binary's flags (at run time, so tests can import this)."""
  flags.DEFINE_string('output_dir', None, 'Where benchmark.json/.md go.')
  flags.DEFINE_list('cohorts', ['10', '50', '200'], 'Cohort sizes.')
  flags.DEFINE_list('systems', list(SYSTEMS), 'Systems to run.')
  flags.DEFINE_integer('rounds', 12, 'Rounds per (system, cohort); the first '
                       'is start-up, the rest give the steady-state rate.')
  flags.DEFINE_integer('simulation_shards', -1,
                       'For the project\'s systems: -1 auto (sharded), 0 one '
                       'user per TFF client, n shards.')
  flags.DEFINE_enum('shards_in', sharded.IN_DRIVER,
                    [sharded.IN_DRIVER, sharded.IN_EXECUTOR],
                    'For the project\'s sharded systems: where the shards\' '
                    'client work runs (this process, or TFF\'s executor with '
                    'the shards as its clients).')
  flags.DEFINE_integer('intra_op_threads',
                       worker_threads.DEFAULT_INTRA_OP_THREADS,
                       'worker_binary threads per op for the project\'s '
                       'systems (-1: TensorFlow\'s default).')
  flags.DEFINE_integer('inter_op_threads',
                       worker_threads.DEFAULT_INTER_OP_THREADS,
                       'worker_binary inter-op threads for the project\'s '
                       'systems (0: the CPU count; -1: TensorFlow\'s '
                       'default).')
  flags.DEFINE_enum('reference_threads', 'tf_default',
                    ['tf_default', 'project'],
                    'Thread pools of tff_fedavg\'s worker: TensorFlow\'s '
                    'defaults (as TFF\'s own local context runs it) or the '
                    'project systems\' --intra/inter_op_threads.')
  flags.DEFINE_integer('memory_rounds', 0,
                       'If > 20: a fedembed_prototype run of this many rounds '
                       'that records RSS after round 20 and after the last.')
  flags.DEFINE_string('peer_python', None,
                      'Python of an environment with pfl-research installed '
                      '(bench/peers/setup_pfl_env.sh); runs pfl_fedavg.')
  flags.DEFINE_integer('seed', 0, 'Workload and sampling seed.')
  flags.DEFINE_list('families', [],
                    'Family rows: each algorithm on its own task, sharded '
                    'and one user per TFF client (binaries/'
                    'benchmark_families.py; e.g. ditto,feddva,fedperc,'
                    'groupfl,furl).')
  flags.DEFINE_list('population_scale', [],
                    'Populations (e.g. 10000,1000000) of the whole loop on '
                    'the generated task: binaries.train --task=synthetic, '
                    'global_plus with a 32-float personal embedding, the '
                    'SQLite store, cohort 200 (binaries/'
                    'benchmark_families.py).')
  flags.DEFINE_integer('family_rounds', 6,
                       'Rounds of each family run (round 1 is start-up).')
  flags.DEFINE_string('data_dir', None,
                      'The shared data directory the family rows read '
                      '(default: ../shared/data from the repository).')
  flags.DEFINE_integer('worker_pairs', 0,
                       'Multi-worker rows: this many pairs of --worker_system '
                       'runs at --worker_cohort on one binaries.worker pinned '
                       'to a core, then on two pinned to a core each, each '
                       'pair after a measure of the machine\'s own two-core '
                       'speed-up (binaries/benchmark_workers.py).')
  flags.DEFINE_enum('worker_system', 'global_plus', list(PROJECT_SYSTEMS),
                    'The system of the multi-worker rows.')
  flags.DEFINE_integer('worker_cohort', 200, 'Cohort of the multi-worker rows.')
  flags.DEFINE_integer('worker_local_epochs', 1,
                       'Local epochs of the multi-worker rows (the other '
                       'rows run one).')
  flags.DEFINE_float('timeout_s', 1800, 'Per-run time limit.')
  # Internal: one run in a child process.
  flags.DEFINE_string('child', None, 'Internal: system to run in this process.')
  flags.DEFINE_integer('cohort', 50, 'Internal: cohort of the child run.')
  flags.DEFINE_string('workload', None, 'Internal: workload .npz path.')
  flags.DEFINE_string('record', None, 'Internal: where the child writes JSON.')
  flags.DEFINE_float('t0', None, 'Internal: wall time the parent spawned us.')
  flags.DEFINE_list('workers', [],
                    'Internal: run the child on these binaries.worker '
                    'services (host:port) instead of a local worker.')
  flags.DEFINE_integer('local_epochs', 1, 'Internal: local epochs of the '
                       'child run (project systems).')
  flags.DEFINE_string('final_weights', None, 'Internal: where the child '
                      'saves the final server weights (.npz).')


# ---------------------------------------------------------------------------
# The workload.


def make_workload(path: str, seed: int) -> None:
  """Generates the clients' data once (images, binary labels, types)."""
  rng = np.random.default_rng(seed)
  shape = (POPULATION, EXAMPLES_PER_CLIENT)
  np.savez(path,
           x=rng.random(shape + (28, 28, 1), dtype=np.float32),
           y=rng.integers(0, 2, shape).astype(np.int32),
           type=rng.integers(0, 10, shape).astype(np.int32))


def cohort_of(round_num: int, cohort: int, seed: int):
  return training_loop.sample_clients(POPULATION, cohort, round_num, seed)


# ---------------------------------------------------------------------------
# Child runs: each returns per-round wall times; the first includes tracing.


def _datasets(data, ids, keys, epochs=1):
  return [tf.data.Dataset.from_tensor_slices(collections.OrderedDict(
      (k, data[k][i]) for k in keys)).batch(BATCH_SIZE).repeat(epochs)
          for i in ids]


def _client_batches(data, ids, keys, element_spec, epochs=1):
  """What a task's `train_batches` gives the sharded simulation."""
  order = [np.arange(EXAMPLES_PER_CLIENT)] * epochs
  return [client_data.ClientBatches.from_arrays(
      collections.OrderedDict((k, data[k][i]) for k in keys), BATCH_SIZE,
      order, element_spec) for i in ids]


def _run_tff_fedavg(data, cohort, rounds, seed, rss_at):
  spec = collections.OrderedDict(
      x=tf.TensorSpec([None, 28, 28, 1], tf.float32),
      y=tf.TensorSpec([None], tf.int32))

  def model_fn():
    keras_model = fedembed_mnist.build_preference_model(0, input_spec=spec).model
    return tff.learning.models.from_keras_model(
        keras_model, input_spec=spec,
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))

  tf.keras.utils.set_random_seed(seed)
  proc = tff.learning.algorithms.build_weighted_fed_avg(
      model_fn, client_optimizer_fn=fedavg.adam(LOCAL_LEARNING_RATE),
      server_optimizer_fn=tff.learning.optimizers.build_sgdm(1.0))
  state = proc.initialize()
  times = []
  for r in range(1, rounds + 1):
    t = time.perf_counter()
    ids = cohort_of(r, cohort, seed)
    state = proc.next(state, _datasets(data, ids, ('x', 'y'))).state
    times.append(time.perf_counter() - t)
    rss_at(r)
  return times, {}


def build_project_process(name: str, seed: int, client_optimizer=None):
  """The registered algorithm `name` on the benchmark's model and optimizers
  (local Adam unless `client_optimizer` is given, server SGD 1), as the
  project's runs build it."""

  class Workload:  # The PreferenceData interface the task's models need.
    num_subpopulations = 10
    num_users = POPULATION

  task = preference_task.PreferenceTask(
      name='benchmark', data=Workload(),
      model_builder=lambda dim, input_spec:
      fedembed_mnist.build_preference_model(dim, input_spec=input_spec),
      batch_size=BATCH_SIZE, seed=seed)
  return registry.build(
      name, registry.model_factory(name, task),
      client_optimizer=(client_optimizer or
                        fedavg.adam(LOCAL_LEARNING_RATE)),
      server_optimizer=tff.learning.optimizers.build_sgdm(1.0),
      metrics_fn=task.metrics_fn, seed=seed)


def _run_project(name, data, cohort, rounds, seed, shards, rss_at,
                 shards_in=sharded.IN_DRIVER, epochs=1, final_weights=None):
  """Runs a project system; returns (round times, record fields).

  With `final_weights` (a path), the last server model's trainable weights
  are saved there (`np.savez`, in order).
  """
  proc = build_project_process(name, seed)
  num_shards = sharded.resolve_num_shards(proc, shards)
  train = sharded.maybe_shard(proc, num_shards, shards_in=shards_in)
  element_spec = tff.types.type_to_tf_tensor_specs(
      proc.client_data_type.element)
  keys = tuple(element_spec.keys())
  template = tff.types.type_to_tf_tensor_specs(proc.client_state_type)
  store = client_state.make_store(
      'memory', client_state.seeded_initial_state_fn(template, seed, 'normal',
                                                      0.1),
      population=POPULATION, directory=None)
  state = train.initialize()
  times = []
  for r in range(1, rounds + 1):
    t = time.perf_counter()
    ids = [int(i) for i in cohort_of(r, cohort, seed)]
    items = (_client_batches(data, ids, keys, element_spec, epochs)
             if num_shards else _datasets(data, ids, keys, epochs))
    state, new_states, _ = train.next(state, store.load(ids), items)
    store.save(ids, [tf.nest.map_structure(np.asarray, s)
                     for s in new_states], r)
    times.append(time.perf_counter() - t)
    rss_at(r)
  store.close()
  if final_weights:
    np.savez(final_weights, *train.get_model_weights(state).trainable)
  return times, {'simulation_shards': num_shards,
                 'shards_in': shards_in if num_shards else None,
                 'local_epochs': epochs}


def _run_keras_central(data, cohort, rounds, seed, rss_at):
  """Keras `fit` once per round over the cohort's examples, same batches."""
  tf.keras.utils.set_random_seed(seed)
  model = fedembed_mnist.build_preference_model(0).model
  model.compile(optimizer=tf.keras.optimizers.Adam(LOCAL_LEARNING_RATE),
                loss=tf.keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True))
  times = []
  for r in range(1, rounds + 1):
    t = time.perf_counter()
    ids = cohort_of(r, cohort, seed)
    x = data['x'][ids].reshape((-1,) + data['x'].shape[2:])
    y = data['y'][ids].reshape((-1,))
    model.fit(x, y, batch_size=BATCH_SIZE, epochs=1, shuffle=False,
              verbose=0)
    times.append(time.perf_counter() - t)
    rss_at(r)
  return times, {}


def build_ceiling_round(keras_models: Sequence[tf.keras.Model],
                        client_optimizer: tff.learning.optimizers.Optimizer):
  """One FedAvg round's arithmetic as a single `tf.function`.

  Returns `round_fn(global_weights, x, y) -> new global weights`, where
  `x` is `[clients, steps, batch, ...]` and `y` `[clients, steps, batch]`:
  each client starts from `global_weights`, takes `steps` steps of
  `client_optimizer` (TFF's functional optimizer, the one the processes
  use, with a fresh state per client) on the sparse softmax cross-entropy
  of the model, and the new global weights are the old ones plus the
  clients' mean delta (server SGD with lr 1; every client has the same
  number of examples, so the weighted mean is the mean). The clients are
  split into one contiguous part per model in `keras_models` (copies of one
  architecture), each part a `tf.while_loop` on its own model's variables,
  so the parts run concurrently on TensorFlow's inter-op threads, as the
  sharded simulation runs its shards. Written by hand: neither TF nor TFF
  ships FedAvg without federation. Trainable weights only (the benchmark's
  model has no non-trainable ones).

  Example:
    models = [build_model() for _ in range(os.cpu_count())]
    round_fn = build_ceiling_round(models, fedavg.adam(1e-3))
    weights = round_fn(weights, x, y)
  """
  if not keras_models:
    raise ValueError('give at least one model')
  if any(m.non_trainable_variables for m in keras_models):
    raise ValueError('the ceiling handles trainable weights only')
  loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

  def part_total(model, global_weights, x, y):
    """The summed client deltas of one part, on `model`'s variables."""
    variables = model.trainable_variables
    specs = tuple(tf.TensorSpec(v.shape, v.dtype) for v in variables)
    clients, steps = tf.shape(x)[0], tf.shape(x)[1]

    def client(c, total):
      for v, g in zip(variables, global_weights):
        v.assign(g)

      def step(b, state):
        with tf.GradientTape() as tape:
          loss = loss_fn(y[c, b], model(x[c, b], training=True))
        grads = tape.gradient(loss, variables)
        state, new = client_optimizer.next(state, tuple(variables),
                                           tuple(grads))
        for v, n in zip(variables, new):
          v.assign(n)
        return b + 1, state

      tf.while_loop(lambda b, _: b < steps, step,
                    (tf.constant(0), client_optimizer.initialize(specs)),
                    parallel_iterations=1)
      return c + 1, tuple(t + (v - g) for t, v, g in
                          zip(total, variables, global_weights))

    zeros = tuple(tf.zeros_like(g) for g in global_weights)
    # One client at a time on the part's variables.
    return tf.while_loop(lambda c, _: c < clients, client,
                         (tf.constant(0), zeros), parallel_iterations=1)[1]

  @tf.function(autograph=False)
  def round_fn(global_weights, x, y):
    global_weights = tuple(global_weights)
    clients = x.shape[0]  # Static: one trace per cohort size.
    parts = min(len(keras_models), clients)
    bounds = [clients * k // parts for k in range(parts + 1)]
    totals = [part_total(m, global_weights, x[a:b], y[a:b])
              for m, a, b in zip(keras_models, bounds[:-1], bounds[1:])]
    return tuple(g + tf.add_n(list(t)) / clients
                 for g, *t in zip(global_weights, *totals))

  return round_fn


def _cohort_arrays(data, ids):
  """The cohort's examples as `[clients, steps, batch, ...]` (the visiting
  order and batches of the federated runs)."""
  steps = EXAMPLES_PER_CLIENT // BATCH_SIZE
  x = data['x'][ids]
  y = data['y'][ids]
  return (x.reshape((len(ids), steps, BATCH_SIZE) + x.shape[2:]),
          y.reshape((len(ids), steps, BATCH_SIZE)))


def _run_tf_ceiling(data, cohort, rounds, seed, rss_at, threads):
  """The ceiling in this process, with the thread pools the project's
  worker gets and one part of the cohort per inter-op thread."""
  intra = worker_threads.resolve(threads[0], 'intra')
  inter = worker_threads.resolve(threads[1], 'inter')
  tf.config.threading.set_intra_op_parallelism_threads(intra or 0)
  tf.config.threading.set_inter_op_parallelism_threads(inter or 0)
  tf.keras.utils.set_random_seed(seed)
  models = [fedembed_mnist.build_preference_model(0).model
            for _ in range(inter or os.cpu_count())]
  round_fn = build_ceiling_round(models, fedavg.adam(LOCAL_LEARNING_RATE))
  weights = tuple(tf.constant(v.numpy())
                  for v in models[0].trainable_variables)
  times = []
  for r in range(1, rounds + 1):
    t = time.perf_counter()
    ids = cohort_of(r, cohort, seed)
    x, y = _cohort_arrays(data, ids)
    weights = round_fn(weights, x, y)
    weights[0].numpy()  # Waits for the round.
    times.append(time.perf_counter() - t)
    rss_at(r)
  return times, {'parts': len(models)}


def tree_rss_mib(pid: int) -> float:
  """Summed RSS of a process and all its descendants, in MiB."""
  try:
    proc = psutil.Process(pid)
    procs = [proc] + proc.children(recursive=True)
  except psutil.NoSuchProcess:
    return 0.0
  total = 0
  for p in procs:
    try:
      total += p.memory_info().rss
    except psutil.NoSuchProcess:
      pass
  return total / 2**20


def child_main(f) -> None:
  """Runs one (system, cohort) and writes its record."""
  rss = {}
  marks = {20, f.rounds}
  first_round_end = []

  def rss_at(r):  # Called at the end of each round.
    if r == 1:
      first_round_end.append(time.time())
    if r in marks:
      rss[f'rss_mib_after_round_{r}'] = tree_rss_mib(os.getpid())

  data = dict(np.load(f.workload))
  threads = (f.intra_op_threads, f.inter_op_threads)
  if f.child == 'tff_fedavg' and f.reference_threads == 'tf_default':
    threads = (-1, -1)
  if (f.workers or f.local_epochs != 1) and f.child not in PROJECT_SYSTEMS:
    raise app.UsageError('--workers and --local_epochs apply to the '
                         f'project\'s systems, not {f.child}')
  # With --workers the services' thread pools are their own flags'.
  with runtime.local_runtime(workers=f.workers or None,
                             intra_op_threads=threads[0],
                             inter_op_threads=threads[1]):
    if f.child == 'tff_fedavg':
      times, extra = _run_tff_fedavg(data, f.cohort, f.rounds, f.seed, rss_at)
    elif f.child == CEILING:
      times, extra = _run_tf_ceiling(data, f.cohort, f.rounds, f.seed, rss_at,
                                     threads)
    elif f.child == 'keras_central':
      times, extra = _run_keras_central(data, f.cohort, f.rounds, f.seed,
                                        rss_at)
    else:
      times, extra = _run_project(f.child, data, f.cohort, f.rounds, f.seed,
                                  f.simulation_shards, rss_at, f.shards_in,
                                  f.local_epochs, f.final_weights)
  steady = times[1:] or times
  per_round = float(np.mean(steady))
  # From the parent's spawn to the end of round 1 (not the shut-down).
  startup = (first_round_end[0] - f.t0) if f.t0 else times[0]
  record = dict(
      name=f.child, cohort=f.cohort, rounds=f.rounds,
      seconds_per_round=per_round,
      client_updates_per_s=f.cohort / per_round,
      examples_per_s=f.cohort * EXAMPLES_PER_CLIENT * f.local_epochs
      / per_round,
      first_round_s=times[0], startup_s=startup,
      worker_threads={'intra_op': worker_threads.resolve(threads[0], 'intra'),
                      'inter_op': worker_threads.resolve(threads[1], 'inter')},
      **extra, **rss)
  with open(f.record, 'w') as out:
    json.dump(record, out)


# ---------------------------------------------------------------------------
# The parent: one subprocess per run, RSS sampling, table.


def run_sampled(cmd, timeout_s):
  """Runs `cmd`; returns (exit code, peak tree RSS MiB, stderr tail).

  The RSS of the process and all its children (TFF's worker_binary
  included) is summed every 200 ms.
  """
  proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
  peak = [0.0]
  done = threading.Event()

  def sample():
    while not done.is_set():
      peak[0] = max(peak[0], tree_rss_mib(proc.pid))
      done.wait(0.2)

  sampler = threading.Thread(target=sample, daemon=True)
  sampler.start()
  try:
    _, err = proc.communicate(timeout=timeout_s)
  except subprocess.TimeoutExpired:
    proc.kill()
    _, err = proc.communicate()
    err = f'timed out after {timeout_s} s\n' + (err or '')
  finally:
    done.set()
    sampler.join()
  return proc.returncode, peak[0], (err or '')[-2000:]


def _run_child(cmd, record_path, timeout_s):
  """Runs `cmd`; returns (record or None, peak tree RSS MiB, error)."""
  code, peak, err = run_sampled(cmd + [f'--t0={time.time()}'], timeout_s)
  if code != 0 or not os.path.exists(record_path):
    return None, peak, err
  with open(record_path) as f:
    record = json.load(f)
  os.remove(record_path)
  return record, peak, None


def parent_main(f) -> int:
  if not f.output_dir:
    raise app.UsageError('--output_dir is required')
  unknown = set(f.systems) - set(SYSTEMS)
  if unknown:
    raise app.UsageError(f'unknown --systems {sorted(unknown)}; known: '
                         f'{list(SYSTEMS)}')
  cohorts = [int(c) for c in f.cohorts]
  if any(not 1 <= c <= POPULATION for c in cohorts):
    raise app.UsageError(f'cohorts must be in [1, {POPULATION}]: {cohorts}')
  if f.rounds < 2:
    raise app.UsageError('--rounds must be >= 2 (round 1 is start-up)')
  if f.peer_python and not os.access(f.peer_python, os.X_OK):
    raise app.UsageError(f'--peer_python={f.peer_python} is not executable')
  if f.worker_pairs < 0 or f.worker_local_epochs < 1:
    raise app.UsageError('--worker_pairs must be >= 0 and '
                         '--worker_local_epochs >= 1')
  if f.worker_pairs:
    if not 2 <= f.worker_cohort <= POPULATION:
      raise app.UsageError(f'--worker_cohort must be in [2, {POPULATION}]')
    try:
      benchmark_workers.two_cores()
    except ValueError as e:
      raise app.UsageError(str(e)) from e
  os.makedirs(f.output_dir, exist_ok=True)
  workload = os.path.join(f.output_dir, 'workload.npz')
  make_workload(workload, f.seed)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  records = []
  runs = [(s, c, f.rounds) for c in cohorts for s in f.systems]
  if f.memory_rounds > 20:
    runs.append(('fedembed_prototype', cohorts[0], f.memory_rounds))
  peer_script = os.path.join(root, 'bench', 'peers', 'pfl_fedavg.py')
  if f.peer_python:
    runs += [('pfl_fedavg', c, f.rounds) for c in cohorts]
  unknown = set(f.families) - set(benchmark_families.FAMILIES)
  if unknown:
    raise app.UsageError(f'unknown --families {sorted(unknown)}; known: '
                         f'{list(benchmark_families.FAMILIES)}')

  def child_cmd(system, cohort, rounds, record_path, extra=()):
    """A child run's command; `extra` flags (a `--simulation_shards`
    among them replaces the run's)."""
    shards = [a for a in extra if a.startswith('--simulation_shards=')] or [
        f'--simulation_shards={f.simulation_shards}']
    return [sys.executable, '-m', 'binaries.benchmark', f'--child={system}',
            f'--cohort={cohort}', f'--rounds={rounds}',
            f'--workload={workload}', f'--record={record_path}',
            f'--seed={f.seed}', *shards, f'--shards_in={f.shards_in}',
            f'--intra_op_threads={f.intra_op_threads}',
            f'--inter_op_threads={f.inter_op_threads}',
            f'--reference_threads={f.reference_threads}',
            *[a for a in extra if a not in shards]]

  for i, (system, cohort, rounds) in enumerate(runs):
    record_path = os.path.join(f.output_dir, f'.record_{i}.json')
    if system == 'pfl_fedavg':
      # The peer runs --warmup_rounds (1) untimed on top of --rounds.
      cmd = [f.peer_python, peer_script, f'--data={workload}',
             f'--cohort={cohort}', f'--rounds={rounds - 1}',
             f'--output={record_path}', f'--seed={f.seed}']
    else:
      cmd = child_cmd(system, cohort, rounds, record_path)
    print(f'[{i + 1}/{len(runs)}] {system} cohort {cohort} ({rounds} rounds)',
          flush=True)
    record, peak, err = _run_child(cmd, record_path, f.timeout_s)
    if record is None:
      print(f'  failed: {err}', flush=True)
      continue
    record['peak_rss_mib'] = peak
    record['memory_run'] = rounds != f.rounds
    print(f"  {record['client_updates_per_s']:.1f} client updates/s, "
          f"{record['seconds_per_round']:.3f} s/round, start-up "
          f"{record.get('startup_s', float('nan')):.1f} s, peak RSS "
          f'{peak:.0f} MiB', flush=True)
    records.append(record)
  if f.families:
    records += benchmark_families.run(
        f.families, f.family_rounds,
        f.data_dir or os.path.join(root, '..', 'shared', 'data'),
        os.path.join(f.output_dir, 'families'), f.timeout_s,
        log=lambda s: print(s, flush=True))
  if f.population_scale:
    records += benchmark_families.run_population_scale(
        [int(n) for n in f.population_scale], f.family_rounds,
        os.path.join(f.output_dir, 'scale'), f.timeout_s, run_sampled,
        log=lambda s: print(s, flush=True))
  if f.worker_pairs:
    records += benchmark_workers.run(
        f.worker_pairs, f.worker_system, f.worker_cohort,
        f.worker_local_epochs, f.rounds, child_cmd, _run_child,
        os.path.join(f.output_dir, 'workers'), root, f.timeout_s,
        log=lambda s: print(s, flush=True))
  del root
  machine = (f'{platform.node()} {platform.machine()}, {os.cpu_count()} '
             f'CPUs, Python {platform.python_version()}, load average '
             f'{os.getloadavg()[0]:.2f} at the end')
  command = 'python -m binaries.benchmark ' + ' '.join(sys.argv[1:])
  with open(os.path.join(f.output_dir, 'benchmark.json'), 'w') as out:
    json.dump(records, out, indent=2)
  with open(os.path.join(f.output_dir, 'benchmark_run.json'), 'w') as out:
    json.dump(dict(machine=machine, command=command, records=records), out,
              indent=2)
  markdown = render_markdown(records, machine, command)
  with open(os.path.join(f.output_dir, 'benchmark.md'), 'w') as out:
    out.write(markdown)
  print(markdown, flush=True)
  expected = (len(runs) + len(f.families) * len(benchmark_families.FORMS) +
              len(f.population_scale) + 3 * f.worker_pairs)
  return 0 if len(records) == expected else 1


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if FLAGS.child:
    child_main(FLAGS)
    return 0
  return parent_main(FLAGS)


if __name__ == '__main__':
  define_flags()
  app.run(main)
