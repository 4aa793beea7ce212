"""Test-wide set-up: one TFF runtime per test process, always shut down."""

import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
# This process's TensorFlow gets the worker's thread pools (one thread per
# op, one inter-op thread per CPU) from its start: sharded rounds compute
# their shards here (`core/sharded.py`), and a test module may start
# TensorFlow before the session's runtime could set them
# (`runtime.configure_driver_threads`).
os.environ.setdefault('TF_NUM_INTRAOP_THREADS', '1')
os.environ.setdefault('TF_NUM_INTEROP_THREADS', str(len(os.sched_getaffinity(0))))
# Under pytest-xdist each worker is one of several processes sharing the
# cores: an auto-sharded run (`simulation_shards=-1`) takes its share of
# them, not all of them, so it traces one shard loop per core it can use.
# Tests of several shards ask for them explicitly.
if 'PYTEST_XDIST_WORKER_COUNT' in os.environ:
  os.environ.setdefault('TFF_PERSONAL_AUTO_SHARDS', str(max(
      1, len(os.sched_getaffinity(0)) //
      int(os.environ['PYTEST_XDIST_WORKER_COUNT']))))

import pytest  # pylint: disable=g-import-not-at-top

from tff_personal.core import runtime  # pylint: disable=g-import-not-at-top

SHARED_DATA = os.path.abspath(
    os.path.join(os.path.dirname(__file__), '..', '..', 'shared', 'data'))


@pytest.fixture(scope='session', autouse=True)
def tff_runtime():
  """Installs a LocalCppRuntime for the whole session and stops its worker."""
  with runtime.local_runtime(handle_sigterm=False) as rt:
    yield rt


@pytest.fixture(scope='session')
def mnist_dir():
  path = os.environ.get('TFF_PERSONAL_MNIST_DIR',
                        os.path.join(SHARED_DATA, 'mnist'))
  if not os.path.isdir(path):
    pytest.skip(f'MNIST IDX files not found at {path}')
  return path


# Files known to take longest (measured, one process; refresh from a CI
# run's --durations). They are collected first, in this order, so that
# `--dist loadfile` hands them out first and the workers finish together,
# instead of one running a long file alone at the end. The other
# files follow in their usual order; a file's tests keep their order.
_SLOWEST_FIRST = (
    'conformance_test.py', 'production_test.py', 'sharded_test.py',
    'benchmark_test.py', 'batched_test.py', 'training_loop_test.py',
    'group_paper_test.py', 'group_stage_test.py', 'train_binary_test.py',
    'fault_test.py', 'context_task_test.py', 'feddva_paper_test.py',
    'furl_paper_test.py', 'fedembed_baselines_test.py',
    'fedembed_som_test.py', 'privacy_test.py', 'stages_test.py',
    'runtime_test.py', 'evaluate_binary_test.py', 'feddva_process_test.py')


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(_SLOWEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
