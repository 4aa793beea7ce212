"""Group Personalized FL (Tables 3 / 6, Table 4, Figure 1) on `shakespeare_groups`.

The four methods of section 5.3 on one pipeline (`algorithms/group_fl.py`):

* `fl`: global FL, T rounds of `clients_per_round` clients (Algorithm 1);
* `perfl`: every evaluated client fine-tunes the FL model locally for K_l
  epochs (Algorithm 3 from the global model);
* `groupfl`: per genre, T_g rounds of FL fine-tuning from the FL model among
  the genre's clients only, with a fresh FedAdam state (Algorithm 2);
* `groupperfl`: local fine-tuning from the client's group model.

FL and the group runs train on the one run path: one `groupfl` run
(`train_config`: stage 'fl', then a per-group stage) under
`<root>/runs/group/pipeline/<config digest>/seed_<n>/groupfl_task/`, resumed
from its checkpoints if killed. The analysis below evaluates that run's
clients through the library (`runs.Run.client_outputs`: FL's model is stage
'fl', GroupFL's each client's group model; PerFL and GroupPerFL are the
`fine_tune` strategy, K_l epochs of SGD at each swept lr) and caches each
result (evaluations, sweep, clustering) as JSON in the same digest-keyed
directory; each cell (method, group) reads its numbers from it. The control `fl_more` is the same
run with `grouping='one'`.

Readings of the paper, and choices made for the CPU budget
(docs/papers/group.md):

* T and T_g are *rounds* here (the paper's 20 / 10 "epochs" were many rounds
  each); cohorts are `--group_clients_per_round` (global) and
  `--group_group_clients_per_round` (per group), both flags (the paper: 100)
  sized for a shared CPU. FedAdam's lr 1e-3 barely moves a model in 20 rounds,
  so the server lr is a flag (`--group_server_lr`, the default states ours).
* Evaluation clients: personalization (K_l = 5 epochs per client, per
  learning rate) is the dominant cost, so the four methods are evaluated on
  the same seeded sample of up to `--group_eval_clients_per_group` clients
  with evaluation speeches per genre (uniform over clients, so the long tail
  is kept in proportion).
* Personalization learning rate: swept over `--group_personalization_lrs`
  (the paper's {0.001, 0.01, 0.1, 1.0}) on a *disjoint* seeded sample of
  `--group_sweep_clients_per_group` clients per genre; the lr with the lowest
  pooled perplexity there is used, per method, for the evaluation clients
  (the paper does not say how it picked; selecting on the evaluated clients
  would be selecting on test data).
* Perplexity: exp(sum of token NLL / number of target tokens) pooled over the
  evaluation speeches of a group's (sampled) clients ("aggregated at sentence
  level"); `all` pools every genre.
* Cost (Table 4), per client, mean over the group's evaluated clients:
  communication = 2 x rounds taken part in (download + upload) + 1 final
  download, in model sizes; computation = K x rounds taken part in + K_l for
  the personalized methods, in local epochs (measured participations).
* `share_clients_improved` (groupperfl rows): share of evaluated clients whose
  GroupPerFL perplexity is below their PerFL perplexity; Figure 1 is the
  histogram of the relative change (GroupPerFL - PerFL) / PerFL.
* Data-driven groups (table `grouping`): updates of a seeded sample of
  `--group_cluster_clients` clients from the FL model, count-sketched,
  centred, spherical k-means into 4 clusters; the adjusted Rand index against
  the genres (and, with one cluster per play, against the plays).
* Controls (tables `control`, `control_margin`, `control_rounds`; not in
  the paper), to separate group knowledge from more training:
  - FL is first trained until its validation perplexity plateaus
    (`plateau_round`: every `--group_plateau_eval_every` rounds, on
    `--group_validation_clients_per_group` clients per genre disjoint from
    the evaluated and sweep clients; T is the first evaluated round after
    which no evaluation of the next `--group_plateau_window` rounds is more
    than `--group_plateau_tolerance` (relative) below it);
  - `fl_more` / `perfl_more`: FL continued from that model for T_g rounds
    with GroupFL's client budget (groups x per-group cohort clients a
    round, fresh FedAdam state), then (perfl_more) personalized;
  - `groupfl_shuffled` / `groupperfl_shuffled`: GroupFL / GroupPerFL on
    random groups of the genres' sizes;
  - `groupfl_keep` / `groupperfl_keep`: GroupFL / GroupPerFL whose group
    stages start from the FL stage's FedAdam state (`server_state=keep`)
    instead of a fresh one;
  - `groupfl_lowlr` / `groupperfl_lowlr`: a fresh state at `LOWLR_SHARE`
    of the server lr (`group_server_lr`), against the two controls at the
    same lr (`*_more_lowlr`, `*_shuffled_lowlr`);
  - `margin` (groupfl, groupperfl rows of `control_margin`): the method's
    perplexity minus the lower of its two controls'; negative where the
    genre groups beat both.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from typing import Mapping, Optional

from absl import flags
import numpy as np
import tensorflow_federated as tff

from tasks import shakespeare_groups
from tff_personal import curve_bands
from tff_personal import atomic_io
from tff_personal import experiment
from tff_personal import reporting
from tff_personal import run_spec
from tff_personal import runs
from tff_personal import strategies
from tff_personal.algorithms import group_fl
from tff_personal.algorithms import update_clustering
from tff_personal.core import runtime
from tff_personal.core import training_loop

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

TABLES = {
    'table3': reporting.Table(
        name='table3', paper=PAPER, metric='perplexity', methods=METHODS,
        columns=_COLUMNS, digits=1,
        title='Perplexity per genre (Tables 3 / 6 of the paper)',
        notes=_PAPER_NOTE),
    'table4_communication': reporting.Table(
        name='table4_communication', paper=PAPER, metric='communication',
        methods=METHODS, columns=_COLUMNS, digits=2,
        paper_values={('fl', ALL): '3060', ('perfl', ALL): '3060',
                      ('groupfl', ALL): '3990', ('groupperfl', ALL): '3990'},
        title='Communication per client, in model sizes (Table 4)',
        notes='Paper values: its "general" video category.'),
    'table4_computation': reporting.Table(
        name='table4_computation', paper=PAPER, metric='computation',
        methods=METHODS, columns=_COLUMNS, digits=2,
        paper_values={('fl', ALL): '20', ('perfl', ALL): '25',
                      ('groupfl', ALL): '30', ('groupperfl', ALL): '35'},
        title='Computation per client, in local epochs (Table 4)',
        notes='Paper values: its "general" video category.'),
    'improved': reporting.Table(
        name='improved', paper=PAPER, metric='share_clients_improved',
        methods=('groupperfl',), columns=_COLUMNS, digits=1, scale=100.0,
        paper_values={('groupperfl', ALL): 'about 70'},
        title='Clients improved by GroupPerFL over PerFL, % (Figure 1)'),
    'grouping': reporting.Table(
        name='grouping', paper=PAPER, metric='adjusted_rand_index',
        methods=('update_clustering',),
        columns=[reporting.Column(ALL, {'group': ALL})], digits=3,
        title='Data-driven groups vs genres (adjusted Rand index)'),
    'control': reporting.Table(
        name='control', paper=PAPER, metric='perplexity',
        methods=CONTROL_METHODS, columns=_CONTROL_COLUMNS, digits=1,
        title='Controls: FL trained to a validation plateau; GroupFL and '
              'GroupPerFL against equal-budget FL and shuffled groups',
        notes='fl: FL at the plateau round T (table control_rounds). '
              '*_more: FL continued from it for T_g rounds with GroupFL\'s '
              'client budget (then personalized for perfl_more). '
              '*_shuffled: the group method on random groups of the genres\' '
              'sizes. *_keep: group stages from the FL stage\'s FedAdam '
              'state; *_lowlr: from a fresh one at a tenth of the server '
              'lr (the method and its controls). Not in the paper.'),
    'control_margin': reporting.Table(
        name='control_margin', paper=PAPER, metric='margin',
        methods=tuple(CONTROLS_OF), columns=_CONTROL_COLUMNS, digits=1,
        title='Group method minus the better of its two controls '
              '(perplexity; negative: the genre groups beat both)',
        notes='groupfl against fl_more and groupfl_shuffled; groupperfl '
              'against perfl_more and groupperfl_shuffled (*_keep: the '
              'same; *_lowlr: the controls at the same low lr); per seed, '
              'then mean ± std. Not in the paper.'),
    'control_rounds': reporting.Table(
        name='control_rounds', paper=PAPER, metric='fl_rounds',
        methods=('fl',), columns=[_CONTROL_COLUMNS[-1]], digits=0,
        title='T: FL rounds to the validation plateau',
        notes='The rule: papers/group.py, plateau_round.'),
}


def define_flags():
  def define(kind, name, default, help_text):
    if name not in flags.FLAGS:
      getattr(flags, f'DEFINE_{kind}')(name, default, help_text)
  define('integer', 'group_vocab_size', 2000,
         'Group: vocabulary size (with 4 special tokens), from train data.')
  define('integer', 'group_seq_len', 16, 'Group: tokens per speech (cap).')
  define('integer', 'group_embedding_dim', 32, 'Group: word embedding size.')
  define('integer', 'group_lstm_units', 64, 'Group: LSTM units.')
  define('integer', 'group_lstm_layers', 1, 'Group: LSTM layers.')
  define('integer', 'group_rounds', 20, 'Group: T, global FL rounds.')
  define('integer', 'group_group_rounds', 10,
         'Group: T_g, group fine-tuning rounds per group.')
  define('integer', 'group_clients_per_round', 20,
         'Group: cohort per round (global and per group; all if fewer).')
  define('integer', 'group_group_clients_per_round', 10,
         'Group: cohort per round of each group\'s fine-tuning.')
  define('integer', 'group_local_epochs', 1, 'Group: K, local epochs.')
  define('float', 'group_client_lr', 1.0, 'Group: client SGD lr.')
  define('float', 'group_server_lr', 0.03, 'Group: FedAdam lr.')
  define('integer', 'group_personalization_epochs', 5, 'Group: K_l.')
  define('list', 'group_personalization_lrs', ['0.01', '0.1', '1.0'],
         'Group: local personalization SGD lrs swept.')
  define('integer', 'group_eval_clients_per_group', 10,
         'Group: evaluated clients per genre (0: all).')
  define('integer', 'group_sweep_clients_per_group', 2,
         'Group: clients per genre (disjoint from the evaluated ones) that '
         'select the personalization lr.')
  define('integer', 'group_max_clients', 0,
         'Group: keep a seeded sample of this many clients (0: all).')
  define('bool', 'group_clustering', True,
         'Group: also cluster client updates (table grouping).')
  define('integer', 'group_cluster_clients', 60,
         'Group: clients (seeded uniform sample) clustered (0: all).')
  define('integer', 'group_plateau_max_rounds', 800,
         'Group controls: most FL rounds searched for the plateau.')
  define('integer', 'group_plateau_eval_every', 10,
         'Group controls: FL rounds between validation evaluations.')
  define('integer', 'group_plateau_window', 50,
         'Group controls: rounds after T in which no validation perplexity '
         'may be more than the tolerance below T\'s.')
  define('float', 'group_plateau_tolerance', 0.01,
         'Group controls: relative improvement that counts as progress.')
  define('integer', 'group_validation_clients_per_group', 25,
         'Group controls: validation clients per genre (disjoint from the '
         'evaluated and sweep clients) that decide the plateau.')


def cells(table: str, flag_values) -> list[reporting.Cell]:
  _config(flag_values)  # Validates the flags before anything runs.
  return TABLES[table].cells(flag_values.seeds)


def _config(f) -> dict:
  cfg = dict(
      data_dir=os.path.abspath(reporting.data_dir(f)),
      vocab_size=f.group_vocab_size, seq_len=f.group_seq_len,
      embedding_dim=f.group_embedding_dim, lstm_units=f.group_lstm_units,
      lstm_layers=f.group_lstm_layers,
      rounds=f.rounds if getattr(f, 'rounds', None) else f.group_rounds,
      group_rounds=f.group_group_rounds,
      group_clients_per_round=f.group_group_clients_per_round,
      clients_per_round=(f.clients_per_round
                         if getattr(f, 'clients_per_round', None)
                         else f.group_clients_per_round),
      local_epochs=f.group_local_epochs, client_lr=f.group_client_lr,
      server_lr=f.group_server_lr,
      personalization_epochs=f.group_personalization_epochs,
      personalization_lrs=sorted(float(x) for x in f.group_personalization_lrs),
      eval_clients_per_group=f.group_eval_clients_per_group,
      sweep_clients_per_group=f.group_sweep_clients_per_group,
      max_clients=f.group_max_clients or None,
      clustering=bool(f.group_clustering),
      cluster_clients=f.group_cluster_clients,
      plateau=dict(
          max_rounds=f.group_plateau_max_rounds,
          eval_every=f.group_plateau_eval_every,
          window=f.group_plateau_window,
          tolerance=f.group_plateau_tolerance,
          validation_clients_per_group=(
              f.group_validation_clients_per_group)))
  if getattr(f, 'data_seed', None) is not None:  # absent: digests unchanged
    cfg['data_seed'] = reporting.data_seed(f, 0)
  for key in ('rounds', 'group_rounds'):
    if cfg[key] < 1:
      raise ValueError(f'group: {key} must be >= 1, got {cfg[key]}')
  if cfg['personalization_epochs'] < 0:
    raise ValueError('group: personalization_epochs must be >= 0, got '
                     f'{cfg["personalization_epochs"]}')
  if cfg['clients_per_round'] < 1 or cfg['group_clients_per_round'] < 1:
    raise ValueError('group: clients per round must be >= 1')
  if cfg['cluster_clients'] < 0:
    raise ValueError('group: cluster_clients must be >= 0')
  if cfg['local_epochs'] < 1:
    raise ValueError('group: local_epochs (K) must be >= 1')
  if not cfg['personalization_lrs'] or min(cfg['personalization_lrs']) <= 0:
    raise ValueError('group: personalization lrs must be positive, got '
                     f'{cfg["personalization_lrs"]}')
  if cfg['client_lr'] <= 0 or cfg['server_lr'] <= 0:
    raise ValueError('group: learning rates must be positive')
  if cfg['eval_clients_per_group'] < 0 or cfg['sweep_clients_per_group'] < 1:
    raise ValueError('group: eval clients must be >= 0 and sweep clients '
                     '>= 1 per group')
  plateau = cfg['plateau']
  if plateau['eval_every'] < 1 or plateau['window'] < plateau['eval_every']:
    raise ValueError('group: plateau eval_every must be >= 1 and the window '
                     f'at least one evaluation, got {plateau}')
  if plateau['max_rounds'] < plateau['eval_every'] + plateau['window']:
    raise ValueError('group: plateau max_rounds must leave room for one '
                     f'evaluation and its window, got {plateau}')
  if not 0 <= plateau['tolerance'] < 1:
    raise ValueError('group: plateau tolerance must be in [0, 1), got '
                     f'{plateau["tolerance"]}')
  if plateau['validation_clients_per_group'] < 1:
    raise ValueError('group: validation clients per group must be >= 1')
  if not os.path.isdir(cfg['data_dir']):
    raise ValueError(f'group: data dir {cfg["data_dir"]} does not exist')
  return cfg


def run_cell(cell: reporting.Cell, flag_values, out_dir: str) -> dict:
  cfg = _config(flag_values)
  root = reporting.root_of(out_dir)
  group = cell.setting['group']
  if cell.setting.get('fl') == PLATEAU:
    return dict(_controls(cfg, cell.seed, root)[cell.method][group])
  result = _pipeline(cfg, cell.seed, root)
  if cell.method == 'update_clustering':
    if 'clustering' not in result:
      raise ValueError('group: clustering is off (--group_clustering)')
    return dict(result['clustering'])
  return dict(result['cells'][cell.method][group])


# ----------------------------------------------------------------- pipeline


def _step(directory: str, name: str, compute):
  """An analysis step's JSON result, cached as `directory/<name>.json`
  (keyed, like the training runs beside it, by the configuration's
  digest)."""
  return atomic_io.cached_json(os.path.join(directory, name + '.json'),
                               compute)


def _data_seed(cfg, seed) -> int:
  """The seed of the data (the task's split, the client samples): the
  cell's seed unless `--data_seed` fixed it (`cfg['data_seed']`)."""
  return cfg.get('data_seed', seed)


def _genre_order(task, genre, seed) -> list[int]:
  """The genre's clients with evaluation speeches, in the seeded order the
  sweep, evaluated and validation samples are cut from (so disjoint)."""
  members = [c for c in task.clients_of(genre) if task.num_eval(c) > 0]
  return np.random.default_rng(
      [seed, 0xE7, len(genre)] + [ord(ch) for ch in genre]
  ).permutation(members).tolist()


def _sample_clients(task, cfg, seed):
  """Disjoint seeded samples per genre: (eval clients, sweep clients)."""
  eval_clients, sweep_clients = [], []
  for g in task.group_names:
    order = _genre_order(task, g, _data_seed(cfg, seed))
    n_sweep = min(cfg['sweep_clients_per_group'], len(order) // 2)
    sweep_clients += order[:n_sweep]
    rest = order[n_sweep:]
    n_eval = cfg['eval_clients_per_group'] or len(rest)
    eval_clients += rest[:n_eval]
  return sorted(eval_clients), sorted(sweep_clients)


def _digest(value) -> str:
  return hashlib.sha256(json.dumps(value, sort_keys=True).encode()
                        ).hexdigest()[:10]


# How the cached evaluations were made: the library's per-client strategies
# (`runs.Run.client_outputs`). Part of the pipeline's key, so a directory
# evaluated by the paper's former code is not read as this one's.
_EVALUATOR = 'client_outputs'


def _config_dir(root, cfg, seed):
  """The pipeline's directory: keyed by the configuration without the
  controls' plateau rule (which the tables of the paper do not use)."""
  digest = _digest({**{k: v for k, v in cfg.items() if k != 'plateau'},
                    'evaluator': _EVALUATOR})
  return os.path.join(root, reporting.RUNS_DIRNAME, PAPER, 'pipeline',
                      digest, f'seed_{seed}')


def base_spec(cfg: dict) -> run_spec.RunSpec:
  """The paper's runs: FedAvg on `shakespeare_groups` under the paper's
  task settings, local SGD at `client_lr`, FedAdam at `server_lr`, cohorts
  of `clients_per_round`, resumed when killed. Each run below is this spec
  with overrides."""
  return run_spec.RunSpec(
      task='shakespeare_groups', algorithm='global',
      task_options={k: cfg[k] for k in (
          'vocab_size', 'seq_len', 'embedding_dim', 'lstm_units',
          'lstm_layers', 'max_clients', 'local_epochs')},
      loop=run_spec.Loop(clients_per_round=cfg['clients_per_round'],
                         resume=True),
      optimizers=run_spec.Optimizers(
          client='sgd', client_learning_rate=cfg['client_lr'],
          server='adam', server_learning_rate=cfg['server_lr']))


def _task(cfg, seed):
  """The registered `shakespeare_groups` task (built through the registry,
  so that runs on it record how it was built and share their FL stage)."""
  return base_spec(cfg).build_task(data_dir=cfg['data_dir'],
                                   seed=_data_seed(cfg, seed))


def _sums(output) -> dict:
  """A client's evaluation output (the word LM's per-speech (NLL, tokens)
  rows) as the token sums `group_fl.perplexity` pools."""
  rows = np.asarray(output['outputs'], np.float64).reshape(-1, 2)
  return {'token_nll_sum': float(rows[:, 0].sum()),
          'tokens': float(rows[:, 1].sum())}


def _personalization(cfg, lr: float):
  """Algorithm 3 as the library's strategy: K_l local epochs of SGD at `lr`
  over a copy of the client's model (none with K_l = 0)."""
  if not cfg['personalization_epochs']:
    return strategies.AsTrained()
  return strategies.FineTune(epochs=cfg['personalization_epochs'],
                             learning_rate=lr, optimizer='sgd')


def _evaluated(run: runs.Run, clients, strategy='none', stage=None,
               round_num=None) -> dict[int, dict]:
  """`{client: token sums}` of `clients` on the run's model (a per-group
  run: each on its group's; `stage='fl'`: the FL model) under a strategy
  (`runs.Run.client_outputs`)."""
  clients = list(clients)
  outputs = run.client_outputs(clients, strategy, round=round_num,
                               stage=stage)
  return {c: _sums(o) for c, o in zip(clients, outputs)}


def train_config(cfg: dict, seed: int, directory: str,
                 grouping: str = 'task', num_groups: int = 1,
                 keep_checkpoints: int = 3,
                 server_state: str = 'fresh',
                 group_server_lr: float = 0.0) -> experiment.ExperimentConfig:
  """The one-path run (`groupfl`) behind the tables.

  Stage 'fl': T rounds of `clients_per_round` over every client; then T_g
  rounds per group of `group_clients_per_round` among the group's clients.
  The control `fl_more` is the same run with `grouping='one'` (one group of
  every client) and GroupFL's client budget (`group_clients_per_round` x
  `num_groups` per round): its FL stage is the same run, hence the same FL
  model. `keep_checkpoints`: the newest checkpoints each run directory
  keeps (the controls keep every group round's, for their curves).
  `server_state`: `groupfl`'s option: 'fresh' (a new FedAdam state per
  group, the tables') or 'keep' (each group stage starts from the FL
  stage's optimizer state; the `*_keep` controls). `group_server_lr`:
  `groupfl`'s option, the group stages' server lr (0: `cfg['server_lr']`;
  the `*_lowlr` controls').
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


def _train(task, config, log_fn) -> runs.Run:
  """The run of `config`, trained unless it finished (a killed run
  resumes from its checkpoints)."""
  return runs.finished_or_trained(
      task, config, log_fn=lambda s: log_fn(
          f'group {config.experiment_name}: {s}'))


def _pipeline(cfg: dict, seed: int, root: str, log_fn=None) -> dict:
  directory = _config_dir(root, cfg, seed)
  return _cached(cfg, seed, directory, 'pipeline.json', _run_pipeline,
                 log_fn, lambda: (make_figures(root, directory),
                                  make_training_figure(root, directory),
                                  make_curves_figure(root, directory)))


def _cached(cfg, seed, directory, filename, run_fn, log_fn, after,
            complete=lambda result: True) -> dict:
  """`run_fn(task, cfg, seed, directory, log_fn)`'s result, cached
  in `directory/filename`; `after()` runs once it is written (figures). A
  cached result that is not `complete` (one written before a method was
  added) is computed again, its finished steps read from `directory`
  (`_step`)."""
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


def _run_pipeline(task, cfg, seed, directory, log_fn) -> dict:
  groups = {g: task.clients_of(g) for g in task.group_names}
  # Stages 1 and 2 (FL, then one FL run per group) on the one run path.
  config = train_config(cfg, seed, directory,
                        keep_checkpoints=_pipeline_keep(cfg))
  run = _train(task, config, log_fn)
  fl_part = run.participations(stage='fl')
  group_part = run.participations()
  group_of = dict(enumerate(task.client_groups))

  eval_clients, sweep_clients = _sample_clients(task, cfg, seed)
  sums, sweep = {}, {}
  # FL's model (stage 'fl'), each group's model; then local personalization
  # from each, its lr selected on the sweep clients.
  for method, personal, stage in (('fl', 'perfl', 'fl'),
                                  ('groupfl', 'groupperfl', None)):
    sums[method] = _evaluate_cached(directory, method, run, eval_clients,
                                    stage, log_fn)
    sums[personal], sweep[personal] = _personalize(
        cfg, directory, personal, run, stage, eval_clients, sweep_clients,
        log_fn)

  result = {'cells': _cells(task, cfg, groups, eval_clients, sums, fl_part,
                            group_part, sweep),
            'sweep': sweep,
            'eval_clients': len(eval_clients),
            'sweep_clients': len(sweep_clients),
            'relative_change': {
                str(c): _relative(sums, c) for c in eval_clients},
            'group_of': {str(c): group_of[c] for c in eval_clients},
            'train_speeches': {str(c): task.num_train(c)
                               for c in eval_clients}}
  lrs = {m: sweep[m]['lr'] for m in sweep}
  _step(directory, 'curves', lambda: _control_curves(
      task, cfg, seed, directory, eval_clients, lrs, log_fn,
      control_runs=_CONTROL_RUNS[:1], opened={'groupfl': run}))
  _step(directory, 'fl_curves', lambda: _global_curves(
      task, cfg, run, 'fl', 1, cfg['rounds'], eval_clients, lrs['perfl'],
      log_fn))
  if cfg['clustering']:
    result['clustering'] = _step(directory, 'clustering', lambda: _cluster(
        task, cfg, run.process(stage='fl').model_weights_type,
        run.weights(stage='fl'), seed, log_fn))
  return result


def _evaluate_cached(directory, method, run, clients, stage, log_fn,
                     strategy='none', name=None) -> dict[int, dict]:
  """`_evaluated`, cached in `directory` as `name` (default
  `eval_<method>`, `_step`)."""
  log_fn(f'group: evaluating {name or method}')
  return {int(c): v for c, v in _step(
      directory, name or f'eval_{method}', lambda: {
          str(c): v for c, v in _evaluated(run, clients, strategy,
                                           stage).items()}).items()}


def _personalize(cfg, directory, method, run, stage, eval_clients,
                 sweep_clients, log_fn):
  """Local personalization (K_l epochs of SGD, `_personalization`) from
  each client's model in `run` (of `stage`; None: its group's).

  The learning rate is the one of `cfg['personalization_lrs']` with the
  lowest pooled perplexity on `sweep_clients`; the evaluated clients are
  then personalized with it. Each step is cached in `directory`
  (`sweep_<method>_lr<lr>`, `eval_<method>`). Returns `({eval client: its
  sums}, {'perplexity_by_lr', 'lr'})`.
  """
  by_lr = {}
  for lr in cfg['personalization_lrs']:
    result = _evaluate_cached(directory, method, run, sweep_clients, stage,
                              log_fn, _personalization(cfg, lr),
                              f'sweep_{method}_lr{lr:g}')
    by_lr[lr] = group_fl.perplexity(list(result.values()))
  best = min(by_lr, key=lambda lr: (by_lr[lr], lr))
  log_fn(f'group: {method} personalization lr {best} (sweep {by_lr})')
  sums = _evaluate_cached(directory, method, run, eval_clients, stage, log_fn,
                          _personalization(cfg, best))
  return sums, {'perplexity_by_lr': {f'{k:g}': v for k, v in by_lr.items()},
                'lr': best}


def plateau_round(curve: Mapping[int, float], window: int,
                  tolerance: float) -> Optional[int]:
  """The round at which a validation curve has plateaued, or None.

  The first evaluated round T such that no evaluation in (T, T + window]
  is more than `tolerance` (relative) below the value at T, among the
  rounds whose whole window the curve covers (lower is better, e.g.
  perplexity).

  Example: plateau_round({10: 200, 20: 150, 30: 149, 40: 149.5}, 20, 0.01)
  is 20 (149 is within 1% of 150).
  """
  rounds = sorted(curve)
  for t in rounds:
    if t + window > rounds[-1]:
      break
    later = [curve[r] for r in rounds if t < r <= t + window]
    if later and min(later) >= curve[t] * (1.0 - tolerance):
      return t
  return None


def _validation_clients(task, cfg, seed) -> list[int]:
  """Per genre, `validation_clients_per_group` clients with evaluation
  speeches after the sweep and evaluated ones of `_sample_clients` in
  `_genre_order`, so disjoint from both."""
  n_val = cfg['plateau']['validation_clients_per_group']
  out = []
  for g in task.group_names:
    order = _genre_order(task, g, _data_seed(cfg, seed))
    n_sweep = min(cfg['sweep_clients_per_group'], len(order) // 2)
    n_eval = cfg['eval_clients_per_group'] or len(order)
    rest = order[n_sweep + n_eval:]
    if not rest:
      raise ValueError(f'group: genre {g} has no client left for validation '
                       'after the sweep and evaluated ones; lower '
                       '--group_eval_clients_per_group')
    out += rest[:n_val]
  return sorted(out)


def _fl_curve_config(cfg, seed, directory) -> experiment.ExperimentConfig:
  """The controls' FL run (the registered `global`: stage 'fl' of
  `groupfl` on its own) for up to `max_rounds`, evaluated every
  `eval_every` rounds; it keeps a checkpoint every `2 * eval_every` rounds
  (`_fl_curves` reads them)."""
  p = cfg['plateau']
  return base_spec(cfg).override({
      'loop.rounds': p['max_rounds'], 'loop.seed': seed,
      'loop.checkpoint_every': 2 * p['eval_every'],
      'loop.keep_checkpoints': max(3, p['max_rounds'] //
                                   (2 * p['eval_every'])),
      'evaluation.every': p['eval_every'],
      'output.root_output_dir': directory,
      'output.experiment_name': 'fl_curve'}).config()


def _train_fl_curve(task, config, validation, log_fn) -> runs.Run:
  """The controls' FL run, trained unless it finished, evaluating the
  validation clients."""
  return runs.finished_or_trained(
      task, config, eval_ids=validation,
      log_fn=lambda s: log_fn(f'group fl_curve: {s}'))


def _find_plateau(task, cfg, seed, directory, validation, log_fn) -> dict:
  """Trains the controls' FL run (`_fl_curve_config`), evaluating the
  validation clients every `eval_every` rounds, and applies
  `plateau_round` to that curve."""
  p = cfg['plateau']
  config = _fl_curve_config(cfg, seed, directory)
  run = _train_fl_curve(task, config, validation, log_fn)
  curve = {int(r['round']): float(r['perplexity'])
           for r in run.curves()['eval'] if 'perplexity' in r}
  rounds = plateau_round(curve, p['window'], p['tolerance'])
  log_fn(f'group: FL validation plateau at round {rounds} '
         f'(searched {p["max_rounds"]})')
  return {'rounds': rounds or p['max_rounds'], 'reached': rounds is not None,
          'curve': {str(r): v for r, v in sorted(curve.items())},
          'validation_clients': len(validation)}


def _fl_curves(task, cfg, seed, directory, validation, eval_clients, lr,
               log_fn) -> dict:
  """`fl` and `perfl` over the controls' FL run (`_global_curves` at every
  checkpoint it keeps: every `2 * eval_every` rounds up to `max_rounds`;
  the run is trained again first if its directory is gone)."""
  config = _fl_curve_config(cfg, seed, directory)
  run = _train_fl_curve(task, config, validation, log_fn)
  return _global_curves(task, cfg, run, None, config.checkpoint_every,
                        config.rounds, eval_clients, lr, log_fn)


def _global_curves(task, cfg, run, stage, every, last, eval_clients, lr,
                   log_fn) -> dict:
  """`fl` and `perfl` over an FL run's rounds, on the evaluated clients.

  At rounds `every`, `2 * every`, ... up to `last`, from the checkpoints of
  `run` (of its `stage`), the FL model is tested on the evaluated clients
  as is (`fl`) and after each client's local fine-tuning at `lr` (`perfl`,
  the lr PerFL's sweep selected). Returns `{'round': [...], 'fl': {group or
  'all': [...]}, 'perfl': {...}}`, perplexities pooled as in the tables.

  Raises:
    ValueError: the run kept no checkpoint of one of those rounds (a run
      made before its curves were: it kept its last 3), naming them.
  """
  rounds = list(range(every, last + 1, every))
  kept = set(run.rounds(stage=stage))
  missing = [r for r in rounds if r not in kept]
  if missing:
    raise ValueError(
        f'group: {run.directory} kept no checkpoint of rounds {missing[:5]}'
        f'{" ..." if len(missing) > 5 else ""} ({len(missing)} of the '
        f'{len(rounds)} the learning curve needs). The run was made before '
        'it kept them: move its directory away to train it again.')
  pools = _pools(task, eval_clients)
  out = {'round': rounds, 'fl': {g: [] for g in pools},
         'perfl': {g: [] for g in pools}}
  for r in rounds:
    log_fn(f'group: curves of fl / perfl, FL round {r}')
    for name, strategy in (('fl', 'none'),
                           ('perfl', _personalization(cfg, lr))):
      by_client = _evaluated(run, eval_clients, strategy, stage, r)
      for g, clients in pools.items():
        out[name][g].append(group_fl.perplexity(
            [by_client[c] for c in clients]))
  return out


def _pools(task, eval_clients) -> dict[str, list[int]]:
  """The evaluated clients of each genre, and `all` of them."""
  pools = {g: [c for c in eval_clients if task.client_groups[c] == g]
           for g in task.group_names}
  pools[ALL] = list(eval_clients)
  return pools


def _controls(cfg: dict, seed: int, root: str, log_fn=None) -> dict:
  """The controls' cells (tables `control*`): `{method: {group: metrics}}`.

  FL trained to its validation plateau (`_find_plateau`); from that FL
  model, the one-path `groupfl` runs with the genres, with shuffled groups
  of the same sizes and with one group of every client at GroupFL's client
  budget (`fl_more`); each personalized as in the tables. Every client is
  evaluated on the clients of `_sample_clients`. Cached as `controls.json`
  (each step before it too) under the pipeline's directory, keyed by the
  plateau rule.
  """
  directory = os.path.join(_config_dir(root, cfg, seed),
                           'controls_' + _digest(cfg['plateau']))
  return _cached(cfg, seed, directory, 'controls.json', _run_controls, log_fn,
                 lambda: (make_plateau_figure(root, os.path.dirname(directory)),
                          make_control_curves_figure(root, directory)),
                 complete=lambda cells: set(CONTROL_METHODS) <= set(cells))


def _run_controls(task, cfg, seed, directory, log_fn) -> dict:
  eval_clients, sweep_clients = _sample_clients(task, cfg, seed)
  validation = _validation_clients(task, cfg, seed)
  plateau = _step(directory, 'plateau', lambda: _find_plateau(
      task, cfg, seed, directory, validation, log_fn))
  cfg_t = dict(cfg, rounds=plateau['rounds'])
  num_groups = len(task.group_names)
  opened = {}  # method -> its run
  for control in _CONTROL_RUNS:
    config = _control_config(cfg_t, seed, directory, control, num_groups,
                             keep_checkpoints=_control_keep(cfg))
    opened[control[3]] = _train(task, config, log_fn)
  # FL (the FL stage every control run shares), then each control run's
  # groups; each as is and personalized.
  starts = [('fl', 'perfl', opened['groupfl'], 'fl')] + [
      (name, personal, opened[name], None)
      for *_, name, personal in _CONTROL_RUNS]
  sums, sweep = {}, {}
  for method, personal, run, stage in starts:
    sums[method] = _evaluate_cached(directory, method, run, eval_clients, stage,
                                    log_fn)
  for method, personal, run, stage in starts:
    sums[personal], sweep[personal] = _personalize(
        cfg, directory, personal, run, stage, eval_clients, sweep_clients,
        log_fn)
  _step(directory, 'curves', lambda: _control_curves(
      task, cfg_t, seed, directory, eval_clients,
      {m: s['lr'] for m, s in sweep.items()}, log_fn, opened=opened))
  _step(directory, 'fl_curves', lambda: _fl_curves(
      task, cfg, seed, directory, validation, eval_clients,
      sweep['perfl']['lr'], log_fn))
  return _control_cells(task, eval_clients, sums, sweep, plateau['rounds'])


def _pipeline_keep(cfg) -> int:
  """Checkpoints the tables' run keeps: every FL round's and every group
  round's (the curves'), and never fewer than the loop's default."""
  return max(cfg['rounds'], cfg['group_rounds'], 3)


def _control_keep(cfg) -> int:
  """Checkpoints each control run keeps: every group round's (the
  curves'), and never fewer than the loop's default."""
  return max(cfg['group_rounds'], 3)


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


def _control_curves(task, cfg_t, seed, directory, eval_clients, lrs, log_fn,
                    control_runs=_CONTROL_RUNS, opened=None) -> dict:
  """Held-out learning curves of group stages (the controls', or with
  `control_runs=_CONTROL_RUNS[:1]` the tables' GroupFL and GroupPerFL).

  For each group-stage run (`runs`) and each round r = 0..T_g,
  every evaluated client is tested with its group's model after r group
  rounds (round 0: the FL model at T), from the run's checkpoints; its
  personalized method first fine-tunes that model as the table does, at
  the lr its sweep selected (`lrs[method]`). The last round's values are
  the table's (the same models and evaluations).

  `opened`: {method: its `runs.Run`} for runs already at hand (the
  others are opened from their directories).

  Returns `{method: {'round': [0..T_g], group or 'all': [perplexity per
  round]}}`, each pooled over the evaluated clients of the genre (`all`:
  every genre).
  """
  num_groups = len(task.group_names)
  pools = _pools(task, eval_clients)
  rounds = list(range(cfg_t['group_rounds'] + 1))
  out = {}
  for control in control_runs:
    method, personal = control[3:]
    config = _control_config(cfg_t, seed, directory, control, num_groups)
    run = (opened or {}).get(method) or runs.Run.open(config.experiment_dir,
                                                      task=task)
    for name in (method, personal):
      out[name] = {'round': rounds, **{g: [] for g in pools}}
    for r in rounds:
      log_fn(f'group: curves of {method} / {personal}, group round {r}')
      # Round 0: the FL model at T, every group's start.
      at = dict(stage='fl') if r == 0 else dict(stage=None, round_num=r)
      for name, strategy in ((method, 'none'), (personal, _personalization(
          cfg_t, lrs[personal]))):
        by_client = _evaluated(run, eval_clients, strategy, **at)
        for g, clients in pools.items():
          out[name][g].append(group_fl.perplexity(
              [by_client[c] for c in clients]))
  return out


def _control_cells(task, eval_clients, sums, sweep, rounds) -> dict:
  """`{method: {group: metrics}}` of the controls, with each group
  method's `margin` over the better of its controls (`CONTROLS_OF`)."""
  members_of = _pools(task, eval_clients)
  out = {}
  for method in CONTROL_METHODS:
    out[method] = {}
    for g, members in members_of.items():
      metrics = {
          'perplexity': group_fl.perplexity([sums[method][c]
                                             for c in members]),
          'clients': len(members),
          'eval_tokens': float(sum(sums[method][c]['tokens']
                                   for c in members)),
          'fl_rounds': rounds}
      if method in sweep:
        metrics['personalization_lr'] = sweep[method]['lr']
      out[method][g] = metrics
  for method, controls in CONTROLS_OF.items():
    for g, metrics in out[method].items():
      metrics['margin'] = metrics['perplexity'] - min(
          out[c][g]['perplexity'] for c in controls)
  return out

def _relative(sums, client) -> float:
  per = group_fl.perplexity([sums['perfl'][client]])
  gper = group_fl.perplexity([sums['groupperfl'][client]])
  return (gper - per) / per


def _cells(task, cfg, groups, eval_clients, sums, fl_part, group_part, sweep):
  k, k_l = cfg['local_epochs'], cfg['personalization_epochs']
  members_of = {g: [c for c in eval_clients if task.client_groups[c] == g]
                for g in groups}
  members_of[ALL] = list(eval_clients)
  out = {}
  for method in METHODS:
    out[method] = {}
    for g, members in members_of.items():
      part = [fl_part.get(c, 0) + (group_part.get(c, 0)
                                   if method.startswith('group') else 0)
              for c in members]
      personal = method.endswith('perfl')
      metrics = {
          'perplexity': group_fl.perplexity([sums[method][c]
                                             for c in members]),
          'communication': float(np.mean(
              [group_fl.communication_cost(p) for p in part])),
          'computation': float(np.mean(
              [group_fl.computation_cost(p, k, k_l if personal else 0)
               for p in part])),
          'clients': len(members),
          'eval_tokens': float(sum(sums[method][c]['tokens']
                                   for c in members)),
      }
      if personal:
        metrics['personalization_lr'] = sweep[method]['lr']
      if method == 'groupperfl':
        metrics['share_clients_improved'] = float(np.mean(
            [_relative(sums, c) < 0 for c in members]))
      out[method][g] = metrics
  return out


def _cluster(task, cfg, weights_type, weights, seed, log_fn) -> dict:
  """Clusters every client with training data by its update from `weights`."""
  log_fn('group: clustering client updates')
  updates = group_fl.build_client_updates(
      task.model_fn, tff.learning.optimizers.build_sgdm(cfg['client_lr']),
      weights_type)
  sketch = update_clustering.CountSketch(dim=4096, seed=seed)
  clients = list(range(task.num_clients))
  if cfg['cluster_clients'] and cfg['cluster_clients'] < len(clients):
    clients = sorted(np.random.default_rng([seed, 0xC1]).choice(
        len(clients), cfg['cluster_clients'], replace=False).tolist())
  vectors = []
  for i in range(0, len(clients), 64):
    chunk = clients[i:i + 64]
    results = updates(weights, [task.train_dataset(c, cfg['local_epochs'])
                                for c in chunk])
    vectors += [sketch(u) for u in results]
  vectors = np.stack(vectors)
  truth = [task.client_groups[c] for c in clients]
  big = [i for i, c in enumerate(clients) if task.num_train(c) >= 10]
  out = {}
  for center in (True, False):
    labels = update_clustering.cluster_updates(
        vectors, len(task.group_names), center=center, seed=seed)
    name = 'adjusted_rand_index' + ('' if center else '_uncentered')
    out[name] = update_clustering.adjusted_rand_index(truth, labels)
    out[name + '_10plus_speeches'] = update_clustering.adjusted_rand_index(
        [truth[i] for i in big], labels[big])
  # Plays are a finer known grouping (characters of a play share names and
  # themes): the same clustering with one cluster per play present.
  plays = [task.client_ids[c].split('/')[1] for c in clients]
  labels = update_clustering.cluster_updates(
      vectors, len(set(plays)), center=True, seed=seed)
  out['adjusted_rand_index_plays'] = update_clustering.adjusted_rand_index(
      plays, labels)
  out['clients'] = len(clients)
  out['clients_10plus_speeches'] = len(big)
  return out


# ------------------------------------------------------------------ figures


def _save_figure(fig, root_output_dir: str, name: str) -> None:
  """Lays out `fig`, writes it to `<root_output_dir>/figures/<name>` and
  closes it."""
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig.tight_layout()
  out = os.path.join(root_output_dir, 'figures')
  os.makedirs(out, exist_ok=True)
  fig.savefig(os.path.join(out, name), dpi=120)
  plt.close(fig)


def make_figures(root_output_dir: str, pipeline_dir: str) -> None:
  """Figure 1: histogram of per-client relative change, GroupPerFL vs PerFL.

  Pools the evaluated clients of every finished seed of the pipeline's
  configuration (the sibling `seed_<n>` directories).
  """
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  changes, seeds = [], 0
  for path in sorted(glob.glob(os.path.join(
      os.path.dirname(pipeline_dir), 'seed_*', 'pipeline.json'))):
    changes += list(atomic_io.read_json(path)['relative_change'].values())
    seeds += 1
  if not changes:
    return
  change = np.array(changes) * 100
  fig, ax = plt.subplots(figsize=(6, 4))
  ax.hist(change, bins=40, color='tab:blue', edgecolor='white')
  ax.axvline(0, color='black', linewidth=1)
  improved = float(np.mean(change < 0)) * 100
  ax.set_xlabel('relative perplexity change, GroupPerFL vs PerFL (%)')
  ax.set_ylabel('clients')
  ax.set_title(f'{len(change)} clients ({seeds} seed(s)); '
               f'{improved:.1f}% improve')
  _save_figure(fig, root_output_dir, 'group_relative_change_hist.png')


def _train_curve(path: str) -> dict:
  """`{'round': [...], 'perplexity': [...]}` of a stage's
  train_metrics.csv: exp of the round cohort's mean token loss."""
  rows = [r for r in training_loop.read_metrics(path) if 'train/loss' in r]
  return {'round': [int(r['round']) for r in rows],
          'perplexity': [float(np.exp(r['train/loss'])) for r in rows]}


def make_training_figure(root_output_dir: str, pipeline_dir: str) -> None:
  """`group_training_curves.png`: the training perplexity (the round
  cohort's) of the FL stage, then of each genre's GroupFL stage, per round:
  the mean over the finished seeds with a band of one standard deviation.
  Reads every sibling seed's `groupfl_task/` under the pipeline's
  configuration."""
  seeds = sorted(glob.glob(os.path.join(os.path.dirname(pipeline_dir),
                                        'seed_*', 'groupfl_task')))
  fl = [_train_curve(p) for p in (
      os.path.join(s, 'stages', 'fl', 'train_metrics.csv') for s in seeds)
        if os.path.exists(p)]
  fl = [c for c in fl if c['round']]  # A seed killed before its round 1.
  if not fl:
    return
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(6.5, 4))
  curve_bands.plot_seed_band(ax, fl, 'round', 'perplexity', color='black',
                           label='fl: every client')
  offset = max(max(c['round']) for c in fl)
  genres = sorted({os.path.basename(g) for s in seeds
                   for g in glob.glob(os.path.join(s, 'groups', '*'))})
  for genre in genres:
    curves = []
    for s in seeds:
      path = os.path.join(s, 'groups', genre, 'train_metrics.csv')
      if os.path.exists(path):
        c = _train_curve(path)
        curves.append({'round': [offset + r for r in c['round']],
                       'perplexity': c['perplexity']})
    curve_bands.plot_seed_band(ax, curves, 'round', 'perplexity',
                             label=f'groupfl: {genre}')
  ax.axvline(offset + 0.5, color='gray', linewidth=0.8)
  ax.set_xlabel('round (FL, then each genre\'s group rounds)')
  ax.set_ylabel('training perplexity (round cohort)')
  ax.set_yscale('log')
  ax.set_title(f'mean ± 1 std over {len(fl)} seed(s)', fontsize=9)
  ax.legend(fontsize=7)
  _save_figure(fig, root_output_dir, 'group_training_curves.png')


def make_curves_figure(root_output_dir: str, pipeline_dir: str) -> None:
  """`group_curves.png`: every method of Table 3 on the evaluated clients
  (`all`), as held-out perplexity per round: `fl` and `perfl` over the T
  FL rounds, then `groupfl` and `groupperfl` over the T_g group rounds
  (from the FL model at T). Each curve is the mean over the finished seeds
  with a band of one standard deviation. Reads every sibling seed's
  `fl_curves.json` and `curves.json` under the pipeline's configuration."""
  fl_curves, curves = [], []
  for path in sorted(glob.glob(os.path.join(
      os.path.dirname(pipeline_dir), 'seed_*', 'pipeline.json'))):
    seed_dir = os.path.dirname(path)
    paths = [os.path.join(seed_dir, n) for n in ('fl_curves.json',
                                                 'curves.json')]
    if not all(os.path.exists(p) for p in paths):
      continue  # Made before the curves existed.
    fl_curves.append(atomic_io.read_json(paths[0]))
    curves.append(atomic_io.read_json(paths[1]))
  if not curves:
    return
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(7, 4.2))
  for method, color in (('fl', 'black'), ('perfl', 'tab:green')):
    curve_bands.plot_seed_band(
        ax, [{'round': c['round'], 'perplexity': c[method][ALL]}
             for c in fl_curves], 'round', 'perplexity', color=color,
        label=method)
  offset = min(max(c['round']) for c in fl_curves)
  for method, color in (('groupfl', 'tab:red'), ('groupperfl', 'tab:blue')):
    curve_bands.plot_seed_band(
        ax, [{'round': [offset + r for r in c[method]['round']],
              'perplexity': c[method][ALL]} for c in curves],
        'round', 'perplexity', color=color, label=method)
  ax.axvline(offset, color='gray', linewidth=0.8)
  ax.set_xlabel(f'round (FL, then the genres\' group rounds from round '
                f'{offset})')
  ax.set_ylabel('held-out perplexity, evaluated clients')
  ax.set_yscale('log')
  ax.set_title(f'mean ± 1 std over {len(curves)} seed(s)', fontsize=9)
  ax.legend(fontsize=8)
  _save_figure(fig, root_output_dir, 'group_curves.png')


def make_plateau_figure(root_output_dir: str, seed_dir: str) -> None:
  """FL's validation perplexity over rounds (the controls' plateau runs):
  the mean over the finished seeds with a band of one standard deviation,
  each seed's plateau round T marked. Reads every sibling seed's
  `controls_*/plateau.json` under the pipeline's directory."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  curves, rounds = [], []
  name = None
  for path in sorted(glob.glob(os.path.join(
      os.path.dirname(seed_dir), 'seed_*', 'controls_*', 'plateau.json'))):
    name = name or os.path.basename(os.path.dirname(path))
    if os.path.basename(os.path.dirname(path)) != name:
      continue  # Another plateau rule.
    plateau = atomic_io.read_json(path)
    points = sorted((int(r), v) for r, v in plateau['curve'].items())
    curves.append({'round': [r for r, _ in points],
                   'perplexity': [v for _, v in points]})
    rounds.append(plateau['rounds'])
  if not curves:
    return
  fig, ax = plt.subplots(figsize=(6, 4))
  curve_bands.plot_seed_band(ax, curves, 'round', 'perplexity',
                           color='tab:blue', alpha=0.25,
                           label=f'FL, mean ± 1 std of {len(curves)} seed(s)')
  mean = curve_bands.seed_band(curves, 'round', 'perplexity')[1]
  for i, t in enumerate(rounds):
    ax.axvline(t, color='tab:red', linewidth=0.8, alpha=0.7,
               label='plateau round T per seed' if i == 0 else None)
  ax.set_xlabel('FL round')
  ax.set_ylabel('validation perplexity')
  ax.set_ylim(top=float(np.percentile(mean, 95)))
  ax.legend()
  _save_figure(fig, root_output_dir, 'group_fl_plateau.png')


def make_control_curves_figure(root_output_dir: str,
                               controls_dir: str) -> None:
  """`group_control_curves.png`: every method of table `control` on the
  evaluated clients (`all`), as held-out perplexity over rounds.

  Left, `fl` and `perfl` over FL's rounds (`_fl_curves`), each seed's
  plateau round T marked; middle, the group-stage runs as trained and,
  right, personalized, over the group rounds after T (`_control_curves`:
  round 0 is the FL model at T), each as the change from the seed's `fl`
  at T, with `fl` and `perfl` at T (the table's) as dashed lines. Each
  curve is the mean over the finished seeds with a band of one standard
  deviation. Reads every sibling seed's
  `controls_*/{fl_curves,curves,controls}.json` of the same plateau rule as
  `controls_dir`.
  """
  name = os.path.basename(controls_dir)
  curves, tables, fl_curves, plateau_rounds = [], [], [], []
  for path in sorted(glob.glob(os.path.join(
      os.path.dirname(os.path.dirname(controls_dir)), 'seed_*', name,
      'controls.json'))):
    seed_dir = os.path.dirname(path)
    tables.append(atomic_io.read_json(path))
    curves.append(atomic_io.read_json(os.path.join(seed_dir, 'curves.json')))
    fl_path = os.path.join(seed_dir, 'fl_curves.json')
    if os.path.exists(fl_path):  # Absent in a run made before it existed.
      fl_curves.append(atomic_io.read_json(fl_path))
      plateau_rounds.append(tables[-1]['fl'][ALL]['fl_rounds'])
  if not curves:
    return
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
  for method, color in (('fl', 'black'), ('perfl', 'tab:green')):
    curve_bands.plot_seed_band(
        axes[0], [{'round': c['round'], 'perplexity': c[method][ALL]}
                  for c in fl_curves], 'round', 'perplexity', color=color,
        label=method)
  for i, t in enumerate(plateau_rounds):
    axes[0].axvline(t, color='tab:red', linewidth=0.8, alpha=0.7,
                    label='plateau round T per seed' if i == 0 else None)
  axes[0].set_xlabel('FL round')
  axes[0].set_ylabel('held-out perplexity, evaluated clients')
  axes[0].set_title(f'FL ({len(fl_curves)} seed(s))', fontsize=9)
  if fl_curves:
    top = max(np.percentile(c['fl'][ALL], 90) for c in fl_curves)
    axes[0].set_ylim(top=float(top))
  # The group stage as each seed's change from its FL model at T: the
  # seeds' evaluated clients differ, and so do their levels.
  base = [t['fl'][ALL]['perplexity'] for t in tables]
  colors = ('tab:red', 'tab:orange', 'tab:green', 'tab:purple', 'tab:blue',
            'tab:pink', 'tab:cyan')
  for ax, column, start in ((axes[1], 3, 'fl'), (axes[2], 4, 'perfl')):
    for run, color in zip(_CONTROL_RUNS, colors):
      method = run[column]
      if any(method not in c for c in curves):  # Not in an older run's.
        continue
      curve_bands.plot_seed_band(
          ax, [{'round': c[method]['round'],
                'perplexity': [v - b for v in c[method][ALL]]}
               for c, b in zip(curves, base)], 'round', 'perplexity',
          color=color, label=method)
    level = float(np.mean([t[start][ALL]['perplexity'] - b
                           for t, b in zip(tables, base)]))
    ax.axhline(level, color='black', linestyle='--', linewidth=1,
               label=f'{start} (at T)')
    ax.set_xlabel('group rounds after T (0: the FL model at T)')
  axes[1].set_ylabel('held-out perplexity minus fl\'s at T (per seed)')
  axes[1].set_title(f'group stage, as trained ({len(curves)} seed(s))',
                    fontsize=9)
  axes[2].set_title('group stage, personalized (each method\'s selected lr)',
                    fontsize=9)
  limits = [ax.get_ylim() for ax in axes[1:]]
  for ax in axes[1:]:
    ax.set_ylim(min(lo for lo, _ in limits), max(hi for _, hi in limits))
  for ax in axes:
    ax.legend(fontsize=8)
  fig.suptitle('mean ± 1 std over seeds', fontsize=9)
  _save_figure(fig, root_output_dir, 'group_control_curves.png')
