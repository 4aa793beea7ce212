"""`run_experiment(eval_ids=...)`: every evaluation tests exactly those
clients (e.g. a validation sample), and bad ids are refused before a run;
`curve_eval_clients`: the learning curve's points test a seeded subset."""

import dataclasses
import os

import pytest

from tasks import registry as task_registry
from tff_personal.config import experiment
from tff_personal.evaluation import run_evaluation
from tff_personal.run import runs


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


def _whole(seen):
  """The evaluations of every evaluated client: one may be followed by the
  re-scoring of its trained clients alone (a strict subset;
  `run_evaluation.with_never_trained`), left out here."""
  out = []
  for ids in seen:
    if not (out and set(ids) < set(out[-1])):
      out.append(ids)
  return out


def test_every_evaluation_tests_the_given_clients(task, tmp_path,
                                                  monkeypatch):
  seen = []
  evaluate = task.evaluate

  def recording(outputs, client_ids):
    seen.append([int(c) for c in client_ids])
    assert len(outputs) == len(client_ids)
    return evaluate(outputs, client_ids)

  monkeypatch.setattr(task, 'evaluate', recording)
  runs.run_experiment(task, _config(tmp_path, 'ids'),
                      log_fn=lambda s: None, eval_ids=[7, 1, 4])
  # After rounds 1 and 2 (the last is the final evaluation): each on the
  # given clients (sorted), not the 5 that eval_clients would draw.
  assert _whole(seen) == [[1, 4, 7], [1, 4, 7]]


def test_curve_points_test_a_fixed_subset_and_the_last_tests_all(
    task, tmp_path, monkeypatch):
  seen = []
  evaluate = task.evaluate

  def recording(outputs, client_ids):
    seen.append([int(c) for c in client_ids])
    return evaluate(outputs, client_ids)

  monkeypatch.setattr(task, 'evaluate', recording)
  config = dataclasses.replace(_config(tmp_path, 'curve'), rounds=3,
                               curve_eval_clients=2)
  runs.run_experiment(task, config, log_fn=lambda s: None)
  everyone = run_evaluation.eval_client_ids(12, 5, config.seed)
  subset = run_evaluation.curve_eval_ids(everyone, 2, config.seed)
  assert len(subset) == 2 and set(subset) < set(everyone)
  # Rounds 1 and 2 test the subset; round 3, the summary's, tests all 5.
  assert _whole(seen) == [subset, subset, everyone]


def test_curve_eval_ids_draws_by_seed_and_refuses_too_many():
  ids = [3, 9, 1, 7, 5]
  assert run_evaluation.curve_eval_ids(ids, 0, 0) == [1, 3, 5, 7, 9]
  draws = {tuple(run_evaluation.curve_eval_ids(ids, 3, seed))
           for seed in range(6)}
  assert len(draws) > 1  # The seed draws the subset.
  assert all(len(d) == 3 and set(d) < set(ids) for d in draws)
  with pytest.raises(ValueError, match='curve_eval_clients'):
    run_evaluation.curve_eval_ids(ids, 6, 0)


def test_too_many_curve_clients_are_refused_before_the_run(task, tmp_path):
  config = dataclasses.replace(_config(tmp_path, 'bad_curve'),
                               curve_eval_clients=6)
  with pytest.raises(ValueError, match='curve_eval_clients'):
    runs.run_experiment(task, config, log_fn=lambda s: None)
  with pytest.raises(experiment.ConfigurationError,
                     match='curve_eval_clients'):
    runs.run_experiment(
        task, dataclasses.replace(config, curve_eval_clients=2),
        log_fn=lambda s: None, eval_ids=[4])
  assert not os.path.exists(config.experiment_dir)


@pytest.mark.parametrize('ids, message', [
    ([], 'empty'), ([1, 1], 'repeats'), ([0, 12], 'outside the population')])
def test_bad_eval_ids_are_refused_before_the_run(task, tmp_path, ids,
                                                 message):
  config = _config(tmp_path, 'bad')
  with pytest.raises(experiment.ConfigurationError, match=message):
    runs.run_experiment(task, config, log_fn=lambda s: None,
                        eval_ids=ids)
  assert not os.path.exists(config.experiment_dir)


def test_validation_draw_is_disjoint_from_the_test_draw_and_seeded():
  test = run_evaluation.eval_client_ids(900, 100, seed=2)
  validation = run_evaluation.validation_client_ids(900, 100, 100, seed=2)
  assert len(validation) == 100 == len(set(validation))
  assert validation == sorted(validation)
  assert not set(validation) & set(test)
  assert all(0 <= i < 900 for i in validation)
  assert validation == run_evaluation.validation_client_ids(900, 100, 100, 2)
  assert validation != run_evaluation.validation_client_ids(900, 100, 100, 3)
  # Every user tested (eval_clients 0), or too few left: refused.
  for clients, eval_clients in ((1, 0), (801, 100), (0, 100)):
    with pytest.raises(ValueError, match='validation clients'):
      run_evaluation.validation_client_ids(900, clients, eval_clients, 2)
