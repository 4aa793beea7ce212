"""Group Personalized FL (Tables 3 / 6 and 4, Figure 1) on Shakespeare.

FL, PerFL, GroupFL and GroupPerFL (`algorithms/group_fl.py`) from one
registered `groupfl` run per seed (`train_config`), its clients evaluated
through the library (`run_analysis`); data-driven groups from clustered
client updates; controls from an FL model trained to a validation plateau.

  python -m binaries.reproduce --paper=group --table=table3 --seeds=5 \
    --root_output_dir=out/group --data_dir=../shared/data

Tables (`--table`): table3, table4_communication, table4_computation,
improved, grouping, control, control_margin, control_rounds. The paper's
readings, our choices and the results: docs/papers/group.md.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os

import numpy as np
import tensorflow_federated as tff

from tasks import shakespeare_groups
from tff_personal.algorithms import group_fl
from tff_personal.algorithms import update_clustering
from tff_personal.config import experiment
from tff_personal.config import run_spec
from tff_personal.config import strategies
from tff_personal.core import atomic_io
from tff_personal.core import runtime
from tff_personal.reports import curve_bands
from tff_personal.reports import figures
from tff_personal.reports import reporting
from tff_personal.run import run_analysis
from tff_personal.run import runs

PAPER = 'group'
METHODS = ('fl', 'perfl', 'groupfl', 'groupperfl')
ALL = 'all'
# The controls' methods, and each group method's two controls.
CONTROL_METHODS = ('fl', 'fl_more', 'fl_more_lowlr', 'groupfl',
                   'groupfl_keep', 'groupfl_lowlr', 'groupfl_shuffled',
                   'groupfl_shuffled_lowlr', 'perfl', 'perfl_more',
                   'perfl_more_lowlr', 'groupperfl', 'groupperfl_keep',
                   'groupperfl_lowlr', 'groupperfl_shuffled',
                   'groupperfl_shuffled_lowlr')
# The `*_lowlr` group methods against controls at the same low lr.
CONTROLS_OF = {'groupfl': ('fl_more', 'groupfl_shuffled'),
               'groupfl_keep': ('fl_more', 'groupfl_shuffled'),
               'groupfl_lowlr': ('fl_more_lowlr', 'groupfl_shuffled_lowlr'),
               'groupperfl': ('perfl_more', 'groupperfl_shuffled'),
               'groupperfl_keep': ('perfl_more', 'groupperfl_shuffled'),
               'groupperfl_lowlr': ('perfl_more_lowlr',
                                    'groupperfl_shuffled_lowlr')}
# The `*_lowlr` controls' group-stage server learning rate, as a share of
# the FL stage's (`--group_server_lr`).
LOWLR_SHARE = 0.1
PLATEAU = 'plateau'  # The setting of the controls' cells: FL to a plateau.
_COLUMNS = [reporting.Column(g, {'group': g})
            for g in shakespeare_groups.GROUP_NAMES + (ALL,)]
_CONTROL_COLUMNS = [reporting.Column(g, {'group': g, 'fl': PLATEAU})
                    for g in shakespeare_groups.GROUP_NAMES + (ALL,)]
_PAPER_NOTE = ('Paper (wiki, Table 6): GroupPerFL beats PerFL by 2-12% on '
               'every topic; video (Table 3): 5-20% on most categories. Our '
               'groups are genres of Shakespeare plays.')
_VIDEO = 'Paper values: its "general" video category.'


def _table(name, metric, methods, title, columns=_COLUMNS, digits=1, **kw):
  return reporting.Table(name=name, paper=PAPER, metric=metric,
                         methods=methods, columns=columns, digits=digits,
                         title=title, **kw)


TABLES = {t.name: t for t in (
    _table('table3', 'perplexity', METHODS,
           'Perplexity per genre (Tables 3 / 6 of the paper)',
           notes=_PAPER_NOTE),
    _table('table4_communication', 'communication', METHODS,
           'Communication per client, in model sizes (Table 4)', digits=2,
           paper_values={('fl', ALL): '3060', ('perfl', ALL): '3060',
                         ('groupfl', ALL): '3990',
                         ('groupperfl', ALL): '3990'}, notes=_VIDEO),
    _table('table4_computation', 'computation', METHODS,
           'Computation per client, in local epochs (Table 4)', digits=2,
           paper_values={('fl', ALL): '20', ('perfl', ALL): '25',
                         ('groupfl', ALL): '30', ('groupperfl', ALL): '35'},
           notes=_VIDEO),
    _table('improved', 'share_clients_improved', ('groupperfl',),
           'Clients improved by GroupPerFL over PerFL, % (Figure 1)',
           scale=100.0, paper_values={('groupperfl', ALL): 'about 70'}),
    _table('grouping', 'adjusted_rand_index', ('update_clustering',),
           'Data-driven groups vs genres (adjusted Rand index)',
           columns=[reporting.Column(ALL, {'group': ALL})], digits=3),
    _table('control', 'perplexity', CONTROL_METHODS,
           'Controls: FL trained to a validation plateau; GroupFL and '
           'GroupPerFL against equal-budget FL and shuffled groups',
           columns=_CONTROL_COLUMNS,
           notes='fl: FL at the plateau round T (table control_rounds). '
                 '*_more: FL continued from it for T_g rounds with '
                 'GroupFL\'s client budget (then personalized for '
                 'perfl_more). *_shuffled: the group method on random '
                 'groups of the genres\' sizes. *_keep: group stages from '
                 'the FL stage\'s FedAdam state; *_lowlr: from a fresh one '
                 'at a tenth of the server lr (the method and its '
                 'controls). Not in the paper.'),
    _table('control_margin', 'margin', tuple(CONTROLS_OF),
           'Group method minus the better of its two controls '
           '(perplexity; negative: the genre groups beat both)',
           columns=_CONTROL_COLUMNS,
           notes='groupfl against fl_more and groupfl_shuffled; groupperfl '
                 'against perfl_more and groupperfl_shuffled (*_keep: the '
                 'same; *_lowlr: the controls at the same low lr); per '
                 'seed, then mean ± std. Not in the paper.'),
    _table('control_rounds', 'fl_rounds', ('fl',),
           'T: FL rounds to the validation plateau',
           columns=[_CONTROL_COLUMNS[-1]], digits=0,
           notes='The rule: tff_personal/run/run_analysis.py, plateau_round.'))}


def define_flags():
  g, c = 'Group: ', 'Group controls: '
  reporting.define_flags(
      ('integer', 'group_vocab_size', 2000, g + 'vocabulary (4 special).'),
      ('integer', 'group_seq_len', 16, g + 'tokens per speech (cap).'),
      ('integer', 'group_embedding_dim', 32, g + 'word embedding size.'),
      ('integer', 'group_lstm_units', 64, g + 'LSTM units.'),
      ('integer', 'group_lstm_layers', 1, g + 'LSTM layers.'),
      ('integer', 'group_rounds', 20, g + 'T, global FL rounds.'),
      ('integer', 'group_group_rounds', 10, g + 'T_g, rounds per group.'),
      ('integer', 'group_clients_per_round', 20, g + 'FL cohort.'),
      ('integer', 'group_group_clients_per_round', 10, g + 'group cohort.'),
      ('integer', 'group_local_epochs', 1, g + 'K, local epochs.'),
      ('float', 'group_client_lr', 1.0, g + 'client SGD lr.'),
      ('float', 'group_server_lr', 0.03, g + 'FedAdam lr.'),
      ('integer', 'group_personalization_epochs', 5, g + 'K_l.'),
      ('list', 'group_personalization_lrs', ['0.01', '0.1', '1.0'],
       g + 'personalization SGD lrs swept.'),
      ('integer', 'group_eval_clients_per_group', 10,
       g + 'evaluated clients per genre (0: all).'),
      ('integer', 'group_sweep_clients_per_group', 2,
       g + 'clients per genre that select the personalization lr.'),
      ('integer', 'group_max_clients', 0, g + 'clients sampled (0: all).'),
      ('bool', 'group_clustering', True, g + 'table grouping too.'),
      ('integer', 'group_cluster_clients', 60, g + 'clustered (0: all).'),
      ('integer', 'group_plateau_max_rounds', 800, c + 'most FL rounds.'),
      ('integer', 'group_plateau_eval_every', 10, c + 'rounds per eval.'),
      ('integer', 'group_plateau_window', 50, c + 'rounds after T.'),
      ('float', 'group_plateau_tolerance', 0.01, c + 'relative progress.'),
      ('integer', 'group_validation_clients_per_group', 25,
       c + 'validation clients per genre.'))


def cells(table: str, flag_values) -> list[reporting.Cell]:
  _config(flag_values)  # Validates the flags before anything runs.
  return TABLES[table].cells(flag_values.seeds)


def _config(f) -> dict:
  cfg = {k: getattr(f, 'group_' + k) for k in (
      'vocab_size', 'seq_len', 'embedding_dim', 'lstm_units', 'lstm_layers',
      'group_rounds', 'group_clients_per_round', 'local_epochs', 'client_lr',
      'server_lr', 'personalization_epochs', 'eval_clients_per_group',
      'sweep_clients_per_group', 'cluster_clients')}
  cfg.update(
      data_dir=os.path.abspath(reporting.data_dir(f)),
      rounds=getattr(f, 'rounds', None) or f.group_rounds,
      clients_per_round=(getattr(f, 'clients_per_round', None)
                         or f.group_clients_per_round),
      personalization_lrs=sorted(float(x) for x in f.group_personalization_lrs),
      max_clients=f.group_max_clients or None,
      clustering=bool(f.group_clustering),
      plateau={**{k: getattr(f, 'group_plateau_' + k) for k in (
          'max_rounds', 'eval_every', 'window', 'tolerance')},
               'validation_clients_per_group': (
                   f.group_validation_clients_per_group)})
  if getattr(f, 'data_seed', None) is not None:  # absent: digests unchanged
    cfg['data_seed'] = reporting.data_seed(f, 0)
  p, lrs = cfg['plateau'], cfg['personalization_lrs']
  wrong = [what for ok, what in (
      (min(cfg['rounds'], cfg['group_rounds'], cfg['local_epochs'],
           cfg['sweep_clients_per_group'],
           p['validation_clients_per_group']) >= 1,
       'rounds, local_epochs, sweep and validation clients must be >= 1'),
      (min(cfg['clients_per_round'], cfg['group_clients_per_round']) >= 1,
       'clients per round must be >= 1'),
      (min(cfg['personalization_epochs'], cfg['cluster_clients'],
           cfg['eval_clients_per_group']) >= 0,
       'personalization_epochs, cluster and eval clients must be >= 0'),
      (bool(lrs) and min(lrs) > 0, 'personalization lrs must be positive'),
      (min(cfg['client_lr'], cfg['server_lr']) > 0, 'lrs must be positive'),
      (1 <= p['eval_every'] <= p['window'] <= p['max_rounds'] -
       p['eval_every'] and 0 <= p['tolerance'] < 1, 'the plateau rule needs '
       '1 <= eval_every <= window <= max_rounds - eval_every, tolerance in '
       '[0, 1)'),
      (os.path.isdir(cfg['data_dir']), 'the data dir must exist')) if not ok]
  if wrong:
    raise ValueError(f'group: {"; ".join(wrong)} (got {cfg})')
  return cfg


def run_cell(cell: reporting.Cell, flag_values, out_dir: str) -> dict:
  cfg = _config(flag_values)
  root = reporting.root_of(out_dir)
  directory = _config_dir(root, cfg, cell.seed)
  if cell.setting.get('fl') == PLATEAU:  # The controls (tables control*).
    directory = os.path.join(directory, 'controls_' + _digest(cfg['plateau']))
    result = _cached(cfg, cell.seed, directory, 'controls.json',
                     _run_controls, lambda: (
                         make_plateau_figure(root, os.path.dirname(directory)),
                         make_control_curves_figure(root, directory)),
                     complete=lambda r: set(CONTROL_METHODS) <= set(r))
  else:
    result = _cached(cfg, cell.seed, directory, 'pipeline.json',
                     _run_pipeline, lambda: (
                         make_figures(root, directory),
                         make_training_figure(root, directory),
                         make_curves_figure(root, directory)))
    if cell.method == 'update_clustering':
      if 'clustering' not in result:
        raise ValueError('group: clustering is off (--group_clustering)')
      return dict(result['clustering'])
    result = result['cells']
  return dict(result[cell.method][cell.setting['group']])


def _samples(task, cfg, seed, validation=False):
  """Disjoint seeded samples per genre of its clients with evaluation
  speeches: (eval clients, sweep clients), or the validation clients."""
  out = ([], [], [])
  for g in task.group_names:
    order = np.random.default_rng(
        [cfg.get('data_seed', seed), 0xE7, len(g)] + [ord(ch) for ch in g]
    ).permutation([c for c in task.clients_of(g)
                   if task.num_eval(c) > 0]).tolist()
    n_sweep = min(cfg['sweep_clients_per_group'], len(order) // 2)
    out[1].extend(order[:n_sweep])
    out[0].extend(order[n_sweep:][:cfg['eval_clients_per_group'] or None])
    rest = order[n_sweep + (cfg['eval_clients_per_group'] or len(order)):]
    if validation and not rest:
      raise ValueError(f'group: genre {g} has no client left for validation '
                       'after the sweep and evaluated ones; lower '
                       '--group_eval_clients_per_group')
    out[2].extend(rest[:cfg['plateau']['validation_clients_per_group']])
  return sorted(out[2]) if validation else (sorted(out[0]), sorted(out[1]))


def _pools(task, eval_clients) -> dict[str, list[int]]:
  """The evaluated clients of each genre, and `all` of them."""
  return {**{g: [c for c in eval_clients if task.client_groups[c] == g]
             for g in task.group_names}, ALL: list(eval_clients)}


def _digest(value) -> str:
  return hashlib.sha256(json.dumps(value, sort_keys=True).encode()
                        ).hexdigest()[:10]


_EVALUATOR = 'client_outputs'  # How the cached evaluations were made.


def _config_dir(root, cfg, seed):
  """The pipeline's directory, keyed by the configuration (without the
  controls' plateau rule) and `_EVALUATOR`."""
  digest = _digest({**{k: v for k, v in cfg.items() if k != 'plateau'},
                    'evaluator': _EVALUATOR})
  return os.path.join(root, reporting.RUNS_DIRNAME, PAPER, 'pipeline',
                      digest, f'seed_{seed}')


def base_spec(cfg: dict) -> run_spec.RunSpec:
  """The paper's runs: FedAvg on `shakespeare_groups`, local SGD, FedAdam,
  resumed when killed; each run is this spec with overrides."""
  return run_spec.RunSpec(
      task='shakespeare_groups', algorithm='global',
      task_options={k: cfg[k] for k in (
          'vocab_size', 'seq_len', 'embedding_dim', 'lstm_units',
          'lstm_layers', 'max_clients', 'local_epochs')},
      loop=run_spec.Loop(clients_per_round=cfg['clients_per_round'],
                         resume=True,
                         # As the recorded cells started.
                         personal_init='normal'),
      optimizers=run_spec.Optimizers(
          client='sgd', client_learning_rate=cfg['client_lr'],
          server='adam', server_learning_rate=cfg['server_lr']))


def _task(cfg, seed):
  """The registered task (its runs record how it was built)."""
  return base_spec(cfg).build_task(data_dir=cfg['data_dir'],
                                   seed=cfg.get('data_seed', seed))


def _personalization(cfg, lr: float):
  """Algorithm 3: K_l local epochs of SGD at `lr` (none with K_l = 0)."""
  if not cfg['personalization_epochs']:
    return strategies.AsTrained()
  return strategies.FineTune(epochs=cfg['personalization_epochs'],
                             learning_rate=lr, optimizer='sgd')


def train_config(cfg: dict, seed: int, directory: str,
                 grouping: str = 'task', num_groups: int = 1,
                 keep_checkpoints: int = 3,
                 server_state: str = 'fresh',
                 group_server_lr: float = 0.0) -> experiment.ExperimentConfig:
  """The one-path run (`groupfl`) behind the tables.

  Stage 'fl': T rounds of `clients_per_round` over every client; then T_g
  rounds per group of `group_clients_per_round` among its clients.
  `grouping='one'` is the control `fl_more` (one group of everyone, at
  GroupFL's budget of `num_groups` cohorts a round); `server_state` and
  `group_server_lr` (0: `server_lr`) are `groupfl`'s group-stage options.
  """
  one = grouping == 'one'
  stage_options = ({'server_state': server_state}
                   if server_state != 'fresh' else {})
  if group_server_lr:
    stage_options['group_server_lr'] = group_server_lr
  return base_spec(cfg).override({
      'algorithm': 'groupfl', 'loop.rounds': cfg['group_rounds'],
      'loop.clients_per_round': cfg['group_clients_per_round'] * (
          num_groups if one else 1),
      'loop.seed': seed, 'loop.keep_checkpoints': keep_checkpoints,
      'output.root_output_dir': directory,
      'output.experiment_name': (
          'fl_more' if one else f'groupfl_{grouping}') + (
              f'_{server_state}' if server_state != 'fresh' else '') + (
                  f'_glr{group_server_lr:g}' if group_server_lr else ''),
      **{f'algorithm_options.{k}': v for k, v in {
          'fl_rounds': cfg['rounds'],
          'fl_clients_per_round': cfg['clients_per_round'],
          'grouping': grouping, **stage_options}.items()}}).config()


def _fl_curve_config(cfg, seed, directory) -> experiment.ExperimentConfig:
  """The controls' FL run (`global`) for up to `max_rounds`, evaluated
  every `eval_every` rounds, a checkpoint kept every `2 * eval_every`."""
  p = cfg['plateau']
  return base_spec(cfg).override({
      'loop.rounds': p['max_rounds'], 'loop.seed': seed,
      'loop.checkpoint_every': 2 * p['eval_every'],
      'loop.keep_checkpoints': max(3, p['max_rounds'] //
                                   (2 * p['eval_every'])),
      'evaluation.every': p['eval_every'],
      'output.root_output_dir': directory,
      'output.experiment_name': 'fl_curve'}).config()


# The controls' group-stage runs: (grouping, server_state, group-stage
# server lr as a share of the FL stage's (0: the same), method, its
# personalized method). They share one FL stage (`Stage.shared_as`).
_CONTROL_RUNS = (('task', 'fresh', 0.0, 'groupfl', 'groupperfl'),
                 ('task', 'keep', 0.0, 'groupfl_keep', 'groupperfl_keep'),
                 ('task', 'fresh', LOWLR_SHARE, 'groupfl_lowlr',
                  'groupperfl_lowlr'),
                 ('shuffled', 'fresh', 0.0, 'groupfl_shuffled',
                  'groupperfl_shuffled'),
                 ('one', 'fresh', 0.0, 'fl_more', 'perfl_more'),
                 ('shuffled', 'fresh', LOWLR_SHARE, 'groupfl_shuffled_lowlr',
                  'groupperfl_shuffled_lowlr'),
                 ('one', 'fresh', LOWLR_SHARE, 'fl_more_lowlr',
                  'perfl_more_lowlr'))


def _control_config(cfg_t, seed, directory, control_run, num_groups,
                    **kwargs) -> experiment.ExperimentConfig:
  """The one-path run of a `_CONTROL_RUNS` entry."""
  grouping, server_state, lr_share = control_run[:3]
  return train_config(cfg_t, seed, directory, grouping, num_groups,
                      server_state=server_state,
                      group_server_lr=lr_share * cfg_t['server_lr'], **kwargs)


def _step(directory: str, name: str, compute):
  """An analysis step's JSON result, cached as `directory/<name>.json`."""
  return atomic_io.cached_json(os.path.join(directory, name + '.json'),
                               compute)


def _train(task, config, log_fn, **kwargs) -> runs.Run:
  return runs.finished_or_trained(task, config, log_fn=lambda s: log_fn(
      f'group {config.experiment_name}: {s}'), **kwargs)


def _cached(cfg, seed, directory, filename, run_fn, after,
            complete=lambda result: True, log_fn=None) -> dict:
  """`run_fn(task, cfg, seed, directory, log_fn)`'s result, cached in
  `directory/filename` (computed again from its cached steps unless
  `complete`); `after()` (the figures) once it is written."""
  log_fn = log_fn or (lambda s: print(s, flush=True))
  final = os.path.join(directory, filename)
  if os.path.exists(final):
    result = atomic_io.read_json(final)
    if complete(result):
      return result
  atomic_io.write_json(os.path.join(directory, 'config.json'), cfg)
  task = _task(cfg, seed)
  with runtime.local_runtime(os.path.join(directory, 'worker_binary.log')):
    result = run_fn(task, cfg, seed, directory, log_fn)
  atomic_io.write_json(final, result)
  after()
  return result


def _evaluate(cfg, directory, methods, clients, log_fn):
  """`run_analysis.evaluate_methods` of `{method: (run, stage, personal)}`
  (personal: `_personalization`, its lr chosen on the sweep clients) on
  `clients` (eval, sweep): `({method: {client: token sums}}, sweeps)`."""
  sums, chosen = run_analysis.evaluate_methods(
      directory, {m: (run, stage, (lambda lr: _personalization(cfg, lr))
                      if personal else None)
                  for m, (run, stage, personal) in methods.items()},
      *clients, cfg['personalization_lrs'], score=group_fl.perplexity,
      reduce=group_fl.token_sums, log_fn=lambda s: log_fn(f'group: {s}'))
  return sums, {m: {'perplexity_by_lr': {f'{k:g}': v for k, v in by_lr.items()},
                    'lr': lr} for m, (lr, by_lr) in chosen.items()}


def _run_pipeline(task, cfg, seed, directory, log_fn) -> dict:
  run = _train(task, train_config(cfg, seed, directory, keep_checkpoints=max(
      cfg['rounds'], cfg['group_rounds'], 3)), log_fn)  # Every round's.
  fl_part, group_part = run.participations(stage='fl'), run.participations()
  clients = _samples(task, cfg, seed)  # (eval, sweep)
  evaluated = clients[0]
  sums, sweep = _evaluate(cfg, directory, {
      'fl': (run, 'fl', False), 'perfl': (run, 'fl', True),
      'groupfl': (run, None, False), 'groupperfl': (run, None, True)},
                          clients, log_fn)
  result = {'cells': _cells(task, METHODS, evaluated, sums, sweep, _costs(
      cfg, fl_part, group_part, sums)),
            'sweep': sweep, 'eval_clients': len(evaluated),
            'sweep_clients': len(clients[1]),
            'relative_change': {str(c): _relative(sums, c)
                                for c in evaluated},
            'group_of': {str(c): task.client_groups[c] for c in evaluated},
            'train_speeches': {str(c): task.num_train(c) for c in evaluated}}
  lrs = {m: sweep[m]['lr'] for m in sweep}
  _step(directory, 'curves', lambda: _control_curves(
      task, cfg, seed, directory, evaluated, lrs, log_fn,
      control_runs=_CONTROL_RUNS[:1], opened={'groupfl': run}))
  _step(directory, 'fl_curves', lambda: _global_curves(
      task, cfg, run, 'fl', 1, cfg['rounds'], evaluated, lrs['perfl'],
      log_fn))
  if cfg['clustering']:
    result['clustering'] = _step(directory, 'clustering', lambda: _cluster(
        task, cfg, run.process(stage='fl').model_weights_type,
        run.weights(stage='fl'), seed, log_fn))
  return result


def _curves(task, run, evaluated, named, points, log_fn):
  """`run_analysis.checkpoint_curves` of `{name: strategy}`, pooled per
  genre and `all` as in the tables."""
  return run_analysis.checkpoint_curves(
      run, evaluated, named, points, _pools(task, evaluated),
      score=group_fl.perplexity, reduce=group_fl.token_sums,
      log_fn=lambda s: log_fn(f'group: {s}'))


def _global_curves(task, cfg, run, stage, every, last, evaluated, lr,
                   log_fn) -> dict:
  """`fl` and `perfl` (at `lr`) at rounds `every`, `2 * every`, ... up to
  `last` of an FL run (its `stage`), from the checkpoints it kept."""
  rounds = list(range(every, last + 1, every))
  run_analysis.check_checkpoints(run, rounds, stage=stage)
  return {'round': rounds, **_curves(
      task, run, evaluated, {'fl': 'none', 'perfl': _personalization(cfg, lr)},
      [dict(stage=stage, round=r) for r in rounds], log_fn)}


def _control_curves(task, cfg_t, seed, directory, evaluated, lrs, log_fn,
                    control_runs=_CONTROL_RUNS, opened=None) -> dict:
  """Each group-stage run's method and personalized method (at `lrs`)
  after r = 0..T_g group rounds (0: the FL model at T), `{method:
  {'round': [...], genre or 'all': [...]}}`; `opened`: runs at hand."""
  rounds = list(range(cfg_t['group_rounds'] + 1))
  out = {}
  for control in control_runs:
    method, personal = control[3:]
    config = _control_config(cfg_t, seed, directory, control,
                             len(task.group_names))
    run = (opened or {}).get(method) or runs.Run.open(config.experiment_dir,
                                                      task=task)
    for name, curve in _curves(task, run, evaluated, {
        method: 'none', personal: _personalization(cfg_t, lrs[personal])},
                               [dict(stage='fl')] + [
                                   dict(round=r) for r in rounds[1:]],
                               log_fn).items():
      out[name] = {'round': rounds, **curve}
  return out


def _run_controls(task, cfg, seed, directory, log_fn) -> dict:
  clients = _samples(task, cfg, seed)  # (eval, sweep)
  validation = _samples(task, cfg, seed, validation=True)
  fl_curve = _fl_curve_config(cfg, seed, directory)
  train_fl = lambda: _train(task, fl_curve, log_fn, eval_ids=validation)
  plateau = _step(directory, 'plateau', lambda: _find_plateau(
      train_fl(), cfg['plateau'], len(validation), log_fn))
  cfg_t = dict(cfg, rounds=plateau['rounds'])
  opened = {c[3]: _train(task, _control_config(
      cfg_t, seed, directory, c, len(task.group_names),
      keep_checkpoints=max(cfg['group_rounds'], 3)), log_fn)
            for c in _CONTROL_RUNS}  # Every group round's checkpoint.
  # FL (the stage every control run shares), then each run's groups; all
  # as trained, then all personalized.
  starts = [('fl', 'perfl', opened['groupfl'], 'fl')] + [
      (name, personal, opened[name], None)
      for *_, name, personal in _CONTROL_RUNS]
  sums, sweep = _evaluate(cfg, directory, {
      **{m: (run, stage, False) for m, _, run, stage in starts},
      **{p: (run, stage, True) for _, p, run, stage in starts}},
                          clients, log_fn)
  _step(directory, 'curves', lambda: _control_curves(
      task, cfg_t, seed, directory, clients[0],
      {m: s['lr'] for m, s in sweep.items()}, log_fn, opened=opened))
  _step(directory, 'fl_curves', lambda: _global_curves(
      task, cfg, train_fl(), None, fl_curve.checkpoint_every,
      fl_curve.rounds, clients[0], sweep['perfl']['lr'], log_fn))
  out = _cells(task, CONTROL_METHODS, clients[0], sums, sweep,
               lambda *_: {'fl_rounds': plateau['rounds']})
  for method, controls in CONTROLS_OF.items():  # Over the better control.
    for g, metrics in out[method].items():
      metrics['margin'] = metrics['perplexity'] - min(
          out[c][g]['perplexity'] for c in controls)
  return out


def _find_plateau(run, p, validation_clients, log_fn) -> dict:
  """T: `run_analysis.eval_plateau` of the FL run's validation curve."""
  rounds, curve = run_analysis.eval_plateau(run, 'perplexity', p['window'],
                                            p['tolerance'])
  log_fn(f'group: FL validation plateau at round {rounds} '
         f'(searched {p["max_rounds"]})')
  return {'rounds': rounds or p['max_rounds'], 'reached': rounds is not None,
          'curve': {str(r): v for r, v in sorted(curve.items())},
          'validation_clients': validation_clients}


def _relative(sums, client) -> float:
  per = group_fl.perplexity([sums['perfl'][client]])
  return (group_fl.perplexity([sums['groupperfl'][client]]) - per) / per


def _cells(task, methods, evaluated, sums, sweep, more) -> dict:
  """`{method: {group: metrics}}`: the pooled perplexity of the group's
  evaluated clients, their number and tokens, the personalized methods'
  lr, and `more(method, members)`."""
  return {m: {g: {'perplexity': group_fl.perplexity([sums[m][c]
                                                     for c in members]),
                  'clients': len(members),
                  'eval_tokens': float(sum(sums[m][c]['tokens']
                                           for c in members)),
                  **({'personalization_lr': sweep[m]['lr']}
                     if m in sweep else {}), **more(m, members)}
              for g, members in _pools(task, evaluated).items()}
          for m in methods}


def _costs(cfg, fl_part, group_part, sums):
  """Tables 4 and `improved`, `more` of `_cells`: the mean cost per client
  from its participations (`group_fl.*_cost`), and the share improved."""
  def more(method, members):
    part = [fl_part.get(c, 0) + (group_part.get(c, 0)
                                 if method.startswith('group') else 0)
            for c in members]
    k_l = cfg['personalization_epochs'] if method.endswith('perfl') else 0
    out = {'communication': float(np.mean(
        [group_fl.communication_cost(p) for p in part])),
           'computation': float(np.mean([group_fl.computation_cost(
               p, cfg['local_epochs'], k_l) for p in part]))}
    if method == 'groupperfl':
      out['share_clients_improved'] = float(np.mean(
          [_relative(sums, c) < 0 for c in members]))
    return out
  return more


def _cluster(task, cfg, weights_type, weights, seed, log_fn) -> dict:
  """Clusters a seeded sample of clients by their sketched updates from
  `weights`; adjusted Rand index against the genres and the plays."""
  log_fn('group: clustering client updates')
  updates = group_fl.build_client_updates(
      task.model_fn, tff.learning.optimizers.build_sgdm(cfg['client_lr']),
      weights_type)
  sketch = update_clustering.CountSketch(dim=4096, seed=seed)
  clients = list(range(task.num_clients))
  if cfg['cluster_clients'] and cfg['cluster_clients'] < len(clients):
    clients = sorted(np.random.default_rng([seed, 0xC1]).choice(
        len(clients), cfg['cluster_clients'], replace=False).tolist())
  vectors = update_clustering.sketched_updates(
      updates, weights, clients,
      lambda c: task.train_dataset(c, cfg['local_epochs']), sketch)
  truth = [task.client_groups[c] for c in clients]
  big = [i for i, c in enumerate(clients) if task.num_train(c) >= 10]
  ari, out = update_clustering.adjusted_rand_index, {}
  for center in (True, False):
    labels = update_clustering.cluster_updates(
        vectors, len(task.group_names), center=center, seed=seed)
    name = 'adjusted_rand_index' + ('' if center else '_uncentered')
    out[name] = ari(truth, labels)
    out[name + '_10plus_speeches'] = ari([truth[i] for i in big], labels[big])
  plays = [task.client_ids[c].split('/')[1] for c in clients]  # Finer.
  labels = update_clustering.cluster_updates(
      vectors, len(set(plays)), center=True, seed=seed)
  return dict(out, adjusted_rand_index_plays=ari(plays, labels),
              clients=len(clients), clients_10plus_speeches=len(big))


def _per_seed(seed_dir, pattern, *beside) -> list[list]:
  """Each sibling `seed_*` directory's JSON `pattern` (a glob) and the
  files `beside` it (None where absent)."""
  read = lambda p: atomic_io.read_json(p) if os.path.exists(p) else None
  return [[read(p)] + [read(os.path.join(os.path.dirname(p), n))
                       for n in beside] for p in sorted(glob.glob(
                           os.path.join(os.path.dirname(seed_dir), 'seed_*',
                                        pattern)))]


def _line(rounds_values, label, color=None, offset=0, **kwargs) -> dict:
  """A `figures.band_figure` line: one `(rounds, perplexities)` per seed."""
  return dict(y='perplexity', label=label, color=color, **kwargs, curves=[
      {'round': [offset + r for r in x], 'perplexity': list(v)}
      for x, v in rounds_values])


def _draw(root_output_dir, name, panels, **kwargs) -> None:
  figures.band_figure(os.path.join(root_output_dir, 'figures', name), panels,
                      dpi=120, **kwargs)


_T = dict(color='tab:red', linewidth=0.8, alpha=0.7,
          label='plateau round T per seed')  # The mark of a seed's T.


def make_figures(root_output_dir: str, pipeline_dir: str) -> None:
  """`group_relative_change_hist.png` (Figure 1): each evaluated client's
  relative change, GroupPerFL vs PerFL, over the finished seeds."""
  seeds = _per_seed(pipeline_dir, 'pipeline.json')
  change = np.array([v for (p,) in seeds
                     for v in p['relative_change'].values()]) * 100
  if not change.size:
    return
  fig, ax = figures.pyplot().subplots(figsize=(6, 4))
  ax.hist(change, bins=40, color='tab:blue', edgecolor='white')
  ax.axvline(0, color='black', linewidth=1)
  ax.set(xlabel='relative perplexity change, GroupPerFL vs PerFL (%)',
         ylabel='clients', title=f'{len(change)} clients ({len(seeds)} '
         f'seed(s)); {float(np.mean(change < 0)) * 100:.1f}% improve')
  fig.tight_layout()
  figures.save(fig, os.path.join(root_output_dir, 'figures',
                                 'group_relative_change_hist.png'), dpi=120)


def make_training_figure(root_output_dir: str, pipeline_dir: str) -> None:
  """`group_training_curves.png`: the round cohort's training perplexity
  of the FL stage, then of each genre's stage, over the seeds' runs."""
  def train(rows):
    rows = [r for r in rows if 'train/loss' in r]
    return ([r['round'] for r in rows],
            [float(np.exp(r['train/loss'])) for r in rows])
  seeds = [runs.Run.open(d) for d in sorted(glob.glob(os.path.join(
      os.path.dirname(pipeline_dir), 'seed_*', 'groupfl_task')))]
  fl = [c for c in (train(r.curves(stage='fl')['train']) for r in seeds)
        if c[0]]  # Not a seed killed before its round 1.
  if not fl:
    return
  offset, genres = max(max(x) for x, _ in fl), {}
  for run in seeds:
    for genre in run.groups():
      curve = train(run.curves(group=genre)['train'])
      genres.setdefault(genre, []).extend([curve] if curve[0] else [])
  _draw(root_output_dir, 'group_training_curves.png', [dict(
      lines=[_line(fl, 'fl: every client', 'black')] + [
          _line(c, f'groupfl: {g}', offset=offset)
          for g, c in sorted(genres.items())],
      vlines=[dict(x=offset + 0.5, color='gray', linewidth=0.8)],
      yscale='log', title=f'mean ± 1 std over {len(fl)} seed(s)',
      xlabel='round (FL, then each genre\'s group rounds)',
      ylabel='training perplexity (round cohort)')], panel_size=(6.5, 4))


def make_curves_figure(root_output_dir: str, pipeline_dir: str) -> None:
  """`group_curves.png`: Table 3's methods on the evaluated clients per
  round, `fl` and `perfl` over the FL rounds, then `groupfl` and
  `groupperfl` over the group rounds, over the finished seeds."""
  seeds = [s[1:] for s in _per_seed(pipeline_dir, 'pipeline.json',
                                    'fl_curves.json', 'curves.json')
           if None not in s]
  if not seeds:
    return
  t = min(max(f['round']) for f, _ in seeds)
  _draw(root_output_dir, 'group_curves.png', [dict(
      lines=[_line([(f['round'], f[m][ALL]) for f, _ in seeds], m, color)
             for m, color in (('fl', 'black'), ('perfl', 'tab:green'))] + [
          _line([(c[m]['round'], c[m][ALL]) for _, c in seeds], m, color, t)
          for m, color in (('groupfl', 'tab:red'), ('groupperfl', 'tab:blue'))],
      vlines=[dict(x=t, color='gray', linewidth=0.8)], yscale='log',
      title=f'mean ± 1 std over {len(seeds)} seed(s)',
      xlabel=f'round (FL, then the genres\' group rounds from round {t})',
      ylabel='held-out perplexity, evaluated clients')], panel_size=(7, 4.2))


def make_plateau_figure(root_output_dir: str, seed_dir: str) -> None:
  """`group_fl_plateau.png`: FL's validation perplexity over rounds over
  the seeds (of the first plateau rule found), each seed's T marked."""
  paths = sorted(glob.glob(os.path.join(
      os.path.dirname(seed_dir), 'seed_*', 'controls_*', 'plateau.json')))
  rule = [os.path.dirname(p).rsplit('/', 1)[-1] for p in paths]
  plateaus = [atomic_io.read_json(p) for p, r in zip(paths, rule)
              if r == rule[0]]
  if not plateaus:
    return
  line = _line([zip(*sorted((int(r), v) for r, v in p['curve'].items()))
                for p in plateaus], f'FL, mean ± 1 std of {len(plateaus)} '
               'seed(s)', 'tab:blue', alpha=0.25)
  _draw(root_output_dir, 'group_fl_plateau.png', [dict(
      lines=[line], vlines=[dict(_T, x=p['rounds']) for p in plateaus],
      xlabel='FL round', ylabel='validation perplexity', ytop=float(
          np.percentile(curve_bands.seed_band(line['curves'], 'round',
                                              'perplexity')[1], 95)))],
        panel_size=(6, 4))


def make_control_curves_figure(root_output_dir: str,
                               controls_dir: str) -> None:
  """`group_control_curves.png`, over the seeds of `controls_dir`'s
  plateau rule: left, `fl` and `perfl` over FL's rounds, each seed's T
  marked; middle (as trained) and right (personalized), the control
  runs' group stages as the change from the seed's `fl` at T (the seeds'
  levels differ), with `fl` and `perfl` at T dashed."""
  seeds = _per_seed(os.path.dirname(controls_dir), os.path.join(
      os.path.basename(controls_dir), 'controls.json'), 'curves.json',
                    'fl_curves.json')
  if not seeds:
    return
  fl = [(f, t['fl'][ALL]['fl_rounds']) for t, _, f in seeds if f]
  base = [t['fl'][ALL]['perplexity'] for t, _, _ in seeds]
  panels = [dict(
      lines=[_line([(f['round'], f[m][ALL]) for f, _ in fl], m, color)
             for m, color in (('fl', 'black'), ('perfl', 'tab:green'))],
      vlines=[dict(_T, x=t) for _, t in fl], title=f'FL ({len(fl)} seed(s))',
      xlabel='FL round', ylabel='held-out perplexity, evaluated clients',
      ytop=max([float(np.percentile(f['fl'][ALL], 90)) for f, _ in fl],
               default=None))]
  for column, start, title in (
      (3, 'fl', f'group stage, as trained ({len(seeds)} seed(s))'),
      (4, 'perfl', 'group stage, personalized (each method\'s selected lr)')):
    level = np.mean([t[start][ALL]['perplexity'] - b
                     for (t, _, _), b in zip(seeds, base)])
    panels.append(dict(title=title, lines=[
        _line([(c[r[column]]['round'], np.subtract(c[r[column]][ALL], b))
               for (_, c, _), b in zip(seeds, base)], r[column], color)
        for r, color in zip(_CONTROL_RUNS, (
            'tab:red', 'tab:orange', 'tab:green', 'tab:purple', 'tab:blue',
            'tab:pink', 'tab:cyan')) if all(r[column] in c
                                            for _, c, _ in seeds)],
                       hlines=[dict(y=float(level), color='black',
                                    linestyle='--', linewidth=1,
                                    label=f'{start} (at T)')],
                       xlabel='group rounds after T (0: the FL model at T)',
                       ylabel='held-out perplexity minus fl\'s at T '
                       '(per seed)'))
  _draw(root_output_dir, 'group_control_curves.png', panels, share_y=(1, 2),
        panel_size=(5, 4.2), suptitle='mean ± 1 std over seeds')
