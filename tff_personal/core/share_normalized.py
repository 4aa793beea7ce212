"""A server optimizer that turns a cohort mean into means over parts of it.

Some algorithms update part of the shared model from only some clients: a
HypCluster model from the clients that chose it, a FedEmbed head from the
clients that used it. Each client puts the one-hot of its part in "share"
weights of its update; aggregated (any aggregator, DP included), they hold
each part's share of the cohort. `ShareNormalized` divides each part's mean
update by its share before the inner optimizer applies it, which makes it
the mean over the part's own clients, and gives the share weights a zero
update (they stay at 0). Written here: TFF's optimizers have no per-part
rescaling.

Example:
  layout = ['share', 'share', ('part', 0), ('part', 1)]  # per weight
  optimizer = ShareNormalized(tff.learning.optimizers.build_sgdm(1.0),
                              layout)
"""

from __future__ import annotations

from typing import Sequence, Union

import tensorflow as tf
import tensorflow_federated as tff

# Per shared trainable weight (flattened order): 'share' (a share slot, its
# entries in order giving shares 0, 1, ...), 'plain' (unchanged),
# ('part', j) (scaled by share j) or 'rows' (row j scaled by share j).
Slot = Union[str, tuple[str, int]]


class ShareNormalized(tff.learning.optimizers.Optimizer):
  """`inner` applied to the aggregate with each part divided by its share
  (module docstring); a part whose share is at most `min_share` (nobody
  used it, or under DP its noisy share is that small) gets no update."""

  def __init__(self, inner: tff.learning.optimizers.Optimizer,
               layout: Sequence[Slot], min_share: float = 1e-3):
    if 'share' not in layout:
      raise ValueError('the layout has no share slot')
    self._inner = inner
    self._layout = list(layout)
    self._min_share = min_share

  def initialize(self, specs):
    return self._inner.initialize(specs)

  def next(self, state, weights, gradients):
    flat = tf.nest.flatten(gradients)
    shares = tf.concat([tf.reshape(g, [-1]) for g, slot in
                        zip(flat, self._layout) if slot == 'share'], 0)
    scale = tf.where(shares > self._min_share,
                     1.0 / tf.maximum(shares, self._min_share), 0.0)
    out = []
    for g, slot in zip(flat, self._layout):
      if slot == 'share':
        out.append(tf.zeros_like(g))
      elif slot == 'rows':
        out.append(g * tf.reshape(scale, [-1] + [1] * (len(g.shape) - 1)))
      elif slot == 'plain':
        out.append(g)
      else:
        out.append(g * scale[slot[1]])
    return self._inner.next(state, weights,
                            tf.nest.pack_sequence_as(gradients, out))

  def get_hparams(self, state):
    return self._inner.get_hparams(state)

  def set_hparams(self, state, hparams):
    return self._inner.set_hparams(state, hparams)
