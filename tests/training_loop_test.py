"""Unit tests of the training loop's pieces: sampling, metrics, checkpoints."""

import csv
import glob
import json
import os
import shutil

from absl import flags
from absl.testing import flagsaver
import numpy as np
import pytest
import tensorflow as tf

from binaries import train
from tests import files
from tff_personal.core import client_state as client_state_lib
from tff_personal.core import privacy
from tff_personal.core import training_loop
from tff_personal.evaluation import run_evaluation
from tff_personal.run import runs

FLAGS = flags.FLAGS


def test_fixed_size_sampling_is_seeded_and_without_replacement():
  a = training_loop.sample_clients(100, 10, round_num=3, seed=1)
  b = training_loop.sample_clients(100, 10, round_num=3, seed=1)
  c = training_loop.sample_clients(100, 10, round_num=4, seed=1)
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)
  assert len(set(a.tolist())) == 10 and a.min() >= 0 and a.max() < 100


def test_fixed_size_sampling_is_uniform():
  counts = np.zeros(20)
  for r in range(4000):
    counts[training_loop.sample_clients(20, 5, r, seed=0)] += 1
  expected = 4000 * 5 / 20  # 1000 per client
  assert np.all(np.abs(counts - expected) < 5 * np.sqrt(expected))


def test_poisson_sampling_has_binomial_cohorts():
  sizes = [len(training_loop.sample_clients(1000, 50, r, seed=2, scheme='poisson'))
           for r in range(400)]
  # Binomial(1000, 0.05): mean 50, std ~6.9.
  assert abs(np.mean(sizes) - 50) < 5 * 6.9 / np.sqrt(400)
  assert np.std(sizes) == pytest.approx(np.sqrt(1000 * 0.05 * 0.95), rel=0.2)


def test_loop_config_rejects_bad_values():
  ok = dict(rounds=1, clients_per_round=1, population=2, experiment_dir='/x')
  for bad, msg in ((dict(rounds=0), 'rounds'),
                   (dict(clients_per_round=3), 'clients_per_round'),
                   (dict(sampling='cyclic'), 'sampling'),
                   (dict(checkpoint_every=0), 'checkpoint_every'),
                   (dict(keep_checkpoints=0), 'keep_checkpoints')):
    with pytest.raises(ValueError, match=msg):
      training_loop.LoopConfig(**{**ok, **bad}).validate()


def test_flatten_metrics_names_nested_values():
  flat = training_loop.flatten_metrics(
      {'train': {'loss': np.float32(0.5), 'n': np.int64(3)}, 'agg': ()})
  assert flat == {'train/loss': 0.5, 'train/n': 3}


def _flags(tmp_path, mnist_dir, **kw):
  values = dict(task='mnist_preference', algorithm='global_plus',
                data_dir=mnist_dir, num_users=30, rounds=2,
                clients_per_round=5, root_output_dir=str(tmp_path),
                experiment_name='ckpt', seed=3, eval_clients=10)
  values.update(kw)
  return values


@pytest.fixture(scope='module')
def finished(tmp_path_factory, mnist_dir):
  """One finished run of `_flags`' defaults, which the tests below copy
  (`_copy_of`) instead of each training it again."""
  root = tmp_path_factory.mktemp('finished')
  assert _train(root, mnist_dir) == 0
  return root / 'ckpt'


def _copy_of(finished, tmp_path):
  """The finished run, copied to where `_flags(tmp_path, ...)` puts it."""
  shutil.copytree(finished, tmp_path / 'ckpt')
  return tmp_path / 'ckpt'


def test_a_checkpoint_read_again_is_read_from_disk_once_it_changed(
    tmp_path, finished):
  """`load_checkpoint` keeps what it read, as long as the files are the
  same: a checkpoint replaced in place (as a resume rewrites the rounds
  after the store's) is read again."""
  run_dir = str(_copy_of(finished, tmp_path))
  proc = runs.Run.open(run_dir).process()
  first = training_loop.load_checkpoint(proc, run_dir, 2)
  for a, b in zip(tf.nest.flatten(first), tf.nest.flatten(
      training_loop.load_checkpoint(proc, run_dir, 2)), strict=True):
    np.testing.assert_array_equal(a, b)
  ckpts = tmp_path / 'ckpt' / 'checkpoints'
  shutil.rmtree(ckpts / 'program_state_2')
  shutil.copytree(ckpts / 'program_state_1', ckpts / 'program_state_2')
  with pytest.raises(training_loop.CheckpointError, match='holds round 1'):
    training_loop.load_checkpoint(proc, run_dir, 2)


def test_corrupt_checkpoint_is_reported_not_replaced(tmp_path, mnist_dir,
                                                     finished, capsys):
  _copy_of(finished, tmp_path)
  ckpt = tmp_path / 'ckpt' / 'checkpoints' / 'program_state_2'
  variables = [os.path.join(d, f) for d, _, fs in os.walk(ckpt) for f in fs
               if 'variables.data' in f]
  assert variables
  with open(variables[0], 'r+b') as f:
    f.truncate(10)
  summary_before = (tmp_path / 'ckpt' / 'summary.json').read_bytes()
  with flagsaver.flagsaver(**_flags(tmp_path, mnist_dir, rounds=4,
                                    resume=True)):
    assert train.main(['train']) == 3
  err = capsys.readouterr().err
  assert 'checkpoint for round 2' in err and 'cannot be read' in err
  assert 'Refusing to start fresh' in err
  # Nothing was replaced: the checkpoint directory and summary are as they were.
  assert ckpt.exists()
  assert (tmp_path / 'ckpt' / 'summary.json').read_bytes() == summary_before


def test_target_epsilon_calibrates_noise(tmp_path, mnist_dir):
  if not FLAGS.is_parsed():
    FLAGS(['train'])
  with flagsaver.flagsaver(**_flags(tmp_path, mnist_dir, dp='gaussian_fixed',
                                    target_epsilon=8.0, clip_norm=0.3,
                                    experiment_name='eps')):
    assert train.main(['train']) == 0
  with open(tmp_path / 'eps' / 'summary.json') as f:
    privacy = json.load(f)['privacy']
  assert privacy['epsilon'] <= 8.0
  assert privacy['epsilon'] > 7.5  # calibrated, not merely conservative
  assert privacy['noise_multiplier'] > 0


def _train(tmp_path, mnist_dir, **kw):
  """Runs binaries.train in this process; returns its exit code."""
  if not FLAGS.is_parsed():
    FLAGS(['train'])
  with flagsaver.flagsaver(**_flags(tmp_path, mnist_dir, **kw)):
    return train.main(['train'])


def test_resume_refuses_a_missing_or_emptied_sqlite_store(tmp_path, mnist_dir,
                                                          capsys):
  """Checkpoints without the client states they were committed with."""
  assert _train(tmp_path, mnist_dir, client_state_backend='sqlite') == 0
  shutil.copytree(tmp_path / 'ckpt', tmp_path / 'emptied')
  for name, damage in (('ckpt', os.remove), ('emptied', _truncate)):
    store_files = glob.glob(
        str(tmp_path / name / 'client_states' / 'client_states.sqlite*'))
    assert store_files
    for path in store_files:
      damage(path)
    before = files.tree_digest(tmp_path / name)
    assert _train(tmp_path, mnist_dir, client_state_backend='sqlite',
                  experiment_name=name, rounds=3, resume=True) == 3
    err = capsys.readouterr().err
    assert 'client_states.sqlite' in err and 'round 2' in err
    assert files.tree_digest(tmp_path / name) == before


def _truncate(path):
  with open(path, 'r+b') as f:
    f.truncate(0)


def test_resume_without_run_config_is_refused(tmp_path, mnist_dir, finished,
                                             capsys):
  """Without its record a resumed run cannot be checked: even a resume that
  names the other client-state backend would start every user afresh."""
  _copy_of(finished, tmp_path)
  os.remove(tmp_path / 'ckpt' / 'run_config.json')
  before = files.tree_digest(tmp_path / 'ckpt')
  for backend in ('memory', 'sqlite'):
    assert _train(tmp_path, mnist_dir, client_state_backend=backend,
                  rounds=3, resume=True) == 3
    err = capsys.readouterr().err
    assert 'run_config.json' in err and 'missing' in err
    assert files.tree_digest(tmp_path / 'ckpt') == before


class _Killed(Exception):
  """Stands for a kill of the training process."""


def test_dp_epsilon_covers_replayed_rounds_and_rounds_cannot_shrink(
    tmp_path, mnist_dir, capsys, monkeypatch):
  dp = dict(dp='gaussian_fixed', noise_multiplier=1.0, clip_norm=0.5,
            client_state_backend='memory', checkpoint_every=2)
  save = client_state_lib.InMemoryClientStateStore._save_leaves

  def save_or_die(self, client_ids, leaves, round_num):
    if round_num == 3:  # Round 3's noised aggregate was computed: die.
      raise _Killed()
    save(self, client_ids, leaves, round_num)

  with monkeypatch.context() as m:
    m.setattr(client_state_lib.InMemoryClientStateStore, '_save_leaves',
              save_or_die)
    with pytest.raises(_Killed):
      _train(tmp_path, mnist_dir, rounds=4, **dp)
  assert training_loop.checkpoint_rounds(str(tmp_path / 'ckpt')) == [0, 2]
  assert _train(tmp_path, mnist_dir, rounds=4, resume=True, **dp) == 0
  with open(tmp_path / 'ckpt' / 'summary.json') as f:
    summary = json.load(f)
  report = summary['privacy']
  # Rounds 1, 2, 3 (killed), then 3 and 4 again: five noised aggregates.
  assert summary['rounds_completed'] == 4
  assert report['rounds_noised'] == 5
  resolved = privacy.DPConfig(
      mechanism='gaussian_fixed', noise_multiplier=1.0, clip_norm=0.5,
      target_delta=report['delta'], clients_per_round=5, population=30,
      rounds=4)
  assert report['epsilon'] == pytest.approx(
      privacy.compute_epsilon(resolved, 5)['epsilon'])
  assert report['epsilon'] > privacy.compute_epsilon(resolved, 4)['epsilon']
  capsys.readouterr()
  # A shorter resume would report fewer rounds than ran: refused.
  before = files.tree_digest(tmp_path / 'ckpt')
  assert _train(tmp_path, mnist_dir, rounds=3, resume=True, **dp) == 3
  err = capsys.readouterr().err
  assert '--rounds=3' in err and '4 rounds' in err
  assert files.tree_digest(tmp_path / 'ckpt') == before


def _strict_json(path):
  """The JSON of `path`; fails on NaN or Infinity (not JSON)."""
  def refuse(constant):
    raise AssertionError(f'{path} holds {constant}, which is not JSON')
  with open(path) as f:
    return json.loads(f.read(), parse_constant=refuse)


def _csv_rows(path):
  with open(path, newline='') as f:
    return list(csv.DictReader(f))


def test_resume_after_a_kill_in_evaluation_releases_what_was_lost(
    tmp_path, mnist_dir, monkeypatch):
  evaluator = run_evaluation.personal_evaluator  # pylint: disable=protected-access

  def dying_evaluator(*args, **kwargs):
    _, ids, data_fn = evaluator(*args, **kwargs)

    def die(*unused_args, **unused_kwargs):
      raise _Killed()
    return die, ids, data_fn

  with monkeypatch.context() as m:
    m.setattr(run_evaluation, 'personal_evaluator', dying_evaluator)
    with pytest.raises(_Killed):
      _train(tmp_path, mnist_dir)
  run = tmp_path / 'ckpt'
  assert training_loop.checkpoint_rounds(str(run))[-1] == 2
  assert not (run / 'summary.json').exists()
  assert _train(tmp_path, mnist_dir, resume=True) == 0
  summary = _strict_json(run / 'summary.json')
  assert summary['rounds_completed'] == 2
  assert summary['rounds_run_in_this_process'] == 0
  eval_rows = _csv_rows(run / 'eval_metrics.csv')
  assert [int(r['round']) for r in eval_rows] == [2]
  assert float(eval_rows[0]['f1']) == pytest.approx(summary['eval']['f1'])
  last = _csv_rows(run / 'train_metrics.csv')[-1]
  assert int(last['round']) == 2
  assert summary['final_train_metrics']['train/loss'] == pytest.approx(
      float(last['train/loss']))


def test_resuming_a_finished_run_changes_nothing(tmp_path, mnist_dir, finished,
                                                capsys):
  run = _copy_of(finished, tmp_path)
  _strict_json(run / 'summary.json')
  before = files.tree_digest(run)
  capsys.readouterr()
  assert _train(tmp_path, mnist_dir, resume=True) == 0
  assert 'already finished' in capsys.readouterr().out
  assert files.tree_digest(run) == before


def test_keep_checkpoints_keeps_the_newest(tmp_path, mnist_dir):
  """--keep_checkpoints reaches the loop: the newest 4 of 5 rounds (the
  default keeps 3)."""
  assert _train(tmp_path, mnist_dir, rounds=5, keep_checkpoints=4) == 0
  assert training_loop.checkpoint_rounds(str(tmp_path / 'ckpt')) == [2, 3, 4,
                                                                     5]


def _seed_with_empty_rounds(population, clients_per_round, empty, rounds):
  """A seed whose Poisson cohort is empty in the rounds `empty` only."""
  for seed in range(5000):
    sizes = [len(training_loop.sample_clients(
        population, clients_per_round, r, seed, 'poisson'))
             for r in range(1, rounds + 1)]
    if [s == 0 for s in sizes] == [r in empty for r in range(1, rounds + 1)]:
      return seed
  raise AssertionError('no such seed')


def test_an_empty_poisson_cohort_is_a_round(tmp_path, mnist_dir):
  """Round 2 is empty in the unsharded form (one user per TFF client) and
  round 4 in the sharded one (the run resumes with shards after round 2):
  each is a round that trains nothing."""
  seed = _seed_with_empty_rounds(30, 2, empty=(2, 4), rounds=4)
  kw = dict(sampling='poisson', clients_per_round=2, seed=seed, eval_every=1)
  assert _train(tmp_path, mnist_dir, simulation_shards=0, **kw) == 0
  run = tmp_path / 'ckpt'
  assert training_loop.checkpoint_rounds(str(run))[-1] == 2
  assert _train(tmp_path, mnist_dir, rounds=4, resume=True,
                simulation_shards=2, **kw) == 0
  train_rows = _csv_rows(run / 'train_metrics.csv')
  assert [int(r['round']) for r in train_rows] == [1, 2, 3, 4]
  assert [int(r['cohort_size']) > 0 for r in train_rows] == [
      True, False, True, False]
  # Nothing trained in rounds 2 and 4: the model and the states are those
  # of the round before.
  eval_rows = _csv_rows(run / 'eval_metrics.csv')
  assert [int(r['round']) for r in eval_rows] == [1, 2, 3, 4]
  for key in ('f1', 'accuracy', 'auc'):
    assert eval_rows[1][key] == eval_rows[0][key]
    assert eval_rows[3][key] == eval_rows[2][key]
  assert eval_rows[2]['auc'] != eval_rows[1]['auc']  # Round 3 trained.
  summary = _strict_json(run / 'summary.json')
  assert summary['rounds_completed'] == 4 and summary['rounds_started'] == 4


def test_a_round_where_every_client_diverged_fails_loudly(tmp_path, mnist_dir,
                                                          capsys):
  # Finite flags, but steps of 1e30 overflow every client's weights.
  assert _train(tmp_path, mnist_dir, client_optimizer='sgd',
                client_learning_rate=1e30) == 1
  err = capsys.readouterr().err
  assert 'round 1' in err and 'all 5 clients' in err and 'non-finite' in err
  assert training_loop.checkpoint_rounds(str(tmp_path / 'ckpt')) == [0]
  assert not (tmp_path / 'ckpt' / 'summary.json').exists()


def test_unreadable_records_are_named(tmp_path, mnist_dir, finished, capsys):
  run = _copy_of(finished, tmp_path)
  for name in ('summary.json', 'run_config.json'):
    text = (run / name).read_text()
    (run / name).write_text(text[:len(text) // 2])  # Cut short by a crash.
    before = files.tree_digest(run)
    capsys.readouterr()
    assert _train(tmp_path, mnist_dir, resume=True) == 3
    err = capsys.readouterr().err
    assert str(run / name) in err and 'not valid JSON' in err
    assert files.tree_digest(run) == before
    (run / name).write_text(text)


@pytest.mark.parametrize('value', ['1e20', '100000000000000000000', '-1',
                                   '1.5', '"3"', 'true', 'null'])
def test_a_rounds_started_record_that_is_no_count_is_named(tmp_path, value):
  path = tmp_path / training_loop.ROUNDS_STARTED_FILENAME
  path.write_text('{"rounds_started": %s}' % value)
  with pytest.raises(training_loop.CheckpointError) as e:
    training_loop.rounds_started(str(tmp_path), required=True)
  assert str(path) in str(e.value) and '\n' not in str(e.value)
