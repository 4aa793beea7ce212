"""A paper's cells and its results file (`results.jsonl`).

A *cell* is one run of a paper's grid: (paper, method, setting, seed), its
identity the canonical JSON of the four. `ResultsFile` is the append-only
file of finished cells that `tff_personal.reports.reporting` plans, skips and
builds tables from; `reporting` re-exports everything here.

Example:
  results = ResultsFile('/tmp/out/results.jsonl')
  cell = Cell(paper='furl', method='fl', setting={'dp': 'none'}, seed=0)
  results.append(cell, {'accuracy': 0.9})
  results.metrics_for('furl', 'fl', {'dp': 'none'})   # [{'accuracy': 0.9}]

Nothing here needs TensorFlow or TFF.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
from typing import Any, Iterable, Mapping, Optional, Union

RUNS_DIRNAME = 'runs'
RECORD_KEYS = ('paper', 'method', 'setting', 'seed', 'metrics')

def canonical_json(value: Any) -> str:
  """Sorted-key, compact JSON: the identity of settings and cells."""
  return json.dumps(value, sort_keys=True, separators=(',', ':'),
                    allow_nan=False)


def jsonable(value: Any) -> Any:
  """Converts numpy scalars/arrays (anything with .item()/.tolist()) to JSON."""
  if isinstance(value, Mapping):
    return {str(k): jsonable(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [jsonable(v) for v in value]
  if isinstance(value, (str, int, float, bool)) or value is None:
    return value
  if hasattr(value, 'tolist'):  # numpy arrays and scalars.
    return jsonable(value.tolist())
  if hasattr(value, 'item'):
    return value.item()
  raise TypeError(f'not JSON-serializable: {value!r} '
                  f'({type(value).__name__})')


# --------------------------------------------------------------------- cells


@dataclasses.dataclass(frozen=True, eq=False)
class Cell:
  """One run of a paper's grid. Identity is `key()` (canonical JSON)."""
  paper: str
  method: str
  setting: Mapping[str, Any]
  seed: int

  def __post_init__(self):
    if not isinstance(self.paper, str) or not self.paper:
      raise ValueError(f'Cell.paper must be a non-empty string, got '
                       f'{self.paper!r}')
    if not isinstance(self.method, str) or not self.method:
      raise ValueError(f'Cell.method must be a non-empty string, got '
                       f'{self.method!r}')
    if isinstance(self.seed, bool) or not isinstance(self.seed, int):
      raise ValueError(f'Cell.seed must be an int, got {self.seed!r}')
    if not isinstance(self.setting, Mapping):
      raise ValueError(f'Cell.setting must be a dict, got {self.setting!r}')
    try:
      setting = jsonable(dict(self.setting))
      canonical_json(setting)
    except (TypeError, ValueError) as e:
      raise ValueError(f'Cell.setting is not JSON-able: {e}') from e
    object.__setattr__(self, 'setting', setting)

  def key(self) -> str:
    """Canonical JSON of (paper, method, setting, seed)."""
    return canonical_json({'paper': self.paper, 'method': self.method,
                           'setting': self.setting, 'seed': self.seed})

  def __eq__(self, other):
    return isinstance(other, Cell) and self.key() == other.key()

  def __hash__(self):
    return hash(self.key())

  @classmethod
  def from_record(cls, record: Mapping[str, Any]) -> 'Cell':
    return cls(paper=record['paper'], method=record['method'],
               setting=record['setting'], seed=record['seed'])

  def out_dir(self, root_output_dir: str) -> str:
    """Stable per-cell dir: <root>/runs/<paper>/<method>/<setting>/seed_<n>."""
    label = '_'.join(f'{k}={self.setting[k]}' for k in sorted(self.setting))
    label = re.sub(r'[^A-Za-z0-9_.=-]+', '-', label)[:80] or 'default'
    digest = hashlib.sha1(
        canonical_json(self.setting).encode()).hexdigest()[:8]
    method = re.sub(r'[^A-Za-z0-9_.=-]+', '-', self.method)
    return os.path.join(root_output_dir, RUNS_DIRNAME, self.paper, method,
                        f'{label}-{digest}', f'seed_{self.seed}')


# -------------------------------------------------------------- results file


class ResultsFile:
  """Append-only JSON-lines file of finished cells.

  A line that does not parse (the truncated last line of a killed run, or one
  that a later append terminated) is skipped with a warning naming its line
  number; nothing is ever deleted or rewritten. When a cell appears twice, the
  last line wins.
  """

  def __init__(self, path: str):
    self.path = path
    self._warned: set[tuple[int, str]] = set()

  def append(self, cell: Cell, metrics: Mapping[str, Any],
             extra: Optional[Mapping[str, Any]] = None) -> dict:
    """Appends one record (write, flush, fsync); returns it."""
    if not isinstance(metrics, Mapping):
      raise TypeError(f'metrics must be a dict, got {type(metrics).__name__}')
    record = {'paper': cell.paper, 'method': cell.method,
              'setting': cell.setting, 'seed': cell.seed,
              'metrics': jsonable(dict(metrics))}
    for k, v in (extra or {}).items():
      if k in RECORD_KEYS:
        raise ValueError(f'extra key {k!r} collides with a record key')
      record[k] = jsonable(v)
    line = json.dumps(record, sort_keys=True) + '\n'
    directory = os.path.dirname(self.path)
    if directory:
      os.makedirs(directory, exist_ok=True)
    # A killed writer may have left a line without its newline: terminate it
    # so that the new record stays a line of its own (the fragment is kept).
    prefix = ''
    if os.path.exists(self.path) and os.path.getsize(self.path) > 0:
      with open(self.path, 'rb') as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) != b'\n':
          prefix = '\n'
    with open(self.path, 'a', encoding='utf-8') as f:
      f.write(prefix + line)
      f.flush()
      os.fsync(f.fileno())
    return record

  def records(self) -> list[dict]:
    """All valid records in file order (duplicates included)."""
    if not os.path.exists(self.path):
      return []
    with open(self.path, 'rb') as f:
      data = f.read()
    lines = data.split(b'\n')
    records = []
    for i, raw in enumerate(lines):
      if not raw.strip():
        continue
      lineno = i + 1
      is_last = i == len(lines) - 1  # No newline after it.
      try:
        record = json.loads(raw.decode('utf-8'))
        check_record(record)
      except (UnicodeDecodeError, ValueError, TypeError, KeyError) as e:
        self._warn(lineno, raw, is_last, e)
        continue
      records.append(record)
    return records

  def _warn(self, lineno: int, raw: bytes, is_last: bool, error: Exception):
    token = (lineno, hashlib.sha1(raw).hexdigest())
    if token in self._warned:
      return
    self._warned.add(token)
    what = ('truncated last line (a killed run?)' if is_last else
            'unreadable line')
    logging.warning('%s:%d: skipping %s: %s; the line is kept in the file.',
                    self.path, lineno, what, error)

  def latest(self) -> dict[str, dict]:
    """Cell key -> its last record."""
    return {Cell.from_record(r).key(): r for r in self.records()}

  def finished_keys(self) -> set[str]:
    return set(self.latest())

  def metrics_for(self, paper: str, method: str,
                  setting: Mapping[str, Any]) -> list[dict]:
    """Metric dicts of the finished seeds of (paper, method, setting)."""
    return metrics_for(self.latest().values(), paper, method, setting)


def check_record(record: Any):
  """Raises ValueError unless `record` is a well-formed results line."""
  if not isinstance(record, dict):
    raise ValueError('not a JSON object')
  missing = [k for k in RECORD_KEYS if k not in record]
  if missing:
    raise ValueError(f'missing keys {missing}')
  if not isinstance(record['setting'], dict):
    raise ValueError('"setting" is not an object')
  if not isinstance(record['metrics'], dict):
    raise ValueError('"metrics" is not an object')
  Cell.from_record(record)  # Validates the types.


def metrics_for(records: Iterable[Mapping[str, Any]], paper: str, method: str,
                 setting: Mapping[str, Any]) -> list[dict]:
  """The metrics of `records`' (paper, method, setting), one per seed (the
  last record of a seed wins), in seed order."""
  want = canonical_json(jsonable(dict(setting)))
  by_seed = {}
  for r in records:
    if (r['paper'] == paper and r['method'] == method and
        canonical_json(r['setting']) == want):
      by_seed[r['seed']] = r['metrics']
  return [by_seed[s] for s in sorted(by_seed)]


Results = Union[ResultsFile, Iterable[Mapping[str, Any]]]


def latest_records(results: Results) -> list[dict]:
  """The last record of each cell of a results file or of records."""
  if isinstance(results, ResultsFile):
    return list(results.latest().values())
  return list({Cell.from_record(r).key(): r for r in results}.values())
