"""k-NN purity and assignment accuracy against known clusters and chance."""

import numpy as np
import pytest

from tff_personal.reports import embedding_purity
from tff_personal.reports import figures


def test_knn_purity_on_known_clusters():
  rng = np.random.default_rng(0)
  labels = np.repeat(np.arange(3), 20)
  tight = rng.normal(size=(60, 4)) * 0.01 + labels[:, None] * 10.0
  assert embedding_purity.knn_purity(tight, labels) == 1.0
  mixed = rng.normal(size=(60, 4))
  assert embedding_purity.knn_purity(mixed, labels) < 0.6
  # Chance: 3 equal classes of 20 -> 19/59 of other points share the label.
  assert embedding_purity.chance_purity(labels) == pytest.approx(19 / 59)


def test_confusion_and_assignment_accuracy():
  truth = np.array([0, 0, 1, 1, 2, 2])
  assigned = np.array([0, 0, 1, 2, 2, 2])
  cm = figures.confusion(truth, assigned, 3)
  np.testing.assert_allclose(cm, [[1, 0, 0], [0, .5, .5], [0, 0, 1]])
  assert embedding_purity.assignment_accuracy(truth, assigned, 3) == pytest.approx(
      5 / 6)
  # Unsupervised heads: a relabelling scores like the identity.
  assert embedding_purity.assignment_accuracy(truth, (truth + 1) % 3, 3) == 1.0
  # Every group on one head is not a good assignment (one-to-one matching).
  assert embedding_purity.assignment_accuracy(truth, np.zeros(6, int), 3) == (
      pytest.approx(1 / 3))


def test_embedding_clusters_are_matched_to_groups_one_to_one():
  rng = np.random.default_rng(0)
  truth = np.repeat(np.arange(4), 25)
  centres = rng.normal(0, 10, (4, 6))
  embeddings = centres[truth] + rng.normal(0, 0.1, (100, 6))
  clusters = embedding_purity.embedding_assignment(embeddings, 4)
  assert embedding_purity.assignment_accuracy(truth, clusters, 4) == 1.0
  np.testing.assert_array_equal(embedding_purity.matched(truth, clusters, 4), truth)
  # Embeddings that carry no group information cluster no better than
  # chance after matching.
  noise = embedding_purity.embedding_assignment(rng.normal(size=(100, 6)), 4)
  assert embedding_purity.assignment_accuracy(truth, noise, 4) < 0.6
