"""End-to-end tests of binaries.train: flags, summary.json, DP report, resume.

A kill at every point and its resume is tests/fault_test.py; the worker
ending with its killed parent, tests/runtime_test.py.
"""

import json
import os
import subprocess
import sys

from absl import flags
from absl.testing import flagsaver
import numpy as np
import pytest

from binaries import evaluate
from binaries import train
from tests import files
from tff_personal.core import private_noise

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = flags.FLAGS


def _parse_flags():
  if not FLAGS.is_parsed():
    FLAGS(['train'])


def _base(tmp_path, mnist_dir, **overrides):
  values = dict(task='mnist_preference', algorithm='global_plus',
                data_dir=mnist_dir, num_users=40, rounds=2,
                clients_per_round=5, root_output_dir=str(tmp_path),
                experiment_name='e2e', seed=1, server_optimizer='adam',
                server_learning_rate=0.01)
  values.update(overrides)
  return values


@pytest.mark.parametrize('overrides,message', [
    (dict(clients_per_round=50), 'larger than the population'),
    (dict(algorithm='fedfoo'), "--algorithm='fedfoo': unknown algorithm"),
    (dict(task='mnist_prefs'), "--task='mnist_prefs': unknown task"),
    (dict(dp='gaussian_fixed', noise_multiplier=-1.0), 'noise_multiplier'),
    (dict(dp='gaussian_fixed'), 'needs --noise_multiplier or --target_epsilon'),
    (dict(rounds=0), 'rounds must be >= 1'),
    (dict(server_momentum=0.9), "applies to server_optimizer='sgd' only"),
    (dict(algorithm_options=['lam=15']), "global_plus has no option 'lam'"),
    (dict(inter_op_threads=-3), '--inter_op_threads must be'),
    (dict(encoder_weights='enc.npz'), 'apply to --task=speech_preference'),
    (dict(task='speech_preference', algorithm='fedembed_prototype',
          freeze_encoder=True), '--freeze_encoder needs --encoder_weights'),
    (dict(speech_encoder='spectral'), '--speech_encoder applies to'),
    (dict(dp_personal_heads='noised'), "needs dp mechanism 'gaussian_fixed'"),
    (dict(task='speech_preference', algorithm='fedembed_prototype',
          speech_encoder='spectral', encoder_weights='enc.npz'),
     '--speech_encoder=spectral has none to load'),
    (dict(client_learning_rate=float('nan')),
     '--client_learning_rate must be a finite number, got nan'),
    (dict(server_learning_rate=float('inf')),
     '--server_learning_rate must be a finite number, got inf'),
    (dict(personal_init_stddev=-1.0), 'personal_init_stddev must be >= 0'),
    # Integers a run's 32-bit counters cannot hold.
    (dict(rounds=99999999999999999999), '--rounds=99999999999999999999 is '
     'out of range'),
    (dict(seed=2**31), '--seed=2147483648 is out of range'),
    (dict(seed=-1), 'seed must be >= 0'),
    (dict(algorithm='ditto', task='label_skew_mnist',
          task_options=['num_clients=4294967296']),
     'num_clients=4294967296 is out of range'),
    (dict(clip_norm=0.0), 'clip_norm must be > 0'),
    (dict(embedding_dim=-1), 'embedding_dim must be >= 0'),
    (dict(embedding_dim=0), 'global_plus needs a personal embedding'),
    # The best-scoring SOM update hands one client's update to the server.
    (dict(algorithm='fedembed_som'), 'allow_unprotected_best_client=True'),
])
def test_bad_flags_fail_before_any_work(tmp_path, mnist_dir, capsys,
                                        overrides, message):
  _parse_flags()
  with flagsaver.flagsaver(**_base(tmp_path, mnist_dir, **overrides)):
    assert train.main(['train']) == 2
  assert message in capsys.readouterr().err
  assert not os.path.exists(tmp_path / 'e2e')  # nothing was written


def test_missing_data_names_the_file(tmp_path, capsys):
  _parse_flags()
  with flagsaver.flagsaver(**_base(tmp_path, str(tmp_path / 'nowhere'))):
    assert train.main(['train']) == 2
  err = capsys.readouterr().err
  assert 'nowhere' in err and '--data_dir' in err


def test_summary_and_dp_report(tmp_path, mnist_dir):
  _parse_flags()
  with flagsaver.flagsaver(**_base(
      tmp_path, mnist_dir, dp='gaussian_fixed', noise_multiplier=1.0,
      clip_norm=0.5)):
    assert train.main(['train']) == 0
  with open(tmp_path / 'e2e' / 'summary.json') as f:
    summary = json.load(f)
  for key in ('task', 'algorithm', 'rounds_completed', 'seconds_per_round',
              'eval', 'privacy', 'flags'):
    assert key in summary
  assert summary['task'] == 'mnist_preference'
  assert summary['algorithm'] == 'global_plus'
  assert summary['rounds_completed'] == 2
  assert summary['eval']['num_clients'] == 40
  assert 0.0 <= summary['eval']['f1'] <= 1.0
  privacy = summary['privacy']
  assert np.isfinite(privacy['epsilon']) and privacy['epsilon'] > 0
  assert privacy['noise_multiplier'] == 1.0
  assert privacy['clip_norm'] == 0.5
  assert privacy['clients_per_round'] == 5
  assert privacy['population'] == 40
  assert privacy['rounds'] == 2
  assert privacy['sampling'] == 'fixed_size'
  assert summary['flags']['privacy']['dp'] == 'gaussian_fixed'
  # Each released value says whether epsilon covers it, and why. Under DP
  # without --release_unnoised_metrics nothing un-noised about the cohort's
  # training is released.
  labels = {r['name']: (r['covered'], r['basis']) for r in privacy['released']}
  assert labels == {
      'shared model update': (True, 'dp'),
      'aggregator and finalizer measurements': (True, 'dp'),
      'round number, configuration, epsilon and delta': (True, 'public'),
      'cohort_size': (True, 'public'),  # fixed-size: always 5
      'round_seconds and other timings': (False, 'timing'),
      'evaluation metrics': (False, 'evaluation')}
  assert privacy['train_metrics_released'] is False
  assert not any(k.startswith('train/') for k in summary['final_train_metrics'])
  # Metrics went through tff.program release managers.
  with open(tmp_path / 'e2e' / 'train_metrics.csv') as f:
    rows = f.read().strip().splitlines()
  assert rows[0].startswith('round') and len(rows) == 3
  assert 'train/' not in rows[0] and 'cohort_size' in rows[0]
  assert 'round_seconds' in rows[0]


def test_unnoised_metrics_under_dp_only_when_asked(tmp_path, mnist_dir):
  _parse_flags()
  with flagsaver.flagsaver(**_base(
      tmp_path, mnist_dir, dp='gaussian_fixed', noise_multiplier=1.0,
      sampling='poisson', release_unnoised_metrics=True, rounds=1)):
    assert train.main(['train']) == 0
  with open(tmp_path / 'e2e' / 'summary.json') as f:
    summary = json.load(f)
  labels = {r['name']: (r['covered'], r['basis'])
            for r in summary['privacy']['released']}
  assert labels['training-metric sums'] == (False, 'unnoised')
  assert labels['cohort_size'] == (False, 'unnoised')  # Poisson: varies
  assert summary['privacy']['train_metrics_released'] is True
  assert 'train/loss' in summary['final_train_metrics']
  with open(tmp_path / 'e2e' / 'train_metrics.csv') as f:
    header = f.readline()
  assert 'train/loss' in header and 'cohort_size' in header


def test_poisson_cohort_size_withheld_under_dp(tmp_path, mnist_dir):
  _parse_flags()
  with flagsaver.flagsaver(**_base(
      tmp_path, mnist_dir, dp='gaussian_fixed', noise_multiplier=1.0,
      sampling='poisson', rounds=1)):
    assert train.main(['train']) == 0
  with open(tmp_path / 'e2e' / 'summary.json') as f:
    summary = json.load(f)
  names = {r['name'] for r in summary['privacy']['released']}
  assert 'cohort_size' not in names and 'training-metric sums' not in names
  assert set(summary['final_train_metrics']) <= {'round_seconds'} | {
      k for k in summary['final_train_metrics']
      if k.startswith(('aggregator/', 'finalizer/'))}
  with open(tmp_path / 'e2e' / 'train_metrics.csv') as f:
    header = f.readline()
  assert 'cohort_size' not in header and 'train/' not in header


def test_noised_personal_heads_report_their_own_epsilon(tmp_path, mnist_dir):
  _parse_flags()
  with flagsaver.flagsaver(**_base(
      tmp_path, mnist_dir, algorithm='pfedme', dp='gaussian_fixed',
      noise_multiplier=1.3, clip_norm=0.5, dp_personal_heads='noised',
      server_optimizer='sgd', server_learning_rate=1.0,
      eval_strategies=['ft=fine_tune'])):
    assert train.main(['train']) == 0
  with open(tmp_path / 'e2e' / 'summary.json') as f:
    summary = json.load(f)
  privacy = summary['privacy']
  heads = privacy['personal_heads']
  # Two rounds, no intermediate evaluation: at most 2 + 3 passes, and the
  # fine_tune strategy's at the last evaluation and the held-out test;
  # accounted under the shared part's relation (replace-one for fixed-size
  # sampling).
  assert heads['passes'] == 5 + 2
  assert heads['neighboring_relation'] == privacy['neighboring_relation']
  assert heads['epsilon'] == pytest.approx(private_noise.personal_epsilon(
      1.3, 7, privacy['delta'], 'replace_one'))
  assert (heads['noise_multiplier'], heads['clip_norm']) == (1.3, 0.5)
  assert summary['flags']['privacy']['dp_personal_heads'] == 'noised'
  with open(tmp_path / 'e2e' / 'run_config.json') as f:
    assert json.load(f)['config']['dp_personal_heads'] == 'noised'


def _kill_values(out_dir, name, **extra):
  return dict(task='mnist_preference', algorithm='global_plus',
              data_dir=os.path.join(REPO, '..', 'shared', 'data', 'mnist'),
              num_users=60, rounds=6, clients_per_round=8,
              server_learning_rate=0.01, seed=7, root_output_dir=str(out_dir),
              experiment_name=name, **extra)


def _cmd(out_dir, name, extra=()):
  return [sys.executable, '-m', 'binaries.train'] + [
      f'--{k}={v}' for k, v in _kill_values(out_dir, name).items()] + list(
          extra)


def test_resume_under_other_settings_is_refused(tmp_path, mnist_dir,
                                                capsys):
  """A resumed run is the run that started: its settings are recorded."""
  _parse_flags()
  dp = dict(dp='gaussian_fixed', target_epsilon=8.0, clip_norm=0.5)
  with flagsaver.flagsaver(**_base(tmp_path, mnist_dir, rounds=1, **dp)):
    assert train.main(['train']) == 0
  run = tmp_path / 'e2e'
  with open(run / 'run_config.json') as f:
    recorded = json.load(f)
  z_one_round = recorded['config']['dp']['noise_multiplier']
  assert z_one_round > 0 and recorded['flags']['client_learning_rate']
  before = files.tree_digest(run)
  # Another learning rate.
  with flagsaver.flagsaver(**_base(tmp_path, mnist_dir, rounds=2, resume=True,
                                   client_learning_rate=0.05, **dp)):
    assert train.main(['train']) == 3
  err = capsys.readouterr().err
  assert 'client_learning_rate' in err and '0.05 now' in err
  # More rounds at the same target epsilon: the calibrated noise multiplier
  # would change under rounds already noised at the old one.
  with flagsaver.flagsaver(**_base(tmp_path, mnist_dir, rounds=3, resume=True,
                                   **dp)):
    assert train.main(['train']) == 3
  err = capsys.readouterr().err
  assert 'dp.noise_multiplier' in err and repr(z_one_round) in err
  assert files.tree_digest(run) == before  # Nothing was changed.
  # The same settings, at the same noise multiplier, extend it.
  dp_fixed = dict(dp='gaussian_fixed', noise_multiplier=z_one_round,
                  clip_norm=0.5)
  with flagsaver.flagsaver(**_base(tmp_path, mnist_dir, rounds=2, resume=True,
                                   **dp_fixed)):
    code = train.main(['train'])
  err = capsys.readouterr().err
  # target_epsilon -> noise_multiplier is a flag difference, named as such.
  assert code == 3 and '--target_epsilon: 8.0' in err


def test_a_running_experiment_refuses_a_second_program(tmp_path, mnist_dir,
                                                       capsys):
  """While binaries.train runs, neither a resume nor an evaluation of the
  same directory starts; both name the running process."""
  _parse_flags()
  proc = subprocess.Popen(_cmd(tmp_path, 'locked', ['--rounds=500']),
                          cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True)
  try:
    for line in proc.stdout:
      if line.startswith('round 1/'):
        break
    assert proc.poll() is None
    with flagsaver.flagsaver(**_base(tmp_path, mnist_dir,
                                     experiment_name='locked', resume=True)):
      assert train.main(['train']) == 3
    assert f'in use by PID {proc.pid}' in capsys.readouterr().err
    with flagsaver.flagsaver(**_base(tmp_path, mnist_dir,
                                     experiment_name='locked')):
      assert evaluate.main(['evaluate']) == 3
    assert f'in use by PID {proc.pid}' in capsys.readouterr().err
    assert proc.poll() is None
  finally:
    proc.kill()
    proc.wait()


@pytest.mark.parametrize('name', ['../outside', 'a/b', '..', ''])
def test_experiment_name_must_be_a_plain_name(tmp_path, mnist_dir, capsys,
                                              name):
  _parse_flags()
  root = tmp_path / 'root'
  with flagsaver.flagsaver(**_base(root, mnist_dir, experiment_name=name)):
    assert train.main(['train']) == 2
  assert 'experiment_name must be a plain' in capsys.readouterr().err
  assert not os.path.exists(tmp_path / 'outside')
  assert not os.path.exists(root)  # nothing was written
