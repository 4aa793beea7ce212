"""binaries.export on a FedEmbed-Prototype DP run on real MNIST.

The SavedModels load in a fresh process that imports only TensorFlow and
NumPy, and convert to TensorFlow Lite (`TFLiteConverter.from_saved_model`,
Select TF ops, resource variables); in both runtimes the device program
gives, for three users, the upload `MapReduceForm.work` gives (clipped:
norm <= clip) and the library's new client state, and the personalized
models give the library's predictions. The export takes the run's settings
from its record, refusing flags that differ. A DP run's epsilon and an
unfinished run's export: tests/privacy_record_test.py.
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
import tensorflow_federated as tff

from binaries import export as export_binary
from binaries import train
from tff_personal.core import evaluation
from tff_personal.core import process as process_lib
from tff_personal.core import production
from tff_personal.run import export
from tff_personal.run import runs

FLAGS = flags.FLAGS
CLIENTS = (0, 7, 13)

CLIP = 0.5
DOC = os.path.join(os.path.dirname(__file__), '..', 'docs', 'production.md')

# Loads the SavedModels with TensorFlow alone, converts them to TensorFlow
# Lite, and runs both on the inputs.
_FRESH = r"""
import json, re, sys
import numpy as np
import tensorflow as tf
export_dir, inputs, out = sys.argv[1:]
data = np.load(inputs, allow_pickle=False)
clients = json.loads(str(data['clients']))
results = {}


def lite(path, signature):
  converter = tf.lite.TFLiteConverter.from_saved_model(
      path, signature_keys=[signature])
  converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS,
                                         tf.lite.OpsSet.SELECT_TF_OPS]
  converter.experimental_enable_resource_variables = True
  model = converter.convert()
  flex = sorted({m.decode() for m in re.findall(rb'Flex([A-Z][A-Za-z0-9]+)',
                                                model)})
  interpreter = tf.lite.Interpreter(model_content=model)
  return interpreter.get_signature_runner(signature), len(model), flex


device = tf.saved_model.load(f'{export_dir}/device').signatures[
    'local_update']
device_lite, results['device_bytes'], results['device_flex'] = lite(
    f'{export_dir}/device', 'local_update')
for cid in clients:
  named = {k[len(f'c{cid}_'):]: data[k] for k in data.files
           if k.startswith(f'c{cid}_')}
  for runtime, got in (('tf', device(**{k: tf.constant(v)
                                         for k, v in named.items()})),
                       ('lite', device_lite(**named))):
    for k, v in got.items():
      results[f'{runtime}_{cid}_{k}'] = np.asarray(v)
  path = f'{export_dir}/personalized/{cid}'
  model = tf.saved_model.load(path).signatures['predict']
  results[f'tf_{cid}_prediction'] = model(
      x=tf.constant(data[f'x_{cid}']))['prediction'].numpy()
  predict_lite, results['predict_bytes'], results['predict_flex'] = lite(
      path, 'predict')
  results[f'lite_{cid}_prediction'] = predict_lite(
      x=data[f'x_{cid}'])['prediction']
assert not [m for m in sys.modules if m.startswith(('tensorflow_federated',
                                                    'tff_personal'))]
np.savez(out, **results)
"""


def _flag_values(root, mnist_dir):
  return dict(task='mnist_preference', algorithm='fedembed_prototype',
              data_dir=mnist_dir, num_users=20, rounds=2, clients_per_round=5,
              eval_clients=5, root_output_dir=str(root),
              experiment_name='fp', seed=1, dp='gaussian_fixed',
              noise_multiplier=1.0, clip_norm=CLIP, client_optimizer='sgd',
              client_learning_rate=0.3)


@pytest.fixture(scope='module')
def trained(tmp_path_factory, mnist_dir):
  """The finished DP run's directory."""
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


def _norm(leaves) -> float:
  return float(np.sqrt(sum(np.sum(np.square(np.asarray(v, np.float64)))
                           for v in leaves)))


def _leaves(value) -> list:
  return [np.asarray(v) for v in tff.structure.flatten(
      tff.structure.from_container(value, recursive=True))]


def test_exported_programs_upload_update_and_predict_as_the_library(
    trained, tmp_path, mnist_dir, capsys):
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
  assert record['privacy']['mechanism'] == 'gaussian_fixed'
  assert record['privacy']['clip_norm'] == CLIP
  assert record['privacy']['epsilon'] > 0
  task = run.task
  # The library: the run's final state and client states, its round's
  # compiled form, its evaluation.
  proc, _, state, states = export.final_state_and_client_states(
      task, config, CLIENTS)
  form = production.production_form(proc)
  mrf = form.map_reduce_form()
  broadcast = mrf.prepare(state)
  signature = production.device_signature(form)
  assert record['device']['inputs'] == json.loads(json.dumps(
      signature['inputs']))
  assert record['device']['outputs'] == json.loads(json.dumps(
      signature['outputs']))
  saved = np.load(os.path.join(export_dir, 'device', 'broadcast.npz'))
  want_broadcast = production.broadcast_inputs(form, broadcast)
  assert sorted(saved.files) == sorted(want_broadcast)
  for k, v in want_broadcast.items():
    np.testing.assert_array_equal(saved[k], v, err_msg=k)
  weights = proc.get_model_weights(state)
  eval_states = process_lib.eval_client_states(proc, weights, states)
  personal_eval = evaluation.build_personal_eval(
      proc.eval_model_fn or proc.model_fn, proc.model_weights_type,
      proc.eval_client_state_type)
  outputs = personal_eval(weights, eval_states,
                          task.eval_datasets(list(CLIENTS)))
  inputs = {'clients': json.dumps(list(CLIENTS))}
  for cid, data in zip(CLIENTS, task.eval_datasets(list(CLIENTS))):
    inputs[f'x_{cid}'] = np.concatenate(
        [b['x'] for b in data.as_numpy_iterator()])
  # Each device's round on its next round's examples: `work`'s upload,
  # and the client step's new state (one pass).
  batch = record['batch_size']
  want = {}
  for cid, client_state in zip(CLIENTS, states):
    train_data = task.train_datasets([cid], 3)[0]
    examples = collections.OrderedDict(
        (k, np.concatenate([b[k] for b in train_data.as_numpy_iterator()]))
        for k in train_data.element_spec)
    dataset = tf.data.Dataset.from_tensor_slices(examples).batch(batch)
    client_data = {'client_state': client_state, 'data': dataset}
    step = form.client_work(weights, client_state, dataset)
    want[cid] = (_leaves(mrf.work(client_data, broadcast)),
                 _leaves(step['client_state']), _leaves(step['update']))
    for k, v in production.device_inputs(form, broadcast, client_state,
                                         examples).items():
      inputs[f'c{cid}_{k}'] = v
  np.savez(tmp_path / 'inputs.npz', **inputs)
  done = subprocess.run(
      [sys.executable, '-c', _FRESH, export_dir,
       str(tmp_path / 'inputs.npz'), str(tmp_path / 'out.npz')],
      capture_output=True, text=True, timeout=900, check=False,
      env={**os.environ, 'TF_CPP_MIN_LOG_LEVEL': '2'})
  assert done.returncode == 0, done.stderr[-3000:]
  got = np.load(tmp_path / 'out.npz')
  for cid, out in zip(CLIENTS, outputs):
    logits = np.asarray(out['outputs'])
    for runtime in ('tf', 'lite'):
      prediction = got[f'{runtime}_{cid}_prediction']
      np.testing.assert_allclose(prediction, logits, rtol=1e-5, atol=1e-5,
                                 err_msg=f'{runtime} client {cid}')
      np.testing.assert_array_equal(prediction.argmax(-1), logits.argmax(-1))
  # Another process's thread pools may sum a gradient in another order
  # (TensorFlow Lite's kernels too). The run trains with SGD, whose step
  # moves by that rounding only; Adam divides by each gradient's scale, so
  # a near-zero gradient's rounding moved a whole step (seen: 6e-4 of the
  # clip). A wrong weight, state, example or a missing clip would move the
  # whole upload.
  for cid in CLIENTS:
    work, new_state, unclipped = want[cid]
    assert _norm(work) <= CLIP * (1 + 1e-6), cid
    assert _norm(unclipped) > CLIP, (cid, _norm(unclipped))  # It clipped.
    for runtime in ('tf', 'lite'):
      upload = [got[f'{runtime}_{cid}_upload_{i:03d}']
                for i in range(len(work))]
      assert not [k for k in got.files if k.startswith(
          f'{runtime}_{cid}_upload_{len(work):03d}')]
      assert _norm(upload) <= CLIP * (1 + 1e-5), (runtime, cid)
      for i, (a, b) in enumerate(zip(upload, work, strict=True)):
        assert a.shape == b.shape, (runtime, cid, i)
        # Against the clip, the upload's scale.
        assert np.linalg.norm(a - b) <= 1e-4 * CLIP, (runtime, cid, i)
        assert np.abs(a - b).max() <= 1e-4 * CLIP, (runtime, cid, i)
      state = [got[f'{runtime}_{cid}_state_{i:03d}']
               for i in range(len(new_state))]
      for i, (a, b) in enumerate(zip(state, new_state, strict=True)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6,
                                   err_msg=f'{runtime} {cid} state {i}')
  # docs/production.md names every Select TF op the conversions need.
  with open(DOC, encoding='utf-8') as f:
    doc = f.read()
  for key in ('device_flex', 'predict_flex'):
    missing = [op for op in got[key] if f'`{op}`' not in doc]
    assert not missing, (key, missing)
