"""binaries.dp_budget: the accounting grid and the update probe it reports."""

import json

from absl import flags
from absl.testing import flagsaver
import numpy as np
import pytest

from binaries import dp_budget
from tff_personal.core import privacy

FLAGS = flags.FLAGS


def _flags(tmp_path, mnist_dir, **kw):
  if not FLAGS.is_parsed():
    FLAGS(['dp_budget'])
  values = dict(task='mnist_preference', algorithm='global_plus',
                data_dir=mnist_dir, num_users=40, clients_per_round=10,
                rounds=4, dp='gaussian_fixed', target_epsilon=10.0,
                clip_norm=0.05, budget_grid=['10x4', '40x4'], probe_users=6,
                output=str(tmp_path / 'budget.json'), seed=3,
                root_output_dir=str(tmp_path))
  values.update(kw)
  return flagsaver.flagsaver(**values)


def test_grid_and_probe(tmp_path, mnist_dir):
  with _flags(tmp_path, mnist_dir):
    assert dp_budget.main(['dp_budget']) == 0
  with open(tmp_path / 'budget.json') as f:
    out = json.load(f)
  # d is the shared model's size: Global+'s MNIST CNN without its private
  # embedding, so neither zero nor the personal tensor's size.
  assert out['d'] > 1000
  delta = out['delta']
  assert delta < 1 / 40
  for row in out['grid']:
    z = privacy.calibrate_noise_multiplier(privacy.DPConfig(
        mechanism='gaussian_fixed', target_epsilon=10.0, clip_norm=0.05,
        target_delta=delta, clients_per_round=row['cohort'], population=40,
        rounds=row['rounds']))
    assert row['noise_multiplier'] == pytest.approx(z)
    assert row['run_noise_norm'] == pytest.approx(
        z * 0.05 / row['cohort'] * np.sqrt(row['rounds'] * out['d']))
  # Full participation needs a larger multiplier than a quarter cohort, but
  # spreads it over 4x the clients: less noise per coordinate.
  small, full = out['grid']
  assert full['noise_multiplier'] > small['noise_multiplier']
  assert full['noise_std_per_coordinate'] < small['noise_std_per_coordinate']
  assert out['probed_users'] == 6
  assert out['median_update_norm'] > 0
  # A clipped update's coherent part is at most the clip.
  assert 0 <= out['coherent_clipped_norm'] <= 0.05 + 1e-9
  assert out['round_noise_at']['cohort'] == 10
  # The parts cut the same update: their sizes add up to d, their noise
  # norms squared to the whole round's, and no part keeps more than the
  # whole update's coherent norm (up to the estimator's spread).
  parts = out['parts']
  assert sum(p['size'] for p in parts) == out['d']
  assert all(p['size'] == np.prod(p['shape']) for p in parts)
  assert sum(p['round_noise_norm'] ** 2 for p in parts) == pytest.approx(
      out['round_noise_norm'] ** 2)
  assert sum(p['coherent_clipped_norm'] ** 2 for p in parts) == pytest.approx(
      out['coherent_clipped_norm'] ** 2, rel=0.05, abs=1e-6)


@pytest.mark.parametrize('overrides,message', [
    (dict(dp='none', target_epsilon=None), 'needs --dp=gaussian_fixed'),
    (dict(budget_grid=['10by4']), "'10by4' is not COHORTxROUNDS"),
    (dict(budget_grid=['80x4']), 'cohort larger than the population 40'),
    (dict(budget_grid=['10x0']), 'cohort and rounds must be positive'),
    (dict(probe_users=1), '--probe_users must be >= 2'),
])
def test_bad_flags_are_named(tmp_path, mnist_dir, capsys, overrides, message):
  with _flags(tmp_path, mnist_dir, **overrides):
    assert dp_budget.main(['dp_budget']) == 2
  assert message in capsys.readouterr().err
