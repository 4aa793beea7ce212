"""How a never-trained client's private state starts, and the personal
optimizer: `personal_init` and `private_optimizer`.

* `model` draws each private variable from the model's own Keras
  initializer, seeded per (seed, client, variable): equal to the
  initializer called with that seed, different between clients, the same
  on every call.
* `normal` is the seeded normal draw the recorded runs started from, and a
  run at it (and at the Adam personal optimizer) keeps the identity it had
  before either option existed.
"""

import collections
import types

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from binaries import common
from tff_personal.algorithms import registry
from tff_personal.config import experiment
from tff_personal.core import client_state
from tff_personal.core import split_model
from tff_personal.run import runs


def _model_fn_factory(embedding_dim):
  del embedding_dim
  spec = collections.OrderedDict(x=tf.TensorSpec([None, 4], tf.float32),
                                 y=tf.TensorSpec([None], tf.int32))
  return lambda: split_model.SplitModel(
      model=tf.keras.Sequential([
          tf.keras.layers.Input(shape=(4,)),
          tf.keras.layers.Dense(3, name='body'),
          tf.keras.layers.Dense(2, name='head',
                                bias_initializer=tf.keras.initializers.
                                RandomUniform(-0.5, 0.5))]),
      private_variables=[], loss_fn=lambda b, o: tf.reduce_mean(o),
      input_spec=spec)


_TASK = types.SimpleNamespace(name='init', model_fn_factory=_model_fn_factory,
                              supports_personal_embedding=False,
                              has_named_head=True)


def _config(**overrides):
  return experiment.ExperimentConfig(
      algorithm='fedrep', rounds=1, clients_per_round=1,
      root_output_dir='/tmp/x', experiment_name='y', seed=7, **overrides)


@pytest.fixture(scope='module')
def fedrep():
  return registry.build_for_task(
      'fedrep', _TASK,
      client_optimizer=tff.learning.optimizers.build_sgdm(0.1),
      server_optimizer=tff.learning.optimizers.build_sgdm(1.0))


def test_model_init_is_the_models_initializers_seeded_per_client(fedrep):
  initial = experiment.initial_client_state_fn(fedrep, _config())
  states = [initial(c) for c in (0, 1, 0)]
  kernel, bias = states[0]['private']
  assert kernel.shape == (3, 2) and bias.shape == (2,)
  for i, (initializer, shape) in enumerate((
      (tf.keras.initializers.GlorotUniform(), (3, 2)),
      (tf.keras.initializers.RandomUniform(-0.5, 0.5), (2,)))):
    seed = int(np.random.default_rng([7, 0, i]).integers(2**31 - 1))
    want = type(initializer).from_config(
        dict(initializer.get_config(), seed=seed))(shape)
    np.testing.assert_array_equal(states[0]['private'][i], want.numpy())
  limit = np.sqrt(6 / (3 + 2))  # Glorot-uniform's bound
  assert np.all(np.abs(kernel) <= limit) and np.all(np.abs(bias) <= 0.5)
  for a, b in zip(states[0]['private'], states[1]['private']):
    assert not np.allclose(a, b)  # every client its own draw
  for a, b in zip(states[0]['private'], states[2]['private']):
    np.testing.assert_array_equal(a, b)  # the same on every call
  assert int(states[0]['rounds_participated']) == 0


def test_normal_init_is_the_recorded_runs_seeded_draw(fedrep):
  initial = experiment.initial_client_state_fn(
      fedrep, _config(personal_init='normal', personal_init_stddev=0.3))
  template = tff.types.type_to_tf_tensor_specs(fedrep.client_state_type)
  want = client_state.seeded_initial_state_fn(template, 7, init='normal',
                                              stddev=0.3)(5)
  for a, b in zip(initial(5)['private'], want['private']):
    np.testing.assert_array_equal(a, b)


def test_legacy_values_keep_a_recorded_runs_identity(tmp_path):
  record = {'config': {'algorithm': 'fedrep', 'rounds': 1, 'seed': 7,
                       'personal_init_stddev': 0.1, 'dp': {}},
            'task': {'name': 'synthetic', 'arguments': {}}}
  legacy = runs.digest(record)
  same = {**record, 'config': {**record['config'], 'personal_init': 'normal',
                               'private_optimizer': 'adam'}}
  assert runs.digest(same) == legacy
  for changed in ({'personal_init': 'model'}, {'private_optimizer': 'sgd'}):
    other = {**record, 'config': {**record['config'], **changed}}
    assert runs.digest(other) != legacy, changed
  config = runs.config_from_record(
      {'config': {'algorithm': 'fedrep', 'rounds': 1,
                  'clients_per_round': 1, 'dp': {}}}, str(tmp_path / 'run'))
  assert (config.personal_init, config.private_optimizer) == (
      'normal', 'adam')


def test_private_optimizer_and_bad_values():
  sgd = experiment.make_private_optimizer(_config(
      private_learning_rate=0.5, private_optimizer='sgd'))
  adam = experiment.make_private_optimizer(_config(private_learning_rate=0.5))
  def hparams(optimizer):
    return optimizer.get_hparams(optimizer.initialize(
        (tf.TensorSpec([1], tf.float32),)))
  assert hparams(sgd)['learning_rate'] == pytest.approx(0.5)
  assert 'beta_1' not in hparams(sgd) and 'beta_1' in hparams(adam)
  assert experiment.make_private_optimizer(_config()) is None
  for field, value in (('personal_init', 'glorot'),
                       ('private_optimizer', 'rmsprop')):
    with pytest.raises(ValueError, match=field):
      experiment.check_values(_config(**{field: value}))


def test_list_shows_the_private_state_options():
  text = common.listing()
  assert '--personal_init=model|normal' in text
  assert '--private_optimizer=adam|sgd' in text
