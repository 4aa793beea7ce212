"""The one registry and the Task interface: declarations match what runs.

Every task's declared capabilities are those of the task it builds; a pair
the registry says cannot run is refused before any work, naming what is
missing; task options are typed and checked like algorithm options; the data
seed is apart from the training seed; `binaries.train --list` prints the
registry's matrix.
"""

import collections
import os
import re
import types

from absl import flags
from absl.testing import flagsaver
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from binaries import common
from binaries import train  # pylint: disable=unused-import  (defines the flags)
from tasks import registry as task_registry
from tasks import speech_task
from tff_personal.algorithms import registry
from tff_personal.config import experiment
from tff_personal.config import matrix
from tff_personal.config import strategies
from tff_personal.core import split_model
from tff_personal.core import task as task_lib
from tff_personal.run import runs

FLAGS = flags.FLAGS
SHARED_DATA = os.path.abspath(
    os.path.join(os.path.dirname(__file__), '..', '..', 'shared', 'data'))

_SMALL = {
    'mnist_preference': dict(num_users=20, population='balanced'),
    'label_skew_mnist': dict(num_clients=4, train_per_client=20,
                             test_per_client=10),
    'marked_mnist': dict(num_clients=3, train_per_client=20,
                         test_per_client=10),
    'mnist_client_data': dict(num_users=20),
}


def _parse():
  if not FLAGS.is_parsed():
    FLAGS(['test'])


@pytest.mark.parametrize('name', sorted(_SMALL))
def test_declared_capabilities_are_the_built_tasks(name, mnist_dir):
  task = task_registry.build_task(name, data_dir=mnist_dir, seed=0,
                                  **_SMALL[name])
  task_lib.check_task(task)
  assert isinstance(task, task_lib.Task)
  assert task_lib.capabilities(task) == task_registry.spec(name).capabilities


def test_declared_capabilities_of_the_text_and_speech_tasks():
  # speech_preference needs generated audio: its class declares the same
  # members as its instances (class attributes and methods).
  assert task_lib.capabilities(speech_task.SpeechPreferenceTask) == (
      task_registry.spec('speech_preference').capabilities)
  if not os.path.isdir(os.path.join(SHARED_DATA, 'friends')):
    pytest.skip('no speaker_context data')
  task = task_registry.build_task('speaker_context', data_dir=SHARED_DATA,
                                  seed=0, max_docs=40)
  assert task_lib.capabilities(task) == (
      task_registry.spec('speaker_context').capabilities)
  task = task_registry.build_task('shakespeare_groups', data_dir=SHARED_DATA,
                                  seed=0, max_clients=30, vocab_size=100)
  task_lib.check_task(task)
  assert task_lib.capabilities(task) == (
      task_registry.spec('shakespeare_groups').capabilities)


def test_a_task_without_a_required_member_is_named():
  class NoEval:
    name = 'x'
    population = 3

    def model_fn_factory(self, d):
      del d

    metrics_fn = train_datasets = evaluate = model_fn_factory

  with pytest.raises(TypeError, match=r"missing \['eval_datasets'\]"):
    task_lib.check_task(NoEval())


def test_matrix_follows_the_needs():
  rows = {(r['algorithm'], r['task']): r for r in matrix.matrix()}
  assert len(rows) == len(registry.SPECS) * len(task_registry.TASKS)
  for (algorithm, task), row in rows.items():
    needs = set(registry.spec(algorithm).needs)
    have = set(task_registry.spec(task).capabilities)
    assert row['runs'] == needs.issubset(have), (algorithm, task)
  assert not rows[('fedembed_prototype', 'label_skew_mnist')]['runs']
  assert rows[('ditto', 'label_skew_mnist')]['runs']
  assert rows[('fedembed_prototype', 'mnist_client_data')]['runs']
  # FedRep's head is the task model's 'head' layer, or the one it names.
  assert registry.missing_for('fedrep', ('batches', 'split_model')) == [
      'named_head (' + task_lib.CAPABILITIES['named_head'][1] + ')']
  assert not registry.missing_for('fedrep', ('batches', 'split_model'),
                                  {'head_layer': 'mlp_out'})
  # The split algorithms need the task's split model; FedPerC's its own.
  assert not rows[('ditto', 'tv_shows')]['runs']
  assert rows[('fedperc_generated', 'tv_shows')]['runs']
  assert not rows[('fedperc', 'label_skew_mnist')]['runs']


def test_list_prints_the_matrix_and_every_option():
  text = common.listing()
  assert matrix.format_matrix() in text
  for name in registry.SPECS:
    assert re.search(rf'^  {name} \(', text, re.M), name
  assert 'lam (float, default 0.1)' in text  # ditto's option
  assert 'alpha (float, default 0.5)' in text  # label_skew_mnist's


def test_incompatible_pair_is_refused_before_any_work(tmp_path, mnist_dir):
  _parse()
  with flagsaver.flagsaver(task='label_skew_mnist',
                           algorithm='fedembed_prototype',
                           data_dir=mnist_dir, root_output_dir=str(tmp_path)):
    with pytest.raises(ValueError, match=r'--algorithm=fedembed_prototype '
                       r'cannot run on --task=label_skew_mnist: it needs '
                       r'fedembed_model'):
      common.configs_from_flags(FLAGS)
  task = task_registry.build_task('label_skew_mnist', data_dir=mnist_dir,
                                  seed=0, **_SMALL['label_skew_mnist'])
  config = experiment.ExperimentConfig(
      algorithm='global_plus', rounds=1, clients_per_round=1,
      root_output_dir=str(tmp_path), experiment_name='x')
  with pytest.raises(ValueError, match='global_plus cannot run on task '
                     "'label_skew_mnist': it needs personal_embedding"):
    runs.run_experiment(task, config, log_fn=lambda s: None)
  assert not list(tmp_path.iterdir())


def test_task_options_are_typed_and_checked(mnist_dir):
  assert task_registry.parse_task_options(
      'label_skew_mnist', ['alpha=0.1', 'num_clients=5', 'channels=8,8,8,8']
  ) == {'alpha': 0.1, 'num_clients': 5, 'channels': '8,8,8,8'}
  with pytest.raises(ValueError, match=re.escape(
      "label_skew_mnist has no task option 'clients'; its options: alpha "
      '(float, default 0.5)')):
    task_registry.parse_task_options('label_skew_mnist', ['clients=5'])
  with pytest.raises(ValueError, match="num_clients=2.5 must be of type int"):
    task_registry.parse_task_options('label_skew_mnist', ['num_clients=2.5'])
  with pytest.raises(ValueError, match="'seed' is set by the experiment"):
    task_registry.parse_task_options('label_skew_mnist', ['seed=1'])
  _parse()
  with flagsaver.flagsaver(task='label_skew_mnist', algorithm='ditto',
                           data_dir=mnist_dir, clients_per_round=2,
                           task_options=['num_clients=5', 'alpha=0.2']):
    _, kwargs = common.configs_from_flags(FLAGS)
  assert kwargs['num_clients'] == 5 and kwargs['alpha'] == 0.2
  # A flag the task's builder does not take is not passed; one it takes
  # is, when given; given twice (flag and option) is refused.
  assert 'num_users' not in kwargs and 'batch_size' not in kwargs
  with flagsaver.flagsaver(task='label_skew_mnist', algorithm='ditto',
                           data_dir=mnist_dir, batch_size=7):
    assert common.configs_from_flags(FLAGS)[1]['batch_size'] == 7
  with flagsaver.flagsaver(task='label_skew_mnist', algorithm='ditto',
                           data_dir=mnist_dir, batch_size=7,
                           task_options=['batch_size=8']):
    with pytest.raises(ValueError, match=r"\['batch_size'\] given both"):
      common.configs_from_flags(FLAGS)


def test_data_seed_is_apart_from_the_training_seed(mnist_dir):
  _parse()
  with flagsaver.flagsaver(task='mnist_preference', algorithm='global_plus',
                           data_dir=mnist_dir, num_users=30,
                           clients_per_round=3, seed=4, data_seed=1):
    config, kwargs = common.configs_from_flags(FLAGS)
  assert (config.seed, kwargs['seed']) == (4, 1)
  with flagsaver.flagsaver(task='mnist_preference', algorithm='global_plus',
                           data_dir=mnist_dir, num_users=30,
                           clients_per_round=3, seed=4):
    config, kwargs = common.configs_from_flags(FLAGS)
  assert (config.seed, kwargs['seed']) == (4, 4)
  # The data seed moves the data alone.
  a, b = (task_registry.build_task('mnist_preference', data_dir=mnist_dir,
                                   num_users=30, population='balanced',
                                   seed=s) for s in (0, 1))
  assert list(a.groups(range(30))) != list(b.groups(range(30)))


def test_declared_evaluations_are_what_the_processes_run():
  spec = collections.OrderedDict(x=tf.TensorSpec([None, 4], tf.float32),
                                 y=tf.TensorSpec([None], tf.int32))
  task = types.SimpleNamespace(
      name='tiny', supports_personal_embedding=False, has_named_head=True,
      model_fn_factory=lambda dim: lambda: split_model.SplitModel(
          model=tf.keras.Sequential([
              tf.keras.layers.Input(shape=(4,)),
              tf.keras.layers.Dense(3, name='body'),
              tf.keras.layers.Dense(2, name='head')]),
          private_variables=[], loss_fn=lambda b, o: tf.reduce_mean(o),
          input_spec=spec))
  declared = {n: s.evaluation for n, s in registry.SPECS.items()
              if s.evaluation}
  assert set(declared) == {'fedavg_ft', 'fedbabu', 'per_fedavg'}
  for name, text in declared.items():
    strategy = strategies.parse(text)[1]
    assert isinstance(strategy, strategies.FineTune), name
    proc = registry.build_for_task(
        name, task, client_optimizer=tff.learning.optimizers.build_sgdm(0.1),
        server_optimizer=tff.learning.optimizers.build_sgdm(1.0))
    assert proc.eval_fine_tune, name
    assert proc.eval_fine_tune_steps == strategy.steps, name
