"""Statistics of client updates for DP diagnostics (numpy; written by hand).

Under user-level DP each client's update is clipped to `clip` and Gaussian
noise of std `z * clip` is added to their sum. What survives the noise is the
part of the clipped updates that clients share: the norm of the expected
clipped update, ||E[clip(u)]||, against the noise's norm on the mean,
z * clip / cohort * sqrt(d) per round. `coherent_norm` estimates the former
from a sample of updates; neither TFF nor tensorflow-privacy reports it.
"""

from __future__ import annotations

import numpy as np


def clip_rows(updates: np.ndarray, clip: float) -> np.ndarray:
  """Each row scaled to L2 norm at most `clip` (the DP aggregator's clip)."""
  if clip <= 0:
    raise ValueError(f'clip must be positive, got {clip}')
  updates = np.asarray(updates, np.float64)
  norms = np.linalg.norm(updates, axis=1, keepdims=True)
  return updates * np.minimum(1.0, clip / np.maximum(norms, 1e-30))


def coherent_norm(updates: np.ndarray) -> float:
  """Unbiased-in-square estimate of ||E[u]|| from iid rows u_1..u_n.

  ||mean||^2 overestimates ||E u||^2 by the variance term
  (E||u||^2 - ||E u||^2) / n; solving for ||E u||^2 gives
  (n ||mean||^2 - mean ||u_i||^2) / (n - 1), clipped at 0.
  """
  updates = np.asarray(updates, np.float64)
  n = updates.shape[0]
  if updates.ndim != 2 or n < 2:
    raise ValueError('coherent_norm needs a 2-D array of at least 2 updates, '
                     f'got shape {updates.shape}')
  mean = updates.mean(axis=0)
  mean_sq = float((updates ** 2).sum(axis=1).mean())
  estimate = (n * float(mean @ mean) - mean_sq) / (n - 1)
  return float(np.sqrt(max(estimate, 0.0)))


def noise_norm(noise_multiplier: float, clip: float, cohort: int, d: int,
               rounds: int = 1) -> float:
  """Expected L2 norm of the Gaussian noise on the mean update, summed over
  `rounds` rounds: std `noise_multiplier * clip / cohort` per coordinate in
  `d` coordinates (sqrt(rounds * d) times that std)."""
  return noise_multiplier * clip / cohort * float(np.sqrt(rounds * d))
