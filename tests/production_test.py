"""Production forms over the registry (`core/production.py`).

Every registered algorithm, each stage of a staged one, is compiled by
TFF's `tff.backends.mapreduce` to `MapReduceForm` and
`DistributeAggregateForm` with `gaussian_fixed`, or fails with the reason
`production.NOT_COMPILED` names: none is skipped silently. Without DP, the
federated part that differs is the weighted mean of `core/process.py`, the
same wiring for every algorithm but those with statistics of their own
(`STATISTICS`): it is compiled for those, and for one algorithm of each
family, whose compiled forms are run piece by piece over a cohort (each
client's device program once per round: its upload and its new state)
and equal two simulated rounds. Under DP the device program's upload is
`MapReduceForm.work`'s output, clipped, with no metric beside it. The tiny
models are the conformance suite's (`tests/conformance_test.py`).
"""

import collections
import types

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tests import conformance_test as conformance
from tests import fedembed_testdata
from tests import fedperc_testdata
from tff_personal.algorithms import registry
from tff_personal.core import privacy
from tff_personal.core import production

_DP = privacy.build_aggregator(privacy.DPConfig(
    mechanism='gaussian_fixed', noise_multiplier=1.0, clip_norm=1.0,
    clients_per_round=3, population=100, rounds=2))
COMPILED = []  # (name, dp, stage) that compiled, for the count below.


# The conformance suite's task with two groups, for the group algorithms.
_GROUPED = types.SimpleNamespace(**vars(conformance._TASK),  # pylint: disable=protected-access
                                 groups=lambda ids: [i % 2 for i in ids])


def _built(name, dp, aggregator=None):
  """`name` built on the tiny task; under DP with `aggregator` (default
  `_DP`)."""
  overrides = {} if dp == 'none' else {
      'aggregator_factory': aggregator or _DP}
  if name == 'feddva':  # Small encoders: compilation reads every graph.
    overrides.update(pretrain_rounds=2, dim=2, channels='2,2,2,3', hidden=5)
  if 'groups' in registry.spec(name).needs:
    return registry.build_for_task(
        name, _GROUPED, seed=2,
        client_optimizer=tff.learning.optimizers.build_sgdm(0.1),
        server_optimizer=tff.learning.optimizers.build_sgdm(1.0),
        **overrides)
  return conformance._build(name, **overrides)  # pylint: disable=protected-access


# One per family of the registry (`AlgorithmSpec.family`): fedavg, furl,
# baselines, fedembed, fedperc, feddva (a stage) and group (the per-group
# FedAvg stage of groupperfl).
FAMILIES = [('global', 0), ('furl', 0), ('ditto', 0),
            ('fedembed_prototype', 0), ('fedperc', 0), ('feddva', 0),
            ('groupperfl', 1)]
# Algorithms whose rounds aggregate statistics of their own
# (`core/statistics_process.py`), beside the update's aggregator.
STATISTICS = ('fedembed_som', 'pfedkm')


def _compiles(name, dp, stage, form):
  """Compiles `form` to both production forms (or, for a pair in
  `NOT_COMPILED`, holds it to MapReduceForm only)."""
  if (name, dp) in production.NOT_COMPILED:
    form.map_reduce_form()
    with pytest.raises(production.NotProductionReadyError,
                       match='does not compile to DistributeAggregateForm'):
      form.distribute_aggregate_form()
    return
  mrf = form.map_reduce_form()
  form.distribute_aggregate_form()
  # The device takes its client state with its data; nothing client-placed
  # leaves the round.
  assert mrf.work.type_signature.parameter[0].client_state.is_equivalent_to(
      form.process.client_state_type)
  assert all(t.placement.is_server() for t in form.next.type_signature.result)
  COMPILED.append((name, dp, stage))


@pytest.mark.parametrize('name,dp', [(n, 'gaussian_fixed')
                                     for n in sorted(registry.SPECS)] +
                         [(n, 'none') for n in STATISTICS])
def test_every_algorithm_compiles_to_production_forms(name, dp):
  for stage, form in production.production_forms(_built(name, dp)):
    _compiles(name, dp, stage, form)


def _states_close(got, want, what):
  for i, (x, y) in enumerate(zip(tf.nest.flatten(got), tf.nest.flatten(want),
                                 strict=True)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5,
                               atol=1e-6, err_msg=f'{what}: leaf {i}')


def _counting_device_programs(monkeypatch):
  """Counts the calls of every device program, by form."""
  calls = collections.Counter()
  real = production.ProductionForm.device_program

  def counted(self, form='map_reduce'):
    program = real(self, form)

    def call(*args):
      calls[form] += 1
      return program(*args)

    return call

  monkeypatch.setattr(production.ProductionForm, 'device_program', counted)
  return calls


class _WorkRefused:
  """Stands for `MapReduceForm.work` where the round must not run it."""

  def __call__(self, *args):
    raise AssertionError('the hand-run round ran MapReduceForm.work: the '
                         'device program must give the upload')


@pytest.mark.parametrize('name,stage', FAMILIES)
def test_hand_run_forms_run_each_device_once_and_equal_the_rounds(
    name, stage, monkeypatch):
  """Two rounds of the compiled forms run by hand (MapReduceForm and
  DistributeAggregateForm), two cohorts of three users with different
  example counts, equal two rounds of `process.next` (the server weights
  and every client's new state; float32 summation order differs, so to
  1e-5). Each client's device program runs exactly once per round and
  gives both its upload and its new state: `work` is never run. Each stage
  compiles without DP."""
  forms = production.production_forms(_built(name, 'none'))
  for s, f in forms:
    _compiles(name, 'none', s, f)
  _, form = forms[stage]
  proc = form.process
  form.device_program()  # Read from `work` before `work` is refused.
  mrf = form.map_reduce_form()
  monkeypatch.setattr(mrf, '_work', _WorkRefused())
  calls = _counting_device_programs(monkeypatch)
  sizes = [4, 7, 5]
  typed = hasattr(proc.client_data_type.element, 'type')
  data_fn = (fedperc_testdata.datasets if conformance._is_fedperc(name)  # pylint: disable=protected-access
             else lambda s, r: conformance._datasets(s, r, typed))  # pylint: disable=protected-access
  clients = fedembed_testdata.initial_states(proc, len(sizes), seed=4)
  sim_state, sim_clients = proc.initialize(), list(clients)
  hand_state, hand_clients = form.initialize(), list(clients)
  daf_state, daf_clients = form.initialize(), list(clients)
  for r in range(2):
    data = data_fn(sizes, r)
    sim_state, sim_clients, _ = proc.next(sim_state, sim_clients, data)
    hand_state, _, hand_clients = form.run_map_reduce_round(
        hand_state, hand_clients, data, merge_after=1)
    daf_state, _, daf_clients = form.run_distribute_aggregate_round(
        daf_state, daf_clients, data)
    assert calls == {'map_reduce': 3 * (r + 1),
                     'distribute_aggregate': 3 * (r + 1)}, calls
  for what, state, new_clients in (('MapReduceForm', hand_state,
                                    hand_clients),
                                   ('DistributeAggregateForm', daf_state,
                                    daf_clients)):
    _states_close(form.broadcast_weights(state),
                  form.broadcast_weights(sim_state),
                  f'{name} {what} server weights')
    for u, (got, want) in enumerate(zip(new_clients, sim_clients,
                                        strict=True)):
      _states_close(got, want, f'{name} {what} client {u}')
  moved = [not np.allclose(np.asarray(x), np.asarray(y)) for x, y in zip(
      tf.nest.flatten(form.broadcast_weights(sim_state)),
      tf.nest.flatten(form.broadcast_weights(form.initialize())))]
  assert any(moved), f'{name}: the rounds changed nothing'
  changed = [not np.allclose(np.asarray(x), np.asarray(y)) for x, y in zip(
      fedembed_testdata.flat(sim_clients), fedembed_testdata.flat(clients))]
  assert any(changed), f'{name}: the clients\' states did not change'


def _leaves(value):
  return [np.asarray(v) for v in tff.structure.flatten(
      tff.structure.from_container(value, recursive=True))]


@pytest.mark.parametrize('name', ['ditto', 'fedembed_prototype'])
def test_under_dp_the_upload_is_works_clipped_output_and_nothing_else(name):
  """Under DP (train metrics not released), each device program's upload
  is exactly `MapReduceForm.work`'s output on the same inputs, is the
  clipped update alone (the update's leaves, global norm <= clip, where
  the unclipped update of the client step is longer), and its new client
  state is the client step's; a device program without the new state's
  nodes is refused."""
  clip = 0.01  # Well below the tiny models' update norms: every one clips.
  aggregator = tff.aggregators.DifferentiallyPrivateFactory.gaussian_fixed(
      noise_multiplier=1.0, clients_per_round=3, clip=clip)
  form = production.production_form(conformance._build(  # pylint: disable=protected-access
      name, aggregator_factory=aggregator, train_metrics=False))
  proc = form.process
  mrf = form.map_reduce_form()
  program = form.device_program()
  broadcast = mrf.prepare(form.initialize())
  weights = form.broadcast_weights(form.initialize())
  clients = fedembed_testdata.initial_states(proc, 3, seed=4)
  update_shapes = [tuple(s.shape) for s in tf.nest.flatten(
      tff.types.type_to_tf_tensor_specs(proc.aggregation_value_type))]
  for u, (client, data) in enumerate(zip(
      clients, conformance._datasets([4, 7, 5], 0), strict=True)):  # pylint: disable=protected-access
    inputs = {'client_state': client, 'data': data}
    out = program(inputs, broadcast)
    upload = _leaves(out['upload'])
    work = _leaves(mrf.work(inputs, broadcast))
    assert len(upload) == len(work), u
    for a, b in zip(upload, work):
      np.testing.assert_array_equal(a, b, err_msg=f'client {u}')
    assert [a.shape for a in upload] == update_shapes, (
        f'client {u}: the upload holds more than the clipped update')
    norm = np.sqrt(sum(np.sum(np.square(a, dtype=np.float64))
                       for a in upload))
    assert norm <= clip * (1 + 1e-6), (u, norm)
    step = form.client_work(weights, client, data)
    unclipped = np.sqrt(sum(np.sum(np.square(a, dtype=np.float64))
                            for a in _leaves(step['update'])))
    assert unclipped > 2 * clip, (u, unclipped)
    _states_close(out['client_state'], step['client_state'],
                  f'{name} client {u} new state')
  # A client computation without the named new state is refused.
  with pytest.raises(production.NotProductionReadyError,
                     match='new client state'):
    production._with_new_client_state(  # pylint: disable=protected-access
        mrf.prepare, proc.client_state_type)


def test_secure_aggregation_compiles_and_its_sums_give_the_mean():
  """With TFF's secure aggregator the update travels on MapReduceForm's
  secure-sum path (32-bit quantized); its sums, added up as a platform's
  secure aggregation would, give the plain weighted mean's rounds to the
  quantization (TFF's local runtime cannot run secure sums, so the
  reference is the simulation with the plain mean)."""
  secure = tff.learning.secure_aggregator(zeroing=False, clipping=False)
  form = production.production_form(conformance._build(  # pylint: disable=protected-access
      'ditto', aggregator_factory=secure))
  mrf = form.map_reduce_form()
  form.distribute_aggregate_form()
  assert tf.nest.flatten(mrf.secure_sum_bitwidth())  # The path is used.
  plain = conformance._build('ditto')  # pylint: disable=protected-access
  sizes = [4, 7, 5]
  clients = fedembed_testdata.initial_states(plain, len(sizes), seed=4)
  sim_state, sim_clients = plain.initialize(), list(clients)
  hand_state, hand_clients = form.initialize(), list(clients)
  for r in range(2):
    data = conformance._datasets(sizes, r)  # pylint: disable=protected-access
    sim_state, sim_clients, _ = plain.next(sim_state, sim_clients, data)
    hand_state, _, hand_clients = form.run_map_reduce_round(
        hand_state, hand_clients, data, merge_after=2)
  for x, y in zip(tf.nest.flatten(form.broadcast_weights(hand_state)),
                  tf.nest.flatten(plain.get_model_weights(sim_state)),
                  strict=True):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-5)
  _states_close(hand_clients, sim_clients, 'ditto clients')


def test_the_families_are_the_registrys():
  """`FAMILIES` names one algorithm of every family of the registry."""
  assert sorted(registry.spec(n).family for n, _ in FAMILIES) == sorted(
      {spec.family for spec in registry.SPECS.values()})


def test_the_count_that_compiles():
  """Runs after the compilation tests (file order): what compiled, and
  that every other pair the tests compile has its stated reason."""
  pairs = {(name, dp) for name, dp, _ in COMPILED}
  if not pairs:
    pytest.skip('run with the compilation tests')
  every = ({(n, 'gaussian_fixed') for n in registry.SPECS} |
           {(n, 'none') for n in STATISTICS} |
           {(n, 'none') for n, _ in FAMILIES})
  assert set(production.NOT_COMPILED) <= every
  assert pairs | set(production.NOT_COMPILED) == every
  assert not pairs & set(production.NOT_COMPILED)


@pytest.mark.parametrize('aggregator_name', ['secure_aggregator'] + list(
    privacy.DISTRIBUTED_MECHANISMS))
def test_secure_sum_sizes_are_the_compiled_forms(aggregator_name):
  """docs/production.md's secure-sum columns (`update_secure_sum_bits`,
  from the update's size alone) are what the compiled `work` puts on the
  secure-sum path, counted by `secure_sum_bits` (the update's tensors; the
  scalars beside them are a few dozen bits). Both distributed mechanisms
  have distributed_dgauss's layout (TFF's factory, the same bits)."""
  if aggregator_name == 'secure_aggregator':
    layout = 'secure_aggregator'
    aggregator = tff.learning.secure_aggregator(zeroing=False,
                                                clipping=False)
  else:
    layout = 'distributed_dgauss'
    aggregator = privacy.build_aggregator(privacy.DPConfig(
        mechanism=aggregator_name, noise_multiplier=1.0, clip_norm=1.0,
        clients_per_round=3, population=100, rounds=2))
  form = production.production_form(conformance._build(  # pylint: disable=protected-access
      'ditto', aggregator_factory=aggregator, train_metrics=False))
  coordinates = sum(int(np.prod(s.shape)) for s in tf.nest.flatten(
      tff.types.type_to_tf_tensor_specs(form.process.aggregation_value_type)))
  if layout == 'distributed_dgauss':
    coordinates = privacy.ddp_padded_dimension(coordinates)
  mrf = form.map_reduce_form()
  for clients in (3, 100, 1000):
    compiled = production.secure_sum_bits(mrf, clients, scalars=False)
    assert compiled == production.update_secure_sum_bits(
        coordinates, clients, layout), (clients, compiled)
    every = production.secure_sum_bits(mrf, clients)
    assert 0 < every['tff'] - compiled['tff'] <= 16 * 64, every
  # Nothing of the update travels outside the secure sums.
  assert not tf.nest.flatten(tff.types.type_to_tf_tensor_specs(
      mrf.work.type_signature.result[0]))
