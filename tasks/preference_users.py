"""Users of a K-way preference task, for any labelled sample pool.

The construction of `mnist_preference` (see its module docstring for the
full reading of the paper), for K sub-populations instead of MNIST's ten:

* Sub-population sizes from percent shares, by largest-remainder rounding
  (ties to the smaller index), so they sum to `num_users`.
* A user's samples: half of each split are positives (its own type), half
  negatives, each negative's type drawn uniformly from the K - 1 others.
* Every slot asking for type k is filled by cycling through type k's samples
  in seeded random permutations (a fresh one per pass), users in a seeded
  random order, so every sample is used once before any is used again; a
  user's samples are all distinct (train and test together).
* Users are numbered in a seeded random order.

Everything is a deterministic function of `seed`.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Users:
  """Which samples each user holds, and its labels.

  Attributes:
    train_idx: int32 (U, train_per_user) indices into the sample pool.
    test_idx: int32 (U, test_per_user).
    train_y: int32 (U, train_per_user), 1 iff the sample's type is the
      user's sub-population.
    train_type: int32 (U, train_per_user) the sample's type.
    test_y, test_type: the same for the test samples.
    subpopulation: int32 (U,) each user's preferred type.
  """
  train_idx: np.ndarray
  test_idx: np.ndarray
  train_y: np.ndarray
  train_type: np.ndarray
  test_y: np.ndarray
  test_type: np.ndarray
  subpopulation: np.ndarray


def subpopulation_sizes(num_users: int, percent) -> np.ndarray:
  """Users per sub-population from integer percent shares summing to 100."""
  percent = np.asarray(percent, np.int64)
  if percent.sum() != 100 or percent.min() < 0:
    raise ValueError(f'percent shares must be >= 0 and sum to 100, got '
                     f'{percent.tolist()}')
  quota = num_users * percent  # Exact, in hundredths of a user.
  sizes = quota // 100
  shortfall = num_users - int(sizes.sum())
  order = np.argsort(-(quota % 100), kind='stable')
  sizes[order[:shortfall]] += 1
  return sizes


def sample_types(subpopulation: np.ndarray, count: int, num_types: int,
                 rng: np.random.Generator) -> np.ndarray:
  """Types of `count` samples per user: half its own, half uniform others."""
  half = count // 2
  own = np.repeat(subpopulation[:, np.newaxis], half, axis=1)
  other = rng.integers(0, num_types - 1, size=(subpopulation.shape[0], half))
  other += other >= subpopulation[:, np.newaxis]  # Skip the user's type.
  return rng.permuted(np.concatenate([own, other], axis=1), axis=1)


def cycle_fill(pool: np.ndarray, block_starts: np.ndarray, total: int,
               rng: np.random.Generator) -> np.ndarray:
  """Fills `total` slots from `pool` by passes over fresh permutations.

  Slots `block_starts[i]:block_starts[i + 1]` belong to one user and get
  distinct samples: when a block straddles two passes, the samples it got in
  the old pass are moved to the end of the new pass's permutation.
  """
  n = pool.shape[0]
  out = np.empty(total, np.int64)
  perm = rng.permutation(pool)
  pos = 0
  while True:
    end = min(pos + n, total)
    out[pos:end] = perm[:end - pos]
    if end == total:
      return out
    block = np.searchsorted(block_starts, end, side='right') - 1
    recent = out[block_starts[block]:end]
    perm = rng.permutation(pool)
    if recent.size:
      clash = np.isin(perm, recent)
      perm = np.concatenate([perm[~clash], perm[clash]])
    pos = end


def assign_samples(types: np.ndarray, labels: np.ndarray, num_types: int,
                   rng: np.random.Generator, source: str = 'the pool',
                   noun: str = 'type') -> np.ndarray:
  """Picks a sample of the requested type for every slot.

  Args:
    types: int (U, S) the type each slot needs.
    labels: (N,) type of each sample of the pool.
    num_types: K.
    rng: Random generator.
    source: Name of the pool, for error messages.
    noun: What a type is called in error messages (MNIST: 'digit').

  Returns:
    int32 (U, S) sample indices; a row's indices are distinct.

  Raises:
    ValueError: A type has fewer samples than one user needs.
  """
  num_users, slots = types.shape
  flat_type = types.ravel()
  flat_user = np.repeat(np.arange(num_users), slots)
  user_rank = rng.permutation(num_users)
  order = np.lexsort((user_rank[flat_user], flat_type))
  sorted_type = flat_type[order]
  sorted_user = flat_user[order]
  bounds = np.searchsorted(sorted_type, np.arange(num_types + 1))
  filled = np.empty(order.shape[0], np.int64)
  for k in range(num_types):
    lo, hi = int(bounds[k]), int(bounds[k + 1])
    if lo == hi:
      continue
    users = sorted_user[lo:hi]
    block_starts = np.flatnonzero(np.r_[True, users[1:] != users[:-1]])
    largest = int(np.diff(np.r_[block_starts, hi - lo]).max())
    pool = np.flatnonzero(labels == k)
    if pool.shape[0] < largest:
      raise ValueError(f'{source} has {pool.shape[0]} samples of {noun} '
                       f'{k}, but a user needs {largest} distinct ones.')
    filled[lo:hi] = cycle_fill(pool, block_starts, hi - lo, rng)
  result = np.empty_like(filled)
  result[order] = filled
  return result.reshape(num_users, slots).astype(np.int32)


def check_count(value, name: str) -> None:
  """A per-user sample count: a positive even int (half positives)."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise ValueError(f'{name} must be an int, got {value!r}.')
  if value <= 0 or value % 2:
    raise ValueError(f'{name} must be a positive even number (half '
                     f'positives, half negatives), got {value}.')


def frozen(array: np.ndarray) -> np.ndarray:
  """A read-only contiguous copy-or-view of `array`."""
  array = np.ascontiguousarray(array)
  array.setflags(write=False)
  return array


def make_users(labels: np.ndarray, num_types: int, percent, *,
               num_users: int, train_per_user: int, test_per_user: int,
               seed: int) -> Users:
  """Builds the users over a pool of samples labelled 0..num_types-1.

  Args:
    labels: (N,) the type of every sample.
    num_types: K >= 2.
    percent: K integer percent shares of the sub-populations.
    num_users: U.
    train_per_user: Train samples per user (even).
    test_per_user: Test samples per user (even).
    seed: Seed.

  Returns:
    The `Users`.

  Raises:
    ValueError: Bad argument; the message names it.
  """
  labels = np.asarray(labels)
  if num_types < 2:
    raise ValueError(f'num_types must be >= 2, got {num_types}')
  if labels.ndim != 1 or (labels.size and (
      labels.min() < 0 or labels.max() >= num_types)):
    raise ValueError(f'labels must be a vector of types in 0..{num_types - 1}')
  if len(percent) != num_types:
    raise ValueError(f'need {num_types} percent shares, got {len(percent)}')
  if (isinstance(num_users, bool) or
      not isinstance(num_users, (int, np.integer)) or num_users <= 0):
    raise ValueError(f'num_users must be a positive int, got {num_users!r}.')
  check_count(train_per_user, 'train_per_user')
  check_count(test_per_user, 'test_per_user')
  if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
    raise ValueError(f'seed must be an int, got {seed!r}.')
  sizes = subpopulation_sizes(int(num_users), percent)
  if sizes.min() == 0:
    raise ValueError(
        f'num_users={num_users} leaves sub-population(s) '
        f'{np.flatnonzero(sizes == 0).tolist()} without users; every '
        'sub-population needs at least one user.')
  rng = np.random.default_rng(seed)
  subpopulation = rng.permutation(np.repeat(np.arange(num_types), sizes))
  train_types = sample_types(subpopulation, train_per_user, num_types, rng)
  test_types = sample_types(subpopulation, test_per_user, num_types, rng)
  idx = assign_samples(np.concatenate([train_types, test_types], axis=1),
                       labels, num_types, rng)
  train_idx, test_idx = idx[:, :train_per_user], idx[:, train_per_user:]
  train_type = labels[train_idx].astype(np.int32)
  test_type = labels[test_idx].astype(np.int32)
  own = subpopulation[:, np.newaxis]
  return Users(
      train_idx=frozen(train_idx), test_idx=frozen(test_idx),
      train_y=frozen((train_type == own).astype(np.int32)),
      train_type=frozen(train_type),
      test_y=frozen((test_type == own).astype(np.int32)),
      test_type=frozen(test_type),
      subpopulation=frozen(subpopulation.astype(np.int32)))
