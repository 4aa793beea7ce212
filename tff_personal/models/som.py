"""A self-organising map (Kohonen, 1990) over personal embeddings: TF logic.

FedEmbed section 3.3.1 learns a SOM that maps a personal embedding to a
sub-population (one SOM node per sub-population head). This module holds the
map arithmetic only (no TFF): the nodes' grid, the best-matching unit, the
Kohonen update one embedding asks for, and the head re-use between successive
maps. The federated protocol (who computes what, what is aggregated) is in
`algorithms/fedembed_som.py`.

Written by hand: TensorFlow, TFF and the other pinned libraries have no SOM.

* Grid: K nodes on a `rows x cols` rectangle with `rows` the largest divisor
  of K not above sqrt(K) (K=10: 2 x 5); distances between nodes are Euclidean
  grid distances.
* Best-matching unit (BMU) of e: `argmin_i ||e - w_i||^2`.
* Kohonen update asked for by e: `delta_i = h(bmu, i) * (e - w_i)` with the
  Gaussian neighbourhood `h(c, i) = exp(-d_grid(c, i)^2 / (2 sigma^2))`; the
  map moves by `learning_rate * delta`. Its similarity score is
  `-||e - w_bmu||^2` (0 for a perfectly represented embedding).
* Head re-use ("for each cluster in the new SOM, the weights of the equivalent
  model head from the previous iteration initialize the model head associated
  with the new SOM cluster", identified by maximal overlap of cluster
  membership): from counts `C[i, j]` of users in old cluster i and new cluster
  j, new cluster j takes the head of `argmax_i C[i, j]`; it keeps its own head
  when that one is among the maxima or when no counted user is in j. Several
  new clusters may take the same old head (the paper's rule is per new
  cluster, not a matching).
"""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf


def grid_shape(num_nodes: int) -> tuple[int, int]:
  """(rows, cols) of the most square rectangle holding `num_nodes` nodes."""
  if num_nodes < 1:
    raise ValueError(f'a SOM needs at least one node, got {num_nodes}')
  rows = max(r for r in range(1, math.isqrt(num_nodes) + 1)
             if num_nodes % r == 0)
  return rows, num_nodes // rows


def grid_coordinates(num_nodes: int) -> np.ndarray:
  """float32 [K, 2] (row, col) of each node, row-major."""
  rows, cols = grid_shape(num_nodes)
  r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing='ij')
  return np.stack([r.ravel(), c.ravel()], axis=-1).astype(np.float32)


def squared_distances(nodes: tf.Tensor, e: tf.Tensor) -> tf.Tensor:
  """[K] squared distances from one embedding `e` [D] to the nodes [K, D]."""
  return tf.reduce_sum(tf.square(nodes - e[tf.newaxis, :]), axis=-1)


def best_matching_unit(nodes: tf.Tensor, e: tf.Tensor) -> tf.Tensor:
  """int32 index of the node nearest to `e` (first one on ties)."""
  return tf.argmin(squared_distances(nodes, e), output_type=tf.int32)


def best_matching_units(nodes: tf.Tensor, embeddings: tf.Tensor) -> tf.Tensor:
  """int32 [B] BMU of each row of `embeddings` [B, D]."""
  d = tf.reduce_sum(
      tf.square(embeddings[:, tf.newaxis, :] - nodes[tf.newaxis]), axis=-1)
  return tf.argmin(d, axis=-1, output_type=tf.int32)


def neighbourhood(num_nodes: int, bmu: tf.Tensor, sigma) -> tf.Tensor:
  """[K] Gaussian neighbourhood weights around node `bmu` on the grid."""
  coords = tf.constant(grid_coordinates(num_nodes))
  d2 = tf.reduce_sum(tf.square(coords - tf.gather(coords, bmu)), axis=-1)
  sigma = tf.cast(sigma, tf.float32)
  return tf.exp(-d2 / (2.0 * tf.square(sigma)))


def kohonen_update(nodes: tf.Tensor, e: tf.Tensor, sigma):
  """The update one embedding asks for, before the learning rate.

  Args:
    nodes: [K, D] the map.
    e: [D] one embedding.
    sigma: neighbourhood width (grid units).

  Returns:
    `(delta, score, bmu)`: delta [K, D] = h(bmu, i) (e - w_i); score = the
    similarity -||e - w_bmu||^2; bmu the best-matching unit.
  """
  d2 = squared_distances(nodes, e)
  bmu = tf.argmin(d2, output_type=tf.int32)
  h = neighbourhood(int(nodes.shape[0]), bmu, sigma)
  delta = h[:, tf.newaxis] * (e[tf.newaxis, :] - nodes)
  return delta, -tf.gather(d2, bmu), bmu


def membership_counts(num_nodes: int, old_cluster: tf.Tensor,
                      new_cluster: tf.Tensor) -> tf.Tensor:
  """float32 [K, K] one-hot of (old cluster, new cluster) of one user."""
  return tf.tensordot(tf.one_hot(old_cluster, num_nodes),
                      tf.one_hot(new_cluster, num_nodes), axes=0)


def head_sources(counts: tf.Tensor) -> tf.Tensor:
  """int32 [K]: the old head each new cluster re-uses (module docstring).

  Args:
    counts: [K, K] counts (or any non-negative multiple) of users in old
      cluster i (rows) and new cluster j (columns).
  """
  k = int(counts.shape[0])
  best = tf.reduce_max(counts, axis=0)
  own = tf.linalg.diag_part(counts)
  keep = tf.logical_or(own >= best, best <= 0.0)
  return tf.where(keep, tf.range(k, dtype=tf.int32),
                  tf.argmax(counts, axis=0, output_type=tf.int32))


def decayed(initial: float, final: float, step, decay_steps: float):
  """Exponential decay from `initial` to `final` over `decay_steps` steps.

  `initial * (final / initial) ** min(step / decay_steps, 1)`.
  """
  step = tf.cast(step, tf.float32)
  frac = tf.minimum(step / float(decay_steps), 1.0)
  return initial * tf.pow(final / initial, frac)
