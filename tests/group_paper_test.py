"""End-to-end test of the group paper module on a few real Shakespeare clients."""

import glob
import json
import os
import types

import numpy as np
import pytest

from papers import group
from tasks import shakespeare_groups as sg
from tests import conftest
from tff_personal import experiment
from tff_personal import reporting
from tff_personal.core import client_state as client_state_lib


def _flags(**overrides):
  values = dict(
      data_dir=conftest.SHARED_DATA, seeds=1, rounds=None,
      clients_per_round=None, group_vocab_size=200, group_seq_len=6,
      group_embedding_dim=4, group_lstm_units=4, group_lstm_layers=1,
      group_rounds=2, group_group_rounds=1, group_clients_per_round=6,
      group_group_clients_per_round=2, group_local_epochs=1,
      group_client_lr=1.0, group_server_lr=0.01,
      group_personalization_epochs=2, group_personalization_lrs=['0.1', '1'],
      group_eval_clients_per_group=2, group_sweep_clients_per_group=1,
      group_max_clients=30, group_clustering=True, group_cluster_clients=8)
  values.update(overrides)
  return types.SimpleNamespace(**values)


@pytest.fixture(scope='module')
def registered():
  if not os.path.isdir(os.path.join(conftest.SHARED_DATA, 'shakespeare')):
    pytest.skip('Shakespeare data not found')
  reporting.unregister_paper('group')
  reporting.register_paper('group', group)
  yield
  reporting.unregister_paper('group')


def test_flags_are_validated(registered):
  with pytest.raises(reporting.ConfigError, match='clients per round'):
    reporting.plan('group', 'table3', '/tmp/x', _flags(
        group_group_clients_per_round=0))
  with pytest.raises(reporting.ConfigError, match='lrs must be positive'):
    reporting.plan('group', 'table3', '/tmp/x', _flags(
        group_personalization_lrs=['0']))


def test_reproduction_records_every_method_and_group(registered, tmp_path):
  f = _flags()
  root = str(tmp_path)
  for table in ('table3', 'grouping', 'control'):
    p = reporting.plan('group', table, root, f)
    reporting.reproduce(p, f, root, log_fn=lambda s: None)
  with open(os.path.join(root, 'results.jsonl')) as fh:
    records = [json.loads(line) for line in fh]
  cells = {(r['method'], r['setting']['group']): r for r in records}
  groups = list(sg.GROUP_NAMES) + ['all']
  for method in group.METHODS:
    for g in groups:
      r = cells[(method, g)]
      assert r['paper'] == 'group' and r['seed'] == 0
      m = r['metrics']
      for key in ('perplexity', 'communication', 'computation'):
        assert key in m and m[key] == m[key]  # present and not NaN
      assert ('share_clients_improved' in m) == (method == 'groupperfl')
  for g in groups:
    fl, perfl = cells[('fl', g)]['metrics'], cells[('perfl', g)]['metrics']
    gfl = cells[('groupfl', g)]['metrics']
    gper = cells[('groupperfl', g)]['metrics']
    # Personalization costs K_l epochs and no extra communication.
    assert perfl['computation'] == pytest.approx(fl['computation'] + 2)
    assert perfl['communication'] == fl['communication']
    assert gper['computation'] == pytest.approx(gfl['computation'] + 2)
    assert gfl['communication'] >= fl['communication']
    assert 0.0 <= gper['share_clients_improved'] <= 1.0
  # 'all' pools the groups' clients.
  assert cells[('fl', 'all')]['metrics']['clients'] == sum(
      cells[('fl', g)]['metrics']['clients'] for g in sg.GROUP_NAMES)
  # The control spends GroupFL's extra client budget on global FL.
  for g in groups:
    more = cells[('fl_more', g)]['metrics']
    assert more['perplexity'] == more['perplexity']
    assert more['communication'] >= cells[('fl', g)]['metrics'][
        'communication']
    assert more['clients'] == cells[('fl', g)]['metrics']['clients']
  ari = cells[('update_clustering', 'all')]['metrics']
  assert -1.0 <= ari['adjusted_rand_index'] <= 1.0 and ari['clients'] == 8
  assert os.path.exists(os.path.join(root, 'figures',
                                     'group_relative_change_hist.png'))
  _check_runs_share_the_fl_model_and_counts(f, root)
  # Rerunning finds every cell done, and the tables are rebuilt from the file.
  p = reporting.plan('group', 'table4_computation', root, f)
  assert not p.pending
  assert os.path.exists(os.path.join(root, 'tables', 'group', 'table3.md'))


def _check_runs_share_the_fl_model_and_counts(f, root):
  """The control's run repeats the main run's FL stage exactly, and the
  participation counts the costs use (from the sampling function) are the
  client-state stores' own."""
  cfg = group._config(f)
  (directory,) = glob.glob(os.path.join(root, 'runs', 'group', 'pipeline',
                                        '*', 'seed_0'))
  task = group._task(cfg, 0)
  main = group.train_config(cfg, 0, directory)
  control = group.train_config(cfg, 0, directory, 'one',
                               len(task.group_names))
  fl_main, _, _ = group._models(task, main, 'task')
  fl_control, models, _ = group._models(task, control, 'one')
  assert list(models) == ['all']
  for x, y in zip(fl_main.trainable, fl_control.trainable, strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  fl_stage = experiment.build_process(task, main).stages[0]
  store = client_state_lib.make_store(
      main.client_state_backend,
      experiment.initial_client_state_fn(fl_stage.process, main),
      population=task.population, directory=os.path.join(
          experiment.stage_directory(main, 'fl'), 'client_states'))
  try:
    store.restore(cfg['rounds'])  # The states committed at the last round.
    stored = [int(s['rounds_participated'])
              for s in store.load(list(range(task.population)))]
  finally:
    store.close()
  counted = group._fl_participations(task, main, cfg)
  assert stored == [counted.get(c, 0) for c in range(task.population)]
  assert sum(stored) == cfg['rounds'] * cfg['clients_per_round']
