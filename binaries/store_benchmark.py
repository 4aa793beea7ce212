r"""Client-state store at scale: per-round cohort cost, memory, checkpoint, resume.

  python -m binaries.store_benchmark --output_dir=/tmp/store_bench \
    [--configs=sqlite:32:1000000,...] [--cohort=200] [--rounds=30]

Each config `backend:state:population` (state: `32` is a 32-float personal
embedding, `10000` a 10,000-parameter personal head, kernel [999, 10] plus
bias [10]; both with an int32 participation counter, the shape of the
project's client states) runs in fresh child processes so that memory figures
are the store's own:

1. fill: every client of the population is saved once (round 1) and committed:
   the worst case for lookups, a store that has seen everyone. For SQLite this
   runs in its own process; the in-memory store must hold the population, so
   it fills and measures in one process.
2. measure: open the store (`open_s`), then `--rounds` rounds of a uniformly
   sampled cohort (the training loop's sampling): `load`, modify, `save`
   (`load_save_ms`), `commit` (`commit_ms`: for SQLite the durable per-round
   checkpoint of the client states, for the in-memory store an `.npz`
   snapshot of all clients); `round_ms` is the sum. Then a crash is simulated
   (one more round saved, never committed, store not closed) and a new store
   object resumes (`resume_s`: open + `rollback`); the resumed cohort must
   load exactly its committed states, or the run fails.
   `unseen_load_ms`: loading a cohort no one ever saved (states built by the
   seeded initial-state function, nothing written).
   `peak_rss_mib`: the measuring process's peak RSS (VmHWM), Python and numpy
   included (about 30 MiB alone). `round_cpu_ms_p50`: this process's CPU
   time per round (no I/O waits; less sensitive than wall time to other
   programs on the machine). `machine_load`: the 1-minute load average
   during the rounds, next to `cpus`: wall times on a machine with load
   above its core count are inflated accordingly.

Writes `<output_dir>/store_benchmark.json` (one record per config) and
`store_benchmark.md` (a table). Store files go to `--work_dir` (default
`<output_dir>/work`) and are deleted unless `--keep_files`.
"""

import collections
import json
import os
import shutil
import subprocess
import sys
import time

from absl import app
from absl import flags
import numpy as np

from tff_personal.core import client_state as client_state_lib

_DEFAULT_CONFIGS = ('sqlite:32:10000,sqlite:32:100000,sqlite:32:1000000,'
                    'memory:32:10000,memory:32:100000,memory:32:1000000,'
                    'sqlite:10000:10000,sqlite:10000:100000')

# Flag holders, set by define_flags() (at run time, so that tests and other
# binaries can import this module without defining its flags).
_OUTPUT_DIR = None
_CONFIGS = None
_COHORT = None
_ROUNDS = None
_CACHE_SIZE = None
_SEED = None
_WORK_DIR = None
_KEEP_FILES = None
_CHILD = None
_CONFIG = None
_FILL_S = None


def define_flags():
  """Defines the binary's flags."""
  # pylint: disable=global-statement
  global _OUTPUT_DIR, _CONFIGS, _COHORT, _ROUNDS, _CACHE_SIZE, _SEED
  global _WORK_DIR, _KEEP_FILES, _CHILD, _CONFIG, _FILL_S
  _OUTPUT_DIR = flags.DEFINE_string('output_dir', None, 'Where results go.')
  _CONFIGS = flags.DEFINE_list(
      'configs', _DEFAULT_CONFIGS,
      'backend:state:population, backend in {sqlite, memory}, state in '
      '{32, 10000}.')
  _COHORT = flags.DEFINE_integer('cohort', 200, 'Clients per round.')
  _ROUNDS = flags.DEFINE_integer('rounds', 30, 'Measured rounds per config.')
  _CACHE_SIZE = flags.DEFINE_integer('cache_size', 0,
                                     'SQLite LRU cache entries.')
  _SEED = flags.DEFINE_integer('seed', 0, 'Seed of sampling and states.')
  _WORK_DIR = flags.DEFINE_string('work_dir', None,
                                  'Store files (default <output_dir>/work).')
  _KEEP_FILES = flags.DEFINE_bool('keep_files', False,
                                  'Keep the store files after each config.')
  _CHILD = flags.DEFINE_enum('child', None, ['fill', 'measure'],
                             'Internal: run one phase of one config.')
  _CONFIG = flags.DEFINE_string('config', None, 'Internal: the config.')
  _FILL_S = flags.DEFINE_float('fill_s', None, 'Internal: fill seconds.')

_STATES = ('32', '10000')
_BACKENDS = ('sqlite', 'memory')


def parse_config(config: str) -> tuple[str, str, int]:
  parts = config.split(':')
  if (len(parts) != 3 or parts[0] not in _BACKENDS or parts[1] not in _STATES
      or not parts[2].isdigit() or int(parts[2]) < 1):
    raise ValueError(
        f'--configs entry {config!r} is not backend:state:population with '
        f'backend in {_BACKENDS}, state in {_STATES} and population >= 1.')
  return parts[0], parts[1], int(parts[2])


def template(state: str) -> collections.OrderedDict:
  if state == '32':
    private = (np.zeros(32, np.float32),)
  else:
    private = (np.zeros((999, 10), np.float32), np.zeros(10, np.float32))
  return collections.OrderedDict(private=private,
                                 rounds_participated=np.int32(0))


def num_params(state: str) -> int:
  return sum(x.size for x in template(state)['private'])


def cohort_ids(population: int, cohort: int, round_num: int,
               seed: int) -> list[int]:
  """The training loop's fixed-size sampling (`training_loop.sample_clients`).

  Repeated here so this process does not import TensorFlow (whose memory
  would hide the store's).
  """
  rng = np.random.default_rng([seed, round_num, 0x5A3])
  return np.sort(rng.choice(population, cohort, replace=False)).tolist()


def _rss_mib(field: str = 'VmHWM') -> float:
  with open('/proc/self/status') as f:
    for line in f:
      if line.startswith(field + ':'):
        return int(line.split()[1]) / 1024
  return float('nan')


def _open(backend: str, state: str, directory: str, seed: int,
          cache_size: int) -> client_state_lib.ClientStateStore:
  initial = client_state_lib.seeded_initial_state_fn(template(state), seed)
  if backend == 'sqlite':
    return client_state_lib.SqliteClientStateStore(
        initial, os.path.join(directory, client_state_lib.SQLITE_FILENAME),
        cache_size=cache_size)
  return client_state_lib.InMemoryClientStateStore(initial, directory)


def _fill(store, state: str, population: int) -> float:
  """Saves every client once (round 1) and commits; returns seconds."""
  chunk = 20_000 if state == '32' else 1_000
  tmpl = template(state)
  t0 = time.perf_counter()
  for start in range(0, population, chunk):
    ids = range(start, min(population, start + chunk))
    states = [collections.OrderedDict(
        private=tuple(np.full_like(x, cid % 1000) for x in tmpl['private']),
        rounds_participated=np.int32(1)) for cid in ids]
    store.save(list(ids), states, 1)
  store.commit(1)
  return time.perf_counter() - t0


def _bump(states):
  for s in states:
    for x in s['private']:
      x += 1.0
    s['rounds_participated'] = s['rounds_participated'] + 1
  return states


def _pct(values_s, q) -> float:
  return round(1000 * float(np.percentile(values_s, q)), 3)


def _disk_mib(directory: str) -> float:
  total = 0
  for root, _, files in os.walk(directory):
    total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
  return round(total / 2**20, 1)


def _measure(backend, state, population, directory, cohort, rounds, seed,
             cache_size, fill_s=None) -> dict:
  t0 = time.perf_counter()
  store = _open(backend, state, directory, seed, cache_size)
  open_s = time.perf_counter() - t0
  if backend == 'memory':  # The population lives in this process.
    fill_s = _fill(store, state, population)
  rss_open = _rss_mib('VmRSS')
  load_save, commit, cpu = [], [], []
  last = 1
  load_before = os.getloadavg()[0]
  for r in range(2, rounds + 2):
    ids = cohort_ids(population, cohort, r, seed)
    c0 = time.process_time()
    t0 = time.perf_counter()
    states = store.load(ids)
    _bump(states)
    store.save(ids, states, r)
    t1 = time.perf_counter()
    store.commit(r)
    t2 = time.perf_counter()
    cpu.append(time.process_time() - c0)
    load_save.append(t1 - t0)
    commit.append(t2 - t1)
    last = r
  load_after = os.getloadavg()[0]
  checkpoint_s = float(np.median(commit))
  # Crash after an uncommitted save; a new store object resumes.
  ids = cohort_ids(population, cohort, last + 1, seed)
  committed = store.load(ids)
  store.save(ids, _bump(store.load(ids)), last + 1)
  if backend == 'sqlite':
    store.close()  # Its file is all that survives; nothing more is flushed.
  del store
  t0 = time.perf_counter()
  resumed = _open(backend, state, directory, seed, cache_size)
  resumed.rollback(last)
  resume_s = time.perf_counter() - t0
  for a, b in zip(resumed.load(ids), committed):
    for x, y in zip(a['private'], b['private']):
      if not np.array_equal(x, y):
        raise AssertionError('resume did not restore the committed states')
  resumed.close()
  # A cohort nobody saved: seeded initial states, nothing materialised.
  with client_state_lib.InMemoryClientStateStore(
      client_state_lib.seeded_initial_state_fn(template(state), seed)) as empty:
    unseen = []
    for r in range(5):
      t0 = time.perf_counter()
      empty.load(cohort_ids(population, cohort, 10_000 + r, seed))
      unseen.append(time.perf_counter() - t0)
  round_s = np.add(load_save, commit)
  return dict(
      backend=backend, state_params=num_params(state),
      state_bytes=client_state_lib.StateCodec(template(state)).payload_bytes,
      population=population, cohort=cohort, rounds=rounds,
      cache_size=cache_size if backend == 'sqlite' else None,
      load_save_ms_p50=_pct(load_save, 50), load_save_ms_p95=_pct(load_save, 95),
      commit_ms_p50=_pct(commit, 50), commit_ms_p95=_pct(commit, 95),
      round_ms_p50=_pct(round_s, 50), round_ms_p95=_pct(round_s, 95),
      round_cpu_ms_p50=_pct(cpu, 50),
      unseen_load_ms_p50=_pct(unseen, 50),
      checkpoint_s=round(checkpoint_s, 4), resume_s=round(resume_s, 4),
      open_s=round(open_s, 4), fill_s=round(fill_s, 2),
      rss_after_open_mib=round(rss_open, 1),
      peak_rss_mib=round(_rss_mib('VmHWM'), 1),
      disk_mib=_disk_mib(directory),
      machine_load=round(max(load_before, load_after), 1),
      cpus=os.cpu_count())


def _run_child(phase: str, config: str, directory: str,
               extra: list[str]) -> dict:
  cmd = [sys.executable, '-m', 'binaries.store_benchmark', f'--child={phase}',
         f'--config={config}', f'--work_dir={directory}',
         f'--output_dir={_OUTPUT_DIR.value}', f'--cohort={_COHORT.value}',
         f'--rounds={_ROUNDS.value}', f'--cache_size={_CACHE_SIZE.value}',
         f'--seed={_SEED.value}'] + extra
  out = subprocess.run(cmd, check=True, capture_output=True, text=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def _child_main() -> int:
  backend, state, population = parse_config(_CONFIG.value)
  directory = _WORK_DIR.value
  if _CHILD.value == 'fill':
    with _open(backend, state, directory, _SEED.value, 0) as store:
      print(json.dumps({'fill_s': _fill(store, state, population)}))
    return 0
  fill_s = _FILL_S.value
  record = _measure(backend, state, population, directory, _COHORT.value,
                    _ROUNDS.value, _SEED.value, _CACHE_SIZE.value,
                    fill_s=fill_s)
  print(json.dumps(record))
  return 0


_COLUMNS = (
    ('backend', 'backend'), ('state_params', 'state floats'),
    ('population', 'population'), ('load_save_ms_p50', 'load+save ms p50'),
    ('load_save_ms_p95', 'p95'), ('commit_ms_p50', 'commit ms p50'),
    ('round_ms_p50', 'round ms p50'), ('round_ms_p95', 'round ms p95'),
    ('round_cpu_ms_p50', 'round CPU ms p50'),
    ('unseen_load_ms_p50', 'unseen load ms'),
    ('peak_rss_mib', 'peak RSS MiB'), ('checkpoint_s', 'checkpoint s'),
    ('resume_s', 'resume s'), ('fill_s', 'fill s'), ('disk_mib', 'disk MiB'),
    ('machine_load', 'load avg'))


def markdown(records: list[dict], command: str) -> str:
  lines = [f'Command: `{command}`', '',
           '| ' + ' | '.join(h for _, h in _COLUMNS) + ' |',
           '|' + '---|' * len(_COLUMNS)]
  for r in records:
    lines.append('| ' + ' | '.join(
        f'{r[k]:,}' if isinstance(r[k], int) else str(r[k])
        for k, _ in _COLUMNS) + ' |')
  return '\n'.join(lines) + '\n'


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if _CHILD.value:
    return _child_main()
  if not _OUTPUT_DIR.value:
    print('error: --output_dir is required', file=sys.stderr)
    return 2
  try:
    configs = [(c, parse_config(c)) for c in _CONFIGS.value]
  except ValueError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  if _COHORT.value < 1 or _ROUNDS.value < 2:
    print('error: --cohort must be >= 1 and --rounds >= 2', file=sys.stderr)
    return 2
  for c, (_, _, population) in configs:
    if _COHORT.value > population:
      print(f'error: --cohort={_COHORT.value} exceeds the population of {c}',
            file=sys.stderr)
      return 2
  os.makedirs(_OUTPUT_DIR.value, exist_ok=True)
  work = _WORK_DIR.value or os.path.join(_OUTPUT_DIR.value, 'work')
  records = []
  for config, (backend, _, _) in configs:
    directory = os.path.join(work, config.replace(':', '_'))
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    try:
      extra = []
      if backend == 'sqlite':
        fill = _run_child('fill', config, directory, [])
        extra = [f'--fill_s={fill["fill_s"]}']
      record = _run_child('measure', config, directory, extra)
    except subprocess.CalledProcessError as e:
      print(f'error: config {config} failed:\n{e.stderr}', file=sys.stderr)
      return 1
    finally:
      if not _KEEP_FILES.value:
        shutil.rmtree(directory, ignore_errors=True)
    records.append(record)
    print(json.dumps(record), flush=True)
  command = 'python -m binaries.store_benchmark ' + ' '.join(sys.argv[1:])
  with open(os.path.join(_OUTPUT_DIR.value, 'store_benchmark.json'), 'w') as f:
    json.dump(records, f, indent=1)
  with open(os.path.join(_OUTPUT_DIR.value, 'store_benchmark.md'), 'w') as f:
    f.write(markdown(records, command))
  print(markdown(records, command))
  return 0


if __name__ == '__main__':
  define_flags()
  app.run(main)
