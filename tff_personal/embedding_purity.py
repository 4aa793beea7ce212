"""How well users' embeddings cluster by a label (e.g. their sub-population).

`knn_purity` is the mean share of each user's k nearest neighbours (by
Euclidean distance between embeddings) that carry its label;
`chance_purity` is what random neighbours would give. FedEmbed's personal
embeddings and FURL's private user embeddings are read this way.

Example:
  purity = knn_purity(embeddings, groups)    # [users, dim], [users]
  baseline = chance_purity(groups)
"""

from __future__ import annotations

import numpy as np


def knn_purity(embeddings: np.ndarray, labels: np.ndarray, k: int = 5) -> float:
  """Mean fraction of each point's k nearest neighbours with its label.

  Args:
    embeddings: [points, dim].
    labels: [points], one label per point.
    k: neighbours per point (the point itself excluded).

  Returns:
    The purity, in [0, 1].
  """
  d = np.sum((embeddings[:, None, :] - embeddings[None, :, :]) ** 2, -1)
  np.fill_diagonal(d, np.inf)
  nn = np.argsort(d, axis=1)[:, :k]
  return float(np.mean(labels[nn] == labels[:, None]))


def chance_purity(labels: np.ndarray) -> float:
  """Expected purity of random neighbours: for each label, its share times
  the share of the other points that carry it."""
  _, counts = np.unique(labels, return_counts=True)
  p = counts / counts.sum()
  return float(np.sum(p * (counts - 1) / max(len(labels) - 1, 1)))
