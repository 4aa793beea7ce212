"""Centralized ("server") training references: all users' data pooled.

FURL's Table 2 compares FL against server training of the same network on the
same splits ("Server-training uses SGD"): Global Server (no user embedding)
and Personalized Server (a user-embedding table). This is plain Keras; it has
no privacy and exists to measure what federation and privacy cost.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional

import numpy as np
import tensorflow as tf


@dataclasses.dataclass
class CentralizedResult:
  model: tf.keras.Model
  eval_accuracy_per_epoch: list[float]
  seconds_per_epoch: float


def train_centralized(model: tf.keras.Model,
                      train_data: tf.data.Dataset,
                      eval_data: Optional[tf.data.Dataset],
                      *,
                      epochs: int,
                      learning_rate: float,
                      optimizer: str = 'sgd',
                      seed: int = 0,
                      log_fn: Callable[[str], None] = print
                      ) -> CentralizedResult:
  """Trains with Keras; evaluates accuracy on `eval_data` after every epoch.

  Args:
    model: a Keras model producing logits; inputs match the dataset's
      elements minus the label `y`.
    train_data: batched, shuffled elements with a `y` label field.
    eval_data: batched eval elements (or None).
    epochs: passes over `train_data`.
    learning_rate: optimizer learning rate.
    optimizer: 'sgd' (FURL's choice) or 'adam'.
    seed: Keras global seed (initialisation, dropout).
    log_fn: receives one line per epoch.

  Returns:
    The trained model, the eval accuracy after each epoch, seconds per epoch.
  """
  if epochs < 1:
    raise ValueError(f'epochs must be >= 1, got {epochs}')
  tf.keras.utils.set_random_seed(seed)
  opt = {'sgd': tf.keras.optimizers.SGD, 'adam': tf.keras.optimizers.Adam}
  if optimizer not in opt:
    raise ValueError(f"optimizer must be 'sgd' or 'adam', got {optimizer!r}")
  model.compile(
      optimizer=opt[optimizer](learning_rate=learning_rate),
      loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
      metrics=['accuracy'])
  split = lambda d: (
      {k: v for k, v in d.items() if k != 'y'}, d['y'])
  train = train_data.map(split)
  evaluation = eval_data.map(split) if eval_data is not None else None
  curve, times = [], []
  for epoch in range(1, epochs + 1):
    t0 = time.perf_counter()
    history = model.fit(train, epochs=1, verbose=0)
    times.append(time.perf_counter() - t0)
    acc = float('nan')
    if evaluation is not None:
      acc = float(model.evaluate(evaluation, verbose=0, return_dict=True)[
          'accuracy'])
    curve.append(acc)
    log_fn(f'epoch {epoch}/{epochs} | train loss '
           f'{history.history["loss"][-1]:.4f} | eval accuracy {acc:.4f} | '
           f'{times[-1]:.1f} s')
  return CentralizedResult(model=model, eval_accuracy_per_epoch=curve,
                           seconds_per_epoch=float(np.mean(times)))
