"""The record of rounds started, which epsilon accounts, cannot be rolled
back silently: it is kept in the run directory and in the client-state
store (both backends), and resume, re-evaluation, export and
`Run.privacy_report()` take the larger and refuse any other disagreement
than the one a kill between the two writes leaves.

Kills are made in this process: the store's save of round 3 raises, after
the round's noised aggregate was computed (where `TFF_PERSONAL_FAULT=
mid_round:3` kills a run; tests/fault_test.py kills for real).
"""

import json
import os
import shutil
import sqlite3

from absl import flags
from absl.testing import flagsaver
import numpy as np
import pytest

from binaries import evaluate as evaluate_binary
from binaries import export as export_binary
from binaries import train
from tests import files
from tff_personal.core import client_state as client_state_lib
from tff_personal.core import privacy
from tff_personal.core import training_loop
from tff_personal.run import runs

FLAGS = flags.FLAGS
BACKENDS = ('memory', 'sqlite')
_STORES = {'memory': client_state_lib.InMemoryClientStateStore,
           'sqlite': client_state_lib.SqliteClientStateStore}


class _Killed(Exception):
  """Stands for a kill of the training process."""


def _flags(root, mnist_dir, backend, **kw):
  return dict(task='mnist_preference', algorithm='global_plus',
              data_dir=mnist_dir, num_users=30, rounds=4,
              clients_per_round=5, root_output_dir=str(root),
              experiment_name='run', seed=3, eval_clients=10,
              dp='gaussian_fixed', noise_multiplier=1.0, clip_norm=0.5,
              client_state_backend=backend, **kw)


def _train(root, mnist_dir, backend, **kw):
  if not FLAGS.is_parsed():
    FLAGS(['train'])
  with flagsaver.flagsaver(**_flags(root, mnist_dir, backend, **kw)):
    return train.main(['train'])


def _train_killed_in_round_3(root, mnist_dir, backend, monkeypatch, **kw):
  store = _STORES[backend]
  save = store._save_leaves  # pylint: disable=protected-access

  def save_or_die(self, client_ids, leaves, round_num):
    if round_num == 3:  # Round 3's noised aggregate exists: die.
      raise _Killed()
    save(self, client_ids, leaves, round_num)

  with monkeypatch.context() as m:
    m.setattr(store, '_save_leaves', save_or_die)
    with pytest.raises(_Killed):
      _train(root, mnist_dir, backend, **kw)


@pytest.fixture(scope='module', params=BACKENDS)
def dp_runs(request, tmp_path_factory, mnist_dir):
  """A DP run of 4 rounds killed in round 3, resumed and killed in round 3
  again ('killed': rounds 1, 2, 3, 3 started, checkpoint 2), then finished
  ('finished': 1, 2, 3, 3, 3, 4 started)."""
  backend = request.param
  root = tmp_path_factory.mktemp(f'dp_{backend}')
  with pytest.MonkeyPatch.context() as monkeypatch:
    _train_killed_in_round_3(root, mnist_dir, backend, monkeypatch)
    _train_killed_in_round_3(root, mnist_dir, backend, monkeypatch,
                             resume=True)
  shutil.copytree(root / 'run', root / 'killed')
  assert _train(root, mnist_dir, backend, resume=True) == 0
  shutil.copytree(root / 'run', root / 'finished')
  return backend, root


def _copy(dp_runs, name, tmp_path):
  _, root = dp_runs
  shutil.copytree(root / name, tmp_path / 'run')
  return str(tmp_path / 'run')


def _set_run_record(run_dir, count):
  with open(os.path.join(run_dir, training_loop.ROUNDS_STARTED_FILENAME),
            'w') as f:
    json.dump({'rounds_started': count}, f)


def _set_store_record(run_dir, backend, count):
  store = os.path.join(run_dir, 'client_states')
  if backend == 'memory':
    with open(os.path.join(store, 'rounds_started.json'), 'w') as f:
      json.dump({'rounds_started': count}, f)
  else:
    conn = sqlite3.connect(os.path.join(store, 'client_states.sqlite'))
    with conn:
      conn.execute("UPDATE meta SET value = ? WHERE key = 'rounds_started'",
                   (str(count),))
    conn.close()


def _epsilon(rounds_noised):
  return privacy.compute_epsilon(privacy.DPConfig(
      mechanism='gaussian_fixed', noise_multiplier=1.0, clip_norm=0.5,
      target_delta=min(1e-5, 30 ** -1.1), clients_per_round=5,
      population=30, rounds=4), rounds_noised)['epsilon']


def _evaluate(run_dir):
  with flagsaver.flagsaver(run_dir=run_dir, eval_name='again'):
    return evaluate_binary.main(['evaluate'])


def _export(run_dir, export_dir, **kw):
  with flagsaver.flagsaver(run_dir=run_dir, export_dir=str(export_dir),
                           **kw):
    return export_binary.main(['export'])


def _one_error_line(err):
  lines = [line for line in err.splitlines() if line.strip()]
  assert sum(line.startswith('error:') for line in lines) == 1, err
  return next(line for line in lines if line.startswith('error:'))


def _assert_inconsistent(line, run_dir, low, high):
  """The refusal names both places and both counts, says the record is
  inconsistent, and does not suggest restoring a backup."""
  assert os.path.join(run_dir, 'rounds_started.json') in line, line
  assert os.path.join(run_dir, 'client_states') in line, line
  assert f'counts {low} rounds started' in line and f'counts {high}' in line
  assert 'privacy record is inconsistent' in line, line
  assert 'backup' not in line, line


def test_both_places_count_every_round_started(dp_runs):
  backend, root = dp_runs
  for name, started in (('killed', 4), ('finished', 6)):
    run_dir = str(root / name)
    with open(os.path.join(run_dir, 'rounds_started.json')) as f:
      assert json.load(f)['rounds_started'] == started
    assert client_state_lib.read_rounds_started(
        os.path.join(run_dir, 'client_states'))[0] == started, backend
  with open(root / 'finished' / 'summary.json') as f:
    report = json.load(f)['privacy']
  assert report['rounds_noised'] == 6
  assert report['epsilon'] == pytest.approx(_epsilon(6))


def test_a_record_lowered_by_one_round_is_accounted_at_the_store_count(
    dp_runs, tmp_path, mnist_dir):
  """What a kill between the store's write and the run directory's leaves:
  the larger count is epsilon's, and the resume repairs the record and goes
  on. (The issue's reproduction: the record lowered to the checkpoint's
  round after a kill mid-round, one round behind the store.)"""
  backend, _ = dp_runs
  run_dir = _copy(dp_runs, 'killed', tmp_path)
  _set_run_record(run_dir, 3)
  report = runs.Run.open(run_dir).privacy_report()
  assert report['rounds_noised'] == 4
  assert report['epsilon'] == pytest.approx(_epsilon(4))
  assert _train(tmp_path, mnist_dir, backend, resume=True) == 0
  with open(os.path.join(run_dir, 'summary.json')) as f:
    report = json.load(f)['privacy']
  assert report['rounds_noised'] == 6  # 4 before, then 3 and 4 again.
  assert report['epsilon'] == pytest.approx(_epsilon(6))
  assert report['epsilon'] > _epsilon(5)
  with open(os.path.join(run_dir, 'rounds_started.json')) as f:
    assert json.load(f)['rounds_started'] == 6


def test_a_killed_run_whose_record_was_rolled_back_is_refused(
    dp_runs, tmp_path, mnist_dir, capsys):
  """The record set back to the checkpoint's round (2) after a replay (the
  store counts 4), or the store's record set back instead: resume (exit 3),
  export (exit 3) and `privacy_report()` refuse, naming both places;
  nothing is changed."""
  backend, _ = dp_runs
  for where in ('run directory', 'store'):
    run_dir = _copy(dp_runs, 'killed', tmp_path / where.replace(' ', '_'))
    if where == 'run directory':
      _set_run_record(run_dir, 2)
      low, high = 2, 4
    else:  # The store behind the run directory: never a kill's doing.
      _set_store_record(run_dir, backend, 2)
      low, high = 4, 2
    before = _digest(run_dir)
    with pytest.raises(training_loop.CheckpointError) as raised:
      runs.Run.open(run_dir).privacy_report()
    _assert_inconsistent(str(raised.value), run_dir, low, high)
    capsys.readouterr()
    assert _train(tmp_path / where.replace(' ', '_'), mnist_dir, backend,
                  resume=True) == 3
    _assert_inconsistent(_one_error_line(capsys.readouterr().err), run_dir,
                         low, high)
    assert _export(run_dir, tmp_path / 'export', allow_unfinished=True) == 3
    _assert_inconsistent(_one_error_line(capsys.readouterr().err), run_dir,
                         low, high)
    assert not os.path.exists(tmp_path / 'export')
    assert _digest(run_dir) == before, where


def test_a_finished_run_whose_record_was_lowered_is_refused(
    dp_runs, tmp_path, capsys):
  """The finished run started 6 rounds (4 completed). Its record lowered to
  3, below the completed rounds, or to 4 (two behind the store), or both
  places lowered to 3: evaluate, export (exit 3) and `privacy_report()`
  refuse; the record lowered to 5 (one behind), they account the store's
  6."""
  backend, _ = dp_runs
  for case in ('3', '4', '5', 'both 3'):
    run_dir = _copy(dp_runs, 'finished', tmp_path / case.replace(' ', '_'))
    _set_run_record(run_dir, int(case[-1]))
    if case == 'both 3':
      _set_store_record(run_dir, backend, 3)
    run = runs.Run.open(run_dir)
    if case == '5':
      assert run.privacy_report()['rounds_noised'] == 6
      continue
    before = _digest(run_dir)
    with pytest.raises(training_loop.CheckpointError) as raised:
      run.privacy_report()
    capsys.readouterr()
    assert _evaluate(run_dir) == 3
    evaluated = _one_error_line(capsys.readouterr().err)
    assert _export(run_dir, tmp_path / 'export') == 3
    exported = _one_error_line(capsys.readouterr().err)
    for text in (str(raised.value), evaluated, exported):
      if case == 'both 3':
        assert ('counts 3 rounds started, but the run has a checkpoint or '
                'released metrics of round 4') in text, text
        assert 'privacy record is inconsistent' in text, text
        assert 'backup' not in text, text
      else:
        _assert_inconsistent(text, run_dir, int(case), 6)
    assert not os.path.exists(tmp_path / 'export')
    assert not os.path.exists(os.path.join(run_dir, 'evaluations'))
    assert _digest(run_dir) == before, case


def test_an_unfinished_dp_run_exports_only_when_asked_and_says_so(
    dp_runs, tmp_path, capsys):
  """The killed run (checkpoint 2 of 4): refused (exit 2) without
  --allow_unfinished; with it, export.json records that, the round, the
  run's digest and its privacy: epsilon for the 4 rounds started."""
  backend, root = dp_runs
  if backend != 'sqlite':
    pytest.skip('one export is enough; the record is the same for both')
  run_dir = str(root / 'killed')
  out = tmp_path / 'export'
  capsys.readouterr()
  assert _export(run_dir, out) == 2
  line = _one_error_line(capsys.readouterr().err)
  assert 'has not finished' in line and 'round 2 (of 4)' in line, line
  assert '--allow_unfinished' in line and not out.exists()
  assert _export(run_dir, out, allow_unfinished=True) == 0
  with open(out / 'export.json') as f:
    record = json.load(f)
  run = runs.Run.open(run_dir)
  assert record['digest'] == run.digest
  assert record['round'] == 2 and record['rounds_planned'] == 4
  assert record['finished'] is False and record['allow_unfinished'] is True
  got = record['privacy']
  assert got['rounds_noised'] == 4
  assert got['epsilon'] == pytest.approx(_epsilon(4))
  assert got['epsilon'] == run.privacy_report()['epsilon']
  assert (got['delta'], got['noise_multiplier'], got['clip_norm']) == (
      min(1e-5, 30 ** -1.1), 1.0, 0.5)
  assert got['accountant'] and 'covers' in got and 'not_covered' in got


def test_the_store_record_never_goes_down(tmp_path):
  for backend, store in (
      ('memory', client_state_lib.InMemoryClientStateStore(
          _initial, str(tmp_path / 'memory'))),
      ('sqlite', client_state_lib.SqliteClientStateStore(
          _initial, str(tmp_path / 'sqlite' /
                        client_state_lib.SQLITE_FILENAME)))):
    with store:
      assert store.rounds_started() is None
      store.record_rounds_started(2)
      store.record_rounds_started(2)
      with pytest.raises(client_state_lib.ClientStateStoreError,
                         match='counts 2 rounds started; it cannot be '
                               'lowered to 1'):
        store.record_rounds_started(1)
      store.rollback(0)  # A rollback leaves the count.
      assert store.rounds_started() == 2
    assert client_state_lib.read_rounds_started(
        str(tmp_path / backend))[0] == 2, backend


def _initial(unused_client_id):
  return {'a': np.zeros(2, np.float32)}


def _digest(run_dir):
  """Every file's digest but the lock's and SQLite's own journal files."""
  return {k: v for k, v in files.tree_digest(run_dir).items()
          if not k.endswith(('experiment.lock', '-wal', '-shm'))}
