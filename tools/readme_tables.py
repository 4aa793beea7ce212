"""Generates the README's algorithm x task matrix and results table.

The README holds copies of both tables between marker comments:

  <!-- matrix:begin --> ... <!-- matrix:end -->
  <!-- results:begin --> ... <!-- results:end -->
  <!-- performance:begin --> ... <!-- performance:end -->

The matrix comes from `tasks.registry.format_matrix()` (each algorithm
and task linked to its code, each algorithm to its test); the results table
from `docs/papers/targets.json` (one entry per paper target: paper, target,
ours, paper_value, met, report); the performance summary from the committed
benchmark runs in `docs/benchmark/`
(`binaries/benchmark_report.readme_markdown`). `tests/docs_test.py` fails when the
README's copies differ from what this module produces.

Usage (from the repository root):

  python tools/readme_tables.py           # prints both tables
  python tools/readme_tables.py --write   # rewrites them in README.md
"""

from __future__ import annotations

import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, 'README.md')
TARGETS = os.path.join(ROOT, 'docs', 'papers', 'targets.json')
# The committed benchmark runs (each `binaries.benchmark`'s
# benchmark_run.json, ratios within a run) and the parts of each the README
# shows (`benchmark_report.README_PARTS`): the systems, the family rows,
# and the whole loop at population scale.
BENCHMARK_RUNS = tuple(
    (os.path.join(ROOT, 'docs', 'benchmark', name), parts)
    for name, parts in (('inprocess_run.json', ('systems',)),
                        ('systems_run.json', ('families',)),
                        ('scale_run.json', ('scale',))))

MET_LABELS = {True: 'met', False: 'not met', 'partly': 'partly'}
SECTIONS = ('matrix', 'results', 'performance')


def matrix_markdown() -> str:
  """The algorithm x task matrix (Markdown), from the two registries."""
  if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
  from tff_personal.config import matrix  # pylint: disable=g-import-not-at-top
  return matrix.format_matrix(links_from=ROOT)


def load_targets(path: str = TARGETS) -> list[dict]:
  """The committed targets, checked for the fields the table needs."""
  with open(path) as f:
    targets = json.load(f)
  keys = {'paper', 'target', 'ours', 'paper_value', 'met', 'report'}
  for i, t in enumerate(targets):
    missing = keys - set(t)
    if missing:
      raise ValueError(f'{path}: entry {i} lacks {sorted(missing)}')
    if t['met'] not in MET_LABELS:
      raise ValueError(f'{path}: entry {i}: met must be true, false or '
                       f'"partly", got {t["met"]!r}')
  return targets


def _cell(text) -> str:
  return str(text).replace('|', '\\|').replace('\n', ' ')


def results_markdown(path: str = TARGETS) -> str:
  """One row per paper target: ours, the paper's, met, the report."""
  lines = ['| paper | target | ours | paper | met | report |',
           '|---|---|---|---|---|---|']
  for t in load_targets(path):
    report = t['report']
    label = report.split('/')[-1].split('#')[0]
    lines.append('| ' + ' | '.join([
        _cell(t['paper']), _cell(t['target']), _cell(t['ours']),
        _cell(t['paper_value']), MET_LABELS[t['met']],
        f'[{label}]({report})']) + ' |')
  return '\n'.join(lines)


def _pattern(name: str) -> re.Pattern:
  return re.compile(rf'(<!-- {name}:begin -->\n)(.*?)(<!-- {name}:end -->)',
                    re.S)


def readme_section(text: str, name: str) -> str:
  """The README's copy of a generated section (without the markers)."""
  match = _pattern(name).search(text)
  if match is None:
    raise ValueError(f'README has no <!-- {name}:begin/end --> markers')
  return match.group(2).strip('\n')


def performance_markdown(paths=BENCHMARK_RUNS) -> str:
  """The benchmark summaries of the committed runs."""
  if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
  from binaries import benchmark_report  # pylint: disable=g-import-not-at-top
  parts, machines = [], set()
  for path, shown in paths:
    with open(path) as f:
      run = json.load(f)
    parts.append(benchmark_report.readme_markdown(run, shown).strip('\n'))
    machines.add(benchmark_report.machine(run))
  return '\n\n'.join(parts + [f"Machine: {', '.join(sorted(machines))}."])


def generated() -> dict[str, str]:
  return {'matrix': matrix_markdown(), 'results': results_markdown(),
          'performance': performance_markdown()}


def rewrite(text: str, tables: dict[str, str]) -> str:
  """`text` with each marked section replaced by its table."""
  for name, table in tables.items():
    if _pattern(name).search(text) is None:
      raise ValueError(f'README has no <!-- {name}:begin/end --> markers')
    text = _pattern(name).sub(
        lambda m, table=table: m.group(1) + table + '\n' + m.group(3), text)
  return text


def main(argv: list[str]) -> int:
  tables = generated()
  if '--write' in argv[1:]:
    with open(README) as f:
      text = f.read()
    new = rewrite(text, tables)
    if new != text:
      with open(README, 'w') as f:
        f.write(new)
    print('README.md', 'rewritten' if new != text else 'unchanged')
  else:
    for name in SECTIONS:
      print(f'<!-- {name} -->\n{tables[name]}\n')
  return 0


if __name__ == '__main__':
  sys.exit(main(sys.argv))
