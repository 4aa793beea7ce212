"""The benchmark's multi-worker rows: one pinned worker against two.

`binaries.benchmark --worker_pairs=N` starts two `binaries.worker` services,
each pinned to one core (the first two CPUs this process may run on), with
one TensorFlow thread per op and one inter-op thread. Then, N times:

1. the machine's own two-core speed-up (`two_core_speedup`): a fixed
   single-threaded NumPy workload run alone on each core and on both
   cores at once. On a shared VM two "cores" may be two threads of
   one physical core, or be slowed by neighbours, and this changes from
   minute to minute; the multi-worker speed-up is only read next to it;
2. `--worker_system` on the benchmark's workload at `--worker_cohort`
   (`--worker_local_epochs` local epochs), sharded, on the first worker;
3. the same run on both workers.

Both runs of a pair split the cohort into the same shards (one per worker),
so they train the same model: the two-worker record carries the largest
difference of its final server weights from the one-worker run's
(`max_weight_diff`; 0 when the results are identical), its speed-up over
the one-worker run, and the machine's speed-up measured just before. The
driver (the benchmark's child process) is not pinned. Records carry
`workers` (1 or 2), `pinned_cores` and `pair`; the calibration records are
named `two_core_calibration`.

Used by `binaries/benchmark.py`.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from typing import Callable, Optional, Sequence

import numpy as np
import portpicker

from binaries import benchmark_report

CALIBRATION = benchmark_report.CALIBRATION
_READY = re.compile(r'worker ready on port (\d+) \(pid (\d+)\)')
# The calibration's workload: single-threaded float32 matrix products, a few
# seconds on one core of the machines this was written on.
_CALIBRATION_CODE = r'''
import time
import numpy as np
a = np.random.default_rng(0).random((192, 192), dtype=np.float32)
start = time.perf_counter()
for _ in range({n}):
  a @ a
print(time.perf_counter() - start)
'''
_ONE_THREAD = dict(OPENBLAS_NUM_THREADS='1', OMP_NUM_THREADS='1',
                   MKL_NUM_THREADS='1')


def two_cores() -> tuple[int, int]:
  """The first two CPUs this process may run on.

  Raises:
    ValueError: Fewer than two.
  """
  cpus = sorted(os.sched_getaffinity(0))
  if len(cpus) < 2:
    raise ValueError(f'the multi-worker rows need two CPUs; this process '
                     f'may run on {cpus} only')
  return cpus[0], cpus[1]


def _pinned(core: int) -> Callable[[], None]:
  return lambda: os.sched_setaffinity(0, {core})


def two_core_speedup(cores: tuple[int, int], matmuls: int = 12000) -> dict:
  """The machine's speed-up of two independent single-threaded processes.

  Runs the same fixed workload alone on `cores[0]`, then twice at once
  (one process on each core), then alone on `cores[1]`: the two runs alone
  bracket the pair, so a machine whose speed drifts (a shared VM) biases
  the ratio less.

  Args:
    cores: The two cores.
    matmuls: The workload's size (192 x 192 matrix products).

  Returns:
    A record: `one_core_s` (the mean of the two runs alone), `two_cores_s`
    (the slower of the pair) and `speedup` (2 * one_core_s / two_cores_s:
    2.0 when the two cores are as fast together as each alone).
  """
  code = _CALIBRATION_CODE.format(n=int(matmuls))
  env = dict(os.environ, **_ONE_THREAD)

  def run(on):
    procs = [subprocess.Popen([sys.executable, '-c', code], env=env,
                              stdout=subprocess.PIPE, text=True,
                              preexec_fn=_pinned(core)) for core in on]
    outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
      raise RuntimeError('the two-core calibration failed')
    return [float(o) for o in outs]

  (first,) = run(cores[:1])
  two = max(run(cores))
  (second,) = run(cores[1:])
  one = (first + second) / 2
  return dict(name=CALIBRATION, one_core_s=one, two_cores_s=two,
              speedup=2 * one / two, pinned_cores=list(cores))


class PinnedWorker:
  """A `binaries.worker` service pinned to one core, one thread per op.

  Its `worker_binary` inherits the pinning. `stop()` ends it (SIGTERM, and
  the service stops its `worker_binary`).
  """

  def __init__(self, core: int, repo: str, ready_timeout_s: float = 120.0):
    self.core = core
    self.port = portpicker.pick_unused_port()
    self.proc = subprocess.Popen(
        [sys.executable, '-m', 'binaries.worker', f'--port={self.port}',
         '--intra_op_threads=1', '--inter_op_threads=1',
         f'--ready_timeout_s={ready_timeout_s}'],
        cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        text=True, preexec_fn=_pinned(core))
    line = self.proc.stdout.readline()
    if not _READY.search(line):
      self.stop()
      raise RuntimeError(f'the worker on core {core} did not start: '
                         f'{line!r}')

  @property
  def address(self) -> str:
    return f'localhost:{self.port}'

  def stop(self) -> None:
    if self.proc.poll() is None:
      self.proc.send_signal(signal.SIGTERM)
      try:
        self.proc.wait(timeout=60)
      except subprocess.TimeoutExpired:
        self.proc.kill()
        self.proc.wait()


def max_weight_diff(a_path: str, b_path: str) -> float:
  """Largest absolute difference between two saved weight lists."""
  with np.load(a_path) as a, np.load(b_path) as b:
    if sorted(a.files) != sorted(b.files):
      raise ValueError(f'{a_path} and {b_path} hold different weights')
    return max((float(np.max(np.abs(a[k] - b[k]))) for k in a.files
                if a[k].size), default=0.0)


def run(pairs: int, system: str, cohort: int, local_epochs: int,
        rounds: int, child_cmd: Callable[..., list], run_child: Callable,
        output_dir: str, repo: str, timeout_s: float,
        log=print, cores: Optional[Sequence[int]] = None) -> list[dict]:
  """Runs the pairs and returns their records (see the module docstring).

  Args:
    pairs: How many (calibration, one worker, two workers) triples.
    system: A project system (`benchmark.PROJECT_SYSTEMS`).
    cohort: Clients per round.
    local_epochs: Local epochs of every client.
    rounds: Rounds of each run (round 1 is start-up).
    child_cmd: `(system, cohort, rounds, record_path, extra_flags) -> cmd`,
      the benchmark's child command.
    run_child: `(cmd, record_path, timeout_s) -> (record, peak RSS, error)`.
    output_dir: Where the runs' weights go.
    repo: The repository (the workers' working directory).
    timeout_s: Per-run time limit.
    log: Progress lines.
    cores: The two cores (default: `two_cores()`).

  Returns:
    The records, in order; a failed run is logged and left out (its pair's
    two-worker record then has no comparison).
  """
  cores = tuple(cores) if cores is not None else two_cores()
  os.makedirs(output_dir, exist_ok=True)
  workers = []
  records = []
  try:
    for core in cores:
      workers.append(PinnedWorker(core, repo))
    for pair in range(pairs):
      calibration = two_core_speedup(cores)
      calibration['pair'] = pair
      records.append(calibration)
      log(f'pair {pair + 1}/{pairs}: the machine\'s two-core speed-up '
          f"{calibration['speedup']:.2f}x")
      one = None
      for n in (1, 2):
        record_path = os.path.join(output_dir, f'.record_{pair}_{n}.json')
        weights = os.path.join(output_dir, f'weights_{pair}_{n}.npz')
        cmd = child_cmd(system, cohort, rounds, record_path, [
            '--workers=' + ','.join(w.address for w in workers[:n]),
            f'--local_epochs={local_epochs}', f'--final_weights={weights}',
            '--simulation_shards=2'])
        record, peak, err = run_child(cmd, record_path, timeout_s)
        if record is None:
          log(f'  {n} worker(s) failed: {err}')
          continue
        record.update(workers=n, pinned_cores=list(cores[:n]), pair=pair,
                      driver_peak_rss_mib=peak,
                      worker_threads={'intra_op': 1, 'inter_op': 1})
        if n == 1:
          one = (record, weights)
        elif one is not None:
          record['speedup'] = (one[0]['seconds_per_round']
                               / record['seconds_per_round'])
          record['max_weight_diff'] = max_weight_diff(one[1], weights)
          record['machine_two_core_speedup'] = calibration['speedup']
        log(f"  {n} worker(s): {record['seconds_per_round']:.3f} s/round"
            + (f", {record['speedup']:.2f}x, weights differ by "
               f"{record['max_weight_diff']:.3g}" if 'speedup' in record
               else ''))
        records.append(record)
  finally:
    for w in workers:
      w.stop()
  return records
