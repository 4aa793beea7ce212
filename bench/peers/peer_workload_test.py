"""The peer sees the project's workload: same cohorts, same model size.

Run with the project's pytest (outside `testpaths`, so name the file):

  .venv/bin/python -m pytest bench/peers/peer_workload_test.py -q

The last two tests need the peer environment (bench/peers/setup_pfl_env.sh)
and skip without it; one of them runs pfl_fedavg_test.py there.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
if REPO not in sys.path:
  sys.path.insert(0, REPO)

# pylint: disable=g-import-not-at-top
from bench.peers import peer_workload
# pylint: enable=g-import-not-at-top

HERE = os.path.join(REPO, 'bench', 'peers')
PEER_PYTHON = os.environ.get(
    'PFL_PEER_PYTHON', os.path.join(HERE, '.venv-pfl', 'bin', 'python'))
needs_peer = pytest.mark.skipif(
    not os.access(PEER_PYTHON, os.X_OK),
    reason=f'no pfl peer environment at {PEER_PYTHON} '
    '(bench/peers/setup_pfl_env.sh)')


@pytest.mark.parametrize('population,cohort,seed',
                         [(1000, 50, 0), (1000, 200, 7), (13, 13, 2)])
def test_cohorts_match_the_project_sampler(population, cohort, seed):
  from tff_personal.core import training_loop  # pylint: disable=g-import-not-at-top
  for round_num in (1, 2, 17):
    np.testing.assert_array_equal(
        peer_workload.cohort_of(population, cohort, round_num, seed),
        training_loop.sample_clients(population, cohort, round_num, seed))


def test_learnable_workload_passes_validation_and_separates_classes(tmp_path):
  path = str(tmp_path / 'w.npz')
  x, y = peer_workload.make_learnable_workload(6, 20, seed=0)
  np.savez(path, x=x, y=y, type=np.zeros_like(y))  # Extra arrays are fine.
  x2, y2 = peer_workload.load_workload(path)
  np.testing.assert_array_equal(x2, x)
  np.testing.assert_array_equal(y2, y)
  top = x[..., :14, :, 0].mean(axis=(-1, -2))
  assert top[y == 1].min() > top[y == 0].max()


@pytest.mark.parametrize('arrays,message', [
    (dict(x=np.zeros((2, 20, 28, 28, 1), np.float32)), "missing arrays ['y']"),
    (dict(x=np.zeros((2, 20, 28, 28), np.float32),
          y=np.zeros((2, 20), np.int32)),
     'x must be [population, n, 28, 28, 1]'),
    (dict(x=np.zeros((2, 20, 28, 28, 1), np.float64),
          y=np.zeros((2, 20), np.int32)), 'x must be float32'),
    (dict(x=np.zeros((2, 20, 28, 28, 1), np.float32),
          y=np.zeros((2, 19), np.int32)), 'y must be [population, n]'),
    (dict(x=np.zeros((2, 20, 28, 28, 1), np.float32),
          y=np.full((2, 20), 2, np.int32)), 'labels must be in {0, 1}'),
])
def test_bad_workloads_are_named(tmp_path, arrays, message):
  path = str(tmp_path / 'bad.npz')
  np.savez(path, **arrays)
  with pytest.raises(ValueError) as e:
    peer_workload.load_workload(path)
  assert message in str(e.value)


@needs_peer
def test_torch_model_has_the_keras_models_tensors():
  """Same tensor sizes, layer for layer, as build_preference_model(0)."""
  from tff_personal.models import fedembed_mnist  # pylint: disable=g-import-not-at-top
  keras_model = fedembed_mnist.build_preference_model(0).model
  keras_sizes = sorted(int(np.prod(w.shape))
                       for w in keras_model.trainable_weights)
  code = ('import sys; sys.path.insert(0, sys.argv[1]); '
          'from bench.peers import pfl_fedavg; '
          'm = pfl_fedavg.MnistPreferenceCNN(); '
          'print(sorted(p.numel() for p in m.parameters()))')
  out = subprocess.run([PEER_PYTHON, '-c', code, REPO], capture_output=True,
                       text=True, timeout=600, check=True).stdout
  torch_sizes = [int(s) for s in out.strip().strip('[]').split(',')]
  assert torch_sizes == keras_sizes
  assert sum(torch_sizes) == keras_model.count_params()


@needs_peer
def test_peer_environment_tests_pass():
  result = subprocess.run(
      [PEER_PYTHON, os.path.join(HERE, 'pfl_fedavg_test.py')],
      capture_output=True, text=True, timeout=1800, check=False)
  assert result.returncode == 0, result.stderr[-4000:]
