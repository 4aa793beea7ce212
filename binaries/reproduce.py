r"""Reproduces a paper's table: runs its cells, records them, prints tables.

  python -m binaries.reproduce --paper=fedembed --table=table2 \
    --root_output_dir=/tmp/repro --seeds=3 [--first_seed=1] \
    [--methods=a,b] [--settings=...] \
    [--data_dir=../shared/data/mnist --rounds=... --dry_run]

Every finished cell is appended to <root_output_dir>/results.jsonl with the
paper's flags (`config`); a rerun skips the finished cells, so kill it at any
moment and rerun the same command. A run with other paper flags than the
table's recorded cells is refused (exit 2) unless --allow_config_change.
Tables (ours next to the paper's numbers) are rewritten after every cell to
<root_output_dir>/tables/<paper>/<table>.{md,csv} and printed at the end.
Per-cell outputs: <root_output_dir>/runs/<paper>/<method>/<setting>/seed_<n>.

Papers are registered below with `reporting.register_paper(name, module)`;
see `tff_personal/reports/reporting.py` for what a paper module provides.
"""

import sys
from typing import Any, Callable, Optional

from absl import app
from absl import flags
from absl import logging
import tensorflow as tf

from tff_personal.core import runtime
from tff_personal.reports import reporting

FLAGS = flags.FLAGS

# Paper modules. Each paper issue adds its registration here.
from papers import benchmark  # pylint: disable=g-import-not-at-top,g-bad-import-order
from papers import benchmark_tuned  # pylint: disable=g-import-not-at-top,g-bad-import-order
from papers import feddva  # pylint: disable=g-import-not-at-top,g-bad-import-order
from papers import fedembed  # pylint: disable=g-import-not-at-top,g-bad-import-order
from papers import fedperc  # pylint: disable=g-import-not-at-top,g-bad-import-order
from papers import furl  # pylint: disable=g-import-not-at-top,g-bad-import-order
from papers import group  # pylint: disable=g-import-not-at-top,g-bad-import-order

reporting.register_paper('benchmark', benchmark)
reporting.register_paper('benchmark_tuned', benchmark_tuned)
reporting.register_paper('furl', furl)
reporting.register_paper('feddva', feddva)
reporting.register_paper('fedembed', fedembed)
reporting.register_paper('fedperc', fedperc)
reporting.register_paper('group', group)


def _define(kind: str, name: str, default: Any, help_text: str):
  """Defines a flag unless another binary in this process already did."""
  if name not in FLAGS:
    getattr(flags, f'DEFINE_{kind}')(name, default, help_text)


def define_flags():
  """Defines the registered papers' own flags, then the binary's.

  Papers go first so that a paper which defines one of the common flags
  itself (or through binaries.common) keeps its definition.
  """
  for module in reporting.papers().values():
    if hasattr(module, 'define_flags'):
      module.define_flags()
  _define('string', 'paper', None, 'Registered paper to reproduce.')
  _define('string', 'table', None,
          'Table of the paper (optional when it has only one).')
  _define('string', 'root_output_dir', None,
          'Holds results.jsonl, tables/ and runs/.')
  _define('integer', 'seeds', 1, 'Number of seeds: 0..n-1.')
  _define('integer', 'first_seed', 0,
          'Run only seeds first_seed..seeds-1 (the table still shows every '
          'seed recorded in the root).')
  _define('list', 'methods', None,
          'Comma-separated methods to run (default: all of the table).')
  _define('list', 'settings', None,
          'Comma-separated table column names and/or key=value conditions '
          '(default: every setting).')
  _define('list', 'workers', [],
          'host:port of running TFF workers (`python -m binaries.worker`) '
          'to run every cell on; empty: a local worker. Results do not '
          'depend on it.')
  _define('bool', 'dry_run', False,
          'Print the cells that would run and the table from existing '
          'results; run nothing.')
  _define('bool', 'allow_config_change', False,
          "Run even if the root's recorded cells of this table were made "
          'with other paper flags (the table then mixes configurations; '
          'each record keeps its own `config`).')
  # Common per-paper knobs; None means "the paper module's default".
  _define('string', 'data_dir', None, 'Data directory (None: paper default).')
  _define('integer', 'rounds', None, 'Training rounds (None: paper default).')
  _define('integer', 'clients_per_round', None,
          'Cohort size (None: paper default).')
  _define('integer', 'num_users', None, 'Population (None: paper default).')
  _define('integer', 'data_seed', None,
          'Seed of every cell\'s data (users, samples, splits). None: each '
          'cell draws its data with its own seed. Set it to vary only '
          'training across --seeds; the tables say which varies.')


def run(f: Any, log_fn: Callable[[str], None] = print) -> int:
  """Plans (validating everything first), then runs; returns the exit code."""
  try:
    workers = getattr(f, 'workers', None) or []
    workers = runtime.parse_workers(workers) if workers else []
  except ValueError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  try:
    plan = reporting.plan(
        f.paper, f.table, f.root_output_dir, f, seeds=f.seeds,
        methods=_as_list(f.methods), settings=_as_list(f.settings),
        allow_config_change=bool(getattr(f, 'allow_config_change', False)),
        first_seed=getattr(f, 'first_seed', 0))
  except reporting.ConfigError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  with runtime.default_workers(workers):
    reporting.reproduce(plan, f, f.root_output_dir, dry_run=f.dry_run,
                        log_fn=log_fn)
  return 0


def _as_list(value) -> Optional[list[str]]:
  if value is None:
    return None
  if isinstance(value, str):
    value = value.split(',')
  return [v.strip() for v in value if v.strip()] or None


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if not FLAGS['verbosity'].present:  # checkpoint INFO lines drown progress
    logging.set_verbosity(logging.WARNING)
    tf.get_logger().setLevel('ERROR')
  return run(FLAGS, log_fn=lambda s: print(s, flush=True))


if __name__ == '__main__':
  define_flags()
  app.run(main)
