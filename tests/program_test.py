"""TFF's program APIs over the production forms.

* `learning_process`: a production form as a `tff.learning.templates.
  LearningProcess` (TFF's own type checks accept it), for two families
  (Ditto, FedEmbed-Prototype): its `next` gives `process.next`'s server
  state and training metrics exactly, its `get_model_weights` and
  `set_model_weights` computations are the process's methods; the packed
  form (client state inside the client's sequence) gives the same round.
* TFF 0.87's `NativeFederatedContext` refuses `{<C, D*>}@CLIENTS` (if TFF
  lifts it, docs/production.md's reproduction must change) and runs the
  packed form; `tff.learning.programs.train_model` trains it there.
* `program.train`: killed after round 2 (the store saved, no checkpoint;
  or checkpointed, the store not committed) and started again, it resumes
  from its program-state manager and ends with the uninterrupted program's
  server state, every client's state and metrics, bit for bit; so does
  one SIGKILLed in its own process after round 2's checkpoint
  (`TFF_PERSONAL_FAULT`).
"""

import collections
import csv
import os
import pathlib
import random
import signal
import subprocess
import sys
import types

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tests import conformance_test as conformance
from tests import fedembed_testdata
from tff_personal.algorithms import registry
from tff_personal.core import client_state
from tff_personal.core import coroutines
from tff_personal.core import fault
from tff_personal.core import learning_process as lp_lib
from tff_personal.core import production
from tff_personal.core import program_state
from tff_personal.run import program

_SIZES = [4, 7, 5]


def _flat(value):
  return fedembed_testdata.flat(value)


def _equal(got, want, what):
  got, want = _flat(got), _flat(want)
  assert len(got) == len(want), what
  for i, (a, b) in enumerate(zip(got, want)):
    np.testing.assert_array_equal(a, b, err_msg=f'{what}: leaf {i}')


@pytest.fixture(scope='module')
def forms():
  return {name: production.production_form(conformance._build(name))  # pylint: disable=protected-access
          for name in ('ditto', 'fedembed_prototype')}


@pytest.mark.parametrize('name', ['ditto', 'fedembed_prototype'])
def test_learning_process_is_the_process(forms, name):
  form = forms[name]
  proc = form.process
  lp = lp_lib.learning_process(form)
  packed = lp_lib.packed_learning_process(form)
  assert isinstance(lp, tff.learning.templates.LearningProcess)
  assert isinstance(packed, tff.learning.templates.LearningProcess)
  clients = fedembed_testdata.initial_states(proc, len(_SIZES), seed=4)
  data = conformance._datasets(_SIZES, 0)  # pylint: disable=protected-access
  want_state, _, want_metrics = proc.next(proc.initialize(), clients, data)
  out = lp.next(lp.initialize(), [
      {'client_state': c, 'data': d} for c, d in zip(clients, data)])
  assert isinstance(out, tff.learning.templates.LearningProcessOutput)
  _equal(out.state, want_state, f'{name} server state')
  # TFF's learning layout: the training metrics under client_work/train.
  assert list(out.metrics['client_work']) == ['train']
  _equal(out.metrics['client_work']['train'], want_metrics['train'],
         f'{name} train metrics')
  _equal(out.metrics['finalizer'], want_metrics['finalizer'], 'finalizer')
  packed_out = packed.next(packed.initialize(), [
      lp_lib.pack_client_data(c, d) for c, d in zip(clients, data)])
  _equal(packed_out.state, want_state, f'{name} packed server state')
  _equal(packed_out.metrics, out.metrics, f'{name} packed metrics')
  # The accessors are computations, equal to the process's methods.
  assert isinstance(lp.get_model_weights, tff.Computation)
  assert isinstance(lp.set_model_weights, tff.Computation)
  weights = lp.get_model_weights(out.state)
  _equal(weights, proc.get_model_weights(want_state), 'get_model_weights')
  initial = lp.initialize()
  moved = lp.set_model_weights(initial, weights)
  _equal(lp.get_model_weights(moved), weights, 'set then get')
  _equal(moved.finalizer, initial.finalizer, 'set keeps the rest')
  assert not all(np.array_equal(a, b) for a, b in zip(
      _flat(weights), _flat(lp.get_model_weights(initial))))
  # A round from the set state is the process's from its own set state.
  data = conformance._datasets(_SIZES, 1)  # pylint: disable=protected-access
  want, _, _ = proc.next(proc.set_model_weights(proc.initialize(), weights),
                         clients, data)
  got = lp.next(moved, [{'client_state': c, 'data': d}
                        for c, d in zip(clients, data)])
  _equal(got.state, want, f'{name} round after set_model_weights')


def test_a_staged_algorithm_has_one_learning_process_per_stage():
  """GroupPerFL (its FL stage, then its per-group stage): one learning
  process per stage, in order, each taking its own stage's client state
  with the data."""
  grouped = types.SimpleNamespace(**vars(conformance._TASK),  # pylint: disable=protected-access
                                  groups=lambda ids: [i % 2 for i in ids])
  built = registry.build_for_task(
      'groupperfl', grouped, seed=2,
      client_optimizer=tff.learning.optimizers.build_sgdm(0.1),
      server_optimizer=tff.learning.optimizers.build_sgdm(1.0))
  got = lp_lib.learning_processes(built)
  assert [name for name, _ in got] == [s.name for s in built.stages]
  assert len(got) == 2
  for (_, lp), stage in zip(got, built.stages):
    assert isinstance(lp, tff.learning.templates.LearningProcess)
    clients = lp.next.type_signature.parameter[1].member
    assert clients.client_state.is_equivalent_to(
        stage.process.client_state_type)
    assert lp.initialize.type_signature.result.member.is_equivalent_to(
        stage.process.state_type.member)


def test_native_context_refuses_struct_client_data_and_runs_packed(forms,
                                                                   tff_runtime,
                                                                   tmp_path):
  """The TFF limit docs/production.md reproduces, and its workaround:
  `train_model` trains the packed learning process in TFF's program
  context (two rounds of every client equal two rounds of `next`; the
  clients' order is TFF's random draw, so to float32 summation order)."""
  form = forms['ditto']
  proc = form.process
  lp = lp_lib.learning_process(form)
  packed = lp_lib.packed_learning_process(form)
  clients = fedembed_testdata.initial_states(proc, len(_SIZES), seed=4)
  data = conformance._datasets(_SIZES, 0)  # pylint: disable=protected-access
  context = program.native_federated_context(tff_runtime)
  with tff.framework.get_context_stack().install(context):

    async def struct_round():
      return await tff.program.materialize_value(lp.next(
          await tff.program.materialize_value(lp.initialize()),
          [{'client_state': c, 'data': d} for c, d in zip(clients, data)]))

    with pytest.raises(Exception, match='non-all-equal value with placement '
                       'CLIENTS to be a `list`'):
      coroutines.run_sync(struct_round())
    source = lp_lib.PackedClientDataSource(
        form, [(c, _examples(i)) for i, c in enumerate(clients)],
        batch_size=3)
    metrics = tff.program.MemoryReleaseManager()
    manager = tff.program.FileProgramStateManager(str(tmp_path))
    random.seed(0)
    coroutines.run_sync(tff.learning.programs.train_model(
        train_process=packed, train_data_source=source,
        train_per_round_clients=len(_SIZES), train_total_rounds=2,
        program_state_manager=manager,
        model_output_manager=tff.program.MemoryReleaseManager(),
        train_metrics_manager=metrics, evaluation_manager=None,
        evaluation_periodicity=1))
  released = metrics.values()
  assert sorted(released) == [1, 2]
  state = packed.initialize()
  for _ in range(2):
    out = packed.next(state, [lp_lib.pack_client_data(c, _client_data(i))
                              for i, c in enumerate(clients)])
    state = out.state
  assert coroutines.run_sync(manager.get_versions()) == [0, 1, 2]
  # TFF's release moves client_work/train to model_metrics.
  assert released[2]['model_metrics']['num_examples'] == sum(
      len(_examples(i)['y']) for i in range(len(clients)))
  got = _flat(packed.get_model_weights(state))
  # The iterator is stored in the program state: it reads back equal.
  iterator = source.iterator()
  again = type(iterator).from_bytes(iterator.to_bytes())
  assert again == iterator and again.federated_type.is_equivalent_to(
      iterator.federated_type)
  # The saved program state's server state is train_model's last one.
  saved, _ = coroutines.run_sync(manager.load_latest(
      tff.learning.programs.ProgramState(
          packed.initialize(), 0, 0, source.iterator())))
  for a, b in zip(_flat(packed.get_model_weights(saved.state)), got):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# The training program: five users, three a round, four rounds.
_POPULATION, _COHORT, _ROUNDS = 5, 3, 4


def _examples(cid):
  rng = np.random.default_rng([cid, 11])
  n = 3 + cid
  y = (np.arange(n) % 2).astype(np.int32)
  return collections.OrderedDict(
      x=rng.random((n, 28, 28, 1), dtype=np.float32), y=y,
      type=(y + cid % 3).astype(np.int32) % 3)


def _client_data(cid):
  return tf.data.Dataset.from_tensor_slices(_examples(cid)).batch(3)


def _run_program(form, directory):
  proc = form.process
  template = tff.types.type_to_tf_tensor_specs(proc.client_state_type)
  initial = fedembed_testdata.initial_states(proc, 1, seed=7)[0]
  store = client_state.make_store(
      'sqlite', lambda cid: initial, population=_POPULATION,
      directory=str(directory / 'store'),
      template=template)
  try:
    state = program.run(
        form=form, client_data=_client_data, population=_POPULATION,
        clients_per_round=_COHORT, total_rounds=_ROUNDS, seed=3,
        store=store,
        state_manager=program_state.FileProgramStateManager(
            str(directory / 'checkpoints')),
        metrics_manager=tff.program.CSVFileReleaseManager(
            str(directory / 'metrics.csv'), key_fieldname='round'))
    return state, store.load(list(range(_POPULATION)))
  finally:
    store.close()


def _rows(path):
  with open(path) as f:
    return list(csv.DictReader(f))


@pytest.fixture(scope='module')
def uninterrupted(forms, tmp_path_factory):
  directory = tmp_path_factory.mktemp('uninterrupted')
  state, clients = _run_program(forms['ditto'], directory)
  return state, clients, _rows(directory / 'metrics.csv')


@pytest.mark.parametrize('point,resumed_rounds', [('mid_round', 3),
                                                  ('after_checkpoint', 2)])
def test_killed_program_resumes_to_the_uninterrupted_run(
    forms, uninterrupted, tmp_path, monkeypatch, point, resumed_rounds):
  form = forms['ditto']
  monkeypatch.setattr(fault, '_actions', {})
  monkeypatch.setattr(fault, '_hits', collections.Counter())

  class Killed(Exception):
    pass

  def kill():
    raise Killed(point)

  fault.on(point, 2, kill)  # In round 2.
  with pytest.raises(Killed):
    _run_program(form, tmp_path)
  versions = coroutines.run_sync(program_state.FileProgramStateManager(
      str(tmp_path / 'checkpoints')).get_versions())
  assert versions[-1] == (1 if point == 'mid_round' else 2), versions
  # Started again: it resumes (runs only the rounds after the newest
  # version, each sampled device's program once) and ends where the
  # uninterrupted program ends.
  calls = collections.Counter()
  real = production.ProductionForm._run_devices  # pylint: disable=protected-access

  def counted(self, *args):
    calls['rounds'] += 1
    return real(self, *args)

  monkeypatch.setattr(production.ProductionForm, '_run_devices', counted)
  monkeypatch.setattr(fault, '_actions', {})
  state, clients = _run_program(form, tmp_path)
  assert calls['rounds'] == resumed_rounds
  want_state, want_clients, want_rows = uninterrupted
  _equal(state, want_state, 'server state')
  _equal(clients, want_clients, 'client states')
  assert _rows(tmp_path / 'metrics.csv') == want_rows
  assert [int(r['round']) for r in want_rows] == list(range(1, _ROUNDS + 1))
  # The clients trained: their states are not the initial ones.
  initial = fedembed_testdata.initial_states(form.process, 1, seed=7)[0]
  assert any(not np.array_equal(a, b) for c in clients
             for a, b in zip(_flat(c), _flat(initial)))


def test_sigkilled_program_resumes_to_the_uninterrupted_run(
    forms, uninterrupted, tmp_path):
  """A real kill: the program in its own process is SIGKILLed after round
  2's checkpoint, before the store commits (`TFF_PERSONAL_FAULT`); started
  again (here), it ends with the uninterrupted program's server state,
  client states and metrics, bit for bit."""
  env = dict(os.environ, TFF_PERSONAL_FAULT='after_checkpoint:2')
  done = subprocess.run(
      [sys.executable, '-m', 'tests.program_test', str(tmp_path)],
      cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
      env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
      timeout=600, check=False)
  assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
  versions = coroutines.run_sync(program_state.FileProgramStateManager(
      str(tmp_path / 'checkpoints')).get_versions())
  assert versions[-1] == 2, versions
  state, clients = _run_program(forms['ditto'], tmp_path)
  want_state, want_clients, want_rows = uninterrupted
  _equal(state, want_state, 'server state')
  _equal(clients, want_clients, 'client states')
  assert _rows(tmp_path / 'metrics.csv') == want_rows


if __name__ == '__main__':
  # The killed program of the test above: `python -m tests.program_test
  # <directory>`.
  from tff_personal.core import runtime  # pylint: disable=g-import-not-at-top
  with runtime.local_runtime():
    _run_program(production.production_form(conformance._build('ditto')),  # pylint: disable=protected-access
                 pathlib.Path(sys.argv[1]))
