"""Tests for tasks.mnist_preference."""

import time

import numpy as np
import pytest
import tensorflow as tf

from tasks import mnist_io
from tasks import mnist_preference
from tasks import preference_task


@pytest.fixture(scope='module')
def mnist_train(mnist_dir):
  return mnist_io.load_mnist(mnist_dir, 'train')


@pytest.fixture(scope='module')
def full(mnist_train):
  """The paper's population: 9000 balanced users."""
  images, labels = mnist_train
  return mnist_preference.make_preference_data(images, labels, seed=0)


def _synthetic(per_digit=3, seed=0):
  rng = np.random.default_rng(seed)
  labels = np.repeat(np.arange(10, dtype=np.uint8), per_digit)
  images = rng.integers(0, 256, size=(labels.size, 28, 28), dtype=np.uint8)
  return images, labels


def test_shapes_and_dtypes(full):
  assert full.num_users == 9000 and full.num_subpopulations == 10
  for name, cols in [('train_idx', 20), ('train_y', 20), ('train_type', 20),
                     ('test_idx', 10), ('test_y', 10), ('test_type', 10)]:
    array = getattr(full, name)
    assert array.shape == (9000, cols), name
    assert array.dtype == np.int32, name
  assert full.subpopulation.shape == (9000,)
  assert full.subpopulation.dtype == np.int32
  assert not full.train_idx.flags.writeable


def test_half_positive_per_user_per_split(full):
  np.testing.assert_array_equal(full.train_y.sum(axis=1), np.full(9000, 10))
  np.testing.assert_array_equal(full.test_y.sum(axis=1), np.full(9000, 5))


def test_labels_consistent_with_digits(full, mnist_train):
  _, labels = mnist_train
  np.testing.assert_array_equal(full.train_type, labels[full.train_idx])
  np.testing.assert_array_equal(full.test_type, labels[full.test_idx])
  own = full.subpopulation[:, None]
  np.testing.assert_array_equal(full.train_y, full.train_type == own)
  np.testing.assert_array_equal(full.test_y, full.test_type == own)
  assert set(np.unique(full.train_y)) == {0, 1}


def test_user_arrays_match_images(full, mnist_train):
  images, _ = mnist_train
  for user in (0, 4321, 8999):
    for split, idx, y, types in [
        ('train', full.train_idx, full.train_y, full.train_type),
        ('test', full.test_idx, full.test_y, full.test_type)]:
      x, got_y, got_types = full.user_arrays(user, split)
      assert x.dtype == np.float32 and x.shape == (idx.shape[1], 28, 28, 1)
      np.testing.assert_allclose(x[..., 0], images[idx[user]] / 255.0,
                                 rtol=1e-6)
      assert 0.0 <= x.min() and x.max() <= 1.0
      np.testing.assert_array_equal(got_y, y[user])
      np.testing.assert_array_equal(got_types, types[user])


def test_train_x_property_materialises_float(mnist_train):
  images, labels = mnist_train
  data = mnist_preference.make_preference_data(
      images, labels, num_users=20, seed=3)
  assert data.train_x.shape == (20, 20, 28, 28, 1)
  assert data.test_x.shape == (20, 10, 28, 28, 1)
  np.testing.assert_allclose(data.test_x[7], data.user_arrays(7, 'test')[0])


def test_train_test_disjoint_within_user(full):
  both = np.sort(np.concatenate([full.train_idx, full.test_idx], axis=1),
                 axis=1)
  assert not np.any(both[:, 1:] == both[:, :-1])


def test_negatives_uniform_over_other_digits(full):
  types = np.concatenate([full.train_type, full.test_type], axis=1)
  ys = np.concatenate([full.train_y, full.test_y], axis=1)
  for digit in range(10):
    users = full.subpopulation == digit
    negatives = types[users][ys[users] == 0]
    counts = np.bincount(negatives, minlength=10)
    assert counts[digit] == 0
    # 900 users x 15 negatives over 9 digits: 1500 expected, sd ~ 36.5.
    others = np.delete(counts, digit)
    assert others.sum() == 13500
    assert np.all(np.abs(others - 1500) < 200), counts


def test_balanced_counts(full, mnist_train):
  np.testing.assert_array_equal(np.bincount(full.subpopulation), [900] * 10)
  images, labels = mnist_train
  data = mnist_preference.make_preference_data(
      images, labels, num_users=1005, seed=0)
  # Largest remainder: 100.5 each, ties go to the smaller digits.
  np.testing.assert_array_equal(np.bincount(data.subpopulation),
                                [101] * 5 + [100] * 5)


def test_imbalanced_proportions(mnist_train):
  images, labels = mnist_train
  data = mnist_preference.make_preference_data(
      images, labels, num_users=1000, population='imbalanced', seed=0)
  np.testing.assert_array_equal(np.bincount(data.subpopulation, minlength=10),
                                [250, 150, 100, 100, 100, 100, 50, 50, 50, 50])
  np.testing.assert_array_equal(data.train_y.sum(axis=1), np.full(1000, 10))


def test_subpopulation_sizes_sum_exactly():
  for num_users in (13, 19, 37, 999, 1001, 9000, 12345):
    for population in ('balanced', 'imbalanced'):
      sizes = mnist_preference.subpopulation_sizes(num_users, population)
      assert sizes.sum() == num_users, (num_users, population)
  np.testing.assert_array_equal(
      mnist_preference.subpopulation_sizes(1003, 'imbalanced'),
      [251, 151, 101, 100, 100, 100, 50, 50, 50, 50])


def test_deterministic_by_seed(mnist_train):
  images, labels = mnist_train

  def make(seed):
    return mnist_preference.make_preference_data(
        images, labels, num_users=300, population='imbalanced', seed=seed)

  a, b, c = make(7), make(7), make(8)
  for name in ('train_idx', 'test_idx', 'train_y', 'test_y', 'train_type',
               'test_type', 'subpopulation'):
    np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
  assert not np.array_equal(a.train_idx, c.train_idx)
  assert not np.array_equal(a.subpopulation, c.subpopulation)


def test_every_training_image_used_evenly(full, mnist_train):
  _, labels = mnist_train
  used = np.concatenate([full.train_idx.ravel(), full.test_idx.ravel()])
  uses = np.bincount(used, minlength=60000)
  assert uses.shape == (60000,) and uses.min() >= 1
  # Each digit's images are cycled through in whole passes, so within a digit
  # use counts differ by at most one.
  for digit in range(10):
    digit_uses = uses[labels == digit]
    assert digit_uses.max() - digit_uses.min() <= 1, digit
    assert digit_uses.sum() == np.sum(labels[used] == digit)


def test_eval_source_mnist_test(mnist_dir):
  data = mnist_preference.load_task_data(
      mnist_dir, num_users=200, population='balanced', seed=1,
      eval_source='mnist_test')
  test_images, test_labels = mnist_io.load_mnist(mnist_dir, 'test')
  assert data.test_images.shape == (10000, 28, 28)
  assert data.train_images.shape == (60000, 28, 28)
  np.testing.assert_array_equal(data.test_type, test_labels[data.test_idx])
  np.testing.assert_array_equal(data.test_images, test_images)
  np.testing.assert_array_equal(data.test_y.sum(axis=1), np.full(200, 5))


def test_load_task_data_matches_make(mnist_dir, mnist_train):
  images, labels = mnist_train
  loaded = mnist_preference.load_task_data(
      mnist_dir, num_users=50, population='imbalanced', seed=5)
  made = mnist_preference.make_preference_data(
      images, labels, num_users=50, population='imbalanced', seed=5)
  np.testing.assert_array_equal(loaded.train_idx, made.train_idx)
  np.testing.assert_array_equal(loaded.test_idx, made.test_idx)
  assert loaded.test_images is loaded.train_images


@pytest.mark.parametrize('kwargs, argument', [
    (dict(num_users=9), 'num_users'),
    (dict(num_users=0), 'num_users'),
    (dict(num_users=-5), 'num_users'),
    (dict(num_users=12, population='imbalanced'), 'num_users'),
    (dict(train_per_user=19), 'train_per_user'),
    (dict(train_per_user=0), 'train_per_user'),
    (dict(test_per_user=5), 'test_per_user'),
    (dict(population='skewed'), 'population'),
])
def test_invalid_arguments(kwargs, argument):
  images, labels = _synthetic(per_digit=40)
  args = dict(num_users=10)
  args.update(kwargs)
  with pytest.raises(ValueError, match=argument):
    mnist_preference.make_preference_data(images, labels, **args)


def test_too_few_images_of_a_digit():
  images, labels = _synthetic(per_digit=3)
  # A user needs 15 distinct images of its own digit.
  with pytest.raises(ValueError, match='distinct'):
    mnist_preference.make_preference_data(images, labels, num_users=10)


def test_small_synthetic_pool_is_fully_cycled():
  images, labels = _synthetic(per_digit=20)
  data = mnist_preference.make_preference_data(images, labels, num_users=40,
                                               seed=2)
  both = np.concatenate([data.train_idx, data.test_idx], axis=1)
  uses = np.bincount(both.ravel(), minlength=200)
  assert uses.min() >= 1
  for digit in range(10):
    digit_uses = uses[labels == digit]
    assert digit_uses.max() - digit_uses.min() <= 1
  ordered = np.sort(both, axis=1)
  assert not np.any(ordered[:, 1:] == ordered[:, :-1])


def test_element_spec():
  spec = mnist_preference.element_spec(8)
  assert list(spec) == ['x', 'y', 'type']
  assert spec['x'] == tf.TensorSpec([None, 28, 28, 1], tf.float32)
  assert spec['y'] == tf.TensorSpec([None], tf.int32)
  assert spec['type'] == tf.TensorSpec([None], tf.int32)
  with pytest.raises(ValueError, match='batch_size'):
    mnist_preference.element_spec(0)


def _batches(dataset):
  return [{k: v.numpy() for k, v in batch.items()} for batch in dataset]


@pytest.mark.parametrize('split, batch_size, sizes', [
    ('train', 8, [8, 8, 4]),
    ('train', 10, [10, 10]),
    ('test', 10, [10]),
    ('test', 3, [3, 3, 3, 1]),
])
def test_client_dataset_spec_and_batches(full, split, batch_size, sizes):
  dataset = mnist_preference.client_dataset(full, 17, split, batch_size)
  assert dataset.element_spec == mnist_preference.element_spec(batch_size)
  batches = _batches(dataset)
  assert [b['y'].shape[0] for b in batches] == sizes
  x, y, types = full.user_arrays(17, split)
  np.testing.assert_array_equal(np.concatenate([b['x'] for b in batches]), x)
  np.testing.assert_array_equal(np.concatenate([b['y'] for b in batches]), y)
  np.testing.assert_array_equal(
      np.concatenate([b['type'] for b in batches]), types)
  assert batches[0]['x'].dtype == np.float32
  assert batches[0]['y'].dtype == np.int32


def test_client_dataset_shuffle_is_seeded(full):
  def order(seed, split='train'):
    dataset = mnist_preference.client_dataset(
        full, 3, split, batch_size=20, shuffle_seed=seed)
    (batch,) = _batches(dataset)
    return batch['x'].reshape(batch['x'].shape[0], -1).sum(axis=1), batch

  base, _ = order(None)
  first, batch = order(11)
  again, _ = order(11)
  other, _ = order(12)
  np.testing.assert_array_equal(first, again)
  assert not np.array_equal(first, other)
  assert not np.array_equal(first, base)
  np.testing.assert_allclose(np.sort(first), np.sort(base))
  # Labels stay attached to their images.
  x, y, _ = full.user_arrays(3, 'train')
  sums = x.reshape(20, -1).sum(axis=1)
  for image_sum, label in zip(first, batch['y']):
    assert label in y[np.isclose(sums, image_sum)]
  # Test data is never shuffled.
  test_order, _ = order(11, 'test')
  test_base, _ = order(None, 'test')
  np.testing.assert_array_equal(test_order, test_base)


def test_client_dataset_bad_arguments(full):
  with pytest.raises(ValueError, match='user'):
    mnist_preference.client_dataset(full, 9000)
  with pytest.raises(ValueError, match='split'):
    mnist_preference.client_dataset(full, 0, 'validation')


def test_fifty_client_datasets_are_fast(full):
  start = time.perf_counter()
  datasets = [mnist_preference.client_dataset(full, u, shuffle_seed=u)
              for u in range(50)]
  elapsed = time.perf_counter() - start
  assert len(datasets) == 50
  assert elapsed < 3.0, elapsed


def test_eval_batches_are_the_eval_datasets(mnist_dir):

  task = preference_task.mnist_preference_task(
      mnist_dir, num_users=30, population='balanced', seed=2, batch_size=4)
  ids = [0, 13, 29]
  for cb, ds in zip(task.eval_batches(ids), task.eval_datasets(ids)):
    got, want = list(cb.to_dataset()), list(ds)
    assert len(got) == len(want) == 3  # 10 test samples in batches of 4
    for a, b in zip(got, want):
      for key in ('x', 'y', 'type'):
        np.testing.assert_array_equal(a[key].numpy(), b[key].numpy())
