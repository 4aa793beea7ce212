r"""Apple's pfl-research (PyTorch backend) FedAvg on the benchmark workload.

The peer of `binaries.benchmark`: the same clients, model, local schedule and
cohorts, run the idiomatic pfl way (`FederatedDataset.from_slices` over
per-user numpy data, `PyTorchModel`, `SimulatedBackend`, `FederatedAveraging`)
in pfl's own environment (bench/peers/setup_pfl_env.sh):

  bench/peers/.venv-pfl/bin/python bench/peers/pfl_fedavg.py \
      --data=WORKLOAD.npz --cohort=50 --rounds=20 --warmup_rounds=1 \
      --output=RECORD.json [--seed=0] [--t0=$(date +%s.%N)]

Workload: FedEmbed Appendix B.1's MNIST CNN without a personal embedding (the
`Global` model of tff_personal/models/fedembed_mnist.py), local Adam (lr 1e-3,
PyTorch defaults otherwise, fresh optimizer state for every client), one epoch
over each client's examples in order in batches of 10, server SGD lr 1 on the
example-weighted mean model delta (FedAvg, `WeightByDatapoints`). The cohort
of round r (r = 1, 2, ...; round 1 is the first warm-up round) is
`peer_workload.cohort_of(population, cohort, r, seed)`, the project's own
sampler.

Differences from the TensorFlow model (same layers, 114,882 parameters):
* Initialisation follows Keras (Glorot-uniform kernels, zero biases, unit /
  zero LayerNorm affine), drawn from torch's generator, so the values differ.
* LayerNorm epsilon is Keras's 1e-3 (PyTorch's default is 1e-5).
* Adam epsilon is PyTorch's 1e-8 (`tff.learning.optimizers.build_adam`: 1e-7).
* pfl evaluates each user before and after local training in round 1 only
  (its `evaluation_frequency` check is `iteration % f == 0`, so iteration 0
  always evaluates); that costs two forward passes per user in the warm-up
  round and is counted in start-up, not in the steady-state rounds.

The record (JSON) holds:
* seconds_per_round: wall time of the timed rounds (after `--warmup_rounds`),
  total / `--rounds`; client_updates_per_s = cohort / seconds_per_round;
  examples_per_s = cohort * examples per client / seconds_per_round.
* startup_s: from the earliest known start to the end of round 1: `--t0` (the
  caller's clock before it spawned this process) when given, else the
  process's creation time from /proc (10 ms resolution), else the top of this
  script. The parts are reported too (interpreter_s, imports_s, build_s,
  first_round_s, startup_from_script_s, startup_from_process_s).
* cpu_seconds_per_round (user + system, all threads) and
  client_updates_per_cpu_s: less sensitive than wall time to other load on a
  shared machine (though not immune: contention also costs CPU time).
* peak_rss_mib: `getrusage(RUSAGE_SELF).ru_maxrss` (pfl runs in this one
  process in simulation; `children_peak_rss_mib` is reported for
  completeness); rss_after_first_round_mib and rss_end_mib from /proc.
* train_loss_first_round / train_loss_last_round: mean minibatch training
  loss over all local steps of the cohort in round 1 and in the last round
  (accumulated inside the model's `loss`, no extra passes), and
  train_loss_per_round.
"""

import time

_T_SCRIPT = time.time()  # Before any other import: start-up is measured.

# pylint: disable=g-import-not-at-top,g-bad-import-order,wrong-import-position
import json
import os
import resource
import sys

if __package__ in (None, ''):  # Run as a file: make `bench.peers` importable.
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__)))))

from absl import app
from absl import flags
import numpy as np
import pfl
from pfl.aggregate.simulate import SimulatedBackend
from pfl.aggregate.weighting import WeightByDatapoints
from pfl.algorithm import FederatedAveraging
from pfl.algorithm import NNAlgorithmParams
from pfl.callback.base import TrainingProcessCallback
from pfl.data.federated_dataset import FederatedDataset
from pfl.hyperparam import NNTrainHyperParams
from pfl.metrics import Metrics
from pfl.metrics import Weighted
from pfl.model.pytorch import PyTorchModel
import torch

from bench.peers import peer_workload

_T_IMPORTED = time.time()
# pylint: enable=g-import-not-at-top,g-bad-import-order,wrong-import-position

NAME = 'pfl_fedavg'
LOCAL_BATCH_SIZE = 10
LOCAL_LEARNING_RATE = 1e-3
SERVER_LEARNING_RATE = 1.0
KERAS_LAYER_NORM_EPSILON = 1e-3

FLAGS = flags.FLAGS
flags.DEFINE_string('data', None, 'Workload .npz (x [P, n, 28, 28, 1] '
                    'float32, y [P, n] int).')
flags.DEFINE_integer('cohort', 50, 'Clients per round.')
flags.DEFINE_integer('rounds', 20, 'Timed rounds, after the warm-up rounds.')
flags.DEFINE_integer('warmup_rounds', 1, 'Untimed rounds first (>= 1; the '
                     'first ends start-up).')
flags.DEFINE_integer('seed', 0, 'Cohort sampling and initialisation seed.')
flags.DEFINE_string('output', None, 'Where to write the JSON record.')
flags.DEFINE_float('t0', None, 'Caller wall clock (time.time()) just before '
                   'it started this process; start-up is measured from it.')
flags.DEFINE_integer('torch_threads', None, 'torch.set_num_threads; default: '
                     "torch's own choice.")


class MnistPreferenceCNN(torch.nn.Module):
  """FedEmbed B.1's global encoder + head (no personal embedding), in torch.

  Mirrors `fedembed_mnist.build_preference_model(0)` layer for layer, with a
  ReLU after the first two LayerNorms (the project's reading). Its `loss` adds
  every training step's loss to `loss_sum`/`loss_steps` (read and reset by
  the caller) so the training loss is known without extra forward passes.
  """

  def __init__(self):
    super().__init__()
    nn = torch.nn
    eps = KERAS_LAYER_NORM_EPSILON
    self.encoder = nn.Sequential(
        nn.Conv2d(1, 16, 3, stride=2, padding=1),
        nn.LayerNorm([16, 14, 14], eps=eps), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1),
        nn.LayerNorm([32, 7, 7], eps=eps), nn.ReLU(),
        nn.Conv2d(32, 64, 7, stride=1, padding=0),
        nn.LayerNorm([64, 1, 1], eps=eps),
        nn.Flatten())
    self.head = nn.Linear(64, 2)
    for module in self.modules():  # Keras's default initialisers.
      if isinstance(module, (nn.Conv2d, nn.Linear)):
        nn.init.xavier_uniform_(module.weight)
        nn.init.zeros_(module.bias)
    self.reset_loss()

  def reset_loss(self):
    self.loss_sum = torch.zeros(())
    self.loss_steps = 0

  def forward(self, x):
    return self.head(self.encoder(x))

  def loss(self, x, y, eval=False):  # pylint: disable=redefined-builtin
    self.train(not eval)
    value = torch.nn.functional.cross_entropy(self(x), y)
    self.loss_sum += value.detach()
    self.loss_steps += 1
    return value

  @torch.no_grad()
  def metrics(self, x, y, eval=True):  # pylint: disable=redefined-builtin
    self.train(not eval)
    logits = self(x)
    loss = torch.nn.functional.cross_entropy(logits, y, reduction='sum')
    correct = (logits.argmax(-1) == y).sum()
    return {'loss': Weighted(loss.item(), len(y)),
            'accuracy': Weighted(correct.item(), len(y))}


def count_parameters(module: torch.nn.Module) -> int:
  return sum(p.numel() for p in module.parameters() if p.requires_grad)


class CohortSampler:
  """pfl user sampler drawing whole cohorts from `peer_workload.cohort_of`.

  pfl asks its `user_sampler` for one user id at a time; the simulated
  backend asks for exactly `cohort` ids per round (one worker, no
  overshoot), so ids are served cohort by cohort, round 1 first.
  """

  def __init__(self, population: int, cohort: int, seed: int):
    self.population, self.cohort, self.seed = population, cohort, seed
    self.round_num = 0
    self.cohorts = []  # Every cohort served, for tests and the record.
    self._pending = []

  def __call__(self) -> int:
    if not self._pending:
      self.round_num += 1
      ids = peer_workload.cohort_of(self.population, self.cohort,
                                    self.round_num, self.seed)
      self.cohorts.append(ids)
      self._pending = [int(i) for i in ids[::-1]]
    return self._pending.pop()


class RoundRecorder(TrainingProcessCallback):
  """Times each central iteration and reads the model's training loss.

  A round's time runs from the end of the previous callback (or of
  `on_train_begin`) to the start of this one, so the callback's own
  bookkeeping is not counted.
  """

  def __init__(self, module: MnistPreferenceCNN):
    self.module = module
    self.round_seconds = []
    self.round_cpu_seconds = []
    self.round_end_times = []
    self.train_losses = []
    self.rss_mib = []
    self._start = None
    self._cpu_start = None

  def on_train_begin(self, *, model):
    self.module.reset_loss()
    self._cpu_start = cpu_seconds()
    self._start = time.time()
    return Metrics()

  def after_central_iteration(self, aggregate_metrics, model, *,
                              central_iteration):
    end = time.time()
    cpu_end = cpu_seconds()
    self.round_seconds.append(end - self._start)
    self.round_cpu_seconds.append(cpu_end - self._cpu_start)
    self.round_end_times.append(end)
    steps = self.module.loss_steps
    self.train_losses.append(
        float(self.module.loss_sum) / steps if steps else float('nan'))
    self.module.reset_loss()
    self.rss_mib.append(current_rss_mib())
    self._cpu_start = cpu_seconds()
    self._start = time.time()
    return False, Metrics()


def cpu_seconds() -> float:
  """User + system CPU time of this process (all its threads)."""
  usage = resource.getrusage(resource.RUSAGE_SELF)
  return usage.ru_utime + usage.ru_stime


def current_rss_mib() -> float:
  try:
    with open('/proc/self/status', encoding='ascii') as f:
      for line in f:
        if line.startswith('VmRSS:'):
          return int(line.split()[1]) / 1024
  except OSError:
    pass
  return float('nan')


def process_start_time() -> float | None:
  """Wall-clock creation time of this process from /proc, or None."""
  try:
    with open('/proc/self/stat', encoding='ascii') as f:
      fields = f.read().rsplit(')', 1)[1].split()
    with open('/proc/uptime', encoding='ascii') as f:
      uptime = float(f.read().split()[0])
    now = time.time()
    started_after_boot = int(fields[19]) / os.sysconf('SC_CLK_TCK')
    return now - (uptime - started_after_boot)
  except (OSError, ValueError, IndexError):
    return None


def build_fedavg(x: torch.Tensor, y: torch.Tensor, cohort: int,
                 total_rounds: int, seed: int):
  """The pfl objects of a FedAvg simulation on per-user arrays x, y.

  Args:
    x: [population, n, 1, 28, 28] float32 tensor (channels first).
    y: [population, n] int64 tensor.
    cohort: users per round.
    total_rounds: central iterations to run (warm-up included).
    seed: initialisation and sampling seed.

  Returns:
    (algorithm, run_kwargs, module, sampler): call
    `algorithm.run(**run_kwargs)` to train.
  """
  population = x.shape[0]
  torch.manual_seed(seed)
  np.random.seed(seed)  # pfl draws its own per-user seeds from numpy.
  module = MnistPreferenceCNN()
  model = PyTorchModel(
      model=module, local_optimizer_create=torch.optim.Adam,
      central_optimizer=torch.optim.SGD(module.parameters(),
                                        lr=SERVER_LEARNING_RATE))
  sampler = CohortSampler(population, cohort, seed)
  users = {u: (x[u], y[u]) for u in range(population)}
  training_data = FederatedDataset.from_slices(users, sampler)
  backend = SimulatedBackend(training_data=training_data, val_data=None,
                             postprocessors=[WeightByDatapoints()])
  algorithm_params = NNAlgorithmParams(
      central_num_iterations=total_rounds,
      evaluation_frequency=total_rounds + 1,  # Only iteration 0 (pfl's rule).
      train_cohort_size=cohort, val_cohort_size=0)
  train_params = NNTrainHyperParams(
      local_num_epochs=1, local_learning_rate=LOCAL_LEARNING_RATE,
      local_batch_size=LOCAL_BATCH_SIZE)
  run_kwargs = dict(algorithm_params=algorithm_params, backend=backend,
                    model=model, model_train_params=train_params)
  return FederatedAveraging(), run_kwargs, module, sampler


def to_torch_layout(x: np.ndarray, y: np.ndarray):
  """Workload arrays as torch tensors: x [P, n, 1, 28, 28], y int64 [P, n].

  Users' data are handed to pfl as torch tensors, which it passes through
  unchanged (numpy arrays would be converted to float32 tensors every batch,
  labels included).
  """
  return (torch.from_numpy(np.ascontiguousarray(np.moveaxis(x, -1, 2))),
          torch.from_numpy(y.astype(np.int64)))


def build_record(*, cohort, rounds, warmup_rounds, examples_per_client,
                 recorder, module, t_script, t_imported, t_built, t0,
                 t_process) -> dict:
  """The JSON record from a finished run's timings."""
  timed = recorder.round_seconds[warmup_rounds:]
  seconds_per_round = sum(timed) / len(timed)
  timed_cpu = recorder.round_cpu_seconds[warmup_rounds:]
  cpu_seconds_per_round = sum(timed_cpu) / len(timed_cpu)
  first_round_end = recorder.round_end_times[0]
  origin = t0 if t0 is not None else (
      t_process if t_process is not None else t_script)
  kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  children_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
  record = {
      'name': NAME,
      'cohort': cohort,
      'client_updates_per_s': cohort / seconds_per_round,
      'examples_per_s': cohort * examples_per_client / seconds_per_round,
      'seconds_per_round': seconds_per_round,
      'seconds_per_round_median': float(np.median(timed)),
      'startup_s': first_round_end - origin,
      'startup_origin': ('t0' if t0 is not None else
                         'process' if t_process is not None else 'script'),
      'startup_from_script_s': first_round_end - t_script,
      'startup_from_process_s': (None if t_process is None
                                 else first_round_end - t_process),
      'startup_from_t0_s': None if t0 is None else first_round_end - t0,
      'interpreter_s': None if t_process is None else t_script - t_process,
      'imports_s': t_imported - t_script,
      'build_s': t_built - t_imported,
      'first_round_s': recorder.round_seconds[0],
      'cpu_seconds_per_round': cpu_seconds_per_round,
      'client_updates_per_cpu_s': cohort / cpu_seconds_per_round,
      'round_cpu_seconds': recorder.round_cpu_seconds,
      'rounds': rounds,
      'warmup_rounds': warmup_rounds,
      'round_seconds': recorder.round_seconds,
      'peak_rss_mib': kib / 1024,
      'children_peak_rss_mib': children_kib / 1024,
      'rss_after_first_round_mib': recorder.rss_mib[0],
      'rss_end_mib': recorder.rss_mib[-1],
      'train_loss_first_round': recorder.train_losses[0],
      'train_loss_last_round': recorder.train_losses[-1],
      'train_loss_per_round': recorder.train_losses,
      'examples_per_client': examples_per_client,
      'model_parameters': count_parameters(module),
      'torch_threads': torch.get_num_threads(),
      'torch_version': torch.__version__,
      'pfl_version': pfl.__version__,
      'local_batch_size': LOCAL_BATCH_SIZE,
      'cpu_count': os.cpu_count(),
      'load_average_1m': os.getloadavg()[0],
  }
  return record


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if not FLAGS.data or not FLAGS.output:
    raise app.UsageError('--data and --output are required')
  if FLAGS.rounds < 1:
    raise app.UsageError(f'--rounds must be >= 1; got {FLAGS.rounds}')
  if FLAGS.warmup_rounds < 1:
    raise app.UsageError('--warmup_rounds must be >= 1 (the first round '
                         f'ends start-up); got {FLAGS.warmup_rounds}')
  t_process = process_start_time()
  if FLAGS.torch_threads is not None:
    if FLAGS.torch_threads < 1:
      raise app.UsageError('--torch_threads must be >= 1')
    torch.set_num_threads(FLAGS.torch_threads)
  x, y = peer_workload.load_workload(FLAGS.data)
  if not 1 <= FLAGS.cohort <= x.shape[0]:
    raise app.UsageError(f'--cohort must be in [1, population={x.shape[0]}]; '
                         f'got {FLAGS.cohort}')
  x, y = to_torch_layout(x, y)
  total = FLAGS.warmup_rounds + FLAGS.rounds
  algorithm, run_kwargs, module, _ = build_fedavg(x, y, FLAGS.cohort, total,
                                                  FLAGS.seed)
  recorder = RoundRecorder(module)
  t_built = time.time()
  algorithm.run(**run_kwargs, callbacks=[recorder])
  record = build_record(
      cohort=FLAGS.cohort, rounds=FLAGS.rounds,
      warmup_rounds=FLAGS.warmup_rounds, examples_per_client=x.shape[1],
      recorder=recorder, module=module, t_script=_T_SCRIPT,
      t_imported=_T_IMPORTED, t_built=t_built, t0=FLAGS.t0,
      t_process=t_process)
  os.makedirs(os.path.dirname(os.path.abspath(FLAGS.output)), exist_ok=True)
  with open(FLAGS.output, 'w', encoding='utf-8') as f:
    json.dump(record, f, indent=2)
  print(f"{NAME} cohort {FLAGS.cohort}: {record['seconds_per_round']:.3f} "
        f"s/round, {record['client_updates_per_s']:.1f} client updates/s, "
        f"start-up {record['startup_s']:.1f} s, peak RSS "
        f"{record['peak_rss_mib']:.0f} MiB, train loss "
        f"{record['train_loss_first_round']:.3f} -> "
        f"{record['train_loss_last_round']:.3f}", flush=True)


if __name__ == '__main__':
  app.run(main)
