"""The FURL reproduction pieces: cells, purity, and one tiny end-to-end cell."""

import json
import os
import types

import numpy as np
import pytest

from papers import furl
from tasks import speaker_task
from tff_personal.reports import reporting

DATA = os.path.join(os.path.dirname(__file__), '..', '..', 'shared', 'data')
_E2E_MIN_DOCS = 300


def test_cells_skip_server_dp():
  cells = furl.cells('table2', types.SimpleNamespace(seeds=2))
  methods = {(c.method, c.setting['dp']) for c in cells}
  assert ('global_server', 'gaussian_fixed') not in methods
  assert ('personalized_fl', 'gaussian_fixed') in methods
  assert len(cells) == 2 * (4 + 2)


@pytest.mark.skipif(not os.path.isdir(os.path.join(DATA, 'friends')),
                    reason='shared data not found')
def test_speaker_task_holds_out_cold_users():
  task = speaker_task.speaker_context_task(DATA, min_docs=150, seed=0)
  n = task.data.num_users
  assert len(task.cold_client_ids) == round(0.1 * n)
  assert task.population == n - len(task.cold_client_ids)
  warm = {task.user_of(c) for c in range(task.population)}
  cold = {task.user_of(c) for c in task.cold_client_ids}
  assert not warm & cold and len(warm | cold) == n


@pytest.mark.skipif(not os.path.isdir(os.path.join(DATA, 'friends')),
                    reason='shared data not found')
def test_personalized_fl_cell_end_to_end(tmp_path):
  # Users with at least 300 documents (the most a user keeps): 25, of them
  # 23 warm and 2 cold, so one epoch is 3 rounds (at 150: 74 users, 7).
  flag_values = types.SimpleNamespace(
      data_dir=DATA, seeds=1, furl_min_docs=_E2E_MIN_DOCS, furl_fl_epochs=1,
      furl_server_epochs=1, furl_client_learning_rate=3e-3,
      furl_private_learning_rate=0.05,
      furl_server_learning_rate=3e-3, furl_target_epsilon=10.0,
      furl_clip_norm=0.5, furl_evals_per_epoch=3)
  cell = reporting.Cell('furl', 'personalized_fl',
                        {'dp': 'none', 'embedding_dim': 32}, 0)
  out_dir = cell.out_dir(str(tmp_path))
  os.makedirs(out_dir)
  metrics = furl.run_cell(cell, flag_values, out_dir)
  assert 0.0 <= metrics['accuracy'] <= 1.0
  assert 0.0 <= metrics['cold_start_accuracy'] <= 1.0
  # Personalized FL cells also test after one local pass of the embedding.
  assert 0.0 <= metrics['accuracy_fine_tuned'] <= 1.0
  with open(os.path.join(out_dir, 'fl', 'summary.json')) as f:
    summary = json.load(f)
  assert summary['test_fine_tuned']['num_clients'] == (
      summary['test']['num_clients'])
  task = furl._task(DATA, 0, _E2E_MIN_DOCS)  # pylint: disable=protected-access
  assert len(task.cold_client_ids) >= 1 and task.population > 10
  assert metrics['rounds'] == -(-task.population // 10)
  with np.load(os.path.join(out_dir, 'embeddings.npz')) as z:
    assert z['embeddings'].shape == (task.population, 32)
  with open(os.path.join(out_dir, 'curve.json')) as f:
    # Evaluated after every round: 3 points in the one epoch.
    assert json.load(f)['epoch'] == pytest.approx([1 / 3, 2 / 3, 1.0])
  purity_path = tmp_path / 'tables' / 'furl' / 'furl_purity.json'
  purity = json.loads(purity_path.read_text())['personalized_fl']
  assert purity['users'] == task.population
  assert (tmp_path / 'tables' / 'furl' / 'furl_embeddings_tsne.png').exists()


def test_evaluation_frequency_is_operational_and_checked():
  f = types.SimpleNamespace(furl_evals_per_epoch=3, furl_fl_epochs=5,
                            data_dir=None)
  assert 'furl_evals_per_epoch' not in reporting.run_config('furl', furl, f)
  assert 'furl_fl_epochs' in reporting.run_config('furl', furl, f)
  assert furl._evals_per_epoch(types.SimpleNamespace()) == 1  # pylint: disable=protected-access
  with pytest.raises(ValueError, match='furl_evals_per_epoch'):
    furl._evals_per_epoch(types.SimpleNamespace(furl_evals_per_epoch=0))  # pylint: disable=protected-access
