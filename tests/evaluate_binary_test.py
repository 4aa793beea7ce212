"""binaries.evaluate: re-evaluating a finished run reads it and writes one file."""

import dataclasses
import json
import os
import shutil

from absl import flags
from absl.testing import flagsaver
import numpy as np
import pytest

from binaries import common
from binaries import evaluate
from binaries import train
from tasks import registry as task_registry
from tests import files
from tff_personal.evaluation import run_evaluation

FLAGS = flags.FLAGS


def _parse_flags():
  if not FLAGS.is_parsed():
    FLAGS(['evaluate'])


def _run_flags(root, mnist_dir, **overrides):
  values = dict(task='mnist_preference', algorithm='fedembed_personal',
                data_dir=mnist_dir, num_users=30, rounds=2,
                clients_per_round=6, root_output_dir=str(root),
                experiment_name='run', seed=3, eval_clients=0)
  values.update(overrides)
  return values


@pytest.fixture(scope='module')
def finished_run(tmp_path_factory, mnist_dir):
  _parse_flags()
  root = tmp_path_factory.mktemp('evaluate')
  with flagsaver.flagsaver(**_run_flags(root, mnist_dir)):
    assert train.main(['train']) == 0
  with open(root / 'run' / 'summary.json') as f:
    return root, json.load(f)


def _evaluate(root, mnist_dir, **overrides):
  with flagsaver.flagsaver(**_run_flags(root, mnist_dir, **overrides)):
    return evaluate.main(['evaluate'])


def _read(root, name):
  with open(root / 'run' / 'evaluations' / f'{name}.json') as f:
    return json.load(f)


@pytest.fixture(scope='module')
def reevaluated(finished_run, mnist_dir):
  """The finished run evaluated again ('again'): the record, and the run's
  files before and after."""
  root, _ = finished_run
  before = files.tree_digest(root / 'run')
  assert _evaluate(root, mnist_dir, eval_name='again') == 0
  return _read(root, 'again'), before, files.tree_digest(root / 'run')


def test_reevaluation_reproduces_the_run_and_changes_nothing(
    finished_run, reevaluated):
  _, summary = finished_run
  record, before, after = reevaluated
  assert record['round'] == 2
  # The same state, private states and evaluation: the run's final numbers.
  for key, value in summary['eval'].items():
    if isinstance(value, float):
      np.testing.assert_allclose(record['eval'][key], value, rtol=1e-6,
                                 err_msg=key)
  assert {k: v for k, v in after.items()
          if not k.startswith('evaluations')} == before


def test_run_dir_alone_reevaluates_the_run(finished_run, capsys):
  """--run_dir: the run's own record gives its task and configuration; the
  evaluation flags given change its evaluation, and nothing else."""
  root, summary = finished_run
  with flagsaver.flagsaver(run_dir=str(root / 'run'), eval_name='by_dir',
                           task='speaker_context', rounds=99):
    assert evaluate.main(['evaluate']) == 0
  record = _read(root, 'by_dir')
  assert record['round'] == 2
  for key, value in summary['eval'].items():
    if isinstance(value, float):
      np.testing.assert_allclose(record['eval'][key], value, rtol=1e-6,
                                 err_msg=key)
  with flagsaver.flagsaver(run_dir=str(root / 'run'), eval_name='by_dir_12',
                           eval_clients=12):
    assert evaluate.main(['evaluate']) == 0
  assert _read(root, 'by_dir_12')['eval']['num_clients'] == 12
  capsys.readouterr()
  with flagsaver.flagsaver(run_dir=str(root / 'nowhere')):
    assert evaluate.main(['evaluate']) == 2
  assert 'is not a run directory' in capsys.readouterr().err


def test_fine_tuned_and_subset_evaluations(finished_run, mnist_dir):
  root, summary = finished_run
  # (The run itself evaluated after the local pass: the MNIST default.)
  assert summary['flags']['training']['eval_fine_tune'] is True
  assert _evaluate(root, mnist_dir, eval_name='subset', eval_clients=12,
                   eval_fine_tune=False) == 0
  assert _evaluate(root, mnist_dir, eval_name='tuned', eval_fine_tune=True,
                   eval_clients=12) == 0
  plain, tuned = _read(root, 'subset'), _read(root, 'tuned')
  assert plain['eval']['num_clients'] == tuned['eval']['num_clients'] == 12
  assert summary['eval']['num_clients'] == 30
  assert tuned['evaluation']['eval_fine_tune'] is True
  assert plain['evaluation']['eval_fine_tune'] is False
  # One local pass of each client's private embedding moves its scores.
  assert tuned['eval']['auc'] != plain['eval']['auc']


def test_other_training_flags_are_refused(finished_run, mnist_dir, capsys):
  root, _ = finished_run
  assert _evaluate(root, mnist_dir, eval_name='lr',
                   client_learning_rate=0.5) == 2
  err = capsys.readouterr().err
  assert '--client_learning_rate: ' in err and ', 0.5 now' in err
  assert '--eval_name' not in err and '--seed' not in err
  assert not os.path.exists(root / 'run' / 'evaluations' / 'lr.json')


def test_existing_result_is_kept_unless_overwritten(finished_run, reevaluated,
                                                    mnist_dir, capsys):
  root, _ = finished_run
  del reevaluated  # It wrote evaluations/again.json.
  path = root / 'run' / 'evaluations' / 'again.json'
  first = path.read_bytes()
  assert _evaluate(root, mnist_dir, eval_name='again') == 2
  assert 'exists' in capsys.readouterr().err
  assert path.read_bytes() == first
  assert _evaluate(root, mnist_dir, eval_name='again',
                   overwrite_evaluation=True) == 0


def test_unfinished_run_is_refused(tmp_path, mnist_dir, capsys):
  _parse_flags()
  (tmp_path / 'run').mkdir()
  assert _evaluate(tmp_path, mnist_dir, eval_name='x') == 2
  assert 'has not finished' in capsys.readouterr().err
  assert os.listdir(tmp_path / 'run') == []


def test_library_call_checks_the_recorded_config(finished_run, mnist_dir):
  """`evaluate_experiment` itself compares with run_config.json."""
  root, _ = finished_run
  with flagsaver.flagsaver(**_run_flags(root, mnist_dir)):
    config, task_kwargs = common.configs_from_flags(FLAGS)
  task = task_registry.build_task('mnist_preference', **task_kwargs)
  other = dataclasses.replace(config, client_learning_rate=0.5)
  with pytest.raises(run_evaluation.EvaluationError,
                     match='client_learning_rate: 0.003 when the run started'):
    run_evaluation.evaluate_experiment(task, other, 'library')
  assert not os.path.exists(root / 'run' / 'evaluations' / 'library.json')


def test_sqlite_dp_run_is_reevaluated_from_its_store_and_record(tmp_path,
                                                                mnist_dir):
  """The on-disk store is read at its committed round, not rolled back, and
  nothing but the evaluation is written; a hand-edited summary.json changes
  neither the evaluated round nor the privacy report: they are derived from
  the checkpoints and run_config.json."""
  _parse_flags()
  dp = dict(dp='gaussian_fixed', noise_multiplier=1.0, clip_norm=0.5,
            eval_clients=10, client_state_backend='sqlite')
  with flagsaver.flagsaver(**_run_flags(tmp_path, mnist_dir, **dp)):
    assert train.main(['train']) == 0
  path = tmp_path / 'run' / 'summary.json'
  with open(path) as f:
    summary = json.load(f)
  before = files.tree_digest(tmp_path / 'run')
  assert _evaluate(tmp_path, mnist_dir, eval_name='sqlite', **dp) == 0
  record = _read(tmp_path, 'sqlite')
  np.testing.assert_allclose(record['eval']['auc'], summary['eval']['auc'],
                             rtol=1e-6)
  after = files.tree_digest(tmp_path / 'run')
  assert {k: v for k, v in after.items()
          if not k.startswith('evaluations')} == before
  epsilon = summary['privacy']['epsilon']
  # Both edited; one evaluation shows that neither is read.
  summary['privacy']['epsilon'] = epsilon / 100
  summary['rounds_completed'] = 1
  with open(path, 'w') as f:
    json.dump(summary, f)
  assert _evaluate(tmp_path, mnist_dir, eval_name='eps', **dp) == 0
  record = _read(tmp_path, 'eps')
  assert record['privacy']['epsilon'] == pytest.approx(epsilon)
  assert record['privacy']['rounds_noised'] == 2
  assert record['round'] == 2


def test_unreadable_summary_is_named(finished_run, mnist_dir, tmp_path,
                                     capsys):
  root, _ = finished_run
  shutil.copytree(root / 'run', tmp_path / 'run')
  with open(tmp_path / 'run' / 'summary.json', 'a') as f:
    f.write('}')
  assert _evaluate(tmp_path, mnist_dir, eval_name='x') == 2
  err = capsys.readouterr().err
  assert str(tmp_path / 'run' / 'summary.json') in err
  assert 'not valid JSON' in err
