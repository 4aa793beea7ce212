"""The FedDVA paper module: cells, records' settings, runs, speed metric."""

import csv
import json
import os
import types

import pytest

from binaries import reproduce
from papers import feddva as paper
from tff_personal.algorithms import registry
from tff_personal.models import feddva_losses as losses
from tff_personal.models import feddva_recipes as recipes
from tff_personal.reports import curve_bands
from tff_personal.reports import reporting


def _flags(**overrides):
  values = dict(seeds=1, rounds=None, feddva_vae_rounds=7,
                feddva_local_epochs=1, feddva_batch_size=64,
                feddva_probe_dim=4, feddva_class_dim=8, feddva_hidden=16,
                feddva_clients_per_round=0,
                feddva_channels=['4', '4', '4', '4'])
  values.update(overrides)
  return types.SimpleNamespace(**values)


def test_cells_carry_task_and_rounds_and_probes_come_first():
  cells = paper.cells('classification', _flags(rounds=5))
  assert [c.method for c in cells[:2]] == ['probe', 'probe_vae']
  assert cells[0].setting == {'task': 'marked_mnist', 'rounds': 7}
  assert cells[1].setting == cells[0].setting
  methods = [c.method for c in cells[2:]]
  assert methods.index('fedavg') < methods.index('feddva')
  assert {(c.method, c.setting['task']) for c in cells[2:]} == {
      (m, t) for m in paper.METHODS for t in paper.TASK_NAMES}
  assert all(c.setting['rounds'] == 5 for c in cells[2:])
  # The tables' columns follow the rounds run.
  assert paper.TABLES['classification'].column_for(
      {'task': 'label_skew_mnist', 'rounds': 5}) is not None
  with pytest.raises(ValueError, match='feddva_channels'):
    paper.cells('classification', _flags(feddva_channels=['4']))
  with pytest.raises(ValueError, match='rounds'):
    paper.cells('classification', _flags(rounds=0))


def test_registered_tables_are_valid():
  reporting.unregister_paper('feddva_test')
  module = types.SimpleNamespace(TABLES={
      k: reporting.Table(**{**t.__dict__, 'paper': 'feddva_test'})
      for k, t in paper.TABLES.items()}, cells=paper.cells,
      run_cell=paper.run_cell)
  reporting.register_paper('feddva_test', module)
  reporting.unregister_paper('feddva_test')


def test_rounds_to_reach():
  assert paper.rounds_to_reach([0.1, 0.5, 0.7, 0.6], 0.6) == 3
  assert paper.rounds_to_reach([0.1, 0.2], 0.6) is None
  assert paper.rounds_to_reach([0.9], 0.6) == 1


def test_varied_marks_mark_every_marked_mnist_cell_and_have_columns():
  varied = paper.cells('classification',
                       _flags(rounds=5, feddva_marks='varied'))
  for c in varied:
    assert (c.setting.get('marks') == 'varied') == (
        c.setting['task'] == 'marked_mnist'), c
  # The baselines' data change with the marks too, so their cells carry it.
  assert {c.method for c in varied if 'marks' in c.setting} == {
      *paper.PROBE_METHODS, *paper.METHODS}
  for table in ('classification', 'probes'):
    assert paper.TABLES[table].column_for(varied[0].setting if table ==
                                          'probes' else varied[2].setting)
  column = paper.TABLES['classification'].column_for(
      {'task': 'marked_mnist', 'rounds': 5, 'marks': 'varied'})
  assert column is not None and column.name == 'marked_mnist'
  # One fixed mark per client (the earlier task): no key, so the cells of
  # earlier runs keep their identity; the column says so.
  fixed = paper.cells('classification', _flags(rounds=5, feddva_marks='fixed'))
  assert all('marks' not in c.setting for c in fixed)
  assert paper.TABLES['probes'].column_for(fixed[0].setting).name == (
      'marked_mnist (fixed marks)')
  assert [c.setting for c in fixed] == [
      c.setting for c in paper.cells('classification', _flags(rounds=5))]
  # The unmarked control: its own key and column.
  plain = paper.cells('classification', _flags(rounds=5, feddva_marks='none'))
  assert plain[0].setting == {'task': 'marked_mnist', 'marks': 'none',
                              'rounds': 7}
  assert paper.TABLES['probes_z'].column_for(plain[1].setting).name == (
      'marked_mnist (no marks)')


def test_shared_decoder_cells_are_marked_and_default_cells_are_not():
  default = paper.cells('classification', _flags(rounds=5))
  assert all('decoder' not in c.setting for c in default)
  shared = paper.cells('classification',
                       _flags(rounds=5, feddva_decoder='shared'))
  marked = {(c.method, c.setting['task']) for c in shared
            if c.setting.get('decoder') == 'shared'}
  # The probe and FedDVA's classifier depend on the decoder; the baselines
  # do not, so their cells (and results) are shared with the default run.
  assert marked == {('probe', 'marked_mnist')} | {
      ('feddva', t) for t in paper.TASK_NAMES}
  assert paper.TABLES['probes'].column_for(shared[0].setting) is not None
  assert paper.TABLES['classification'].column_for(
      {'task': 'marked_mnist', 'rounds': 5, 'decoder': 'shared'}) is not None


@pytest.mark.parametrize('variant', [
    {'schedule': 'reference'},
    {'mixture_kl': 'sampled'},
    {'mixture_kl': 'moment', 'constraint_weight': 10.0},
    {'constraint_weight': 10.0},
    {'decoder': 'shared', 'schedule': 'reference'}])
def test_variant_cells_carry_their_keys_and_have_table_columns(variant):
  cells = paper.cells('classification', _flags(
      rounds=5, **{f'feddva_{k}': v for k, v in variant.items()}))
  marked = {(c.method, c.setting['task']) for c in cells
            if all(c.setting.get(k) == v for k, v in variant.items())}
  assert marked == {('probe', 'marked_mnist')} | {
      ('feddva', t) for t in paper.TASK_NAMES}
  # Baselines do not depend on FedDVA's variant: no variant keys.
  assert all(not set(variant) & set(c.setting) for c in cells
             if c.method not in ('probe', 'feddva'))
  column = paper.TABLES['probes'].column_for(cells[0].setting)
  words = {'decoder': '{} decoder', 'schedule': '{} schedule',
           'mixture_kl': '{} mixture KL',
           'constraint_weight': 'constraint weight {:g}'}
  assert column is not None and all(
      words[k].format(v) in column.name for k, v in variant.items()), column
  assert paper.TABLES['classification'].column_for(
      {'task': 'marked_mnist', 'rounds': 5, **variant}) is not None
  # The plain VAE has no c, decoder split or schedule: no variant key; the
  # digit-from-z table puts it beside the paper's FedDVA, not the variant.
  vae = [c for c in cells if c.method == 'probe_vae']
  assert len(vae) == 1 and not set(variant) & set(vae[0].setting)
  column = paper.TABLES['probes_z'].column_for(vae[0].setting)
  assert column is not None and column.setting == vae[0].setting
  # The paper's FedDVA cells carry neither key.
  plain = paper.cells('classification', _flags(
      rounds=5, feddva_decoder='private', feddva_schedule='paper',
      feddva_mixture_kl='bound', feddva_constraint_weight=1.0))
  assert all(not {'schedule', 'decoder', 'mixture_kl', 'constraint_weight'}
             & set(c.setting) for c in plain)


def test_recipe_flags_mark_cells_and_refuse_the_flags_they_set():
  authors = paper.cells('classification', _flags(
      rounds=5, feddva_recipe='authors', feddva_ablate=['kl_floor',
                                                        'c_prior']))
  marked = {(c.method, c.setting['task']) for c in authors
            if c.setting.get('recipe') == 'authors'
            and c.setting.get('ablate') == 'c_prior+kl_floor'}
  assert marked == {('probe', 'marked_mnist')} | {
      ('feddva', t) for t in paper.TASK_NAMES}
  column = paper.TABLES['probes'].column_for(authors[0].setting)
  assert column is not None and 'authors recipe' in column.name
  # The recipe 'sampled_mixture_kl' is the cells of --feddva_mixture_kl.
  by_recipe = paper.cells('classification', _flags(
      rounds=5, feddva_recipe='sampled_mixture_kl'))
  by_flag = paper.cells('classification', _flags(
      rounds=5, feddva_mixture_kl='sampled'))
  assert [c.setting for c in by_recipe] == [c.setting for c in by_flag]
  # ...and the same run: options and name (a resume finds either).
  runs = [_run_flags('/unused', '/unused', feddva_schedule='paper', **extra)
          for extra in (dict(feddva_recipe='sampled_mixture_kl'),
                        dict(feddva_mixture_kl='sampled'))]
  assert paper._feddva_options(runs[0], 8) == paper._feddva_options(
      runs[1], 8)
  assert paper.pretrain_key('marked_mnist', 4, runs[0], 8, 0) == (
      paper.pretrain_key('marked_mnist', 4, runs[1], 8, 0))
  with pytest.raises(ValueError, match='--feddva_beta must keep'):
    paper.cells('probes', _flags(feddva_recipe='authors', feddva_beta=0.5))
  with pytest.raises(ValueError, match="only the 'authors' recipe"):
    paper.cells('probes', _flags(feddva_ablate=['c_prior']))
  with pytest.raises(ValueError, match='unknown FedDVA recipe elements'):
    paper.cells('probes', _flags(feddva_recipe='authors',
                                 feddva_ablate=['floor']))
  # The pre-training cache keys apart the recipe and each ablation.
  keys = {paper.pretrain_key('marked_mnist', 4, _run_flags(
      '/unused', '/unused', feddva_schedule='paper', **extra), 8, 0)
          for extra in ({}, dict(feddva_recipe='authors'),
                        dict(feddva_recipe='authors',
                             feddva_ablate=['c_prior']),
                        dict(feddva_recipe='authors',
                             feddva_ablate=['kl_floor']))}
  assert len(keys) == 4


def test_pretrain_key_changes_with_everything_training_depends_on():
  f = _run_flags('/unused', '/unused')
  base = paper.pretrain_key('marked_mnist', 4, f, 8, 0)
  changed = dict(feddva_marked_train=41, feddva_learning_rate=2e-3,
                 feddva_clients_per_round=2, feddva_local_epochs=2,
                 feddva_batch_size=21, feddva_channels=['2', '2', '2', '3'],
                 feddva_hidden=9, feddva_xi=1.0, feddva_alpha=0.5,
                 feddva_beta=0.5, feddva_vae_rounds=3,
                 feddva_decoder='shared', feddva_schedule='paper',
                 feddva_marks='varied', feddva_mixture_kl='sampled',
                 feddva_constraint_weight=10.0, data_seed=3)
  for name, value in changed.items():
    other = _run_flags('/unused', '/unused', **{name: value})
    assert paper.pretrain_key('marked_mnist', 4, other, 8, 0) != base, name
  assert paper.pretrain_key('marked_mnist', 4, f, 8, 1) != base
  assert paper.pretrain_key('marked_mnist', 5, f, 8, 0) != base
  assert paper.pretrain_key('marked_mnist', 4, f, 4, 0) != base
  # Test-set sizes and the other task's sizes do not change training.
  same = _run_flags('/unused', '/unused', feddva_marked_test=999,
                    feddva_skew_train=999)
  assert paper.pretrain_key('marked_mnist', 4, same, 8, 0) == base
  skew = paper.pretrain_key('label_skew_mnist', 4, f, 8, 0)
  for name, value in (('feddva_skew_train', 41),
                      ('feddva_dirichlet_alpha', 0.3)):
    other = _run_flags('/unused', '/unused', **{name: value})
    assert paper.pretrain_key('label_skew_mnist', 4, other, 8, 0) != skew


def test_accuracy_curves_band_every_seed_of_a_method(tmp_path, monkeypatch):
  f = _run_flags(tmp_path, '/unused', seeds=1)  # seeds beyond it are drawn
  setting = {**paper.task_setting('marked_mnist', 'fixed'),
             'rounds': paper.DEFAULT_CLASS_ROUNDS}
  for seed, accuracy in ((0, 0.5), (1, 0.7)):
    path = os.path.join(paper._cell_dir(str(tmp_path), 'fedavg', setting,
                                        seed), 'curve.json')
    os.makedirs(os.path.dirname(path))
    with open(path, 'w') as fh:
      json.dump({'round': [1, 2], 'mean': [accuracy, accuracy + 0.1],
                 'std': [0.0, 0.0]}, fh)
  drawn = []
  real = curve_bands.plot_seed_band
  monkeypatch.setattr(curve_bands, 'plot_seed_band', lambda ax, curves, *a,
                      **k: drawn.append((k['label'], curves)) or real(
                          ax, curves, *a, **k))
  written = paper.make_figures(str(tmp_path), f, latent=False)
  assert [os.path.basename(p) for p in written] == [
      'feddva_accuracy_curves.png']
  ((label, curves),) = drawn
  assert label == 'fedavg' and [c['mean'][0] for c in curves] == [0.5, 0.7]


def test_define_flags_defines_every_flag_the_cells_read():
  from absl import flags  # pylint: disable=g-import-not-at-top
  paper.define_flags()
  paper.define_flags()  # A second call (another binary) is harmless.
  for name in ('feddva_decoder', 'feddva_vae_rounds', 'feddva_channels',
               'feddva_marked_train'):
    assert name in flags.FLAGS
  assert flags.FLAGS['feddva_decoder'].default == 'private'
  assert flags.FLAGS['feddva_schedule'].default == 'paper'
  assert flags.FLAGS['feddva_marks'].default == 'varied'
  assert flags.FLAGS['feddva_mixture_kl'].default == 'bound'
  assert flags.FLAGS['feddva_constraint_weight'].default == 1.0


def _run_flags(root, mnist_dir, **overrides):
  values = dict(
      paper='feddva', table='probes', root_output_dir=str(root), seeds=1,
      methods=['probe'], settings=None, dry_run=False, data_dir=mnist_dir,
      rounds=None, clients_per_round=None, num_users=None,
      feddva_vae_rounds=2, feddva_local_epochs=1, feddva_batch_size=20,
      feddva_channels=['2', '2', '2', '2'], feddva_hidden=8,
      feddva_probe_dim=2, feddva_class_dim=2, feddva_xi=None,
      feddva_alpha=1.0, feddva_beta=0.75, feddva_learning_rate=1e-3,
      feddva_ditto_lambda=0.1, feddva_decoder='private',
      feddva_schedule='reference',
      feddva_clients_per_round=0, feddva_marked_clients=4,
      feddva_marked_train=40, feddva_marked_test=40, feddva_skew_clients=4,
      feddva_skew_train=40, feddva_skew_test=20, feddva_dirichlet_alpha=0.5)
  values.update(overrides)
  return types.SimpleNamespace(**values)


def test_probe_cell_end_to_end_records_probes_and_config(tmp_path, mnist_dir,
                                                         capsys):
  """The reference schedule through TFF on varied marks, the probes, the
  recorded config, and a rerun under another paper flag refused before any
  work."""
  assert reproduce.run(_run_flags(tmp_path, mnist_dir, rounds=1,
                                  feddva_marks='varied')) == 0
  out = capsys.readouterr().out
  assert 'feddva marked_mnist dim 2 seed 0: [pretrain] round 2/2' in out
  # The run's classifier stage (the classification cell of these dims).
  assert 'feddva marked_mnist dim 2 seed 0: round 1/1' in out
  records = reporting.ResultsFile(
      str(tmp_path / 'results.jsonl')).records()
  assert len(records) == 1
  record = records[0]
  assert record['setting'] == {'task': 'marked_mnist', 'marks': 'varied',
                               'rounds': 2, 'schedule': 'reference'}
  metrics = record['metrics']
  for name in ('client_from_c', 'client_from_z', 'digit_from_z',
               'digit_from_c', 'chance_client'):
    assert 0.0 <= metrics[name] <= 1.0, name
  # Three of the four clients carry varying marks: both probes are numbers.
  for name in ('mark_from_c', 'mark_from_z'):
    assert isinstance(metrics[name], float) and metrics[name] <= 1.0, name
  # Pixel means in [0, 1]: a swapped code moves each by at most 1.
  for name in ('decoder_c_effect', 'decoder_z_effect'):
    assert isinstance(metrics[name], float), name
    assert 0.0 <= metrics[name] <= 1.0, name
  assert record['config']['feddva_local_epochs'] == 1
  # In the setting, not the config.
  assert 'feddva_schedule' not in record['config']
  assert 'feddva_marks' not in record['config']
  before = (tmp_path / 'results.jsonl').read_bytes()
  capsys.readouterr()
  assert reproduce.run(_run_flags(tmp_path, mnist_dir, seeds=2, rounds=1,
                                  feddva_marks='varied',
                                  feddva_local_epochs=3)) == 2
  assert '--feddva_local_epochs: 1 in the recorded cell probe' in (
      capsys.readouterr().err)
  assert (tmp_path / 'results.jsonl').read_bytes() == before


def test_vae_probe_cell_trains_a_plain_vae_and_probes_its_z(tmp_path,
                                                           mnist_dir, capsys):
  """probe_vae: no TFF, rounds x local epochs of the pooled VAE, z probes
  only; its digit-from-z table renders; a rerun is skipped."""
  flags_ = _run_flags(tmp_path, mnist_dir, methods=['probe_vae'],
                      table='probes_z', feddva_marks='varied',
                      feddva_vae_rounds=2, feddva_local_epochs=2)
  assert reproduce.run(flags_) == 0
  out = capsys.readouterr().out
  assert 'pooled VAE epoch 4/4' in out and 'FedDVA round' not in out
  records = reporting.ResultsFile(str(tmp_path / 'results.jsonl')).records()
  assert [r['method'] for r in records] == ['probe_vae']
  record = records[0]
  assert record['setting'] == {'task': 'marked_mnist', 'marks': 'varied',
                               'rounds': 2}
  metrics = record['metrics']
  assert metrics['epochs'] == 4
  assert not any(k.endswith('_from_c') for k in metrics)
  for name in ('client_from_z', 'digit_from_z', 'chance_client'):
    assert 0.0 <= metrics[name] <= 1.0, name
  assert metrics['mark_from_z'] <= 1.0
  assert metrics['final_reconstruction'] > 0 and metrics['final_kl_z'] >= 0
  assert 'probe_vae' in out and 'digit from z' in out
  before = (tmp_path / 'results.jsonl').read_bytes()
  assert reproduce.run(flags_) == 0
  assert (tmp_path / 'results.jsonl').read_bytes() == before


class _Killed(Exception):
  pass


def test_feddva_run_is_the_registered_staged_run_and_resumes(tmp_path,
                                                             mnist_dir):
  """The paper's FedDVA run is the registered `feddva` (its 'pretrain'
  stage, then the classifier) on the one path, read or trained by
  `runs.finished_or_trained` with `resume`: a killed run continues from its
  checkpoints, every `--feddva_checkpoint_every` rounds (that a run killed
  mid-stage resumes to the uninterrupted result is `stages_test`)."""
  f = _run_flags(tmp_path, mnist_dir, rounds=2, feddva_vae_rounds=3,
                 feddva_checkpoint_every=1)
  task = paper._task('marked_mnist', f, 0)
  config = paper.feddva_config(task, f, 2, 0, str(tmp_path))
  assert config.algorithm == 'feddva' and config.resume
  assert config.checkpoint_every == 1 and config.rounds == 2
  assert registry.spec('feddva').staged
  assert config.algorithm_options['pretrain_rounds'] == 3
  assert config.experiment_dir.startswith(str(tmp_path))
  assert paper.pretrain_key('marked_mnist', task.num_clients, f, 2, 0) in (
      config.experiment_name)


def test_classification_cells_run_on_the_one_path_and_share_feddva_s_run(
    tmp_path, mnist_dir):
  """A baseline's curve is its run's eval_metrics.csv; FedDVA's classifier
  is the classifier stage of the run the probe cell of the same dims made
  (one FedDVA run for both). Under DP each cell reports the (epsilon,
  delta) of its run: FedDVA's covers both stages' rounds."""
  common = dict(rounds=2, settings=['task=marked_mnist'],
                feddva_marks='varied', feddva_schedule='paper',
                feddva_dp_noise_multiplier=1.0, feddva_dp_clip=0.5)
  assert reproduce.run(_run_flags(tmp_path, mnist_dir, table='probes',
                                  methods=['probe'], **common)) == 0
  assert reproduce.run(_run_flags(tmp_path, mnist_dir,
                                  table='classification',
                                  methods=['fedavg', 'feddva'],
                                  **common)) == 0
  runs = os.listdir(os.path.join(tmp_path, reporting.RUNS_DIRNAME,
                                 paper._FEDDVA_DIRNAME))
  assert len(runs) == 1
  records = {r['method']: r for r in reporting.ResultsFile(
      str(tmp_path / 'results.jsonl')).records()}
  assert set(records) == {'probe', 'fedavg', 'feddva'}
  for method in ('fedavg', 'feddva'):
    out_dir = records[method]['out_dir']
    with open(os.path.join(out_dir, 'curve.json')) as fh:
      curve = json.load(fh)
    assert curve['round'] == [1, 2]
    metrics = records[method]['metrics']
    assert metrics['final_accuracy'] == curve['mean'][-1]
    assert metrics['accuracy_std_across_clients'] == curve['std'][-1]
  run_dir = os.path.join(tmp_path, reporting.RUNS_DIRNAME,
                         paper._FEDDVA_DIRNAME, runs[0])
  with open(os.path.join(run_dir, 'eval_metrics.csv')) as fh:
    rows = list(csv.DictReader(fh))
  assert [float(r['accuracy']) for r in rows] == curve['mean']
  assert records['feddva']['metrics']['pretrain_rounds'] == 2
  assert records['feddva']['metrics']['fedavg_final_accuracy'] == (
      records['fedavg']['metrics']['final_accuracy'])
  metrics = {m: records[m]['metrics'] for m in ('fedavg', 'feddva')}
  assert metrics['fedavg']['rounds_noised'] == 2
  assert metrics['feddva']['rounds_noised'] == 4
  assert metrics['feddva']['epsilon'] > metrics['fedavg']['epsilon'] > 0
  assert metrics['feddva']['clip_norm'] == 0.5


def test_checkpoint_interval_is_not_a_config_change(tmp_path):
  config = reporting.run_config(
      'feddva', paper, _run_flags(tmp_path, '/unused',
                                  feddva_checkpoint_every=5))
  assert 'feddva_checkpoint_every' not in config
  assert config['feddva_local_epochs'] == 1
  with pytest.raises(ValueError, match='feddva_checkpoint_every'):
    paper.cells('probes', _run_flags(tmp_path, '/unused',
                                     feddva_checkpoint_every=-1))


def test_dp_cells_carry_the_dp_setting():
  """Under --feddva_dp_noise_multiplier every cell carries the DP keys (no
  pooled-VAE cell: it has no federated version); what they report is the
  classification cells' test."""
  f = _flags(rounds=5, feddva_dp_noise_multiplier=1.0, feddva_dp_clip=0.5)
  cells = paper.cells('classification', f)
  dp = {'dp': 'gaussian_fixed', 'noise_multiplier': 1.0, 'clip_norm': 0.5}
  assert 'probe_vae' not in {c.method for c in cells}
  for cell in cells:
    assert dp.items() <= cell.setting.items(), cell
    table = 'probes' if cell.method == 'probe' else 'classification'
    assert paper.TABLES[table].column_for(cell.setting) is not None, cell
  with pytest.raises(ValueError, match='feddva_dp_clip > 0'):
    paper.cells('probes', _flags(feddva_dp_noise_multiplier=1.0,
                                 feddva_dp_clip=0.0))


@pytest.mark.parametrize('overrides, expect', [
    ({}, (losses.LossConfig(), 'paper')),
    ({'feddva_mixture_kl': 'sampled'},
     (losses.LossConfig(mixture_kl='sampled'), 'paper')),
    ({'feddva_constraint_weight': 10.0, 'feddva_schedule': 'reference'},
     (losses.LossConfig(constraint_weight=10.0), 'reference')),
    ({'feddva_mixture_kl': 'moment', 'feddva_xi': 3.0, 'feddva_beta': 0.5},
     (losses.LossConfig(mixture_kl='moment', xi=3.0, beta=0.5), 'paper')),
    ({'feddva_recipe': 'authors'},
     (recipes.recipe('authors').loss, 'authors')),
    ({'feddva_recipe': 'authors', 'feddva_ablate': ['kl_floor']},
     (recipes.recipe('authors', ('kl_floor',)).loss, 'authors'))])
def test_the_run_builds_the_loss_its_flags_ask_for(tmp_path, monkeypatch,
                                                   overrides, expect):
  seen = []

  def build(config, loss_config, **kwargs):
    seen.append((loss_config, kwargs['schedule'], config.z_dim))
    raise _Killed()

  monkeypatch.setattr(paper.feddva, 'build_feddva', build)
  f = _run_flags(tmp_path, '/unused', **{
      'feddva_schedule': 'paper', 'feddva_mixture_kl': 'bound',
      'feddva_marks': 'varied', **overrides})
  options = paper._feddva_options(f, 3)
  registry.check_algorithm_options('feddva', options)
  with pytest.raises(_Killed):
    registry.build('feddva', None, client_optimizer=None,
                   server_optimizer=None, **options)
  assert seen == [(*expect, 3)]


def test_negative_constraint_weight_is_refused_before_any_cell():
  with pytest.raises(ValueError, match='feddva_constraint_weight'):
    paper.cells('classification', _flags(feddva_constraint_weight=-1.0))
