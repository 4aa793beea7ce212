"""`run_experiment(eval_ids=...)`: every evaluation tests exactly those
clients (e.g. a validation sample), and bad ids are refused before a run."""

import os

import pytest

from tasks import registry as task_registry
from tff_personal import experiment


@pytest.fixture(scope='module')
def task(mnist_dir):
  return task_registry.build_task('mnist_preference', data_dir=mnist_dir,
                                  num_users=12, population='balanced',
                                  seed=3, batch_size=4, local_epochs=1)


def _config(tmp_path, name):
  return experiment.ExperimentConfig(
      algorithm='global', rounds=2, clients_per_round=3,
      root_output_dir=str(tmp_path), experiment_name=name, eval_every=1,
      eval_clients=5)


def test_every_evaluation_tests_the_given_clients(task, tmp_path,
                                                  monkeypatch):
  seen = []
  evaluate = task.evaluate

  def recording(outputs, client_ids):
    seen.append([int(c) for c in client_ids])
    assert len(outputs) == len(client_ids)
    return evaluate(outputs, client_ids)

  monkeypatch.setattr(task, 'evaluate', recording)
  experiment.run_experiment(task, _config(tmp_path, 'ids'),
                            log_fn=lambda s: None, eval_ids=[7, 1, 4])
  # After rounds 1 and 2 (the last is the final evaluation): each on the
  # given clients (sorted), not the 5 that eval_clients would draw.
  assert seen == [[1, 4, 7], [1, 4, 7]]


@pytest.mark.parametrize('ids, message', [
    ([], 'empty'), ([1, 1], 'repeats'), ([0, 12], 'outside the population')])
def test_bad_eval_ids_are_refused_before_the_run(task, tmp_path, ids,
                                                 message):
  config = _config(tmp_path, 'bad')
  with pytest.raises(experiment.ConfigurationError, match=message):
    experiment.run_experiment(task, config, log_fn=lambda s: None,
                              eval_ids=ids)
  assert not os.path.exists(config.experiment_dir)
