"""How well users' embeddings or assignments follow a label (their group).

`knn_purity` is the mean share of each user's k nearest neighbours (by
Euclidean distance between embeddings) that carry its label;
`chance_purity` is what random neighbours would give. FedEmbed's personal
embeddings and FURL's private user embeddings are read this way.
`assignment_accuracy` scores users' assignments to heads or clusters against
their groups under the best one-to-one relabelling (`matched` applies it);
`embedding_assignment` clusters embeddings into as many clusters as groups.

Example:
  purity = knn_purity(embeddings, groups)    # [users, dim], [users]
  baseline = chance_purity(groups)
  k = groups.max() + 1
  score = assignment_accuracy(groups, embedding_assignment(embeddings, k), k)
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


def embedding_assignment(embeddings: np.ndarray, k: int,
                         seed: int = 0) -> np.ndarray:
  """Users' clusters from their embeddings: scikit-learn's k-means.

  Args:
    embeddings: [users, dim].
    k: clusters (e.g. the number of groups; score them with
      `assignment_accuracy`, which matches clusters to groups one to one).
    seed: k-means' random state.

  Returns:
    int64 [users], each user's cluster in [0, k).
  """
  from sklearn.cluster import KMeans  # pylint: disable=g-import-not-at-top
  return KMeans(n_clusters=k, n_init=10, random_state=seed).fit_predict(
      embeddings).astype(np.int64)


def matched(truth: np.ndarray, assigned: np.ndarray, k: int) -> np.ndarray:
  """`assigned` relabelled by the best one-to-one map onto `truth`."""
  from scipy import optimize  # pylint: disable=g-import-not-at-top
  cm = np.zeros((k, k), np.int64)
  np.add.at(cm, (truth, assigned), 1)
  rows, cols = optimize.linear_sum_assignment(-cm)
  relabel = np.arange(k)
  relabel[cols] = rows
  return relabel[assigned]


def assignment_accuracy(truth: np.ndarray, assigned: np.ndarray,
                        k: int) -> float:
  """Fraction of users on their group's head under the best one-to-one map.

  Any relabelling is allowed (for unsupervised assignment: clusters, SOM
  nodes), but being one-to-one (Hungarian matching, scipy) the score does not
  reward sending every group to one head. Where heads are tied to groups by
  training, `np.mean(truth == assigned)` is the stricter score.

  Args:
    truth: int [users], each user's group in [0, k).
    assigned: int [users], each user's head or cluster in [0, k).
    k: groups and heads.

  Returns:
    The fraction in [0, 1]; 0 for no users.
  """
  if len(truth) == 0:
    return 0.0
  from scipy import optimize  # pylint: disable=g-import-not-at-top
  cm = np.zeros((k, k), np.int64)
  np.add.at(cm, (truth, assigned), 1)
  rows, cols = optimize.linear_sum_assignment(-cm)
  return float(cm[rows, cols].sum() / len(truth))
