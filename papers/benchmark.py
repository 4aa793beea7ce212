"""The personalization benchmark: every compatible method on four tasks,
without and with user-level DP, one table per task.

  python -m binaries.reproduce --paper=benchmark --seeds=3 \
    --root_output_dir=out/benchmark --data_dir=../shared/data

Rows: the personalization methods of the registry (`METHODS`) that the
task fits (`algorithms.registry.missing_for`). Columns: no DP, and DP
(`gaussian_fixed`, user-level, the noise calibrated to
`--benchmark_target_epsilon` at the library's delta for the population).
Every cell is one `runs.run_experiment` with the method's registry
defaults and the task's (`TASKS`): the same rounds, cohort, optimizers and
evaluation for every method; no learning rate is tuned. Evaluation is the
library's (each method's declared evaluation: FedAvg+FT, FedBABU and
Per-FedAvg fine-tune, HypCluster re-selects, kNN-Per builds its memory), so
the methods are scored the same way.

Tables per task: `<task>` (the task's metric over every evaluated client),
`<task>_trained` and `<task>_never_trained` (the clients that took part in
training, and those that never did), `<task>_seconds` (a cell's wall time
on this machine). The DP cells record epsilon and delta.
"""

from __future__ import annotations

import os
import time

from tasks import registry as task_registry
from tff_personal.algorithms import registry
from tff_personal.config import run_spec
from tff_personal.core import runtime
from tff_personal.evaluation import run_evaluation
from tff_personal.reports import reporting
from tff_personal.run import runs

PAPER = 'benchmark'

# The methods compared: FedAvg and the personalization methods reviewers
# ask about (the papers' own methods have their own reports).
METHODS = ('global', 'fedavg_ft', 'fedrep', 'fedper', 'lg_fedavg', 'fedbabu',
           'pfedme', 'ditto', 'apfl', 'per_fedavg', 'hypcluster', 'knn_per',
           'global_plus')

# task -> (data folder under --data_dir, task options, metric, digits).
TASKS = {
    'label_skew_mnist': ('mnist', {'num_clients': 100, 'alpha': 0.1},
                         'accuracy', 3),
    'mnist_client_data': ('mnist', {'num_users': 1000}, 'accuracy', 3),
    'speaker_context': ('', {}, 'accuracy', 3),
    'shakespeare_groups': ('', {'max_clients': 400}, 'perplexity', 1),
}


# How each task's metric pools its clients: a ClientData task's `accuracy`
# is the mean of the clients' accuracies, the speaker task's is pooled over
# every test example (each record also has `accuracy_pooled` and
# `accuracy_client_mean`).
POOLING = {
    'label_skew_mnist': 'mean over clients',
    'mnist_client_data': 'mean over clients',
    'speaker_context': 'pooled over examples',
    'shakespeare_groups': 'pooled over tokens',
}


def methods_for(task: str) -> tuple[str, ...]:
  """The benchmark's methods that run on `task`."""
  capabilities = task_registry.spec(task).capabilities
  return tuple(m for m in METHODS
               if not registry.missing_for(m, capabilities))


def _table(task: str, name: str, metric: str, what: str, digits: int
           ) -> reporting.Table:
  return reporting.Table(
      name=name, paper=PAPER, metric=metric, methods=methods_for(task),
      columns=[reporting.Column('no DP', {'task': task, 'dp': 'none'}),
               reporting.Column('DP', {'task': task,
                                       'dp': 'gaussian_fixed'})],
      title=f'{task}: {what}', digits=digits,
      notes='DP: user-level, gaussian_fixed at --benchmark_target_epsilon; '
            'epsilon and delta in results.jsonl.')


def _tables() -> dict[str, reporting.Table]:
  out = {}
  for task, (_, _, metric, digits) in TASKS.items():
    for suffix, key, what in (
        ('', metric, f'{metric} ({POOLING[task]}), every evaluated client'),
        ('_trained', f'trained_{metric}',
         f'{metric} ({POOLING[task]}), the clients that trained'),
        ('_never_trained', f'never_trained_{metric}',
         f'{metric} ({POOLING[task]}), the clients that never trained'),
        ('_seconds', 'seconds', 'seconds per cell (2 cores)')):
      out[task + suffix] = _table(task, task + suffix, key, what,
                                  0 if suffix == '_seconds' else digits)
  return out


TABLES = _tables()


def define_flags():
  reporting.define_flags(
      ('integer', 'benchmark_rounds', 30, 'Benchmark: rounds per cell.'),
      ('integer', 'benchmark_clients_per_round', 10, 'Benchmark: cohort size.'),
      ('integer', 'benchmark_eval_clients', 100,
       'Benchmark: clients evaluated (drawn by the seed; 0: all).'),
      ('float', 'benchmark_target_epsilon', 8.0,
       'Benchmark: epsilon of the DP cells (delta: the library default).'),
      ('float', 'benchmark_clip_norm', 0.5,
       'Benchmark: DP clip of a client update.'))


def cells(table: str, flag_values) -> list[reporting.Cell]:
  return TABLES[table].cells(flag_values.seeds)


_BUILT = {}


def _task(name: str, flag_values, seed: int):
  folder, options, _, _ = TASKS[name]
  root = flag_values.data_dir or os.path.join(
      os.path.dirname(__file__), '..', '..', 'shared', 'data')
  key = (name, root, seed)
  if key not in _BUILT:
    _BUILT[key] = task_registry.build_task(
        name, data_dir=os.path.join(root, folder) if folder else root,
        seed=seed, **options)
  return _BUILT[key]


def cell_spec(cell: reporting.Cell, flag_values, out_dir: str,
              population: int) -> run_spec.RunSpec:
  """A cell's run: the method on the cell's task, the benchmark's rounds
  and cohort, local Adam and FedAvg's server; a DP cell calibrates to
  `--benchmark_target_epsilon` at delta `default_target_delta(population)`."""
  dp = run_spec.Privacy()
  if cell.setting['dp'] != 'none':
    dp = run_spec.Privacy(
        mechanism=cell.setting['dp'],
        target_epsilon=flag_values.benchmark_target_epsilon,
        clip_norm=flag_values.benchmark_clip_norm)
  return run_spec.RunSpec(
      task=cell.setting['task'], algorithm=cell.method,
      task_options=TASKS[cell.setting['task']][1],
      loop=run_spec.Loop(
          rounds=flag_values.benchmark_rounds,
          clients_per_round=flag_values.benchmark_clients_per_round,
          seed=cell.seed, checkpoint_every=10, resume=True,
          personal_init='normal'),  # as the recorded cells started
      privacy=dp,
      evaluation=run_spec.Evaluation(
          clients=min(flag_values.benchmark_eval_clients, population)),
      output=run_spec.Output(out_dir, 'run'))


def run_cell(cell: reporting.Cell, flag_values, out_dir: str) -> dict:
  name = cell.setting['task']
  task = _task(name, flag_values, reporting.data_seed(flag_values, cell.seed))
  metric = TASKS[name][2]
  config = cell_spec(cell, flag_values, out_dir, task.population).config()
  start = time.monotonic()
  with runtime.local_runtime(
      log_path=os.path.join(out_dir, 'worker_binary.log')):
    run = runs.run_experiment(task, config, log_fn=lambda _: None)
  evaluated = run['eval']
  if metric not in evaluated:
    raise ValueError(f'benchmark: task {name!r} reports no {metric!r} '
                     f'(TASKS); its evaluation has {sorted(evaluated)}')
  metrics = {metric: evaluated[metric],
             'seconds': time.monotonic() - start,
             'never_trained_clients': evaluated.get(
                 run_evaluation.NEVER_TRAINED, 0),
             'rounds': run['rounds_completed']}
  # The trained clients and the others apart (every client trained: the
  # trained part is the whole, and there is no never-trained part).
  trained = evaluated.get(run_evaluation.TRAINED_PREFIX + metric)
  if trained is None and not metrics['never_trained_clients']:
    trained = evaluated[metric]
  never = evaluated.get(run_evaluation.NEVER_TRAINED_PREFIX + metric)
  for key, value in (('trained_' + metric, trained),
                     ('never_trained_' + metric, never)):
    if value is not None:
      metrics[key] = value
  if run['privacy']:
    metrics.update(epsilon=run['privacy']['epsilon'],
                   delta=run['privacy']['delta'],
                   noise_multiplier=run['privacy']['noise_multiplier'])
  return metrics
