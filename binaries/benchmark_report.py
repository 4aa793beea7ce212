"""The benchmark's tables, from its records (no TensorFlow needed).

`binaries.benchmark` writes `benchmark.json` (its records) and
`benchmark_run.json` (machine, command, records); `render_markdown` makes
its full tables and `readme_markdown` the README's summary, which
`tools/readme_tables.py` builds from the committed `docs/benchmark/`.
"""

from __future__ import annotations

import statistics
from typing import Sequence

CEILING = 'tf_ceiling'
# The machine's own two-core speed-up (`benchmark_workers.two_core_speedup`).
CALIBRATION = 'two_core_calibration'
NO_WORKER = ('keras_central',)  # And every ceiling (`_threads`).
# The systems that train FedAvg's model (`global`'s).
FEDAVG_MODEL = ('tff_fedavg', 'pfl_fedavg', 'keras_central')


def ceiling_name(system: str) -> str:
  """The record name of the arithmetic ceiling of `system`'s model:
  `tf_ceiling` for `global` (FedAvg's model, which `tff_fedavg`,
  `pfl_fedavg` and `keras_central` train too), `tf_ceiling_<system>` for the
  project's other systems."""
  return CEILING if system == 'global' else f'{CEILING}_{system}'


# The README's summary: these systems, every cohort, each as a fraction of
# its model's ceiling.
README_SYSTEMS = ('fedembed_prototype', 'fedembed_prototype_inprocess',
                  'fedembed_prototype_batched',
                  'fedembed_prototype_batched_inprocess', 'global',
                  'global_inprocess', 'global_batched',
                  'global_batched_inprocess', 'pfl_fedavg', 'tff_fedavg',
                  'keras_central', ceiling_name('global'),
                  ceiling_name('fedembed_prototype'),
                  ceiling_name('global') + '_batched')


BATCHED_SUFFIX = '_batched'
# A project system whose rounds run in process (`core/inprocess.py`).
INPROCESS_SUFFIX = '_inprocess'


def own_ceiling(system: str) -> str:
  """The ceiling of the model `system` trains (itself for a ceiling)."""
  if system.startswith(CEILING):
    return system
  for suffix in (INPROCESS_SUFFIX, BATCHED_SUFFIX):
    if system.endswith(suffix):
      system = system[:-len(suffix)]
  return CEILING if system in FEDAVG_MODEL else ceiling_name(system)


def median_of_repeats(records):
  """One record per (name, cohort, memory run): the run of median rate.

  With `--repeats` every (system, cohort) ran several times, interleaved.
  The kept record is the run whose `client_updates_per_s` is the median
  (the lower median for an even count), with `repeats` and the rate of
  every run, in run order, in `client_updates_per_s_runs`. Order: first
  appearance.
  """
  groups = {}
  for r in records:
    groups.setdefault((r['name'], r['cohort'], bool(r.get('memory_run'))),
                      []).append(r)
  out = []
  for runs in groups.values():
    rates = [r['client_updates_per_s'] for r in runs]
    kept = dict(runs[rates.index(statistics.median_low(rates))])
    if len(runs) > 1:
      kept.update(repeats=len(runs), client_updates_per_s_runs=rates)
    out.append(kept)
  return out


def _ratio(a, b):
  return f'{a / b:.2f}x' if a and b else '-'


def _threads(record) -> str:
  """'intra/inter' of the run's worker_binary ('-' without a worker)."""
  t = record.get('worker_threads')
  if not t or record['name'] in NO_WORKER or record['name'].startswith(
      CEILING):
    return '-'
  show = lambda n: 'TF default' if n is None else str(n)
  return f"{show(t['intra_op'])}/{show(t['inter_op'])}"


def _is_system(record) -> bool:
  """A row of the systems table (not a family, scale or worker row)."""
  return not (record.get('form') or record.get('population') or
              record.get('workers') or record['name'] == CALIBRATION)


def _worker_lines(records) -> list[str]:
  """The multi-worker pairs: one pinned worker against two, beside the
  machine's own two-core speed-up measured just before."""
  runs = {(r['pair'], r['workers']): r for r in records if r.get('workers')}
  if not runs:
    return []
  machine = {r['pair']: r for r in records if r['name'] == CALIBRATION}
  first = next(iter(runs.values()))
  epochs = first.get('local_epochs', 1)
  lines = ['', f"Two workers against one (`binaries.worker` services pinned "
           f"to a core each; {first['name']}, cohort {first['cohort']}, "
           f"{epochs} local epoch{'s' * (epochs != 1)}; rounds 2 and "
           "later):", '',
           "| pair | the machine's two-core speed-up | one worker s/round | "
           'two workers s/round | speed-up | largest weight difference |',
           '|---:|---:|---:|---:|---:|---:|']
  for pair in sorted({p for p, _ in runs}):
    one, two = runs.get((pair, 1)), runs.get((pair, 2))
    cal = machine.get(pair)
    cell = lambda r, key, fmt: '-' if r is None or key not in r else (
        format(r[key], fmt))
    lines.append(
        f"| {pair + 1} | {cell(cal, 'speedup', '.2f')}x | "
        f"{cell(one, 'seconds_per_round', '.3f')} | "
        f"{cell(two, 'seconds_per_round', '.3f')} | "
        f"{cell(two, 'speedup', '.2f')}x | "
        f"{cell(two, 'max_weight_diff', '.3g')} |")
  ours = [r['speedup'] for r in runs.values() if 'speedup' in r]
  theirs = [r['speedup'] for r in machine.values()]
  if len(ours) > 1 and theirs:
    lines.append(f"| median | {statistics.median(theirs):.2f}x | | | "
                 f"{statistics.median(ours):.2f}x | |")
  return lines


def render_markdown(records, machine: str, command: str) -> str:
  """The tables: systems with ratios to tff_fedavg, the arithmetic ceiling
  and pfl per cohort; family rows, sharded against one user per client."""
  lines = [f'Machine: {machine}', '', f'Command: `{command}`', '',
           '| system | cohort | client updates/s | examples/s | s/round | '
           'start-up s | peak RSS MiB | vs tff_fedavg | vs tf_ceiling | '
           'vs its model\'s ceiling | vs pfl_fedavg | worker threads '
           '(intra/inter) |',
           '|' + '---|' * 12]
  scale = [r for r in records if r.get('population')]
  families = [r for r in records if r.get('form')]
  workers = _worker_lines(records)
  records = [r for r in records if _is_system(r)]
  if not records:  # Family, scale or worker rows only.
    lines = lines[:4]
  by_key = {(r['name'], r['cohort']): r for r in records}
  for r in records:
    if 'rss_mib_after_round_20' in r and r.get('memory_run'):
      continue
    ref = by_key.get(('tff_fedavg', r['cohort']), {})
    ceiling = by_key.get((CEILING, r['cohort']), {})
    own = by_key.get((own_ceiling(r['name']), r['cohort']), {})
    peer = by_key.get(('pfl_fedavg', r['cohort']), {})
    u = r['client_updates_per_s']
    lines.append(
        f"| {r['name']} | {r['cohort']} | {u:.1f} | "
        f"{r['examples_per_s']:.0f} | {r['seconds_per_round']:.3f} | "
        f"{r.get('startup_s', float('nan')):.1f} | "
        f"{r.get('peak_rss_mib', float('nan')):.0f} | "
        f"{_ratio(u, ref.get('client_updates_per_s'))} | "
        f"{_ratio(u, ceiling.get('client_updates_per_s'))} | "
        f"{_ratio(u, own.get('client_updates_per_s'))} | "
        f"{_ratio(u, peer.get('client_updates_per_s'))} | "
        f"{_threads(r)} |")
  repeated = [r for r in records if r.get('repeats')]
  if repeated:
    spread = lambda r: (max(r['client_updates_per_s_runs']) /
                        min(r['client_updates_per_s_runs']))
    widest = max(repeated, key=spread)
    lines += ['', f"Each row is the run of median rate of "
              f"{widest['repeats']}, interleaved (every system at every "
              "cohort, then again); the fastest of a row's runs was up to "
              f"{spread(widest):.2f}x its slowest ({widest['name']}, cohort "
              f"{widest['cohort']})."]
  if families:
    lines += ['', 'Families, each on its own task (binaries.train; rounds 2 '
              'and later of the timed stage):', '',
              '| algorithm | task | stage | cohort | form | client updates/s '
              '| examples/s | s/round | vs per client (batched: vs '
              'sharded) |',
              '|' + '---|' * 9]
    forms = {(r['name'], r['form']): r for r in families}
    for r in families:
      other = forms.get((r['name'], 'sharded' if r['form'] == 'batched'
                         else 'per_client'), {})
      examples = r.get('examples_per_s')
      lines.append(
          f"| {r['name']} | {r['workload']} | {r.get('stage') or '-'} | "
          f"{r['cohort']} | {r['form']} | {r['client_updates_per_s']:.2f} | "
          f"{'-' if examples is None else f'{examples:.0f}'} | "
          f"{r['seconds_per_round']:.3f} | " + (
              _ratio(r['client_updates_per_s'],
                     other.get('client_updates_per_s'))
              if r['form'] in ('sharded', 'batched') else '1.00x') + ' |')
  if scale:
    lines += _scale_lines(scale)
  lines += workers
  memory = [r for r in records if r.get('memory_run')]
  for r in memory:
    a = r.get('rss_mib_after_round_20')
    b = r.get(f"rss_mib_after_round_{r['rounds']}")
    lines += ['', f"Memory over rounds ({r['name']}, cohort {r['cohort']}): "
              f"RSS after round 20 {a:.0f} MiB, after round {r['rounds']} "
              f"{b:.0f} MiB ({(b / a - 1) * 100:+.1f}%)."]
  return '\n'.join(lines) + '\n'


def _scale_lines(scale) -> list[str]:
  """The population-scale rows, each against the smallest population."""
  base = min(scale, key=lambda r: r['population'])
  lines = ['', 'The whole loop at population scale (binaries.train on the '
           'generated task, global_plus with a 32-float personal embedding, '
           'the SQLite store; rounds 2 and later):', '',
           '| users | cohort | s/round | peak RSS MiB | s/round vs '
           f"{base['population']:,} | RSS vs {base['population']:,} |",
           '|---:|---:|---:|---:|---:|---:|']
  for r in sorted(scale, key=lambda r: r['population']):
    lines.append(
        f"| {r['population']:,} | {r['cohort']} | "
        f"{r['seconds_per_round']:.3f} | {r['peak_rss_mib']:.0f} | "
        f"{r['seconds_per_round'] / base['seconds_per_round']:.2f}x | "
        f"{r['peak_rss_mib'] / base['peak_rss_mib']:.2f}x |")
  return lines


def machine(run: dict) -> str:
  """The run's machine, without its load (the README is no lab notebook)."""
  return run['machine'].split(', load average')[0]


README_PARTS = ('systems', 'families', 'scale', 'workers')


def readme_markdown(run: dict, parts: Sequence[str] = README_PARTS) -> str:
  """The README's performance tables from a `benchmark_run.json` (those of
  `parts`, of `README_PARTS`), and the command that made them."""
  unknown = set(parts) - set(README_PARTS)
  if unknown:
    raise ValueError(f'parts must be of {README_PARTS}, got {sorted(unknown)}')
  records = [r for r in run['records'] if not r.get('memory_run')]
  scale = [r for r in records if r.get('population')] if (
      'scale' in parts) else []
  systems = [r for r in records if _is_system(r)] if (
      'systems' in parts) else []
  cohorts = sorted({r['cohort'] for r in systems})
  by_key = {(r['name'], r['cohort']): r for r in systems}
  lines = []
  if systems:
    lines = ['Client updates per second by cohort, and the fraction of the '
             'arithmetic ceiling of the model the system trains: the same '
             'local training and server step in one `tf.function`, without '
             'federation (`tf_ceiling` for FedAvg\'s model, '
             '`tf_ceiling_fedembed_prototype` for FedEmbed\'s; '
             '`tf_ceiling_batched` trains FedAvg\'s model on each step\'s '
             'batches of the whole cohort as one batch). `_batched`: the '
             'shards\' users trained together (`--simulation_batched`); '
             '`_inprocess`: the round\'s aggregation, DP noise and server '
             'step from its compiled production form in the driver, no TFF '
             'runtime (`--simulation_round`, the default); the others on '
             'TFF\'s runtime:',
             '',
             '| system | ' + ' | '.join(f'cohort {c}' for c in cohorts) + ' |',
             '|---|' + '---:|' * len(cohorts)]
  for name in README_SYSTEMS if systems else ():
    row = [by_key.get((name, c)) for c in cohorts]
    if not any(row):
      continue
    cells = []
    for r, c in zip(row, cohorts):
      ceiling = by_key.get((own_ceiling(name), c), {})
      cells.append('-' if r is None else (
          f"{r['client_updates_per_s']:.0f} "
          f"({_ratio(r['client_updates_per_s'], ceiling.get('client_updates_per_s'))})"))
    lines.append(f'| {name} | ' + ' | '.join(cells) + ' |')
  families = [r for r in records if r.get('form') == 'sharded'] if (
      'families' in parts) else []
  if families:
    per_client = {r['name']: r for r in records
                  if r.get('form') == 'per_client'}
    batched = {r['name']: r for r in records if r.get('form') == 'batched'}
    lines += ['' if lines else None, 'Each family on its own task, sharded '
              'against one user per TFF client, and batched against '
              'sharded where the family runs batched (rounds 2 and later '
              'of the stage that trains it):', '',
              '| algorithm | task | cohort | sharded updates/s | per-client '
              'updates/s | ratio | batched updates/s | ratio |',
              '|---|---|---:|---:|---:|---:|---:|---:|']
    for r in families:
      u = per_client.get(r['name'], {}).get('client_updates_per_s')
      b = batched.get(r['name'], {}).get('client_updates_per_s')
      lines.append(
          f"| {r['name']} | {r['workload']} | {r['cohort']} | "
          f"{r['client_updates_per_s']:.1f} | "
          f"{'-' if u is None else f'{u:.1f}'} | "
          f"{_ratio(r['client_updates_per_s'], u)} | "
          f"{'-' if b is None else f'{b:.1f}'} | "
          f"{'-' if b is None else _ratio(b, r['client_updates_per_s'])} |")
  if scale:
    lines += _scale_lines(scale)
  if 'workers' in parts:
    lines += _worker_lines(records)
  lines += ['', f"Command: `{run['command']}`"]
  return '\n'.join(line for line in lines if line is not None) + '\n'
