"""k-NN purity of embeddings against known clusters and chance."""

import numpy as np
import pytest

from tff_personal import embedding_purity


def test_knn_purity_on_known_clusters():
  rng = np.random.default_rng(0)
  labels = np.repeat(np.arange(3), 20)
  tight = rng.normal(size=(60, 4)) * 0.01 + labels[:, None] * 10.0
  assert embedding_purity.knn_purity(tight, labels) == 1.0
  mixed = rng.normal(size=(60, 4))
  assert embedding_purity.knn_purity(mixed, labels) < 0.6
  # Chance: 3 equal classes of 20 -> 19/59 of other points share the label.
  assert embedding_purity.chance_purity(labels) == pytest.approx(19 / 59)
