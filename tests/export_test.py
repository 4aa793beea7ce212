"""binaries.export on a FedEmbed-Prototype run on real MNIST: the SavedModels
load in a fresh process that imports only TensorFlow and NumPy, and give the
library's predictions for three users and the library's local update; the
export takes the run's settings from its record, refusing flags that differ.
A DP run's export (epsilon, an unfinished run): tests/privacy_record_test.py.
"""

import collections
import json
import os
import subprocess
import sys

from absl import flags
from absl.testing import flagsaver
import numpy as np
import pytest
import tensorflow as tf

from binaries import export as export_binary
from binaries import train
from tff_personal import export
from tff_personal import runs
from tff_personal.core import evaluation
from tff_personal.core import process as process_lib
from tff_personal.core import production

FLAGS = flags.FLAGS
CLIENTS = (0, 7, 13)

# Loads the SavedModels with TensorFlow alone and runs them on the inputs.
_FRESH = r"""
import json, sys
import numpy as np
import pytest
import tensorflow as tf
export_dir, inputs, out = sys.argv[1:]
data = np.load(inputs, allow_pickle=False)
results = {}
for cid in json.loads(str(data['clients'])):
  model = tf.saved_model.load(f'{export_dir}/personalized/{cid}')
  results[f'predict_{cid}'] = model.predict(data[f'x_{cid}']).numpy()
device = tf.saved_model.load(f'{export_dir}/device')
n = lambda p: sorted(k for k in data.files if k.startswith(p))
got = device.local_update(
    tuple(data[k] for k in n('trainable_')),
    tuple(data[k] for k in n('non_trainable_')),
    tuple(data[k] for k in n('private_')), data['rounds'],
    {k[len('example_'):]: data[k] for k in n('example_')})
for i, v in enumerate(tf.nest.flatten(got['update'])):
  results[f'update_{i:03d}'] = v.numpy()
for i, v in enumerate(got['private']):
  results[f'new_private_{i:03d}'] = v.numpy()
results['rounds_participated'] = got['rounds_participated'].numpy()
assert not [m for m in sys.modules if m.startswith(('tensorflow_federated',
                                                    'tff_personal'))]
np.savez(out, **results)
"""


def _flag_values(root, mnist_dir):
  return dict(task='mnist_preference', algorithm='fedembed_prototype',
              data_dir=mnist_dir, num_users=20, rounds=2, clients_per_round=5,
              eval_clients=5, root_output_dir=str(root),
              experiment_name='fp', seed=1)


@pytest.fixture(scope='module')
def trained(tmp_path_factory, mnist_dir):
  """The finished run's directory."""
  if not FLAGS.is_parsed():
    FLAGS(['train'])
  root = tmp_path_factory.mktemp('runs')
  with flagsaver.flagsaver(**_flag_values(root, mnist_dir)):
    assert train.main(['train']) == 0
  return str(root / 'fp')


def _export(capsys, **values):
  capsys.readouterr()
  with flagsaver.flagsaver(**values):
    code = export_binary.main(['export'])
  return code, capsys.readouterr().err


def test_export_refuses_training_flags_other_than_the_runs(trained, tmp_path,
                                                         capsys):
  """A training flag must be the run's own (it was trained at the
  algorithm's default learning rate), and a flag that cannot change an
  export is unknown to it: exit 2, one line naming the flag, nothing
  written."""
  with open(os.path.join(trained, 'run_config.json')) as f:
    recorded = json.load(f)['flags']['client_learning_rate']
  assert recorded != 0.5
  out = str(tmp_path / 'export')
  code, err = _export(capsys, run_dir=trained, export_dir=out,
                      client_learning_rate=0.5)
  assert code == 2, err
  assert err.startswith('error: ') and len(err.strip().splitlines()) == 1
  assert (f"--client_learning_rate=0.5, the run's is {recorded!r}" in err and
          'run_config.json' in err), err
  code, err = _export(capsys, run_dir=trained, export_dir=out,
                      eval_clients=5, simulation_shards=2)
  assert code == 2, err
  assert ('--eval_clients, --simulation_shards: unknown to binaries.export'
          in err), err
  code, err = _export(capsys, run_dir=trained, export_dir=out,
                      root_output_dir=str(tmp_path))
  assert code == 2 and 'not two of them' in err, err
  assert not os.path.exists(out)


def test_a_spec_names_the_run_and_must_be_the_runs(trained, tmp_path,
                                                  capsys):
  """--spec states the run: the run's own spec is accepted; one with
  another learning rate, or a training flag beside it, is refused."""
  spec = runs.Run.open(trained).spec
  path = str(tmp_path / 'spec.json')
  out = str(tmp_path / 'export')
  with open(path, 'w') as f:
    json.dump(spec.to_dict(), f)
  with flagsaver.flagsaver(spec=path, export_dir=out):
    assert export_binary._spec_run().directory == trained  # pylint: disable=protected-access
  code, err = _export(capsys, spec=path, export_dir=out, seed=2)
  assert code == 2 and '--seed given beside it' in err, err
  with open(path, 'w') as f:
    json.dump(spec.override(
        {'optimizers.client_learning_rate': 0.5}).to_dict(), f)
  code, err = _export(capsys, spec=path, export_dir=out)
  assert code == 2, err
  assert f'is not the run in {trained}' in err and (
      'client_learning_rate' in err and '0.5 now' in err), err
  assert not os.path.exists(out)


def test_exported_models_predict_and_update_as_the_library(trained, tmp_path,
                                                           mnist_dir, capsys):
  export_dir = str(tmp_path / 'export')
  # The run named by its root and name, with training flags of its own.
  code, err = _export(capsys, root_output_dir=os.path.dirname(trained),
                      experiment_name='fp', export_dir=export_dir,
                      export_clients=[str(c) for c in CLIENTS],
                      data_dir=mnist_dir, algorithm='fedembed_prototype',
                      num_users=20, rounds=2, seed=1)
  assert code == 0, err
  run = runs.Run.open(trained)
  config = run.config
  with open(os.path.join(export_dir, 'export.json')) as f:
    record = json.load(f)
  assert record['clients'] == list(CLIENTS)
  assert record['digest'] == run.digest and record['round'] == 2
  assert record['finished'] is True and record['allow_unfinished'] is False
  assert record['privacy']['mechanism'] == 'none'
  assert record['privacy']['epsilon'] is None
  task = run.task
  # The library: the run's final weights and states, its evaluation.
  proc, _, weights, states = export.final_weights_and_states(
      task, config, CLIENTS)
  eval_states = process_lib.eval_client_states(proc, weights, states)
  personal_eval = evaluation.build_personal_eval(
      proc.eval_model_fn or proc.model_fn, proc.model_weights_type,
      proc.eval_client_state_type)
  outputs = personal_eval(weights, eval_states,
                          task.eval_datasets(list(CLIENTS)))
  inputs = {'clients': json.dumps(list(CLIENTS))}
  for cid, data in zip(CLIENTS, task.eval_datasets(list(CLIENTS))):
    inputs[f'x_{cid}'] = np.concatenate([b['x'] for b in data.as_numpy_iterator()])
  # The device's local update of client 0 on its next round's examples.
  examples = collections.OrderedDict(
      (k, np.concatenate([b[k] for b in task.train_datasets([CLIENTS[0]], 3)[
          0].as_numpy_iterator()])) for k in task.train_datasets(
              [CLIENTS[0]], 3)[0].element_spec)
  batch = getattr(task, 'batch_size', None) or 10
  form = production.production_form(proc)
  want = form.device(weights, states[0], tf.data.Dataset.from_tensor_slices(
      examples).batch(batch))
  for i, v in enumerate(weights.trainable):
    inputs[f'trainable_{i:03d}'] = np.asarray(v)
  for i, v in enumerate(weights.non_trainable):
    inputs[f'non_trainable_{i:03d}'] = np.asarray(v)
  for i, v in enumerate(states[0][process_lib.CLIENT_STATE_PRIVATE]):
    inputs[f'private_{i:03d}'] = np.asarray(v)
  inputs['rounds'] = np.asarray(states[0][process_lib.CLIENT_STATE_ROUNDS])
  for k, v in examples.items():
    inputs[f'example_{k}'] = v
  np.savez(tmp_path / 'inputs.npz', **inputs)
  done = subprocess.run(
      [sys.executable, '-c', _FRESH, export_dir,
       str(tmp_path / 'inputs.npz'), str(tmp_path / 'out.npz')],
      capture_output=True, text=True, timeout=600, check=False,
      env={**os.environ, 'TF_CPP_MIN_LOG_LEVEL': '2'})
  assert done.returncode == 0, done.stderr[-3000:]
  got = np.load(tmp_path / 'out.npz')
  # The same predictions (the logits to float32 rounding; the predicted
  # classes exactly), and the same local update: another process's thread
  # pools may sum a gradient in another order, and the local Adam divides
  # by each gradient's scale, so where a gradient is near zero that moves
  # a step by a few 1e-6 (seen: 2 of 100k kernel elements by 6e-6); a
  # wrong weight, state or example would move the whole update.
  for cid, out in zip(CLIENTS, outputs):
    logits = np.asarray(out['outputs'])
    np.testing.assert_allclose(got[f'predict_{cid}'], logits, rtol=1e-6,
                               atol=1e-6, err_msg=f'client {cid}')
    np.testing.assert_array_equal(got[f'predict_{cid}'].argmax(-1),
                                  logits.argmax(-1))
  updates = sorted(k for k in got.files if k.startswith('update_'))
  for k, v in zip(updates, tf.nest.flatten(want['update']), strict=True):
    a, b = got[k], np.asarray(v)
    assert a.shape == b.shape, k
    assert np.linalg.norm(a - b) <= 1e-4 * np.linalg.norm(b) + 1e-6, k
    assert np.abs(a - b).max() <= 1e-4, k
  privates = sorted(k for k in got.files if k.startswith('new_private_'))
  for k, v in zip(privates, want['client_state'][
      process_lib.CLIENT_STATE_PRIVATE], strict=True):
    np.testing.assert_allclose(got[k], np.asarray(v), rtol=1e-5, atol=1e-6,
                               err_msg=k)
  assert int(got['rounds_participated']) == int(
      want['client_state'][process_lib.CLIENT_STATE_ROUNDS])
