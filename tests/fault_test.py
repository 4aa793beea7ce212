"""The fault suite: SIGKILL at each named point, on both stores, then resume.

Each kill is one process running `binaries.train`'s main with
`TFF_PERSONAL_FAULT=<point>:<n>` (tff_personal/core/fault.py), which SIGKILLs
itself at that point. To pay TensorFlow's import once, one helper process
imports the binary and forks a child per kill, two at a time (each child is
a whole training process with its own TFF worker, killed with SIGKILL).
Each resume then runs in this process through `runs.run_experiment`
(it already has TensorFlow and a TFF runtime, and the task is built once)
and must equal an uninterrupted run bit for bit: the final server
checkpoint, every released evaluation and training metric (but wall
times), and the memory store's final snapshot.

A DP run killed mid-round is resumed too, and its epsilon is recomputed
independently with dp_accounting for the rounds actually noised.
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

from absl import flags
from absl.testing import flagsaver
import dp_accounting
import numpy as np
import pytest
import tensorflow as tf

from binaries import common
from tasks import registry as task_registry
from tests import files
from tff_personal.core import client_state as client_state_lib
from tff_personal.core import fault
from tff_personal.core import privacy
from tff_personal.core import training_loop
from tff_personal.records import run_records
from tff_personal.run import runs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = flags.FLAGS

_COMMON = dict(task='mnist_preference', algorithm='global_plus',
               num_users=16, rounds=3, clients_per_round=4,
               eval_every=2, checkpoint_every=1, seed=3,
               server_optimizer='sgd', server_learning_rate=1.0,
               simulation_shards=0, eval_fine_tune=False, local_epochs=1)
_DP = dict(dp='gaussian_fixed', noise_multiplier=1.1, clip_norm=0.5)

# point -> the hit of that point the run dies at: every one in round 2.
# Round 0's checkpoint is written outside the loop's (so mid_checkpoint's
# hits are rounds 1, 2, ...); the store commits round 0 too (so
# mid_store_commit's hits are rounds 0, 1, 2, ...); the first evaluation is
# round 2's.
KILLS = {'mid_round': 2, 'mid_checkpoint': 2, 'after_checkpoint': 2,
         'mid_evaluation': 1, 'mid_store_commit': 3}
BACKENDS = ('memory', 'sqlite')


def _flag_values(out, name, **extra):
  return dict(_COMMON, root_output_dir=str(out), experiment_name=name,
              **extra)


# Imports the binary once, then forks one child per job (two at a time);
# each child parses its flags, sets its fault and runs the binary's main.
_FORKER = r"""
import json, os, sys
from absl import flags
from binaries import train
from tff_personal.core import fault
jobs, running, codes = json.loads(sys.argv[1]), {}, {}
while jobs or running:
  while jobs and len(running) < 2:
    name, argv, spec = jobs.pop(0)
    pid = os.fork()
    if pid == 0:
      os.environ[fault.ENV] = spec
      null = os.open(os.devnull, os.O_WRONLY)
      os.dup2(null, 1)
      os.dup2(null, 2)
      try:
        flags.FLAGS(['train'] + argv)
        code = train.main(['train'])
      except BaseException:
        code = 99
      os._exit(code)
    running[pid] = name
  pid, status = os.wait()
  codes[running.pop(pid)] = os.waitstatus_to_exitcode(status)
print(json.dumps(codes))
"""


def _parse_flags():
  common.define_flags()
  if not FLAGS.is_parsed():
    FLAGS(['train'])


_TASKS = {}


def _train_here(values, mnist_dir):
  """The binary's run, in this process: flags -> config, the task (built
  once), `runs.run_experiment` in the test session's TFF runtime."""
  _parse_flags()
  with flagsaver.flagsaver(data_dir=mnist_dir, **values):
    config, task_kwargs = common.configs_from_flags(FLAGS)
    key = json.dumps(task_kwargs, sort_keys=True, default=str)
    if key not in _TASKS:
      _TASKS[key] = task_registry.build_task(FLAGS.task, **task_kwargs)
    return runs.run_experiment(
        _TASKS[key], config, log_fn=lambda s: None,
        flag_values=common.flag_values(FLAGS))


@pytest.fixture(scope='module')
def killed(tmp_path_factory, mnist_dir):
  """Every kill: name -> (flag values, exit code)."""
  out = tmp_path_factory.mktemp('killed')
  runs = {f'{point}-{backend}': (_flag_values(
      out, f'{point}-{backend}', client_state_backend=backend),
                                 f'{point}:{hit}')
          for point, hit in KILLS.items() for backend in BACKENDS}
  runs['dp-mid_round-sqlite'] = (_flag_values(
      out, 'dp-mid_round-sqlite', client_state_backend='sqlite', **_DP),
                                 'mid_round:2')
  jobs = [[name, [f'--data_dir={mnist_dir}'] +
           [f'--{k}={v}' for k, v in values.items()], spec]
          for name, (values, spec) in runs.items()]
  proc = subprocess.run(
      [sys.executable, '-c', _FORKER, json.dumps(jobs)], cwd=REPO,
      env={**os.environ, 'PYTHONPATH': REPO}, capture_output=True,
      text=True, timeout=1200)
  assert proc.returncode == 0, proc.stderr[-3000:]
  codes = json.loads(proc.stdout.strip().splitlines()[-1])
  # Copies of the runs killed mid-round, for the damaged-store tests.
  for backend in BACKENDS:
    shutil.copytree(out / f'mid_round-{backend}',
                    out / f'damaged-{backend}')
  shutil.copytree(out / 'dp-mid_round-sqlite', out / 'damaged-dp-sqlite')
  return {name: (runs[name][0], codes[name], '') for name in runs}


@pytest.fixture(scope='module')
def reference(tmp_path_factory, mnist_dir):
  """The uninterrupted run (the store backend does not change it)."""
  out = tmp_path_factory.mktemp('reference')
  values = _flag_values(out, 'reference', client_state_backend='memory')
  _train_here(values, mnist_dir)
  return os.path.join(out, 'reference')


def _checkpoint_tensors(run_dir, round_num):
  path = os.path.join(run_dir, 'checkpoints', f'program_state_{round_num}',
                      'variables', 'variables')
  reader = tf.train.load_checkpoint(path)
  return {name: reader.get_tensor(name)
          for name, _ in tf.train.list_variables(path)
          if not name.startswith('_CHECKPOINTABLE_OBJECT_GRAPH')}


def _csv(path, drop=('round_seconds',)):
  rows = training_loop._read_csv(path)  # pylint: disable=protected-access
  return [{k: v for k, v in row.items() if k not in drop} for row in rows]


def _assert_same_run(got, want):
  a, b = _checkpoint_tensors(got, 3), _checkpoint_tensors(want, 3)
  assert sorted(a) == sorted(b) and a
  for name in a:
    np.testing.assert_array_equal(a[name], b[name], err_msg=name)
  for name in ('eval_metrics.csv', 'train_metrics.csv'):
    rows = _csv(os.path.join(got, name))
    assert rows == _csv(os.path.join(want, name)), name
  assert [int(r['round']) for r in _csv(
      os.path.join(got, 'train_metrics.csv'))] == [1, 2, 3]
  with open(os.path.join(got, 'summary.json')) as f:
    summary = json.load(f)
  with open(os.path.join(want, 'summary.json')) as f:
    assert summary['eval'] == json.load(f)['eval']
  return summary


def _evidence(point, backend, run_dir):
  """What the kill left on disk: the run died where it was asked to."""
  ckpt = os.path.join(run_dir, 'checkpoints')
  names = os.listdir(ckpt)
  rounds = training_loop.checkpoint_rounds(run_dir)
  released_eval = [int(r['round']) for r in _csv(
      os.path.join(run_dir, 'eval_metrics.csv'))]
  store_dir = os.path.join(run_dir, 'client_states')
  if point == 'mid_round':
    assert rounds == [0, 1]
    assert training_loop.rounds_started(run_dir) == 2
    # Both places of the record counted round 2 before it was killed.
    assert client_state_lib.read_rounds_started(store_dir)[0] == 2
  elif point == 'mid_checkpoint':
    assert rounds == [0, 1]
    assert any('program_state_2_temp' in n for n in names), names
  elif point in ('after_checkpoint', 'mid_store_commit'):
    assert rounds == [0, 1, 2]
  elif point == 'mid_evaluation':
    assert rounds == [0, 1, 2] and released_eval == []
  if point == 'mid_store_commit' and backend == 'memory':
    left = os.listdir(store_dir)
    assert 'client_states_1.npz' in left and (
        'client_states_2.npz' not in left), left
    assert any(n.endswith('.tmp') for n in left), left


@pytest.mark.parametrize('backend', BACKENDS)
@pytest.mark.parametrize('point', list(KILLS))
def test_a_kill_at_each_point_resumes_to_the_uninterrupted_run(
    killed, reference, mnist_dir, point, backend):
  values, code, err = killed[f'{point}-{backend}']
  assert code == -9, err  # SIGKILL, by the run itself at the point.
  run_dir = os.path.join(values['root_output_dir'],
                         values['experiment_name'])
  _evidence(point, backend, run_dir)
  _train_here(dict(values, resume=True), mnist_dir)
  summary = _assert_same_run(run_dir, reference)
  assert summary['resumed_from_round'] in (1, 2)
  if backend == 'memory':
    a = np.load(os.path.join(run_dir, 'client_states',
                             'client_states_3.npz'))
    b = np.load(os.path.join(reference, 'client_states',
                             'client_states_3.npz'))
    assert sorted(a.files) == sorted(b.files)
    for key in a.files:
      np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_fault_spec_is_checked():
  os.environ[fault.ENV] = 'mid_lunch'
  try:
    with pytest.raises(ValueError, match='mid_lunch'):
      fault.point('mid_round')
  finally:
    del os.environ[fault.ENV]
  fault.point('mid_round')  # No variable: nothing happens.
  with pytest.raises(ValueError, match='unknown fault point'):
    fault.point('nowhere')


def test_dp_epsilon_after_a_kill_matches_dp_accounting(killed, mnist_dir):
  """A DP run killed mid-round 2 and resumed noised rounds 1, 2, 2 again
  and 3: epsilon must be dp_accounting's for 4 rounds, computed here from
  the recorded noise multiplier and sampling, not through core/privacy.py.
  And summary.json lists every released value as covered or not."""
  values, code, err = killed['dp-mid_round-sqlite']
  assert code == -9, err
  run_dir = os.path.join(values['root_output_dir'],
                         values['experiment_name'])
  _train_here(dict(values, resume=True), mnist_dir)
  with open(os.path.join(run_dir, 'summary.json')) as f:
    summary = json.load(f)
  report = summary['privacy']
  assert report['rounds_noised'] == 4 and report['rounds_completed'] == 3
  assert report['sampling'] == 'fixed_size' and report['accountant'] == 'rdp'
  z, n, m = (report['noise_multiplier'], report['population'],
             report['clients_per_round'])
  assert (z, n, m) == (1.1, 16, 4)
  delta = min(1e-5, 16 ** -1.1)
  assert report['delta'] == delta
  # Fixed-size sampling without replacement, replace-one neighbours: the
  # sum's sensitivity is 2 * clip, so the Gaussian's multiplier is z / 2.
  event = dp_accounting.SelfComposedDpEvent(
      dp_accounting.SampledWithoutReplacementDpEvent(
          n, m, dp_accounting.GaussianDpEvent(z / 2)), 4)
  accountant = dp_accounting.rdp.RdpAccountant(
      neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
  expected = accountant.compose(event).get_epsilon(delta)
  assert report['epsilon'] == pytest.approx(expected, rel=1e-9)
  # Three rounds would have been less: the replay is accounted.
  three = dp_accounting.rdp.RdpAccountant(
      neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
  assert report['epsilon'] > three.compose(
      dp_accounting.SelfComposedDpEvent(
          dp_accounting.SampledWithoutReplacementDpEvent(
              n, m, dp_accounting.GaussianDpEvent(z / 2)), 3)).get_epsilon(
                  delta)
  released = {r['name']: r['covered'] for r in report['released']}
  assert released and all(isinstance(c, bool) for c in released.values())
  assert released['shared model update'] is True
  assert released['evaluation metrics'] is False
  assert 'training-metric sums' not in released  # Not released by default.
  with open(os.path.join(run_dir, 'train_metrics.csv')) as f:
    assert 'train/' not in f.readline()
  # The privacy module agrees with itself on the same configuration.
  assert privacy.compute_epsilon(privacy.DPConfig(
      mechanism='gaussian_fixed', noise_multiplier=z, clip_norm=0.5,
      clients_per_round=m, population=n, rounds=3), 4)['epsilon'] == (
          report['epsilon'])


def _damage(run_dir, backend, damage):
  backend = backend.replace('dp-', '')
  store = os.path.join(run_dir, 'client_states')
  if damage == 'deleted store':
    shutil.rmtree(store)
    return (training_loop.CheckpointError, 'missing or empty')
  if damage == 'corrupted store':
    name = (client_state_lib.SQLITE_FILENAME if backend == 'sqlite' else
            'client_states_1.npz')
    # SQLite's write-ahead log, which the killed run left, is damaged too
    # (else it would still serve the pages overwritten here).
    for damaged in (name, name + '-wal'):
      if os.path.exists(os.path.join(store, damaged)):
        with open(os.path.join(store, damaged), 'r+b') as f:
          f.seek(0)
          f.write(b'\0garbage' * 64)
    # Memory: the snapshot fails to load at the rollback (CheckpointError
    # naming it); SQLite: the database fails to open.
    return ((training_loop.CheckpointError,
             client_state_lib.ClientStateStoreError), name)
  if damage == 'no --resume':  # Nothing damaged: the flag is missing.
    return (training_loop.CheckpointError, 'pass --resume')
  record = os.path.join(run_dir, training_loop.ROUNDS_STARTED_FILENAME)
  if damage == 'deleted rounds record':  # The only record of the replay.
    os.remove(record)
    return (training_loop.CheckpointError,
            'rounds_started.json is missing: .* epsilon')
  if damage == 'truncated rounds record':
    with open(record, 'r+b') as f:
      f.truncate(7)
    return (training_loop.CheckpointError, 'rounds_started.json cannot be read')
  if damage == 'rounds record behind the checkpoints':
    with open(record, 'w') as f:
      json.dump({'rounds_started': 0}, f)
    # The store's record (2) disagrees first: the privacy record is
    # inconsistent either way.
    return (training_loop.CheckpointError,
            'rounds_started.json counts 0 rounds started, but .*privacy '
            'record is inconsistent')
  if damage == 'copied checkpoint':  # Its name says 99; it holds round 1.
    ckpt = os.path.join(run_dir, 'checkpoints')
    shutil.copytree(os.path.join(ckpt, 'program_state_1'),
                    os.path.join(ckpt, 'program_state_99'))
    return (training_loop.CheckpointError,
            'program_state_99 holds round 1, not 99: .* copied or renamed')
  assert damage == 'edited record'
  path = os.path.join(run_dir, run_records.RUN_CONFIG_FILENAME)
  with open(path) as f:
    record = json.load(f)
  record['config']['client_learning_rate'] = 0.5
  with open(path, 'w') as f:
    json.dump(record, f)
  return (run_records.ResumeError, 'client_learning_rate: 0.5')


_DAMAGES = ('deleted store', 'corrupted store', 'edited record',
            'no --resume', 'deleted rounds record', 'truncated rounds record',
            'rounds record behind the checkpoints', 'copied checkpoint')


@pytest.mark.parametrize('backend', BACKENDS + ('dp-sqlite',))
def test_a_killed_run_with_a_damaged_store_or_record_is_refused(
    killed, tmp_path, mnist_dir, backend):
  """Deleted or corrupted client-state store, an edited run record, a
  restart without --resume, a deleted, truncated or lagging record of the
  rounds started (epsilon counts its replays), or a checkpoint directory
  copied under another round's name: refused naming the problem, changing
  nothing (the SQLite database included: it is not opened). The DP run
  killed mid-round 2 had noised rounds 1, 2: without its record a resume
  would account 3 rounds, not 4."""
  values, _, _ = killed[f'{"dp-" if "dp" in backend else ""}mid_round-'
                        f'{backend.replace("dp-", "")}']
  source = os.path.join(values['root_output_dir'], f'damaged-{backend}')
  damages = _DAMAGES if 'dp' not in backend else (
      'deleted rounds record', 'truncated rounds record',
      'rounds record behind the checkpoints')
  for damage in damages:
    run_dir = tmp_path / damage.replace(' ', '_').replace('-', '')
    shutil.copytree(source, run_dir)
    error, message = _damage(str(run_dir), backend, damage)
    before = _digest(run_dir)
    with pytest.raises(error, match=message):
      _train_here(dict(values, root_output_dir=str(tmp_path),
                       experiment_name=run_dir.name,
                       resume=damage != 'no --resume'), mnist_dir)
    assert _digest(run_dir) == before, damage


def _digest(run_dir):
  """Every file's digest but the lock's (the killed run left its PID in it;
  a refused resume holds the lock and empties it) and SQLite's own
  journal files."""
  return {k: v for k, v in files.tree_digest(run_dir).items()
          if not k.endswith(('experiment.lock', '-wal', '-shm'))}


# The disk: each cause made for real (a full tmpfs, RLIMIT_FSIZE, a
# read-only mount, a file-system uid without permission, a garbage SQLite
# header), the binary run in this process: exit 3 and one line naming the
# path; then, with the cause removed (the store restored from a backup),
# --resume equals the uninterrupted run.
DISK_CAUSES = ('no space', 'file-size limit', 'read-only',
               'permission denied', 'damaged store')


def _mount_tmpfs(directory, *options):
  os.makedirs(directory, exist_ok=True)
  done = subprocess.run(
      ['mount', '-t', 'tmpfs', '-o', ','.join(('size=64m',) + options),
       'tmpfs', str(directory)], capture_output=True, check=False)
  if done.returncode:
    pytest.skip(f'cannot mount a tmpfs here: {done.stderr.decode()[:200]}')


def _fill(directory):
  with open(os.path.join(directory, 'filler'), 'wb') as f:
    try:
      while True:
        f.write(b'\0' * (1 << 20))
        f.flush()
    except OSError:
      pass


def _setfsuid(uid):
  """This thread's file-system uid: 65534 loses root's permission checks
  (a uid other than 0 drops the file-system capabilities); 0 restores."""
  import ctypes  # pylint: disable=g-import-not-at-top
  libc = ctypes.CDLL(None)
  libc.setfsuid(uid)
  libc.setfsuid(uid)  # The second call returns the uid now in force.


@pytest.mark.parametrize('cause', DISK_CAUSES)
def test_a_disk_failure_is_one_line_naming_the_path_then_resumes(
    killed, reference, tmp_path, mnist_dir, capsys, cause):
  if os.geteuid() != 0:
    pytest.skip('making disk failures needs root (mount, setfsuid)')
  from binaries import train  # pylint: disable=g-import-not-at-top
  import resource  # pylint: disable=g-import-not-at-top
  root = tmp_path / 'disk'
  if cause == 'permission denied':  # Below a directory all may traverse.
    root = pathlib.Path(tempfile.mkdtemp(prefix='tff_personal_disk_'))
    root.chmod(0o755)
  mounted = cause in ('no space', 'read-only')
  if mounted:
    _mount_tmpfs(root)
  root.mkdir(exist_ok=True)
  limits = resource.getrlimit(resource.RLIMIT_FSIZE)
  if cause in ('no space', 'file-size limit'):  # Mid-run, a fresh run.
    values = _flag_values(root, 'run', client_state_backend=(
        'sqlite' if cause == 'no space' else 'memory'))
    action = (lambda: _fill(root)) if cause == 'no space' else (
        lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limits[1])))
    fault.on('after_checkpoint', 1, action)  # Round 1's store commit fails.
  else:  # At the start of a resume of the run killed mid-round 2.
    killed_values, _, _ = killed['mid_round-sqlite']
    shutil.copytree(os.path.join(killed_values['root_output_dir'],
                                 'damaged-sqlite'), root / 'run')
    values = dict(killed_values, root_output_dir=str(root),
                  experiment_name='run', resume=True)
  run_dir = str(root / 'run')
  _parse_flags()
  capsys.readouterr()
  store = os.path.join(run_dir, 'client_states')
  backup = {name: (root / 'run' / 'client_states' / name).read_bytes()
            for name in os.listdir(store)} if cause == 'damaged store' else {}
  try:
    for name in backup:  # A garbage SQLite header (and its log).
      with open(os.path.join(store, name), 'r+b') as f:
        f.write(b'\0garbage' * 64)
    if cause == 'read-only':
      subprocess.run(['mount', '-o', 'remount,ro', str(root)], check=True)
    if cause == 'permission denied':
      _setfsuid(65534)
    with flagsaver.flagsaver(data_dir=mnist_dir, **values):
      code = train.main(['train'])
  finally:
    _setfsuid(0)
    resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    fault._actions.clear()  # pylint: disable=protected-access
    fault._hits.clear()  # pylint: disable=protected-access
    if cause == 'read-only':
      subprocess.run(['mount', '-o', 'remount,rw', str(root)], check=True)
    if cause == 'no space':
      os.remove(root / 'filler')
    for name, data in backup.items():  # Restored from the backup.
      with open(os.path.join(store, name), 'wb') as f:
        f.write(data)
  err = capsys.readouterr().err
  lines = [line for line in err.splitlines() if line.strip()]
  try:
    assert code == 3, err
    assert 'Traceback' not in err and lines, err
    assert lines[-1].startswith('error: ') and run_dir in lines[-1], err
    assert sum(line.startswith('error:') for line in lines) == 1, err
    _train_here(dict(values, resume=True), mnist_dir)
    _assert_same_run(run_dir, reference)
  finally:
    if mounted:
      subprocess.run(['umount', '-l', str(root)], check=False)
    if cause == 'permission denied':
      shutil.rmtree(root)
