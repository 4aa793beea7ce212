"""The in-process round (`core/inprocess.py`) against TFF's runtime.

Two forms, each held round for round to the same round on TFF's runtime:
two rounds of three users with different example counts give the same
server state, the same new state of every client and the same metrics
(float32, to 1e-5).

* One user per client: a process's compiled MapReduceForm run as
  TensorFlow functions here against `process.next`.
* Sharded (the default in-process form): two shards' work in the driver,
  the round's aggregation, DP noise and server step from the compiled
  pieces of `ShardedProcess`'s round, against the same shards aggregated
  on TFF's runtime.

By default for the cheapest algorithm of every family of the registry
(`FAMILIES`), without DP and under DP at noise multiplier 0 (clipping on;
sharded, for two families: `SHARDED_CASES`);
with `TFF_PERSONAL_INPROCESS_ALL=1` also for every algorithm the registry
declares covered (`AlgorithmSpec.inprocess`), every stage, without DP
(several more minutes on two cores). Each piece runs as often as the round
needs it (counted), a skipped piece shows as a different round, no TFF
execution happens on the way, the states of either round feed the other,
the secure sums run, and DP noise is the compiled `update`'s fresh draw at
the configured scale. The tiny models and ragged clients are the
conformance suite's and `tests/production_test.py`'s.
"""
import dataclasses
import functools
import os
import types

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff
from tensorflow_federated.python.core.impl.context_stack import (
    context_stack_impl)
from tensorflow_federated.python.core.impl.context_stack import (
    runtime_error_context)

from tests import conformance_test as conformance
from tests import fedembed_testdata
from tests import fedperc_testdata
from tests import production_test
from tff_personal.algorithms import registry
from tff_personal.config import experiment
from tff_personal.core import inprocess
from tff_personal.core import privacy
from tff_personal.core import production
from tff_personal.core import runtime
from tff_personal.core import sharded
from tff_personal.run import runs

SIZES = [4, 7, 5]
COVERED = sorted(n for n, s in registry.SPECS.items() if not s.inprocess)
# The cheapest algorithm of each family (`AlgorithmSpec.family`), with the
# stage compared for a staged one (its others build, not run).
FAMILIES = [('global', 0), ('furl', 0), ('fedper', 0),
            ('fedembed_personal', 0), ('fedperc_frozen', 0),
            ('feddva', 1), ('groupfl', 1)]
EVERY = os.environ.get('TFF_PERSONAL_INPROCESS_ALL') == '1'
_EVERY_ONLY = pytest.mark.skipif(
    not EVERY, reason='TFF_PERSONAL_INPROCESS_ALL=1 (about two minutes)')


def _dp():
  """TFF's central DP at noise multiplier 0 with a clip below the tiny
  models' update norms: every update is clipped, no noise is drawn."""
  return tff.aggregators.DifferentiallyPrivateFactory.gaussian_fixed(
      noise_multiplier=0.0, clients_per_round=len(SIZES), clip=0.01)


@functools.lru_cache(maxsize=None)
def _stages(name, dp):
  """The processes of `name`'s stages (one for a single-stage one), built
  once, as `tests/production_test.py` builds them (under DP with
  `_dp()`)."""
  built = production_test._built(  # pylint: disable=protected-access
      name, dp, _dp() if dp != 'none' else None)
  return [form.process for _, form in production.production_forms(built)]


@functools.lru_cache(maxsize=None)
def _round(name, dp, stage):
  """`(process, its in-process round)` of one stage (built once)."""
  proc = _stages(name, dp)[stage]
  return proc, inprocess.build(proc)


def _data_fn(name, proc):
  typed = hasattr(proc.client_data_type.element, 'type')
  if conformance._is_fedperc(name):  # pylint: disable=protected-access
    return fedperc_testdata.datasets
  return lambda sizes, r: conformance._datasets(sizes, r, typed)  # pylint: disable=protected-access


def _leaves(value, type_spec):
  return [np.asarray(v) for v in inprocess.value_leaves(value, type_spec)]


def _check_close(got, want, type_spec, what):
  got, want = _leaves(got, type_spec), _leaves(want, type_spec)
  assert len(got) == len(want), what
  for i, (x, y) in enumerate(zip(got, want)):
    assert x.dtype == y.dtype and x.shape == y.shape, (what, i, x, y)
    if x.dtype.kind in 'fc':
      np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6,
                                 err_msg=f'{what}: leaf {i}')
    else:  # Integers, booleans, strings: exactly.
      np.testing.assert_array_equal(x, y, err_msg=f'{what}: leaf {i}')


def _two_rounds(name, proc, step, state, clients):
  data_fn = _data_fn(name, proc)
  metrics = None
  for r in range(2):
    state, clients, metrics = step(state, clients, data_fn(SIZES, r))
  return state, clients, metrics


def _check_same_rounds(name, dp, stage):
  proc, in_process = _round(name, dp, stage)
  before = {k: p.calls for k, p in in_process.pieces.items()}
  result = proc.next.type_signature.result
  clients = fedembed_testdata.initial_states(proc, len(SIZES), seed=4)
  initial = proc.initialize()
  _check_close(in_process.initialize(), initial, result[0],
               f'{name} initial state')
  got = _two_rounds(name, proc, in_process.next, in_process.initialize(),
                    list(clients))
  want = _two_rounds(name, proc, proc.next, initial, list(clients))
  _check_close(got[0], want[0], result[0], f'{name} {dp} server state')
  for u, (a, b) in enumerate(zip(got[1], want[1], strict=True)):
    _check_close(a, b, result[1], f'{name} {dp} client {u}')
  _check_close(got[2], want[2], result[2], f'{name} {dp} metrics')
  # The rounds did something: the comparison is not of two no-ops.
  assert not all(np.allclose(a, b) for a, b in zip(
      _leaves(want[0], result[0]), _leaves(initial, result[0]))), name
  # Each piece ran once per round, each device once per client.
  calls = {k: p.calls - before[k] for k, p in in_process.pieces.items()}
  assert calls['device'] == 2 * len(SIZES) and calls['update'] == 2, calls


@functools.lru_cache(maxsize=None)
def _sharded_stages(name, dp):
  """The processes of `name`'s stages, under DP with the library's own
  DP aggregator (`privacy.build_aggregator`, which the sharded form reads)
  at noise multiplier 0 and a clip below the updates' norms."""
  aggregator = privacy.build_aggregator(privacy.DPConfig(
      mechanism='gaussian_fixed', noise_multiplier=0.0, clip_norm=0.01,
      clients_per_round=len(SIZES), population=100, rounds=2))
  built = production_test._built(  # pylint: disable=protected-access
      name, dp, aggregator if dp != 'none' else None)
  return [form.process for _, form in production.production_forms(built)]


def _check_same_sharded_rounds(name, dp, stage):
  """Two shards, the round's aggregation and server step in process
  (as one graph, and piece by piece) against the same shards aggregated on
  TFF's runtime."""
  proc = _sharded_stages(name, dp)[stage]
  assert sharded.resolve_num_shards(proc, -1) > 0, f'{name} is not sharded'
  reference = sharded.ShardedProcess(proc, 2)
  in_process = sharded.ShardedProcess(
      proc, 2, aggregate_in=sharded.AGGREGATE_IN_PROCESS)
  round_ = in_process.inprocess_round
  result = round_.process.next.type_signature.result
  client_type = proc.next.type_signature.result[1]
  clients = fedembed_testdata.initial_states(proc, len(SIZES), seed=4)
  initial = reference.initialize()
  _check_close(in_process.initialize(), initial, result[0],
               f'{name} initial state')
  want = _two_rounds(name, proc, reference.next, initial, list(clients))
  assert not all(np.allclose(a, b) for a, b in zip(
      _leaves(want[0], result[0]), _leaves(initial, result[0]))), name
  assert round_.fuse  # A shard's inputs are tensors.
  for fuse in (True, False):
    round_.fuse = fuse
    before = {k: p.calls for k, p in round_.pieces.items()}
    got = _two_rounds(name, proc, in_process.next, in_process.initialize(),
                      list(clients))
    what = f'{name} {dp} {"fused" if fuse else "by piece"}'
    _check_close(got[0], want[0], result[0], f'{what} server state')
    for u, (a, b) in enumerate(zip(got[1], want[1], strict=True)):
      _check_close(a, b, client_type, f'{what} client {u}')
    _check_close(got[2], want[2], result[2], f'{what} metrics')
    calls = {k: p.calls - before[k] for k, p in round_.pieces.items()}
    if fuse:  # One graph of two shards ran; no piece on its own.
      assert list(round_._fused) == [2], round_._fused  # pylint: disable=protected-access
      assert not any(calls[k] for k in inprocess.PIECES), calls
    else:  # Each piece once per round, the device piece once per shard.
      assert calls['device'] == 2 * 2 and calls['update'] == 2, calls
  round_.fuse = True


# Sharded: every family without DP; under DP (the sharded DP aggregator,
# the same for every family) FedAvg and one with private state.
SHARDED_CASES = [(name, stage, 'none') for name, stage in FAMILIES] + [
    ('global', 0, 'gaussian_fixed'), ('fedembed_personal', 0,
                                      'gaussian_fixed')]


@pytest.mark.parametrize('name,stage,dp', SHARDED_CASES)
def test_one_algorithm_per_family_sharded_in_process_as_on_tff(name, stage,
                                                                dp):
  _check_same_sharded_rounds(name, dp, stage)


@_EVERY_ONLY
@pytest.mark.parametrize('name', COVERED)
def test_every_covered_algorithm_sharded_in_process_as_on_tff(name):
  for stage in range(len(_sharded_stages(name, 'none'))):
    if sharded.resolve_num_shards(_sharded_stages(name, 'none')[stage],
                                  -1):
      _check_same_sharded_rounds(name, 'none', stage)


@pytest.mark.parametrize('name,stage', FAMILIES)
@pytest.mark.parametrize('dp', ['none', 'gaussian_fixed'])
def test_one_algorithm_per_family_runs_as_process_next(name, stage, dp):
  _check_same_rounds(name, dp, stage)


@_EVERY_ONLY
@pytest.mark.parametrize('name', COVERED)
def test_every_covered_algorithm_every_stage_runs_as_process_next(name):
  for stage, _ in enumerate(_stages(name, 'none')):
    _check_same_rounds(name, 'none', stage)


def test_the_families_are_the_registrys():
  assert sorted(registry.spec(n).family for n, _ in FAMILIES) == sorted(
      {spec.family for spec in registry.SPECS.values()})
  assert all(not registry.spec(n).inprocess for n, _ in FAMILIES)


def _fresh(name='global'):
  """A new in-process round of `name`'s process (its counts at zero)."""
  proc, _ = _round(name, 'none', 0)
  return proc, inprocess.build(proc)


def test_each_piece_runs_as_often_as_the_round_needs():
  """Per round of three clients split 1 + 2 between two accumulators:
  `prepare`, `report`, the modulus and `update` once, each device program
  and `accumulate` once per client, `zero` once per accumulator, `merge`
  once; `initialize` once per call."""
  proc, in_process = _fresh()
  clients = fedembed_testdata.initial_states(proc, len(SIZES), seed=4)
  state = in_process.initialize()
  for r in range(2):
    state, clients, _ = in_process.next(
        state, clients, conformance._datasets(SIZES, r), merge_after=1)  # pylint: disable=protected-access
  once = dict(prepare=1, report=1, merge=1, secure_modular_sum_modulus=1,
              update=1, device=len(SIZES), accumulate=len(SIZES), zero=2)
  assert {k: p.calls for k, p in in_process.pieces.items()} == dict(
      {k: 2 * v for k, v in once.items()}, initialize=1)


def test_a_skipped_piece_shows_as_another_round():
  """The comparison sees a round that loses one client's accumulation: the
  count and the equivalence above can fail."""
  proc, in_process = _fresh()
  accumulate = in_process.pieces['accumulate']
  seen = []

  def skipping(accumulator, upload):
    seen.append(1)
    return accumulator if len(seen) == 2 else accumulate(accumulator, upload)

  in_process.pieces['accumulate'] = skipping
  clients = fedembed_testdata.initial_states(proc, len(SIZES), seed=4)
  data = conformance._datasets(SIZES, 0)  # pylint: disable=protected-access
  got, _, _ = in_process.next(in_process.initialize(), clients, data)
  want, _, _ = proc.next(proc.initialize(), clients, data)
  with pytest.raises(AssertionError):
    _check_close(got, want, proc.next.type_signature.result[0], 'skipped')


def test_a_fused_round_without_an_accumulation_shows_as_another_round():
  """The one-graph round stamps what it is given: with `accumulate`
  replaced by one that drops the upload, its state is not the reference's
  (so the equivalence above can fail for the fused form too)."""
  proc = _sharded_stages('global', 'none')[0]
  in_process = sharded.ShardedProcess(
      proc, 2, aggregate_in=sharded.AGGREGATE_IN_PROCESS)
  round_ = in_process.inprocess_round
  mrf = round_.form.map_reduce_form()
  accumulate_type = mrf.accumulate.type_signature

  @tff.tensorflow.computation(*accumulate_type.parameter)
  def dropping(accumulator, upload):
    del upload
    if isinstance(accumulator, tff.structure.Struct):
      return tff.structure.map_structure(tf.identity, accumulator)
    return tf.nest.map_structure(tf.identity, accumulator)

  clients = fedembed_testdata.initial_states(proc, len(SIZES), seed=4)
  data = conformance._datasets(SIZES, 0)  # pylint: disable=protected-access
  want, _, _ = in_process.next(in_process.initialize(), clients, data)
  round_._fused[2] = inprocess._FusedRound(  # pylint: disable=protected-access
      types.SimpleNamespace(**{k: getattr(mrf, k) for k in (
          'prepare', 'zero', 'report', 'update',
          'secure_modular_sum_modulus')}, accumulate=dropping),
      round_._device, 2)  # pylint: disable=protected-access
  got, _, _ = in_process.next(in_process.initialize(), clients, data)
  result = round_.process.next.type_signature.result
  with pytest.raises(AssertionError):
    _check_close(got, want, result[0], 'dropped')


def test_it_executes_nothing_on_tffs_runtime():
  """Built and run under a context that refuses every TFF execution (no
  worker is asked for): compiling traces only."""
  proc = conformance._build('global')  # pylint: disable=protected-access
  clients = fedembed_testdata.initial_states(proc, len(SIZES), seed=4)
  data = conformance._datasets(SIZES, 0)  # pylint: disable=protected-access
  with context_stack_impl.context_stack.install(
      runtime_error_context.RuntimeErrorContext()):
    with pytest.raises(Exception):  # The guard holds: TFF cannot run here.
      proc.initialize()
    for in_process in (inprocess.build(proc), sharded.ShardedProcess(
        proc, 2, aggregate_in=sharded.AGGREGATE_IN_PROCESS)):
      state, new_clients, metrics = in_process.next(
          in_process.initialize(), clients, data)
      assert int(metrics['train']['clients']) == len(SIZES)
      assert len(new_clients) == len(SIZES)


def test_states_of_either_round_feed_the_other():
  """A round of each kind after a round of the other equals two rounds of
  `process.next`: the containers are TFF's."""
  proc, in_process = _round('global', 'none', 0)
  result = proc.next.type_signature.result
  clients = fedembed_testdata.initial_states(proc, len(SIZES), seed=4)
  data = [conformance._datasets(SIZES, r) for r in range(2)]  # pylint: disable=protected-access
  want = proc.next(*proc.next(proc.initialize(), clients, data[0])[:2],
                   data[1])
  mixed = in_process.next(
      *proc.next(in_process.initialize(), clients, data[0])[:2], data[1])
  other = proc.next(
      *in_process.next(proc.initialize(), clients, data[0])[:2], data[1])
  for got in (mixed, other):
    assert type(got[0]) is type(want[0])  # pylint: disable=unidiomatic-typecheck
    _check_close(got[0], want[0], result[0], 'server state')
    for u, (a, b) in enumerate(zip(got[1], want[1], strict=True)):
      _check_close(a, b, result[1], f'client {u}')
    _check_close(got[2], want[2], result[2], 'metrics')


@pytest.mark.parametrize('aggregator', ['secure_aggregator',
                                        'distributed_dgauss'])
def test_secure_sums_run_in_process(aggregator):
  """On the secure-sum path (TFF's secure aggregator; the distributed
  discrete Gaussian at noise multiplier 0, its devices rotating, clipping
  and rounding) the sums added up in process (`production._reduce`) give
  the rounds of the same process's `process.next` (TFF's runtime lowers
  its secure sums) to the quantization; the secure aggregator's, those of
  the plain weighted mean too (the distributed mechanism clips)."""
  if aggregator == 'secure_aggregator':
    factory = tff.learning.secure_aggregator(zeroing=False, clipping=False)
  else:
    factory = privacy.build_aggregator(privacy.DPConfig(
        mechanism=aggregator, noise_multiplier=0.0, clip_norm=1.0,
        clients_per_round=len(SIZES), population=100, rounds=2))
  secure = conformance._build(  # pylint: disable=protected-access
      'global', aggregator_factory=factory, train_metrics=False)
  in_process = inprocess.build(secure)
  assert tf.nest.flatten(
      in_process.form.map_reduce_form().secure_sum_bitwidth())
  plain, _ = _round('global', 'none', 0)
  clients = fedembed_testdata.initial_states(plain, len(SIZES), seed=4)
  got = _two_rounds('global', secure, in_process.next,
                    in_process.initialize(), list(clients))
  for want_proc in (secure, plain) if aggregator == 'secure_aggregator' else (
      secure,):
    want = _two_rounds('global', want_proc, want_proc.next,
                       want_proc.initialize(), list(clients))
    for x, y in zip(tf.nest.flatten(plain.get_model_weights(got[0])),
                    tf.nest.flatten(plain.get_model_weights(want[0])),
                    strict=True):
      np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-5)
  if aggregator != 'secure_aggregator':
    return  # Distributed DP runs one user per client, not sharded.
  # Sharded, the one-graph round adds the shards' summands up in its graph.
  fused = sharded.ShardedProcess(
      secure, 2, aggregate_in=sharded.AGGREGATE_IN_PROCESS)
  assert fused.inprocess_round.fuse
  got = _two_rounds('global', secure, fused.next, fused.initialize(),
                    list(clients))
  reference = sharded.ShardedProcess(secure, 2)
  want = _two_rounds('global', secure, reference.next,
                     reference.initialize(), list(clients))
  for x, y in zip(tf.nest.flatten(plain.get_model_weights(got[0])),
                  tf.nest.flatten(plain.get_model_weights(want[0])),
                  strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize('form', ['one_user_per_client', 'sharded'])
def test_dp_noise_is_updates_own_draw(form):
  """At noise multiplier 1 the compiled `update` draws fresh noise at every
  call, in process as under TFF (one user per client, or sharded with the
  round as one graph): two rounds from the same inputs differ by the
  difference of two draws, whose standard deviation is sqrt(2) times the
  noise's on the mean update (z * clip / clients; server SGD at 1)."""
  clip = 0.01
  if form == 'sharded':  # The library's aggregator, which shards read.
    factory = privacy.build_aggregator(privacy.DPConfig(
        mechanism='gaussian_fixed', noise_multiplier=1.0, clip_norm=clip,
        clients_per_round=len(SIZES), population=100, rounds=2))
  else:
    factory = tff.aggregators.DifferentiallyPrivateFactory.gaussian_fixed(
        noise_multiplier=1.0, clients_per_round=len(SIZES), clip=clip)
  proc = conformance._build('global', aggregator_factory=factory)  # pylint: disable=protected-access
  in_process = (inprocess.build(proc) if form != 'sharded' else
                sharded.ShardedProcess(
                    proc, 2, aggregate_in=sharded.AGGREGATE_IN_PROCESS))
  clients = fedembed_testdata.initial_states(proc, len(SIZES), seed=4)
  data = conformance._datasets(SIZES, 0)  # pylint: disable=protected-access
  state = in_process.initialize()

  def weights(s):
    return np.concatenate([np.ravel(w) for w in proc.get_model_weights(
        s).trainable])

  a, b = (weights(in_process.next(state, clients, data)[0])
          for _ in range(2))
  ratio = np.std(a - b) / (np.sqrt(2) * clip / len(SIZES))
  assert a.size >= 50 and 0.6 < ratio < 1.4, (a.size, ratio)


def test_bad_input_gets_one_line():
  proc, in_process = _round('global', 'none', 0)
  clients = fedembed_testdata.initial_states(proc, 2, seed=4)
  with pytest.raises(ValueError, match=r'^2 client states for 3 datasets$'):
    in_process.next(in_process.initialize(), clients,
                    conformance._datasets(SIZES, 0))  # pylint: disable=protected-access
  with pytest.raises(TypeError, match='tf.data.Dataset is expected'):
    in_process.next(in_process.initialize(), clients, [[1.0], [2.0]])


def _config(**kwargs):
  return experiment.ExperimentConfig(**{
      'algorithm': 'global', 'rounds': 2, 'clients_per_round': 3,
      'root_output_dir': '/nonexistent', 'experiment_name': 'x',
      'simulation_round': 'inprocess', **kwargs})


def test_the_option_is_refused_where_it_does_not_run(monkeypatch):
  """An algorithm the registry declares not covered, asked to run in
  process, or an unknown form, is refused in one line before any work;
  'auto' then runs it on TFF's runtime, and runs a covered algorithm in
  process only when sharded."""
  for ok in (_config(), _config(simulation_shards=2),
             _config(simulation_batched=True)):
    experiment.validate(ok, 10)
  with pytest.raises(experiment.ConfigurationError) as e:
    experiment.validate(_config(simulation_round='fast'), 10)
  assert str(e.value) == ("simulation_round must be one of ('auto', "
                          "'inprocess', 'tff'), got 'fast'")
  auto = _config(simulation_round='auto')
  assert experiment.round_in_process(auto, 2)
  assert not experiment.round_in_process(auto, 0)
  assert not experiment.round_in_process(
      _config(simulation_round='tff'), 2)
  monkeypatch.setitem(registry.SPECS, 'global', dataclasses.replace(
      registry.SPECS['global'], inprocess='a reason'))
  with pytest.raises(experiment.ConfigurationError) as e:
    experiment.validate(_config(), 10)
  assert str(e.value) == ('simulation_round=inprocess: global has no '
                          'in-process round: a reason')
  experiment.validate(auto, 10)
  assert not experiment.round_in_process(auto, 2)


def test_the_option_is_not_part_of_a_runs_identity():
  """A run keeps its digest whichever form ran its rounds (a simulation
  setting, as `simulation_shards` is), and a record of the retired
  `simulation_inprocess` field, or of none, has the same digest; 'auto'
  is the default."""
  record = {'config': dataclasses.asdict(_config(simulation_round='tff')),
            'task': {'name': 'synthetic', 'arguments': {}}}
  with_it = {**record, 'config': {**record['config'],
                                  'simulation_round': 'inprocess'}}
  before = {**record, 'config': {k: v for k, v in record['config'].items()
                                 if k != 'simulation_round'}}
  retired = {**before, 'config': {**before['config'],
                                  'simulation_inprocess': False}}
  assert (runs.digest(with_it) == runs.digest(record) ==
          runs.digest(before) == runs.digest(retired))
  fields = {f.name for f in dataclasses.fields(experiment.ExperimentConfig)
            if f.default is dataclasses.MISSING}
  assert experiment.ExperimentConfig(**{
      k: v for k, v in dataclasses.asdict(_config()).items()
      if k in fields}).simulation_round == 'auto'


def test_a_dataset_with_python_state_runs_the_eager_form_alike():
  """A dataset that cannot be serialized into a session's feed (it holds
  Python state: `from_generator`) runs through the eager import of the
  same computation, with the same result as the serializable dataset."""
  proc, in_process = _round('global', 'none', 0)
  clients = fedembed_testdata.initial_states(proc, len(SIZES), seed=4)
  data = _data_fn('global', proc)(SIZES, 0)

  def generated(dataset):
    return tf.data.Dataset.from_generator(
        lambda: dataset.as_numpy_iterator(),
        output_signature=dataset.element_spec)

  state = in_process.initialize()
  result = proc.next.type_signature.result
  want = in_process.next(state, list(clients), data)
  got = in_process.next(state, list(clients), [generated(d) for d in data])
  _check_close(got[0], want[0], result[0], 'server state')
  for u, (a, b) in enumerate(zip(got[1], want[1], strict=True)):
    _check_close(a, b, result[1], f'client {u}')


def _run(tmp_path, name, task, **kwargs):
  config = experiment.ExperimentConfig(**{
      'algorithm': 'global', 'rounds': 2, 'clients_per_round': 5,
      'simulation_shards': 2, 'eval_clients': 6, 'checkpoint_every': 1,
      'seed': 3, 'root_output_dir': str(tmp_path), 'experiment_name': name,
      'dp': privacy.DPConfig(mechanism='gaussian_fixed',
                             noise_multiplier=0.0, clip_norm=0.05),
      **kwargs})
  return runs.run_experiment(task, config, log_fn=lambda s: None)


def _final_weights(run):
  return [np.asarray(w) for w in tf.nest.flatten(run.weights())]


def test_a_sharded_run_needs_no_tff_runtime_and_resumes_either_way(
    tmp_path):
  """A sharded DP run (clipping on, noise multiplier 0) trains and
  evaluates under a context that refuses every TFF execution, on the SQLite
  store, and ends where the same run on TFF's runtime (memory store) ends:
  the same global weights to float rounding and the same evaluation. Killed
  after round 1 (its checkpoint kept) and resumed on the other form, it
  ends there too."""
  from tasks import registry as task_registry  # pylint: disable=g-import-not-at-top
  task = task_registry.build_task('synthetic', num_users=40, seed=4)
  with context_stack_impl.context_stack.install(
      runtime_error_context.RuntimeErrorContext()):
    in_process = _run(tmp_path, 'inprocess', task,
                      client_state_backend='sqlite')
  with runtime.local_runtime():
    on_tff = _run(tmp_path, 'tff', task, simulation_round='tff',
                  client_state_backend='memory')
    first = _run(tmp_path, 'resumed', task, rounds=1,
                 simulation_round='tff', client_state_backend='sqlite')
    del first
    resumed = _run(tmp_path, 'resumed', task, resume=True,
                   simulation_round='inprocess',
                   client_state_backend='sqlite')
  assert in_process['rounds_completed'] == resumed['rounds_completed'] == 2
  for run in (in_process, resumed):
    for x, y in zip(_final_weights(run), _final_weights(on_tff),
                    strict=True):
      np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
    assert run['eval']['accuracy'] == pytest.approx(
        on_tff['eval']['accuracy'], abs=1e-6)
  # Round 2 moved the weights: the comparison is not of two no-ops.
  assert not all(np.allclose(x, y) for x, y in zip(
      _final_weights(on_tff), tf.nest.flatten(on_tff.weights(round=1))))
