"""Tests of the data-driven grouping (count sketch, cosine clustering, ARI)."""

import numpy as np
import pytest

from tff_personal.algorithms import update_clustering as uc


def test_count_sketch_is_linear_and_keeps_cosines():
  rng = np.random.default_rng(0)
  shapes = [(200, 100), (3000,), (50, 40)]
  a = [rng.normal(size=s) for s in shapes]
  b = [0.6 * x + 0.8 * rng.normal(size=x.shape) for x in a]  # cosine ~0.6
  sketch = uc.CountSketch(dim=4096, seed=3)
  np.testing.assert_allclose(sketch([x + y for x, y in zip(a, b)]),
                             sketch(a) + sketch(b), atol=1e-9)
  flat = lambda v: np.concatenate([x.ravel() for x in v])
  true_cos = uc.cosine_similarity(np.stack([flat(a), flat(b)]))[0, 1]
  est_cos = uc.cosine_similarity(np.stack([sketch(a), sketch(b)]))[0, 1]
  assert true_cos == pytest.approx(0.6, abs=0.02)
  assert est_cos == pytest.approx(true_cos, abs=0.05)
  # Same seed, same sketch; another seed, another one.
  np.testing.assert_array_equal(sketch(a), uc.CountSketch(4096, 3)(a))
  assert not np.allclose(sketch(a), uc.CountSketch(4096, 4)(a))


def _planted(shared_scale, seed=0):
  """Clients of 3 groups: shared direction + group direction + noise."""
  rng = np.random.default_rng(seed)
  d = 500
  shared = rng.normal(size=d)
  directions = rng.normal(size=(3, d))
  truth = np.repeat(np.arange(3), 20)
  vectors = (shared_scale * shared + directions[truth]
             + 0.7 * rng.normal(size=(len(truth), d)))
  return vectors, truth


def test_cosine_clustering_recovers_planted_groups():
  vectors, truth = _planted(shared_scale=0.0)
  for method in ('kmeans', 'agglomerative'):
    labels = uc.cluster_updates(vectors, 3, method=method)
    assert uc.adjusted_rand_index(truth, labels) > 0.95
  # Shuffled labels are at chance level, so the index can fail.
  rng = np.random.default_rng(1)
  assert abs(uc.adjusted_rand_index(truth, rng.permutation(truth))) < 0.2


def test_centering_removes_a_dominant_shared_update():
  vectors, truth = _planted(shared_scale=3.0)
  centered = uc.cluster_updates(vectors, 3, center=True)
  assert uc.adjusted_rand_index(truth, centered) > 0.95
  # Scaling a client's update does not change its cosine similarities.
  scaled = vectors * np.linspace(0.1, 10, len(vectors))[:, None]
  cos = uc.cosine_similarity(vectors)
  np.testing.assert_allclose(uc.cosine_similarity(scaled), cos, atol=1e-12)


def test_bad_input():
  with pytest.raises(ValueError, match='num_groups'):
    uc.cluster_updates(np.ones((3, 2)), 4)
  with pytest.raises(ValueError, match='non-finite'):
    uc.cluster_updates(np.array([[1.0, np.nan], [1.0, 2.0]]), 1)
  with pytest.raises(ValueError, match='unknown method'):
    uc.cluster_updates(np.eye(3), 2, method='dbscan')
  with pytest.raises(ValueError, match='sketch dim'):
    uc.CountSketch(0)


def test_sketched_updates_chunk_the_clients_and_sketch_each_update():
  rng = np.random.default_rng(1)
  updates_of = {c: [rng.normal(size=(4, 3)), rng.normal(size=5)]
                for c in range(5)}
  calls = []

  def client_updates(weights, datasets):
    calls.append(list(datasets))
    return [[u * weights for u in updates_of[d]] for d in datasets]

  sketch = uc.CountSketch(dim=64, seed=2)
  built = []
  dataset_fn = lambda c: built.append(c) or c  # Each client's "data".
  vectors = uc.sketched_updates(client_updates, 2.0, [3, 0, 4, 1, 2],
                                dataset_fn, sketch, chunk_size=2)
  assert calls == [[3, 0], [4, 1], [2]] and built == [3, 0, 4, 1, 2]
  assert vectors.shape == (5, 64)
  for row, c in zip(vectors, [3, 0, 4, 1, 2]):
    np.testing.assert_allclose(row, sketch([2.0 * u for u in updates_of[c]]))
