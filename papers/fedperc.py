"""FedPerC (Silva, Tambwekar & Gombolay): Tables 1-4 on the `tv_shows` task.

`python -m binaries.reproduce --paper=fedperc --table=table1
--fedperc_backbone=<preset>` runs a table's cells. One run of a variant's
registered algorithm per (variant, seed) (`train_config`) serves Tables 1
and 2, scored by the library's evaluator under named strategies
(`strategies_of`); Table 3 and the memory table time every model in one
process (`models/fedperc_costs.py`); Table 4 samples the trained model.
docs/papers/fedperc.md says what each table and cell is.
"""

from __future__ import annotations

import glob
import hashlib
import os
import pickle
import re
import sys

import numpy as np
import tensorflow as tf

from tasks import context_task
from tasks import tv_shows
from tasks import tv_shows_task
from tff_personal.algorithms import fedperc as fedperc_alg
from tff_personal.algorithms import registry
from tff_personal.config import experiment
from tff_personal.config import run_spec
from tff_personal.config import strategies
from tff_personal.core import atomic_io
from tff_personal.core import process as process_lib
from tff_personal.core import runtime
from tff_personal.models import bpe_trainer
from tff_personal.models import fedperc
from tff_personal.models import fedperc_backbone
from tff_personal.models import fedperc_costs
from tff_personal.models import fedperc_training
from tff_personal.reports import figures
from tff_personal.reports import reporting
from tff_personal.run import runs

PAPER = 'fedperc'
METHODS = ('fedperc', 'fedperc_frozen', 'fedperc_generated', 'split_learning',
           'meta_learning')
SAMPLES = (1, 5, 15, 'all')
PROMPT_TOKENS = 3

# FedPerC Tables 1-3, TV Shows rows.
_PAPER_T1 = reporting.paper_rows('''
    fedperc           | 57.2 ± 3.6 | 51.5 ± 1.5 | 48.8 ± 1.7 | 46.7 ± 1.7
    fedperc_frozen    | 50.3 ± 1.6 | 50.7 ± 2.1 | 51.0 ± 2.1 | 51.2 ± 2.0
    fedperc_generated | 51.6 ± 1.3 | 51.7 ± 2.0 | 51.7 ± 2.0 | 52.1 ± 2.6
    split_learning    | 359.4 ± 28.2 | 244.5 ± 15.1 | 167.7 ± 8.6 | 82.1 ± 3.3
    meta_learning     | 111.7 ± 4.6 | 110.0 ± 6.5 | 111.9 ± 6.1 | 113.0 ± 4.7
''')
_PAPER_T2 = reporting.paper_rows('''
  fedperc           | 205.1 ± 292.2 | 68.6 ± 5.6 | 62.1 ± 5.0 | 52.3 ± 3.3
  fedperc_frozen    | 96.4 ± 10.4 | 90.1 ± 4.9 | 97.6 ± 6.8 | 98.2 ± 9.5
  fedperc_generated | 68.7 ± 5.9 | 66.7 ± 6.3 | 66.1 ± 5.5 | 68.6 ± 5.1
  split_learning    | 283.6 ± 30.9 | 220.7 ± 29.2 | 158.1 ± 20.0 | 96.7 ± 14.5
  meta_learning     | 113.5 ± 13.1 | 111.4 ± 13.3 | 117.3 ± 10.5 | 114.2 ± 17.0
''')
# Table 3: train pass, test pass (ms).
_PAPER_MS = reporting.paper_rows('''
    fedperc           | 88.18 ± 24.104 | 40.37 ± 11.76
    fedperc_frozen    | 43.57 ± 11.99 | 40.25 ± 12.10
    fedperc_generated | 55.96 ± 12.41 | 47.02 ± 12.63
    split_learning    | 222.08 ± 37.55 | 65.42 ± 16.49
    meta_learning     | 111.81 ± 22.33 | 36.77 ± 8.95
''')
_PAPER_TRAIN_MS = {m: v[0] for m, v in _PAPER_MS.items()}
_PAPER_TEST_MS = {m: v[1] for m, v in _PAPER_MS.items()}


def _samples_name(n) -> str:
  return 'All' if n == 'all' else str(n)


def _perplexity_table(name, users, paper_values, title):
  columns = [reporting.Column(_samples_name(n), {'users': users, 'samples': n})
             for n in SAMPLES]
  return reporting.Table(
      name=name, paper=PAPER, metric='perplexity', methods=METHODS,
      columns=columns,
      paper_values={(m, _samples_name(n)): v[i]
                    for m, v in paper_values.items()
                    for i, n in enumerate(SAMPLES)},
      title=title, digits=1,
      notes='Paper: TV Shows with DistilGPT2; ours: the backbone in '
            'docs/papers/fedperc.md. Compare ratios, not absolute values.')


def _single(name, metric, paper_values, title, digits=2):
  return reporting.Table(
      name=name, paper=PAPER, metric=metric, methods=METHODS,
      columns=[reporting.Column(metric, {'measure': metric})],
      paper_values={(m, metric): v for m, v in paper_values.items()},
      title=title, digits=digits)


TABLES = {
    'table1': _perplexity_table(
        'table1', 'known', _PAPER_T1,
        'FedPerC Table 1: perplexity, known users (lower is better)'),
    'table2': _perplexity_table(
        'table2', 'withheld', _PAPER_T2,
        'FedPerC Table 2: perplexity, withheld users (lower is better)'),
    'table3_train': _single('table3_train', 'train_ms', _PAPER_TRAIN_MS,
                            'FedPerC Table 3: train pass time (ms)'),
    'table3_test': _single('table3_test', 'test_ms', _PAPER_TEST_MS,
                           'FedPerC Table 3: test pass time (ms)'),
    'memory': _single('memory', 'bytes_per_user', {},
                      'Per-user on-device memory beyond the frozen backbone '
                      '(bytes)', digits=0),
}


def define_flags():
  reporting.define_flags(
      ('string', 'fedperc_backbone', None,
       'FedPerC: keras-nlp GPT-2 preset name or preset directory '
       '(binaries.pretrain_backbone makes one).'),
      ('integer', 'fedperc_rounds', 10, 'FedPerC: training rounds.'),
      ('integer', 'fedperc_clients_per_round', 5, 'FedPerC: cohort size.'),
      ('integer', 'fedperc_local_steps', 10, 'FedPerC: local steps.'),
      ('integer', 'fedperc_batch_size', 15, 'FedPerC: utterances per step.'),
      ('integer', 'fedperc_max_utterances', 200,
       'FedPerC: utterances kept per user (0: all).'),
      ('integer', 'fedperc_max_tokens', 24,
       'FedPerC: tokens per utterance (end token included).'),
      ('integer', 'fedperc_fine_tune_steps', 15,
       'FedPerC: test-time local steps.'),
      ('float', 'fedperc_client_learning_rate', 1e-3,
       'FedPerC: local Adam lr.'),
      ('float', 'fedperc_proximal_mu', 1.0, 'FedPerC: FedProx mu.'),
      ('string', 'fedperc_server_optimizer', 'sgd',
       'FedPerC: sgd (Algorithm 1: add the mean delta) or adam.'),
      ('float', 'fedperc_server_learning_rate', 1.0, 'FedPerC: server lr.'),
      ('float', 'fedperc_dp_noise_multiplier', 1.0,
       'FedPerC: noise multiplier of the new-user DP average.'),
      ('float', 'fedperc_dp_clip', None,
       "FedPerC: L2 clip of a user's private state in the new-user DP "
       "average (None: the variant's, algorithms/fedperc.DP_CLIP_NORMS)."),
      ('integer', 'fedperc_generator_tokens', 12,
       'FedPerC: tokens of each utterance the generators read (0: all).'),
      ('integer', 'fedperc_timing_repeats', 20,
       'FedPerC: timed passes per method.'),
      ('integer', 'fedperc_curve_points', 10,
       "FedPerC: held-out evaluations per training run (every rounds // N "
       "rounds; 0: after the last round only)."))


# Flags that change how a run is carried out, not what it computes
# (reporting.run_config leaves them out of the trained models' cache key).
OPERATIONAL_FLAGS = ('fedperc_curve_points',)


def cells(table: str, flag_values) -> list[reporting.Cell]:
  if not flag_values.fedperc_backbone:
    raise ValueError('--fedperc_backbone is required (a keras-nlp GPT-2 preset '
                     'or a directory made by binaries.pretrain_backbone)')
  for name in ('fedperc_rounds', 'fedperc_clients_per_round',
               'fedperc_local_steps', 'fedperc_batch_size',
               'fedperc_max_tokens', 'fedperc_fine_tune_steps'):
    if getattr(flag_values, name) < 1:
      raise ValueError(f'--{name} must be positive')
  if (TABLES[table].metric == 'perplexity'
      and fedperc_backbone.has_random_weights(flag_values.fedperc_backbone)):
    raise ValueError(
        f'--fedperc_backbone={flag_values.fedperc_backbone} has random weights '
        f'({fedperc_backbone.RANDOM_WEIGHTS_FILE}; binaries.shaped_backbone): '
        f'it times passes and counts memory, but {table} measures perplexity')
  return TABLES[table].cells(flag_values.seeds)


# ------------------------------------------------------------ data


_SPECS: dict[str, fedperc_backbone.BackboneSpec] = {}
_USERS: dict[tuple, dict[str, tv_shows.UserData]] = {}


def _spec(flag_values) -> fedperc_backbone.BackboneSpec:
  name = flag_values.fedperc_backbone
  if name not in _SPECS:
    _SPECS[name] = fedperc_backbone.load_backbone(name)
  return _SPECS[name]


def _users(flag_values, seed: int,
           cache_dir: str | None = None) -> dict[str, tv_shows.UserData]:
  """The task's users, tokenized; cached in memory and (optionally) on disk,
  since every `reproduce` invocation (one per table) would redo it."""
  spec = _spec(flag_values)
  seed = reporting.data_seed(flag_values, seed)  # Which utterances, users.
  key = (flag_values.fedperc_backbone, reporting.data_dir(flag_values), seed,
         flag_values.fedperc_max_tokens, flag_values.fedperc_max_utterances)
  if key in _USERS:
    return _USERS[key]
  path = None
  if cache_dir:
    digest = hashlib.sha1(repr(key).encode()).hexdigest()[:12]
    path = os.path.join(cache_dir, f'users_{digest}.pkl')
    if os.path.exists(path):
      with open(path, 'rb') as f:
        _USERS[key] = pickle.load(f)
      return _USERS[key]
  sentences = tv_shows.load_sentences(reporting.data_dir(flag_values))
  _USERS[key] = tv_shows.build_users(
      sentences, spec.tokenizer(), max_tokens=flag_values.fedperc_max_tokens,
      end_id=spec.vocabulary[bpe_trainer.END_TOKEN], seed=seed,
      max_utterances_per_user=flag_values.fedperc_max_utterances or None)
  if path:
    with atomic_io.atomic_write(path, 'wb') as f:
      pickle.dump(_USERS[key], f)
  return _USERS[key]


def _config(variant: str, flag_values) -> fedperc.FedPercConfig:
  return fedperc.FedPercConfig(
      variant=variant, num_contexts=len(tv_shows.CONTEXTS),
      max_tokens=flag_values.fedperc_max_tokens,
      generator_tokens=flag_values.fedperc_generator_tokens)


# ------------------------------------------------------------ training



def _method_of(variant: str) -> str:
  """The registered algorithm that trains `variant` (the first listed)."""
  return next(m for m in METHODS
              if fedperc_alg.algorithm(m).variant == variant)


def task_of(flag_values, seed: int) -> context_task.ContextTask:
  """The `tv_shows` task under the paper's flags (users from `_users`)."""
  return tv_shows_task.from_users(
      _spec(flag_values), _users(flag_values, seed),
      max_tokens=flag_values.fedperc_max_tokens,
      local_steps=flag_values.fedperc_local_steps,
      batch_size=flag_values.fedperc_batch_size,
      generator_tokens=flag_values.fedperc_generator_tokens, seed=seed)


def eval_every(flag_values) -> int:
  """Rounds between the training run's held-out evaluations (0: the last
  round only), from `--fedperc_curve_points`."""
  points = getattr(flag_values, 'fedperc_curve_points', 0) or 0
  if points < 0:
    raise ValueError(f'--fedperc_curve_points must be >= 0, got {points}')
  return max(1, flag_values.fedperc_rounds // points) if points else 0


def train_config(variant: str, flag_values, seed: int,
                 cache_dir: str) -> experiment.ExperimentConfig:
  """The one-path run that trains `variant` (section 4, Appendix B).

  The run evaluates the known users' held-out utterances (the task's
  evaluation: perplexity with the user's trained state, no test-time
  adaptation) every `eval_every(flag_values)` rounds and after the last.
  """
  method = _method_of(variant)
  options = {'proximal_mu': flag_values.fedperc_proximal_mu}
  if 'fine_tune_steps' in registry.algorithm_options(method):
    options['fine_tune_steps'] = flag_values.fedperc_fine_tune_steps
  return run_spec.RunSpec(
      task='tv_shows', algorithm=method, algorithm_options=options,
      loop=run_spec.Loop(
          rounds=flag_values.fedperc_rounds,
          clients_per_round=min(flag_values.fedperc_clients_per_round,
                                len(tv_shows.training_users(withheld=True))),
          seed=seed, resume=True,
          personal_init='normal'),  # as the recorded cells started
      optimizers=run_spec.Optimizers(
          client='adam',
          client_learning_rate=flag_values.fedperc_client_learning_rate,
          server=flag_values.fedperc_server_optimizer,
          server_learning_rate=flag_values.fedperc_server_learning_rate),
      evaluation=run_spec.Evaluation(every=eval_every(flag_values)),
      output=run_spec.Output(cache_dir, f'{variant}_seed{seed}')).config()


def trained_run(variant: str, flag_values, seed: int,
                cache_dir: str) -> runs.Run:
  """The finished one-path run of `variant` (`train_config`, in `cache_dir`,
  itself keyed by the digest of the paper's flags): trained on the users
  that are not withheld if it has not finished (a killed run resumes),
  else read back."""
  task = task_of(flag_values, seed)
  config = train_config(variant, flag_values, seed, cache_dir)
  with runtime.local_runtime():  # Every TFF call in a runtime we own.
    return runs.finished_or_trained(task, config, log_fn=lambda s: print(
        f'fedperc {variant} seed {seed}: {s}', flush=True))


def _curves(run: runs.Run) -> dict:
  """dict(seconds=the rounds' wall time, train_loss=[per round],
  eval_curve=dict(round=[...], perplexity=[...]): the run's held-out
  evaluations of the known users, `train_config`)."""
  curves = run.curves()
  rows = sorted(curves['train'], key=lambda r: r['round'])
  evals = sorted((r for r in curves['eval'] if 'perplexity' in r),
                 key=lambda r: r['round'])
  return dict(
      seconds=float(sum(float(r['round_seconds']) for r in rows)),
      train_loss=[float(r['train/loss']) for r in rows],
      eval_curve=dict(round=[int(r['round']) for r in evals],
                      perplexity=[float(r['perplexity']) for r in evals]))


# ------------------------------------------------------------ evaluation


def strategies_of(variant: str, flag_values) -> dict:
  """Tables 1 and 2 of one trained run as the library's named strategies.

  Known users: `adapt(samples=k)` for k in 0 (no adaptation: the frozen
  row), 1, 5, 15 (all: the run's own evaluation). Withheld users:
  `cold_start` at 0, 1, 5, 15 and all samples, from the DP average of the
  trained users' private states (`--fedperc_dp_noise_multiplier`,
  `--fedperc_dp_clip`) for the variants that have one, else from the
  process's new-user state (Split-Learning: the pre-trained head).
  """
  named = {f'adapt{n}': strategies.Adapt(samples=n)
           for n in (0,) + SAMPLES if n != 'all'}
  named['new'] = strategies.ColdStart(
      samples=(0,) + SAMPLES,
      start=('dp_average' if variant in fedperc_alg.DP_CLIP_NORMS
             else 'initial'),
      noise_multiplier=flag_values.fedperc_dp_noise_multiplier,
      clip_norm=flag_values.fedperc_dp_clip)
  return named


def evaluate(run: runs.Run, flag_values) -> dict:
  """Tables 1 and 2 of one finished run (`strategies_of`, `Run.evaluate`).

  Returns:
    `{'known': {samples: perplexity}, 'withheld': {...}, 'tokens':
    {'known': ..., 'withheld': ...}, 'new_user_dp_average': the DP
    release's record (variants with one)}`, samples '0', '1', '5', '15'
    and 'all'.
  """
  named = strategies_of(fedperc_alg.algorithm(run.config.algorithm).variant,
                        flag_values)
  with runtime.local_runtime():
    record = run.evaluate(strategies=named)
  got = record['strategies']
  known = {str(named[n].samples): got[n]['eval'] for n in named
           if n != 'new'}
  known['all'] = record['eval']
  withheld = got['new']['samples']
  return dict(
      known={k: float(m['perplexity']) for k, m in known.items()},
      withheld={k: float(m['perplexity']) for k, m in withheld.items()},
      tokens=dict(known={k: float(m['tokens']) for k, m in known.items()},
                  withheld={k: float(m['tokens'])
                            for k, m in withheld.items()}),
      **({'new_user_dp_average': got['new']['dp_average']}
         if 'dp_average' in got['new'] else {}))


# ------------------------------------------------------------ timing


def measure_costs(flag_values, seed: int) -> dict:
  """Train / test pass ms and per-user memory of every method, one process
  (`fedperc_costs.pass_costs` on a batch of the first user's test set)."""
  users = _users(flag_values, seed)
  batch = {k: tf.constant(v[:flag_values.fedperc_batch_size])
           for k, v in users[tv_shows.USERS[0]].splits['test'].items()}
  return fedperc_costs.pass_costs(
      _spec(flag_values),
      {name: _config(fedperc_alg.algorithm(name).variant, flag_values)
       for name in METHODS},
      batch, repeats=flag_values.fedperc_timing_repeats, seed=seed,
      prompt_tokens=PROMPT_TOKENS)


# ------------------------------------------------------------ Table 4


def write_generations(run: runs.Run, flag_values, seed: int,
                      path: str) -> str:
  """Table 4: continuations for Chandler and Arya in both shows' contexts,
  from the trained `fedperc` run."""
  with runtime.local_runtime():
    weights = run.weights()
    states = dict(zip(run.task.client_names,
                      run.client_states(range(run.task.population))))
  spec = _spec(flag_values)
  model = fedperc.FedPercModel(spec, _config(fedperc.EMBEDDING, flag_values),
                               seed)
  tokenizer = spec.tokenizer()
  end_id = spec.vocabulary[bpe_trainer.END_TOKEN]
  lines = ['| character | context | "We must" | "I think" |',
           '|---|---|---|---|']
  for user in ('friends/CHANDLER', 'got/ARYA'):
    fedperc_training.assign_weights(
        model, weights, states[user][process_lib.CLIENT_STATE_PRIVATE])
    for context in range(len(tv_shows.CONTEXTS)):
      cells = []
      for prompt in ('We must', 'I think'):
        ids = tokenizer(prompt).numpy().tolist()
        rng = np.random.default_rng([seed, context, len(prompt)])
        samples = []
        for _ in range(3):
          out = fedperc_training.sample_continuation(
              model, ids, context, end_id=end_id, max_new_tokens=12, rng=rng)
          samples.append(tokenizer.detokenize(out).numpy().decode(
              'utf-8', 'replace').replace('|', '/').replace('\n', ' ').strip())
        cells.append(' / '.join(samples))
      lines.append(f'| {user.split("/")[1].title()} | '
                   f'{tv_shows.CONTEXTS[context]} | {cells[0]} | {cells[1]} |')
  text = '\n'.join(lines) + '\n'
  with atomic_io.atomic_write(path) as f:
    f.write(text)
  return text


# ------------------------------------------------------------ cells


def trained_cache_dir(root: str, flag_values) -> str:
  """Where cells share trained models, evaluations and costs: one directory
  per configuration of the paper's flags (`reporting.run_config`), so that
  no cell reuses what was made under other flags."""
  config = reporting.run_config(PAPER, sys.modules[__name__], flag_values)
  return os.path.join(root, reporting.RUNS_DIRNAME, PAPER, '_trained',
                      reporting.config_digest(config))


def run_cell(cell: reporting.Cell, flag_values, out_dir: str) -> dict:
  root = reporting.root_of(out_dir)
  cache = trained_cache_dir(root, flag_values)
  os.makedirs(cache, exist_ok=True)
  seed = cell.seed
  _users(flag_values, seed, cache)  # Loads (or makes) the disk cache.
  if 'measure' in cell.setting:
    costs = atomic_io.cached_json(
        os.path.join(cache, f'costs_seed{seed}.json'),
        lambda: measure_costs(flag_values, seed))
    metric = cell.setting['measure']
    value = costs[cell.method]
    if metric == 'bytes_per_user':
      return dict(bytes_per_user=value['bytes_per_user'],
                  parameters_per_user=value['parameters_per_user'])
    return {metric: value[metric], f'{metric}_std': value[f'{metric}_std']}
  algo = fedperc_alg.algorithm(cell.method)
  method = _method_of(algo.variant)  # The run that trains the variant.

  def compute():
    run = trained_run(algo.variant, flag_values, seed, cache)
    curves = _curves(run)
    return dict(evaluate(run, flag_values), train_seconds=curves['seconds'],
                train_loss=curves['train_loss'],
                eval_curve=curves['eval_curve'])

  result = atomic_io.cached_json(
      os.path.join(cache, f'eval_{method}_seed{seed}.json'), compute)
  if cell.method == 'fedperc' and cell.setting['users'] == 'known':
    table4 = os.path.join(root, reporting.TABLES_DIRNAME, PAPER, 'table4.md')
    if not os.path.exists(table4):
      write_generations(trained_run(algo.variant, flag_values, seed, cache),
                        flag_values, seed, table4)
  atomic_io.write_json(os.path.join(out_dir, 'eval.json'), result)
  make_figures(root, flag_values)
  users = cell.setting['users']
  # A method without test-time adaptation reads none of the samples.
  samples = '0' if algo.adapt == 'none' else str(cell.setting['samples'])
  return dict(perplexity=result[users][samples],
              tokens=result['tokens'][users][samples])


_EVAL_FILE = re.compile(r'eval_(?P<method>.+)_seed(?P<seed>\d+)\.json$')


def _variant_runs(cache: str, key: str):
  """`key` of every cached evaluation, by variant and training seed, and
  the methods of each variant (they share its training)."""
  runs: dict[str, dict[int, object]] = {}
  methods: dict[str, set[str]] = {}
  for path in sorted(glob.glob(os.path.join(cache, 'eval_*_seed*.json'))):
    match = _EVAL_FILE.search(os.path.basename(path))
    if not match or match['method'] not in METHODS:
      continue
    value = atomic_io.read_json(path).get(key)
    if not value or (isinstance(value, dict) and not value.get('round')):
      continue
    variant = fedperc_alg.algorithm(match['method']).variant
    runs.setdefault(variant, {})[int(match['seed'])] = value
    methods[variant] = {m for m in METHODS
                        if fedperc_alg.algorithm(m).variant == variant}
  return runs, methods


def make_figures(root: str, flag_values) -> list[str]:
  """The learning curves of every trained variant (mean over its training
  seeds, a band of one std) from the evaluations cached under the flags'
  `trained_cache_dir`: `fedperc_train_loss.png` (training loss per round,
  the round's cohort) and `fedperc_eval_curves.png` (the known users'
  held-out perplexity at the training run's evaluations). Returns the
  paths written (none when nothing is cached)."""
  cache = trained_cache_dir(root, flag_values)
  out = os.path.join(root, reporting.TABLES_DIRNAME, PAPER)
  paths = []
  for name, key, ylabel, yscale, curve_of in (
      ('fedperc_train_loss.png', 'train_loss',
       'training loss (round cohort)', 'linear',
       lambda x: {'round': list(range(1, len(x) + 1)), 'value': x}),
      ('fedperc_eval_curves.png', 'eval_curve',
       "perplexity, known users' held-out utterances", 'log',
       lambda c: {'round': c['round'], 'value': c['perplexity']})):
    values, methods = _variant_runs(cache, key)
    curves = {v: [curve_of(x) for _, x in sorted(by_seed.items())]
              for v, by_seed in values.items()}
    lines = [dict(curves=curves[v], y='value', label=f'{v} (' + ', '.join(
        m for m in METHODS if m in methods[v]) + ')') for v in sorted(curves)]
    seeds = ', '.join(map(str, sorted({len(c) for c in curves.values()})))
    path = figures.band_figure(
        os.path.join(out, name), [dict(
            title=f'FedPerC variants: mean ± 1 std over {seeds} seed(s)',
            lines=lines)],
        ylabel=ylabel, yscale=yscale, panel_size=(6.5, 4))
    if path:
      paths.append(path)
  return paths
