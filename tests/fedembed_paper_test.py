"""The FedEmbed reproduction: cells, tables, defaults wiring, DP, one cell."""

import contextlib
import dataclasses
import json
import os
import types

from absl import flags
from absl.testing import flagsaver
import numpy as np
import pytest

from binaries import common
from papers import fedembed
from tasks import registry as task_registry
from tff_personal.algorithms import defaults
from tff_personal.algorithms import registry as algorithm_registry
from tff_personal.core import privacy
from tff_personal.reports import reporting

FLAGS = flags.FLAGS
MNIST = os.environ.get('TFF_PERSONAL_MNIST_DIR') or os.path.join(
    os.path.dirname(__file__), '..', '..', 'shared', 'data', 'mnist')


def _flags(**kw):
  values = dict(seeds=1, data_dir=MNIST, rounds=None, clients_per_round=None,
                num_users=None, fedembed_local_epochs=None,
                fedembed_eval_clients=None, fedembed_eval_every=None,
                fedembed_curve_eval_clients=None,
                fedembed_target_epsilon=10.0, fedembed_clip_norm=None)
  values.update(kw)
  return types.SimpleNamespace(**values)


def test_table2_lists_every_method_and_skips_unregistered(monkeypatch, capsys):
  table = fedembed.TABLES['2']
  assert set(table.methods) == set(fedembed.METHODS)
  assert len(fedembed.METHODS) == 9  # the rows of the paper's Table 1
  assert {tuple(sorted(c.setting.items())) for c in table.columns} == {
      (('dp', dp), ('population', pop)) for pop in ('balanced', 'imbalanced')
      for dp in ('none', 'gaussian_fixed')}
  registered = dict(algorithm_registry.ALGORITHMS)
  registered.pop('fedrep', None)
  registered['fedembed_type'] = object()
  monkeypatch.setattr(algorithm_registry, 'ALGORITHMS', registered)
  cells = fedembed.cells('2', _flags(seeds=2))
  methods = {c.method for c in cells}
  assert 'fedrep' not in methods and 'fedembed_type' in methods
  assert len(cells) == 2 * 4 * len(methods & set(fedembed.METHODS))
  assert 'skipping fedrep' in capsys.readouterr().out


def test_table4_shares_the_imbalanced_cells_of_table2():
  cells2 = {c.key() for c in fedembed.TABLES['2'].cells(1)
            if c.setting['population'] == 'imbalanced'}
  for name in ('4', '4_25', '4_15', '4_10'):
    assert {c.key() for c in fedembed.TABLES[name].cells(1)} == cells2
  assert fedembed.TABLES['4'].metric == 'f1_prev_5'
  # Speech cells are different cells (their setting names the task).
  speech = {c.key() for c in fedembed.TABLES['3'].cells(1)}
  assert not speech & {c.key() for c in fedembed.TABLES['2'].cells(1)}


def test_macro_tables_show_the_same_cells_by_macro_f1():
  for name in ('2', '3', '3_public', '3_spectral'):
    macro = fedembed.TABLES[f'{name}_macro']
    assert macro.metric == 'f1_macro' and fedembed.TABLES[name].metric == 'f1'
    assert ({c.key() for c in macro.cells(2)}
            == {c.key() for c in fedembed.TABLES[name].cells(2)})
    assert macro.paper_values == fedembed.TABLES[name].paper_values


def test_cell_metrics_record_macro_f1_by_prevalence_when_evaluated():
  per_group = {k: 0.05 * k for k in range(20)}
  summary = {'eval': {'f1': 0.5, 'accuracy': 0.6, 'auc': 0.7,
                      'f1_user_mean': 0.5, 'num_clients': 20,
                      'f1_per_group': per_group},
             'rounds_completed': 3, 'seconds_per_round': 1.0,
             'population': 100}
  old = fedembed.cell_metrics(summary, fedembed.SPEECH_PREVALENCE)
  assert 'f1_macro' not in old and 'f1_prev_20' in old  # older summaries
  summary['eval'].update(
      f1_macro=0.4, f1_macro_per_group={k: 1 - v for k, v in per_group.items()})
  m = fedembed.cell_metrics(summary, fedembed.SPEECH_PREVALENCE)
  assert m['f1_macro'] == 0.4
  assert m['f1_macro_prev_20'] == pytest.approx(1.0)
  assert m['f1_macro_prev_8'] == pytest.approx(1 - 0.25)
  assert m['f1_prev_8'] == pytest.approx(0.25)


def test_prevalence_f1_averages_the_right_groups():
  per_group = {str(k): 0.1 * k for k in range(10)}
  out = fedembed.prevalence_f1(per_group, fedembed.MNIST_PREVALENCE)
  assert out['f1_prev_25'] == pytest.approx(0.0)
  assert out['f1_prev_15'] == pytest.approx(0.1)
  assert out['f1_prev_10'] == pytest.approx(np.mean([0.2, 0.3, 0.4, 0.5]))
  assert out['f1_prev_5'] == pytest.approx(np.mean([0.6, 0.7, 0.8, 0.9]))
  speech = fedembed.prevalence_f1({str(k): float(k) for k in range(20)},
                                  fedembed.SPEECH_PREVALENCE)
  assert speech['f1_prev_20'] == 0.0 and speech['f1_prev_8'] == 5.0
  assert speech['f1_prev_4'] == pytest.approx(
      np.mean([k for k in range(20) if k not in (0, 5)]))


def _fabricated_results(path, rng):
  results = reporting.ResultsFile(path)
  values = {}
  for method in ('fedembed_prototype', 'global'):
    for column in fedembed.TABLES['2'].columns:
      for seed in range(3):
        per_group = {str(k): float(rng.uniform()) for k in range(10)}
        prevalence = (fedembed.MNIST_PREVALENCE
                      if column.setting['population'] == 'imbalanced'
                      else (10,) * 10)
        metrics = {'f1': float(np.mean(list(per_group.values())))}
        metrics.update(fedembed.prevalence_f1(per_group, prevalence))
        if column.setting['dp'] != 'none':
          metrics.update(epsilon=9.5 + 0.1 * seed, delta=1 / 9001,
                         noise_multiplier=0.87, clip_norm=0.1)
        results.append(reporting.Cell('fedembed', method, column.setting,
                                      seed), metrics)
        values.setdefault((method, column.name), []).append(metrics)
  return results, values


def test_tables_render_from_a_results_file(tmp_path):
  rng = np.random.default_rng(0)
  results, values = _fabricated_results(str(tmp_path / 'results.jsonl'), rng)
  md = reporting.render_markdown(results, fedembed.TABLES['2'])
  v = [m['f1'] for m in values[('fedembed_prototype', 'balanced None')]]
  assert f'{np.mean(v):.2f} ± {np.std(v, ddof=1):.2f} (3)' in md
  assert '0.88 ± 0.02' in md  # the paper's number next to ours
  md4 = reporting.render_markdown(results, fedembed.TABLES['4'])
  v5 = [m['f1_prev_5'] for m in values[('global', 'imbalanced Gaussian')]]
  assert f'{np.mean(v5):.2f} ± {np.std(v5, ddof=1):.2f} (3)' in md4
  both = fedembed.render_by_prevalence(results, '4')
  row = next(l for l in both.splitlines() if l.startswith('| global |'))
  cells = [c.strip() for c in row.strip('|').split('|')]
  assert len(cells) == 1 + 2 * 4
  v25 = [m['f1_prev_25'] for m in values[('global', 'imbalanced None')]]
  assert cells[1] == (f'{np.mean(v25):.2f} ± {np.std(v25, ddof=1):.2f} (3) '
                      '(0.82 ± 0.10)')
  eps = fedembed.EXTRA_TABLES['epsilon'](list(results.latest().values()))
  assert eps.count('| fedembed_prototype |') == 2 * 3  # DP cells only
  assert '9.700' in eps


def test_defaults_reach_the_binary_and_flags_override(tmp_path):
  common.define_flags()
  if not FLAGS.is_parsed():
    FLAGS(['train'])
  want = defaults.defaults_for('mnist_preference', 'fedembed_prototype')
  with flagsaver.flagsaver(algorithm='fedembed_prototype',
                           root_output_dir=str(tmp_path), rounds=7):
    config, task_kwargs = common.configs_from_flags(FLAGS)
  assert config.rounds == 7  # given: kept
  for key in ('clients_per_round', 'client_learning_rate',
              'private_learning_rate', 'server_learning_rate', 'eval_every',
              'eval_clients', 'eval_fine_tune'):
    assert getattr(config, key) == want[key], key
  assert task_kwargs['num_users'] == want['num_users']
  assert task_kwargs['local_epochs'] == want['local_epochs']
  # The paper module builds the same configuration from the same table.
  cell = reporting.Cell('fedembed', 'fedembed_prototype',
                        {'population': 'balanced', 'dp': 'none'}, 0)
  paper = fedembed.experiment_config(cell, _flags(rounds=7), str(tmp_path),
                                     want['num_users'])
  for key in ('rounds', 'clients_per_round', 'client_learning_rate',
              'private_learning_rate', 'server_optimizer',
              'server_learning_rate', 'eval_clients', 'eval_fine_tune'):
    assert getattr(paper, key) == getattr(config, key), key
  # A smaller population than eval_clients is evaluated whole.
  with flagsaver.flagsaver(algorithm='global_plus', num_users=50,
                           clients_per_round=5,
                           root_output_dir=str(tmp_path)):
    config, _ = common.configs_from_flags(FLAGS)
  assert config.eval_clients == 0


def test_every_method_has_the_same_budget_and_dp():
  budgets = set()
  for method in fedembed.METHODS:
    d = defaults.defaults_for('mnist_preference', method)
    budgets.add((d['rounds'], d['clients_per_round'], d['local_epochs'],
                 d['num_users'], d['eval_clients'], d['eval_fine_tune']))
  assert len(budgets) == 1
  configs = set()
  for method in fedembed.METHODS:
    cell = reporting.Cell('fedembed', method,
                          {'population': 'balanced', 'dp': 'gaussian_fixed'}, 0)
    configs.add(fedembed.experiment_config(cell, _flags(), 'out', 9000).dp)
  assert len(configs) == 1
  (dp,) = configs
  d = defaults.defaults_for('mnist_preference', 'fedembed_prototype',
                            'gaussian_fixed')
  resolved = privacy.resolve(dataclasses.replace(
      dp, clients_per_round=d['clients_per_round'], population=9000,
      rounds=d['rounds']))
  eps = privacy.compute_epsilon(resolved, d['rounds'])
  assert eps['epsilon'] <= 10.0 + 1e-6
  # The library's delta, not ~1/n.
  assert eps['delta'] == privacy.default_target_delta(9000) == 1e-5


def test_dp_defaults_use_the_library_delta(tmp_path):
  common.define_flags()
  if not FLAGS.is_parsed():
    FLAGS(['train'])
  with flagsaver.flagsaver(algorithm='fedembed_prototype', dp='gaussian_fixed',
                           target_epsilon=10.0,
                           root_output_dir=str(tmp_path)):
    applied = defaults.apply_defaults(FLAGS, 'mnist_preference',
                                      'fedembed_prototype')
    assert 'target_delta' not in applied and FLAGS.target_delta is None
  # And a given delta is kept.
  with flagsaver.flagsaver(algorithm='fedembed_prototype', dp='gaussian_fixed',
                           target_epsilon=10.0, target_delta=1e-6,
                           root_output_dir=str(tmp_path)):
    defaults.apply_defaults(FLAGS, 'mnist_preference', 'fedembed_prototype')
    assert FLAGS.target_delta == 1e-6


def test_paper_som_opts_into_the_unprotected_best_client_only_without_dp(
    tmp_path):
  cells = {dp: reporting.Cell('fedembed', 'fedembed_som',
                              {'population': 'balanced', 'dp': dp}, 0)
           for dp in ('none', 'gaussian_fixed')}
  plain = fedembed.experiment_config(cells['none'], _flags(), str(tmp_path),
                                     9000)
  private = fedembed.experiment_config(cells['gaussian_fixed'], _flags(),
                                       str(tmp_path), 9000)
  assert plain.algorithm_options == {'allow_unprotected_best_client': True}
  assert private.algorithm_options == {}


def test_heads_tables_noise_the_heads_at_the_gaussian_cells_dp(tmp_path):
  """`2_heads` / `3_heads`: the personal-head methods, with the Gaussian
  cells' DP plus noised heads, next to the paper's Gaussian columns."""
  for name, methods, task in (
      ('2_heads', fedembed.HEAD_METHODS, None),
      ('3_heads', fedembed.HEAD_METHODS + (fedembed.PFEDME_RESTART,),
       fedembed.SPEECH)):
    table = fedembed.TABLES[name]
    assert table.methods == methods
    assert {c.setting['dp'] for c in table.columns} == {fedembed.GAUSSIAN_HEADS}
    paper = fedembed.TABLES['2' if task is None else '3']
    for col in table.columns:
      assert col.setting.get('task') == task
      main = next(c for c in paper.columns
                  if c.setting['dp'] == 'gaussian_fixed' and
                  c.setting['population'] == col.setting['population'])
      for m in fedembed.HEAD_METHODS:
        assert table.paper_values[(m, col.name)] == paper.paper_values[
            (m, main.name)]
  cell = reporting.Cell('fedembed', 'pfedme',
                        {'population': 'balanced',
                         'dp': fedembed.GAUSSIAN_HEADS}, 0)
  plain = dataclasses.replace(cell, setting={'population': 'balanced',
                                             'dp': 'gaussian_fixed'})
  heads = fedembed.experiment_config(cell, _flags(), str(tmp_path), 9000)
  base = fedembed.experiment_config(plain, _flags(), str(tmp_path), 9000)
  assert heads.dp_personal_heads == 'noised'
  assert base.dp_personal_heads == 'exempt'
  assert dataclasses.replace(heads, dp_personal_heads='exempt') == base


def _fake_analysis(root, method, setting_dir, truth, head=None,
                   embedding=None):
  d = os.path.join(root, reporting.RUNS_DIRNAME, 'fedembed', method,
                   setting_dir, 'seed_0')
  os.makedirs(d)
  arrays = {'ids': np.arange(len(truth)), 'subpopulation': truth,
            'trained': np.ones(len(truth), bool)}
  if head is not None:
    arrays['head'] = head
  if embedding is not None:
    arrays['embedding'] = embedding
  np.savez(os.path.join(d, 'analysis.npz'), **arrays)


def test_speech_runs_get_their_own_figure_5(tmp_path):
  root = str(tmp_path)
  truth = np.repeat(np.arange(20), 5)
  speech = 'dp=none_population=balanced_task=speech_preference-abc'
  _fake_analysis(root, 'fedembed_prototype', speech, truth, head=truth)
  _fake_analysis(root, 'fedembed_type', speech, truth,
                 embedding=np.eye(20)[truth] * 5.0)
  _fake_analysis(root, 'fedembed_prototype',
                 'dp=none_population=balanced-abc', truth % 10,
                 head=truth % 10)
  written = [os.path.basename(p) for p in fedembed.make_figures(root)]
  assert 'fedembed_confusion_speech.png' in written  # Figure 5
  assert 'fedembed_confusion.png' in written  # MNIST's Figure 3


def test_speech_cell_without_the_task_fails_clearly(monkeypatch, tmp_path):
  monkeypatch.setattr(task_registry, 'TASKS', ['mnist_preference'])
  cell = fedembed.TABLES['3'].cells(1)[-1]
  with pytest.raises(ValueError, match="'speech_preference' is not registered"):
    fedembed.run_cell(cell, _flags(), str(tmp_path))


def test_public_encoder_cells_are_their_own_and_need_the_encoder(tmp_path):
  public = fedembed.TABLES['3_public'].cells(1)
  scratch = {c.key() for c in fedembed.TABLES['3'].cells(1)}
  assert not {c.key() for c in public} & scratch
  # Every federated cell of Table 3 but FedRep's (frozen encoder: nothing
  # to federate); each table has its own local row, in every column.
  table3 = fedembed.TABLES['3'].cells(1)
  def federated(cells):
    return {(c.method, tuple(sorted((k, v) for k, v in c.setting.items()
                                    if k != 'encoder')))
            for c in cells if c.method not in fedembed.LOCAL_METHODS}
  assert federated(public) == federated(
      c for c in table3 if c.method != 'fedrep')
  for cells, local in ((public, fedembed.LOCAL),
                       (table3, fedembed.LOCAL_SPECTRUM)):
    assert len([c for c in cells if c.method == local]) == 4
    assert not [c for c in cells if c.method in fedembed.LOCAL_METHODS
                and c.method != local]
  assert all(c.setting['encoder'] == 'public' for c in public)
  cell = [c for c in public if c.method == 'fedembed_prototype'][0]
  with pytest.raises(ValueError, match='--fedembed_speech_encoder'):
    fedembed.run_cell(cell, _flags(fedembed_speech_encoder=None),
                      str(tmp_path))
  mnist = reporting.Cell('fedembed', 'global',
                         {'population': 'balanced', 'dp': 'none',
                          'encoder': 'public'}, 0)
  with pytest.raises(ValueError, match="unknown encoder setting 'public'"):
    fedembed.run_cell(mnist, _flags(fedembed_speech_encoder='x.npz'),
                      str(tmp_path))


def test_spectral_encoder_cells_build_the_spectral_task(tmp_path,
                                                        monkeypatch):
  spectral = fedembed.TABLES['3_spectral'].cells(1)
  table3 = fedembed.TABLES['3'].cells(1)
  assert not {c.key() for c in spectral} & {c.key() for c in table3}
  strip = lambda cells: {(c.method, tuple(sorted(
      (k, v) for k, v in c.setting.items() if k != 'encoder'))) for c in cells}
  assert strip(spectral) == strip(table3)  # every row, FedRep included
  assert all(c.setting['encoder'] == 'spectral' for c in spectral)
  built = []
  def fake_build(*args):
    built.append(args)
    raise RuntimeError('stop here')
  monkeypatch.setattr(fedembed, '_build_task', fake_build)
  cell = [c for c in spectral if c.method == 'fedembed_prototype'][0]
  with pytest.raises(RuntimeError, match='stop here'):
    fedembed.run_cell(cell, _flags(fedembed_speech_encoder='ignored.npz'),
                      str(tmp_path))
  *_, weights, encoder = built[-1]
  assert weights is None and encoder == 'spectral'
  with pytest.raises(RuntimeError, match='stop here'):  # B.2: the default
    fedembed.run_cell([c for c in table3 if c.method == cell.method
                       and c.setting == {k: v for k, v in cell.setting.items()
                                         if k != 'encoder'}][0],
                      _flags(), str(tmp_path))
  assert built[-1][-1] is None
  # 3_spectrum: the weightless encoder; FedRep left out (nothing to share).
  spectrum = fedembed.TABLES['3_spectrum'].cells(1)
  assert strip(spectrum) == strip(c for c in table3 if c.method != 'fedrep')
  with pytest.raises(RuntimeError, match='stop here'):
    fedembed.run_cell([c for c in spectrum if c.method == 'pfedme'][0],
                      _flags(), str(tmp_path))
  assert built[-1][-2:] == (None, 'spectrum')


@pytest.mark.skipif(not os.path.isdir(MNIST), reason='MNIST not found')
def test_one_tiny_dp_cell_end_to_end(tmp_path):
  f = _flags(rounds=2, clients_per_round=5, num_users=40,
             fedembed_local_epochs=1, fedembed_eval_clients=26,
             fedembed_eval_every=1, seeds=1)
  cell = reporting.Cell('fedembed', 'fedembed_prototype',
                        {'population': 'imbalanced', 'dp': 'gaussian_fixed'},
                        0)
  registered = 'fedembed' in reporting.papers()
  reporting.register_paper('fedembed', fedembed)
  try:
    plan = reporting.plan('fedembed', '4', str(tmp_path), f, seeds=1,
                          methods=['fedembed_prototype'],
                          settings=['dp=gaussian_fixed'])
  finally:
    if not registered:
      reporting.unregister_paper('fedembed')
  assert plan.pending == [cell]
  reporting.reproduce(plan, f, str(tmp_path), log_fn=lambda s: None)
  (record,) = [json.loads(l) for l in open(tmp_path / 'results.jsonl')]
  assert record['paper'] == 'fedembed'
  assert record['method'] == 'fedembed_prototype'
  assert record['setting'] == {'population': 'imbalanced',
                               'dp': 'gaussian_fixed'}
  m = record['metrics']
  assert 0.0 <= m['f1'] <= 1.0 and m['eval_clients'] == 26
  groups = [m[f'f1_group_{k}'] for k in range(10) if f'f1_group_{k}' in m]
  assert m['f1'] == pytest.approx(np.mean(groups))
  assert {'f1_prev_25', 'f1_prev_15'} <= set(m)
  macro_groups = [m[f'f1_macro_prev_{p}'] for p in (25, 15, 10, 5)]
  assert 0.0 <= m['f1_macro'] <= 1.0 and all(0 <= v <= 1 for v in macro_groups)
  assert m['epsilon'] <= 10.0
  assert m['delta'] == privacy.default_target_delta(40)  # not 1/(n+1)
  assert m['rounds'] == 2 and m['population'] == 40
  out = cell.out_dir(str(tmp_path))
  with np.load(os.path.join(out, 'analysis.npz')) as z:
    assert z['embedding'].shape == (26, 28)
    assert z['trained'].sum() <= 2 * 5  # at most the two cohorts trained
    assert z['trained'].dtype == bool
  with open(os.path.join(out, 'curve.json')) as fh:
    assert json.load(fh)['round'] == [1, 2]
  tables = tmp_path / 'tables' / 'fedembed'
  assert (tables / '4.md').exists() and (tables / '4_by_prevalence.md').exists()
  assert 'fedembed_prototype' in (tables / 'epsilon.md').read_text()


def test_data_seed_fixes_data_and_evaluated_users_not_training(
    tmp_path, monkeypatch):
  """--data_seed: every seed builds the same users and evaluates the same
  ones; the training seed is still the cell's own."""
  built, ran = [], []
  def fake_build(name, data_dir, s, population, seed, *rest):
    built.append(seed)
    return types.SimpleNamespace(population=9000)
  def fake_run(task, config, **kw):
    ran.append((config.seed, kw['eval_ids']))
    raise RuntimeError('stop here')
  monkeypatch.setattr(fedembed, '_build_task', fake_build)
  monkeypatch.setattr(fedembed.runs, 'run_experiment', fake_run)
  monkeypatch.setattr(fedembed.runtime, 'local_runtime',
                      lambda **kw: contextlib.nullcontext())
  cells = [c for c in fedembed.TABLES['2'].cells(3)
           if c.method == 'fedembed_prototype'
           and c.setting == {'population': 'balanced', 'dp': 'none'}]
  assert [c.seed for c in cells] == [0, 1, 2]
  for data_seed in (None, 0):
    for cell in cells:
      with pytest.raises(RuntimeError, match='stop here'):
        fedembed.run_cell(cell, _flags(data_seed=data_seed), str(tmp_path))
  # Without it, the data follow the seed; the default evaluated users (None:
  # drawn by the run's seed) too.
  assert built[:3] == [0, 1, 2] and [r[1] for r in ran[:3]] == [None] * 3
  # With --data_seed=0: the data and the evaluated users of seed 0 for all.
  assert built[3:] == [0, 0, 0]
  assert ran[3][1] is None  # seed 0 is its own data seed
  expected = fedembed.run_evaluation.eval_client_ids(9000, 500, 0)
  assert [list(r[1]) for r in ran[4:]] == [list(expected)] * 2
  assert list(fedembed.run_evaluation.eval_client_ids(9000, 500, 1)) != list(
      expected)
  assert [r[0] for r in ran] == [0, 1, 2, 0, 1, 2]  # training seeds vary



@pytest.mark.skipif(not os.path.isdir(MNIST), reason='MNIST not found')
def test_evaluating_more_often_changes_nothing_but_the_curve(tmp_path):
  """Why the evaluation interval is operational (not in a record's config):
  a cell evaluated every round ends where one evaluated once does. (Without
  DP: TFF draws DP noise unseeded, so two DP runs differ by their noise.)
  Which users the curve's earlier points test is experiment_eval_ids_test's."""
  cell = reporting.Cell('fedembed', 'fedembed_prototype',
                        {'population': 'imbalanced', 'dp': 'none'}, 0)
  runs = {}
  # (evaluation interval, users at the curve's earlier points)
  for every, curve in ((3, None), (1, 10)):
    out = str(tmp_path / f'every{every}_{curve}')
    os.makedirs(out)
    f = _flags(rounds=3, clients_per_round=5, num_users=40,
               fedembed_local_epochs=1, fedembed_eval_clients=26,
               fedembed_eval_every=every, fedembed_curve_eval_clients=curve)
    runs[every, curve] = (
        fedembed.run_cell(cell, f, out),
        np.load(os.path.join(out, 'analysis.npz'))['embedding'],
        json.load(open(os.path.join(out, 'curve.json'))))
  (m3, e3, c3), (ms, es, cs) = runs[3, None], runs[1, 10]
  assert cs['round'] == [1, 2, 3] and c3['round'] == [3]
  assert c3['f1'][-1] == cs['f1'][-1]
  np.testing.assert_array_equal(e3, es)
  for key in ('f1', 'accuracy', 'auc', 'f1_macro'):
    assert m3[key] == ms[key], key
  for flag in ('fedembed_eval_every', 'fedembed_curve_eval_clients'):
    assert flag not in reporting.run_config(
        'fedembed', fedembed, _flags(**{flag: 3}))


def test_curve_points_set_the_evaluation_interval():
  cell = reporting.Cell('fedembed', 'fedembed_prototype',
                        {'population': 'balanced', 'dp': 'gaussian_fixed'}, 0)
  settings = lambda **kw: fedembed.cell_settings(cell, _flags(**kw))
  rounds = settings()['rounds']
  assert settings(fedembed_curve_points=10)['eval_every'] == rounds // 10
  assert settings(fedembed_curve_points=10,
                  fedembed_eval_every=7)['eval_every'] == 7
  assert settings(fedembed_curve_points=0)['eval_every'] == (
      defaults.defaults_for('mnist_preference', 'fedembed_prototype',
                            'gaussian_fixed')['eval_every'])
  with pytest.raises(ValueError, match='curve_points'):
    settings(fedembed_curve_points=-1)
