"""FedDVA's MNIST tasks: marks per client, Dirichlet label skew."""

import numpy as np
import pytest

from tasks import feddva_tasks


def test_marks_are_distinct_and_the_fourth_is_none():
  marks = [feddva_tasks.render_mark(k) for k in range(8)]
  assert feddva_tasks.mark_name(3) == 'none' and not marks[3].any()
  for i in range(8):
    assert marks[i].min() >= 0 and marks[i].max() <= 1
    for j in range(i):
      assert np.abs(marks[i] - marks[j]).sum() > 20, (i, j)
  # The horizontal sinusoid varies along x, the vertical one along y.
  assert np.allclose(marks[0], marks[2].T)
  with pytest.raises(ValueError, match='mark index'):
    feddva_tasks.render_mark(-1)


def test_marked_mnist_is_deterministic_and_marks_each_client(mnist_dir):
  a = feddva_tasks.marked_mnist(mnist_dir, num_clients=5,
                                train_per_client=30, test_per_client=10)
  b = feddva_tasks.marked_mnist(mnist_dir, num_clients=5,
                                train_per_client=30, test_per_client=10)
  assert a.num_clients == 5 and len(a.client_names) == 5
  for ca, cb, k in zip(a.clients, b.clients, range(5)):
    np.testing.assert_array_equal(ca.train_x, cb.train_x)
    assert ca.train_x.shape == (30, 28, 28, 1) and ca.test_y.shape == (10,)
    mark = feddva_tasks.render_mark(k)[..., None]
    # Every image is at least as bright as its client's mark.
    assert np.all(ca.train_x >= mark - 1e-6)
  with pytest.raises(ValueError, match='exceed'):
    feddva_tasks.marked_mnist(mnist_dir, num_clients=4,
                              train_per_client=20000)
  with pytest.raises(ValueError, match='positive'):
    feddva_tasks.marked_mnist(mnist_dir, num_clients=0)


def test_label_skew_follows_dirichlet_proportions(mnist_dir):
  task = feddva_tasks.label_skew_mnist(mnist_dir, num_clients=6,
                                       train_per_client=200,
                                       test_per_client=50, alpha=0.3)
  props = feddva_tasks.dirichlet_proportions(6, 0.3, 0)
  for k, c in enumerate(task.clients):
    counts = np.bincount(c.train_y, minlength=10)
    assert counts.sum() == 200
    np.testing.assert_allclose(counts / 200, props[k], atol=1 / 200 + 1e-9)
    test_counts = np.bincount(c.test_y, minlength=10)
    np.testing.assert_allclose(test_counts / 50, props[k], atol=1 / 50 + 1e-9)
  # Small alpha: clients are skewed (a dominant class well above 10%).
  assert np.mean([p.max() for p in props]) > 0.4
  # Training images are disjoint across clients.
  flat = np.concatenate([c.train_x.reshape(len(c.train_x), -1)
                         for c in task.clients])
  assert len(np.unique(flat, axis=0)) == len(flat)
  with pytest.raises(ValueError, match='alpha'):
    feddva_tasks.label_skew_mnist(mnist_dir, alpha=0.0)
  with pytest.raises(ValueError, match='too few'):
    feddva_tasks.label_skew_mnist(mnist_dir, num_clients=20,
                                  train_per_client=3000, alpha=0.05)


def test_dataset_batches_and_rejects_bad_split(mnist_dir):
  task = feddva_tasks.marked_mnist(mnist_dir, num_clients=2,
                                   train_per_client=10, test_per_client=4)
  batches = list(task.dataset(0, 'train', 4, epochs=2, shuffle_seed=1))
  assert [int(b['y'].shape[0]) for b in batches] == [4, 4, 4, 4, 4]
  with pytest.raises(ValueError, match='split'):
    task.dataset(0, 'valid', 4)
