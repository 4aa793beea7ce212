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
from tff_personal.config import experiment
from tff_personal.core import client_state as client_state_lib
from tff_personal.reports import curve_bands
from tff_personal.reports import reporting
from tff_personal.run import run_analysis
from tff_personal.run import runs


def _flags(**overrides):
  values = dict(
      data_dir=conftest.SHARED_DATA, seeds=1, rounds=None,
      clients_per_round=None, group_vocab_size=200, group_seq_len=6,
      group_embedding_dim=4, group_lstm_units=4, group_lstm_layers=1,
      group_rounds=2, group_group_rounds=1, group_clients_per_round=6,
      group_group_clients_per_round=2, group_local_epochs=1,
      group_client_lr=1.0, group_server_lr=0.01,
      group_personalization_epochs=2, group_personalization_lrs=['0.1', '1'],
      group_eval_clients_per_group=1, group_sweep_clients_per_group=1,
      group_max_clients=30, group_clustering=True, group_cluster_clients=8,
      group_plateau_max_rounds=4, group_plateau_eval_every=2,
      group_plateau_window=2, group_plateau_tolerance=0.01,
      group_validation_clients_per_group=2)
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
  cells = {(r['method'], r['setting']['group']): r for r in records
           if 'fl' not in r['setting']}
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
  _check_controls(f, root, records)
  ari = cells[('update_clustering', 'all')]['metrics']
  assert -1.0 <= ari['adjusted_rand_index'] <= 1.0 and ari['clients'] == 8
  assert os.path.exists(os.path.join(root, 'figures',
                                     'group_relative_change_hist.png'))
  _check_table_curves(f, root, cells)
  _check_runs_share_the_fl_model_and_counts(f, root)
  # Rerunning finds every cell done, and the tables are rebuilt from the file.
  p = reporting.plan('group', 'table4_computation', root, f)
  assert not p.pending
  assert os.path.exists(os.path.join(root, 'tables', 'group', 'table3.md'))


def _check_controls(f, root, records):
  """The controls' cells: every method and group, T from the plateau rule
  on the recorded curve, margins over the better control, and the three
  control runs (genres, shuffled, one group) on the same FL model."""
  cfg = group._config(f)
  cells = {(r['method'], r['setting']['group']): r['metrics']
           for r in records if r['setting'].get('fl') == group.PLATEAU}
  groups = list(sg.GROUP_NAMES) + ['all']
  assert set(cells) == {(m, g) for m in group.CONTROL_METHODS for g in groups}
  (directory,) = glob.glob(os.path.join(root, 'runs', 'group', 'pipeline',
                                        '*', 'seed_0', 'controls_*'))
  with open(os.path.join(directory, 'plateau.json')) as fh:
    plateau = json.load(fh)
  curve = {int(r): v for r, v in plateau['curve'].items()}
  assert sorted(curve) == [2, 4]  # Every eval_every rounds, to the end.
  expected = run_analysis.plateau_round(curve, 2, 0.01) or 4
  assert plateau['rounds'] == expected
  for (method, g), m in cells.items():
    assert m['fl_rounds'] == expected and m['perplexity'] == m['perplexity']
    assert m['clients'] == cells[('fl', g)]['clients']
    if method in group.CONTROLS_OF:
      assert m['margin'] == pytest.approx(m['perplexity'] - min(
          cells[(c, g)]['perplexity'] for c in group.CONTROLS_OF[method]))
  task = group._task(cfg, 0)
  cfg_t = dict(cfg, rounds=expected)
  fl_weights = []
  for grouping in ('task', 'shuffled', 'one'):
    config = group.train_config(cfg_t, 0, directory, grouping,
                                len(task.group_names))
    fl_weights.append(runs.Run.open(config.experiment_dir,
                                    task=task).weights(stage='fl'))
    sizes = sorted(len(m) for m in experiment.group_members(
        task, config, grouping).values())
    if grouping == 'shuffled':
      assert sizes == sorted(len(task.clients_of(g))
                             for g in task.group_names)
  assert os.path.exists(os.path.join(root, 'figures', 'group_fl_plateau.png'))
  _check_control_curves(f, root, directory, cells)
  for other in fl_weights[1:]:
    for x, y in zip(fl_weights[0].trainable, other.trainable, strict=True):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _check_table_curves(f, root, cells):
  """Table 3's curves: fl and perfl at every FL round, groupfl and
  groupperfl at every group round from the FL model; each curve's last
  point is the table's cell (same checkpoint, same evaluation)."""
  (directory,) = glob.glob(os.path.join(root, 'runs', 'group', 'pipeline',
                                        '*', 'seed_0'))
  with open(os.path.join(directory, 'fl_curves.json')) as fh:
    fl_curves = json.load(fh)
  with open(os.path.join(directory, 'curves.json')) as fh:
    curves = json.load(fh)
  assert set(curves) == {'groupfl', 'groupperfl'}
  assert fl_curves['round'] == list(range(1, f.group_rounds + 1))
  for g in list(sg.GROUP_NAMES) + ['all']:
    for method in ('fl', 'perfl'):
      assert fl_curves[method][g][-1] == pytest.approx(
          cells[(method, g)]['metrics']['perplexity'], rel=1e-9)
    for method in ('groupfl', 'groupperfl'):
      assert curves[method]['round'] == list(range(f.group_group_rounds + 1))
      assert curves[method][g][-1] == pytest.approx(
          cells[(method, g)]['metrics']['perplexity'], rel=1e-9)
    assert curves['groupfl'][g][0] == pytest.approx(
        cells[('fl', g)]['metrics']['perplexity'], rel=1e-9)
  assert os.path.exists(os.path.join(root, 'figures', 'group_curves.png'))
  # A run that did not keep a round's checkpoint is refused, not drawn
  # with the rounds it has.
  cfg = group._config(f)
  task = group._task(cfg, 0)
  run = runs.Run.open(group.train_config(cfg, 0, directory).experiment_dir,
                      task=task)
  with pytest.raises(ValueError, match=r'no checkpoint of rounds \[3\]'):
    group._global_curves(task, cfg, run, 'fl', 1, f.group_rounds + 1, [],
                         1.0, print)


def _check_control_curves(f, root, directory, cells):
  """The curves: rounds 0..T_g of every group-stage method; the last
  round is the table's cell (same checkpoint, same evaluation), round 0 is
  the FL model at T for every run (personalized: at the method's lr)."""
  with open(os.path.join(directory, 'curves.json')) as fh:
    curves = json.load(fh)
  assert set(curves) == set(group.CONTROL_METHODS) - {'fl', 'perfl'}
  groups = list(sg.GROUP_NAMES) + ['all']
  for method, curve in curves.items():
    assert curve['round'] == list(range(f.group_group_rounds + 1))
    for g in groups:
      assert len(curve[g]) == len(curve['round'])
      assert curve[g][-1] == pytest.approx(cells[(method, g)]['perplexity'],
                                           rel=1e-9)
      start = 'perfl' if 'perfl' in method else 'fl'
      if (cells[(method, g)].get('personalization_lr') ==
          cells[(start, g)].get('personalization_lr')):
        assert curve[g][0] == pytest.approx(cells[(start, g)]['perplexity'],
                                            rel=1e-9)
  # fl and perfl over FL's rounds: at every kept checkpoint (every
  # 2 * eval_every rounds), on the same clients and pools.
  with open(os.path.join(directory, 'fl_curves.json')) as fh:
    fl_curves = json.load(fh)
  step = 2 * f.group_plateau_eval_every
  assert fl_curves['round'] == list(range(
      step, f.group_plateau_max_rounds + 1, step))
  for method in ('fl', 'perfl'):
    assert set(fl_curves[method]) == set(groups)
    assert all(len(v) == len(fl_curves['round'])
               for v in fl_curves[method].values())
  # The three unpersonalized runs start from one FL model: one round 0.
  assert (curves['groupfl']['all'][0] == curves['fl_more']['all'][0] ==
          curves['groupfl_shuffled']['all'][0])
  assert os.path.exists(os.path.join(root, 'figures',
                                     'group_control_curves.png'))


def test_validation_clients_are_disjoint_from_evaluated_and_sweep(
    registered):
  cfg = group._config(_flags())
  task = group._task(cfg, 0)
  eval_clients, sweep = group._samples(task, cfg, 0)
  validation = group._samples(task, cfg, 0, validation=True)
  assert validation and not set(validation) & (set(eval_clients) | set(sweep))
  assert all(task.num_eval(c) > 0 for c in validation)
  with pytest.raises(ValueError, match='no client left for validation'):
    group._samples(task, dict(cfg, eval_clients_per_group=0), 0,
                   validation=True)


def test_data_seed_fixes_the_samples_and_leaves_old_digests(registered):
  cfg = group._config(_flags())
  assert 'data_seed' not in cfg  # unset: the recorded caches' digests hold
  fixed = group._config(_flags(data_seed=0))
  assert fixed['data_seed'] == 0
  task = group._task(fixed, 0)
  samples = [group._samples(task, fixed, seed) for seed in (0, 1)]
  assert samples[0] == samples[1]
  assert (group._samples(task, fixed, 1, validation=True)
          == group._samples(task, cfg, 0, validation=True))
  # Without it, another seed samples other clients.
  assert group._samples(group._task(cfg, 1), cfg, 1) != samples[0]


def _check_runs_share_the_fl_model_and_counts(f, root):
  """The participation counts the costs use (`Run.participations`, which
  replays the sampling) are the client-state stores' own."""
  cfg = group._config(f)
  (directory,) = glob.glob(os.path.join(root, 'runs', 'group', 'pipeline',
                                        '*', 'seed_0'))
  task = group._task(cfg, 0)
  main = group.train_config(cfg, 0, directory)
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
  counted = runs.Run.open(main.experiment_dir, task).participations(
      stage='fl')
  assert stored == [counted.get(c, 0) for c in range(task.population)]
  assert sum(stored) == cfg['rounds'] * cfg['clients_per_round']


class _FakeRun:
  """The part of `runs.Run` the training figure reads: its released
  training rows per stage and group."""

  def __init__(self, fl_losses, group_losses):
    rows = lambda losses: [{'round': r, 'train/loss': l}
                           for r, l in enumerate(losses, 1)]
    self._fl, self._groups = rows(fl_losses), {
        g: rows(l) for g, l in group_losses.items()}

  def groups(self):
    return {g: [] for g in self._groups}

  def curves(self, stage=None, group=None):
    assert (stage == 'fl') != (group is not None)
    return {'train': self._fl if stage else self._groups[group], 'eval': []}


def test_training_figure_offsets_group_rounds_after_fl(tmp_path, monkeypatch):
  fakes = {}
  for seed, shift in ((0, 0.0), (1, 0.5)):
    fakes[seed] = _FakeRun([3.0 + shift, 2.0 + shift], {'comedy': [1.0]})
  # A seed killed before its first round: no rows, its groups not started.
  fakes[2] = _FakeRun([], {'comedy': []})
  for seed in fakes:
    os.makedirs(tmp_path / 'pipe' / f'seed_{seed}' / 'groupfl_task')
  monkeypatch.setattr(runs.Run, 'open', staticmethod(
      lambda d: fakes[int(os.path.basename(os.path.dirname(d))[5:])]))
  drawn = {}
  real = curve_bands.plot_seed_band
  monkeypatch.setattr(curve_bands, 'plot_seed_band',
                      lambda ax, curves, *a, **k: drawn.update(
                          {k['label']: curves}) or real(ax, curves, *a, **k))
  group.make_training_figure(str(tmp_path), str(tmp_path / 'pipe' / 'seed_0'))
  fl = drawn['fl: every client']
  assert [c['round'] for c in fl] == [[1, 2], [1, 2]]
  np.testing.assert_allclose(fl[1]['perplexity'], np.exp([3.5, 2.5]))
  # After the FL rounds, and without the killed seed's empty curve.
  assert [c['round'] for c in drawn['groupfl: comedy']] == [[3], [3]]
  assert (tmp_path / 'figures' / 'group_training_curves.png').exists()
