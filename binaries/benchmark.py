r"""Simulation benchmark: TFF's FedAvg, the project's processes, plain Keras.

  python -m binaries.benchmark --output_dir=/tmp/bench \
    [--cohorts=50,200] [--rounds=12] [--repeats=3] [--systems=...] \
    [--peer_python=PATH] [--memory_rounds=200] [--families=...] \
    [--worker_pairs=4]

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
* `tf_ceiling`, `tf_ceiling_global_plus`, `tf_ceiling_fedembed_prototype`:
  the arithmetic ceilings, one per model. A system's local training (the
  global weights and its private values in, the model's `prepare_fn`, local
  Adam over its batches, its delta and new private values out) and
  FedAvg's server step (the mean delta applied with SGD 1), on each cohort,
  as one `tf.function` of `tf.while_loop`s in one process: no federation,
  no TFF runtime, no `tf.data` (`build_ceiling_round`; tests hold each
  equal to its process's round). `tf_ceiling` is `global`'s model, the one
  FedAvg trains in every other system. Every system is reported as a
  fraction of `tf_ceiling` and of its own model's ceiling.
* `global_batched`, `fedembed_prototype_batched`: the system with each
  shard's users trained together (`--simulation_batched`,
  `core/batched.py`; FedEmbed's form is `models/fedembed_batched.py`).
* `<system>_inprocess` (of `global`, `fedembed_prototype` and their
  `_batched` forms): the same shards, with the round's aggregation, DP
  noise and server step run from its compiled production pieces in the
  driver (`--simulation_round=inprocess`, `core/inprocess.py`), no TFF
  runtime started; `--simulation_shards=0` runs each user's device
  program there too. The other project rows run the round on TFF's
  runtime (`--simulation_round=tff`), the reference form.
* `tf_ceiling_batched`: FedAvg's model trained as if the cohort were one
  client, each step one batch of the cohort's batches together: the same
  examples and steps, the arithmetic limit of training clients together.
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
import contextlib
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
from tff_personal.core import inprocess
from tff_personal.core import process as process_lib
from tff_personal.core import runtime
from tff_personal.core import sharded
from tff_personal.core import split_model as split_model_lib
from tff_personal.core import training_loop
from tff_personal.core import worker_threads
from tff_personal.models import fedembed_mnist

FLAGS = flags.FLAGS

PROJECT_SYSTEMS = ('global', 'global_plus', 'fedembed_prototype')
CEILING = benchmark_report.CEILING
ceiling_name = benchmark_report.ceiling_name
# The project's systems whose shards train their users together
# (`core/batched.py`): `<system>_batched`.
BATCHED_SYSTEMS = tuple(s + benchmark_report.BATCHED_SUFFIX
                        for s in ('global', 'fedembed_prototype'))
# The project's systems whose rounds run in process (`core/inprocess.py`):
# `<system>_inprocess`.
INPROCESS_SYSTEMS = tuple(s + benchmark_report.INPROCESS_SUFFIX
                          for s in ('global', 'fedembed_prototype',
                                    *BATCHED_SYSTEMS))
# FedAvg's model trained on the cohort's examples as one batch per step.
BATCHED_CEILING = CEILING + benchmark_report.BATCHED_SUFFIX
SYSTEMS = ('tff_fedavg', *PROJECT_SYSTEMS, *BATCHED_SYSTEMS,
           *INPROCESS_SYSTEMS,
           *(ceiling_name(s) for s in PROJECT_SYSTEMS), BATCHED_CEILING,
           'keras_central')
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
  flags.DEFINE_integer('repeats', 1,
                       'Runs of each (system, cohort), interleaved (every '
                       'system at every cohort once, then again); each '
                       'record is the run of median rate, with every run\'s '
                       'rate beside it. On a machine whose speed drifts, '
                       'the medians keep the ratios within a run honest.')
  flags.DEFINE_integer('simulation_shards', -1,
                       'For the project\'s systems: -1 auto (sharded), 0 one '
                       'user per TFF client, n shards.')
  flags.DEFINE_integer('simulation_batch_users', 25,
                       'For the `_batched` systems: the most users trained '
                       'together (`--simulation_batch_users` of the '
                       'binaries); 0: all of a shard\'s users at once.')
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
                 shards_in=sharded.IN_DRIVER, epochs=1, final_weights=None,
                 batch_users=0):
  """Runs a project system; returns (round times, record fields).

  With `final_weights` (a path), the last server model's trainable weights
  are saved there (`np.savez`, in order).
  """
  in_process = name in INPROCESS_SYSTEMS
  if in_process:
    name = name[:-len(benchmark_report.INPROCESS_SUFFIX)]
  batched = name in BATCHED_SYSTEMS
  if batched:
    name = name[:-len(benchmark_report.BATCHED_SUFFIX)]
  proc = build_project_process(name, seed)
  num_shards = sharded.resolve_num_shards(proc, shards)
  if batched and not num_shards:
    raise app.UsageError(f'{name}{benchmark_report.BATCHED_SUFFIX} needs '
                         'shards (--simulation_shards != 0)')
  if in_process and not num_shards:  # Each user's device program here.
    train = inprocess.build(proc)
  else:  # In process: no TFF runtime is started (`child_main`).
    train = sharded.maybe_shard(
        proc, num_shards, shards_in=shards_in, batched=batched,
        batch_users=(batch_users or None) if batched else None,
        aggregate_in=(sharded.AGGREGATE_IN_PROCESS if in_process
                      else sharded.AGGREGATE_IN_TFF))
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
                 'simulation_batch_users': batch_users if batched else None,
                 'shards_in': shards_in if num_shards else None,
                 'simulation_round': 'inprocess' if in_process else 'tff',
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


class _OneClientBatches:
  """Client `c`'s batches of a `[clients, steps, batch, ...]` structure, with
  the `element_spec` and `reduce` of a `tf.data.Dataset` (what a model's
  `prepare_fn` reads)."""

  def __init__(self, batches, c):
    self._batches, self._c = batches, c
    self.element_spec = tf.nest.map_structure(
        lambda t: tf.TensorSpec([None] + t.shape[3:], t.dtype), batches)

  def batch(self, b):
    return tf.nest.map_structure(lambda t: t[self._c, b], self._batches)

  def reduce(self, initial_state, reduce_fn):
    steps = tf.shape(tf.nest.flatten(self._batches)[0])[1]
    return tf.while_loop(
        lambda b, _: b < steps,
        lambda b, state: (b + 1, reduce_fn(state, self.batch(b))),
        (tf.constant(0), initial_state))[1]


def build_ceiling_round(models: Sequence[split_model_lib.SplitModel],
                        client_optimizer: tff.learning.optimizers.Optimizer):
  """One round of a split model's local training and FedAvg's server step,
  as a single `tf.function`: the arithmetic ceiling of a system.

  Returns `round_fn(global_weights, private, batches) -> (new global
  weights, new private)`. `batches` is the cohort's examples as a structure
  of `[clients, steps, batch, ...]` tensors (the model's batch structure),
  `private` a tuple of `[clients, ...]` tensors, one per private variable
  of the model (in `private_variables` order; empty for a model without).
  Each client starts from `global_weights` (the shared trainable
  variables) and its private values, runs the model's `prepare_fn` (if any)
  on its batches, takes one step of `client_optimizer` (TFF's functional
  optimizer, the one the processes use, fresh per client, over the shared
  and private trainable variables together) per batch on the model's loss,
  and keeps its new private values; the new global weights are the old
  ones plus the clients' mean delta (server SGD with lr 1; every client has
  the same number of examples, so the weighted mean is the mean). The
  clients are split into one contiguous part per model in `models` (builds
  of one model function), each part a `tf.while_loop` on its own model's
  variables, so the parts run concurrently on TensorFlow's inter-op
  threads, as the sharded simulation runs its shards. No federation, no
  TFF runtime, no `tf.data`, no metrics and no checks for non-finite
  values. Written by hand: neither TF nor TFF ships FedAvg without
  federation. Models with shared non-trainable variables or private noise
  are refused (the benchmark's models have neither).

  Example:
    models = [model_fn() for _ in range(os.cpu_count())]
    round_fn = build_ceiling_round(models, fedavg.adam(1e-3))
    weights, private = round_fn(weights, private, batches)
  """
  if not models:
    raise ValueError('give at least one model')
  for m in models:
    if m.shared_non_trainable_variables or m.private_noise is not None:
      raise ValueError('the ceiling handles models without shared '
                       'non-trainable variables or private noise')

  def part_total(model, global_weights, private, batches):
    """One part's summed client deltas and new private values, on
    `model`'s variables."""
    shared = model.shared_trainable_variables
    private_vars = list(model.private_variables)
    trainable = shared + model.private_trainable_variables
    specs = tuple(tf.TensorSpec(v.shape, v.dtype) for v in trainable)
    clients = tf.shape(tf.nest.flatten(batches)[0])[0]

    def client(c, total, arrays):
      for v, g in zip(shared, global_weights):
        v.assign(g)
      for v, p in zip(private_vars, private):
        v.assign(p[c])
      data = _OneClientBatches(batches, c)
      if model.prepare_fn is not None:
        model.prepare_fn(data)

      def step(state, batch):
        with tf.GradientTape() as tape:
          loss = model.loss(batch, model.forward(batch, training=True))
        grads = tape.gradient(loss, trainable)
        grads = [tf.zeros_like(v) if g is None else g
                 for g, v in zip(grads, trainable)]
        state, new = client_optimizer.next(state, tuple(trainable),
                                           tuple(grads))
        for v, n in zip(trainable, new):
          v.assign(n)
        return state

      data.reduce(client_optimizer.initialize(specs), step)
      arrays = tuple(a.write(c, v.read_value())
                     for a, v in zip(arrays, private_vars))
      return c + 1, tuple(t + (v - g) for t, v, g in
                          zip(total, shared, global_weights)), arrays

    zeros = tuple(tf.zeros_like(g) for g in global_weights)
    arrays = tuple(tf.TensorArray(v.dtype, size=clients,
                                  element_shape=v.shape)
                   for v in private_vars)
    # One client at a time on the part's variables.
    _, total, arrays = tf.while_loop(
        lambda c, *_: c < clients, client, (tf.constant(0), zeros, arrays),
        parallel_iterations=1)
    return total, tuple(a.stack() for a in arrays)

  @tf.function(autograph=False)
  def round_fn(global_weights, private, batches):
    global_weights, private = tuple(global_weights), tuple(private)
    # Static: one trace per cohort size.
    clients = tf.nest.flatten(batches)[0].shape[0]
    parts = min(len(models), clients)
    bounds = [clients * k // parts for k in range(parts + 1)]
    cut = lambda s, a, b: tf.nest.map_structure(lambda t: t[a:b], s)
    results = [part_total(m, global_weights, cut(private, a, b),
                          cut(batches, a, b))
               for m, a, b in zip(models, bounds[:-1], bounds[1:])]
    new_weights = tuple(g + tf.add_n(list(t)) / clients for g, *t in
                        zip(global_weights, *[t for t, _ in results]))
    new_private = tuple(tf.concat(list(p), 0) for p in
                        zip(*[p for _, p in results]))
    return new_weights, new_private

  return round_fn


def _cohort_batches(data, ids, keys=('x', 'y', 'type')):
  """The cohort's examples as `[clients, steps, batch, ...]` arrays (the
  visiting order and batches of the federated runs)."""
  steps = EXAMPLES_PER_CLIENT // BATCH_SIZE
  return collections.OrderedDict(
      (k, data[k][ids].reshape((len(ids), steps, BATCH_SIZE)
                               + data[k].shape[2:])) for k in keys)


# Ceiling record name -> the system whose arithmetic it is.
_CEILINGS = {ceiling_name(s): s for s in PROJECT_SYSTEMS}


def _ceiling_threads_and_seed(threads, seed):
  """A ceiling's thread pools (those the project's worker gets) and seed;
  returns the inter-op thread count (None: TensorFlow's default)."""
  intra = worker_threads.resolve(threads[0], 'intra')
  inter = worker_threads.resolve(threads[1], 'inter')
  tf.config.threading.set_intra_op_parallelism_threads(intra or 0)
  tf.config.threading.set_inter_op_parallelism_threads(inter or 0)
  tf.keras.utils.set_random_seed(seed)
  return inter


def _run_tf_ceiling(system, data, cohort, rounds, seed, rss_at, threads):
  """`system`'s ceiling in this process, with the thread pools the
  project's worker gets and one part of the cohort per inter-op thread.
  Every user's private values start as the project's runs start them and
  are kept between rounds."""
  inter = _ceiling_threads_and_seed(threads, seed)
  proc = build_project_process(system, seed)
  models = [proc.model_fn() for _ in range(inter or os.cpu_count())]
  round_fn = build_ceiling_round(models, fedavg.adam(LOCAL_LEARNING_RATE))
  weights = tuple(tf.constant(v.numpy())
                  for v in models[0].shared_trainable_variables)
  template = tff.types.type_to_tf_tensor_specs(proc.client_state_type)
  initial = client_state.seeded_initial_state_fn(template, seed, 'normal',
                                                 0.1)
  private = [np.stack(column) for column in zip(
      *[initial(i)[process_lib.CLIENT_STATE_PRIVATE]
        for i in range(POPULATION)])]
  times = []
  for r in range(1, rounds + 1):
    t = time.perf_counter()
    ids = cohort_of(r, cohort, seed)
    weights, new_private = round_fn(
        weights, tuple(p[ids] for p in private), _cohort_batches(data, ids))
    for p, n in zip(private, new_private):
      p[ids] = n.numpy()
    weights[0].numpy()  # Waits for the round.
    times.append(time.perf_counter() - t)
    rss_at(r)
  return times, {'parts': len(models), 'model_of': system}


def _run_tf_ceiling_batched(data, cohort, rounds, seed, rss_at, threads):
  """`global`'s model trained as if the cohort were one client: each step
  one batch of the cohort's step-s batches together (cohort x batch
  examples), Adam, as many steps as a client takes; one `tf.function` of a
  `tf.while_loop`. The same examples and steps per round as the federated
  systems, with none of their per-client cost: the arithmetic limit of
  training the cohort's clients together (`--simulation_batched`)."""
  _ceiling_threads_and_seed(threads, seed)
  model = build_project_process('global', seed).model_fn()
  trainable = model.shared_trainable_variables
  optimizer = fedavg.adam(LOCAL_LEARNING_RATE)
  specs = tuple(tf.TensorSpec(v.shape, v.dtype) for v in trainable)

  @tf.function(autograph=False)
  def round_fn(batches):
    # [clients, steps, batch, ...] -> [steps, clients * batch, ...].
    steps = tf.nest.map_structure(
        lambda t: tf.reshape(tf.transpose(
            t, [1, 0] + list(range(2, t.shape.rank))),
                             [t.shape[1], -1] + t.shape[3:].as_list()),
        batches)

    def step(s, state):
      batch = tf.nest.map_structure(lambda t: t[s], steps)
      with tf.GradientTape() as tape:
        loss = model.loss(batch, model.forward(batch, training=True))
      grads = tape.gradient(loss, trainable)
      state, new = optimizer.next(state, tuple(trainable), tuple(grads))
      for v, n in zip(trainable, new):
        v.assign(n)
      return s + 1, state

    num_steps = tf.nest.flatten(steps)[0].shape[0]
    tf.while_loop(lambda s, _: s < num_steps, step,
                  (tf.constant(0), optimizer.initialize(specs)),
                  parallel_iterations=1)
    return trainable[0].read_value()

  times = []
  for r in range(1, rounds + 1):
    t = time.perf_counter()
    round_fn(_cohort_batches(data, cohort_of(r, cohort, seed))).numpy()
    times.append(time.perf_counter() - t)
    rss_at(r)
  return times, {'model_of': 'global'}


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
  if f.workers and f.child in INPROCESS_SYSTEMS:
    raise app.UsageError(f'{f.child} runs in this process: no --workers')
  # With --workers the services' thread pools are their own flags'. An
  # in-process system starts no TFF runtime (nor its worker_binary, whose
  # memory would count in its peak RSS): its process's TensorFlow takes
  # the thread flags.
  if f.child in INPROCESS_SYSTEMS:
    runtime.configure_driver_threads(threads[0], threads[1])
    context = contextlib.nullcontext()
  else:
    context = runtime.local_runtime(workers=f.workers or None,
                                    intra_op_threads=threads[0],
                                    inter_op_threads=threads[1])
  with context:
    if f.child == 'tff_fedavg':
      times, extra = _run_tff_fedavg(data, f.cohort, f.rounds, f.seed, rss_at)
    elif f.child == BATCHED_CEILING:
      times, extra = _run_tf_ceiling_batched(data, f.cohort, f.rounds,
                                             f.seed, rss_at, threads)
    elif f.child in _CEILINGS:
      times, extra = _run_tf_ceiling(_CEILINGS[f.child], data, f.cohort,
                                     f.rounds, f.seed, rss_at, threads)
    elif f.child == 'keras_central':
      times, extra = _run_keras_central(data, f.cohort, f.rounds, f.seed,
                                        rss_at)
    else:
      times, extra = _run_project(f.child, data, f.cohort, f.rounds, f.seed,
                                  f.simulation_shards, rss_at, f.shards_in,
                                  f.local_epochs, f.final_weights,
                                  f.simulation_batch_users)
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


def _numbers(f, name: str) -> list[int]:
  """The list flag `name` as ints; ValueError naming it."""
  try:
    return [int(c) for c in f[name].value]
  except ValueError as e:
    raise ValueError(f'--{name} must be whole numbers, got '
                     f'{",".join(f[name].value)!r}') from e


def check_flags(f) -> list[int]:
  """The parent's flags checked before any work; returns the cohorts.

  Raises:
    ValueError: naming the flag (the binary prints it as one line and
      exits 2).
  """
  if not f.output_dir:
    raise ValueError('--output_dir is required')
  unknown = set(f.systems) - set(SYSTEMS)
  if unknown:
    raise ValueError(f'unknown --systems {sorted(unknown)}; known: '
                     f'{list(SYSTEMS)}')
  cohorts = _numbers(f, 'cohorts')
  if any(not 1 <= c <= POPULATION for c in cohorts):
    raise ValueError(f'cohorts must be in [1, {POPULATION}]: {cohorts}')
  if f.rounds < 2:
    raise ValueError('--rounds must be >= 2 (round 1 is start-up)')
  if f.repeats < 1:
    raise ValueError('--repeats must be >= 1')
  if f.peer_python and not os.access(f.peer_python, os.X_OK):
    raise ValueError(f'--peer_python={f.peer_python} is not executable')
  if f.worker_pairs < 0 or f.worker_local_epochs < 1:
    raise ValueError('--worker_pairs must be >= 0 and '
                     '--worker_local_epochs >= 1')
  if f.worker_pairs:
    if not 2 <= f.worker_cohort <= POPULATION:
      raise ValueError(f'--worker_cohort must be in [2, {POPULATION}]')
    benchmark_workers.two_cores()
  unknown = set(f.families) - set(benchmark_families.FAMILIES)
  if unknown:
    raise ValueError(f'unknown --families {sorted(unknown)}; known: '
                     f'{list(benchmark_families.FAMILIES)}')
  _numbers(f, 'population_scale')
  return cohorts


def parent_main(f) -> int:
  cohorts = check_flags(f)
  os.makedirs(f.output_dir, exist_ok=True)
  workload = os.path.join(f.output_dir, 'workload.npz')
  make_workload(workload, f.seed)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  records = []
  systems = list(f.systems) + (['pfl_fedavg'] if f.peer_python else [])
  runs = [(s, c, f.rounds) for _ in range(f.repeats) for c in cohorts
          for s in systems]
  if f.memory_rounds > 20:
    runs.append(('fedembed_prototype', cohorts[0], f.memory_rounds))
  peer_script = os.path.join(root, 'bench', 'peers', 'pfl_fedavg.py')

  def child_cmd(system, cohort, rounds, record_path, extra=()):
    """A child run's command; `extra` flags (a `--simulation_shards`
    among them replaces the run's)."""
    shards = [a for a in extra if a.startswith('--simulation_shards=')] or [
        f'--simulation_shards={f.simulation_shards}']
    return [sys.executable, '-m', 'binaries.benchmark', f'--child={system}',
            f'--cohort={cohort}', f'--rounds={rounds}',
            f'--workload={workload}', f'--record={record_path}',
            f'--seed={f.seed}', *shards, f'--shards_in={f.shards_in}',
            f'--simulation_batch_users={f.simulation_batch_users}',
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
  completed = len(records)
  records = benchmark_report.median_of_repeats(records)
  num_systems = len(records)
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
  expected = sum(len(benchmark_families.FAMILIES[name].forms())
                 for name in f.families) + len(
      f.population_scale) + 3 * f.worker_pairs
  return 0 if completed == len(runs) and len(records) == (
      num_systems + expected) else 1


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if FLAGS.child:
    child_main(FLAGS)
    return 0
  try:
    check_flags(FLAGS)
  except ValueError as e:  # Nothing ran.
    print(f'error: {e}', file=sys.stderr)
    return 2
  return parent_main(FLAGS)


if __name__ == '__main__':
  define_flags()
  app.run(main)
