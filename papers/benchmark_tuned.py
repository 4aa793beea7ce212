"""The tuned personalization benchmark (Motley-style): each method's learning
rates chosen on validation clients, then scored on test clients of the
training population and on withheld (cold-start) clients, without and with
user-level DP.

  python -m binaries.reproduce --paper=benchmark_tuned --table=<table> \
    --seeds=<n> --root_output_dir=out/benchmark_tuned --data_dir=../shared/data

run table by table, in this order (each reads the choices of the earlier
ones from the root's results.jsonl):

  tune_client_lr   --seeds=1   client (Adam) rate, server SGD 1.0
  tune_private_lr  --seeds=1   personal rate at the chosen client rate
  tune_server_lr   --seeds=1   server rate at the chosen client and personal
  final            --seeds=3   the chosen rates, no DP and DP

As in `papers/benchmark.py` (whose protocol this reuses: `cell_spec`):
`mnist_client_data` with 1,000 users, 30 rounds of 10 clients, each method's
declared evaluation, DP `gaussian_fixed` at `--benchmark_tuned_target_epsilon`
with clip `--benchmark_tuned_clip_norm`. Here 100 users (`WITHHELD`) are
withheld from training. Private layers start from the model's initialisers
(`personal_init='model'`).

Tuning cells (seed 0, no DP) score `--benchmark_tuned_eval_clients`
validation clients drawn from the training population less the test draw
(`run_evaluation.validation_client_ids`); a stage picks the rate with the
highest validation client-mean accuracy (ties: the earlier grid value), the
previous stages' choices fixed. Final cells score the test draw
(`run_evaluation.eval_client_ids`) as trained, and the withheld users as
new users (`COLD_START`): metrics `trained_accuracy_{pooled,client_mean}`
and `cold_accuracy_{pooled,client_mean}`.
"""

from __future__ import annotations

import dataclasses
import os
import time
import types
from typing import Any, Mapping, Optional, Sequence

from papers import benchmark
from tasks import registry as task_registry
from tff_personal.config import run_spec
from tff_personal.core import runtime
from tff_personal.evaluation import run_evaluation
from tff_personal.reports import reporting
from tff_personal.run import runs

PAPER = 'benchmark_tuned'
TASK = 'mnist_client_data'
FOLDER = 'mnist'
WITHHELD = 100
TASK_OPTIONS = {'num_users': 1000, 'withheld_clients': WITHHELD}
METHODS = benchmark.methods_for(TASK)

# The grids (at most four values each), searched coordinate-wise.
CLIENT_LRS = (3e-4, 1e-3, 3e-3, 1e-2)
DEFAULT_SERVER_LR = 1.0
SERVER_LRS = (0.5, 2.0)  # 1.0 is the client stage's own.
PRIVATE_LRS = (3e-4, 1e-3, 3e-3, 1e-2)
# The methods whose private variables take the personal optimizer
# (`--private_learning_rate`): FedRep's, FedPer's heads, LG-FedAvg's body,
# Ditto's and APFL's personal models, FedAvg+'s embedding. (pFedMe's
# personal head has its own inner solver, SGD at its `inner_learning_rate`,
# which a private rate would switch to Adam: not tuned here.)
PRIVATE_LR_METHODS = tuple(
    m for m in ('fedrep', 'fedper', 'lg_fedavg', 'ditto', 'apfl',
                'global_plus') if m in METHODS)

# How the withheld users start: from the final shared model's counterpart
# of the private state where there is one; elsewhere from the process's
# new-user state (the model's initialisers for private layers; a process
# with nothing private starts from the global model either way). Then each
# adapts on its own training examples (samples=all) and is tested; `0`
# (no adaptation) is recorded too.
GLOBAL_START = ('ditto', 'apfl', 'pfedme')
COLD_SAMPLES = (0, 'all')


def cold_start_strategy(method: str) -> str:
  start = 'global' if method in GLOBAL_START else 'initial'
  samples = '/'.join(str(s) for s in COLD_SAMPLES)
  return f'cold=cold_start(start={start},samples={samples})'


VALIDATION = 'validation'
METRIC_VAL = 'val_accuracy_client_mean'
DP_NONE, DP = 'none', 'gaussian_fixed'


def _tune(name: str, key: str, grid: Sequence[float],
          methods: Sequence[str], what: str) -> reporting.Table:
  return reporting.Table(
      name=name, paper=PAPER, metric=METRIC_VAL, methods=methods,
      columns=[reporting.Column(f'{v:g}', {'stage': name, key: v})
               for v in grid],
      title=f'Tuning: {what} (validation clients, seed 0, no DP)', digits=3,
      notes='Metric: the mean over the validation clients of their '
            'accuracy (client-mean).')


def _final(name: str, metric: str, what: str, digits: int = 3
           ) -> reporting.Table:
  return reporting.Table(
      name=name, paper=PAPER, metric=metric, methods=METHODS,
      columns=[reporting.Column('no DP', {'stage': 'final', 'dp': DP_NONE}),
               reporting.Column('DP', {'stage': 'final', 'dp': DP})],
      title=f'{TASK}, tuned: {what}', digits=digits)


TABLES = {
    'tune_client_lr': _tune('tune_client_lr', 'client_lr', CLIENT_LRS,
                            METHODS, 'client learning rate (Adam), server '
                            f'SGD {DEFAULT_SERVER_LR:g}'),
    'tune_private_lr': _tune('tune_private_lr', 'private_lr', PRIVATE_LRS,
                             PRIVATE_LR_METHODS,
                             'personal learning rate (Adam), at the chosen '
                             'client rate'),
    'tune_server_lr': _tune('tune_server_lr', 'server_lr', SERVER_LRS,
                            METHODS, 'server learning rate (SGD), at the '
                            'chosen client and personal rates'),
    'final': _final('final', 'trained_accuracy_client_mean',
                    'client-mean accuracy, test clients of the training '
                    'population'),
    'final_seconds': _final('final_seconds', 'seconds',
                            'seconds per final cell (2 cores)', digits=0),
}
TUNING_STAGES = ('tune_client_lr', 'tune_private_lr', 'tune_server_lr')


def define_flags():
  reporting.define_flags(
      ('integer', 'benchmark_tuned_rounds', 30, 'Tuned benchmark: rounds.'),
      ('integer', 'benchmark_tuned_clients_per_round', 10,
       'Tuned benchmark: cohort size.'),
      ('integer', 'benchmark_tuned_eval_clients', 100,
       'Tuned benchmark: test clients, and validation clients, each drawn by '
       'the seed from the training population.'),
      ('float', 'benchmark_tuned_target_epsilon', 8.0,
       'Tuned benchmark: epsilon of the DP cells.'),
      ('float', 'benchmark_tuned_clip_norm', 0.5,
       'Tuned benchmark: DP clip of a client update.'))


def cells(table: str, flag_values) -> list[reporting.Cell]:
  return TABLES[table].cells(flag_values.seeds)


# ----------------------------------------------------------------- choices


@dataclasses.dataclass(frozen=True)
class Rates:
  """A method's learning rates (`private` None: the client optimizer's)."""
  client: float = 1e-3
  server: float = DEFAULT_SERVER_LR
  private: Optional[float] = None


def _score(record: Mapping[str, Any]) -> Optional[float]:
  value = record['metrics'].get(METRIC_VAL)
  return float(value) if isinstance(value, (int, float)) else None


def _rates_of(record: Mapping[str, Any]) -> Rates:
  m = record['metrics']
  return Rates(client=m['client_learning_rate'],
               server=m['server_learning_rate'],
               private=m.get('private_learning_rate'))


def chosen(records: Sequence[Mapping[str, Any]], method: str,
           through: str = TUNING_STAGES[-1]) -> tuple[Rates, float]:
  """The rates `method`'s tuning records choose through stage `through`, and
  their validation score.

  Each stage keeps the best of its grid and the previous choice (a stage
  the method does not take, or has not run, keeps it), by validation
  client-mean accuracy; ties keep the earlier.

  Raises:
    ValueError: no client-rate cell of `method` is recorded.
  """
  best, best_score = None, None
  for stage in TUNING_STAGES[:TUNING_STAGES.index(through) + 1]:
    table = TABLES[stage]
    found = []
    for column in table.columns:
      for r in records:
        if (r.get('paper') == PAPER and r['method'] == method and
            r['seed'] == 0 and dict(r['setting']) == dict(column.setting)
            and _score(r) is not None):
          found.append(r)
    for r in found:
      if best_score is None or _score(r) > best_score:
        best, best_score = _rates_of(r), _score(r)
    if stage == 'tune_client_lr' and best is None:
      raise ValueError(f'{PAPER}: no tune_client_lr cell of {method} is '
                       'recorded; run that table first')
  return best, best_score


def _records(flag_values) -> list[dict]:
  root = flag_values.root_output_dir
  return list(reporting.ResultsFile(
      os.path.join(root, reporting.RESULTS_FILENAME)).latest().values())


def cell_rates(cell: reporting.Cell, records) -> Rates:
  """The rates a cell runs at: its own grid value over the earlier stages'
  choices (a final cell: every stage's)."""
  stage = cell.setting['stage']
  if stage == 'tune_client_lr':
    return Rates(client=cell.setting['client_lr'])
  if stage == 'final':
    return chosen(records, cell.method)[0]
  previous = TUNING_STAGES[TUNING_STAGES.index(stage) - 1]
  base = chosen(records, cell.method, previous)[0]
  if stage == 'tune_private_lr':
    return dataclasses.replace(base, private=cell.setting['private_lr'])
  return dataclasses.replace(base, server=cell.setting['server_lr'])


# -------------------------------------------------------------------- cells


_BUILT = {}


def _task(flag_values, seed: int):
  root = reporting.data_dir(flag_values)
  key = (root, seed)
  if key not in _BUILT:
    _BUILT[key] = task_registry.build_task(
        TASK, data_dir=os.path.join(root, FOLDER), seed=seed, **TASK_OPTIONS)
  return _BUILT[key]


def _benchmark_flags(flag_values) -> Any:
  """This paper's flags under `papers.benchmark`'s names (its `cell_spec`)."""
  return types.SimpleNamespace(**{
      f'benchmark_{n}': getattr(flag_values, f'benchmark_tuned_{n}')
      for n in ('rounds', 'clients_per_round', 'eval_clients',
                'target_epsilon', 'clip_norm')})


def cell_spec(cell: reporting.Cell, flag_values, out_dir: str,
              population: int, rates: Rates) -> run_spec.RunSpec:
  """`papers.benchmark.cell_spec`'s run (rounds, cohort, DP) at `rates`,
  on the task with withheld users, private layers from the model's
  initialisers; a final cell also evaluates the withheld users."""
  dp = cell.setting.get('dp', DP_NONE)
  spec = benchmark.cell_spec(
      reporting.Cell(PAPER, cell.method, {'task': TASK, 'dp': dp}, cell.seed),
      _benchmark_flags(flag_values), out_dir, population)
  final = cell.setting['stage'] == 'final'
  return dataclasses.replace(
      spec, task_options=dict(TASK_OPTIONS),
      loop=dataclasses.replace(spec.loop, personal_init='model'),
      optimizers=run_spec.Optimizers(
          client='adam', client_learning_rate=rates.client,
          private_learning_rate=rates.private, private='adam',
          server='sgd', server_learning_rate=rates.server),
      evaluation=dataclasses.replace(
          spec.evaluation,
          strategies=(cold_start_strategy(cell.method),) if final else ()))


def _accuracies(prefix: str, metrics: Mapping[str, Any]) -> dict:
  return {f'{prefix}accuracy_{k}': metrics[f'accuracy_{k}']
          for k in ('pooled', 'client_mean')}


def run_cell(cell: reporting.Cell, flag_values, out_dir: str) -> dict:
  rates = cell_rates(cell, _records(flag_values))
  task = _task(flag_values, reporting.data_seed(flag_values, cell.seed))
  final = cell.setting['stage'] == 'final'
  count = min(flag_values.benchmark_tuned_eval_clients, task.population)
  ids = (run_evaluation.eval_client_ids(task.population, count, cell.seed)
         if final else run_evaluation.validation_client_ids(
             task.population, count, count, cell.seed))
  config = cell_spec(cell, flag_values, out_dir, task.population,
                     rates).config()
  start = time.monotonic()
  with runtime.local_runtime(
      log_path=os.path.join(out_dir, 'worker_binary.log')):
    run = runs.run_experiment(task, config, log_fn=lambda _: None,
                              eval_ids=ids)
  evaluated = run['eval']
  metrics = {'seconds': time.monotonic() - start,
             'rounds': run['rounds_completed'],
             'client_learning_rate': rates.client,
             'server_learning_rate': rates.server,
             'never_trained_clients': evaluated.get(
                 run_evaluation.NEVER_TRAINED, 0)}
  if rates.private is not None:
    metrics['private_learning_rate'] = rates.private
  if not final:
    metrics.update(_accuracies('val_', evaluated))
    return metrics
  metrics.update(_accuracies('trained_', evaluated))
  # Of those, the clients that took part in a round (the others hold the
  # private state `personal_init` starts them with).
  participated = {k[len(run_evaluation.TRAINED_PREFIX):]: v
                  for k, v in evaluated.items()
                  if k.startswith(run_evaluation.TRAINED_PREFIX)}
  if 'accuracy_pooled' in participated:
    metrics.update(_accuracies('participated_', participated))
  cold = run[run_evaluation.STRATEGIES]['cold']
  metrics['cold_clients'] = cold['users']
  metrics['cold_start'] = cold['strategy']
  metrics.update(_accuracies('cold_', cold['samples']['all']))
  metrics.update(_accuracies('cold_unadapted_', cold['samples']['0']))
  return _with_privacy(metrics, run)


def _with_privacy(metrics: dict, run) -> dict:
  if run['privacy']:
    metrics.update(epsilon=run['privacy']['epsilon'],
                   delta=run['privacy']['delta'],
                   noise_multiplier=run['privacy']['noise_multiplier'])
  return metrics


# ------------------------------------------------------------------- tables


def _fmt(values: Sequence[float], digits: int = 3) -> str:
  s = reporting.summarize(values)
  if s is None:
    return reporting.MISSING
  return f'{s.mean:.{digits}f} ± {s.std:.{digits}f} ({s.n})'


def _final_values(records, method: str, dp: str, metric: str) -> list:
  return [m[metric] for m in reporting.metrics_for(
      records, PAPER, method, {'stage': 'final', 'dp': dp})
          if isinstance(m.get(metric), (int, float))]


def render_accuracy(records, pooling: str) -> str:
  """The final cells' accuracy (`pooling`: 'client_mean' or 'pooled'): the
  test clients of the training population and the withheld (cold-start)
  users, no DP and DP, mean ± std (n) over seeds."""
  what = {'client_mean': 'client-mean (the mean of the clients\' '
                         'accuracies)',
          'pooled': 'pooled (over every test example of the clients)'}[
                              pooling]
  lines = [f'### {TASK}, tuned: accuracy, {what}', '',
           f'Metrics: `trained_accuracy_{pooling}`, '
           f'`cold_accuracy_{pooling}`.', '',
           '| method | trained, no DP | trained, DP | cold start, no DP | '
           'cold start, DP |', '|---|---:|---:|---:|---:|']
  for m in METHODS:
    row = [_fmt(_final_values(records, m, dp, f'{part}_accuracy_{pooling}'))
           for part in ('trained', 'cold') for dp in (DP_NONE, DP)]
    lines.append(f'| {m} | ' + ' | '.join(row) + ' |')
  lines += ['', 'mean ± sample standard deviation (ddof=1) over seeds, (n) '
            f'seeds; {reporting.MISSING}: not run yet. trained: the test '
            'clients drawn by the seed from the training population, each '
            'with its stored state through the method\'s declared '
            f'evaluation. cold start: the {WITHHELD} withheld users, each '
            'with the final shared model and a private part from its shared '
            'counterpart (' + ', '.join(GLOBAL_START) + ': `start=global`) '
            'or from the model\'s initialisers (the others: '
            '`start=initial`), adapted on its own training examples. '
            'DP: user-level `gaussian_fixed` at the epsilon in '
            'results.jsonl, at the no-DP choice of rates.']
  return '\n'.join(lines) + '\n'


def _rate(value: Optional[float]) -> str:
  return 'client' if value is None else f'{value:g}'


def render_rates(records) -> str:
  """Each method's chosen rates and their validation score."""
  lines = [f'### {TASK}, tuned: the chosen learning rates', '',
           '| method | client (Adam) | personal (Adam) | server (SGD) | '
           'validation client-mean accuracy |', '|---|---:|---:|---:|---:|']
  for m in METHODS:
    try:
      rates, score = chosen(records, m)
    except ValueError:
      lines.append(f'| {m} | ' + ' | '.join([reporting.MISSING] * 4) + ' |')
      continue
    personal = (_rate(rates.private) if m in PRIVATE_LR_METHODS else
                'not tuned')
    lines.append(f'| {m} | {rates.client:g} | {personal} | '
                 f'{rates.server:g} | {score:.3f} |')
  lines += ['', 'Grids: client ' + ', '.join(f'{v:g}' for v in CLIENT_LRS) +
            f' (server {DEFAULT_SERVER_LR:g}); personal ' +
            ', '.join(f'{v:g}' for v in PRIVATE_LRS) + ' (' +
            ', '.join(PRIVATE_LR_METHODS) + '; "client": the client '
            'optimizer trains the private variables); server ' +
            ', '.join(f'{v:g}' for v in sorted(SERVER_LRS + (
                DEFAULT_SERVER_LR,))) + '. Chosen in that order on seed 0 '
            'without DP, by the validation clients\' mean accuracy.']
  return '\n'.join(lines) + '\n'


def render_wall_time(records) -> str:
  """The recorded cells' wall time, per table."""
  lines = ['### Wall time', '', '| table | cells | minutes |',
           '|---|---:|---:|']
  total_cells, total = 0, 0.0
  for name in TUNING_STAGES + ('final',):
    table = TABLES[name]
    seconds = [r['seconds'] for r in records
               if r.get('paper') == PAPER and r['method'] in table.methods
               and table.column_for(r['setting']) is not None
               and isinstance(r.get('seconds'), (int, float))]
    total_cells += len(seconds)
    total += sum(seconds)
    lines.append(f'| {name} | {len(seconds)} | {sum(seconds) / 60:.1f} |')
  lines.append(f'| all | {total_cells} | {total / 60:.1f} |')
  lines += ['', 'Each cell\'s wall time as `binaries.reproduce` recorded it '
            '(building the task, training, evaluating), on 2 cores; '
            'starting each table\'s process adds a few seconds.']
  return '\n'.join(lines) + '\n'


EXTRA_TABLES = {
    'accuracy_client_mean': lambda records: render_accuracy(
        records, 'client_mean'),
    'accuracy_pooled': lambda records: render_accuracy(records, 'pooled'),
    'rates': render_rates,
    'wall_time': render_wall_time,
}
