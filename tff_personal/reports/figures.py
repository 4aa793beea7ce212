"""The figures of a paper's report: curves over seeds, confusion, 2-D maps.

Every figure is drawn without a display (matplotlib's Agg backend) and saved
as a PNG; a figure with nothing to draw is not written. The paper modules
describe *what* to draw (which runs, which metric); this module draws it.

Example:
  curves = curve_bands.seed_curves(os.path.join(runs_dir, 'fedavg', '*'))
  figures.band_figure(
      'out/accuracy.png',
      [dict(title='task A', lines=[
          dict(curves=curves, y='accuracy', label='fedavg')],
            vlines=[dict(x=20, label='T')])],
      xlabel='round', ylabel='test accuracy')
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from tff_personal.core import atomic_io
from tff_personal.reports import curve_bands


def pyplot():
  """matplotlib's pyplot on the Agg backend (no display needed)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


def save(fig, path: str, dpi: int = 110, **savefig_kwargs) -> str:
  """Saves `fig` as `path` (atomically, its directory made) and closes it.

  Returns:
    `path`.
  """
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with atomic_io.atomic_write(path, mode='wb') as f:
    fig.savefig(f, dpi=dpi, format='png', **savefig_kwargs)
  pyplot().close(fig)
  return path


def band_figure(path: str, panels: Sequence[Mapping[str, Any]], *,
                x: str = 'round', xlabel: str = '', ylabel: str = '',
                yscale: str = 'linear', suptitle: Optional[str] = None,
                legend: str = 'panel',
                handles: Sequence[Mapping[str, Any]] = (),
                panel_size: tuple[float, float] = (5.5, 4.0),
                sharey: bool = False, share_y: Sequence[int] = (),
                dpi: int = 110) -> Optional[str]:
  """Learning curves over seeds (a band of one std), one panel per entry.

  Args:
    path: the PNG to write.
    panels: one mapping per panel, every key optional:
      `lines`: dicts of `curves` (one per seed, what
        `curve_bands.seed_curves` reads), `y` (the metric) and keywords of
        `curve_bands.plot_seed_band` (`label`, `color`, `linestyle`,
        `alpha`); a line whose curves share no point draws nothing;
      `vlines`, `hlines`: dicts of `x` (`y`) and keywords of matplotlib's
        `axvline` (`axhline`); a `label` repeated within a panel is shown
        once in its legend;
      `title`, and `xlabel`, `ylabel`, `yscale`, which override the
        figure's; `ytop`: the y axis' upper limit.
    x: the curves' x key.
    xlabel, ylabel, yscale: every panel's unless it sets its own.
    suptitle: a title over the panels.
    legend: 'panel' (in each panel, of its labelled lines and marks),
      'figure' (one legend right of the panels, of `handles`) or 'none'.
    handles: with legend='figure', the entries: keywords of
      `matplotlib.lines.Line2D` (`label`, `color`, `linestyle`, `marker`).
    panel_size: inches per panel.
    sharey: one y axis for every panel; `share_y`: the panels (indices)
      given one y range, the union of theirs.
    dpi: the PNG's resolution.

  Returns:
    `path`, or None when no line of any panel has a point (nothing
    written).
  """
  if not any(curve_bands.seed_band(l['curves'], x, l['y'])[0]
             for p in panels for l in p.get('lines', ())):
    return None
  plt = pyplot()
  fig, axes = plt.subplots(1, len(panels), squeeze=False, sharey=sharey,
                           figsize=(panel_size[0] * len(panels),
                                    panel_size[1]))
  axes = axes[0]
  for ax, panel in zip(axes, panels):
    for line in panel.get('lines', ()):
      line = dict(line)
      curves, y = line.pop('curves'), line.pop('y')
      curve_bands.plot_seed_band(ax, curves, x, y, **line)
    shown = set()
    for kind, draw in (('vlines', ax.axvline), ('hlines', ax.axhline)):
      for mark in panel.get(kind, ()):
        mark = dict(mark)
        at = mark.pop('x' if kind == 'vlines' else 'y')
        if mark.get('label') in shown:
          mark['label'] = None
        shown.add(mark.get('label'))
        draw(at, **mark)
    ax.set_yscale(panel.get('yscale', yscale))
    ax.set_xlabel(panel.get('xlabel', xlabel))
    ax.set_ylabel(panel.get('ylabel', ylabel))
    ax.set_title(panel.get('title', ''), fontsize=9)
    ax.grid(alpha=0.3)
    if panel.get('ytop') is not None:
      ax.set_ylim(top=panel['ytop'])
    if legend == 'panel' and ax.get_legend_handles_labels()[1]:
      ax.legend(fontsize=8)
  if share_y:
    limits = [axes[i].get_ylim() for i in share_y]
    for i in share_y:
      axes[i].set_ylim(min(lo for lo, _ in limits),
                       max(hi for _, hi in limits))
  if suptitle:
    fig.suptitle(suptitle, fontsize=9)
  fig.tight_layout()
  if legend == 'figure' and handles:
    from matplotlib import lines as mlines  # pylint: disable=g-import-not-at-top
    fig.legend(handles=[mlines.Line2D([], [], **h) for h in handles],
               loc='center left', bbox_to_anchor=(1.0, 0.5), fontsize=8,
               frameon=False)
    return save(fig, path, dpi=dpi, bbox_inches='tight')
  return save(fig, path, dpi=dpi)


def seed_spread(curves: Sequence[Any]) -> str:
  """'mean over N seed(s), band: ± 1 std' (N, or 'M to N' when they differ)
  for a list of each line's curves (one per seed)."""
  seeds = sorted({len(c) for c in curves if c})
  n = (f'{seeds[0]}' if len(seeds) == 1 else
       f'{seeds[0]} to {seeds[-1]}') if seeds else '0'
  return f'mean over {n} seed(s), band: ± 1 std'


def confusion(truth: np.ndarray, assigned: np.ndarray, k: int) -> np.ndarray:
  """Row-normalised confusion matrix [k, k]: truth (rows) x assigned."""
  counts = np.zeros((k, k), np.float64)
  np.add.at(counts, (np.asarray(truth), np.asarray(assigned)), 1.0)
  rows = counts.sum(axis=1, keepdims=True)
  return np.divide(counts, rows, out=np.zeros_like(counts), where=rows > 0)


def map_2d(values: np.ndarray, seed: int = 0) -> np.ndarray:
  """Points [N, D] as [N, 2] to draw: as they are for D = 2, else their
  t-SNE (scikit-learn; perplexity at most 30, PCA start)."""
  values = np.asarray(values)
  if values.shape[1] == 2:
    return values
  from sklearn.manifold import TSNE  # pylint: disable=g-import-not-at-top
  return TSNE(n_components=2, random_state=seed, init='pca',
              perplexity=min(30, len(values) - 1)).fit_transform(values)
