"""Multi-stage algorithms on the one run path (FedDVA: VAE, then classifier).

A run stopped after its first stage and resumed computes what the
uninterrupted run computes; each stage keeps its own checkpoints; the
privacy report accounts the rounds of every stage.
"""

import os

import numpy as np
import pytest
import tensorflow as tf

from tasks import registry as task_registry
from tff_personal import experiment
from tff_personal import runs
from tff_personal.core import privacy
from tff_personal.core import stages
from tff_personal.core import training_loop

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


def test_staged_run_resumes_to_the_uninterrupted_result(task, tmp_path):
  whole = _config(tmp_path, 'whole', rounds=2)
  runs.run_experiment(task, whole, log_fn=lambda s: None)
  pretrain_dir = experiment.stage_directory(whole, 'pretrain')
  assert training_loop.checkpoint_rounds(pretrain_dir)[-1] == 2
  assert training_loop.checkpoint_rounds(whole.experiment_dir)[-1] == 2
  # Stopped after one classifier round, then resumed to two: the VAE stage
  # runs no round again and the classifier continues from its checkpoint.
  first = _config(tmp_path, 'split', rounds=1)
  runs.run_experiment(task, first, log_fn=lambda s: None)
  logs = []
  runs.run_experiment(
      task, _config(tmp_path, 'split', rounds=2, resume=True),
      log_fn=logs.append)
  assert not any(line.startswith('[pretrain] round') for line in logs), logs
  for a, b in zip(_final_weights(task, whole),
                  _final_weights(task, _config(tmp_path, 'split', 2))):
    np.testing.assert_array_equal(a, b)


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
