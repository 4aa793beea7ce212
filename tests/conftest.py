"""Test-wide set-up: one TFF runtime per test process, always shut down."""

import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

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
