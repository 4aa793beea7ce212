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
