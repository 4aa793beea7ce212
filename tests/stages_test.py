"""Multi-stage algorithms on the one run path (FedDVA: VAE, then classifier).

A run killed in its first stage and resumed computes what the
uninterrupted run computes; each stage keeps its own checkpoints; the
privacy report accounts the rounds of every stage.
"""

import os

import numpy as np
import pytest
import tensorflow as tf

from tasks import registry as task_registry
from tff_personal.config import experiment
from tff_personal.core import privacy
from tff_personal.core import stages
from tff_personal.core import training_loop
from tff_personal.run import runs

_OPTIONS = dict(pretrain_rounds=2, dim=2, channels='2,2,2,3', hidden=5)


@pytest.fixture(scope='module')
def task(mnist_dir):
  return task_registry.build_task(
      'marked_mnist', data_dir=mnist_dir, seed=0, num_clients=3,
      train_per_client=12, test_per_client=6, batch_size=6)


def _config(root, name, rounds, **kw):
  return experiment.ExperimentConfig(
      algorithm='feddva', rounds=rounds, clients_per_round=2,
      root_output_dir=str(root), experiment_name=name,
      algorithm_options=dict(_OPTIONS), **kw)


def _final_weights(task, config):
  proc = stages.final_process(experiment.build_process(task, config))
  state = training_loop.load_checkpoint(proc, config.experiment_dir,
                                        config.rounds)
  return [np.asarray(w) for w in
          tf.nest.flatten(proc.get_model_weights(state).trainable)]


class _Killed(Exception):
  pass


def test_staged_run_killed_mid_stage_resumes_to_the_uninterrupted_result(
    task, tmp_path, monkeypatch):
  """Killed in the second of its two VAE rounds, the run resumes from that
  stage's round-1 checkpoint and ends with exactly the uninterrupted run's
  classifier, VAE curve and decoders (the VAE stage's client states)."""
  whole = _config(tmp_path, 'whole', rounds=2)
  runs.run_experiment(task, whole, log_fn=lambda s: None)
  pretrain_dir = experiment.stage_directory(whole, 'pretrain')
  assert training_loop.checkpoint_rounds(pretrain_dir)[-1] == 2
  assert training_loop.checkpoint_rounds(whole.experiment_dir)[-1] == 2
  # Training reads the task's batches (sharded) or datasets: both fail in
  # the VAE stage's round 2.
  cls = type(task)
  real = {name: getattr(cls, name)
          for name in ('train_batches', 'train_datasets')}

  def killed_in_round_2(name):
    def read(self, client_ids, round_num):
      if round_num == 2:
        raise _Killed()
      return real[name](self, client_ids, round_num)
    return read

  for name in real:
    monkeypatch.setattr(cls, name, killed_in_round_2(name))
  split = _config(tmp_path, 'split', rounds=2)
  with pytest.raises(_Killed):
    runs.run_experiment(task, split, log_fn=lambda s: None)
  for name, method in real.items():
    monkeypatch.setattr(cls, name, method)
  assert training_loop.checkpoint_rounds(
      experiment.stage_directory(split, 'pretrain'))[-1] == 1
  logs = []
  runs.run_experiment(task, _config(tmp_path, 'split', rounds=2, resume=True),
                      log_fn=logs.append)
  # It continued from round 1 (a restart would give the same numbers).
  assert any(line.startswith('[pretrain] resumed from round 1 checkpoint')
             for line in logs), logs
  for a, b in zip(_final_weights(task, whole), _final_weights(task, split),
                  strict=True):
    np.testing.assert_array_equal(a, b)
  want, got = runs.Run.open(whole.experiment_dir), runs.Run.open(
      split.experiment_dir)
  untimed = lambda run: [
      {k: v for k, v in row.items() if 'seconds' not in k}
      for row in run.curves(stage='pretrain')['train']]
  assert got.rounds(stage='pretrain')[-1] == 2
  assert untimed(got) == untimed(want) and len(untimed(want)) == 2
  for a, b in zip(want.client_states([0, 1, 2], stage='pretrain'),
                  got.client_states([0, 1, 2], stage='pretrain'), strict=True):
    for x, y in zip(tf.nest.flatten(a), tf.nest.flatten(b), strict=True):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_privacy_covers_every_stage(task, tmp_path):
  dp = privacy.DPConfig(mechanism='gaussian_fixed', noise_multiplier=1.0,
                        clip_norm=1.0)
  config = _config(tmp_path, 'dp', rounds=1, dp=dp)
  summary = runs.run_experiment(task, config, log_fn=lambda s: None)
  resolved = experiment.validate(config, task.population)
  assert resolved.rounds == 3  # two VAE rounds and one classifier round
  want = privacy.privacy_report(resolved, 3)['epsilon']
  assert summary['privacy']['epsilon'] == pytest.approx(want)
  assert want > privacy.privacy_report(resolved, 1)['epsilon']
  assert os.path.isdir(os.path.join(config.experiment_dir, 'stages',
                                    'pretrain', 'checkpoints'))
  # Reopened from its directory alone (the task rebuilt from the record):
  # its final weights and states load into the DP process, each stage's
  # weights are there, and evaluating them again gives the run's numbers.
  run = runs.Run.open(config.experiment_dir)
  assert run.privacy_report()['epsilon'] == pytest.approx(want)
  final = run.weights()
  for a, b in zip(tf.nest.flatten(final.trainable),
                  _final_weights(task, config), strict=True):
    np.testing.assert_array_equal(a, b)
  vae = run.weights(stage='pretrain')
  assert len(vae.trainable) != len(final.trainable)
  assert len(run.client_states([0, 1, 2])) == 3
  assert run.evaluate()['eval'] == summary['eval']
  with pytest.raises(runs.RunError, match="no earlier stage 'vae'"):
    run.weights(stage='vae')
