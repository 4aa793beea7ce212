"""The tuned benchmark: each tuning stage keeps the best validation score of
its grid over the earlier choice, the cells run at those rates, a final
cell evaluates the withheld users, and the tables read the records (no
TFF run here; the cells' runs are `papers.benchmark`'s)."""

import types

import pytest

from binaries import reproduce
from papers import benchmark
from papers import benchmark_tuned as tuned
from tff_personal.reports import reporting

del reproduce  # Registers the papers.


def _record(method, setting, score, client, server=1.0, private=None,
            seed=0):
  metrics = {'val_accuracy_client_mean': score,
             'client_learning_rate': client, 'server_learning_rate': server}
  if private is not None:
    metrics['private_learning_rate'] = private
  return {'paper': tuned.PAPER, 'method': method, 'setting': setting,
          'seed': seed, 'metrics': metrics}


def _records():
  """Ditto: client 3e-3 wins, then personal 1e-2, then server 1.0 stays;
  FedAvg: client 1e-3 (a tie with 1e-2 keeps the earlier), server 2.0."""
  out = []
  for lr, score in zip(tuned.CLIENT_LRS, (0.50, 0.55, 0.60, 0.52)):
    out.append(_record('ditto', {'stage': 'tune_client_lr', 'client_lr': lr},
                       score, lr))
  for lr, score in zip(tuned.PRIVATE_LRS, (0.58, 0.59, 0.61, 0.62)):
    out.append(_record('ditto', {'stage': 'tune_private_lr',
                                 'private_lr': lr}, score, 3e-3, private=lr))
  for lr, score in zip(tuned.SERVER_LRS, (0.40, 0.62)):  # 0.62: a tie.
    out.append(_record('ditto', {'stage': 'tune_server_lr', 'server_lr': lr},
                       score, 3e-3, server=lr, private=1e-2))
  for lr, score in zip(tuned.CLIENT_LRS, (0.50, 0.53, 0.51, 0.53)):
    out.append(_record('global', {'stage': 'tune_client_lr',
                                  'client_lr': lr}, score, lr))
  for lr, score in zip(tuned.SERVER_LRS, (0.52, 0.54)):
    out.append(_record('global', {'stage': 'tune_server_lr',
                                  'server_lr': lr}, score, 1e-3, server=lr))
  return out


def test_rows_grids_and_registration():
  assert tuned.METHODS == benchmark.methods_for(tuned.TASK)
  assert reporting.get_paper(tuned.PAPER) is tuned
  for grid in (tuned.CLIENT_LRS, tuned.PRIVATE_LRS,
               tuned.SERVER_LRS + (tuned.DEFAULT_SERVER_LR,)):
    assert len(grid) <= 4
  assert set(tuned.PRIVATE_LR_METHODS) <= set(tuned.METHODS)
  assert len(tuned.cells('final', types.SimpleNamespace(seeds=3))) == (
      len(tuned.METHODS) * 2 * 3)


def test_each_stage_keeps_the_best_of_its_grid_and_the_earlier_choice():
  records = _records()
  assert tuned.chosen(records, 'ditto', 'tune_client_lr') == (
      tuned.Rates(client=3e-3), 0.60)
  assert tuned.chosen(records, 'ditto', 'tune_private_lr') == (
      tuned.Rates(client=3e-3, private=1e-2), 0.62)
  assert tuned.chosen(records, 'ditto') == (
      tuned.Rates(client=3e-3, private=1e-2), 0.62)
  # No personal stage for FedAvg; a tie keeps the earlier grid value.
  assert tuned.chosen(records, 'global') == (
      tuned.Rates(client=1e-3, server=2.0), 0.54)
  # DP and other seeds' records do not choose.
  assert tuned.chosen(records + [_record(
      'global', {'stage': 'tune_client_lr', 'client_lr': 1e-2}, 0.9, 1e-2,
      seed=1)], 'global')[0].client == 1e-3
  with pytest.raises(ValueError, match='tune_client_lr'):
    tuned.chosen(records, 'fedrep')


def test_a_cell_runs_at_its_grid_value_over_the_earlier_choices():
  records = _records()

  def rates(stage, **setting):
    return tuned.cell_rates(reporting.Cell(
        tuned.PAPER, 'ditto', dict(stage=stage, **setting), 0), records)

  assert rates('tune_client_lr', client_lr=1e-2) == tuned.Rates(client=1e-2)
  assert rates('tune_private_lr', private_lr=3e-4) == tuned.Rates(
      client=3e-3, private=3e-4)
  assert rates('tune_server_lr', server_lr=0.5) == tuned.Rates(
      client=3e-3, private=1e-2, server=0.5)
  assert rates('final', dp='gaussian_fixed') == tuned.Rates(
      client=3e-3, private=1e-2)


def test_a_final_cell_is_the_benchmarks_run_with_withheld_users(tmp_path):
  flags = types.SimpleNamespace(
      benchmark_tuned_rounds=30, benchmark_tuned_clients_per_round=10,
      benchmark_tuned_eval_clients=100, benchmark_tuned_target_epsilon=8.0,
      benchmark_tuned_clip_norm=0.5)
  rates = tuned.Rates(client=3e-3, private=1e-2, server=2.0)
  final = tuned.cell_spec(reporting.Cell(
      tuned.PAPER, 'ditto', {'stage': 'final', 'dp': 'gaussian_fixed'}, 1),
                          flags, str(tmp_path), 900, rates)
  assert final.task == tuned.TASK
  assert final.task_options['withheld_clients'] == tuned.WITHHELD
  assert final.loop.personal_init == 'model'
  assert (final.loop.rounds, final.loop.clients_per_round,
          final.loop.seed) == (30, 10, 1)
  assert (final.optimizers.client_learning_rate,
          final.optimizers.private_learning_rate,
          final.optimizers.server_learning_rate) == (3e-3, 1e-2, 2.0)
  assert final.privacy.mechanism == 'gaussian_fixed'
  assert final.privacy.target_epsilon == 8.0
  assert final.privacy.clip_norm == 0.5
  assert final.evaluation.strategies == (
      'cold=cold_start(start=global,samples=0/all)',)
  tuning = tuned.cell_spec(reporting.Cell(
      tuned.PAPER, 'fedrep', {'stage': 'tune_client_lr', 'client_lr': 1e-3},
      0), flags, str(tmp_path), 900, tuned.Rates())
  assert tuning.privacy.mechanism == 'none'
  assert not tuning.evaluation.strategies
  assert 'start=initial' in tuned.cold_start_strategy('fedrep')
  # FedBABU, with nothing private, is a new user from the global model.
  babu = tuned.cell_spec(reporting.Cell(
      tuned.PAPER, 'fedbabu', {'stage': 'final', 'dp': 'none'}, 0), flags,
                         str(tmp_path), 900, tuned.Rates())
  assert babu.evaluation.strategies == (
      'cold=cold_start(start=initial,samples=0/all)',)


def test_tables_read_the_records():
  final = []
  for seed, (trained, cold) in enumerate(((0.6, 0.7), (0.62, 0.72))):
    for dp in ('none', 'gaussian_fixed'):
      final.append({
          'paper': tuned.PAPER, 'method': 'global', 'seed': seed,
          'setting': {'stage': 'final', 'dp': dp}, 'seconds': 30.0,
          'metrics': {'trained_accuracy_client_mean': trained,
                      'cold_accuracy_client_mean': cold,
                      'trained_accuracy_pooled': trained,
                      'cold_accuracy_pooled': cold}})
  records = _records() + final
  table = tuned.EXTRA_TABLES['accuracy_client_mean'](records)
  assert ('| global | 0.610 ± 0.014 (2) | 0.610 ± 0.014 (2) | '
          '0.710 ± 0.014 (2) | 0.710 ± 0.014 (2) |') in table
  assert '| fedrep | — | — | — | — |' in table
  rates = tuned.EXTRA_TABLES['rates'](records)
  assert '| ditto | 0.003 | 0.01 | 1 | 0.620 |' in rates
  assert '| global | 0.001 | not tuned | 2 | 0.540 |' in rates
  wall = tuned.EXTRA_TABLES['wall_time'](records)
  assert '| final | 4 | 2.0 |' in wall
