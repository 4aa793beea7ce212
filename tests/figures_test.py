"""`figures.band_figure`: panels with their own axes, marks and y ranges."""

import os

from tff_personal.reports import figures


def _curves(offset):
  return [{'round': [1, 2, 3], 'loss': [offset + 3.0, offset + 2.0,
                                        offset + 1.0]},
          {'round': [1, 2, 3], 'loss': [offset + 4.0, offset + 2.5,
                                        offset + 1.5]}]


def test_panels_carry_their_own_axes_and_reference_lines(tmp_path,
                                                         monkeypatch):
  saved = {}
  real = figures.save
  monkeypatch.setattr(figures, 'save', lambda fig, path, **kw: saved.update(
      fig=fig, axes=list(fig.axes)) or real(fig, path, **kw))
  path = str(tmp_path / 'out' / 'f.png')
  marks = [dict(x=2, color='red', label='T'), dict(x=3, label='T')]
  assert figures.band_figure(path, [
      dict(lines=[dict(curves=_curves(0), y='loss', label='a')],
           vlines=marks, yscale='log', xlabel='round', ylabel='loss',
           title='left', ytop=3.0),
      dict(lines=[dict(curves=_curves(10), y='loss', label='b')],
           hlines=[dict(y=12.0, linestyle='--', label='level')]),
      dict(lines=[dict(curves=_curves(-10), y='loss')])],
                            share_y=(1, 2), suptitle='s') == path
  assert os.path.exists(path)
  left, middle, right = saved['axes']
  assert left.get_yscale() == 'log' and left.get_ylim()[1] == 3.0
  assert left.get_xlabel() == 'round' and left.get_title() == 'left'
  # The mark's label is in the legend once.
  assert [t.get_text() for t in left.get_legend().get_texts()] == ['a', 'T']
  assert [t.get_text() for t in middle.get_legend().get_texts()] == [
      'b', 'level']
  assert right.get_legend() is None  # No label to show.
  assert middle.get_ylim() == right.get_ylim()
  assert middle.get_ylim()[0] <= -9.0 and middle.get_ylim()[1] >= 14.0


def test_nothing_to_draw_writes_nothing(tmp_path):
  path = str(tmp_path / 'f.png')
  empty = [{'round': [], 'loss': []}]
  assert figures.band_figure(path, [
      dict(lines=[dict(curves=empty, y='loss')], vlines=[dict(x=1)])]) is None
  assert figures.band_figure(path, [dict(title='no lines')]) is None
  assert not os.path.exists(path)
