"""tff_personal.core.dp_budget: the grid, the probe summary, the report
(numpy and dp-accounting only; no TFF run)."""

import numpy as np
import pytest

from tff_personal.core import dp_budget
from tff_personal.core import privacy


def _dp(cohort=10, population=40, rounds=4, epsilon=10.0, clip=0.5):
  return privacy.resolve(privacy.DPConfig(
      mechanism='gaussian_fixed', target_epsilon=epsilon, clip_norm=clip,
      clients_per_round=cohort, population=population, rounds=rounds))


def test_parse_grid_and_named_errors():
  assert dp_budget.parse_grid(['10x4', '40X2']) == [(10, 4), (40, 2)]
  with pytest.raises(ValueError, match="'10by4' is not COHORTxROUNDS"):
    dp_budget.parse_grid(['10by4'])
  with pytest.raises(ValueError, match='must be positive'):
    dp_budget.parse_grid(['0x4'])
  with pytest.raises(ValueError, match='larger than the population 40'):
    dp_budget.parse_grid(['41x1'], population=40)


def test_budget_rows_spend_the_same_epsilon():
  dp = _dp()
  rows = dp_budget.budget_rows(dp, 10.0, 40, [(10, 4), (10, 16), (40, 4)],
                               d=100)
  for row in rows:
    # Each row's multiplier, accounted for its own cohort and rounds, gives
    # back the target epsilon (calibration is a search: epsilon <= target).
    config = privacy.resolve(privacy.DPConfig(
        mechanism='gaussian_fixed', noise_multiplier=row['noise_multiplier'],
        clip_norm=dp.clip_norm, target_delta=dp.target_delta,
        clients_per_round=row['cohort'], population=40,
        rounds=row['rounds']))
    epsilon = privacy.compute_epsilon(config, row['rounds'])['epsilon']
    assert 9.5 < epsilon <= 10.0 + 1e-6
    assert row['noise_std_per_coordinate'] == pytest.approx(
        row['noise_multiplier'] / row['cohort'])
    assert row['run_noise_norm'] == pytest.approx(
        row['noise_multiplier'] * 0.5 / row['cohort']
        * np.sqrt(row['rounds'] * 100))
  few, many, full = rows
  # Four times the rounds at the same epsilon needs more noise per round.
  assert many['noise_multiplier'] > few['noise_multiplier']
  assert full['accountant'] and few['accountant']


def test_probe_summary_of_known_updates():
  dp = _dp(clip=1.0)
  rng = np.random.default_rng(0)
  n, d = 400, 50
  direction = np.zeros(d)
  direction[0] = 1.0
  # Every update: 3 along a shared direction plus isotropic noise of norm
  # about 4, so all are clipped to norm 1 and the shared part after
  # clipping is about 3 / 5 = 0.6.
  updates = 3.0 * direction + rng.normal(scale=4.0 / np.sqrt(d), size=(n, d))
  out = dp_budget.probe_summary(updates, dp)
  assert out['clipped_fraction'] == 1.0
  assert out['median_update_norm'] == pytest.approx(5.0, rel=0.1)
  assert out['coherent_clipped_norm'] == pytest.approx(0.6, abs=0.06)
  assert out['round_noise_norm'] == pytest.approx(
      dp.noise_multiplier * 1.0 / dp.clients_per_round * np.sqrt(d))
  assert out['round_noise_at']['cohort'] == dp.clients_per_round


def test_probe_parts_find_the_coherent_tensor_after_the_whole_clip():
  dp = _dp(clip=1.0)
  rng = np.random.default_rng(2)
  n = 400
  # Tensor A (3 x 2): a shared direction of norm 3 plus noise; tensor B
  # (40,): noise of norm about 4 with no shared part. Each update (norm
  # about 5) is clipped to 1 as a whole, so A keeps about 3 / 5 of the clip
  # and B nothing.
  a = np.zeros((n, 6))
  a[:, 0] = 3.0
  a += rng.normal(scale=0.1, size=a.shape)
  b = rng.normal(scale=4.0 / np.sqrt(40), size=(n, 40))
  updates = np.concatenate([a, b], axis=1)
  parts = dp_budget.probe_parts(updates, [(3, 2), (40,)], dp)
  assert [p['shape'] for p in parts] == [[3, 2], [40]]
  assert [p['size'] for p in parts] == [6, 40]
  assert parts[0]['coherent_clipped_norm'] == pytest.approx(0.6, abs=0.06)
  assert parts[1]['coherent_clipped_norm'] < 0.06
  whole = dp_budget.probe_summary(updates, dp)['round_noise_norm']
  assert sum(p['round_noise_norm'] ** 2 for p in parts) == pytest.approx(
      whole ** 2)
  assert parts[0]['round_noise_norm'] == pytest.approx(
      dp.noise_multiplier / dp.clients_per_round * np.sqrt(6))
  with pytest.raises(ValueError, match='hold 45 values, the updates 46'):
    dp_budget.probe_parts(updates, [(3, 2), (39,)], dp)
  text = dp_budget.markdown(dict(
      d=46, epsilon=10.0, delta=dp.target_delta, clip_norm=1.0, grid=[],
      probed_users=n, parts=parts, **dp_budget.probe_summary(updates, dp)))
  assert '| (3, 2) | 6 |' in text and '| (40,) | 40 |' in text


def test_markdown_has_a_row_per_grid_entry():
  dp = _dp()
  updates = np.random.default_rng(1).normal(size=(5, 20))
  result = dict(d=20, epsilon=10.0, delta=dp.target_delta, clip_norm=0.5,
                grid=dp_budget.budget_rows(dp, 10.0, 40, [(10, 4), (20, 2)],
                                           d=20),
                probed_users=5, **dp_budget.probe_summary(updates, dp))
  text = dp_budget.markdown(result)
  assert text.count('\n| 10 | 4 |') == 1 and text.count('\n| 20 | 2 |') == 1
  assert 'probe (5 users' in text
