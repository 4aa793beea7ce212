"""FedDVA gives bit-identical rounds for identical inputs.

Its clients sample z and c every batch from a stateless seed per client
round, pass and batch, so one round run twice from the same state, client
states and data must give exactly the same server state, client states and
metrics, in each schedule and decoder mode, on data that reshuffle on every
iteration. (Every registered algorithm's reruns, in both of its forms, are
checked by `conformance_test`, which builds each one already.)

The same settings give the same weights from Python and from the binary:
both compute with the same TensorFlow thread pools, and record them.
"""

import collections
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tasks import registry as task_registry
from tests import fedembed_testdata
from tff_personal.algorithms import feddva
from tff_personal.config import run_spec
from tff_personal.core import worker_threads
from tff_personal.models import feddva as feddva_lib
from tff_personal.models import feddva_losses
from tff_personal.models import feddva_recipes
from tff_personal.models import feddva_training
from tff_personal.run import runs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_flat = fedembed_testdata.flat


def _datasets(num=3, n=6):
  rng = np.random.default_rng(11)
  out = []
  for i in range(num):
    y = (np.arange(n) % 2).astype(np.int32)
    out.append(tf.data.Dataset.from_tensor_slices(collections.OrderedDict(
        x=rng.random((n, 28, 28, 1), dtype=np.float32), y=y,
        type=np.where(y == 1, i % 3, (i + 1) % 3).astype(np.int32))).shuffle(
            n, seed=7, reshuffle_each_iteration=True).repeat(2).batch(2))
  return out


_FEDDVA = feddva_lib.FeddvaConfig(z_dim=2, c_dim=2, channels=(2, 2, 2, 3),
                                  hidden=5)


@pytest.mark.parametrize('schedule, decoder', [
    ('paper', 'private'), ('reference', 'private'), ('paper', 'shared'),
    ('authors', 'private')])
def test_feddva_round_twice_is_bit_identical(schedule, decoder):
  """FedDVA samples z and c every batch: its noise is seeded too."""
  # The authors' schedule runs with the rest of their recipe, resampled.
  authors = feddva_recipes.recipe('authors')
  extra = (dict(resamples=2) if schedule == 'authors' else {})
  proc = feddva.build_feddva(
      _FEDDVA, authors.loss if schedule == 'authors' else
      feddva_losses.LossConfig(), **extra,
      schedule=schedule, decoder=decoder, seed=4,
      decoder_optimizer=tff.learning.optimizers.build_adam(1e-2),
      encoder_optimizer=tff.learning.optimizers.build_adam(1e-2))
  _, decoder0 = feddva.initial_weights(_FEDDVA, seed=4)
  states = [feddva.initial_client_state(
      () if decoder == 'shared' else decoder0) for _ in range(3)]
  state = proc.initialize()
  data = lambda: [d.map(lambda b: collections.OrderedDict(x=b['x'],
                                                          y=b['y']))
                  for d in _datasets()]
  first = proc.next(state, states, data())
  second = proc.next(state, states, data())
  for i, (x, y) in enumerate(zip(_flat(first), _flat(second))):
    np.testing.assert_array_equal(x, y, err_msg=f'leaf {i}')
  moved = [not np.array_equal(x, y) for x, y in zip(
      _flat(first[0].global_model_weights.trainable),
      _flat(state.global_model_weights.trainable))]
  assert any(moved)


def _images(order, n=6, seed=3):
  rng = np.random.default_rng(seed)
  x = rng.integers(0, 256, (n, 28, 28, 1)).astype(np.float32) / 255.0
  return tf.data.Dataset.from_tensor_slices(collections.OrderedDict(
      x=x[order], y=np.zeros(n, np.int32))).batch(2)


def test_feddva_client_seed_ignores_order_but_not_data_or_round():
  seed = lambda rounds, data, base=0: feddva_training.client_seed(
      base, rounds, data).numpy().tolist()
  forward, backward = _images(np.arange(6)), _images(np.arange(6)[::-1])
  assert seed(0, forward) == seed(0, backward)
  assert seed(0, forward) != seed(1, forward)
  assert seed(0, forward) != seed(0, _images(np.arange(6), seed=4))
  assert seed(0, forward) != seed(0, forward, base=1)


_PYTHON_RUN = '''
import json, sys
import tensorflow as tf
from tff_personal.config import run_spec
from tff_personal.core import runtime
from tff_personal.run import runs
spec = run_spec.RunSpec.from_dict(json.load(open(sys.argv[1])))
task = spec.build_task(data_dir=sys.argv[2], seed=spec.loop.seed)
tf.reduce_sum(tf.ones(3))  # The program's own work starts TensorFlow.
with runtime.local_runtime():
  runs.run_experiment(task, spec.resolve(task), log_fn=lambda s: None)
'''


def test_python_and_the_binary_train_the_same_weights(tmp_path, mnist_dir):
  """One Ditto run stated once, trained by a Python program (which starts
  TensorFlow before it enters the runtime) and by
  `binaries.train --spec`, each in a fresh process without thread
  variables: they record the same thread pools and give identical
  weights, and the binary's run gives its spec back."""
  spec = run_spec.RunSpec(
      task='mnist_preference', algorithm='ditto',
      task_options={'num_users': 20},
      loop=run_spec.Loop(rounds=2, clients_per_round=6, seed=3),
      optimizers=run_spec.Optimizers(client_learning_rate=0.05),
      simulation=run_spec.Simulation(shards=2),
      output=run_spec.Output(str(tmp_path), 'python'))
  paths = {}
  env = {k: v for k, v in os.environ.items()
         if k not in (worker_threads.INTRA_VAR, worker_threads.INTER_VAR)}
  env.update(TF_CPP_MIN_LOG_LEVEL='3', PYTHONPATH=REPO)
  for name, command in (
      ('python', [sys.executable, '-c', _PYTHON_RUN]),
      ('binary', [sys.executable, '-m', 'binaries.train'])):
    path = tmp_path / f'{name}.json'
    path.write_text(json.dumps(spec.override(
        {'output.experiment_name': name}).to_dict()))
    args = [str(path), mnist_dir] if name == 'python' else [
        f'--spec={path}', f'--data_dir={mnist_dir}']
    with open(tmp_path / f'{name}.log', 'w') as log:
      code = subprocess.run(command + args, cwd=REPO, env=env, stdout=log,
                            stderr=subprocess.STDOUT, timeout=900).returncode
    assert code == 0, (tmp_path / f'{name}.log').read_text()[-3000:]
    paths[name] = str(tmp_path / name)
  python, binary = (runs.Run.open(paths[n]) for n in ('python', 'binary'))
  assert python.record['threads'] == binary.record['threads']
  assert python.record['threads']['driver']['intra_op_threads'] == 1
  # The binary's spec: the same run, its task's other options (which the
  # binary passes from flags) at their defaults.
  got, want = binary.spec, spec.override({'output.experiment_name': 'binary'})
  assert got.config() == want.config() and got.task == want.task
  defaults = task_registry.task_options(want.task)
  assert got.task_options == {
      k: want.task_options.get(k, defaults[k][1]) for k in got.task_options}
  for a, b in zip(tf.nest.flatten(python.weights()),
                  tf.nest.flatten(binary.weights()), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert python['eval'] == binary['eval']
