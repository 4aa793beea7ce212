"""The generic task over a `tff.simulation.datasets.ClientData`.

On the real MNIST files: the users of `mnist_preference` handed over as TFF
ClientData give exactly the native task's batches, so any algorithm trains
on them as on the native task; bad ClientData is refused, naming why.
"""

import collections
import types

from absl import flags
from absl.testing import flagsaver
import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from binaries import train
from tasks import client_data_task
from tasks import registry as task_registry
from tests import tiny_client_data
from tff_personal.algorithms import registry
from tff_personal.config import experiment
from tff_personal.core import runtime
from tff_personal.core import task as task_lib
from tff_personal.core import training_loop
from tff_personal.evaluation import new_user_evaluation
from tff_personal.run import runs


@pytest.fixture(scope='module')
def both(mnist_dir):
  native = task_registry.build_task('mnist_preference', data_dir=mnist_dir,
                                    num_users=12, population='balanced',
                                    seed=3, batch_size=4, local_epochs=2)
  generic = task_registry.build_task('mnist_client_data', data_dir=mnist_dir,
                                     num_users=12, seed=3, batch_size=4,
                                     local_epochs=2)
  return native, generic


def _flat(batches):
  return [(np.asarray(b.index_batches, dtype=object),
           [np.asarray(a) for a in tf.nest.flatten(b.examples)])
          for b in batches]


def test_clientdata_users_give_the_native_tasks_batches(both):
  native, generic = both
  assert generic.population == native.population == 12
  ids = [0, 5, 11]
  for round_num in (1, 2):
    for (ni, nx), (gi, gx) in zip(_flat(native.train_batches(ids, round_num)),
                                  _flat(generic.train_batches(ids, round_num))):
      assert len(ni) == len(gi) == 2 * int(np.ceil(len(nx[1]) / 4))
      for a, b in zip(ni, gi):
        np.testing.assert_array_equal(a, b)
      for a, b in zip(nx, gx):
        np.testing.assert_array_equal(a, b)
  # Rounds draw fresh orders; every epoch visits each example once.
  r1, r2 = (generic.train_batches([5], r)[0] for r in (1, 2))
  assert not all(np.array_equal(a, b) for a, b in
                 zip(r1.index_batches, r2.index_batches))
  n = len(r1.examples['y'])
  first_epoch = np.concatenate(r1.index_batches[:int(np.ceil(n / 4))])
  assert sorted(first_epoch.tolist()) == list(range(n))
  for (a, _), (b, _) in zip(_flat(native.eval_batches(ids)),
                            _flat(generic.eval_batches(ids))):
    for x, y in zip(a, b):
      np.testing.assert_array_equal(x, y)


def test_the_same_run_on_either_task(both, tmp_path):
  """One algorithm, the same seeds: the generic task trains what the native
  one does (the same shared weights after two rounds)."""
  native, generic = both
  weights = []
  for task in (native, generic):
    config = experiment.ExperimentConfig(
        algorithm='global_plus', rounds=2, clients_per_round=3,
        root_output_dir=str(tmp_path), experiment_name=task.name,
        embedding_dim=28, eval_clients=2)
    runs.run_experiment(task, config, log_fn=lambda s: None)
    proc = experiment.build_process(task, config)
    state = training_loop.load_checkpoint(proc, config.experiment_dir, 2)
    weights.append(tf.nest.flatten(proc.get_model_weights(state).trainable))
  for a, b in zip(*weights):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _client_data(ids, fn):
  return tff.simulation.datasets.ClientData.from_clients_and_tf_fn(ids, fn)


def _xy(n):
  return lambda cid: tf.data.Dataset.from_tensor_slices(collections.OrderedDict(
      x=np.zeros((n, 2), np.float32), y=np.zeros(n, np.int32)))


def test_bad_client_data_is_named():
  builder = client_data_task.keras_classifier(
      lambda: tf.keras.Sequential([tf.keras.layers.Dense(2)]))
  with pytest.raises(ValueError, match='1 training clients have no test data'):
    client_data_task.ClientDataTask('t', _client_data(['a', 'b'], _xy(3)),
                                    _client_data(['a'], _xy(3)), builder)
  no_y = _client_data(['a'], lambda cid: tf.data.Dataset.from_tensor_slices(
      collections.OrderedDict(x=np.zeros((3, 2), np.float32))))
  with pytest.raises(ValueError, match='must be dicts with x and y'):
    client_data_task.ClientDataTask('t', no_y, no_y, builder)
  with pytest.raises(ValueError, match="needs a 'type' feature"):
    client_data_task.ClientDataTask(
        't', _client_data(['a'], _xy(3)), _client_data(['a'], _xy(3)),
        builder, fedembed_encoder_fn=lambda c: None, num_types=2)
  task = client_data_task.ClientDataTask(
      't', _client_data(['a'], _xy(3)), _client_data(['a'], _xy(3)), builder)
  assert task_lib.capabilities(task) == ('batches', 'split_model')
  with pytest.raises(ValueError, match=r'client index 1 is not in \[0, 1\)'):
    task.train_batches([1], 1)
  with pytest.raises(ValueError, match='has no personal embedding'):
    task.model_fn_factory(4)()


def test_client_groups_give_the_groups_capability():
  """`client_groups` makes a ClientData task a grouped one (GroupFL runs on
  it); its per-group stage splits the clients by those groups."""
  builder = client_data_task.keras_classifier(
      lambda: tf.keras.Sequential([tf.keras.layers.Dense(2)]))
  ids = ['a', 'b', 'c', 'd', 'e']
  data = _client_data(ids, _xy(3))
  plain = client_data_task.ClientDataTask('t', data, data, builder)
  assert 'groups' not in task_lib.capabilities(plain)
  with pytest.raises(ValueError, match=r'gives it with: client_groups='):
    registry.check_compatible('groupfl', plain)
  task = client_data_task.ClientDataTask(
      't', data, data, builder,
      client_groups={'a': 'x', 'b': 'y', 'c': 'x', 'd': 'y', 'e': 'x'})
  assert 'groups' in task_lib.capabilities(task)
  registry.check_compatible('groupfl', task)
  assert task.group_names == ['x', 'y']
  assert list(task.groups([4, 1])) == ['x', 'y']
  config = experiment.ExperimentConfig(
      algorithm='groupfl', rounds=1, clients_per_round=2,
      root_output_dir='/tmp', experiment_name='g')
  assert experiment.group_members(task, config) == {'x': [0, 2, 4],
                                                     'y': [1, 3]}
  with pytest.raises(ValueError, match=r"1 clients have no group.*\['e'\]"):
    client_data_task.ClientDataTask('t', data, data, builder,
                                    client_groups={c: 'x' for c in ids[:4]})


def test_classification_metrics_are_per_client():
  outputs = [dict(outputs=np.array([[1., 0.], [0., 1.]]), labels=[0, 0]),
             dict(outputs=np.array([[0., 1.]] * 3), labels=[1, 1, 1])]
  m = client_data_task.classification_metrics(outputs, [0, 1])
  assert m['accuracy'] == pytest.approx(0.75)  # mean of 0.5 and 1.0
  assert m['accuracy_pooled'] == pytest.approx(4 / 5)
  assert m['accuracy_client_mean'] == m['accuracy']
  assert m['accuracy_std_across_clients'] == pytest.approx(0.25)
  assert m['accuracy_min'] == 0.5 and m['clients'] == 2


# ------------------------------------------------------------ cold start






def _two_layers():
  return tf.keras.Sequential([tf.keras.layers.Input(shape=(4,)),
                              tf.keras.layers.Dense(3, name='body'),
                              tf.keras.layers.Dense(2, name='head')])


def _withheld_task(withheld):
  return client_data_task.ClientDataTask(
      'mine', tiny_client_data.client_data(0), tiny_client_data.client_data(1),
      model_builder=client_data_task.keras_classifier(
          _two_layers),
      batch_size=4, evaluate_fn=tiny_client_data.mean_loss, withheld_clients=withheld,
      seed=5, has_named_head=True)


def test_withheld_clients_never_train_and_are_drawn_by_the_seed():
  task = _withheld_task(2)
  assert task.population == 6 and len(task.withheld_names) == 2
  assert not set(task.withheld_names) & set(task.client_names)
  assert sorted(task.withheld_names + task.client_names) == [
      f'c{k}' for k in range(8)]
  assert _withheld_task(0.25).withheld_names == task.withheld_names
  assert 'withheld' in task_lib.capabilities(task)
  for bad in (-1, 8, 2.5, True):
    with pytest.raises(ValueError, match='withheld_clients'):
      _withheld_task(bad)
  adapt, = task.withheld_adaptation_datasets([1], samples=5)
  assert sum(int(b['y'].shape[0]) for b in adapt) == 5
  test, = task.withheld_eval_datasets([1])
  assert sum(int(b['y'].shape[0]) for b in test) == 12


def _by_hand(task, weights, learning_rate, samples):
  """The withheld users' pooled loss from the global `weights`, after one
  pass of SGD on their first `samples` training examples (Keras)."""
  losses = []
  for name in task.withheld_names:
    model = _two_layers()
    model.set_weights([np.asarray(w) for w in weights.trainable])
    train = task.train_data.create_tf_dataset_for_client(name).take(
        samples).batch(4)
    opt = tf.keras.optimizers.SGD(learning_rate)
    for batch in train:
      with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
            batch['y'], model(batch['x']), from_logits=True))
      opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                              model.trainable_variables))
    test = next(iter(task.test_data.create_tf_dataset_for_client(
        name).batch(100)))
    losses.append(tf.keras.losses.sparse_categorical_crossentropy(
        test['y'], model(test['x']), from_logits=True).numpy())
  return float(np.mean(np.concatenate(losses)))


def test_cold_start_from_the_global_model_on_your_own_client_data(tmp_path):
  task = _withheld_task(2)
  config = experiment.ExperimentConfig(
      algorithm='ditto', rounds=2, clients_per_round=3,
      root_output_dir=str(tmp_path), experiment_name='cold',
      client_optimizer='sgd', client_learning_rate=0.5, seed=3,
      eval_strategies=('cg=cold_start(start=global,samples=0/5/all)',
                       'ci=cold_start(samples=0)'))
  with runtime.local_runtime():
    run = runs.run_experiment(task, config, log_fn=lambda s: None)
    weights = run.weights()
    fedrep = registry.build_for_task(
        'fedrep', task, client_optimizer=tff.learning.optimizers.build_sgdm(
            0.1), server_optimizer=tff.learning.optimizers.build_sgdm(1.0))
  cold = run.summary['strategies']['cg']
  assert cold['users'] == 2 and cold['start'] == 'global'
  # Ditto's new user starts as the final global model, then one pass of
  # the run's SGD on its first k examples: equal to Keras by hand.
  for samples, count in (('0', 0), ('5', 5), ('all', 12)):
    assert cold['samples'][samples]['loss'] == pytest.approx(
        _by_hand(task, weights, 0.5, count), rel=1e-4), samples
  assert cold['samples']['0']['loss'] != pytest.approx(
      cold['samples']['all']['loss'], rel=1e-3)
  # From the initial model instead: Ditto's new user is the initial global
  # model, which two rounds have moved away from.
  initial = run.summary['strategies']['ci']['samples']['0']['loss']
  assert initial != pytest.approx(cold['samples']['0']['loss'], rel=1e-3)
  # FedRep's head has no shared counterpart: start=global is refused.
  with pytest.raises(new_user_evaluation.NewUserError,
                     match="fedrep's private state has no shared"):
    new_user_evaluation.global_start(fedrep, weights, 'fedrep')


def test_fedbabu_new_users_fine_tune_the_whole_model_head_included(tmp_path):
  """FedBABU trains under a frozen head and fine-tunes every layer at
  evaluation: a new user starts from the final body and the frozen head
  and takes one pass of the run's SGD on all of them, as Keras does by
  hand (the whole-model copy of a process with nothing private would
  refuse the frozen head)."""
  task = _withheld_task(2)
  config = experiment.ExperimentConfig(
      algorithm='fedbabu', rounds=2, clients_per_round=3,
      root_output_dir=str(tmp_path), experiment_name='babu',
      client_optimizer='sgd', client_learning_rate=0.5, seed=3,
      eval_strategies=('cold=cold_start(samples=0/all)',))
  with runtime.local_runtime():
    run = runs.run_experiment(task, config, log_fn=lambda s: None)
    weights = run.weights()
  # Body (trained) then head (frozen): the Keras model's order.
  whole = types.SimpleNamespace(
      trainable=list(weights.trainable) + list(weights.non_trainable))
  cold = run.summary['strategies']['cold']
  for samples, count in (('0', 0), ('all', 12)):
    assert cold['samples'][samples]['loss'] == pytest.approx(
        _by_hand(task, whole, 0.5, count), rel=1e-4), samples


def test_the_binary_evaluates_withheld_users_from_the_global_model(
    tmp_path, mnist_dir):
  if not flags.FLAGS.is_parsed():
    flags.FLAGS(['train'])
  with flagsaver.flagsaver(
      task='mnist_client_data', algorithm='ditto', data_dir=mnist_dir,
      task_options=['num_users=30', 'withheld_clients=5'], rounds=1,
      clients_per_round=5, eval_clients=5, root_output_dir=str(tmp_path),
      experiment_name='cold', eval_strategies=[
          'cold=cold_start(start=global,samples=0/5)']):
    assert train.main(['train']) == 0
  run = runs.Run.open(str(tmp_path / 'cold'))
  assert run.task.population == 25
  cold = run.summary['strategies']['cold']
  assert cold['users'] == 5 and cold['start'] == 'global'
  assert cold['samples']['0']['clients'] == 5
  assert set(cold['samples']) == {'0', '5'}
