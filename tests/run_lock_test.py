"""The experiment-directory lock: exclusive, reentrant, never stale."""

import os
import signal
import subprocess
import sys

import pytest

from tests import process_utils
from tff_personal.records import run_lock

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_HOLDER = '''
import sys, time
from tff_personal.records import run_lock
with run_lock.hold(sys.argv[1]):
  print('locked', flush=True)
  time.sleep(300)
'''


def _start_holder(directory):
  proc = subprocess.Popen([sys.executable, '-c', _HOLDER, str(directory)],
                          cwd=REPO, stdout=subprocess.PIPE, text=True)
  assert proc.stdout.readline().strip() == 'locked'
  return proc


def test_a_held_lock_refuses_naming_the_holder_and_a_killed_one_does_not(
    tmp_path):
  holder = _start_holder(tmp_path)
  try:
    with pytest.raises(run_lock.ExperimentLockedError,
                       match=f'PID {holder.pid}'):
      with run_lock.hold(str(tmp_path)):
        pass
  finally:
    holder.send_signal(signal.SIGKILL)
    holder.wait()
  assert process_utils.wait_dead(holder.pid)
  # The killed holder's PID is still in the file; the kernel freed its lock.
  with open(run_lock.lock_path(str(tmp_path))) as f:
    assert f.read().strip() == str(holder.pid)
  with run_lock.hold(str(tmp_path)):
    with open(run_lock.lock_path(str(tmp_path))) as f:
      assert f.read().strip() == str(os.getpid())
    with run_lock.hold(str(tmp_path)):  # Reentrant in one process.
      pass
    # Still held after the inner block: another process is refused.
    probe = subprocess.run(
        [sys.executable, '-c', _HOLDER, str(tmp_path)], cwd=REPO,
        capture_output=True, text=True, timeout=60)
    assert probe.returncode != 0 and f'PID {os.getpid()}' in probe.stderr
  with open(run_lock.lock_path(str(tmp_path))) as f:
    assert f.read() == ''  # Emptied on release.


def test_reading_a_missing_directory_creates_nothing(tmp_path):
  with run_lock.hold(str(tmp_path / 'absent'), create=False):
    pass
  assert not (tmp_path / 'absent').exists()
