"""`runs.Run`: a finished DP run reopened from its directory alone gives its
final weights and client states, and evaluating them again equals the run's
own final evaluation; an outside task named `package.module:factory` is
listed, trained and reopened like a registered one.

The FedDVA (staged) and group (per-group) families are reopened in
tests/stages_test.py and tests/group_stage_test.py, on their DP runs.
"""

import collections
import contextlib
import dataclasses
import io
import json
import os
import textwrap

from absl import flags
from absl.testing import flagsaver
import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff
from tensorflow_federated.python.core.impl.context_stack import context_stack_impl

from binaries import common
from binaries import train
from tasks import client_data_task
from tasks import registry as task_registry
from tasks import tv_shows_task
from tests import fedperc_testdata
from tests import tiny_client_data
from tff_personal.config import experiment
from tff_personal.config import matrix
from tff_personal.config import run_spec
from tff_personal.core import privacy
from tff_personal.core import runtime
from tff_personal.core import task as task_lib
from tff_personal.core import training_loop
from tff_personal.records import run_records
from tff_personal.run import runs

FLAGS = flags.FLAGS
_DP = privacy.DPConfig(mechanism='gaussian_fixed', noise_multiplier=1.0,
                       clip_norm=0.5)
_TINY_MNIST = dict(num_clients=6, train_per_client=12, test_per_client=6,
                   channels='2,2,2,2', hidden=8, batch_size=6)


def _assert_states_equal(got, want):
  for a, b in zip(tf.nest.flatten(got), tf.nest.flatten(want), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_split_model_dp_run_reopens_from_its_directory_alone(
    tmp_path, mnist_dir, monkeypatch):
  task = task_registry.build_task('label_skew_mnist', data_dir=mnist_dir,
                                  seed=0, **_TINY_MNIST)
  config = experiment.ExperimentConfig(
      algorithm='fedrep', rounds=2, clients_per_round=3,
      root_output_dir=str(tmp_path), experiment_name='fedrep_dp', dp=_DP,
      client_learning_rate=0.05, simulation_shards=0)
  checks = []  # The configuration is checked (and DP resolved) once a run.
  validate = experiment.validate
  monkeypatch.setattr(experiment, 'validate',
                      lambda *a: checks.append(a) or validate(*a))
  trained = runs.finished_or_trained(task, config, log_fn=lambda s: None)
  trained.client_states([0])
  assert len(checks) == 1, checks
  monkeypatch.undo()
  assert trained['rounds_completed'] == 2  # It reads as its summary.
  def no_training(line):
    raise AssertionError(f'a finished run trained again: {line}')
  reused = runs.finished_or_trained(task, config, log_fn=no_training)
  assert reused.digest == trained.digest and reused['eval'] == trained['eval']

  # A process of its own: the task is rebuilt from run_config.json.
  run = runs.Run.open(config.experiment_dir)
  assert run.finished and run.digest == trained.digest
  # The run as a typed spec, through JSON: it resolves to this run.
  spec = run_spec.RunSpec.from_dict(json.loads(json.dumps(
      run.spec.to_dict())))
  assert spec == run.spec and spec.task_options == _TINY_MNIST
  resolved = spec.resolve(task)
  assert runs.digest(run_records.run_record(
      resolved.config, resolved.dp, None,
      task_lib.build_record(task))) == run.digest
  assert spec.override({'loop.seed': 1}).config().seed == 1
  assert run.task.population == task.population
  assert run.privacy_report()['epsilon'] == pytest.approx(
      trained['privacy']['epsilon'])
  weights = run.weights()
  proc = run.process()
  state = training_loop.load_checkpoint(proc, config.experiment_dir, 2)
  _assert_states_equal(weights, proc.get_model_weights(state))
  states = run.client_states(range(task.population))
  initial = experiment.initial_client_state_fn(proc, config)
  trained_clients = [c for c in range(task.population)
                     if int(states[c]['rounds_participated'])]
  assert trained_clients
  assert run.participations() == {
      c: int(states[c]['rounds_participated']) for c in trained_clients}
  for c in trained_clients:  # Their private heads moved.
    assert not np.allclose(states[c]['private'][0],
                           initial(c)['private'][0])
  # The evaluation counts the clients never sampled (their heads are
  # random) and scores the trained ones apart.
  never = task.population - len(trained_clients)
  assert 0 < never and trained['eval']['never_trained_clients'] == never
  assert trained['eval']['trained/clients'] == len(trained_clients)
  assert trained['eval']['never_trained/clients'] == never
  again = run.evaluate()
  assert again['eval'] == trained['eval']
  assert again['privacy']['epsilon'] == pytest.approx(
      trained['privacy']['epsilon'])
  assert [r['round'] for r in run.curves()['eval']] == [2]
  with pytest.raises(runs.RunError, match='no checkpoint of round 7'):
    run.weights(round=7)
  # Extended by one round: the handle resumes it, and epsilon grows.
  longer = run.resume(rounds=3, log_fn=lambda s: None)
  assert longer['rounds_completed'] == 3
  assert longer['privacy']['epsilon'] > trained['privacy']['epsilon']


def test_fedperc_dp_run_reopens_and_evaluates_as_it_did(tmp_path):
  task = tv_shows_task.from_users(
      fedperc_testdata.spec(), fedperc_testdata.tv_show_users(),
      max_tokens=fedperc_testdata.MAX_TOKENS, local_steps=2, batch_size=3,
      generator_tokens=4, seed=0)
  config = experiment.ExperimentConfig(
      algorithm='fedperc', rounds=2, clients_per_round=2,
      root_output_dir=str(tmp_path), experiment_name='fedperc_dp', dp=_DP,
      client_learning_rate=0.05, eval_clients=4)
  trained = runs.run_experiment(task, config, log_fn=lambda s: None)
  # A task built directly is not in the record: the handle asks for it.
  with pytest.raises(runs.RunError, match='pass it'):
    runs.Run.open(config.experiment_dir).task  # pylint: disable=expression-not-assigned
  run = runs.Run.open(config.experiment_dir, task=task)
  states = run.client_states([0, 1])
  assert len(states) == 2 and 'private' in states[0]
  assert run.evaluate()['eval'] == trained['eval']
  assert run.privacy_report()['rounds_noised'] == 2


_OUTSIDE = '''
"""MNIST users of my own (a task defined outside the repository)."""
from tasks import client_data_task


def make(data_dir, seed=0, users=6):
  """Six MNIST users with label skew, defined outside the repository."""
  return client_data_task.label_skew_mnist_task(
      data_dir, num_clients=users, train_per_client=12, test_per_client=6,
      channels='2,2,2,2', hidden=8, batch_size=6, seed=seed)


make.capabilities = ('split_model', 'batches', 'named_head', 'digit_images')
'''


def test_outside_task_is_listed_trained_and_reopened(tmp_path, mnist_dir,
                                                     monkeypatch):
  package = tmp_path / 'mypkg'
  package.mkdir()
  (package / '__init__.py').write_text('')
  (package / 'mytask.py').write_text(textwrap.dedent(_OUTSIDE))
  monkeypatch.syspath_prepend(str(tmp_path))
  if not FLAGS.is_parsed():
    FLAGS(['train'])
  out = io.StringIO()
  with flagsaver.flagsaver(task='mypkg.mytask:make', list=True), \
      contextlib.redirect_stdout(out):
    assert train.main(['train']) == 0
  listing = out.getvalue()
  assert '| mypkg.mytask:make |' in listing.splitlines()[2]
  assert ('mypkg.mytask:make: Six MNIST users with label skew, defined '
          'outside the repository; capabilities: batches, digit_images, '
          'named_head, split_model; options: users (int, default 6)'
          ) in listing
  with flagsaver.flagsaver(task='mypkg.mytask:make', list=True,
                           algorithm='mypkg.mytask:nothing'):
    assert train.main(['train']) == 2  # Named in one line.
  values = dict(task='mypkg.mytask:make', algorithm='ditto',
                data_dir=mnist_dir, rounds=1, clients_per_round=2,
                task_options=['users=5'], root_output_dir=str(tmp_path),
                experiment_name='outside', simulation_shards=0)
  with flagsaver.flagsaver(**values):
    assert train.main(['train']) == 0
  run = runs.Run.open(str(tmp_path / 'outside'))
  assert run.task.population == 5
  # Built by name, it is recorded: its spec names it and its options.
  assert run.spec.task == 'mypkg.mytask:make'
  assert run.spec.task_options == {'users': 5}
  assert run.evaluate()['eval'] == run['eval']
  with flagsaver.flagsaver(**dict(values, task='mypkg.nosuch:make',
                                  experiment_name='x')):
    assert train.main(['train']) == 2


def test_a_process_is_built_once_for_what_it_depends_on(mnist_dir,
                                                         monkeypatch):
  """Runs of one task and algorithm that differ only in where, how long or
  how they are simulated, evaluated and stored share one built process
  (and what is traced from it); a field the process depends on, or an
  aggregator of the caller's, builds another."""
  def task():
    return task_registry.build_task('label_skew_mnist', data_dir=mnist_dir,
                                    seed=0, **_TINY_MNIST)
  config = experiment.ExperimentConfig(
      algorithm='fedrep', rounds=2, clients_per_round=3,
      root_output_dir='/here', experiment_name='a', client_learning_rate=0.05)
  built = experiment.build_process(task(), config)
  elsewhere = dataclasses.replace(
      config, experiment_name='b', root_output_dir='/elsewhere', rounds=5,
      resume=True, eval_fine_tune=True, simulation_shards=0, eval_every=1)
  # The task rebuilt by name is the same task.
  assert experiment.build_process(task(), elsewhere) is built
  for change in (dict(seed=1), dict(dp=_DP)):
    assert experiment.build_process(
        task(), dataclasses.replace(config, **change)) is not built
  assert experiment.build_process(task(), config, aggregator=None) is not built
  made = []
  form = lambda: made.append(1) or object()
  assert experiment.derived(built, 'form', form) is experiment.derived(
      built, 'form', form) and made == [1]
  # A large model's process is not kept, nor what is made from it (each
  # holds copies of the model).
  monkeypatch.setattr(experiment, '_KEPT_WEIGHT_BYTES', 0)
  experiment.derived(built, 'other', form)
  experiment.derived(built, 'other', form)
  assert made == [1, 1, 1]
  large = dataclasses.replace(config, seed=7)
  assert experiment.build_process(task(), large) is not (
      experiment.build_process(task(), large))


def test_every_registered_task_gives_its_spec_back(tmp_path):
  """`Run.spec` of a run of each registered task, as `binaries.train`
  records it (its flags' task arguments), names the task and its build
  options, and reads back through JSON; the record is made without the
  task's data."""
  if not FLAGS.is_parsed():
    FLAGS(['train'])
  for name in task_registry.TASKS:
    algorithm = next(r['algorithm'] for r in matrix.matrix()
                     if r['task'] == name and r['runs'])
    with flagsaver.flagsaver(task=name, algorithm=algorithm, rounds=2,
                             clients_per_round=2, num_users=30,
                             root_output_dir=str(tmp_path),
                             experiment_name=name):
      config, kwargs = common.configs_from_flags(FLAGS)
    arguments = dict(kwargs)
    os.makedirs(config.experiment_dir)
    training_loop.write_summary(
        os.path.join(config.experiment_dir, run_records.RUN_CONFIG_FILENAME),
        run_records.run_record(config, config.dp, None,
                               {'name': name, 'arguments': arguments}))
    spec = runs.Run.open(config.experiment_dir).spec
    assert spec.task == name and spec.algorithm == algorithm
    assert spec.task_options == {
        k: v for k, v in arguments.items()
        if k not in task_registry.RUN_ARGUMENTS}, name
    assert spec.config() == dataclasses.replace(config, resume=False), name
    assert run_spec.RunSpec.from_dict(json.loads(json.dumps(
        spec.to_dict()))) == spec


def _zeros(n):
  return lambda cid: tf.data.Dataset.from_tensor_slices(
      collections.OrderedDict(x=np.zeros((n, 2), np.float32),
                              y=np.zeros(n, np.int32)))


@pytest.fixture(scope='module')
def python_run(tmp_path_factory):
  """A run of a ClientData task built in Python (no build record)."""
  data = tff.simulation.datasets.ClientData.from_clients_and_tf_fn(
      ['a', 'b', 'c'], _zeros(4))
  task = client_data_task.ClientDataTask(
      'mine', data, data, client_data_task.keras_classifier(
          lambda: tf.keras.Sequential([tf.keras.Input((2,)),
                                       tf.keras.layers.Dense(2)])),
      batch_size=2)
  config = experiment.ExperimentConfig(
      algorithm='global', rounds=1, clients_per_round=2,
      root_output_dir=str(tmp_path_factory.mktemp('runs')),
      experiment_name='mine', simulation_shards=0)
  runs.run_experiment(task, config, log_fn=lambda s: None)
  return runs.Run.open(config.experiment_dir, task=task)


def test_a_task_built_in_python_says_how_to_make_its_spec(python_run):
  with pytest.raises(runs.RunError) as e:
    python_run.spec  # pylint: disable=pointless-statement
  message = str(e.value)
  assert "task (mine) was built in Python" in message and '\n' not in message
  assert '@tp.task_factory' in message


def test_a_task_from_a_declared_factory_called_in_python_gives_its_spec(
    tmp_path):
  """A ClientData task from a `task_factory` builder, called in Python and
  trained in Python, is rebuilt from the run's record alone: its spec names
  the builder and resolves to the run's digest. Called from `__main__`, the
  same builder records nothing (its name could not be imported)."""
  task = tiny_client_data.make_task(str(tmp_path), num_clients=3)
  config = experiment.ExperimentConfig(
      algorithm='global', rounds=1, clients_per_round=2,
      root_output_dir=str(tmp_path), experiment_name='tiny',
      simulation_shards=0)
  runs.run_experiment(task, config, log_fn=lambda s: None)
  run = runs.Run.open(config.experiment_dir)  # No task given.
  spec = run.spec
  assert spec.task == 'tests.tiny_client_data:make_task'
  assert spec.task_options == {'num_clients': 3}
  assert run.task.population == 3 and run.task.name == 'tiny'
  resolved = spec.resolve(run.task)
  assert runs.digest(run_records.run_record(
      resolved.config, resolved.dp, None,
      task_lib.build_record(run.task))) == run.digest
  unrecorded = task_registry.task_factory(capabilities=('batches',))(
      lambda data_dir: tiny_client_data.make_task.__wrapped__(data_dir))
  assert task_lib.build_record(unrecorded(None)) is None  # '<lambda>'.


def test_requests_of_the_wrong_type_are_refused_by_name(python_run):
  with pytest.raises(runs.RunError, match=r"client ids must be ints, got "
                     r"\['a'\]"):
    python_run.client_states(['a'])
  with pytest.raises(runs.RunError, match='ids must be a sequence'):
    python_run.client_states(3)
  with pytest.raises(runs.RunError, match=r"round must be a round number "
                     r"\(an int\) or None, got '1' \(str\)"):
    python_run.weights(round='1')
  with pytest.raises(runs.RunError, match='got 1.0 '):
    python_run.weights(round=1.0)
  assert len(python_run.client_states(np.arange(3))) == 3


class _Stop(Exception):
  pass


def test_work_outside_the_runtime_starts_its_own(python_run, monkeypatch):
  """Called outside `local_runtime()` (on TFF's import-time context, where
  such calls hung), a run's method runs in a runtime of its own and stops
  its worker; the context is TFF's again after."""
  inside = python_run.weights()
  stack = context_stack_impl.context_stack
  session = stack._stack[0]  # pylint: disable=protected-access
  stack.set_default_context(runtime._TFF_IMPORT_TIME_CONTEXT)  # pylint: disable=protected-access
  try:
    assert not runtime.installed()
    # Where the computation would run: in a runtime (checked before it
    # runs, so that a call on TFF's context fails here rather than hangs).
    seen = []
    def where(*args, **kwargs):
      del args, kwargs
      seen.append(runtime.installed())
      raise _Stop()
    with monkeypatch.context() as m:
      m.setattr(training_loop, 'load_checkpoint', where)
      with pytest.raises(_Stop):
        python_run.weights()
    assert seen == [True] and not runtime.installed()
    before = len(runtime._RUNTIMES)  # pylint: disable=protected-access
    outside = python_run.weights()
    started = runtime._RUNTIMES[before:]  # pylint: disable=protected-access
    assert started and all(rt.worker_pid is None for rt in started)
    assert stack._stack[0] is runtime._TFF_IMPORT_TIME_CONTEXT  # pylint: disable=protected-access
  finally:
    stack.set_default_context(session)
  assert runtime.installed()
  _assert_states_equal(outside, inside)
