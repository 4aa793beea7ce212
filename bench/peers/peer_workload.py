"""The benchmark workload as the peer scripts see it (numpy only).

`binaries.benchmark` writes one `.npz` per run with `x` [population, n, 28,
28, 1] float32 and `y` [population, n] int32 (n = 20 examples per client;
extra arrays such as `type` are ignored here). This module reads that file,
draws each round's cohort exactly as the project does
(`tff_personal.core.training_loop.sample_clients`, 'fixed_size' scheme, which
cannot be imported here: the peer environment has no TensorFlow; a test checks
the two agree), and writes small *learnable* workloads of the same layout for
testing the peers without the benchmark.

`make_test_workload.py` writes such a test workload from the command line.
"""

from __future__ import annotations

import numpy as np

IMAGE_SHAPE = (28, 28, 1)


def cohort_of(population: int, cohort: int, round_num: int,
              seed: int) -> np.ndarray:
  """Sorted ids of round `round_num`'s cohort: uniform, without replacement.

  A pure function of (seed, round_num); identical to
  `training_loop.sample_clients(population, cohort, round_num, seed)`.
  """
  if not 1 <= cohort <= population:
    raise ValueError(f'cohort must be in [1, population={population}]; got '
                     f'{cohort}')
  rng = np.random.default_rng([seed, round_num, 0x5A3])
  return np.sort(rng.choice(population, cohort, replace=False))


def load_workload(path: str) -> tuple[np.ndarray, np.ndarray]:
  """Reads and validates `x` [P, n, 28, 28, 1] float32 and `y` [P, n] ints."""
  with np.load(path) as data:
    missing = {'x', 'y'} - set(data.files)
    if missing:
      raise ValueError(f'{path}: missing arrays {sorted(missing)}; has '
                       f'{data.files}')
    x, y = data['x'], data['y']
  if x.ndim != 5 or x.shape[2:] != IMAGE_SHAPE:
    raise ValueError(f'{path}: x must be [population, n, 28, 28, 1]; got '
                     f'shape {x.shape}')
  if x.dtype != np.float32:
    raise ValueError(f'{path}: x must be float32; got {x.dtype}')
  if y.shape != x.shape[:2]:
    raise ValueError(f'{path}: y must be [population, n] = {x.shape[:2]}; '
                     f'got shape {y.shape}')
  if not np.issubdtype(y.dtype, np.integer):
    raise ValueError(f'{path}: y must be integer labels; got {y.dtype}')
  if y.size and (y.min() < 0 or y.max() > 1):
    raise ValueError(f'{path}: labels must be in {{0, 1}}; got range '
                     f'[{y.min()}, {y.max()}]')
  return x, y


def make_learnable_workload(population: int, examples_per_client: int,
                            seed: int) -> tuple[np.ndarray, np.ndarray]:
  """Images whose label is visible: class 1 is brighter in the top half.

  Pixels are uniform noise in [0, 0.6) plus 0.4 on the top (label 1) or the
  bottom (label 0) half, so a CNN can learn the labels within a few rounds.
  """
  rng = np.random.default_rng(seed)
  y = rng.integers(0, 2, (population, examples_per_client)).astype(np.int32)
  x = 0.6 * rng.random((population, examples_per_client) + IMAGE_SHAPE,
                       dtype=np.float32)
  half = IMAGE_SHAPE[0] // 2
  x[..., :half, :, :] += 0.4 * (y == 1)[..., None, None, None]
  x[..., half:, :, :] += 0.4 * (y == 0)[..., None, None, None]
  return x.astype(np.float32), y
