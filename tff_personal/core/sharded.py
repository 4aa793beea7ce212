"""Sharded simulation: many users inside one TFF client computation.

A TFF simulation in the one-user-per-client form (`StatefulClientProcess`)
pays a fixed cost per user per round: every user's `tf.data` dataset is
serialised into TFF's executor and runs as its own computation call. On small
clients (tens of examples) that overhead, not arithmetic, is most of the
round. The sharded form keeps each algorithm's per-user client work unchanged
(the same TF function, `Composition.client_step`) and runs a *shard* of users
inside one TFF client: the shard's data arrive as dense tensors and a
`tf.while_loop` calls the per-user step for each user in turn, so a round is
`num_shards` computation calls instead of one per user.

What each shard returns is what the server's aggregator would have computed
from its users: for a weighted mean, the shard sends the weighted mean of its
users' updates with the sum of their weights, and the weighted mean of the
shards is exactly the weighted mean of all users. Client states go in and
come out stacked along a leading user axis and are split back per user, so the
driver (`core/training_loop.py`) and the client-state store see the same
per-user states as in the one-user-per-client form. A test checks both forms
give the same server and client states on the same seed.

The one-user-per-client `StatefulClientProcess` stays the production-faithful
form (one TFF client is one device); `ShardedProcess` is for simulation.

Where the shards run (`ShardedProcess(..., shards_in=)`). By default
(`IN_DRIVER`) a local round computes each shard's work in this process,
one thread per shard (`DriverShardWork`: the TFF shard computation's own TF
code, traced once per concurrent shard), and then runs the process's TFF
round with a client work that returns those results: the aggregation, DP
noise and server update stay in TFF. That round takes only what the
aggregation reads (no client states) and takes the server state and the
results packed, one vector per dtype (`flat_transport.FlatTransport`; bit
for bit the same round). Through the executor (`IN_EXECUTOR`,
TFF running the shards as its clients), every round serialised every
shard's examples into the `worker_binary` and the results back. With
several workers the shards run on them (`runtime.worker_map`). The two
places give the same round up to float rounding (two TensorFlow runtimes;
`tests/sharded_test.py`).

Where the round's server side runs (`ShardedProcess(..., aggregate_in=)`):
on TFF's runtime (`AGGREGATE_IN_TFF`, the reference), or in this process
(`AGGREGATE_IN_PROCESS`, what `--simulation_round=auto` picks), where the
process that takes the shards' results is compiled to its production
form and its pieces run as one TensorFlow graph (`core/inprocess.py`), so
no `worker_binary` is needed; `tests/inprocess_test.py` holds the two
equal.

Differential privacy: user-level DP clips each *user's* update before
anything is summed; TFF's DP aggregator applied to shards would clip each
shard's sum instead. So when the process aggregates with a DP factory of
`privacy.build_aggregator` (its `DPConfig` is read from the factory,
`privacy.config_of`; nothing is passed beside it), each shard clips every
user's update (`sharded_privacy.clip_user_update`, the clipping of
`tfp.GaussianSumQuery`) and sends their sum, and the server aggregates with
`sharded_privacy.build_sharded_aggregator`: the same sum, the same Gaussian
noise (std `noise_multiplier * clip_norm`, added once) and the same
denominator as
`privacy.build_aggregator` over the users, hence the same (epsilon, delta).
Only fixed clipping is supported sharded. Written by hand: TFF has no form of
its learning processes that runs several clients per computation call.

Processes with a server step (`core/statistics_process.py`: PFedKM,
FedEmbed-SOM) are re-composed with that step around the shard work:

* their `update` is `<model, statistics>`, one joint update, so the shard's
  weighted mean (or its sum of per-user clipped updates, DP) covers the
  statistics exactly as the aggregator over users does (TFF's DP query also
  clips the whole record with one global norm);
* `selected` (the best-scoring selection, `core/best_scoring.py`) is
  reduced in the shard with that aggregator's own rule `best_scoring.better`
  over the users in order, and the server's aggregator then selects among
  the shards in order: the first best user of the cohort, as over users
  (ties included: the rule keeps the earlier candidate). Values are copied,
  not combined, so this is exact. Another selection aggregator is refused
  (its shard-level reduction is unknown);
* the server step's cohort size is the sum of the shards' user counts
  (`SHARD_USERS`), not the number of shards.

What "the same" means: integer and selected values are equal exactly;
means (weighted: a mean of shard means; DP: a sum of shard sums) equal the
means over users up to float32 rounding of the summation order, as for every
sharded process. PFedKM's server step is continuous in them (a zero count
stays exactly zero). FedEmbed-SOM's head re-use is an argmax over the mean
membership counts (ties keep the own head): it is the same unless the
one-user-per-client counts hold an exact tie that last-bit rounding breaks
the other way, which can happen when users have equal update weights (e.g.
a new cluster with one user from its own and one from another old cluster,
in different shards of unequal total weight); such a round then re-uses
the other, equally overlapping head. The clients' own discrete choices in
later rounds (nearest centroid, best-matching unit, best score) likewise
differ only for a user within rounding of a tie. The tests compare both
forms on users of unequal sizes, where no such tie occurs.
"""

from __future__ import annotations

import collections
import os
from typing import Any, Sequence

import tensorflow as tf
import tensorflow_federated as tff

from tff_personal.core import batched as batched_lib
from tff_personal.core import best_scoring
from tff_personal.core import client_data
from tff_personal.core import flat_transport
from tff_personal.core import inprocess
from tff_personal.core import moved
from tff_personal.core import privacy
from tff_personal.core import process as process_lib
from tff_personal.core import runtime
from tff_personal.core import shard_packing
from tff_personal.core import shard_threads
from tff_personal.core import sharded_privacy
from tff_personal.core import statistics_process
from tff_personal.core import worker_threads

# The packing of users into shards (`core/shard_packing.py`), re-exported.
SHARD_EXAMPLES = shard_packing.SHARD_EXAMPLES
SHARD_INDICES = shard_packing.SHARD_INDICES
SHARD_BATCH_SIZES = shard_packing.SHARD_BATCH_SIZES
SHARD_NUM_BATCHES = shard_packing.SHARD_NUM_BATCHES
SHARD_USERS = shard_packing.SHARD_USERS
shard_data_type = shard_packing.shard_data_type
PackedBatches = shard_packing.PackedBatches
pack_datasets = shard_packing.pack_datasets
shard_ranges = shard_packing.shard_ranges
stack_states = shard_packing.stack_states


def _shard_loop(step, spec, element_spec, user_clip_norm, wire,
                count_users: bool):
  """The TF logic of a shard (`build_shard_work`) around a built per-user
  `step`: `run(weights, states, shard) -> OrderedDict`, plain Python to be
  traced (without AutoGraph, as the one-user form)."""
  select = 'selected' in spec

  def run(weights, states, shard):
    num_users = tf.shape(shard[SHARD_NUM_BATCHES])[0]
    zeros = lambda s: tf.zeros(s.shape, s.dtype)
    update_sum = tf.nest.map_structure(zeros, spec['update'])
    metric_sums = tf.nest.map_structure(zeros, spec['metrics'])
    arrays = tf.nest.map_structure(
        lambda s: tf.TensorArray(s.dtype, size=num_users,
                                 element_shape=s.shape),
        spec['client_state'])
    # The selection so far (an empty structure when there is none).
    best = (best_scoring.no_candidate(spec['selected']['value'])
            if select else ())

    def body(u, update_sum, total_weight, metric_sums, arrays, best):
      state_u = tf.nest.map_structure(lambda t: t[u], states)
      out = step(weights, state_u, PackedBatches(shard, u, element_spec,
                                                 wire))
      if user_clip_norm is None:
        w = tf.cast(out['update_weight'], tf.float32)
        user_update = out['update']
      else:
        w = tf.constant(1.0)
        user_update = sharded_privacy.clip_user_update(out['update'],
                                                       user_clip_norm)
      update_sum = tf.nest.map_structure(
          lambda a, x: a + tf.cast(w, x.dtype) * x, update_sum, user_update)
      metric_sums = tf.nest.map_structure(tf.add, metric_sums,
                                          out['metrics'])
      arrays = tf.nest.map_structure(lambda ta, x: ta.write(u, x), arrays,
                                     out['client_state'])
      if select:
        best = best_scoring.better(best, out['selected'])
      return u + 1, update_sum, total_weight + w, metric_sums, arrays, best

    # One user at a time: every user loads its values into the same model
    # variables (`shard_packing.PackedBatches.reduce` says why overlapping
    # iterations are not safe).
    _, update_sum, total_weight, metric_sums, arrays, best = tf.while_loop(
        lambda u, *_: u < num_users, body,
        (tf.constant(0), update_sum, tf.constant(0.0), metric_sums, arrays,
         best), parallel_iterations=1)
    if user_clip_norm is None:
      update = tf.nest.map_structure(
          lambda a: tf.math.divide_no_nan(a, tf.cast(total_weight, a.dtype)),
          update_sum)
    else:
      update = update_sum
    new_states = tf.nest.map_structure(lambda ta: ta.stack(), arrays)
    result = collections.OrderedDict(
        update=update, update_weight=total_weight, client_state=new_states,
        metrics=metric_sums)
    if select:
      result['selected'] = best
    if count_users:
      result[SHARD_USERS] = tf.cast(num_users, tf.float32)
    return result

  return run


def _make_loop(make_step, spec, element_spec, user_clip_norm, wire,
               count_users, batched):
  """The shard's TF logic: per user (`_shard_loop`) or batched."""
  if batched:
    return batched_lib.shard_loop(make_step, spec, user_clip_norm, wire,
                                  count_users)
  return _shard_loop(make_step(), spec, element_spec, user_clip_norm, wire,
                     count_users)


def shard_result_type(step_result_type: tff.Type,
                      count_users: bool = False) -> tff.Type:
  """The TFF type of a shard's result (`build_shard_work`), from one step's
  result type, without tracing the step: the update, metrics and selection
  as one user's, the update weight a float32, the client states stacked
  along a leading user axis and, with `count_users`, `SHARD_USERS`."""
  spec = tff.types.type_to_tf_tensor_specs(step_result_type)
  result = collections.OrderedDict(
      update=spec['update'],
      update_weight=tf.TensorSpec([], tf.float32),
      client_state=tf.nest.map_structure(
          lambda t: tf.TensorSpec([None] + t.shape.as_list(), t.dtype),
          spec['client_state']),
      metrics=spec['metrics'])
  if 'selected' in spec:
    result['selected'] = spec['selected']
  if count_users:
    result[SHARD_USERS] = tf.TensorSpec([], tf.float32)
  return tff.types.tensorflow_to_type(result)


def build_shard_work(make_step: process_lib.ClientStepFactory,
                     weights_type: tff.Type, client_state_type: tff.Type,
                     data_type: tff.SequenceType,
                     step_result_type: tff.Type,
                     user_clip_norm: float | None = None,
                     wire: client_data.WireFormat | None = None,
                     count_users: bool = False,
                     batched: bool = False
                     ) -> tff.Computation:
  """The TFF client work of a shard: the per-user step over every user.

  Returns the weighted mean of the users' updates (weights: the users'
  update weights; zero total weight gives a zero update), the total weight,
  the stacked new client states and the summed metrics. With
  `user_clip_norm`, the update is instead the sum of the users' updates each
  clipped to that L2 norm (for DP; the weight is then the number of users).
  `step_result_type` is the type of one step's result (the one-user client
  work's result type). With `wire`, the shard's examples arrive in that
  form and each batch is decoded before the step sees it. When the step
  returns `selected` (`<score, value>`), the shard returns its best user's,
  selected in user order by `best_scoring.better`. With `count_users`, the
  result also holds `SHARD_USERS`, the shard's user count (float32). With
  `batched`, the shard's users train together (`core/batched.py`).
  """
  spec = tff.types.type_to_tf_tensor_specs(step_result_type)
  element_spec = tff.types.type_to_tf_tensor_specs(data_type.element)
  stacked_state_type = shard_packing.stacked_type(client_state_type)
  shard_type = shard_data_type(data_type, wire)

  @tff.tensorflow.computation(weights_type, stacked_state_type, shard_type)
  def shard_work(weights, states, shard):
    run = _make_loop(make_step, spec, element_spec, user_clip_norm, wire,
                     count_users, batched)
    # As the one-user form: no AutoGraph.
    return tf.function(run, autograph=False)(weights, states, shard)

  return shard_work


def _relaxed(t, leading: int) -> tf.TensorSpec:
  """`t`'s spec with any size along its first `leading` axes."""
  return tf.TensorSpec([None] * leading + t.shape[leading:].as_list(),
                       t.dtype)


def _shard_signature(shard) -> collections.OrderedDict:
  """A packed shard's spec for any user, batch and example count: the
  examples vary along (user, example), the index arrays along every axis."""
  return collections.OrderedDict(
      (k, tf.nest.map_structure(
          lambda t: _relaxed(t, 2 if k == SHARD_EXAMPLES else t.shape.rank),
          v)) for k, v in shard.items())


def call_signature(weights, states, *shards) -> tuple:
  """The input signature of a shard loop called with `(weights, stacked
  states, *shards)` shaped as these, for any user, batch and example
  count."""
  return (tf.nest.map_structure(lambda t: _relaxed(t, 0), weights),
          tf.nest.map_structure(lambda t: _relaxed(t, 1), states),
          *[_shard_signature(shard) for shard in shards])


class DriverShardWork:
  """`build_shard_work`'s computation run in this process, one thread per
  shard, instead of in TFF's executor.

  Called with a list of `(weights, stacked_states, shard)` argument tuples
  (those of the TFF computation), it returns their results in order, as
  nested numpy values of the computation's result type. Each concurrent
  shard has its own per-user step (`make_step()`, built eagerly once, so
  its model variables are reused: a step re-assigns every variable it reads
  on entry) and its own traced loop, the same TF code as the computation's
  (`_shard_loop`). Routed through the executor, a round serialised every
  shard's examples into it and the results back; here they stay in this
  process. The aggregation, DP noise included, runs where `ShardedProcess`
  says (`aggregate_in`): on TFF's runtime, or compiled, in this process.

  Args:
    make_step: The per-user step factory (`Composition.client_step`).
    step_result_type: One step's result type (as for `build_shard_work`).
    element_spec: The per-user batches' element spec (decoded form).
    user_clip_norm, wire, count_users, batched: As for `build_shard_work`.
  """

  def __init__(self, make_step: process_lib.ClientStepFactory,
               step_result_type: tff.Type, element_spec,
               user_clip_norm: float | None = None,
               wire: client_data.WireFormat | None = None,
               count_users: bool = False, batched: bool = False):
    self._make_step = make_step
    self._result_spec = tff.types.type_to_tf_tensor_specs(step_result_type)
    self._element_spec = element_spec
    self._loop_args = (user_clip_norm, wire, count_users, batched)
    self._runs = []  # One loop per concurrent shard, built on use.

  def _build(self, example_call):
    """A fresh step and the shard loop over it, for arguments shaped as
    `example_call` with any user, batch and example count (traced in this
    thread: `shard_threads.trace_loop`)."""
    return shard_threads.trace_loop(
        lambda: _make_loop(self._make_step, self._result_spec,
                           self._element_spec, *self._loop_args),
        call_signature(*example_call), autograph=False)

  @property
  def traced_loops(self) -> list:
    """The shard loops traced so far (`tf.function`s, one per concurrent
    shard), e.g. to inspect their graphs."""
    return [run.function for run in self._runs]

  def __call__(self, calls: Sequence[tuple],
               lanes: int | None = None) -> list:
    """The calls' results in order; with `lanes`, at most that many run at
    once (`shard_threads.run_concurrently`)."""
    to_tensors = lambda x: tf.nest.map_structure(tf.convert_to_tensor, x)
    results = shard_threads.run_concurrently(self._runs, self._build,
                                             [to_tensors(c) for c in calls],
                                             lanes)
    return [tf.nest.map_structure(lambda t: t.numpy(), r) for r in results]


IN_DRIVER = 'driver'
IN_EXECUTOR = 'executor'

# Where the round's aggregation, DP noise and server step run once the
# shards' results are in (`ShardedProcess(..., aggregate_in=)`).
AGGREGATE_IN_TFF = 'tff'
AGGREGATE_IN_PROCESS = 'inprocess'


def _batch_count(dataset) -> int:
  """A client's number of batches, or -1 when it is not known up front
  (a `tf.data.Dataset` of unknown cardinality)."""
  if isinstance(dataset, client_data.ClientBatches):
    return len(dataset.index_batches)
  return int(dataset.cardinality())


class ShardedProcess:
  """Runs a `StatefulClientProcess`'s algorithm with users packed in shards.

  Same Python interface as the process for a driver: `initialize()`,
  `next(state, client_states, datasets)` with per-user lists in and out,
  `get_model_weights`, `set_model_weights`, `model_fn`, `client_state_type`,
  `model_weights_type`, and the base process's evaluation declarations
  (`eval_model_fn`, `initial_private`, ...). The underlying TFF process
  (whose clients are shards) is `iterative_process`.
  """

  def __init__(self, base: process_lib.StatefulClientProcess, num_shards: int,
               wire: client_data.WireFormat | None = None,
               shards_in: str = IN_DRIVER, batched: bool = False,
               batch_users: int | None = None,
               aggregate_in: str = AGGREGATE_IN_TFF):
    """Builds the sharded form of `base`.

    Args:
      base: a process composed with a `client_step` (every process built by
        `build_split_model_process` is; so are PFedKM and FedEmbed-SOM, by
        `statistics_process.compose_with_server_step`, whose server step and
        best-scoring selection are kept: module docstring).
      num_shards: TFF clients per round (users are split evenly); about the
        number of CPU cores.
      wire: the task's `WireFormat` when its `ClientBatches` hold examples
        in a compact form (e.g. uint8) that the shard decodes; its decoded
        form must match the process's client data type.
      shards_in: Where a local run computes the shards' client work:
        `IN_DRIVER` (this process, `DriverShardWork`) or `IN_EXECUTOR`
        (TFF's executor, the shards as its clients). The aggregation, DP
        noise and server update run in TFF either way; with several workers
        (`runtime.local_runtime(workers=...)`) the shards run on them.
      batched: train each shard's users together (`core/batched.py`)
        instead of one after another; refused, saying why, for a process
        whose client step it does not cover. Shards are then cut from the
        round's users sorted by batch count, so that a shard's users pad
        little (the sum over shards is the same, up to float order).
      batch_users: with `batched`, the most users trained together: the
        round's users (sorted by batch count) are cut into groups of at
        most this many, and each of the `num_shards` shards runs its groups
        one after another. Each user has its own weights and optimizer
        slots, so a group's state should stay in the CPU's cache; None:
        all of a shard's users at once.
      aggregate_in: Where the round's aggregation, DP noise and server step
        run on the shards' results: `AGGREGATE_IN_TFF` (TFF's runtime, the
        reference) or `AGGREGATE_IN_PROCESS` (the compiled MapReduceForm
        pieces of the same process as TensorFlow functions of this process,
        `core/inprocess.py`: no `worker_binary`); needs `IN_DRIVER`. The
        in-process round is compiled on first use and raises
        `inprocess.NotInProcessError` if the process does not compile.
    """
    if shards_in not in (IN_DRIVER, IN_EXECUTOR):
      raise ValueError(f'shards_in must be {IN_DRIVER!r} or {IN_EXECUTOR!r}, '
                       f'got {shards_in!r}')
    if aggregate_in not in (AGGREGATE_IN_TFF, AGGREGATE_IN_PROCESS):
      raise ValueError(f'aggregate_in must be {AGGREGATE_IN_TFF!r} or '
                       f'{AGGREGATE_IN_PROCESS!r}, got {aggregate_in!r}')
    if aggregate_in == AGGREGATE_IN_PROCESS and shards_in != IN_DRIVER:
      raise ValueError('aggregate_in=inprocess runs the shards in the driver '
                       f'(shards_in={IN_DRIVER!r}), got {shards_in!r}')
    composition = base.composition
    if composition is None or composition.client_step is None:
      raise ValueError(
          'this process was not composed with a per-user client step '
          '(compose_stateful_client_process(client_step=...)), so it cannot '
          'be sharded; run it with one user per client (num_shards=0)')
    # User-level DP clips each user before summing, so the shards clip per
    # user: the clip and noise are the process's own aggregator's.
    dp = privacy.config_of(composition.aggregator_factory)
    if num_shards < 1:
      raise ValueError(f'num_shards must be >= 1, got {num_shards}')
    if not _selection_is_shardable(composition):
      raise ValueError(
          'the process selects with '
          f'{type(composition.selection_factory).__name__}, whose reduction '
          'over a shard of users is unknown (only BestScoringFactory is '
          'sharded); run it with one user per client (num_shards=0)')
    if batch_users is not None and (not batched or batch_users < 1):
      raise ValueError('batch_users needs batched=True and is >= 1, got '
                       f'{batch_users} (batched={batched})')
    if batched:
      reason = batched_lib.unsupported_reason(composition.client_step)
      if reason is not None:
        raise ValueError(f'this process cannot run batched: {reason}; run it '
                         'sharded (batched=False)')
    with_server_step = composition.server_step is not None
    self._base = base
    self._batched = batched
    self._batch_users = batch_users
    self._num_shards = num_shards
    data_type = composition.client_data_type
    self._element_spec = tff.types.type_to_tf_tensor_specs(data_type.element)
    self._wire = wire
    self._state_template = tff.types.type_to_tf_tensor_specs(
        composition.client_state_type)
    clip = None if dp is None else float(dp.clip_norm)
    # The TFF shard computation is traced on first use (by the executor
    # form or the workers); the driver form needs only its types.
    self._build_shard_work = lambda: build_shard_work(
        composition.client_step, base.model_weights_type,
        composition.client_state_type, data_type,
        composition.client_work_result_type, user_clip_norm=clip, wire=wire,
        count_users=with_server_step, batched=batched)
    self._shard_work_fn = None
    self._result_type = shard_result_type(
        composition.client_work_result_type, count_users=with_server_step)
    self._common = dict(
        initial_model_weights=composition.initial_model_weights,
        client_state_type=shard_packing.stacked_type(composition.client_state_type),
        aggregator_factory=(composition.aggregator_factory if dp is None else
                            sharded_privacy.build_sharded_aggregator(dp)),
        server_optimizer=composition.server_optimizer,
        train_metrics=composition.train_metrics, model_fn=base.model_fn)
    self._shards_in = shards_in
    self._driver_work = DriverShardWork(
        composition.client_step, composition.client_work_result_type,
        self._element_spec, user_clip_norm=clip, wire=wire,
        count_users=with_server_step, batched=batched)
    self._with_server_step = with_server_step
    self._executor_process = None  # Built on first use.
    self._from_results = None  # Built on first use.
    self._transport = None  # Set with _from_results.
    self._results_call = None  # Built on first use.
    self._aggregate_in = aggregate_in
    self._inprocess_round = None  # Built on first use.

  @property
  def driver_work(self) -> DriverShardWork:
    """The shards' client work as this process computes it (`IN_DRIVER`)."""
    return self._driver_work

  @property
  def _shard_work(self) -> tff.Computation:
    if self._shard_work_fn is None:
      self._shard_work_fn = self._build_shard_work()
    return self._shard_work_fn

  @property
  def _process(self) -> process_lib.StatefulClientProcess:
    if self._executor_process is None:
      self._executor_process = self._compose(self._shard_work)
    return self._executor_process

  def _compose(self, client_work, client_state_type=None):
    composition = self._base.composition
    common = dict(self._common, client_work=client_work)
    if client_state_type is not None:
      common['client_state_type'] = client_state_type
    if self._with_server_step:
      return statistics_process.compose_with_server_step(
          server_step=composition.server_step,
          selection_factory=composition.selection_factory,
          cohort_field=SHARD_USERS, **common)
    return process_lib.compose_stateful_client_process(**common)

  def _process_from_results(self) -> process_lib.StatefulClientProcess:
    """The same process, whose client work returns each shard's result
    computed beforehand (its client data): the aggregation, DP noise and
    server step of one round, without the shards' training.

    Only what the aggregation reads crosses into TFF: the shards' new
    client states are taken from their results in the driver (the process
    returns the client work's states unchanged), so its client states are
    empty, and the rest of a result travels packed
    (`flat_transport.FlatTransport`, when every shape is known) and is
    unpacked inside the client work.
    """
    if self._from_results is None:
      weights_type = self._base.model_weights_type
      sent = tff.types.type_to_tf_tensor_specs(self._result_type)
      del sent['client_state']
      self._transport = (flat_transport.FlatTransport(sent)
                         if flat_transport.FlatTransport.fits(sent) else None)
      sent_type = tff.types.tensorflow_to_type(
          sent if self._transport is None else self._transport.packed_spec)
      no_state = tff.StructType([])
      keys = list(tff.types.type_to_tf_tensor_specs(self._result_type))

      @tff.tensorflow.computation(weights_type, no_state, sent_type)
      def precomputed(weights, states, sent):
        del weights, states  # The shard's result was computed with them.
        if self._transport is not None:
          sent = self._transport.unpack_tensors(sent)
        return collections.OrderedDict(
            (k, () if k == 'client_state' else sent[k]) for k in keys)

      self._from_results = self._compose(precomputed, no_state)
    return self._from_results

  @property
  def aggregate_in(self) -> str:
    """Where the aggregation and server step run (`AGGREGATE_IN_*`)."""
    return self._aggregate_in

  @property
  def inprocess_round(self) -> inprocess.InProcessRound:
    """`_process_from_results`'s round compiled to its production form
    and run in this process (`inprocess.build`), built on first use."""
    if self._inprocess_round is None:
      self._inprocess_round = inprocess.build(self._process_from_results())
    return self._inprocess_round

  def _aggregate_results(self, state, results: Sequence[Any]):
    """The round's TFF call on the shards' `results`: the aggregation, DP
    noise and server step of `_process_from_results`. Returns the new
    server state and the round's metrics.

    The server state crosses into TFF and back packed
    (`flat_transport.FlatTransport`, when every shape is known): the call
    unpacks it at the server, runs the process's `next` and packs the new
    state. The state held between rounds is the process's own (structured)
    value.
    """
    if self._aggregate_in == AGGREGATE_IN_PROCESS:
      sent = [self._sent(r) for r in results]
      state, _, metrics = self.inprocess_round.next(state, [()] * len(sent),
                                                    sent)
      return state, metrics
    if self._results_call is None:
      process = self._process_from_results()
      next_type = process.next.type_signature
      state_type = next_type.parameter[0].member
      state_spec = tff.types.type_to_tf_tensor_specs(state_type)
      if not flat_transport.FlatTransport.fits(state_spec):
        def call(state, sent):
          state, _, metrics = process.next(state, [()] * len(sent), sent)
          return state, metrics
      else:
        transport = flat_transport.FlatTransport(state_spec)
        packed_type = tff.types.tensorflow_to_type(transport.packed_spec)

        @tff.tensorflow.computation(packed_type)
        def unpack_state(packed):
          return transport.unpack_tensors(packed)

        @tff.tensorflow.computation(state_type)
        def pack_state(state):
          return transport.pack_tensors(state)

        @tff.federated_computation(tff.FederatedType(packed_type, tff.SERVER),
                                   next_type.parameter[1],
                                   next_type.parameter[2])
        def packed_next(packed, states, sent):
          state = tff.federated_map(unpack_state, packed)
          new_state, _, metrics = process.next(state, states, sent)
          return tff.federated_map(pack_state, new_state), metrics

        def call(state, sent):
          packed, metrics = packed_next(transport.pack(state),
                                        [()] * len(sent), sent)
          return transport.unpack(packed), metrics
      self._results_call = call
    return self._results_call(state, [self._sent(r) for r in results])

  def _sent(self, result):
    """What of a shard's result `_process_from_results` takes."""
    sent = collections.OrderedDict(
        (k, v) for k, v in result.items() if k != 'client_state')
    return sent if self._transport is None else self._transport.pack(sent)

  @property
  def num_shards(self) -> int:
    return self._num_shards

  @property
  def iterative_process(self) -> process_lib.StatefulClientProcess:
    """The TFF process whose clients are shards (stacked states, packed data)."""
    return self._process

  @property
  def base_process(self) -> process_lib.StatefulClientProcess:
    return self._base

  @property
  def model_fn(self):
    return self._base.model_fn

  @property
  def client_state_type(self) -> tff.Type:
    return self._base.client_state_type

  @property
  def model_weights_type(self) -> tff.Type:
    return self._base.model_weights_type

  # How clients are evaluated and start: the base process's declarations.
  @property
  def eval_model_fn(self):
    return self._base.eval_model_fn

  @property
  def eval_private_fn(self):
    return self._base.eval_private_fn

  @property
  def eval_client_state_type(self) -> tff.Type:
    return self._base.eval_client_state_type

  @property
  def eval_fine_tune(self) -> bool:
    return self._base.eval_fine_tune

  @property
  def initial_private(self):
    return self._base.initial_private

  def initialize(self):
    # The process `next` will run, so that only one is traced.
    if self._aggregate_in == AGGREGATE_IN_PROCESS:
      return self.inprocess_round.initialize()
    if self._shards_in == IN_EXECUTOR and runtime.worker_map() is None:
      return self._process.initialize()
    return self._process_from_results().initialize()

  def get_model_weights(self, state):
    return self._base.get_model_weights(state)

  def set_model_weights(self, state, weights):
    return self._base.set_model_weights(state, weights)

  def shards(self, num_users: int) -> list[range]:
    """The user positions (in `_user_order`) of each TFF client's work: a
    shard's, or with `batch_users` a group's."""
    if self._batch_users is None:
      return shard_ranges(num_users, self._num_shards)
    return shard_ranges(num_users, max(self._num_shards,
                                       -(-num_users // self._batch_users)))

  def _user_order(self, datasets) -> list[int]:
    """The order in which users are cut into shards. Batched, users of
    similar batch counts share a shard (a shard runs as many steps as its
    largest user, for every user), when every dataset's cardinality is
    known; otherwise, and sharded, their own order."""
    order = list(range(len(datasets)))
    if not self._batched:
      return order
    sizes = [_batch_count(d) for d in datasets]
    if min(sizes) < 0:
      return order
    return sorted(order, key=lambda i: sizes[i])

  def next(self, state, client_states: Sequence[Any],
           datasets: Sequence[tf.data.Dataset]):
    """One round; per-user states and datasets in, per-user states out."""
    if len(client_states) != len(datasets):
      raise ValueError(f'{len(client_states)} client states for '
                       f'{len(datasets)} datasets')
    if not datasets:
      raise ValueError('a round needs at least one client')
    order = self._user_order(datasets)
    ranges = [[order[i] for i in r] for r in self.shards(len(datasets))]
    shard_states = [stack_states([client_states[i] for i in r])
                    for r in ranges]
    shard_data = [pack_datasets([datasets[i] for i in r], self._element_spec,
                                self._wire)
                  for r in ranges]
    spread = runtime.worker_map()
    if spread is None and self._shards_in == IN_EXECUTOR:
      # One call: TFF runs the shards as its clients.
      state, new_shard_states, metrics = self._process.next(
          state, shard_states, shard_data)
    else:
      # Each shard's work runs once, in this process (the examples never
      # cross into the executor) or on one of several workers (TFF's
      # mergeable form would run the client work again after the merge to
      # produce the client states); the round's aggregate, DP noise
      # included, is formed once in TFF from the shards' results.
      weights = self.get_model_weights(state)
      calls = [(weights, st, d) for st, d in zip(shard_states, shard_data)]
      results = (self._driver_work(calls, lanes=self._num_shards)
                 if spread is None else spread(self._shard_work, calls))
      state, metrics = self._aggregate_results(state, results)
      new_shard_states = [r['client_state'] for r in results]
    new_states = [None] * len(datasets)
    for r, stacked in zip(ranges, new_shard_states):
      for i, user_state in zip(r, shard_packing.unstack_states(
          stacked, len(r), self._state_template)):
        new_states[i] = user_state
    return state, new_states, metrics


AUTO = -1
AUTO_SHARDS_VAR = 'TFF_PERSONAL_AUTO_SHARDS'


def auto_shard_count() -> int:
  """Shards per round of an AUTO (-1) run that can be sharded.

  The value of `$TFF_PERSONAL_AUTO_SHARDS` when set (a positive count, for
  a process that shares the machine: each of the test suite's two pytest
  workers takes one), else the CPUs this process may run on (its affinity
  mask), at most 8.

  Raises:
    ValueError: The variable is set to something other than a positive
      count.
  """
  value = os.environ.get(AUTO_SHARDS_VAR, '')
  if value:
    if not value.isdigit() or int(value) < 1:
      raise ValueError(f'{AUTO_SHARDS_VAR} must be a positive shard count, '
                       f'got {value!r}')
    return int(value)
  return max(1, min(worker_threads.cpu_count(), 8))


def _selection_is_shardable(composition: process_lib.Composition) -> bool:
  """No selection, or the best-scoring one (whose rule shards can apply)."""
  return composition.selection_factory is None or isinstance(
      composition.selection_factory, best_scoring.BestScoringFactory)


def resolve_num_shards(process, requested: int) -> int:
  """The shard count to use: `requested`, or for AUTO (-1)
  `auto_shard_count()` when the process can be sharded (it has a per-user
  client step, its selection if any is the best-scoring one, and DP if any
  is fixed-clip Gaussian), else 0 (one user per client)."""
  if requested != AUTO:
    if requested < 0:
      raise ValueError(f'simulation_shards must be >= 0 or {AUTO} (auto), '
                       f'got {requested}')
    return requested
  composition = getattr(process, 'composition', None)
  if composition is None or composition.client_step is None:
    return 0
  if not _selection_is_shardable(composition):
    return 0
  try:
    dp = privacy.config_of(composition.aggregator_factory)
  except ValueError:  # A DP aggregator of unknown clip: refused sharded.
    return 0
  if dp is not None and dp.mechanism != 'gaussian_fixed':
    return 0
  return auto_shard_count()


def maybe_shard(process, num_shards: int,
                wire: client_data.WireFormat | None = None,
                shards_in: str = IN_DRIVER, batched: bool = False,
                batch_users: int | None = None,
                aggregate_in: str = AGGREGATE_IN_TFF):
  """`ShardedProcess(process, num_shards, wire, shards_in, batched,
  batch_users, aggregate_in)`, or `process` for 0 (refused with
  `batched`)."""
  if num_shards == 0:
    if batched:
      raise ValueError('batched training runs in shards; it needs '
                       'simulation_shards != 0')
    return process
  return ShardedProcess(process, num_shards, wire, shards_in, batched,
                        batch_users, aggregate_in)


# Names that moved away raise an error naming their new place.
__getattr__ = moved.module_getattr(__name__)
