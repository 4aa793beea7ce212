"""Multi-worker runs: two local `binaries.worker` services vs. the local run."""

import asyncio
import csv
import glob
import os
import re
import signal
import subprocess
import sys
import types

from absl import flags
from absl.testing import flagsaver
import numpy as np
import portpicker
import pytest
import tensorflow_federated as tff

from binaries import benchmark
from binaries import train
from tests import process_utils
from tff_personal.core import client_state
from tff_personal.core import runtime
from tff_personal.core import sharded

FLAGS = flags.FLAGS
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_READY = re.compile(r'worker ready on port (\d+) \(pid (\d+)\)')


class _Worker:
  """One `python -m binaries.worker` process and its worker_binary child."""

  def __init__(self):
    self.port = portpicker.pick_unused_port()
    self.proc = subprocess.Popen(
        [sys.executable, '-m', 'binaries.worker', f'--port={self.port}'],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        text=True)
    line = self.proc.stdout.readline()
    match = _READY.search(line)
    if not match:
      self.proc.kill()
      raise RuntimeError(f'worker did not start: {line!r}')
    self.service_pid = int(match.group(2))

  @property
  def address(self):
    return f'localhost:{self.port}'

  def stop(self):
    self.proc.send_signal(signal.SIGTERM)
    out, _ = self.proc.communicate(timeout=60)
    return self.proc.returncode, out


@pytest.fixture(scope='module')
def workers():
  started = []
  try:
    for _ in range(2):
      started.append(_Worker())
    yield started
  finally:
    for w in started:
      if w.proc.poll() is None:
        w.proc.kill()
        w.proc.wait()


def test_parse_workers_rejects_bad_addresses():
  assert runtime.parse_workers('a:1, b:2') == ['a:1', 'b:2']
  assert runtime.parse_workers(['[::1]:80']) == ['[::1]:80']
  for bad, msg in (('a:1,,b:2', 'empty'), ('host', 'host:port'),
                   ('h:0', 'host:port'), ('h:x', 'host:port'),
                   (':80', 'host:port'), ('a:1,a:1', 'twice')):
    with pytest.raises(ValueError, match=msg):
      runtime.parse_workers(bad)


def test_unreachable_worker_is_named():
  port = portpicker.pick_unused_port()
  with pytest.raises(ConnectionError, match=f'localhost:{port}'):
    runtime.WorkersRuntime([f'localhost:{port}'], connect_timeout_s=1)


@tff.federated_computation(tff.FederatedType(np.float32, tff.CLIENTS))
def _scale_and_sum(x):
  """CLIENTS-placed and SERVER-placed results, like `next`."""
  doubled = tff.federated_map(
      tff.tensorflow.computation(lambda v: v * 2.0, np.float32), x)
  return doubled, tff.federated_sum(x)


def test_clients_split_across_workers_and_results_in_order(workers):
  values = [float(v) for v in range(1, 8)]
  calls = []
  with runtime.WorkersRuntime([w.address for w in workers]) as rt:
    for i, ctx in enumerate(rt.context._contexts):  # pylint: disable=protected-access
      original = ctx.invoke

      async def spy(comp, arg, original=original, i=i):
        calls.append(i)
        if i == 0:  # The first slice finishes last (TFF 0.87's own context
          await asyncio.sleep(0.3)  # then returns the clients reordered).
        return await original(comp, arg)

      ctx.invoke = spy
    for _ in range(2):
      doubled, total = _scale_and_sum(values)
      assert [float(v) for v in doubled] == [2.0 * v for v in values]
      assert float(total) == sum(values)
  assert set(calls) == {0, 1}  # Both workers computed slices.


def _read_csv(path):
  with open(path) as f:
    return list(csv.DictReader(f))


def _run(tmp_path, mnist_dir, name, worker_addresses):
  if not FLAGS.is_parsed():
    FLAGS(['train'])
  with flagsaver.flagsaver(
      task='mnist_preference', algorithm='global_plus', data_dir=mnist_dir,
      num_users=20, rounds=2, clients_per_round=6, seed=5, eval_clients=8,
      root_output_dir=str(tmp_path), experiment_name=name,
      client_state_backend='memory', workers=worker_addresses):
    assert train.main(['train']) == 0
  exp = tmp_path / name
  snapshots = sorted(glob.glob(str(exp / 'client_states' / '*.npz')))
  with np.load(snapshots[-1]) as z:
    states = {k: z[k] for k in z.files}
  return (_read_csv(exp / 'train_metrics.csv'),
          _read_csv(exp / 'eval_metrics.csv'), states)


def test_training_on_two_workers_matches_local_run(workers, tmp_path,
                                                   mnist_dir):
  local = _run(tmp_path, mnist_dir, 'local', [])
  remote = _run(tmp_path, mnist_dir, 'two_workers',
                [w.address for w in workers])
  for rows_local, rows_remote in zip(local[:2], remote[:2]):
    assert len(rows_local) == len(rows_remote) > 0
    for a, b in zip(rows_local, rows_remote):
      for key, value in a.items():
        if key == 'round_seconds':
          continue
        np.testing.assert_allclose(float(b[key]), float(value), rtol=1e-5,
                                   atol=1e-6, err_msg=key)
  # The private states each client kept (wrong order = wrong client: the
  # states of different clients differ by ~0.1). Merging two partial sums
  # instead of one sum rounds differently, and round 2 trains from that
  # model: measured differences are below 1e-5.
  assert local[2].keys() == remote[2].keys()
  np.testing.assert_array_equal(remote[2]['client_ids'],
                                local[2]['client_ids'])
  for key in local[2]:
    if key.startswith('leaf_'):
      np.testing.assert_allclose(remote[2][key], local[2][key], rtol=0,
                                 atol=1e-4, err_msg=key)


def test_worker_refuses_a_port_in_use(workers):
  out = subprocess.run(
      [sys.executable, '-m', 'binaries.worker', f'--port={workers[0].port}'],
      cwd=REPO, capture_output=True, text=True, timeout=120)
  assert out.returncode == 1
  assert f'port {workers[0].port} is already in use' in out.stderr


def test_worker_service_gets_its_thread_pools(workers):
  # The default: one thread per op, one inter-op thread per CPU.
  with open(f'/proc/{workers[0].service_pid}/environ', 'rb') as f:
    env = f.read().split(b'\0')
  assert b'TF_NUM_INTRAOP_THREADS=1' in env
  assert f'TF_NUM_INTEROP_THREADS={len(os.sched_getaffinity(0))}'.encode(
      ) in env


def test_worker_refuses_a_bad_thread_count_before_starting():
  out = subprocess.run(
      [sys.executable, '-m', 'binaries.worker',
       f'--port={portpicker.pick_unused_port()}', '--intra_op_threads=-3'],
      cwd=REPO, capture_output=True, text=True, timeout=120)
  assert out.returncode == 2
  assert 'intra_op_threads must be' in out.stderr
  assert 'ready' not in out.stdout


def test_sharded_round_trains_each_shard_once_on_one_worker(workers):
  """With workers, each shard's work runs once (on one worker) and the
  round equals the local one: the same server weights and client states."""
  rng = np.random.default_rng(3)
  n = benchmark.EXAMPLES_PER_CLIENT
  data = dict(x=rng.random((4, n, 28, 28, 1), dtype=np.float32),
              y=rng.integers(0, 2, (4, n)).astype(np.int32),
              type=rng.integers(0, 10, (4, n)).astype(np.int32))
  ids = [0, 1, 2, 3]
  # Local SGD: Adam would turn float noise in near-zero gradients into
  # steps of the learning rate whose sign follows the two runtimes' sums.
  proc = sharded.ShardedProcess(
      benchmark.build_project_process(
          'global_plus', seed=0,
          client_optimizer=tff.learning.optimizers.build_sgdm(0.1)),
      num_shards=2)
  spec = tff.types.type_to_tf_tensor_specs(proc.client_state_type)
  states = [client_state.seeded_initial_state_fn(spec, 0, 'normal', 0.1)(i)
            for i in ids]
  element_spec = tff.types.type_to_tf_tensor_specs(
      proc.base_process.client_data_type.element)
  batches = benchmark._client_batches(data, ids, tuple(element_spec),
                                      element_spec)

  def one_round():
    state, new_states, _ = proc.next(proc.initialize(), states, batches)
    return ([np.asarray(w) for w in proc.get_model_weights(state).trainable],
            [np.asarray(s['private'][0]) for s in new_states])

  local = one_round()
  shard_calls = []
  with runtime.WorkersRuntime([w.address for w in workers]) as rt:
    for i, ctx in enumerate(rt.context._contexts):  # pylint: disable=protected-access
      original = ctx.invoke

      async def spy(comp, arg, original=original, i=i):
        if comp is proc._shard_work:  # pylint: disable=protected-access
          shard_calls.append(i)
        return await original(comp, arg)

      ctx.invoke = spy
    remote = one_round()
  # One shard on each worker (the workers run at once, so in any order).
  assert sorted(shard_calls) == [0, 1]
  for a, b in zip(local[0] + local[1], remote[0] + remote[1]):
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
  # Training moved the states (the comparison is not of initial values).
  assert not np.allclose(local[1][0], states[0]['private'][0])


def test_default_workers_route_every_runtime_of_the_block(workers):
  """`binaries.reproduce --workers`: paper modules open their runtimes
  themselves, and inside `default_workers` those run on the workers."""
  addresses = [w.address for w in workers]
  with runtime.default_workers(addresses):
    with runtime.local_runtime(handle_sigterm=False) as rt:
      assert isinstance(rt, runtime.WorkersRuntime)
      assert rt.addresses == addresses
      assert runtime.worker_map() is not None
  assert runtime.worker_map() is None  # The session's local runtime again.
  with pytest.raises(ValueError, match='host:port'):
    with runtime.default_workers(['nonsense']):
      pass


def test_reproduce_refuses_bad_workers(tmp_path, capsys):
  from binaries import reproduce  # pylint: disable=g-import-not-at-top
  # Refused before anything is planned or run.
  f = types.SimpleNamespace(workers=['localhost:0'],
                            root_output_dir=str(tmp_path))
  assert reproduce.run(f) == 2
  assert 'port in 1..65535' in capsys.readouterr().err
  assert not os.listdir(tmp_path)


# Last: it stops the module's workers.
def test_workers_shut_down_on_sigterm(workers):
  for w in workers:
    code, out = w.stop()
    assert code == 0, out
    assert 'stopped' in out
    assert process_utils.wait_dead(w.service_pid)
