"""Data-driven groups: clustering clients by the direction of their updates.

For tasks without known groups, Group Personalized FL points to reference
[18] (Sattler et al., Clustered FL), which groups clients by the cosine
similarity of their updates. Here:

1. every client computes, from the same (global) model, the update it would
   send in FL (`algorithms.group_fl.build_client_updates`);
2. the driver compresses each update with a count sketch (`CountSketch`:
   every coordinate is added, with a seeded random sign, to one of `dim`
   seeded random buckets). The sketch is linear and preserves inner products
   in expectation, so cosine similarities of sketches estimate those of the
   full updates while a client's vector is `dim` floats instead of the whole
   model. Written by hand: sklearn's `FeatureHasher` hashes feature names,
   not dense vectors;
3. `cluster_updates` optionally removes the mean update (the component every
   client shares: CFL's premise is a model at a stationary point of the
   global objective, where the mean update vanishes; ours is not converged),
   normalises every vector to unit length and runs k-means on the unit
   vectors (spherical k-means: it maximises the cosine similarity of
   clients to their cluster's mean direction). Alternatively, average-linkage
   agglomerative clustering on cosine distances (sklearn).
4. `adjusted_rand_index` (sklearn) measures how well clusters recover known
   groups (1: identical partitions, ~0: chance).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
from sklearn import cluster as sk_cluster
from sklearn import metrics as sk_metrics


class CountSketch:
  """A seeded linear sketch of a list of arrays into `dim` floats."""

  def __init__(self, dim: int = 4096, seed: int = 0):
    if dim < 1:
      raise ValueError(f'sketch dim must be >= 1, got {dim}')
    self.dim = dim
    self.seed = seed
    self._hashes: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}

  def _hash(self, index: int, size: int):
    key = (index, size)
    if key not in self._hashes:
      rng = np.random.default_rng([self.seed, index, size])
      self._hashes[key] = (rng.integers(0, self.dim, size),
                           rng.choice(np.array([-1.0, 1.0]), size))
    return self._hashes[key]

  def __call__(self, arrays: Sequence[np.ndarray]) -> np.ndarray:
    out = np.zeros(self.dim, np.float64)
    for i, a in enumerate(arrays):
      flat = np.asarray(a, np.float64).ravel()
      buckets, signs = self._hash(i, flat.size)
      out += np.bincount(buckets, weights=signs * flat, minlength=self.dim)
    return out


def sketched_updates(client_updates: Callable[[Any, list], Sequence],
                     weights: Any, clients: Sequence[int],
                     dataset_fn: Callable[[int], Any], sketch: CountSketch,
                     chunk_size: int = 64) -> np.ndarray:
  """The count sketches of clients' updates from one model, [N, dim].

  Args:
    client_updates: `(weights, [dataset]) -> [update]`, each update a list
      of arrays (`algorithms.group_fl.build_client_updates`).
    weights: the model every update starts from.
    clients: the clients, in order.
    dataset_fn: a client's training data; built `chunk_size` clients at a
      time, so only one chunk's are held.
    sketch: the sketch applied to each update.
    chunk_size: clients per call of `client_updates`.

  Returns:
    One row per client of `clients`.

  Example:
    updates = group_fl.build_client_updates(model_fn, sgd, weights_type)
    vectors = sketched_updates(updates, weights, ids, task.train_dataset,
                               CountSketch(dim=4096, seed=0))
  """
  vectors = []
  for i in range(0, len(clients), chunk_size):
    chunk = clients[i:i + chunk_size]
    results = client_updates(weights, [dataset_fn(c) for c in chunk])
    vectors += [sketch(u) for u in results]
  return np.stack(vectors)


def cosine_similarity(vectors: np.ndarray) -> np.ndarray:
  unit = _unit(vectors)
  return unit @ unit.T


def _unit(vectors: np.ndarray) -> np.ndarray:
  norms = np.linalg.norm(vectors, axis=1, keepdims=True)
  return vectors / np.maximum(norms, 1e-12)


def cluster_updates(vectors: np.ndarray, num_groups: int, *,
                    center: bool = True, method: str = 'kmeans',
                    seed: int = 0) -> np.ndarray:
  """Cluster labels (0..num_groups-1) of clients by update direction.

  Args:
    vectors: [clients, d] updates (or their sketches).
    num_groups: number of clusters.
    center: subtract the mean update first (module docstring).
    method: 'kmeans' (spherical k-means on unit vectors) or 'agglomerative'
      (average linkage on cosine distance).
    seed: of k-means' initialisation.
  """
  vectors = np.asarray(vectors, np.float64)
  if vectors.ndim != 2:
    raise ValueError(f'vectors must be [clients, d], got shape {vectors.shape}')
  if not 1 <= num_groups <= len(vectors):
    raise ValueError(f'num_groups must be in [1, {len(vectors)}] (the number '
                     f'of clients), got {num_groups}')
  if not np.all(np.isfinite(vectors)):
    raise ValueError('vectors hold non-finite values')
  if center:
    vectors = vectors - vectors.mean(axis=0, keepdims=True)
  unit = _unit(vectors)
  if method == 'kmeans':
    return sk_cluster.KMeans(num_groups, n_init=10,
                             random_state=seed).fit_predict(unit)
  if method == 'agglomerative':
    return sk_cluster.AgglomerativeClustering(
        n_clusters=num_groups, metric='cosine',
        linkage='average').fit_predict(unit)
  raise ValueError(f"unknown method {method!r}; use 'kmeans' or "
                   "'agglomerative'")


def adjusted_rand_index(true_groups: Sequence, labels: Sequence) -> float:
  return float(sk_metrics.adjusted_rand_score(list(true_groups), list(labels)))
