"""FedDVA (Personalization Disentanglement for FL): probes, classification.

`python -m binaries.reproduce --paper=feddva --table=classification` (or
`spread`, `speed`, `probes`, `probes_z`; every table runs the same cells)
probes FedDVA's latents on `marked_mnist` (`probe`; `probe_vae`: a plain VAE
on the pooled images), then runs `fedavg`, `fedavg_ft`, `ditto` and `feddva`
on `marked_mnist` and `label_skew_mnist`, every run on the one run path. The
probes and figures are `tff_personal/reports/feddva_probes.py`. What each
cell computes, the flags and their setting keys, the figures and what was
run: docs/papers/feddva.md.
"""

from __future__ import annotations

import functools
import os

import numpy as np

from tasks import client_data_task
from tasks import feddva_tasks
from tff_personal.algorithms import feddva
from tff_personal.config import experiment
from tff_personal.config import run_spec
from tff_personal.core import atomic_io
from tff_personal.core import runtime
from tff_personal.models import feddva as feddva_lib
from tff_personal.models import feddva_losses
from tff_personal.models import feddva_recipes
from tff_personal.models import feddva_training
from tff_personal.reports import curve_bands
from tff_personal.reports import feddva_probes
from tff_personal.reports import figures
from tff_personal.reports import reporting
from tff_personal.run import run_analysis
from tff_personal.run import runs

PAPER = 'feddva'
TASK_NAMES = ('marked_mnist', 'label_skew_mnist')
# Flags that the cells' settings carry (reporting.run_config leaves them out).
SETTING_FLAGS = ('rounds', 'feddva_decoder', 'feddva_schedule', 'feddva_marks',
                 'feddva_mixture_kl', 'feddva_constraint_weight',
                 'feddva_recipe', 'feddva_ablate',
                 'feddva_dp_noise_multiplier', 'feddva_dp_clip')
# Flags that change how a run is carried out, not what it computes
# (reporting.run_config leaves them out, so changing one is not a conflict).
OPERATIONAL_FLAGS = ('feddva_checkpoint_every',)
METHODS = ('fedavg', 'fedavg_ft', 'ditto', 'feddva')
# FedDVA's probes, and the plain VAE's on the pooled images (the reference).
PROBE_METHODS = ('probe', 'probe_vae')
DEFAULT_CLASS_ROUNDS = 20
DEFAULT_VAE_ROUNDS = 30
_FEDDVA_DIRNAME = '_feddva'

# A FedDVA variant's setting keys, in order, with how each value is named in
# table columns, figure file names and the pre-training cache directory (the
# last two must not change: existing roots are found by them).
_VARIANT_NAMES = (
    ('decoder', '{} decoder', '_{}_decoder', '_{}dec'),
    ('schedule', '{} schedule', '_{}_schedule', '_{}sched'),
    ('mixture_kl', '{} mixture KL', '_{}_mixture_kl', '_{}mix'),
    ('constraint_weight', 'constraint weight {:g}', '_constraint_weight{:g}',
     '_cw{:g}'),
    ('recipe', '{} recipe', '_{}_recipe', '_{}rec'),
    ('ablate', 'without {}', '_without_{}', '_no{}'),
)
_LABEL, _FIGURE, _CACHE = 1, 2, 3


def _variant_names(variant: dict, which: int) -> list[str]:
  return [names[which].format(variant[names[0]])
          for names in _VARIANT_NAMES if names[0] in variant]


def variant_label(variant: dict) -> str:
  """' (shared decoder, ...)' for a variant setting; '' for the paper's."""
  parts = _variant_names(variant, _LABEL)
  return f" ({', '.join(parts)})" if parts else ''


def task_setting(task: str, marks: str) -> dict:
  """{'task': task}, and for marked_mnist {'marks': marks} unless 'fixed'
  (cells run before the flag existed carry no 'marks' key)."""
  setting = {'task': task}
  if task == 'marked_mnist' and marks != 'fixed':
    setting['marks'] = marks
  return setting


def _columns(tasks, rounds: int, variant: dict, marks: str, dp: dict):
  """The paper's FedDVA's columns of `tasks`, then the variant's."""
  label = lambda t: (t if t != 'marked_mnist' or marks == 'varied' else
                     f'{t} ({"no" if marks == "none" else marks} marks)')
  dp_label = (f', DP z={dp["noise_multiplier"]:g} C={dp["clip_norm"]:g}'
              if dp else '')
  return [reporting.Column(label(t) + dp_label + variant_label(v), {
      **task_setting(t, marks), 'rounds': rounds, **v, **dp})
          for v in ({}, variant) for t in tasks]


def _tables(class_rounds: int, vae_rounds: int,
            variant: dict | None = None, marks: str = 'varied',
            dp: dict | None = None) -> dict:
  """The tables; `variant` adds its columns, `dp` is in every column."""
  variant, dp = dict(variant or {'decoder': 'shared'}), dict(dp or {})
  probes = dict(paper=PAPER, scale=1.0, columns=_columns(
      ('marked_mnist',), vae_rounds, variant, marks, dp))
  common = dict(paper=PAPER, methods=METHODS, columns=_columns(
      TASK_NAMES, class_rounds, variant, marks, dp), notes='The paper reports '
      'these as curves only (Figures 6, 7), so there are no paper numbers. '
      'feddva also ran pretrain_rounds rounds of FedDVA (results.jsonl).')
  return {
      'classification': reporting.Table(
          name='classification', metric='final_accuracy', scale=100.0,
          title='Personalized classification: final accuracy (%, mean over '
                'clients)', **common),
      'spread': reporting.Table(
          name='spread', metric='accuracy_std_across_clients', scale=100.0,
          title='Accuracy spread across clients (std, %)', **common),
      'speed': reporting.Table(
          name='speed', metric='rounds_to_reach_fedavg_final', digits=0,
          title="Rounds to reach FedAvg's final mean accuracy", **common),
      'probes': reporting.Table(
          name='probes', metric='client_from_c', methods=('probe',),
          title='Linear probe: client from c (accuracy); the other probes '
                '(client_from_z, digit_from_z, digit_from_c, chance_client, '
                'mark_from_c, mark_from_z, decoder_c_effect, decoder_z_effect) '
                'are in results.jsonl and docs', **probes),
      'probes_z': reporting.Table(
          name='probes_z', metric='digit_from_z', methods=PROBE_METHODS,
          title='Linear probe: digit from z (accuracy), FedDVA (probe) '
                'against a plain VAE trained on the pooled images '
                '(probe_vae, the reference; not federated, no c); '
                'client_from_z and mark_from_z are in results.jsonl', **probes),
  }


TABLES = _tables(DEFAULT_CLASS_ROUNDS, DEFAULT_VAE_ROUNDS)

# The report's run of the authors' recipe with every row at dims 8
# (`--feddva_recipe=authors --feddva_ablate=dims`, 60 FedDVA rounds): its
# tables over seeds, in the report's own columns (`tools/paper_tables.py`).
AUTHORS_RECIPE_VAE_ROUNDS = 60
_AUTHORS_RECIPE = _tables(DEFAULT_CLASS_ROUNDS, AUTHORS_RECIPE_VAE_ROUNDS,
                          {'recipe': 'authors', 'ablate': 'dims'})
EXTRA_TABLES = {f'{name}_authors_recipe': functools.partial(
    reporting.render_markdown, table=_AUTHORS_RECIPE[name])
                for name in ('classification', 'spread', 'probes', 'probes_z')}


def define_flags():
  reporting.define_flags(
      ('integer', 'feddva_vae_rounds', DEFAULT_VAE_ROUNDS,
       'FedDVA: rounds of dual-VAE pre-training.'),
      ('integer', 'feddva_local_epochs', 1, 'FedDVA: local epochs.'),
      ('integer', 'feddva_batch_size', 64, 'FedDVA: batch size (paper 256).'),
      ('list', 'feddva_channels', ['16', '16', '32', '32'],
       'FedDVA: channels of the 4-layer CNN backbones.'),
      ('integer', 'feddva_hidden', 128, 'FedDVA: FC width.'),
      ('integer', 'feddva_probe_dim', 4, 'FedDVA: dim of z and c to probe.'),
      ('integer', 'feddva_class_dim', 8, 'FedDVA: dim of z and c to classify.'),
      ('float', 'feddva_xi', None, 'FedDVA: xi_k (default 8 x dim(c)).'),
      ('float', 'feddva_alpha', 1.0, 'FedDVA: alpha (weight of R_z).'),
      ('float', 'feddva_beta', 0.75, 'FedDVA: beta (weight of R_c).'),
      ('float', 'feddva_learning_rate', 1e-3, 'FedDVA: local Adam lr.'),
      ('float', 'feddva_ditto_lambda', 0.1, 'FedDVA: Ditto lambda.'),
      ('enum', 'feddva_decoder', 'private', 'FedDVA: private or shared.',
       feddva.DECODERS),
      ('enum', 'feddva_schedule', 'paper', "FedDVA: client round (reference: "
       "the authors').", feddva_training.SCHEDULES),
      ('enum', 'feddva_mixture_kl', 'bound', "FedDVA: Eq. 7's mixture KL "
       '(bound: Eq. 26).', feddva_losses.MIXTURE_KL),
      ('float', 'feddva_constraint_weight', 1.0, "FedDVA: Eq. 7's rho."),
      ('enum', 'feddva_recipe', 'paper', 'FedDVA: recipe (feddva_recipes).',
       feddva_recipes.RECIPES),
      ('list', 'feddva_ablate', [], "FedDVA: authors' elements undone."),
      ('integer', 'feddva_checkpoint_every', 10,
       'FedDVA: rounds between checkpoints (0: never).'),
      ('float', 'feddva_dp_noise_multiplier', None,
       'FedDVA: user-level DP noise multiplier of every shared update '
       '(None: no DP).'),
      ('float', 'feddva_dp_clip', 1.0, "FedDVA: DP clip of an update."),
      ('integer', 'feddva_clients_per_round', 0, 'FedDVA: cohort (0: all).'),
      ('enum', 'feddva_marks', 'varied', 'marked_mnist: per image, per '
       'client or none.', feddva_tasks.MARK_MODES),
      ('integer', 'feddva_marked_clients', 4, 'marked_mnist: clients.'),
      ('integer', 'feddva_marked_train', 500, 'marked_mnist: train images.'),
      ('integer', 'feddva_marked_test', 200, 'marked_mnist: test images.'),
      ('integer', 'feddva_skew_clients', 20, 'label_skew_mnist: clients.'),
      ('integer', 'feddva_skew_train', 200, 'label_skew_mnist: train images.'),
      ('integer', 'feddva_skew_test', 100, 'label_skew_mnist: test images.'),
      ('float', 'feddva_dirichlet_alpha', 0.5, 'label_skew_mnist: Dir alpha.'))


# A flag's value where `f` lacks it: flags newer than recorded cells (which
# keep their identity so) and the flags a recipe sets, at their defaults.
_PREDATING = dict(decoder='private', schedule='paper', mixture_kl='bound',
                  constraint_weight=1.0, recipe='paper', ablate=(),
                  marks='fixed', dp_noise_multiplier=None, dp_clip=1.0,
                  checkpoint_every=0, alpha=1.0, beta=0.75, xi=None)
_RECIPE_SETS = ('schedule', 'mixture_kl', 'constraint_weight', 'alpha',
                'beta', 'xi')  # The flags a recipe other than 'paper' sets.
# Lower bounds of the flags (None, as --rounds unset, passes).
_AT_LEAST = dict(rounds=1, feddva_vae_rounds=1, feddva_local_epochs=1,
                 feddva_batch_size=1, feddva_probe_dim=1, feddva_class_dim=1,
                 feddva_hidden=1, feddva_clients_per_round=0,
                 feddva_constraint_weight=0, feddva_checkpoint_every=0)


def _flag(f, name: str, raw: bool = False):
  """--feddva_<name> (`_PREDATING` where `f` lacks it); unless `raw`: ablate
  sorted, rho a float, mixture_kl 'sampled' under its recipe (the same)."""
  value = getattr(f, f'feddva_{name}', _PREDATING[name])
  if raw:
    return value
  if name == 'mixture_kl' and _flag(f, 'recipe') == 'sampled_mixture_kl':
    return 'sampled'
  if name == 'ablate':
    return tuple(sorted(value or ()))
  return float(value) if name == 'constraint_weight' else value


def _class_rounds(f) -> int:
  return f.rounds or DEFAULT_CLASS_ROUNDS


def _check(f) -> None:
  """Refuses flags no cell can run with, naming them."""
  for name, low in _AT_LEAST.items():
    value = getattr(f, name, None)
    if value is not None and not value >= low:
      raise ValueError(f'--{name} must be >= {low}, got {value}')
  recipe = _flag(f, 'recipe')
  feddva_recipes.recipe(recipe, _flag(f, 'ablate'))  # Names a bad input.
  clash = [f'--feddva_{n}' for n in _RECIPE_SETS if recipe != 'paper'
           and _flag(f, n, raw=True) != _PREDATING[n]]
  if clash:
    raise ValueError(
        f'--feddva_recipe={recipe} sets the loss and the schedule; '
        f'{", ".join(clash)} must keep their defaults (switch an element '
        "of the authors' recipe off with --feddva_ablate)")
  if len(f.feddva_channels) != 4:
    raise ValueError(f'--feddva_channels needs 4 values, got '
                     f'{f.feddva_channels}')
  z, clip = _flag(f, 'dp_noise_multiplier'), _flag(f, 'dp_clip')
  if (z is not None and not z >= 0) or not clip > 0:
    raise ValueError('--feddva_dp_noise_multiplier must be >= 0 and '
                     f'--feddva_dp_clip > 0, got {z}, {clip}')


def cells(table: str, f) -> list[reporting.Cell]:
  """Every table's cells: probe, probe_vae (not under DP), methods x tasks."""
  del table
  _check(f)
  # The tables' columns carry the rounds run.
  TABLES.update(_tables(_class_rounds(f), f.feddva_vae_rounds,
                        _variant_setting(f), _flag(f, 'marks'),
                        _dp_setting(f)))
  grid = [(m, 'marked_mnist') for m in PROBE_METHODS
          if m == 'probe' or not _dp_setting(f)]
  grid += [(m, t) for m in METHODS for t in TASK_NAMES]
  return [reporting.Cell(PAPER, m, _setting(m, t, f), s)
          for m, t in grid for s in range(f.seeds)]


def _reconstruction(f) -> str:
  """The decoders' likelihood under the recipe ('bernoulli' or 'focal')."""
  return feddva_recipes.recipe(_flag(f, 'recipe'),
                               _flag(f, 'ablate')).loss.reconstruction


def _variant_setting(f) -> dict:
  """The setting keys of a FedDVA variant, in `_VARIANT_NAMES` order; {} for
  the paper's FedDVA (cells run before these flags keep their identity)."""
  variant = {k: _flag(f, k) for k in ('decoder', 'schedule', 'mixture_kl',
                                      'constraint_weight')
             if _flag(f, k) != _PREDATING[k]}
  if _flag(f, 'recipe') == 'authors':
    variant['recipe'] = 'authors'
    if _flag(f, 'ablate'):
      variant['ablate'] = '+'.join(_flag(f, 'ablate'))
  return variant


def _dp_setting(f) -> dict:
  """The DP keys every cell of a DP run carries ({} without DP)."""
  z = _flag(f, 'dp_noise_multiplier')
  return {} if z is None else {'dp': 'gaussian_fixed',
                               'noise_multiplier': float(z),
                               'clip_norm': float(_flag(f, 'dp_clip'))}


def _setting(method: str, task: str, f) -> dict:
  """A cell's setting: its data and rounds, the variant's keys in FedDVA's
  cells, the DP keys in every federated one (all but probe_vae)."""
  return {**task_setting(task, _flag(f, 'marks')),
          'rounds': (f.feddva_vae_rounds if method in PROBE_METHODS
                     else _class_rounds(f)),
          **(_variant_setting(f) if method in ('probe', 'feddva') else {}),
          **({} if method == 'probe_vae' else _dp_setting(f))}


_TASKS: dict[tuple, feddva_tasks.FeddvaTask] = {}


def _task(name: str, f, seed: int) -> feddva_tasks.FeddvaTask:
  sizes = {'marked_mnist': 'marked', 'label_skew_mnist': 'skew'}.get(name)
  if sizes is None:
    raise ValueError(f'unknown FedDVA task {name!r}')
  kwargs = {k: getattr(f, f'feddva_{sizes}_{flag}') for k, flag in (
      ('num_clients', 'clients'), ('train_per_client', 'train'),
      ('test_per_client', 'test'))}
  kwargs.update({'marks': _flag(f, 'marks')} if sizes == 'marked'
                else {'alpha': f.feddva_dirichlet_alpha})
  kwargs['seed'] = reporting.data_seed(f, seed)  # Which images clients hold.
  data_dir = reporting.data_dir(f)
  if os.path.basename(os.path.normpath(data_dir)) != 'mnist':
    data_dir = os.path.join(data_dir, 'mnist')
  key = (name, data_dir, tuple(sorted(kwargs.items())))
  if key not in _TASKS:
    _TASKS[key] = feddva_tasks.build_task(name, data_dir, **kwargs)
  return _TASKS[key]


def _config(f, dim: int) -> feddva_lib.FeddvaConfig:
  return feddva_lib.FeddvaConfig(
      z_dim=dim, c_dim=dim, channels=tuple(int(c) for c in f.feddva_channels),
      hidden=f.feddva_hidden)


def _base_config(algorithm: str, task, f, seed: int, root_output_dir: str,
                 experiment_name: str, options: dict
                 ) -> experiment.ExperimentConfig:
  """`algorithm` on the one path: Adam on the clients, FedAvg's server."""
  dp, cohort = _dp_setting(f), f.feddva_clients_per_round
  return run_spec.RunSpec(
      task=task.name, algorithm=algorithm, algorithm_options=options,
      loop=run_spec.Loop(
          rounds=_class_rounds(f), seed=seed, resume=True,
          personal_init='normal',  # as the recorded cells started
          clients_per_round=(task.num_clients if not 0 < cohort
                             < task.num_clients else cohort),
          checkpoint_every=max(1, int(_flag(f, 'checkpoint_every') or
                                      _class_rounds(f) + f.feddva_vae_rounds))),
      optimizers=run_spec.Optimizers(
          client='adam', client_learning_rate=f.feddva_learning_rate),
      privacy=run_spec.Privacy(
          mechanism=dp['dp'], noise_multiplier=dp['noise_multiplier'],
          clip_norm=dp['clip_norm']) if dp else run_spec.Privacy(),
      evaluation=run_spec.Evaluation(every=1),
      output=run_spec.Output(root_output_dir, experiment_name)).config()


def _feddva_options(f, dim: int) -> dict:
  """The registered `feddva` algorithm's options under the paper's flags."""
  options = dict(pretrain_rounds=f.feddva_vae_rounds, dim=dim,
                 channels=','.join(str(c) for c in f.feddva_channels),
                 hidden=f.feddva_hidden, decoder=_flag(f, 'decoder'))
  if _flag(f, 'recipe') != 'authors':  # The paper's, or sampled mixture KL.
    options.update(recipe='paper',
                   alpha=float(f.feddva_alpha), beta=float(f.feddva_beta),
                   xi=None if f.feddva_xi is None else float(f.feddva_xi),
                   mixture_kl=_flag(f, 'mixture_kl'),
                   constraint_weight=_flag(f, 'constraint_weight'),
                   schedule=_flag(f, 'schedule'))
  else:
    options['recipe'] = 'authors'
    if _flag(f, 'ablate'):
      options['ablate'] = '+'.join(_flag(f, 'ablate'))
  return options


def feddva_config(task, f, dim: int, seed: int, root: str
                  ) -> experiment.ExperimentConfig:
  """FedDVA's run on `task` (both stages of `feddva`), in
  <root>/runs/_feddva/<pretrain_key>_c<classification rounds>."""
  return _base_config(
      'feddva', task, f, seed,
      os.path.join(root, reporting.RUNS_DIRNAME, _FEDDVA_DIRNAME),
      pretrain_key(task.name, task.num_clients, f, dim, seed)
      + f'_c{_class_rounds(f)}', _feddva_options(f, dim))


def pretrain_key(task_name: str, num_clients: int, f, dim: int,
                 seed: int) -> str:
  """The name of a FedDVA run (`feddva_config` adds the classification
  rounds): everything its pre-training depends on."""
  marks = _flag(f, 'marks')
  train = (f'{f.feddva_marked_train}'
           + ('' if marks == 'fixed' else f'_{marks}marks')
           if task_name == 'marked_mnist'
           else f'{f.feddva_skew_train}_da{f.feddva_dirichlet_alpha}')
  data = '' if getattr(f, 'data_seed', None) is None else f'_data{f.data_seed}'
  return (f'{task_name}_dim{dim}_r{f.feddva_vae_rounds}'
          f'_e{f.feddva_local_epochs}_b{f.feddva_batch_size}'
          f'_ch{"-".join(map(str, f.feddva_channels))}_h{f.feddva_hidden}'
          f'_xi{f.feddva_xi}_a{f.feddva_alpha}_b{f.feddva_beta}'
          f'_n{num_clients}_seed{seed}{data}_tr{train}'
          f'_lr{f.feddva_learning_rate}_cpr{f.feddva_clients_per_round}'
          + ''.join(_variant_names(_variant_setting(f), _CACHE))
          + ''.join(f'_dp{v["noise_multiplier"]:g}c{v["clip_norm"]:g}'
                    for v in [_dp_setting(f)] if v))


def _train(task, f, seed: int, config, what: str) -> runs.Run:
  """The run of `config` on `task`'s clients, trained unless it finished (a
  killed run resumes). Call inside a runtime this program owns."""
  return runs.finished_or_trained(client_data_task.from_feddva_task(
      task.name, task, batch_size=f.feddva_batch_size,
      local_epochs=f.feddva_local_epochs, seed=seed,
      channels=tuple(int(c) for c in f.feddva_channels),
      hidden=f.feddva_hidden), config, log_fn=lambda s: print(
          f'feddva {what}: {s}', flush=True))


def pretrain_feddva(task, f, dim: int, seed: int, root: str) -> dict:
  """The model FedDVA's run on `task` (`feddva_config`; trained unless it
  finished) pre-trained (`feddva.load_pretrained`, kept beside the run), and
  the 'run'. Call inside a runtime this program owns."""
  config = feddva_config(task, f, dim, seed, root)
  pre = feddva.load_pretrained(config.experiment_dir, task.num_clients)
  if pre is None:
    run = _train(task, f, seed, config, f'{task.name} dim {dim} seed {seed}')
    feddva.save_pretrained(run, _config(f, dim), _flag(f, 'decoder'),
                           dim=dim, client_names=task.client_names)
    pre = feddva.load_pretrained(config.experiment_dir, task.num_clients)
  return dict(pre, run=runs.Run.open(config.experiment_dir))


def _run_probe(cell, f, out_dir) -> dict:
  """FedDVA's probes, or the plain VAE's (as many epochs as FedDVA's)."""
  task = _task(cell.setting['task'], f, cell.seed)
  config = _config(f, f.feddva_probe_dim)
  if cell.method == 'probe_vae':
    reps, metrics = feddva_probes.pooled_vae_probes(
        config, task.clients, seed=cell.seed,
        epochs=f.feddva_vae_rounds * f.feddva_local_epochs,
        batch_size=f.feddva_batch_size, learning_rate=f.feddva_learning_rate,
        alpha=f.feddva_alpha)
  else:
    pre = pretrain_feddva(task, f, f.feddva_probe_dim, cell.seed,
                          reporting.root_of(out_dir))
    reps, metrics = feddva_probes.probe_feddva(
        config, pre['encoders'], pre['decoders'], task.clients, cell.seed,
        _reconstruction(f))
    metrics['seconds_per_round'] = pre['seconds_per_round']
    metrics.update(run_analysis.privacy_metrics(pre['run']))
    last = pre['curve'][-1] if pre['curve'] else {}
    metrics.update({f'final_{k}': last[k] for k in (
        'reconstruction', 'kl_z', 'kl_c_prior', 'kl_c_mixture',
        'constraint_met') if k in last})
  np.savez(os.path.join(out_dir, 'representations.npz'), **reps)
  return metrics


# The baselines' registered algorithms (FedAvg is 'global').
_BASELINES = {'fedavg': 'global', 'fedavg_ft': 'fedavg_ft', 'ditto': 'ditto'}


def _cell_dir(root: str, method: str, setting: dict, seed: int = 0) -> str:
  return reporting.Cell(PAPER, method, setting, seed).out_dir(root)


def rounds_to_reach(means, target) -> int | None:
  """First round (1-based) whose mean accuracy is >= target, else None."""
  return next((r for r, m in enumerate(means, 1) if m >= target - 1e-12),
              None)


def _run_classification(cell, f, out_dir) -> dict:
  """The baselines run in the cell's directory; `feddva` is the classifier
  stage of FedDVA's run, which the probe cell of the same dims shares."""
  task, seed = _task(cell.setting['task'], f, cell.seed), cell.seed
  root, extra = reporting.root_of(out_dir), {}
  if cell.method == 'feddva':
    run = pretrain_feddva(task, f, f.feddva_class_dim, seed, root)['run']
    extra['pretrain_rounds'] = f.feddva_vae_rounds
  elif cell.method in _BASELINES:
    run = _train(task, f, seed, _base_config(
        _BASELINES[cell.method], task, f, seed, out_dir, 'run',
        {'lam': f.feddva_ditto_lambda} if cell.method == 'ditto' else {}),
                 f'{cell.method} {task.name} seed {seed}')
  else:
    raise ValueError(f'unknown method {cell.method!r}')
  curve = run_analysis.accuracy_curve(run)
  means, stds = curve['mean'], curve['std']
  extra.update(run_analysis.privacy_metrics(run),
               seconds_per_round=curve['seconds_per_round'])
  atomic_io.write_json(os.path.join(out_dir, 'curve.json'), {
      'round': list(range(1, len(means) + 1)), 'mean': means, 'std': stds,
      'client_names': task.client_names})
  fedavg = os.path.join(_cell_dir(root, 'fedavg', _setting(
      'fedavg', task.name, f), seed), 'curve.json')
  target = (atomic_io.read_json(fedavg)['mean'][-1]
            if os.path.exists(fedavg) else None)
  return {'final_accuracy': means[-1], 'accuracy_std_across_clients': stds[-1],
          'rounds_to_reach_fedavg_final': (
              None if target is None else rounds_to_reach(means, target)),
          'fedavg_final_accuracy': target, **extra}


def run_cell(cell: reporting.Cell, f, out_dir: str) -> dict:
  if cell.method == 'probe_vae':  # Plain TensorFlow; no TFF runtime.
    return _run_probe(cell, f, out_dir)
  with runtime.local_runtime(
      log_path=os.path.join(out_dir, 'worker_binary.log')):
    metrics = (_run_probe if cell.method == 'probe' else
               _run_classification)(cell, f, out_dir)
  try:  # t-SNE is slow: latent figures only after the probe cell.
    make_figures(reporting.root_of(out_dir), f,
                 latent=cell.method == 'probe', curves=cell.method != 'probe')
  except Exception as e:  # pylint: disable=broad-except
    print(f'feddva: figures not rebuilt: {e!r}')
  return metrics


def make_figures(root: str, f, latent: bool = True,
                 curves: bool = True) -> list[str]:
  """Rebuilds the accuracy curves (`curves`) and the probe's FedDVA's figures
  (`latent`, seed 0) from what the runs saved; returns their paths."""
  fig_dir, marks = os.path.join(root, 'figures'), _flag(f, 'marks')
  lines = [(m, {}, m) for m in METHODS]
  for variant in ({'decoder': 'shared'}, _variant_setting(f)):
    if variant and ('feddva', variant) not in [l[:2] for l in lines]:
      lines.append(('feddva', variant, f'feddva{variant_label(variant)}'))
  panels = []
  for t in TASK_NAMES if curves else ():
    drawn = [(label, c) for m, extra, label in lines
             if (c := curve_bands.seed_curves(os.path.dirname(_cell_dir(
                 root, m, {**task_setting(t, marks),
                           'rounds': _class_rounds(f), **extra}))))]
    if drawn:
      panels.append(dict(
          title=f'{t}: mean over clients; '
          f'{figures.seed_spread([c for _, c in drawn])}',
          lines=[dict(curves=c, y='mean', label=label) for label, c in drawn]))
  written = [p for p in [figures.band_figure(
      os.path.join(fig_dir, 'feddva_accuracy_curves.png'), panels,
      xlabel='round', ylabel='test accuracy')] if p]
  reps_path = os.path.join(_cell_dir(root, 'probe', _setting(
      'probe', 'marked_mnist', f)), 'representations.npz')
  if latent and os.path.exists(reps_path):
    suffix = (''.join(_variant_names(_variant_setting(f), _FIGURE))
              + ('' if marks == 'varied' else f'_{marks}_marks'))
    task = _task('marked_mnist', f, 0)
    pre = pretrain_feddva(task, f, f.feddva_probe_dim, 0, root)
    written.append(feddva_probes.reconstruction_grid(
        os.path.join(fig_dir, f'feddva_reconstructions{suffix}.png'),
        _config(f, f.feddva_probe_dim), pre['encoders'], pre['decoders'],
        task.clients, task.client_names, _reconstruction(f),
        shared_decoder=_flag(f, 'decoder') != 'private'))
    with np.load(reps_path) as data:
      reps = {k: data[k] for k in data.files}
    written.append(feddva_probes.latent_figure(
        os.path.join(fig_dir, f'feddva_tsne{suffix}.png'), reps,
        task.client_names))
  return written
