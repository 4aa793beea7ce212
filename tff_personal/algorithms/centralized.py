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
  """A trained model, its eval accuracy after each epoch, seconds per
  epoch, the learning curve: `(epoch, eval accuracy)` at every
  evaluation, fractional epochs included (`evals_per_epoch`), and the
  trained model's test accuracy (None without test data)."""
  model: tf.keras.Model
  eval_accuracy_per_epoch: list[float]
  seconds_per_epoch: float
  curve: list[tuple[float, float]] = dataclasses.field(default_factory=list)
  test_accuracy: Optional[float] = None


def _accuracy(model: tf.keras.Model, evaluation: tf.data.Dataset) -> float:
  """Accuracy of `model`'s logits on `(inputs, y)` batches, without
  Keras' compiled metrics (which `fit` is still updating)."""
  correct = total = 0
  for x, y in evaluation:
    predicted = tf.argmax(model(x, training=False), axis=-1,
                          output_type=tf.int32)
    correct += int(tf.reduce_sum(tf.cast(
        predicted == tf.cast(y, tf.int32), tf.int32)))
    total += int(tf.size(y))
  return correct / total if total else float('nan')


class _EvalWithinEpoch(tf.keras.callbacks.Callback):
  """Evaluates at `evals_per_epoch - 1` evenly spaced batches of an epoch
  (the epoch's end is evaluated by `train_centralized` itself)."""

  def __init__(self, evaluation, batches_per_epoch: int, evals_per_epoch: int,
               epoch: int, curve: list):
    super().__init__()
    self._evaluation = evaluation
    self._epoch = epoch
    self._curve = curve
    self._at = {round(batches_per_epoch * i / evals_per_epoch): i
                for i in range(1, evals_per_epoch)}
    self._batches = batches_per_epoch
    self.seconds = 0.0  # Spent evaluating (left out of the epoch's time).

  def on_train_batch_end(self, batch, logs=None):
    done = batch + 1
    if done in self._at and done < self._batches:
      t0 = time.perf_counter()
      self._curve.append((self._epoch - 1 + done / self._batches,
                          _accuracy(self.model, self._evaluation)))
      self.seconds += time.perf_counter() - t0


def train_centralized(model: tf.keras.Model,
                      train_data: tf.data.Dataset,
                      eval_data: Optional[tf.data.Dataset],
                      *,
                      epochs: int,
                      learning_rate: float,
                      optimizer: str = 'sgd',
                      seed: int = 0,
                      log_fn: Callable[[str], None] = print,
                      evals_per_epoch: int = 1,
                      test_data: Optional[tf.data.Dataset] = None
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
    evals_per_epoch: evaluations per epoch for the learning curve (the last
      at the epoch's end); the others, at evenly spaced batches, do not
      change training. Needs `train_data` of known cardinality when > 1.
    test_data: batched test elements, scored once after training (or None).

  Returns:
    The trained model, the eval accuracy after each epoch, seconds of
    training per epoch (evaluations left out), the curve and the test
    accuracy.

  Example:
    result = train_centralized(model, train, evaluation, epochs=5,
                               learning_rate=3e-3, evals_per_epoch=2)
    epochs, accuracy = zip(*result.curve)  # 10 points
  """
  if epochs < 1:
    raise ValueError(f'epochs must be >= 1, got {epochs}')
  if evals_per_epoch < 1:
    raise ValueError(f'evals_per_epoch must be >= 1, got {evals_per_epoch}')
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
  batches = int(train.cardinality())
  if evals_per_epoch > 1 and evaluation is not None and batches < 1:
    raise ValueError('evals_per_epoch > 1 needs train_data of known, '
                     f'finite cardinality, got {batches}')
  curve, times, points = [], [], []
  for epoch in range(1, epochs + 1):
    t0 = time.perf_counter()
    callbacks = ([_EvalWithinEpoch(evaluation, batches, evals_per_epoch,
                                   epoch, points)]
                 if evals_per_epoch > 1 and evaluation is not None else [])
    history = model.fit(train, epochs=1, verbose=0, callbacks=callbacks)
    times.append(time.perf_counter() - t0 - sum(c.seconds for c in callbacks))
    acc = float('nan')
    if evaluation is not None:
      acc = float(model.evaluate(evaluation, verbose=0, return_dict=True)[
          'accuracy'])
      points.append((float(epoch), acc))
    curve.append(acc)
    log_fn(f'epoch {epoch}/{epochs} | train loss '
           f'{history.history["loss"][-1]:.4f} | eval accuracy {acc:.4f} | '
           f'{times[-1]:.1f} s')
  test_accuracy = None
  if test_data is not None:
    test_accuracy = float(model.evaluate(
        test_data.map(split), verbose=0, return_dict=True)['accuracy'])
  return CentralizedResult(model=model, eval_accuracy_per_epoch=curve,
                           seconds_per_epoch=float(np.mean(times)),
                           curve=points, test_accuracy=test_accuracy)
