"""FedDVA's MNIST tasks: `marked_mnist` and `label_skew_mnist`.

Both are built deterministically from the MNIST IDX files (`mnist_io`) and a
seed; nothing is written to disk.

* `marked_mnist` (paper section V.A, Figure 3a; "heterogeneous inputs"):
  MNIST images are allocated uniformly at random to clients and every image
  of client k carries client k's mark, drawn over the digit as
  max(digit, mark). Marks 0-3 are the paper's: a horizontal sinusoid, an
  ellipse, a vertical sinusoid and none (plain digits). For more clients,
  mark k >= 4 is a sinusoid at angle 37 k degrees with 1 + k mod 3 periods
  across the image (so any number of clients has distinct marks). Lines are
  anti-aliased, about 1.5 pixels wide, intensity 1.
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


@dataclasses.dataclass
class ClientData:
  train_x: np.ndarray
  train_y: np.ndarray
  test_x: np.ndarray
  test_y: np.ndarray


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


def render_mark(k: int, size: int = 28) -> np.ndarray:
  """Client k's mark, float32 [size, size] in [0, 1] (0 everywhere for 'none')."""
  if k < 0:
    raise ValueError(f'mark index must be >= 0, got {k}')
  yy, xx = np.mgrid[0:size, 0:size].astype(np.float64)
  center, amplitude = (size - 1) / 2.0, size / 7.0
  omega = 2 * np.pi * 2 / size  # Two periods across the image.
  name = mark_name(k)
  if name == 'none':
    return np.zeros((size, size), np.float32)
  if name == 'ellipse':
    a, b = size * 0.42, size * 0.30
    r = np.sqrt(((xx - center) / a) ** 2 + ((yy - center) / b) ** 2)
    # Distance to the outline, approximately, in pixels.
    return _line_intensity((r - 1.0) * min(a, b)).astype(np.float32)
  if name == 'horizontal_sinusoid':
    u, v = xx, yy
  elif name == 'vertical_sinusoid':
    u, v = yy, xx
  else:
    angle = np.deg2rad((37 * k) % 180)
    omega = 2 * np.pi * (1 + k % 3) / size
    u = (xx - center) * np.cos(angle) + (yy - center) * np.sin(angle) + center
    v = -(xx - center) * np.sin(angle) + (yy - center) * np.cos(angle) + center
  curve = center + amplitude * np.sin(omega * u)
  slope = amplitude * omega * np.cos(omega * u)
  distance = (v - curve) / np.sqrt(1.0 + slope ** 2)
  return _line_intensity(distance).astype(np.float32)


def _as_float(images: np.ndarray) -> np.ndarray:
  return (images.astype(np.float32) / 255.0)[..., None]


def _check_positive(**values):
  for name, value in values.items():
    if not isinstance(value, (int, np.integer)) or value < 1:
      raise ValueError(f'{name} must be a positive integer, got {value!r}')


def marked_mnist(data_dir: str | None, *, num_clients: int = 4,
                 train_per_client: int = 500, test_per_client: int = 200,
                 seed: int = 0) -> FeddvaTask:
  """MNIST clients whose images carry a client-specific mark."""
  _check_positive(num_clients=num_clients, train_per_client=train_per_client,
                  test_per_client=test_per_client)
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
    mark = render_mark(k)[..., None]
    tr = train_order[k * train_per_client:(k + 1) * train_per_client]
    te = test_order[k * test_per_client:(k + 1) * test_per_client]
    clients.append(ClientData(
        train_x=np.maximum(_as_float(train_x[tr]), mark),
        train_y=train_y[tr].astype(np.int32),
        test_x=np.maximum(_as_float(test_x[te]), mark),
        test_y=test_y[te].astype(np.int32)))
  return FeddvaTask('marked_mnist', clients,
                    [mark_name(k) for k in range(num_clients)])


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
