"""The FedEmbed MNIST preference task (paper section 4.2).

Every user prefers one digit k in 0..9, its *sub-population*. A user holds 30
samples, 20 for training and 10 for testing; half of each split are positives
(label y=1: an image of digit k) and half negatives (y=0: an image of another
digit, each negative's digit drawn uniformly at random from the 9 others).
Every sample also carries its digit as the "type" label m.

Readings of the paper that this module makes (the paper leaves them open):

* Image reuse. "We use all 60,000 training MNIST images for a total of 900
  users per sub-population": 9,000 users x 30 samples = 270,000 sample slots
  for 60,000 images, so images are necessarily shared by several users. Each
  slot first gets a digit (the user's digit for positives, a uniform other
  digit for negatives); then, digit by digit, the slots asking for that digit
  are taken user by user (users in a seeded random order, a user's slots
  consecutive) and filled by cycling through that digit's images in a seeded
  random permutation, drawing a fresh permutation for every pass. So every
  image of a digit is used once before any is used again, every image is used
  as soon as a digit is asked for at least as often as it has images (with
  9,000 balanced users each digit fills ~27,000 slots, so each image is used
  about 4.5 times), and no image occurs twice within one user: when a user's
  slots straddle two passes, the images it got from the old pass are moved to
  the end of the new permutation.
* Test split. As in the paper, both a user's train and test samples come from
  the MNIST *train* split. A user's test images are disjoint from its own
  train images (all 30 of a user's images are distinct), but they can be
  other users' train images, so the test set measures a user's preference on
  samples that user has not trained on, not on images no client has seen.
  `eval_source='mnist_test'` (in `load_task_data`; `eval_images`/`eval_labels`
  in `make_preference_data`) draws the test samples from the t10k split
  instead, by the same scheme.
* Populations. 'balanced': equal users per digit; 'imbalanced': digit 0 25%,
  1 15%, 2-5 10% each, 6-9 5% each. Counts are rounded with largest remainders
  (ties to the smaller digit) so they sum to `num_users`; every sub-population
  must get at least one user (num_users >= 10 balanced, >= 13 imbalanced).
  Users are numbered in a seeded random order, not grouped by sub-population.

Memory: the data keeps the uint8 images once plus int32 image indices per user
(`train_idx`, `test_idx`) and materialises float32 pixels per client (in
`user_arrays` / `client_dataset`), instead of 9,000 x 30 x 784 float32 (847
MB). `train_x` / `test_x` still exist but build the full float32 arrays on every
access. Everything is a deterministic function of `seed`.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import tensorflow as tf

from tasks import mnist_io
from tasks import preference_users

NUM_SUBPOPULATIONS = 10
IMAGE_SHAPE = (28, 28, 1)
SPLITS = ('train', 'test')
EVAL_SOURCES = ('mnist_train', 'mnist_test')

# Sub-population shares in percent, by digit.
POPULATION_PERCENT = {
    'balanced': (10,) * 10,
    'imbalanced': (25, 15, 10, 10, 10, 10, 5, 5, 5, 5),
}


@dataclasses.dataclass(frozen=True, eq=False)
class PreferenceData:
  """Users' preference data, as image indices plus per-sample labels.

  Attributes:
    train_images: uint8 (N, 28, 28), the images `train_idx` points into.
    test_images: uint8 (M, 28, 28), the images `test_idx` points into (the
      same array as `train_images` unless test samples come from t10k).
    train_idx: int32 (U, train_per_user) image indices of each user's train
      samples.
    test_idx: int32 (U, test_per_user) image indices of its test samples.
    train_y: int32 (U, train_per_user) preference label, 1 iff the digit is
      the user's sub-population.
    train_type: int32 (U, train_per_user) the sample's digit.
    test_y: int32 (U, test_per_user), as `train_y`.
    test_type: int32 (U, test_per_user), as `train_type`.
    subpopulation: int32 (U,) each user's preferred digit.
    num_subpopulations: 10.
  """
  train_images: np.ndarray
  test_images: np.ndarray
  train_idx: np.ndarray
  test_idx: np.ndarray
  train_y: np.ndarray
  train_type: np.ndarray
  test_y: np.ndarray
  test_type: np.ndarray
  subpopulation: np.ndarray
  num_subpopulations: int = NUM_SUBPOPULATIONS

  @property
  def num_users(self) -> int:
    return int(self.subpopulation.shape[0])

  @property
  def train_x(self) -> np.ndarray:
    """float32 (U, train_per_user, 28, 28, 1) in [0, 1], built per access."""
    return _to_float(self.train_images[self.train_idx])

  @property
  def test_x(self) -> np.ndarray:
    """float32 (U, test_per_user, 28, 28, 1) in [0, 1], built per access."""
    return _to_float(self.test_images[self.test_idx])

  def user_arrays(self, user: int,
                  split: str = 'train'
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Returns one user's `(x, y, type)` for `split` ('train' or 'test').

    Args:
      user: User index in [0, num_users).
      split: 'train' or 'test'.

    Returns:
      x: float32 (n, 28, 28, 1) in [0, 1]; y, type: int32 (n,).
    """
    if split not in SPLITS:
      raise ValueError(f'split must be one of {SPLITS}, got {split!r}.')
    if not 0 <= user < self.num_users:
      raise ValueError(
          f'user must be in [0, {self.num_users}), got {user}.')
    if split == 'train':
      return (_to_float(self.train_images[self.train_idx[user]]),
              self.train_y[user], self.train_type[user])
    return (_to_float(self.test_images[self.test_idx[user]]),
            self.test_y[user], self.test_type[user])


def _to_float(images: np.ndarray) -> np.ndarray:
  return (images.astype(np.float32) / np.float32(255.0))[..., np.newaxis]


def subpopulation_sizes(num_users: int, population: str) -> np.ndarray:
  """Users per digit, by largest-remainder rounding (ties to smaller digits).

  Args:
    num_users: Total number of users.
    population: 'balanced' or 'imbalanced'.

  Returns:
    int64 (10,) counts summing to `num_users`.
  """
  if population not in POPULATION_PERCENT:
    raise ValueError(f'population must be one of {sorted(POPULATION_PERCENT)}'
                     f', got {population!r}.')
  return preference_users.subpopulation_sizes(
      num_users, POPULATION_PERCENT[population])


def _assign_images(digits: np.ndarray, labels: np.ndarray, source: str,
                   rng: np.random.Generator) -> np.ndarray:
  """An image of the requested digit for every slot (see module doc)."""
  return preference_users.assign_samples(
      digits, labels, NUM_SUBPOPULATIONS, rng, source=source, noun='digit')


def _check_images(images: np.ndarray, labels: np.ndarray, name: str) -> None:
  if images.dtype != np.uint8 or images.ndim != 3 or images.shape[1:] != (
      28, 28):
    raise ValueError(f'{name} images must be uint8 (N, 28, 28), got '
                     f'{images.dtype} {images.shape}.')
  if labels.shape != (images.shape[0],):
    raise ValueError(f'{name} labels must have shape ({images.shape[0]},), '
                     f'got {labels.shape}.')
  if labels.size and (labels.min() < 0 or labels.max() >= NUM_SUBPOPULATIONS):
    raise ValueError(f'{name} labels must be in 0..9.')


def make_preference_data(images: np.ndarray,
                         labels: np.ndarray,
                         *,
                         num_users: int = 9000,
                         population: str = 'balanced',
                         train_per_user: int = 20,
                         test_per_user: int = 10,
                         seed: int = 0,
                         eval_images: np.ndarray | None = None,
                         eval_labels: np.ndarray | None = None
                         ) -> PreferenceData:
  """Builds the users' preference data from MNIST (see the module docstring).

  Args:
    images: uint8 (N, 28, 28), normally the MNIST train split.
    labels: (N,) digits of `images`.
    num_users: Number of users U.
    population: 'balanced' or 'imbalanced'.
    train_per_user: Train samples per user (even).
    test_per_user: Test samples per user (even).
    seed: Seed; the result is a deterministic function of it and the inputs.
    eval_images: Optional uint8 (M, 28, 28) to draw the test samples from
      (e.g. the t10k split); by default they come from `images`, disjoint
      from the same user's train samples.
    eval_labels: (M,) digits of `eval_images`; given iff `eval_images` is.

  Returns:
    The `PreferenceData`.

  Raises:
    ValueError: Bad argument; the message names it.
  """
  labels = np.asarray(labels)
  _check_images(images, labels, 'images')
  if (eval_images is None) != (eval_labels is None):
    raise ValueError('eval_images and eval_labels must be given together.')
  if eval_images is not None:
    eval_labels = np.asarray(eval_labels)
    _check_images(eval_images, eval_labels, 'eval_images')
  if population not in POPULATION_PERCENT:
    raise ValueError(f'population must be one of {sorted(POPULATION_PERCENT)}'
                     f', got {population!r}.')
  if (isinstance(num_users, bool) or
      not isinstance(num_users, (int, np.integer)) or num_users <= 0):
    raise ValueError(f'num_users must be a positive int, got {num_users!r}.')
  preference_users.check_count(train_per_user, 'train_per_user')
  preference_users.check_count(test_per_user, 'test_per_user')
  if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
    raise ValueError(f'seed must be an int, got {seed!r}.')
  sizes = subpopulation_sizes(int(num_users), population)
  if sizes.min() == 0:
    raise ValueError(
        f'num_users={num_users} leaves sub-population(s) '
        f'{np.flatnonzero(sizes == 0).tolist()} without users under the '
        f'{population!r} population; every sub-population needs at least one '
        f'user (balanced: num_users >= 10, imbalanced: num_users >= 13).')

  rng = np.random.default_rng(seed)
  subpopulation = rng.permutation(
      np.repeat(np.arange(NUM_SUBPOPULATIONS), sizes))
  train_digits = preference_users.sample_types(
      subpopulation, train_per_user, NUM_SUBPOPULATIONS, rng)
  test_digits = preference_users.sample_types(
      subpopulation, test_per_user, NUM_SUBPOPULATIONS, rng)
  if eval_images is None:
    # One allocation over all of a user's slots keeps its train and test
    # images disjoint.
    idx = _assign_images(
        np.concatenate([train_digits, test_digits], axis=1), labels,
        'images', rng)
    train_idx, test_idx = idx[:, :train_per_user], idx[:, train_per_user:]
    test_images = images
    test_labels = labels
  else:
    train_idx = _assign_images(train_digits, labels, 'images', rng)
    test_idx = _assign_images(test_digits, eval_labels, 'eval_images', rng)
    test_images = eval_images
    test_labels = eval_labels

  train_type = labels[train_idx].astype(np.int32)
  test_type = test_labels[test_idx].astype(np.int32)
  own = subpopulation[:, np.newaxis]
  return PreferenceData(
      train_images=images,
      test_images=test_images,
      train_idx=preference_users.frozen(train_idx),
      test_idx=preference_users.frozen(test_idx),
      train_y=preference_users.frozen((train_type == own).astype(np.int32)),
      train_type=preference_users.frozen(train_type),
      test_y=preference_users.frozen((test_type == own).astype(np.int32)),
      test_type=preference_users.frozen(test_type),
      subpopulation=preference_users.frozen(subpopulation.astype(np.int32)),
      num_subpopulations=NUM_SUBPOPULATIONS)


def load_task_data(data_dir: str | None,
                   *,
                   num_users: int = 9000,
                   population: str = 'balanced',
                   seed: int = 0,
                   eval_source: str = 'mnist_train',
                   train_per_user: int = 20,
                   test_per_user: int = 10) -> PreferenceData:
  """Loads MNIST (`mnist_io.load_mnist`) and builds the preference data.

  Args:
    data_dir: Directory of the MNIST IDX files, or None for tensorflow-datasets.
    num_users: Number of users.
    population: 'balanced' or 'imbalanced'.
    seed: Seed of the user construction.
    eval_source: 'mnist_train' (the paper: test samples from the train split,
      disjoint within a user) or 'mnist_test' (test samples from t10k).
    train_per_user: Train samples per user.
    test_per_user: Test samples per user.

  Returns:
    The `PreferenceData`.
  """
  if eval_source not in EVAL_SOURCES:
    raise ValueError(
        f'eval_source must be one of {EVAL_SOURCES}, got {eval_source!r}.')
  images, labels = mnist_io.load_mnist(data_dir, 'train')
  eval_images = eval_labels = None
  if eval_source == 'mnist_test':
    eval_images, eval_labels = mnist_io.load_mnist(data_dir, 'test')
  return make_preference_data(
      images, labels, num_users=num_users, population=population,
      train_per_user=train_per_user, test_per_user=test_per_user, seed=seed,
      eval_images=eval_images, eval_labels=eval_labels)


def element_spec(batch_size: int) -> collections.OrderedDict:
  """The element spec of `client_dataset` (batch dimension None).

  Args:
    batch_size: The batch size (the spec's batch dimension is None since the
      last batch may be smaller).

  Returns:
    OrderedDict(x=float32 [None, 28, 28, 1], y=int32 [None],
    type=int32 [None]).
  """
  _check_batch_size(batch_size)
  return collections.OrderedDict(
      x=tf.TensorSpec([None, *IMAGE_SHAPE], tf.float32),
      y=tf.TensorSpec([None], tf.int32),
      type=tf.TensorSpec([None], tf.int32))


def _check_batch_size(batch_size: int) -> None:
  if (isinstance(batch_size, bool) or
      not isinstance(batch_size, (int, np.integer)) or batch_size <= 0):
    raise ValueError(f'batch_size must be a positive int, got {batch_size!r}.')


def client_dataset(data: PreferenceData,
                   user: int,
                   split: str = 'train',
                   batch_size: int = 10,
                   shuffle_seed: int | None = None) -> tf.data.Dataset:
  """One user's samples as a batched `tf.data.Dataset`.

  Args:
    data: The task data.
    user: User index.
    split: 'train' or 'test'.
    batch_size: Batch size; the last batch may be smaller.
    shuffle_seed: If not None and `split == 'train'`, the samples are shuffled
      with this seed (reshuffled on each iteration, deterministically: a
      dataset built with the same seed yields the same sequence of orders).

  Returns:
    A dataset of OrderedDict(x=float32 [b, 28, 28, 1], y=int32 [b],
    type=int32 [b]), with element spec `element_spec(batch_size)`.
  """
  _check_batch_size(batch_size)
  x, y, types = data.user_arrays(user, split)
  dataset = tf.data.Dataset.from_tensor_slices(
      collections.OrderedDict(x=x, y=y, type=types))
  if split == 'train' and shuffle_seed is not None:
    dataset = dataset.shuffle(
        y.shape[0], seed=shuffle_seed, reshuffle_each_iteration=True)
  return dataset.batch(int(batch_size))
