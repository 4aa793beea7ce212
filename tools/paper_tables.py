"""Generates the paper reports' result tables from committed results.

A reproduction (`binaries.reproduce`) appends one record per finished cell
to `<root>/results.jsonl`. The records behind the reports are committed as
`docs/results/<paper>.jsonl` (metrics and configs; no data), and each
report holds copies of its tables between marker comments:

  <!-- table fedembed 2: begin -->
  ... generated ...
  <!-- table: end -->

A marker names a paper and one of its `TABLES` (rendered by
`reporting.render_markdown`: mean ± std (n) over seeds, the paper's values,
what the seeds vary) or one of its `EXTRA_TABLES` (a paper's own layout,
e.g. FedEmbed's table 4 with every prevalence side by side).
`tests/docs_test.py` fails when a copy differs from what this module
produces.

Usage (from the repository root):

  # Add a root's records to the committed ones (the latest record of a
  # cell wins, as in `reporting`), then refresh every report's tables:
  python tools/paper_tables.py --add=fedembed:/tmp/repro/results.jsonl
  python tools/paper_tables.py --write
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(ROOT, 'docs', 'results')
REPORTS = os.path.join(ROOT, 'docs', 'papers')
# `<!-- table <paper> <table>: begin -->` ... `<!-- table: end -->`.
BLOCK = re.compile(
    r'(<!-- table (?P<paper>[a-z_]+) (?P<table>[A-Za-z0-9_]+): begin -->\n)'
    r'(?P<body>.*?)(<!-- table: end -->)', re.S)


def results_path(paper: str) -> str:
  return os.path.join(RESULTS_DIR, f'{paper}.jsonl')


def _papers() -> dict:
  if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
  from binaries import reproduce  # pylint: disable=g-import-not-at-top
  from tff_personal.reports import reporting  # pylint: disable=g-import-not-at-top
  del reproduce  # Registers the papers.
  return reporting.papers()


def render(paper: str, table: str) -> str:
  """The Markdown of `paper`'s `table` from its committed results.

  Raises:
    ValueError: for an unknown paper or table, or missing results.
  """
  from tff_personal.reports import reporting  # pylint: disable=g-import-not-at-top
  papers = _papers()
  if paper not in papers:
    raise ValueError(f'unknown paper {paper!r}; registered: {sorted(papers)}')
  module = papers[paper]
  path = results_path(paper)
  if not os.path.exists(path):
    raise ValueError(f'{path} is missing: add the records with '
                     f'`python tools/paper_tables.py --add={paper}:<root>/'
                     'results.jsonl`')
  results = reporting.ResultsFile(path)
  extra = getattr(module, 'EXTRA_TABLES', {})
  if table in module.TABLES:
    return reporting.render_markdown(results, module.TABLES[table])
  if table in extra:
    return extra[table](list(results.latest().values()))
  raise ValueError(f'{paper} has no table {table!r}; tables: '
                   f'{sorted(module.TABLES)}, extra: {sorted(extra)}')


def rewrite(text: str) -> str:
  """`text` with every marked table regenerated."""
  return BLOCK.sub(
      lambda m: (m.group(1) + render(m.group('paper'), m.group('table'))
                 + m.group(5)), text)


def stale_blocks(path: str) -> list[str]:
  """The marked tables of a report whose copy differs from `render`."""
  with open(path, encoding='utf-8') as f:
    text = f.read()
  return [f'{m.group("paper")} {m.group("table")}'
          for m in BLOCK.finditer(text)
          if m.group('body') != render(m.group('paper'), m.group('table'))]


# Reports outside docs/papers that hold generated tables.
OTHER_REPORTS = (os.path.join(ROOT, 'docs', 'benchmark_personalization.md'),)


def reports() -> list[str]:
  return sorted(glob.glob(os.path.join(REPORTS, '*.md'))) + [
      p for p in OTHER_REPORTS if os.path.exists(p)]


def add(paper: str, source: str) -> int:
  """Appends `source`'s records of `paper` that differ from the committed
  ones; returns how many were added."""
  from tff_personal.reports import reporting  # pylint: disable=g-import-not-at-top
  os.makedirs(RESULTS_DIR, exist_ok=True)
  target = results_path(paper)
  known = set()
  if os.path.exists(target):
    with open(target, encoding='utf-8') as f:
      known = {line.strip() for line in f if line.strip()}
  added = 0
  with open(target, 'a', encoding='utf-8') as out:
    for record in reporting.ResultsFile(source).records():
      if record['paper'] != paper:
        continue
      line = json.dumps(record, sort_keys=True)
      if line not in known:
        out.write(line + '\n')
        known.add(line)
        added += 1
  return added


def main(argv: list[str]) -> int:
  for arg in argv[1:]:
    if arg.startswith('--add='):
      paper, _, source = arg[len('--add='):].partition(':')
      print(f'{results_path(paper)}: {add(paper, source)} record(s) added')
  if '--write' in argv[1:]:
    for path in reports():
      with open(path, encoding='utf-8') as f:
        text = f.read()
      new = rewrite(text)
      if new != text:
        with open(path, 'w', encoding='utf-8') as f:
          f.write(new)
        print(f'{os.path.relpath(path, ROOT)} rewritten')
  elif not any(a.startswith('--add=') for a in argv[1:]):
    for path in reports():
      print(os.path.relpath(path, ROOT), stale_blocks(path) or 'up to date')
  return 0


if __name__ == '__main__':
  sys.exit(main(sys.argv))
