"""The reproduction framework: results file, restart, tables, the binary."""

import dataclasses
import json
import logging
import os
import subprocess
import sys
import types

import numpy as np
import pytest

from binaries import reproduce
from tff_personal.reports import curve_bands
from tff_personal.reports import reporting

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_TABLE = reporting.Table(
    name='table1', paper='fake', metric='accuracy',
    methods=('global', 'personal'),
    columns=(reporting.Column('small', {'num_users': 10, 'dp': 'none'}),
             reporting.Column('large', {'num_users': 100, 'dp': 'none'})),
    paper_values={('global', 'small'): '0.88 ± 0.02',
                  ('personal', 'large'): '0.91'},
    title='Fake table 1')


class FakePaper(types.ModuleType):
  """A paper module whose run_cell counts calls; metrics follow the seed."""

  def __init__(self, fail_on=None):
    super().__init__('fake_paper')
    self.TABLES = {'table1': _TABLE}  # pylint: disable=invalid-name
    self.calls = []
    self.fail_on = fail_on

  def cells(self, table, flags):
    return self.TABLES[table].cells(flags.seeds)

  def run_cell(self, cell, flags, out_dir):
    del flags
    assert os.path.isdir(out_dir)
    if self.fail_on is not None and cell.key() == self.fail_on.key():
      raise RuntimeError('killed')
    self.calls.append(cell)
    bonus = 0.1 if cell.method == 'personal' else 0.0
    return {'accuracy': 0.5 + 0.2 * cell.seed + bonus,
            'loss': 1.0 / (1 + cell.seed)}


@pytest.fixture
def paper():
  module = FakePaper()
  reporting.register_paper('fake', module)
  yield module
  reporting.unregister_paper('fake')


def _flags(root, **kw):
  values = dict(paper='fake', table='table1', root_output_dir=str(root),
                seeds=2, methods=None, settings=None, dry_run=False,
                data_dir=None, rounds=None, clients_per_round=None,
                num_users=None)
  values.update(kw)
  return types.SimpleNamespace(**values)


def _cell(method='global', seed=0, **setting):
  return reporting.Cell('fake', method, setting or {'num_users': 10,
                                                    'dp': 'none'}, seed)


def test_cell_key_is_canonical():
  a = reporting.Cell('p', 'm', {'b': 1, 'a': [1, 2]}, 0)
  b = reporting.Cell('p', 'm', {'a': [1, 2], 'b': 1}, 0)
  assert a.key() == b.key() and a == b and hash(a) == hash(b)
  assert json.loads(a.key()) == {'paper': 'p', 'method': 'm',
                                 'setting': {'a': [1, 2], 'b': 1}, 'seed': 0}
  assert a != reporting.Cell('p', 'm', {'b': 1, 'a': [1, 2]}, 1)
  with pytest.raises(ValueError, match='JSON'):
    reporting.Cell('p', 'm', {'x': object()}, 0)


def test_results_file_round_trip(tmp_path):
  results = reporting.ResultsFile(str(tmp_path / 'sub' / 'results.jsonl'))
  assert results.records() == [] and results.finished_keys() == set()
  c0, c1 = _cell(seed=0), _cell(seed=1)
  results.append(c1, {'accuracy': 0.7}, extra={'seconds': 1.5})
  results.append(c0, {'accuracy': 0.5})
  records = results.records()
  assert [r['seed'] for r in records] == [1, 0]
  assert records[0] == {'paper': 'fake', 'method': 'global',
                        'setting': {'dp': 'none', 'num_users': 10}, 'seed': 1,
                        'metrics': {'accuracy': 0.7}, 'seconds': 1.5}
  assert results.finished_keys() == {c0.key(), c1.key()}
  assert results.metrics_for('fake', 'global',
                             {'num_users': 10, 'dp': 'none'}) == [
                                 {'accuracy': 0.5}, {'accuracy': 0.7}]
  assert results.metrics_for('fake', 'personal', c0.setting) == []
  with open(results.path, encoding='utf-8') as f:
    lines = f.read().splitlines()
  assert len(lines) == 2 and all(json.loads(line) for line in lines)
  with pytest.raises(ValueError, match='collides'):
    results.append(c0, {}, extra={'metrics': 1})


def test_truncated_last_line_is_skipped_and_kept(tmp_path, caplog):
  path = tmp_path / 'results.jsonl'
  results = reporting.ResultsFile(str(path))
  results.append(_cell(seed=0), {'accuracy': 0.5})
  results.append(_cell(seed=1), {'accuracy': 0.7})
  fragment = b'{"metrics": {"accuracy": 0.9}, "method": "glo'
  with open(path, 'ab') as f:
    f.write(fragment)
  before = path.read_bytes()
  with caplog.at_level(logging.WARNING):
    records = results.records()
  assert [r['seed'] for r in records] == [0, 1]
  assert path.read_bytes() == before  # Nothing deleted or rewritten.
  assert any('results.jsonl:3' in m and 'truncated last line' in m
             for m in caplog.messages)
  # The next append terminates the fragment; both survive.
  results.append(_cell(seed=2), {'accuracy': 0.9})
  assert path.read_bytes().startswith(before + b'\n')
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    fresh = reporting.ResultsFile(str(path))
    assert [r['seed'] for r in fresh.records()] == [0, 1, 2]
  assert any('results.jsonl:3' in m for m in caplog.messages)


def test_markdown_mean_std_and_paper_value(tmp_path):
  results = reporting.ResultsFile(str(tmp_path / 'results.jsonl'))
  results.append(_cell(seed=0), {'accuracy': 0.5})
  results.append(_cell(seed=1), {'accuracy': 0.7})
  results.append(_cell('personal', 0, num_users=100, dp='none'),
                 {'accuracy': 0.8})
  md = reporting.render_markdown(results, _TABLE)
  lines = md.splitlines()
  header = next(line for line in lines if line.startswith('| method'))
  assert header == ('| method | small (ours) | small (paper) | large (ours) '
                    '| large (paper) |')
  row = {line.split('|')[1].strip(): [c.strip() for c in line.split('|')[2:-1]]
         for line in lines if line.startswith('| ') and '---' not in line}
  assert row['global'] == ['0.60 ± 0.14 (2)', '0.88 ± 0.02', '—', '—']
  assert row['personal'] == ['—', '—', '0.80 ± 0.00 (1)', '0.91']
  assert 'std is 0 when n=1' in md
  csv_text = reporting.render_csv(results, _TABLE)
  assert csv_text.splitlines()[0] == ','.join(reporting.CSV_FIELDS)
  assert 'global,small,' in csv_text
  assert '0.60 ± 0.14 (2),0.88 ± 0.02' in csv_text
  s = reporting.summarize([0.5, 0.7])
  assert s.n == 2 and s.mean == pytest.approx(0.6)
  assert s.std == pytest.approx(0.1414213562)


def test_a_table_without_paper_values_shows_only_ours(tmp_path):
  results = reporting.ResultsFile(str(tmp_path / 'results.jsonl'))
  results.append(_cell(seed=0), {'accuracy': 0.5})
  results.append(_cell(seed=1), {'accuracy': 0.7})
  md = reporting.render_markdown(
      results, dataclasses.replace(_TABLE, paper_values={}))
  lines = md.splitlines()
  assert next(line for line in lines if line.startswith('| method')) == (
      '| method | small | large |')
  assert '| global | 0.60 ± 0.14 (2) | — |' in lines
  assert 'paper' not in md.split('ours: mean')[1].split('\n')[0]


def test_tables_say_what_the_seeds_vary(tmp_path):
  def note(*data_seeds):
    results = reporting.ResultsFile(str(tmp_path / f'r{data_seeds}.jsonl'))
    for seed, data_seed in enumerate(data_seeds):
      results.append(_cell(seed=seed), {'accuracy': 0.5},
                     extra={'config': {'data_seed': data_seed}})
    md = reporting.render_markdown(results, _TABLE)
    return md.split('What the seeds vary: ')[1].split('\n')[0]
  assert note(None, None).startswith('the data (users and samples drawn by')
  assert note(3, 3).startswith('training only') and '--data_seed=3' in note(3)
  assert note(None, 3).startswith('mixed') and 'seed 3' in note(None, 3)
  # Seed 0 without --data_seed drew the data of seed 0: the same data.
  assert note(None, 0).startswith('training only') and 'seed 0' in note(None, 0)
  assert note(0, None).startswith('mixed')  # seed 1 drew its own data
  empty = reporting.ResultsFile(str(tmp_path / 'empty.jsonl'))
  assert 'What the seeds vary' not in reporting.render_markdown(empty, _TABLE)


def test_data_seed_is_the_flag_or_the_cells_seed():
  ns = types.SimpleNamespace
  assert reporting.data_seed(ns(), 4) == 4
  assert reporting.data_seed(ns(data_seed=None), 4) == 4
  assert reporting.data_seed(ns(data_seed=0), 4) == 0
  for bad in (-1, True, '1'):
    with pytest.raises(reporting.ConfigError, match='--data_seed'):
      reporting.data_seed(ns(data_seed=bad), 4)
  # A table's runs never mix data seeds without --allow_config_change.
  assert 'data_seed' in reporting.run_config(
      'fake', types.SimpleNamespace(), ns(data_seed=0))


def test_seed_band_is_mean_and_std_at_the_shared_rounds():
  curves = [{'round': [10, 20, 30], 'f1': [0.1, 0.5, 0.9]},
            {'round': [20, 10], 'f1': [0.7, 0.3]}]  # a seed still running
  rounds, mean, std = curve_bands.seed_band(curves)
  assert rounds == [10, 20]
  np.testing.assert_allclose(mean, [0.2, 0.6])
  np.testing.assert_allclose(std, [np.sqrt(0.02)] * 2)
  rounds, mean, std = curve_bands.seed_band(curves[:1])
  assert rounds == [10, 20, 30] and std == [0.0] * 3
  assert curve_bands.seed_band([]) == ([], [], [])
  assert curve_bands.seed_band(
      [{'epoch': [1, 2], 'acc': [0.5, 0.6]}], 'epoch', 'acc')[0] == [1, 2]
  assert curve_bands.seed_band([{'round': [], 'f1': []}] + curves) == (
      [], [], [])


def test_seed_band_interpolates_a_seed_evaluated_at_other_points():
  every_round = {'epoch': [0.5, 1.0, 1.5, 2.0], 'acc': [0.1, 0.2, 0.3, 0.4]}
  every_epoch = {'epoch': [1.0, 2.0], 'acc': [0.4, 0.6]}
  xs, mean, std = curve_bands.seed_band([every_round, every_epoch], 'epoch',
                                      'acc')
  assert xs == [1.0, 1.5, 2.0]  # where both seeds have a curve
  np.testing.assert_allclose(mean, [0.3, 0.4, 0.5])  # 1.5: (0.3 + 0.5) / 2
  np.testing.assert_allclose(std, [np.sqrt(0.02)] * 3)


def test_seed_curves_reads_every_seed_of_the_matching_cells(tmp_path):
  def write(cell, seed, curve):
    d = tmp_path / cell / f'seed_{seed}'
    d.mkdir(parents=True)
    (d / 'curve.json').write_text(json.dumps(curve))
  write('dp=none-aa', 0, {'round': [1, 2], 'f1': [0.1, 0.2]})
  write('dp=none-aa', 1, {'round': [1], 'f1': [0.3]})
  write('dp=none-aa', 2, {'round': [], 'f1': []})  # stopped before round 1
  write('dp=gaussian-bb', 0, {'round': [1], 'f1': [0.9]})
  curves = curve_bands.seed_curves(str(tmp_path / 'dp=none*'))
  assert [c['f1'] for c in curves] == [[0.1, 0.2], [0.3]]
  assert curve_bands.seed_band(curves)[0] == [1]
  assert curve_bands.seed_curves(str(tmp_path / 'dp=none*'), x='epoch') == []
  assert len(curve_bands.seed_curves(str(tmp_path / '*'))) == 3


def test_huge_means_print_in_scientific_notation(tmp_path):
  results = reporting.ResultsFile(str(tmp_path / 'results.jsonl'))
  results.append(_cell(seed=0), {'accuracy': 6.2e103})  # a diverged model
  results.append(_cell(seed=1), {'accuracy': 4.2e103})
  results.append(_cell('personal', 0, num_users=100, dp='none'),
                 {'accuracy': 999999.0})
  row = {line.split('|')[1].strip(): [c.strip() for c in line.split('|')[2:-1]]
         for line in reporting.render_markdown(results, _TABLE).splitlines()
         if line.startswith('| ') and '---' not in line}
  assert row['global'][0] == '5.20e+103 ± 1.41e+103 (2)'
  assert row['personal'][2] == '999999.00 ± 0.00 (1)'


def test_write_tables_is_atomic(tmp_path):
  results = reporting.ResultsFile(str(tmp_path / 'results.jsonl'))
  results.append(_cell(seed=0), {'accuracy': 0.5})
  out = tmp_path / 'tables'
  paths = reporting.write_tables(results, {'table1': _TABLE}, str(out))
  assert sorted(os.listdir(out)) == ['table1.csv', 'table1.md']
  assert sorted(paths) == sorted(str(out / n) for n in os.listdir(out))
  assert (out / 'table1.md').read_text(encoding='utf-8') == (
      reporting.render_markdown(results, _TABLE))


def test_finished_cells_are_skipped_on_restart(tmp_path, paper, capsys):
  f = _flags(tmp_path)
  assert reproduce.run(f) == 0
  assert len(paper.calls) == 2 * 2 * 2  # methods x columns x seeds
  out = capsys.readouterr().out
  assert '[1/8] global small seed=0 -> accuracy=0.5, loss=1 (' in out
  table_md = tmp_path / 'tables' / 'fake' / 'table1.md'
  first = table_md.read_text(encoding='utf-8')
  assert '| global | 0.60 ± 0.14 (2) | 0.88 ± 0.02 |' in first
  records = reporting.ResultsFile(
      str(tmp_path / 'results.jsonl')).records()
  assert len(records) == 8
  assert {tuple(sorted(r)) for r in records} == {tuple(sorted(
      reporting.RECORD_KEYS + ('config', 'seconds', 'out_dir',
                               'finished_at')))}

  paper.calls.clear()
  assert reproduce.run(f) == 0
  assert paper.calls == []
  assert table_md.read_text(encoding='utf-8') == first
  assert '0 to run' in capsys.readouterr().out
  assert len(reporting.ResultsFile(
      str(tmp_path / 'results.jsonl')).records()) == 8


def test_other_paper_flags_are_refused_before_any_work(tmp_path, paper,
                                                        capsys):
  assert reproduce.run(_flags(tmp_path, seeds=1, fake_lr=0.1,
                              other_lr=7)) == 0
  results = reporting.ResultsFile(str(tmp_path / 'results.jsonl'))
  before = (tmp_path / 'results.jsonl').read_bytes()
  assert {json.dumps(r['config'], sort_keys=True)
          for r in results.records()} == {json.dumps(
              {'fake_lr': 0.1, 'data_dir': None, 'rounds': None,
               'clients_per_round': None, 'num_users': None},
              sort_keys=True)}
  paper.calls.clear()
  capsys.readouterr()
  # Another paper's flag is not this paper's configuration.
  assert reproduce.run(_flags(tmp_path, seeds=1, fake_lr=0.1,
                              other_lr=8)) == 0
  # A new seed under other flags would land in the same table: refused,
  # naming the flag, both values and a recorded cell; nothing runs.
  assert reproduce.run(_flags(tmp_path, seeds=2, fake_lr=0.2)) == 2
  err = capsys.readouterr().err
  assert '--fake_lr: 0.1 in the recorded cell global' in err
  assert '0.2 now' in err and '--allow_config_change' in err
  assert paper.calls == []
  assert (tmp_path / 'results.jsonl').read_bytes() == before
  # The same flags resume; mixing on purpose is allowed and recorded.
  assert reproduce.run(_flags(tmp_path, seeds=2, fake_lr=0.2,
                              allow_config_change=True)) == 0
  assert len(paper.calls) == 4
  lrs = sorted(r['config']['fake_lr'] for r in results.records())
  assert lrs == [0.1] * 4 + [0.2] * 4


def test_a_killed_cell_is_not_resumed_under_other_flags(tmp_path, paper,
                                                        capsys):
  killed = reporting.Cell('fake', 'global', {'num_users': 10, 'dp': 'none'},
                          0)
  paper.fail_on = killed
  with pytest.raises(RuntimeError, match='killed'):
    reproduce.run(_flags(tmp_path, seeds=1, fake_lr=0.1))
  started = os.path.join(killed.out_dir(str(tmp_path)),
                         reporting.CELL_CONFIG_FILENAME)
  with open(started) as f:
    assert json.load(f)['fake_lr'] == 0.1
  paper.fail_on = None
  capsys.readouterr()
  # No finished record conflicts (none was written), but the killed cell
  # would resume from what it saved under --fake_lr=0.1: refused, even with
  # --allow_config_change.
  for allow in (False, True):
    assert reproduce.run(_flags(tmp_path, seeds=1, fake_lr=0.2,
                                allow_config_change=allow)) == 2
    err = capsys.readouterr().err
    assert 'global' in err and "started with --fake_lr=0.1" in err
  assert paper.calls == []
  # The old flags resume it.
  assert reproduce.run(_flags(tmp_path, seeds=1, fake_lr=0.1)) == 0
  assert paper.calls[0] == killed


def test_plan_uses_the_table_as_cells_rebuilt_it(tmp_path, paper):
  """A paper may rebuild a table from the flags in cells() (FedDVA's
  columns carry the rounds and the variant run); the plan, its conflict
  check and the printed table use the rebuilt one."""
  rebuilt = reporting.Table(
      name='table1', paper='fake', metric='accuracy',
      methods=('global', 'personal'),
      columns=(reporting.Column('tiny', {'num_users': 3, 'dp': 'none'}),),
      title='Rebuilt')
  original_cells = paper.cells

  def cells(table, flags):
    paper.TABLES['table1'] = rebuilt
    return original_cells(table, flags)

  paper.cells = cells
  try:
    p = reporting.plan('fake', 'table1', str(tmp_path), _flags(tmp_path))
  finally:
    paper.TABLES['table1'] = _TABLE
  assert p.table is rebuilt
  assert {c.setting['num_users'] for c in p.cells} == {3}


def test_run_config_and_conflicts(tmp_path, monkeypatch):
  module = types.SimpleNamespace(SETTING_FLAGS=('rounds', 'fake_variant'))
  (tmp_path / 'data').mkdir()
  monkeypatch.chdir(tmp_path)
  f = types.SimpleNamespace(fake_lr=0.1, fake_variant='b', fakeish=1,
                            other_lr=2, rounds=5, data_dir='data',
                            fake_list=['1', '2'])
  config = reporting.run_config('fake', module, f)
  assert config == {'fake_lr': 0.1, 'fake_list': ['1', '2'],
                    'data_dir': str((tmp_path / 'data').resolve())}
  assert reporting.config_digest(config) == reporting.config_digest(
      dict(reversed(list(config.items()))))
  assert reporting.config_digest(config) != reporting.config_digest(
      dict(config, fake_lr=0.2))
  record = dict(paper='fake', method='global', seed=0, metrics={},
                setting={'num_users': 10, 'dp': 'none'},
                config=dict(config, fake_lr=0.3, fake_new_flag=1))
  conflicts = reporting.config_conflicts([record], _TABLE, config)
  assert len(conflicts) == 1 and conflicts[0].startswith('--fake_lr: 0.3')
  # Not compared: records made before configs were recorded, and cells
  # outside the table (another table's settings or methods).
  assert not reporting.config_conflicts(
      [{k: v for k, v in record.items() if k != 'config'}], _TABLE, config)
  assert not reporting.config_conflicts(
      [dict(record, setting={'num_users': 7, 'dp': 'none'})], _TABLE, config)
  assert not reporting.config_conflicts([dict(record, method='other')],
                                        _TABLE, config)


def test_run_config_leaves_a_longer_papers_flags_to_it():
  table = reporting.Table(name='t', paper='fake_tuned', metric='accuracy',
                          methods=['global'],
                          columns=[reporting.Column('a', {'x': 1})])
  longer = types.SimpleNamespace(TABLES={'t': table}, cells=None,
                                 run_cell=None)
  f = types.SimpleNamespace(fake_lr=0.1, fake_tuned_lr=0.2)
  reporting.register_paper('fake_tuned', longer)
  try:
    assert reporting.run_config('fake', object(), f) == {'fake_lr': 0.1}
    assert reporting.run_config('fake_tuned', longer, f) == {
        'fake_tuned_lr': 0.2}
  finally:
    reporting.unregister_paper('fake_tuned')


def test_killed_run_resumes_with_the_remaining_cells(tmp_path, paper):
  paper.fail_on = reporting.Cell('fake', 'personal',
                                 {'num_users': 10, 'dp': 'none'}, 1)
  with pytest.raises(RuntimeError, match='killed'):
    reproduce.run(_flags(tmp_path))
  assert len(paper.calls) == 5  # global x 4, then personal small seed 0.
  with open(tmp_path / 'results.jsonl', 'ab') as f:
    f.write(b'{"paper": "fake", "meth')  # As if killed mid-append.
  paper.fail_on = None
  paper.calls.clear()
  assert reproduce.run(_flags(tmp_path)) == 0
  assert [(c.method, c.setting['num_users'], c.seed) for c in paper.calls] == [
      ('personal', 10, 1), ('personal', 100, 0), ('personal', 100, 1)]
  assert len(reporting.ResultsFile(
      str(tmp_path / 'results.jsonl')).records()) == 8


def test_filters_and_dry_run(tmp_path, paper, capsys):
  assert reproduce.run(_flags(tmp_path, dry_run=True)) == 0
  assert paper.calls == [] and not os.path.exists(tmp_path / 'results.jsonl')
  assert not os.listdir(tmp_path)
  out = capsys.readouterr().out
  assert '[8/8] would run personal large seed=1' in out
  assert '| global | — | 0.88 ± 0.02 |' in out

  assert reproduce.run(_flags(tmp_path, methods='personal',
                              settings='large', seeds=1)) == 0
  assert [(c.method, c.setting['num_users'], c.seed)
          for c in paper.calls] == [('personal', 100, 0)]
  paper.calls.clear()
  assert reproduce.run(_flags(tmp_path, methods=['global'],
                              settings=['num_users=10', 'dp=none'])) == 0
  assert [(c.method, c.setting['num_users'], c.seed)
          for c in paper.calls] == [('global', 10, 0), ('global', 10, 1)]


def test_first_seed_runs_only_the_later_seeds(tmp_path, paper):
  assert reproduce.run(_flags(tmp_path, seeds=3, first_seed=1,
                              methods='global', settings='small')) == 0
  assert [c.seed for c in paper.calls] == [1, 2]
  table_md = (tmp_path / 'tables' / 'fake' / 'table1.md').read_text(
      encoding='utf-8')
  # Seeds 1 and 2 (0.7, 0.9) are the row's mean; seed 0 never ran.
  assert '| global | 0.80 ± 0.14 (2) |' in table_md
  paper.calls.clear()
  assert reproduce.run(_flags(tmp_path, seeds=3, methods='global',
                              settings='small')) == 0
  assert [c.seed for c in paper.calls] == [0]


@pytest.mark.parametrize('overrides, message', [
    (dict(paper='nope'), "unknown --paper='nope'"),
    (dict(table='table9'), "unknown --table='table9'"),
    (dict(methods='fedavg'), 'unknown --methods'),
    (dict(settings='huge'), 'unknown --settings'),
    (dict(seeds=0), '--seeds must be a positive integer'),
    (dict(seeds=2, first_seed=2), '--first_seed must be an integer in'),
    (dict(first_seed=-1), '--first_seed must be an integer in'),
    (dict(root_output_dir=None), '--root_output_dir is required'),
])
def test_bad_flags_fail_before_any_work(tmp_path, paper, capsys, overrides,
                                        message):
  root = tmp_path / 'root'
  assert reproduce.run(_flags(root, **overrides)) == 2
  assert message in capsys.readouterr().err
  assert paper.calls == [] and not os.path.exists(root)


def test_register_paper_checks_the_module():
  with pytest.raises(TypeError, match='run_cell'):
    reporting.register_paper('bad', types.SimpleNamespace(TABLES={},
                                                          cells=None))
  with pytest.raises(TypeError, match='paper'):
    reporting.register_paper('other', FakePaper())  # Its tables say 'fake'.
  with pytest.raises(ValueError, match='unknown'):
    reporting.Table(name='t', paper='p', metric='m', methods=['a'],
                    columns=[reporting.Column('c', {})],
                    paper_values={('b', 'c'): '1'})


def test_binary_rejects_unknown_paper(tmp_path):
  proc = subprocess.run(
      [sys.executable, '-m', 'binaries.reproduce', '--paper=nope',
       f'--root_output_dir={tmp_path}'],
      cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
  assert proc.returncode == 2, proc.stderr
  assert "unknown --paper='nope'" in proc.stderr
  assert not os.listdir(tmp_path)
