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
  for marks in feddva_tasks.MARK_MODES:
    a = feddva_tasks.marked_mnist(mnist_dir, num_clients=5, marks=marks,
                                  train_per_client=30, test_per_client=10)
    b = feddva_tasks.marked_mnist(mnist_dir, num_clients=5, marks=marks,
                                  train_per_client=30, test_per_client=10)
    assert a.num_clients == 5 and len(a.client_names) == 5
    for ca, cb, k in zip(a.clients, b.clients, range(5)):
      np.testing.assert_array_equal(ca.train_x, cb.train_x)
      np.testing.assert_array_equal(ca.test_mark, cb.test_mark)
      assert ca.train_x.shape == (30, 28, 28, 1) and ca.test_y.shape == (10,)
      # Every image is at least as bright as its own mark.
      for x, angle in zip(ca.train_x, ca.train_mark):
        if feddva_tasks.mark_name(k) == 'none' or marks == 'none':
          assert np.isnan(angle)
        else:
          assert np.all(x >= feddva_tasks.render_mark(k, angle=angle)[..., None]
                        - 1e-6)
  with pytest.raises(ValueError, match='exceed'):
    feddva_tasks.marked_mnist(mnist_dir, num_clients=4,
                              train_per_client=20000)
  with pytest.raises(ValueError, match='positive'):
    feddva_tasks.marked_mnist(mnist_dir, num_clients=0)
  with pytest.raises(ValueError, match="marks must be one of .*'wavy'"):
    feddva_tasks.marked_mnist(mnist_dir, marks='wavy')


def test_varied_marks_vary_within_a_client_and_fixed_marks_do_not(mnist_dir):
  kw = dict(num_clients=5, train_per_client=40, test_per_client=10)
  varied = feddva_tasks.marked_mnist(mnist_dir, marks='varied', **kw)
  fixed = feddva_tasks.marked_mnist(mnist_dir, marks='fixed', **kw)
  for k in range(5):
    v, f = varied.clients[k], fixed.clients[k]
    # The same digits in both modes; only the marks differ.
    np.testing.assert_array_equal(v.train_y, f.train_y)
    if feddva_tasks.mark_name(k) == 'none':
      np.testing.assert_array_equal(v.train_x, f.train_x)
      assert np.all(np.isnan(v.train_mark))
      continue
    assert np.all(f.train_mark == 0)
    angles = v.train_mark
    assert np.all((angles >= 0) & (angles < 2 * np.pi))
    assert len(np.unique(np.round(angles, 6))) == len(angles)
    # Spread over the circle, not clumped (40 uniform draws).
    assert np.abs(np.mean(np.exp(1j * angles))) < 0.5
    # The drawn marks differ image to image: the mean of the varied
    # images' pixelwise spread is far above the fixed ones' (where only the
    # digit varies under the mark).
    marks_v = np.stack([feddva_tasks.render_mark(k, angle=a) for a in angles])
    assert marks_v.std(axis=0).mean() > 0.1
  # Train and test draws, clients and seeds are independent streams.
  assert not np.allclose(varied.clients[0].train_mark[:10],
                         varied.clients[0].test_mark)
  assert not np.allclose(varied.clients[0].train_mark,
                         varied.clients[1].train_mark)
  other = feddva_tasks.marked_mnist(mnist_dir, marks='varied', seed=1, **kw)
  assert not np.allclose(other.clients[0].test_mark,
                         varied.clients[0].test_mark)


def test_no_marks_is_the_same_digits_unmarked(mnist_dir):
  """The control: the marked task's clients and digits, with no mark."""
  kw = dict(num_clients=5, train_per_client=30, test_per_client=10)
  plain = feddva_tasks.marked_mnist(mnist_dir, marks='none', **kw)
  varied = feddva_tasks.marked_mnist(mnist_dir, marks='varied', **kw)
  raw, _ = feddva_tasks.mnist_io.load_mnist(mnist_dir, 'train')
  order = np.random.default_rng([0, 7]).permutation(len(raw))
  for k, (p, v) in enumerate(zip(plain.clients, varied.clients)):
    np.testing.assert_array_equal(p.train_y, v.train_y)
    np.testing.assert_array_equal(p.test_y, v.test_y)
    np.testing.assert_array_equal(
        p.train_x, raw[order[k * 30:(k + 1) * 30]][..., None].astype(
            np.float32) / np.float32(255.0))
    assert np.all(np.isnan(p.train_mark)) and np.all(np.isnan(p.test_mark))
    # The marked task's images are brighter wherever a mark is drawn.
    assert (feddva_tasks.mark_name(k) == 'none') == np.array_equal(
        p.train_x, v.train_x)
  assert plain.client_names == ['no mark'] * plain.num_clients


def test_render_mark_angle_is_the_phase_or_twice_the_rotation():
  for k in range(6):
    base = feddva_tasks.render_mark(k)
    np.testing.assert_array_equal(feddva_tasks.render_mark(k, angle=0.0), base)
    # Every mark is periodic in its angle with period 2 pi ...
    np.testing.assert_allclose(
        feddva_tasks.render_mark(k, angle=2 * np.pi), base, atol=1e-5)
    if feddva_tasks.mark_name(k) == 'none':
      continue
    # ... and another angle draws another mark.
    assert np.abs(feddva_tasks.render_mark(k, angle=np.pi) - base).sum() > 20
  # The ellipse at angle pi is the ellipse turned by 90 degrees.
  turned = feddva_tasks.render_mark(1, angle=np.pi)
  np.testing.assert_allclose(turned, feddva_tasks.render_mark(1).T, atol=1e-5)
  with pytest.raises(ValueError, match='finite'):
    feddva_tasks.render_mark(0, angle=float('nan'))


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
