"""The generated task: users drawn on demand, and the loop at a million
users storing only the users it sampled."""

import os
import sqlite3

import numpy as np
import pytest

from tasks import registry as task_registry
from tff_personal.config import experiment
from tff_personal.core import training_loop
from tff_personal.run import runs


def _task(**kwargs):
  return task_registry.build_task('synthetic', **{'num_users': 1_000_000,
                                                  'seed': 4, **kwargs})


def test_users_are_a_pure_function_of_seed_and_id():
  task = _task()
  a, b = task.eval_batches([7, 999_999])
  again = task.eval_batches([7])[0]
  np.testing.assert_array_equal(a.examples['x'], again.examples['x'])
  assert not np.allclose(a.examples['x'], b.examples['x'])
  other_seed = _task(seed=5).eval_batches([7])[0]
  assert not np.allclose(a.examples['x'], other_seed.examples['x'])
  # Rounds visit the same examples in a fresh order.
  r1, r2 = (task.train_batches([7], r)[0] for r in (1, 2))
  np.testing.assert_array_equal(r1.examples['y'], r2.examples['y'])
  assert not all(np.array_equal(x, y) for x, y in
                 zip(r1.index_batches, r2.index_batches))
  with pytest.raises(ValueError, match='outside the population'):
    task.train_batches([1_000_000], 1)


def test_a_million_user_run_stores_only_the_sampled_users(tmp_path):
  task = _task()
  config = experiment.ExperimentConfig(
      algorithm='global_plus', rounds=2, clients_per_round=6,
      root_output_dir=str(tmp_path), experiment_name='m', embedding_dim=32,
      eval_clients=4, client_state_backend='sqlite', seed=4)
  summary = runs.run_experiment(task, config, log_fn=lambda s: None)
  assert summary['population'] == 1_000_000
  sampled = set()
  for r in (1, 2):
    sampled.update(int(c) for c in training_loop.sample_clients(
        task.population, 6, r, 4, config.sampling))
  db = os.path.join(config.experiment_dir, 'client_states',
                    'client_states.sqlite')
  with sqlite3.connect(db) as conn:
    stored = {row[0] for row in conn.execute(
        'SELECT DISTINCT client_id FROM states')}
  assert stored == sampled


def _examples(dataset):
  return {k: np.concatenate([b[k] for b in dataset.as_numpy_iterator()])
          for k in dataset.element_spec}


def test_any_registered_task_withholds_clients_as_new_users(tmp_path):
  """`withheld_clients` on a task whose builder has no such option: the
  trained clients are the others, renumbered, with their own data; the
  withheld ones are the seeded draw, evaluated on their own data and
  adapting on the first examples of theirs. A run evaluates them as new
  users from the global model, and its spec rebuilds the same task."""
  plain = _task(num_users=12)
  task = _task(num_users=12, withheld_clients=3)
  assert task.population == 9 and len(task.withheld_names) == 3
  held = [int(n) for n in task.withheld_names]
  assert held == _task(num_users=12, withheld_clients=3).withheld_ids
  assert sorted(held + task.client_ids) == list(range(12))
  assert held != _task(num_users=12, withheld_clients=3, seed=5).withheld_ids
  for i in (0, 8):  # Client i trains on its own data, and is scored so.
    got = _examples(task.train_datasets([i], 2)[0])
    want = _examples(plain.train_datasets([task.client_ids[i]], 2)[0])
    for k in want:
      np.testing.assert_array_equal(got[k], want[k])
  for i, cid in enumerate(held):
    got = _examples(task.withheld_eval_datasets([i])[0])
    want = _examples(plain.eval_datasets([cid])[0])
    np.testing.assert_array_equal(got['x'], want['x'])
    first = _examples(task.withheld_adaptation_datasets([i], 5)[0])
    train = _examples(plain.train_datasets([cid], 0)[0])
    np.testing.assert_array_equal(first['x'], train['x'][:5])
  with pytest.raises(ValueError, match='withheld client indices'):
    task.withheld_eval_datasets([3])
  with pytest.raises(ValueError, match='at least one must train'):
    _task(num_users=12, withheld_clients=12)
  config = experiment.ExperimentConfig(
      algorithm='ditto', rounds=1, clients_per_round=3, eval_clients=3,
      root_output_dir=str(tmp_path), experiment_name='cold',
      eval_strategies=('cold=cold_start(start=global,samples=0/5)',))
  run = runs.run_experiment(task, config, log_fn=lambda s: None)
  cold = run.summary['strategies']['cold']
  assert cold['users'] == 3 and cold['start'] == 'global'
  assert set(cold['samples']) == {'0', '5'}
  again = runs.Run.open(config.experiment_dir)
  assert again.spec.task_options['withheld_clients'] == 3
  assert again.task.withheld_ids == held
