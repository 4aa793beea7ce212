"""Local training alone: each user fits a head on fixed features, by itself.

The "local" reference of personalization benchmarks: nothing is federated
and nothing leaves a user's device, so it spends no privacy budget and DP
changes nothing about it. With a frozen encoder (FedEmbed's table
`3_public`) a user's local model is a head on that encoder's features of its
own training samples. It answers one question: whether a user's own samples
suffice once the features are good, i.e. whether federating anything pays
on the task.

The head is an L2-regularised logistic regression, fitted per user to
convergence by scikit-learn's `LogisticRegression` (lbfgs, inverse strength
`c`; its default `c = 1` is the headline value, fixed before any run). A
user whose training labels are all of one class gets that class for every
test sample (logistic regression needs two classes). Written here: only the
per-user loop and the logits in the form `core.evaluation.
preference_metrics` takes; scikit-learn does the fitting.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np
import tensorflow as tf

from tff_personal.core import evaluation

DEFAULT_C = 1.0


def encode(encoder: tf.keras.Model, x: np.ndarray,
           batch_size: int = 256) -> np.ndarray:
  """float32 [n, features]: `encoder(x)` (inference mode) in batches."""
  if batch_size < 1:
    raise ValueError(f'batch_size must be >= 1, got {batch_size}')
  out = [np.asarray(encoder(x[i:i + batch_size], training=False))
         for i in range(0, len(x), batch_size)]
  return (np.concatenate(out).astype(np.float32) if out
          else np.zeros((0, encoder.output_shape[-1]), np.float32))


def fit_predict(train_features: np.ndarray, train_labels: np.ndarray,
                test_features: np.ndarray, c: float = DEFAULT_C,
                seed: int = 0) -> np.ndarray:
  """One user's test logits [m, 2] from a head fitted on its train samples.

  Args:
    train_features: [n, d] the user's training features.
    train_labels: [n] 0/1 labels.
    test_features: [m, d] the user's test features.
    c: inverse L2 strength of the logistic regression (> 0).
    seed: scikit-learn's `random_state` (lbfgs does not use it; kept so the
      fit is pinned if the solver changes).

  Returns:
    [m, 2] logits `(0, w.x + b)`: column 1 minus column 0 is the decision
    function, so argmax predicts 1 exactly where scikit-learn's `predict`
    does. A one-class user gets `(0, +-1)`, that class everywhere.

  Raises:
    ValueError: shapes, labels or `c` bad, named.
  """
  from sklearn import linear_model  # pylint: disable=g-import-not-at-top
  train_features = np.asarray(train_features, np.float64)
  test_features = np.asarray(test_features, np.float64)
  labels = np.asarray(train_labels)
  if not c > 0:
    raise ValueError(f'c must be > 0, got {c}')
  if (train_features.ndim != 2 or test_features.ndim != 2
      or train_features.shape[1] != test_features.shape[1]):
    raise ValueError(
        f'features must be [n, d] and [m, d]; got train '
        f'{train_features.shape}, test {test_features.shape}')
  if labels.shape != (len(train_features),):
    raise ValueError(f'train_labels must be [{len(train_features)}], got '
                     f'{labels.shape}')
  if len(labels) == 0:
    raise ValueError('a user without training samples has no local model')
  if not np.all(np.isin(labels, (0, 1))):
    raise ValueError(f'train_labels must be 0/1, got {np.unique(labels)}')
  logits = np.zeros((len(test_features), 2), np.float32)
  classes = np.unique(labels)
  if len(classes) == 1:
    logits[:, 1] = 1.0 if classes[0] == 1 else -1.0
    return logits
  model = linear_model.LogisticRegression(C=c, max_iter=1000,
                                          random_state=seed)
  model.fit(train_features, labels.astype(np.int64))
  logits[:, 1] = model.decision_function(test_features)
  return logits


def local_outputs(train: Sequence[tuple[np.ndarray, np.ndarray]],
                  test: Sequence[tuple[np.ndarray, np.ndarray]],
                  c: float = DEFAULT_C, seed: int = 0) -> list[dict]:
  """Per user `{'outputs': [m, 2] logits, 'labels': [m]}` of local heads.

  Args:
    train: per user (features [n, d], labels [n]).
    test: per user (features [m, d], labels [m]), in the same user order.
    c: as `fit_predict`.
    seed: as `fit_predict`.
  """
  if len(train) != len(test):
    raise ValueError(f'{len(train)} users with training data, {len(test)} '
                     'with test data')
  return [{'outputs': fit_predict(xf, y, tf_, c=c, seed=seed),
           'labels': np.asarray(ty)}
          for (xf, y), (tf_, ty) in zip(train, test)]


def user_features(load: Callable[[int, str], tuple[np.ndarray, np.ndarray]],
                  users: Sequence[int],
                  features: Callable[[np.ndarray], np.ndarray],
                  log_fn: Optional[Callable[[str], None]] = None
                  ) -> tuple[list, list]:
  """Each user's (features, labels) of its training and of its test split.

  Args:
    load: `(user, split) -> (inputs, labels)`, split 'train' or 'test'.
    users: the users, in order.
    features: inputs -> [n, d] fixed features.
    log_fn: receives a progress line every 300 users and at the end.

  Returns:
    `(train, test)`: per user `(features, labels)`, what `local_outputs`
    takes.
  """
  train, test = [], []
  for n, user in enumerate(users):
    for split, out in (('train', train), ('test', test)):
      x, y = load(user, split)
      out.append((features(x), y))
    if log_fn and ((n + 1) % 300 == 0 or n + 1 == len(users)):
      log_fn(f'features of {n + 1}/{len(users)} users')
  return train, test


def evaluate(train: Sequence[tuple[np.ndarray, np.ndarray]],
             test: Sequence[tuple[np.ndarray, np.ndarray]],
             groups: Sequence[int], c_values: Sequence[float] = (DEFAULT_C,),
             seed: int = 0) -> dict[float, dict]:
  """Local heads' preference metrics (`core.evaluation.preference_metrics`
  over the users' `groups`) at each inverse strength in `c_values`.

  Example:
    train, test = user_features(load, users, features)
    f1 = evaluate(train, test, groups)[DEFAULT_C]['f1']
  """
  return {c: evaluation.preference_metrics(
      local_outputs(train, test, c=c, seed=seed), groups) for c in c_values}
