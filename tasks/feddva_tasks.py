"""FedDVA's MNIST tasks: `marked_mnist` and `label_skew_mnist`.

Both are built deterministically from the MNIST IDX files (`mnist_io`) and a
seed; nothing is written to disk.

* `marked_mnist` (paper section V.A, Figure 3a; "heterogeneous inputs"):
  MNIST images are allocated uniformly at random to clients and every image
  of client k carries a mark of client k's *type*, drawn over the digit as
  max(digit, mark). Types 0-3 are the paper's: a horizontal sinusoid, an
  ellipse, a vertical sinusoid and none (plain digits). For more clients,
  type k >= 4 is a sinusoid at angle 37 k degrees with 1 + k mod 3 periods
  across the image (so any number of clients has distinct types). Lines are
  anti-aliased, about 1.5 pixels wide, intensity 1.

  `marks='varied'` (the default; our reading of the paper): each image's
  mark is drawn with its own parameter, the sinusoids' phase uniform in
  [0, 2 pi) and the ellipse's rotation uniform in [0, pi), seeded by (seed,
  client, split). The paper says the marks are client-specific and that in
  the reconstructions "client-specific marks will vary along with the
  changes in c" (Figure 3b / 10), which needs marks that vary within a
  client; the authors' public code (pysleepy/FedDVA, read, not copied) draws
  every image's sinusoid with a random phase and its ellipse with a random
  rotation. `marks='fixed'` draws one identical mark on every image of a
  client (a private decoder can then draw the mark by itself and no latent
  needs it). The per-image parameter is kept
  as an angle on the circle (`ClientData.train_mark` / `test_mark`: the
  phase, or twice the rotation, since an ellipse turned by pi is itself;
  NaN for plain digits), so probes can ask which latent carries it.
  `marks='none'` is the control: the same clients and digits with no mark
  on any image (every angle NaN), for calibrating the probes.
* `label_skew_mnist` (appendix F; "heterogeneous outputs"): after Hsu et al.
  (2019), client k's class proportions are q_k ~ Dirichlet(alpha * 1_10)
  (alpha = 0.5 by default); its training examples are drawn by those
  proportions without replacement from shuffled per-class pools of the
  training split (disjoint across clients; an error if a class runs out), and
  its test examples likewise from the test split, independently per client
  (test sets of different clients may share images).

Each client has train and test arrays: x float32 [n, 28, 28, 1] in [0, 1],
y int32 [n].
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import tensorflow as tf

from tasks import mnist_io

BASE_MARKS = ('horizontal_sinusoid', 'ellipse', 'vertical_sinusoid', 'none')
MARK_MODES = ('varied', 'fixed', 'none')


@dataclasses.dataclass
class ClientData:
  """A client's arrays. `train_mark` / `test_mark`: each image's mark
  parameter as an angle in [0, 2 pi) (NaN: no mark), or None where the task
  has no marks."""
  train_x: np.ndarray
  train_y: np.ndarray
  test_x: np.ndarray
  test_y: np.ndarray
  train_mark: np.ndarray | None = None
  test_mark: np.ndarray | None = None


@dataclasses.dataclass
class FeddvaTask:
  """A list of clients with train/test arrays, and their names."""
  name: str
  clients: list[ClientData]
  client_names: list[str]

  @property
  def num_clients(self) -> int:
    return len(self.clients)

  def dataset(self, client: int, split: str, batch_size: int,
              epochs: int = 1, shuffle_seed: int | None = None
              ) -> tf.data.Dataset:
    """The client's batches of OrderedDict(x, y)."""
    if split not in ('train', 'test'):
      raise ValueError(f'split must be train or test, got {split!r}')
    data = self.clients[client]
    x, y = ((data.train_x, data.train_y) if split == 'train' else
            (data.test_x, data.test_y))
    ds = tf.data.Dataset.from_tensor_slices(collections.OrderedDict(x=x, y=y))
    if shuffle_seed is not None:
      ds = ds.shuffle(len(y), seed=shuffle_seed, reshuffle_each_iteration=True)
    return ds.repeat(epochs).batch(batch_size)


def mark_name(k: int) -> str:
  if k < len(BASE_MARKS):
    return BASE_MARKS[k]
  return f'sinusoid_{(37 * k) % 180}deg_{1 + k % 3}periods'


def _line_intensity(distance: np.ndarray, width: float = 1.5) -> np.ndarray:
  return np.clip(1.0 - np.abs(distance) / width + 0.5, 0.0, 1.0)


def render_mark(k: int, size: int = 28, angle: float = 0.0) -> np.ndarray:
  """A mark of type k, float32 [size, size] in [0, 1] (0 everywhere for
  'none').

  `angle` (radians) is the mark's parameter: the sinusoids' phase, or twice
  the ellipse's rotation (so that every angle in [0, 2 pi) is a distinct
  ellipse). angle 0 is the fixed mark of `marks='fixed'`.
  """
  if k < 0:
    raise ValueError(f'mark index must be >= 0, got {k}')
  if not np.isfinite(angle):
    raise ValueError(f'mark angle must be finite, got {angle}')
  yy, xx = np.mgrid[0:size, 0:size].astype(np.float64)
  center, amplitude = (size - 1) / 2.0, size / 7.0
  omega = 2 * np.pi * 2 / size  # Two periods across the image.
  name = mark_name(k)
  if name == 'none':
    return np.zeros((size, size), np.float32)
  if name == 'ellipse':
    a, b = size * 0.42, size * 0.30
    dx, dy = xx - center, yy - center
    if angle:
      rot = angle / 2.0
      dx, dy = (dx * np.cos(rot) + dy * np.sin(rot),
                -dx * np.sin(rot) + dy * np.cos(rot))
    r = np.sqrt((dx / a) ** 2 + (dy / b) ** 2)
    # Distance to the outline, approximately, in pixels.
    return _line_intensity((r - 1.0) * min(a, b)).astype(np.float32)
  if name == 'horizontal_sinusoid':
    u, v = xx, yy
  elif name == 'vertical_sinusoid':
    u, v = yy, xx
  else:
    tilt = np.deg2rad((37 * k) % 180)
    omega = 2 * np.pi * (1 + k % 3) / size
    u = (xx - center) * np.cos(tilt) + (yy - center) * np.sin(tilt) + center
    v = -(xx - center) * np.sin(tilt) + (yy - center) * np.cos(tilt) + center
  curve = center + amplitude * np.sin(omega * u + angle)
  slope = amplitude * omega * np.cos(omega * u + angle)
  distance = (v - curve) / np.sqrt(1.0 + slope ** 2)
  return _line_intensity(distance).astype(np.float32)


def _as_float(images: np.ndarray) -> np.ndarray:
  return (images.astype(np.float32) / 255.0)[..., None]


def _check_positive(**values):
  for name, value in values.items():
    if not isinstance(value, (int, np.integer)) or value < 1:
      raise ValueError(f'{name} must be a positive integer, got {value!r}')


def mark_angles(k: int, n: int, marks: str, rng: np.random.Generator
                ) -> np.ndarray:
  """The mark parameters of n images of client k (see the module doc)."""
  if marks == 'none' or mark_name(k) == 'none':
    return np.full(n, np.nan)
  if marks == 'fixed':
    return np.zeros(n)
  return rng.uniform(0.0, 2 * np.pi, size=n)


def _marked(images: np.ndarray, k: int, angles: np.ndarray) -> np.ndarray:
  x = _as_float(images)
  if np.all(np.isnan(angles)):  # Type 'none', or marks='none'.
    return x
  if np.all(angles == angles[0]):  # One mark for all (marks='fixed').
    return np.maximum(x, render_mark(k, x.shape[1], angles[0])[..., None])
  marks = np.stack([render_mark(k, x.shape[1], a) for a in angles])
  return np.maximum(x, marks[..., None])


def marked_mnist(data_dir: str | None, *, num_clients: int = 4,
                 train_per_client: int = 500, test_per_client: int = 200,
                 seed: int = 0, marks: str = 'varied') -> FeddvaTask:
  """MNIST clients whose images carry marks of a client-specific type."""
  _check_positive(num_clients=num_clients, train_per_client=train_per_client,
                  test_per_client=test_per_client)
  if marks not in MARK_MODES:
    raise ValueError(f'marked_mnist: marks must be one of {MARK_MODES}, got '
                     f'{marks!r}')
  train_x, train_y = mnist_io.load_mnist(data_dir, 'train')
  test_x, test_y = mnist_io.load_mnist(data_dir, 'test')
  for split, n_total, per in (('train', len(train_y), train_per_client),
                              ('test', len(test_y), test_per_client)):
    if num_clients * per > n_total:
      raise ValueError(
          f'marked_mnist: {num_clients} clients x {per} {split} examples '
          f'exceed the {n_total} MNIST {split} images')
  rng = np.random.default_rng([seed, 7])
  train_order = rng.permutation(len(train_y))
  test_order = rng.permutation(len(test_y))
  clients = []
  for k in range(num_clients):
    tr = train_order[k * train_per_client:(k + 1) * train_per_client]
    te = test_order[k * test_per_client:(k + 1) * test_per_client]
    tr_angle = mark_angles(k, len(tr), marks,
                           np.random.default_rng([seed, 17, k, 0]))
    te_angle = mark_angles(k, len(te), marks,
                           np.random.default_rng([seed, 17, k, 1]))
    clients.append(ClientData(
        train_x=_marked(train_x[tr], k, tr_angle),
        train_y=train_y[tr].astype(np.int32),
        test_x=_marked(test_x[te], k, te_angle),
        test_y=test_y[te].astype(np.int32),
        train_mark=tr_angle, test_mark=te_angle))
  names = [mark_name(k) if marks != 'none' else 'no mark'
           for k in range(num_clients)]
  return FeddvaTask('marked_mnist', clients, names)


def dirichlet_proportions(num_clients: int, alpha: float, seed: int,
                          num_classes: int = 10) -> np.ndarray:
  """[num_clients, num_classes] class proportions, rows ~ Dir(alpha 1)."""
  if not alpha > 0:
    raise ValueError(f'dirichlet alpha must be > 0, got {alpha}')
  rng = np.random.default_rng([seed, 11])
  return rng.dirichlet(alpha * np.ones(num_classes), size=num_clients)


def _counts(proportions: np.ndarray, n: int) -> np.ndarray:
  """Integer class counts summing to n (largest remainders)."""
  raw = proportions * n
  counts = np.floor(raw).astype(int)
  for i in np.argsort(-(raw - counts))[:n - counts.sum()]:
    counts[i] += 1
  return counts


def label_skew_mnist(data_dir: str | None, *, num_clients: int = 20,
                     train_per_client: int = 300, test_per_client: int = 100,
                     alpha: float = 0.5, seed: int = 0) -> FeddvaTask:
  """MNIST over clients with Dirichlet(alpha) label proportions."""
  _check_positive(num_clients=num_clients, train_per_client=train_per_client,
                  test_per_client=test_per_client)
  train_x, train_y = mnist_io.load_mnist(data_dir, 'train')
  test_x, test_y = mnist_io.load_mnist(data_dir, 'test')
  proportions = dirichlet_proportions(num_clients, alpha, seed)
  rng = np.random.default_rng([seed, 13])
  pools = {c: list(rng.permutation(np.flatnonzero(train_y == c)))
           for c in range(10)}
  test_pools = {c: np.flatnonzero(test_y == c) for c in range(10)}
  clients = []
  for k in range(num_clients):
    tr, te = [], []
    for c, (n_tr, n_te) in enumerate(zip(
        _counts(proportions[k], train_per_client),
        _counts(proportions[k], test_per_client))):
      if n_tr > len(pools[c]):
        raise ValueError(
            f'label_skew_mnist: class {c} has too few training images left '
            f'for client {k} (needs {n_tr}); lower train_per_client')
      tr += [pools[c].pop() for _ in range(n_tr)]
      te += list(rng.choice(test_pools[c], size=n_te, replace=False))
    tr, te = np.array(tr, int), np.array(te, int)
    tr, te = tr[rng.permutation(len(tr))], te[rng.permutation(len(te))]
    clients.append(ClientData(
        train_x=_as_float(train_x[tr]), train_y=train_y[tr].astype(np.int32),
        test_x=_as_float(test_x[te]), test_y=test_y[te].astype(np.int32)))
  return FeddvaTask('label_skew_mnist', clients,
                    [f'client_{k}' for k in range(num_clients)])


TASKS = {'marked_mnist': marked_mnist, 'label_skew_mnist': label_skew_mnist}


def build_task(name: str, data_dir: str | None, **kwargs) -> FeddvaTask:
  if name not in TASKS:
    raise ValueError(f'unknown FedDVA task {name!r}; known: {sorted(TASKS)}')
  return TASKS[name](data_dir, **kwargs)
