"""Production forms over the registry (`core/production.py`).

Every registered algorithm, each stage of a staged one, is compiled by
TFF's `tff.backends.mapreduce` to `MapReduceForm` and
`DistributeAggregateForm` with `gaussian_fixed`, or fails with the reason
`production.NOT_COMPILED` names: none is skipped silently. Without DP, the
federated part that differs is the weighted mean of `core/process.py`, the
same wiring for every algorithm but those with statistics of their own
(`STATISTICS`): it is compiled for those, and for one algorithm of each
family, whose compiled `MapReduceForm` is run piece by piece over a cohort
(prepare, work, zero/accumulate/merge, report, the secure sums, update),
with the device part writing each client's new state, and equals two
simulated rounds. The tiny models are the conformance suite's
(`tests/conformance_test.py`).
"""

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


def _built(name, dp):
  overrides = {} if dp == 'none' else {'aggregator_factory': _DP}
  if name == 'feddva':  # Small encoders: compilation reads every graph.
    overrides.update(pretrain_rounds=2, dim=2, channels='2,2,2,3', hidden=5)
  if 'groups' in registry.spec(name).needs:
    return registry.build_for_task(
        name, _GROUPED, seed=2,
        client_optimizer=tff.learning.optimizers.build_sgdm(0.1),
        server_optimizer=tff.learning.optimizers.build_sgdm(1.0),
        **overrides)
  return conformance._build(name, **overrides)  # pylint: disable=protected-access


# One per family: the split model, FedEmbed, FedPerC, a FedDVA stage and a
# group stage (the per-group FedAvg of groupperfl).
FAMILIES = [('ditto', 0), ('fedembed_prototype', 0), ('fedperc', 0),
            ('feddva', 0), ('groupperfl', 1)]
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


@pytest.mark.parametrize('name,stage', FAMILIES)
def test_hand_run_map_reduce_form_equals_the_simulated_rounds(name, stage):
  """Two rounds of the compiled form run by hand, two cohorts of three
  users with different example counts, equal two rounds of `process.next`
  (the server weights and every client's new state; float32 summation
  order differs, so to 1e-5). Each stage compiles without DP."""
  forms = production.production_forms(_built(name, 'none'))
  for s, f in forms:
    _compiles(name, 'none', s, f)
  _, form = forms[stage]
  proc = form.process
  sizes = [4, 7, 5]
  typed = hasattr(proc.client_data_type.element, 'type')
  data_fn = (fedperc_testdata.datasets if conformance._is_fedperc(name)  # pylint: disable=protected-access
             else lambda s, r: conformance._datasets(s, r, typed))  # pylint: disable=protected-access
  clients = fedembed_testdata.initial_states(proc, len(sizes), seed=4)
  sim_state, sim_clients = proc.initialize(), list(clients)
  hand_state, hand_clients = form.initialize(), list(clients)
  for r in range(2):
    data = data_fn(sizes, r)
    sim_state, sim_clients, _ = proc.next(sim_state, sim_clients, data)
    hand_state, _, hand_clients = form.run_map_reduce_round(
        hand_state, hand_clients, data, merge_after=1)
  _states_close(form.broadcast_weights(hand_state),
                form.broadcast_weights(sim_state), f'{name} server weights')
  for u, (got, want) in enumerate(zip(hand_clients, sim_clients)):
    _states_close(got, want, f'{name} client {u}')
  moved = [not np.allclose(np.asarray(x), np.asarray(y)) for x, y in zip(
      tf.nest.flatten(form.broadcast_weights(sim_state)),
      tf.nest.flatten(form.broadcast_weights(form.initialize())))]
  assert any(moved), f'{name}: the rounds changed nothing'


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
