"""Paper reproduction: cells, the results file, tables next to the papers'.

A *cell* is one run of a paper's grid: (paper, method, setting, seed). Every
finished cell is appended to `<root_output_dir>/results.jsonl`, one JSON object
per line with keys `paper`, `method`, `setting` (an object), `seed`, `metrics`
(an object) and any extra keys (`seconds`, `finished_at`, `out_dir`). That file
is the only state: finished cells are skipped on restart and every table is
rebuilt from it.

A *paper module* (registered with `register_paper`) has:

  TABLES: dict[str, Table]                  # table name -> spec
  cells(table: str, flags) -> list[Cell]    # TABLES[table].cells(flags.seeds)
  run_cell(cell: Cell, flags, out_dir: str) -> dict[str, float]   # metrics
  define_flags() -> None                    # optional: its own absl flags
  EXTRA_TABLES: dict[str, records -> str]   # optional: its own layouts

`flags` is the binary's absl FLAGS (any object with attributes in tests).
`out_dir` is stable per cell, so a `run_cell` may resume a killed run there.
After every cell, `reproduce` rewrites the table and each `EXTRA_TABLES`
entry (`<root>/tables/<paper>/<name>.md`, from the latest records).

A paper's flags are named `<paper>_*`. Those, and the common knobs
(`COMMON_CONFIG_FLAGS`), shape results without being part of a cell's
identity, so each record also carries them as `config` (`run_config`), and a
run whose flags differ from those of results already in its table is refused
before anything runs (`config_conflicts`): one table never mixes cells made
under different flags unless asked to. A cell writes the config to its
`out_dir` when it starts, and an unfinished cell (killed, resumable) is never
resumed under other flags. Caches shared by cells should be keyed by
`config_digest(run_config(...))`. A module lists the flags that its
cells' settings already carry in an optional `SETTING_FLAGS`.

Nothing here needs TensorFlow or TFF.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import hashlib
import io
import json
import math
import os
import re
import time
from typing import (Any, Callable, Iterable, Mapping, Optional, Protocol,
                    Sequence, Union)

from tff_personal.core import atomic_io
from tff_personal.core import moved
from tff_personal.reports.paper_results import canonical_json  # pylint: disable=unused-import
from tff_personal.reports.paper_results import Cell
from tff_personal.reports.paper_results import jsonable
from tff_personal.reports.paper_results import latest_records
from tff_personal.reports.paper_results import metrics_for
from tff_personal.reports.paper_results import RECORD_KEYS  # pylint: disable=unused-import
from tff_personal.reports.paper_results import Results
from tff_personal.reports.paper_results import ResultsFile
from tff_personal.reports.paper_results import RUNS_DIRNAME  # pylint: disable=unused-import

RESULTS_FILENAME = 'results.jsonl'
TABLES_DIRNAME = 'tables'
MISSING = '—'
CONFIG_KEY = 'config'
CELL_CONFIG_FILENAME = 'config.json'  # In a cell's out_dir, when it starts.
COMMON_CONFIG_FLAGS = ('data_dir', 'rounds', 'clients_per_round', 'num_users',
                       'data_seed')

_NAME_RE = re.compile(r'^[A-Za-z0-9_.-]+$')
# The data sets beside the repository (`../shared/data`): the papers'
# default for `--data_dir`.
DEFAULT_DATA_DIR = os.path.normpath(os.path.join(
    os.path.dirname(os.path.abspath(__file__)), '..', '..', 'shared', 'data'))


def data_dir(flag_values) -> str:
  """`--data_dir` if given, else `DEFAULT_DATA_DIR`."""
  return getattr(flag_values, 'data_dir', None) or DEFAULT_DATA_DIR


def root_of(out_dir: str, required: bool = True) -> Optional[str]:
  """The root output directory of a cell's `out_dir`
  (`<root>/runs/<paper>/...`, as `reproduce` makes it).

  Raises ValueError naming `out_dir` when it is not under a `runs`
  directory, or returns None there with `required=False`.
  """
  root = os.path.abspath(out_dir)
  while os.path.basename(root) != RUNS_DIRNAME:
    if root == os.path.dirname(root):
      if required:
        raise ValueError(f'{out_dir} is not under a {RUNS_DIRNAME!r} '
                         'directory (<root>/runs/<paper>/...)')
      return None
    root = os.path.dirname(root)
  return os.path.dirname(root)


class ConfigError(ValueError):
  """A bad paper, table, filter or flag, detected before any cell runs."""


def setting_label(setting: Mapping[str, Any]) -> str:
  """Compact display of a setting, e.g. 'dp=none num_users=1000'."""
  if not setting:
    return '{}'
  return ' '.join(f'{k}={_display(setting[k])}' for k in sorted(setting))


def _display(value: Any) -> str:
  return value if isinstance(value, str) else json.dumps(value)


# -------------------------------------------------------------------- tables


@dataclasses.dataclass(frozen=True)
class Column:
  """A table column: a setting and its display name."""
  name: str
  setting: Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class Table:
  """Rows = methods, columns = settings, one metric; the paper's numbers.

  `paper_values[(method, column_name)]` is the paper's cell as printed (e.g.
  '0.88 ± 0.02'). Our values are multiplied by `scale` (e.g. 100 when the
  paper reports percent) and printed with `digits` decimals.
  """
  name: str
  paper: str
  metric: str
  methods: Sequence[str]
  columns: Sequence[Column]
  paper_values: Mapping[tuple[str, str], str] = dataclasses.field(
      default_factory=dict)
  title: str = ''
  digits: int = 2
  scale: float = 1.0
  notes: str = ''

  def __post_init__(self):
    object.__setattr__(self, 'methods', tuple(self.methods))
    object.__setattr__(self, 'columns', tuple(self.columns))
    if not _NAME_RE.match(self.name):
      raise ValueError(f'table name {self.name!r} must match '
                       f'{_NAME_RE.pattern}')
    for kind, names in (('method', self.methods),
                        ('column', [c.name for c in self.columns])):
      dup = sorted({n for n in names if list(names).count(n) > 1})
      if dup:
        raise ValueError(f'table {self.name!r}: duplicate {kind}s {dup}')
    settings = [canonical_json(jsonable(dict(c.setting)))
                for c in self.columns]
    if len(set(settings)) != len(settings):
      raise ValueError(f'table {self.name!r}: two columns have one setting')
    columns = {c.name for c in self.columns}
    for method, column in self.paper_values:
      if method not in self.methods or column not in columns:
        raise ValueError(f'table {self.name!r}: paper value for unknown '
                         f'(method, column) ({method!r}, {column!r})')

  def column_for(self, setting: Mapping[str, Any]) -> Optional[Column]:
    want = canonical_json(jsonable(dict(setting)))
    for c in self.columns:
      if canonical_json(jsonable(dict(c.setting))) == want:
        return c
    return None

  def cells(self, seeds: int) -> list[Cell]:
    """Every (method, column, seed in range(seeds)) cell, row by row."""
    return [Cell(self.paper, m, c.setting, s)
            for m in self.methods for c in self.columns for s in range(seeds)]


@dataclasses.dataclass(frozen=True)
class Summary:
  n: int
  mean: float
  std: float  # Sample std (ddof=1); 0 for n=1.


def summarize(values: Sequence[float]) -> Optional[Summary]:
  values = [float(v) for v in values]
  n = len(values)
  if not n:
    return None
  mean = math.fsum(values) / n
  std = (math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
         if n > 1 else 0.0)
  return Summary(n, mean, std)


def _cell_summaries(records, table: Table):
  out = {}
  for method in table.methods:
    for column in table.columns:
      metrics = metrics_for(records, table.paper, method, column.setting)
      values = [m[table.metric] * table.scale for m in metrics
                if isinstance(m.get(table.metric), (int, float))]
      out[(method, column.name)] = summarize(values)
  return out


def _seed_note(records, table: Table) -> str:
  """' What the seeds vary: ...' for the table's records ('' if none).

  A record without `--data_seed` drew its data with its own seed, so seed
  0 run before `--data_seed=0` existed has the same data as seeds run with
  it.
  """
  given, drawn = set(), set()
  for r in records:
    if (r.get('paper') == table.paper and r['method'] in table.methods
        and table.column_for(r['setting']) is not None):
      config = r.get(CONFIG_KEY)
      value = (config.get('data_seed') if isinstance(config, Mapping)
               else None)
      given.add(value)
      drawn.add(r['seed'] if value is None else value)
  if not given:
    return ''
  if given == {None}:
    return (' What the seeds vary: the data (users and samples drawn by the '
            'seed) and training.')
  if len(drawn) == 1:
    (k,) = drawn
    return (' What the seeds vary: training only (initialization, cohorts, '
            f'DP noise); every seed has the data of seed {k} '
            f'(`--data_seed={k}`).')
  labels = sorted('their own seed' if v is None else f'seed {v}'
                  for v in given)
  return (' What the seeds vary: mixed; the records draw their data with '
          + ', '.join(labels) + ' (`--data_seed`).')


# Means at or above this magnitude (e.g. the perplexity of a diverged model)
# print in scientific notation, not as a hundred digits.
_SCIENTIFIC_FROM = 1e6


def _number(x: float, digits: int, scientific: bool) -> str:
  return f'{x:.{max(digits, 2)}e}' if scientific else f'{x:.{digits}f}'


def _fmt(s: Optional[Summary], digits: int) -> str:
  if s is None:
    return MISSING
  scientific = abs(s.mean) >= _SCIENTIFIC_FROM
  return (f'{_number(s.mean, digits, scientific)} ± '
          f'{_number(s.std, digits, scientific)} ({s.n})')


def paper_rows(text: str) -> dict[str, tuple[str, ...]]:
  """A paper's table as printed: `{method: (value, ...)}`, one row a line.

  Args:
    text: lines of `method | value | value ...`; blank lines are skipped.

  Returns:
    Each row's values as texts, in order.

  Example:
    paper_rows('''
        fedrep | 0.78 ± 0.02 | 0.51 ± 0.02
        global | 0.40 ± 0.02 | 0.38 ± 0.06''')['global'][1]  # '0.38 ± 0.06'
  """
  rows = {}
  for line in text.strip().splitlines():
    if line.strip():
      method, *values = [v.strip() for v in line.split('|')]
      rows[method] = tuple(values)
  return rows


def render_markdown(results: Results, table: Table) -> str:
  """A markdown table: per column, our 'mean ± std (n)' and the paper's
  (only ours when the table has no paper values, e.g. a control)."""
  records = latest_records(results)
  summaries = _cell_summaries(records, table)
  title = table.title or f'{table.paper} {table.name}'
  scale = f' × {table.scale:g}' if table.scale != 1 else ''
  lines = [f'### {title}', '', f'Metric: `{table.metric}`{scale}.', '']
  with_paper = bool(table.paper_values)
  header = ['method']
  for c in table.columns:
    header += ([f'{c.name} (ours)', f'{c.name} (paper)'] if with_paper else
               [c.name])
  lines.append('| ' + ' | '.join(header) + ' |')
  lines.append('|' + '|'.join(['---'] + ['---:'] * (len(header) - 1)) + '|')
  for m in table.methods:
    row = [m]
    for c in table.columns:
      row.append(_fmt(summaries[(m, c.name)], table.digits))
      if with_paper:
        row.append(table.paper_values.get((m, c.name), MISSING))
    lines.append('| ' + ' | '.join(row) + ' |')
  lines += ['', 'ours: mean ± sample standard deviation (ddof=1) over seeds, '
            '(n) seeds; the std is 0 when n=1. ' +
            ('paper: as reported. ' if with_paper else '') +
            f'{MISSING}: not run yet' + (' / not reported.' if with_paper
                                         else '.') + _seed_note(records, table)]
  if table.notes:
    lines += ['', table.notes]
  return '\n'.join(lines) + '\n'


CSV_FIELDS = ('method', 'column', 'setting', 'metric', 'n', 'mean', 'std',
              'ours', 'paper')


def render_csv(results: Results, table: Table) -> str:
  """One row per (method, column): n, mean, std (scaled), ours, paper."""
  summaries = _cell_summaries(latest_records(results), table)
  buf = io.StringIO()
  writer = csv.writer(buf, lineterminator='\n')
  writer.writerow(CSV_FIELDS)
  for m in table.methods:
    for c in table.columns:
      s = summaries[(m, c.name)]
      writer.writerow([
          m, c.name, canonical_json(jsonable(dict(c.setting))), table.metric,
          s.n if s else 0, repr(s.mean) if s else '', repr(s.std) if s else '',
          _fmt(s, table.digits), table.paper_values.get((m, c.name), '')])
  return buf.getvalue()


def _write_atomic(path: str, text: str):
  with atomic_io.atomic_write(path) as f:
    f.write(text)


def write_tables(results: Results, tables: Union[Mapping[str, Table],
                                                 Iterable[Table]],
                 out_dir: str) -> list[str]:
  """Writes <name>.md and <name>.csv per table atomically; returns the paths."""
  if isinstance(tables, Mapping):
    tables = tables.values()
  records = latest_records(results)
  paths = []
  for table in tables:
    for ext, render in (('md', render_markdown), ('csv', render_csv)):
      path = os.path.join(out_dir, f'{table.name}.{ext}')
      _write_atomic(path, render(records, table))
      paths.append(path)
  return paths


def write_extra_tables(results: Results, module: Any,
                       out_dir: str) -> list[str]:
  """Writes a paper's `EXTRA_TABLES` (its own layouts) as <name>.md.

  Args:
    results: the results (a `ResultsFile` or records).
    module: the paper module; `EXTRA_TABLES` maps a name to a function of
      the latest records that returns Markdown (absent: nothing written).
    out_dir: the paper's tables directory.

  Returns:
    The paths written.
  """
  extra = getattr(module, 'EXTRA_TABLES', None) or {}
  records = latest_records(results) if extra else []
  paths = []
  for name, render in extra.items():
    path = os.path.join(out_dir, f'{name}.md')
    _write_atomic(path, render(records))
    paths.append(path)
  return paths


def render_epsilons(records: Iterable[Mapping[str, Any]], paper: str) -> str:
  """A Markdown table of the exact (epsilon, delta) of every DP cell of
  `paper` (the records whose metrics have an `epsilon`), with its noise
  multiplier and clip."""
  lines = ['| method | setting | seed | epsilon | delta | noise multiplier '
           '| clip |', '|---|---|---:|---:|---:|---:|---:|']
  for r in sorted(records, key=lambda r: (r['method'], json.dumps(
      r['setting'], sort_keys=True), r['seed'])):
    m = r['metrics']
    if r['paper'] == paper and 'epsilon' in m:
      lines.append(f'| {r["method"]} | {setting_label(r["setting"])}'
                   f' | {r["seed"]} | {m["epsilon"]:.3f} | {m["delta"]:.3g} | '
                   f'{m["noise_multiplier"]:.4f} | {m["clip_norm"]:g} |')
  return '\n'.join(lines) + '\n'


# ------------------------------------------------------------------ registry


class PaperModule(Protocol):
  TABLES: Mapping[str, Table]

  def cells(self, table: str, flags: Any) -> list[Cell]:
    ...

  def run_cell(self, cell: Cell, flags: Any, out_dir: str) -> dict:
    ...


_PAPERS: dict[str, Any] = {}


def register_paper(name: str, module: Any) -> None:
  """Registers a paper module (see the module docstring for its interface)."""
  for attr in ('TABLES', 'cells', 'run_cell'):
    if not hasattr(module, attr):
      raise TypeError(f'paper module for {name!r} has no {attr!r}')
  for key, table in module.TABLES.items():
    if not isinstance(table, Table) or table.name != key or table.paper != name:
      raise TypeError(f'paper {name!r}: TABLES[{key!r}] must be a Table with '
                      f'name {key!r} and paper {name!r}')
  if name in _PAPERS and _PAPERS[name] is not module:
    raise ValueError(f'paper {name!r} is already registered')
  _PAPERS[name] = module


def unregister_paper(name: str) -> None:
  _PAPERS.pop(name, None)


def papers() -> dict[str, Any]:
  return dict(_PAPERS)


def get_paper(name: str) -> Any:
  if name not in _PAPERS:
    raise ConfigError(f'unknown --paper={name!r}; registered: '
                      f'{sorted(_PAPERS) or "none"}')
  return _PAPERS[name]


# ------------------------------------------------------- run configuration


def define_flags(*definitions: tuple) -> None:
  """Defines a paper's absl flags, each once (several papers share a binary).

  Args:
    *definitions: `(kind, name, default, help)`, kind an absl `DEFINE_<kind>`
      suffix ('integer', 'float', 'string', 'bool', 'list'), or
      `('enum', name, default, help, values)`.

  Example:
    reporting.define_flags(
        ('integer', 'mypaper_rounds', 10, 'MyPaper: rounds.'),
        ('enum', 'mypaper_mode', 'a', 'MyPaper: mode.', ('a', 'b')))
  """
  from absl import flags  # pylint: disable=g-import-not-at-top
  for kind, name, default, help_text, *values in definitions:
    if name in flags.FLAGS:
      continue
    if kind == 'enum':
      flags.DEFINE_enum(name, default, list(values[0]), help_text)
    else:
      getattr(flags, f'DEFINE_{kind}')(name, default, help_text)



def _flag_names(flag_values: Any) -> list[str]:
  """Flag names of absl FlagValues, or attribute names of a namespace."""
  try:
    return list(flag_values)  # absl FlagValues iterates over its names.
  except TypeError:
    return list(vars(flag_values))


def data_seed(flag_values: Any, seed: int) -> int:
  """The seed that draws a cell's data: `--data_seed` if set, else `seed`.

  A cell's seed varies both its data (which users, which samples, which
  splits) and its training (initialization, cohorts, DP noise). With
  `--data_seed` set, every seed of a table trains on the same data and only
  training varies; the tables say which (`render_markdown`). Papers call
  this wherever they build data and pass the cell's own seed to training.

  Args:
    flag_values: The binary's flags (or a namespace); `data_seed` may be
      absent or None.
    seed: The cell's seed.

  Returns:
    The data seed.

  Example:
    task = build_task(..., seed=reporting.data_seed(flags, cell.seed))
  """
  value = getattr(flag_values, 'data_seed', None)
  if value is None:
    return seed
  if isinstance(value, bool) or not isinstance(value, int) or value < 0:
    raise ConfigError(f'--data_seed must be a non-negative integer, got '
                      f'{value!r}')
  return value


def _config_value(value: Any) -> Any:
  if isinstance(value, str) and value and os.path.exists(value):
    return os.path.realpath(value)  # One data set, however it was named.
  return jsonable(value)


def run_config(paper: str, module: Any, flag_values: Any) -> dict[str, Any]:
  """The flags that shape `paper`'s results beyond its cells' settings.

  Every flag named `<paper>_*` (but not those of another registered paper
  named `<paper>_<more>`) and the `COMMON_CONFIG_FLAGS`, less the module's
  `SETTING_FLAGS` (in the cells' settings) and `OPERATIONAL_FLAGS` (how a
  run is carried out, e.g. its checkpoint interval, not what it computes); paths that exist are resolved, so the same data reached by
  another relative path is the same configuration.
  """
  skip = (set(getattr(module, 'SETTING_FLAGS', ()))
          | set(getattr(module, 'OPERATIONAL_FLAGS', ())))
  # Another registered paper named `<paper>_...` owns its own flags.
  longer = [f'{p}_' for p in _PAPERS if p.startswith(f'{paper}_')]
  names = [n for n in _flag_names(flag_values)
           if (n.startswith(f'{paper}_') or n in COMMON_CONFIG_FLAGS)
           and n not in skip and not any(n.startswith(p) for p in longer)]
  return {n: _config_value(getattr(flag_values, n)) for n in sorted(names)}


def config_conflicts(records: Iterable[Mapping[str, Any]], table: 'Table',
                     config: Mapping[str, Any], limit: int = 5) -> list[str]:
  """How `config` differs from the configs of the table's recorded cells.

  Records without a config (made before configs were recorded) and flags
  that one side lacks (defined later) are not compared. Returns one line per
  differing flag, naming a record that has the other value.
  """
  lines, seen = [], set()
  for r in records:
    old = r.get(CONFIG_KEY)
    if (not isinstance(old, Mapping) or r['method'] not in table.methods
        or table.column_for(r['setting']) is None):
      continue
    for name in sorted(set(old) & set(config)):
      if name in seen or (canonical_json(old[name])
                          == canonical_json(jsonable(config[name]))):
        continue
      seen.add(name)
      lines.append(f'--{name}: {old[name]!r} in the recorded cell '
                   f'{r["method"]} {setting_label(r["setting"])} seed '
                   f'{r["seed"]}, {config[name]!r} now')
  return lines[:limit] + ([f'... and {len(lines) - limit} more']
                          if len(lines) > limit else [])


def config_digest(config: Mapping[str, Any]) -> str:
  """A short name for a configuration (e.g. for caches shared by cells)."""
  return hashlib.sha1(
      canonical_json(jsonable(dict(config))).encode()).hexdigest()[:12]


def _partial_run_conflicts(cells: Sequence[Cell], root_output_dir: str,
                           config: Mapping[str, Any]) -> list[str]:
  """Unfinished cells whose out_dir holds a start made with other flags."""
  lines = []
  for cell in cells:
    path = os.path.join(cell.out_dir(root_output_dir), CELL_CONFIG_FILENAME)
    if not os.path.exists(path):
      continue
    try:
      with open(path, encoding='utf-8') as f:
        old = json.load(f)
    except (OSError, ValueError) as e:
      lines.append(f'{path}: unreadable ({e})')
      continue
    names = sorted(n for n in set(old) & set(config)
                   if canonical_json(old[n])
                   != canonical_json(jsonable(config[n])))
    if names:
      lines.append(f'{cell.method} {setting_label(cell.setting)} seed '
                   f'{cell.seed} ({os.path.dirname(path)}): started with ' +
                   ', '.join(f'--{n}={old[n]!r}' for n in names))
  return lines


# ---------------------------------------------------------------- the loop


@dataclasses.dataclass
class Plan:
  paper: str
  module: Any
  table: Table
  cells: list[Cell]    # Every selected cell.
  pending: list[Cell]  # Those not in results.jsonl yet.
  results: ResultsFile
  tables_dir: str
  config: dict = dataclasses.field(default_factory=dict)


def _filter_settings(cells: list[Cell], table: Table,
                     settings: Sequence[str]) -> list[Cell]:
  """Keeps cells matching any named column and every key=value condition."""
  names = [s for s in settings if '=' not in s]
  conditions = [s.split('=', 1) for s in settings if '=' in s]
  columns = {c.name: c for c in table.columns}
  unknown = [n for n in names if n not in columns]
  if unknown:
    raise ConfigError(f'unknown --settings {unknown} for table '
                      f'{table.name!r}; columns: {list(columns)} '
                      '(or key=value)')
  wanted = {canonical_json(jsonable(dict(columns[n].setting))) for n in names}

  def keep(cell):
    if wanted and canonical_json(cell.setting) not in wanted:
      return False
    for k, v in conditions:
      if k not in cell.setting:
        return False
      if v != _display(cell.setting[k]):
        return False
    return True

  return [c for c in cells if keep(c)]


def plan(paper: str, table: Optional[str], root_output_dir: Optional[str],
         flag_values: Any, seeds: int = 1,
         methods: Optional[Sequence[str]] = None,
         settings: Optional[Sequence[str]] = None,
         allow_config_change: bool = False, first_seed: int = 0) -> Plan:
  """Resolves paper, table, filters and pending cells; raises ConfigError.

  The cells are those of seeds `first_seed .. seeds - 1` (e.g. seeds=5,
  first_seed=2 adds seeds 2 to 4 to a root, or starts a root with them, as
  another machine runs seeds 0 and 1 elsewhere).

  Also refuses flags that differ from those of the table's recorded cells
  (`config_conflicts`) unless `allow_config_change`.
  """
  module = get_paper(paper)
  tables = module.TABLES
  if table is None:
    if len(tables) != 1:
      raise ConfigError(f'--table is required for paper {paper!r}; tables: '
                        f'{sorted(tables)}')
    table = next(iter(tables))
  if table not in tables:
    raise ConfigError(f'unknown --table={table!r} for paper {paper!r}; '
                      f'tables: {sorted(tables)}')
  spec = tables[table]
  if not root_output_dir:
    raise ConfigError('--root_output_dir is required')
  if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
    raise ConfigError(f'--seeds must be a positive integer, got {seeds!r}')
  if (isinstance(first_seed, bool) or not isinstance(first_seed, int)
      or not 0 <= first_seed < seeds):
    raise ConfigError(f'--first_seed must be an integer in [0, --seeds={seeds}'
                      f'), got {first_seed!r}')
  if methods:
    unknown = [m for m in methods if m not in spec.methods]
    if unknown:
      raise ConfigError(f'unknown --methods {unknown} for table {table!r}; '
                        f'methods: {list(spec.methods)}')
  try:
    cells = list(module.cells(table, flag_values))
  except ValueError as e:  # The paper module validates its flags here.
    raise ConfigError(str(e)) from e
  for c in cells:
    if not isinstance(c, Cell) or c.paper != paper:
      raise ConfigError(f'paper {paper!r}: cells() returned {c!r}')
  # cells() may rebuild the tables from the flags (e.g. columns carrying the
  # rounds run, or a variant's columns): use the table as it now stands.
  spec = module.TABLES.get(table, spec)
  cells = [c for c in cells if first_seed <= c.seed < seeds]
  if methods:
    cells = [c for c in cells if c.method in methods]
  if settings:
    cells = _filter_settings(cells, spec, settings)
  cells = list(dict.fromkeys(cells))  # Drops duplicates, keeps the order.
  results = ResultsFile(os.path.join(root_output_dir, RESULTS_FILENAME))
  latest = results.latest()
  config = run_config(paper, module, flag_values)
  conflicts = config_conflicts(
      [r for r in latest.values() if r['paper'] == paper], spec, config)
  if conflicts and not allow_config_change:
    raise ConfigError(
        f'{results.path} holds {paper} table {table!r} cells made with other '
        'flags:\n  ' + '\n  '.join(conflicts) + '\nA table would mix the two '
        'configurations (finished cells are not rerun). Use another '
        '--root_output_dir, or --allow_config_change to mix them on purpose '
        '(each record keeps its own config).')
  pending = [c for c in cells if c.key() not in latest]
  partial = _partial_run_conflicts(pending, root_output_dir, config)
  if partial:
    raise ConfigError(
        'unfinished cells were started with other flags and would resume '
        'from what they saved:\n  ' + '\n  '.join(partial) + '\nRerun '
        'with those flags, or delete those directories to start the cells '
        'over (--allow_config_change does not cover this).')
  return Plan(paper, module, spec, cells, pending, results,
              os.path.join(root_output_dir, TABLES_DIRNAME, paper), config)


def _fmt_metrics(metrics: Mapping[str, Any]) -> str:
  return ', '.join(f'{k}={v:.4g}' if isinstance(v, float) else f'{k}={v}'
                   for k, v in sorted(metrics.items()))


def _cell_label(cell: Cell, table: Table) -> str:
  column = table.column_for(cell.setting)
  label = column.name if column else setting_label(cell.setting)
  return f'{cell.method} {label} seed={cell.seed}'


def reproduce(p: Plan, flag_values: Any, root_output_dir: str,
              dry_run: bool = False,
              log_fn: Callable[[str], None] = print) -> str:
  """Runs the plan's pending cells; returns the table's markdown.

  After each cell: append to results.jsonl, rewrite the table
  (<root>/tables/<paper>/<table>.{md,csv}), print progress; at the end,
  every table of the paper. A cell that raises
  stops the loop (finished cells stay recorded; rerun to continue).
  """
  done = len(p.cells) - len(p.pending)
  log_fn(f'{p.paper}/{p.table.name}: {len(p.cells)} cells, {done} already in '
         f'{p.results.path}, {len(p.pending)} to run.')
  if dry_run:
    for i, cell in enumerate(p.pending, 1):
      log_fn(f'[{i}/{len(p.pending)}] would run {_cell_label(cell, p.table)} '
             f'-> {cell.out_dir(root_output_dir)}')
    markdown = render_markdown(p.results, p.table)
    log_fn(markdown)
    return markdown
  for i, cell in enumerate(p.pending, 1):
    out_dir = cell.out_dir(root_output_dir)
    os.makedirs(out_dir, exist_ok=True)
    _write_atomic(os.path.join(out_dir, CELL_CONFIG_FILENAME),
                  json.dumps(p.config, sort_keys=True, indent=1))
    start = time.perf_counter()
    metrics = p.module.run_cell(cell, flag_values, out_dir)
    seconds = time.perf_counter() - start
    if not isinstance(metrics, Mapping):
      raise TypeError(f'{p.paper}.run_cell returned {type(metrics).__name__}, '
                      'not a dict of metrics')
    p.results.append(cell, metrics, extra={
        CONFIG_KEY: p.config,
        'seconds': round(seconds, 3), 'out_dir': out_dir,
        'finished_at': datetime.datetime.now(
            datetime.timezone.utc).isoformat(timespec='seconds')})
    write_tables(p.results, [p.table], p.tables_dir)
    write_extra_tables(p.results, p.module, p.tables_dir)
    log_fn(f'[{i}/{len(p.pending)}] {_cell_label(cell, p.table)} -> '
           f'{_fmt_metrics(metrics)} ({seconds:.1f} s)')
  write_tables(p.results, p.module.TABLES, p.tables_dir)
  write_extra_tables(p.results, p.module, p.tables_dir)
  markdown = render_markdown(p.results, p.table)
  log_fn(markdown)
  return markdown


# Names that moved away raise an error naming their new place.
__getattr__ = moved.module_getattr(__name__)
