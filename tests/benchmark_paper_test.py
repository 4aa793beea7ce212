"""The personalization benchmark: its rows are the methods each task fits,
and a cell scores the trained and never-trained clients apart, which
partition the pooled score (one DP cell, end to end, with its epsilon)."""

import os
import types

import pytest

from papers import benchmark
from tff_personal.reports import reporting

DATA = os.path.join(os.path.dirname(__file__), '..', '..', 'shared', 'data')


def test_rows_are_the_methods_each_task_fits():
  assert 'knn_per' in benchmark.methods_for('label_skew_mnist')
  assert 'global_plus' not in benchmark.methods_for('label_skew_mnist')
  assert 'global_plus' in benchmark.methods_for('speaker_context')
  assert 'knn_per' not in benchmark.methods_for('shakespeare_groups')
  for task in benchmark.TASKS:
    assert benchmark.TABLES[task].methods == benchmark.methods_for(task)


@pytest.mark.skipif(not os.path.isdir(os.path.join(DATA, 'mnist')),
                    reason='shared data not found')
@pytest.mark.parametrize('task', ['label_skew_mnist', 'mnist_client_data'])
def test_a_dp_cell_scores_trained_and_never_trained_apart(task, tmp_path):
  flag_values = types.SimpleNamespace(
      data_dir=DATA, seeds=1, data_seed=None, benchmark_rounds=2,
      benchmark_clients_per_round=20, benchmark_eval_clients=20,
      benchmark_target_epsilon=8.0, benchmark_clip_norm=0.5)
  cell = reporting.Cell('benchmark', 'fedbabu',
                        {'task': task, 'dp': 'gaussian_fixed'}, 0)
  metrics = benchmark.run_cell(cell, flag_values, str(tmp_path))
  never = metrics['never_trained_clients']
  metric = benchmark.TASKS[task][2]  # the table's metric, as the task has it
  assert 0 < never < 20
  # Every client tests on as many examples, so the mean over clients is
  # the client-weighted mean of the two parts.
  parts = ((20 - never) * metrics['trained_' + metric]
           + never * metrics['never_trained_' + metric]) / 20
  assert metrics[metric] == pytest.approx(parts, abs=1e-9)
  assert metrics['epsilon'] == pytest.approx(8.0, rel=0.05)
  assert 0 < metrics['delta'] < 1e-2 and metrics['rounds'] == 2
