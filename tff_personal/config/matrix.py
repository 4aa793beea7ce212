"""The algorithm x task matrix: which registered algorithm runs on which task.

Computed here, where algorithms and tasks are both known: an algorithm
declares what it needs (`algorithms/registry.py`, `AlgorithmSpec.needs`),
a task what it provides (`tasks/registry.py`, `TaskSpec.capabilities`),
and neither registry imports the other. `binaries.train --list` prints it;
the README's table is `format_matrix(links_from=root)`
(`tools/readme_tables.py`).

Example:

  from tff_personal.config import matrix
  rows = matrix.matrix()        # [{'algorithm', 'task', 'runs', 'missing'}]
  print(matrix.format_matrix())
"""

from __future__ import annotations

import os
from typing import Any, Sequence

from tasks import registry as task_registry
from tff_personal.algorithms import registry as algorithms


def _task_specs(tasks: Sequence[str]) -> list:
  """The registered tasks' specs, then those of `tasks` not registered."""
  return list(task_registry.SPECS.values()) + [
      task_registry.spec(t) for t in tasks if t not in task_registry.SPECS]


def matrix(tasks: Sequence[str] = ()) -> list[dict[str, Any]]:
  """Every (algorithm, task) pair: whether it runs, and if not what the task
  lacks. Rows in registry order; `tasks`: the registered tasks and these
  (e.g. an outside task's `package.module:factory`)."""
  rows = []
  for algorithm in algorithms.SPECS:
    for task_spec in _task_specs(tasks):
      missing = algorithms.missing_for(algorithm, task_spec.capabilities)
      rows.append(dict(algorithm=algorithm, task=task_spec.name,
                       runs=not missing, missing=missing))
  return rows


def _source(module: str) -> str:
  return module.replace('.', '/') + '.py'


def _test_of(module: str, root: str) -> str:
  """The module's own test file if it has one, else the conformance suite
  (which runs every registered algorithm)."""
  own = f'tests/{module.rsplit(".", 1)[-1]}_test.py'
  return own if os.path.exists(os.path.join(root, own)) else (
      'tests/conformance_test.py')


def format_matrix(links_from: str | None = None,
                  tasks: Sequence[str] = ()) -> str:
  """The matrix as a Markdown table ('yes', or 'no: ' what is missing).

  With `links_from` (the repository root), each algorithm and task name
  links to its code, and each algorithm to its test. `tasks`: outside
  tasks to add as columns (`matrix`).
  """
  cells = {(r['algorithm'], r['task']): r for r in matrix(tasks)}
  names = [s.name for s in _task_specs(tasks)]
  header = [f'[{t}]({_source(task_registry.spec(t).builder.__module__)})'
            if links_from
            else t for t in names]
  lines = ['| algorithm | ' + ' | '.join(header) + ' |',
           '|---|' + '---|' * len(names)]
  for algorithm, algorithm_spec in algorithms.SPECS.items():
    row = []
    for task in names:
      cell = cells[(algorithm, task)]
      row.append('yes' if cell['runs'] else
                 'no: ' + ', '.join(m.split(' (')[0] for m in cell['missing']))
    name = algorithm
    if links_from:
      module = algorithm_spec.module
      name = (f'[{algorithm}]({_source(module)}) '
              f'([test]({_test_of(module, links_from)}))')
    lines.append(f'| {name} | ' + ' | '.join(row) + ' |')
  return '\n'.join(lines)
