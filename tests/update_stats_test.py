"""Tests of the client-update statistics used by DP diagnostics."""

import numpy as np
import pytest

from tff_personal.core import update_stats


def test_clip_rows_scales_long_rows_only():
  u = np.array([[3.0, 4.0], [0.3, 0.4]])
  out = update_stats.clip_rows(u, 1.0)
  np.testing.assert_allclose(out, [[0.6, 0.8], [0.3, 0.4]])
  with pytest.raises(ValueError, match='clip must be positive'):
    update_stats.clip_rows(u, 0.0)


def test_identical_updates_are_fully_coherent():
  v = np.array([1.0, -2.0, 2.0])
  assert update_stats.coherent_norm(np.tile(v, (5, 1))) == pytest.approx(3.0)


def test_zero_mean_noise_has_no_coherent_part_and_signal_is_recovered():
  rng = np.random.default_rng(0)
  n, d = 100, 20000
  noise = rng.normal(size=(n, d))  # ||u|| ~ 141, ||mean|| ~ 14
  assert update_stats.coherent_norm(noise) < 3.0  # std of its square ~1.4
  signal = np.zeros(d)
  signal[:100] = 1.0  # ||signal|| = 10, buried under per-row noise of 141
  estimate = update_stats.coherent_norm(noise + signal)
  assert estimate == pytest.approx(10.0, rel=0.15)
  assert np.linalg.norm((noise + signal).mean(0)) > 15  # the naive norm is off


def test_coherent_norm_names_bad_shapes():
  with pytest.raises(ValueError, match='at least 2 updates'):
    update_stats.coherent_norm(np.ones((1, 3)))
