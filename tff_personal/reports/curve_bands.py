"""Learning curves over seeds: read each seed's curve, band them, draw them.

A paper's cell writes one curve per seed (`<cell>/seed_<k>/curve.json`);
`seed_curves` reads them back, `seed_band` gives their mean and sample std
at each x, and `plot_seed_band` draws that band on a matplotlib axis.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any, Mapping, Optional, Sequence

from tff_personal.reports import reporting


def seed_curves(cell_pattern: str, filename: str = 'curve.json',
                x: str = 'round') -> list[dict[str, Any]]:
  """Every seed's learning curve of the cells whose directories match a glob.

  A cell's run writes one JSON file per seed, `<cell>/seed_<k>/<filename>`,
  with equal-length lists under its x key and its metrics (what
  `seed_band` takes). Curves with no point on `x` (a seed stopped before
  its first evaluation) are left out, so they do not empty the band.

  Args:
    cell_pattern: a `glob` pattern of cell directories (the directories
      that hold `seed_*`), e.g. `<root>/runs/<paper>/<method>/dp=none*`.
    filename: the curve file in each seed's directory.
    x: the key of the x values.

  Returns:
    The curves, in sorted path order.

  Example:
    curves = curve_bands.seed_curves(os.path.join(runs, 'fedavg', 'dp=none*'))
    curve_bands.plot_seed_band(ax, curves, 'round', 'accuracy')
  """
  curves = []
  for path in sorted(glob.glob(os.path.join(cell_pattern, 'seed_*',
                                            filename))):
    with open(path, encoding='utf-8') as f:
      curve = json.load(f)
    if curve.get(x):
      curves.append(curve)
  return curves


def seed_band(curves: Sequence[Mapping[str, Sequence[float]]],
              x: str = 'round', y: str = 'f1'
              ) -> tuple[list[float], list[float], list[float]]:
  """A learning curve over seeds: `(xs, means, stds)` over the x range that
  every seed's curve covers (a seed still running stops the band there).

  The xs are every seed's evaluation points within that range. Where seeds
  were evaluated at the same points (the usual case) the band is exactly
  their mean and std there; a seed evaluated at other points (e.g. a run
  made with another evaluation interval) is interpolated linearly between
  its own points.

  Args:
    curves: one dict per seed, with equal-length lists under `x` and `y`
      (e.g. a cell's `curve.json`).
    x: the key of the x values (round, epoch).
    y: the key of the metric.

  Returns:
    The x values, sorted, and `summarize`'s mean and sample std (ddof=1; 0
    for one seed) of `y` at each.

  Example:
    xs, mean, std = curve_bands.seed_band(curves, 'epoch', 'eval_accuracy')
    ax.fill_between(xs, np.subtract(mean, std), np.add(mean, std))
  """
  points = [sorted(zip(c[x], c[y])) for c in curves]
  if not points or not all(points):
    return [], [], []
  lo = max(p[0][0] for p in points)
  hi = min(p[-1][0] for p in points)
  xs = sorted({v for p in points for v, _ in p if lo <= v <= hi})

  def at(p, v):
    """`p`'s value at `v`: its own point, else linear between neighbours."""
    for (x0, y0), (x1, y1) in zip(p, p[1:] + p[-1:]):
      if x0 == v:
        return y0
      if x0 < v < x1:
        return y0 + (y1 - y0) * (v - x0) / (x1 - x0)
    raise AssertionError(f'{v} outside the curve')  # xs are within range.

  summaries = [reporting.summarize([at(p, v) for p in points]) for v in xs]
  return xs, [s.mean for s in summaries], [s.std for s in summaries]


def plot_seed_band(ax, curves: Sequence[Mapping[str, Sequence[float]]],
                   x: str = 'round', y: str = 'f1', *, color=None,
                   linestyle: str = '-', label: Optional[str] = None,
                   alpha: float = 0.15) -> int:
  """Draws `seed_band(curves, x, y)` on a matplotlib `ax`: the mean, and a
  band of one standard deviation when there are two seeds or more.

  Returns:
    The number of points drawn (0 when the curves share none).
  """
  xs, mean, std = seed_band(curves, x, y)
  if not xs:
    return 0
  line, = ax.plot(xs, mean, linestyle=linestyle, marker='.', markersize=3,
                  color=color, label=label)
  if len(curves) > 1:
    ax.fill_between(xs, [m - s for m, s in zip(mean, std)],
                    [m + s for m, s in zip(mean, std)],
                    color=line.get_color(), alpha=alpha, linewidth=0)
  return len(xs)
