"""FURL (Bui et al. 2019): Table 2 on the `speaker_context` task.

`python -m binaries.reproduce --paper=furl --table=table2` runs the four
configurations of FURL's Table 2 on the same users and splits: centralized
training without and with a user-embedding table (`global_server`,
`personalized_server`: `algorithms/centralized.py`), FedAvg (`global_fl`)
and FURL, whose user embedding is private client state (`personalized_fl`).
docs/papers/furl.md says what each table, cell and figure is.
"""

from __future__ import annotations

import dataclasses
import glob
import math
import os
from typing import Any

import numpy as np

from tasks import speaker_context
from tasks import speaker_task
from tff_personal.algorithms import centralized
from tff_personal.config import run_spec
from tff_personal.core import atomic_io
from tff_personal.core import runtime
from tff_personal.models import furl_text
from tff_personal.reports import curve_bands
from tff_personal.reports import embedding_purity
from tff_personal.reports import figures
from tff_personal.reports import reporting
from tff_personal.run import runs

PAPER = 'furl'
_DIM = 32  # FURL's best user-embedding size on Subreddit.
_METHODS = ('global_server', 'personalized_server', 'global_fl',
            'personalized_fl')
_SERVER = ('global_server', 'personalized_server')

TABLES = {
    'table2': reporting.Table(
        name='table2', paper=PAPER, metric='accuracy', methods=_METHODS,
        columns=[
            reporting.Column('no DP', {'dp': 'none', 'embedding_dim': _DIM}),
            reporting.Column('DP', {'dp': 'gaussian_fixed',
                                    'embedding_dim': _DIM}),
        ],
        # FURL Table 2, Subreddit (accuracy; the Sticker task reports AUC).
        paper_values={('global_server', 'no DP'): '28.93',
                      ('personalized_server', 'no DP'): '66.13',
                      ('global_fl', 'no DP'): '11.90',
                      ('personalized_fl', 'no DP'): '62.41'},
        title='FURL Table 2 (test accuracy, %); paper: Subreddit',
        scale=100.0, digits=2,
        notes='DP: user-level DP on the federated parameters only (server '
              'methods have no DP cell); epsilon in results.jsonl.'),
    # The same cells as table2: FL users' test accuracy after one local pass
    # of their private embedding over their own training documents (shared
    # model frozen; nothing leaves the device). FURL tests with the stored
    # embedding, which a user last trained against an older shared model.
    'table2_fine_tuned': reporting.Table(
        name='table2_fine_tuned', paper=PAPER, metric='accuracy_fine_tuned',
        methods=('personalized_fl',),
        columns=[
            reporting.Column('no DP', {'dp': 'none', 'embedding_dim': _DIM}),
            reporting.Column('DP', {'dp': 'gaussian_fixed',
                                    'embedding_dim': _DIM}),
        ],
        title='Personalized FL after one local pass of the private '
              'embedding at test time (test accuracy, %)',
        scale=100.0, digits=2,
        notes='Not in the paper: FURL tests with the stored embedding '
              '(table2). Same runs as table2.'),
    'sweep': reporting.Table(
        name='sweep', paper=PAPER, metric='accuracy',
        methods=('personalized_server', 'personalized_fl'),
        columns=[reporting.Column(f'dim {d}', {'dp': 'none', 'embedding_dim': d})
                 for d in (4, 8, 16, 32)],
        title='User-embedding size sweep (test accuracy, %)', scale=100.0),
}


# How often a cell evaluates (its learning curve), not what it computes
# (`train_centralized` is tested to train the same with evaluations within
# an epoch; the FL run's evaluation reads states and never writes them):
# left out of a record's config.
OPERATIONAL_FLAGS = ('furl_evals_per_epoch',)


def define_flags():
  reporting.define_flags(
      ('integer', 'furl_fl_epochs', 5, 'FURL: FL epochs.'),
      ('integer', 'furl_server_epochs', 5, 'FURL: server-training epochs.'),
      ('integer', 'furl_evals_per_epoch', 2,
       'FURL: evaluations per epoch for the learning curves.'),
      ('float', 'furl_client_learning_rate', 3e-3, 'FURL: local Adam lr.'),
      ('float', 'furl_private_learning_rate', 0.05,
       'FURL: local Adam lr of the private user embedding.'),
      ('float', 'furl_server_learning_rate', 3e-3,
       'FURL: centralized Adam lr.'),
      ('float', 'furl_target_epsilon', 10.0, 'FURL: epsilon of DP cells.'),
      ('float', 'furl_clip_norm', 0.5, 'FURL: DP clip of a client update.'),
      ('integer', 'furl_min_docs', speaker_context.DEFAULT_MIN_DOCS,
       'FURL: users need at least this many documents.'))


def cells(table: str, flag_values) -> list[reporting.Cell]:
  out = TABLES[table].cells(flag_values.seeds)
  # Server training has no DP cell: DP here protects the federated update.
  return [c for c in out
          if not (c.method in _SERVER and c.setting['dp'] != 'none')]


_TASKS: dict[tuple, Any] = {}


def _task(data_dir: str, seed: int, min_docs: int) -> speaker_task.SpeakerTask:
  key = (data_dir, seed, min_docs)
  if key not in _TASKS:
    _TASKS[key] = speaker_task.speaker_context_task(
        data_dir, seed=seed, min_docs=min_docs)
  return _TASKS[key]


def run_cell(cell: reporting.Cell, flag_values, out_dir: str) -> dict:
  task = _task(reporting.data_dir(flag_values),
               reporting.data_seed(flag_values, cell.seed),
               flag_values.furl_min_docs)
  dim = cell.setting['embedding_dim']
  if cell.method in _SERVER:
    metrics = _run_server(task, cell, flag_values, out_dir,
                          dim if cell.method == 'personalized_server' else 0)
  else:
    metrics = _run_fl(task, cell, flag_values, out_dir)
  make_figures(reporting.root_of(out_dir), task)
  return metrics


def _run_server(task, cell, f, out_dir, dim) -> dict:
  warm = list(range(task.population))
  config = dataclasses.replace(task.model_config, user_embedding_dim=dim)
  model = furl_text.build_centralized_model(config, task.population)
  result = centralized.train_centralized(
      model, task.pooled(warm, 'train', 32, shuffle_seed=cell.seed),
      task.pooled(warm, 'eval', 256), epochs=f.furl_server_epochs,
      learning_rate=f.furl_server_learning_rate, optimizer='adam',
      seed=cell.seed, evals_per_epoch=_evals_per_epoch(f),
      test_data=task.pooled(warm, 'test', 256))
  curve = {'epoch': [e for e, _ in result.curve],
           'eval_accuracy': [a for _, a in result.curve]}
  atomic_io.write_json(os.path.join(out_dir, 'curve.json'), curve)
  if dim:
    table = model.get_layer('user_embedding_table').get_weights()[0]
    np.savez(os.path.join(out_dir, 'embeddings.npz'), ids=np.arange(len(warm)),
             embeddings=table)
  return {'accuracy': result.test_accuracy,
          'seconds_per_epoch': result.seconds_per_epoch,
          'epochs': f.furl_server_epochs}


def fl_spec(cell: reporting.Cell, f, out_dir: str, population: int
            ) -> run_spec.RunSpec:
  """An FL cell's run: FedAvg (`global_fl`) or FURL (`personalized_fl`,
  the cell's user-embedding size) on the speaker task, cohorts of 10,
  `--furl_fl_epochs` passes over the users, one checkpoint per epoch;
  a DP cell calibrates to `--furl_target_epsilon` at delta
  `default_target_delta(population)`."""
  rounds_per_epoch = math.ceil(population / 10)
  changes = {
      'loop.rounds': f.furl_fl_epochs * rounds_per_epoch,
      'loop.seed': cell.seed, 'loop.checkpoint_every': rounds_per_epoch,
      'optimizers.client_learning_rate': f.furl_client_learning_rate,
      'optimizers.private_learning_rate': f.furl_private_learning_rate,
      'evaluation.every': max(1, rounds_per_epoch // _evals_per_epoch(f)),
      'output.root_output_dir': out_dir}
  if cell.method == 'personalized_fl':
    changes.update({'algorithm': 'furl',
                    'loop.embedding_dim': cell.setting['embedding_dim'],
                    'evaluation.test_fine_tune': True})
  if cell.setting['dp'] != 'none':
    changes.update({'privacy.mechanism': cell.setting['dp'],
                    'privacy.target_epsilon': f.furl_target_epsilon,
                    'privacy.clip_norm': f.furl_clip_norm})
  return run_spec.RunSpec(
      task='speaker_context', algorithm='global',
      task_options={'min_docs': f.furl_min_docs},
      loop=run_spec.Loop(clients_per_round=10, resume=True,
                         # As the recorded cells started.
                         personal_init='normal'),
      output=run_spec.Output(experiment_name='fl')).override(changes)


def _run_fl(task, cell, f, out_dir) -> dict:
  rounds_per_epoch = math.ceil(task.population / 10)
  config = fl_spec(cell, f, out_dir, task.population).config()
  with runtime.local_runtime(
      log_path=os.path.join(out_dir, 'worker_binary.log')):
    run = runs.run_experiment(
        task, config, export_private_states=cell.method == 'personalized_fl')
  exp_dir = config.experiment_dir
  curve = _fl_curve(run.curves()['eval'], rounds_per_epoch)
  atomic_io.write_json(os.path.join(out_dir, 'curve.json'), curve)
  states = os.path.join(exp_dir, 'private_states.npz')
  if os.path.exists(states):
    with np.load(states) as z:
      np.savez(os.path.join(out_dir, 'embeddings.npz'), ids=z['ids'],
               embeddings=z['private_0'])
  metrics = {'accuracy': run['test']['accuracy'],
             'seconds_per_round': run['seconds_per_round'],
             'rounds': run['rounds_completed'],
             'epochs': f.furl_fl_epochs}
  if run.get('test_fine_tuned'):
    metrics['accuracy_fine_tuned'] = run['test_fine_tuned']['accuracy']
  if run.get('cold_start'):
    metrics['cold_start_accuracy'] = run['cold_start']['accuracy']
  if run['privacy']:
    metrics['epsilon'] = run['privacy']['epsilon']
    metrics['delta'] = run['privacy']['delta']
    metrics['noise_multiplier'] = run['privacy']['noise_multiplier']
  return metrics


def _evals_per_epoch(f) -> int:
  k = getattr(f, 'furl_evals_per_epoch', None)
  if k is None:
    return 1
  if k < 1:
    raise ValueError(f'--furl_evals_per_epoch must be >= 1, got {k}')
  return k


def _fl_curve(rows: list[dict], rounds_per_epoch: int) -> dict:
  """The evaluated accuracy per epoch, from a run's eval rows."""
  rows = [r for r in rows if 'accuracy' in r]
  return {'epoch': [int(r['round']) / rounds_per_epoch for r in rows],
          'eval_accuracy': [float(r['accuracy']) for r in rows]}


def make_figures(root_output_dir: str, task: speaker_task.SpeakerTask) -> None:
  """Learning curves (FURL Figure 5), the t-SNE of the user embeddings
  (Figure 7) and their 5-NN community purity, from the saved runs."""
  runs_dir = os.path.join(root_output_dir, reporting.RUNS_DIRNAME, PAPER)
  out = os.path.join(root_output_dir, reporting.TABLES_DIRNAME, PAPER)
  lines = []
  for i, method in enumerate(_METHODS):  # A colour per method, a style per DP.
    for dp, style in (('none', '-'), ('gaussian_fixed', '--')):
      lines.append(dict(
          curves=curve_bands.seed_curves(os.path.join(
              runs_dir, method, f'dp={dp}_embedding_dim={_DIM}-*'),
                                         x='epoch'),
          y='eval_accuracy', color=f'C{i}', linestyle=style,
          label=method + (', DP' if dp != 'none' else '')))
  figures.band_figure(
      os.path.join(out, 'furl_learning_curves.png'),
      [dict(title='speaker_context: FL vs server (FURL Fig. 5)\n' +
            figures.seed_spread([l['curves'] for l in lines]), lines=lines)],
      x='epoch', xlabel='epoch', ylabel='eval accuracy', panel_size=(6.5, 4))
  purity, panels = {}, []
  for method in ('personalized_server', 'personalized_fl'):
    for path in sorted(glob.glob(os.path.join(
        runs_dir, method, f'*dp=none*embedding_dim={_DIM}*', 'seed_0',
        'embeddings.npz'))):
      with np.load(path) as z:
        ids, emb = z['ids'], z['embeddings']
      labels = task.communities(ids)
      purity[method] = {'knn5_purity': embedding_purity.knn_purity(emb, labels),
                        'chance': embedding_purity.chance_purity(labels),
                        'users': len(ids)}
      panels.append((method, emb, labels))
  atomic_io.write_json(os.path.join(out, 'furl_purity.json'), purity)
  if not panels:
    return
  fig, axes = figures.pyplot().subplots(
      1, len(panels), figsize=(6 * len(panels), 5), squeeze=False)
  for ax, (method, emb, labels) in zip(axes[0], panels):
    xy = figures.map_2d(emb)
    shows = labels < 2  # friends, game_of_thrones; the rest are plays
    ax.scatter(xy[~shows, 0], xy[~shows, 1], c=labels[~shows], cmap='tab20',
               s=8, label='Shakespeare plays (colour = play)')
    for lab, colour, name in ((0, 'black', 'Friends'),
                              (1, 'red', 'Game of Thrones')):
      sel = labels == lab
      ax.scatter(xy[sel, 0], xy[sel, 1], c=colour, s=10, marker='x',
                 label=name)
    ax.set_title(f'{method}: user embeddings (5-NN purity '
                 f'{purity[method]["knn5_purity"]:.2f})')
    ax.legend(fontsize=7)
  fig.tight_layout()
  figures.save(fig, os.path.join(out, 'furl_embeddings_tsne.png'))
