"""What a DP budget leaves of a model's updates: the accounting grid and
the probe summary that `binaries/dp_budget.py` prints (numpy; the noise
multipliers and accountants are `core/privacy.py`'s, i.e. dp-accounting's).

For a resolved `privacy.DPConfig` (delta, clip, sampling) and an epsilon:

* `budget_rows`: for each cohort x rounds, the noise multiplier that
  calibrates to the same epsilon, the accountant that did it, the noise std
  on the mean update per coordinate and unit of clip (z / cohort) and the
  norm of all the noise a run adds (z * clip / cohort * sqrt(rounds * d)).
* `probe_summary`: from one round's client updates (rows), their median
  norm, the clipped fraction, and the coherent norm of the clipped updates
  (`update_stats.coherent_norm`) against one round's noise norm at the
  config's cohort.
* `probe_parts`: the same coherent norm and noise norm for each tensor of
  the update (the rows cut by shape after the whole-update clip, as the DP
  aggregator clips): which parameters carry the signal the noise must beat.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from tff_personal.core import privacy
from tff_personal.core import update_stats


def parse_grid(values: Sequence[str],
               population: int | None = None) -> list[tuple[int, int]]:
  """['100x30', ...] -> [(100, 30), ...]; bad entries are named, and so is a
  cohort larger than `population` (if given)."""
  out = []
  for v in values:
    try:
      cohort, rounds = (int(x) for x in v.lower().split('x'))
    except ValueError:
      raise ValueError(f'--budget_grid entry {v!r} is not COHORTxROUNDS, '
                       'e.g. 100x30') from None
    if cohort < 1 or rounds < 1:
      raise ValueError(f'--budget_grid entry {v!r}: cohort and rounds must '
                       'be positive')
    out.append((cohort, rounds))
  if population is not None and any(c > population for c, _ in out):
    raise ValueError(f'--budget_grid has a cohort larger than the '
                     f'population {population}')
  return out


def budget_rows(dp: privacy.DPConfig, epsilon: float, population: int,
                grid: Sequence[tuple[int, int]], d: int) -> list[dict]:
  """One row per (cohort, rounds) at `epsilon` and `dp`'s delta, clip,
  mechanism and sampling.

  `d`: the size of the shared update (what the noise is added to).
  """
  parse_grid([f'{c}x{r}' for c, r in grid], population)
  rows = []
  for cohort, rounds in grid:
    row_config = privacy.resolve(privacy.DPConfig(
        mechanism=dp.mechanism, target_epsilon=epsilon,
        clip_norm=dp.clip_norm, target_delta=dp.target_delta,
        clients_per_round=cohort, population=population, rounds=rounds,
        sampling=dp.sampling))
    z = row_config.noise_multiplier
    rows.append(dict(
        cohort=cohort, rounds=rounds, noise_multiplier=z,
        # PLD where it applies (e.g. full participation), else RDP.
        accountant=privacy.compute_epsilon(row_config, rounds)['accountant'],
        noise_std_per_coordinate=z / cohort,
        run_noise_norm=update_stats.noise_norm(z, dp.clip_norm, cohort, d,
                                               rounds)))
  return rows


def probe_summary(updates: np.ndarray, dp: privacy.DPConfig) -> dict:
  """Norms of one round's client updates (rows) against one round's noise."""
  norms = np.linalg.norm(updates, axis=1)
  clipped = update_stats.clip_rows(updates, dp.clip_norm)
  return dict(
      median_update_norm=float(np.median(norms)),
      clipped_fraction=float(np.mean(norms > dp.clip_norm)),
      coherent_clipped_norm=update_stats.coherent_norm(clipped),
      round_noise_norm=update_stats.noise_norm(
          dp.noise_multiplier, dp.clip_norm, dp.clients_per_round,
          updates.shape[1]),
      round_noise_at=dict(cohort=dp.clients_per_round,
                          noise_multiplier=dp.noise_multiplier))


def probe_parts(updates: np.ndarray, shapes: Sequence[Sequence[int]],
                dp: privacy.DPConfig) -> list[dict]:
  """Per tensor of the update: its size, the coherent norm of its block of
  the clipped updates and one round's noise norm on the block.

  The rows are clipped whole (the aggregator clips a client's whole
  update), then cut into `shapes` in order. Noise is isotropic, so a
  block of size d_i gets noise norm z * clip / cohort * sqrt(d_i); the
  blocks' squared noise norms add up to the whole update's.

  Raises:
    ValueError: `shapes` do not add up to the rows' length (named).
  """
  updates = np.asarray(updates, np.float64)
  sizes = [int(np.prod(s)) for s in shapes]
  if sum(sizes) != updates.shape[1]:
    raise ValueError(f'shapes {list(shapes)} hold {sum(sizes)} values, the '
                     f'updates {updates.shape[1]}')
  clipped = update_stats.clip_rows(updates, dp.clip_norm)
  parts, start = [], 0
  for shape, size in zip(shapes, sizes):
    block = clipped[:, start:start + size]
    start += size
    parts.append(dict(
        shape=list(shape), size=size,
        coherent_clipped_norm=update_stats.coherent_norm(block),
        round_noise_norm=update_stats.noise_norm(
            dp.noise_multiplier, dp.clip_norm, dp.clients_per_round, size)))
  return parts


def markdown(result: dict) -> str:
  """The report of `binaries.dp_budget` from its result dict."""
  lines = [
      f'd = {result["d"]} shared parameters; epsilon {result["epsilon"]} at '
      f'delta {result["delta"]:.3g}, clip {result["clip_norm"]}',
      '| cohort | rounds | noise multiplier | accountant | std / coordinate '
      '| run noise norm |', '|---:|---:|---:|---|---:|---:|']
  for r in result['grid']:
    lines.append(
        f'| {r["cohort"]} | {r["rounds"]} | {r["noise_multiplier"]:.3f} | '
        f'{r["accountant"]} | {r["noise_std_per_coordinate"]:.5f} | '
        f'{r["run_noise_norm"]:.2f} |')
  lines.append(
      f'probe ({result["probed_users"]} users, one round of local training '
      'from the initial model): '
      f'median update norm {result["median_update_norm"]:.3f}, '
      f'{result["clipped_fraction"]:.0%} clipped; coherent clipped norm '
      f'{result["coherent_clipped_norm"]:.3f} vs one round\'s noise norm '
      f'{result["round_noise_norm"]:.3f} '
      f'(cohort {result["round_noise_at"]["cohort"]})')
  if result.get('parts'):
    lines += ['', '| update tensor | size | coherent clipped norm | one '
              'round\'s noise norm | ratio |', '|---|---:|---:|---:|---:|']
    for p in result['parts']:
      lines.append(
          f'| {tuple(p["shape"])} | {p["size"]} | '
          f'{p["coherent_clipped_norm"]:.4f} | {p["round_noise_norm"]:.4f} | '
          f'{p["coherent_clipped_norm"] / p["round_noise_norm"]:.3f} |')
  return '\n'.join(lines)
