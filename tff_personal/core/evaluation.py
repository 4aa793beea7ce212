"""Personalized evaluation: each client evaluates with its own private state.

`build_personal_eval` is a TFF computation

    (<ModelWeights@SERVER, {C}@CLIENTS, {D*}@CLIENTS> -> {<outputs, labels>}@CLIENTS)

that broadcasts the shared weights and returns each client's model outputs and
labels *at the clients*: in a deployment the client computes its own metrics
from them and only an aggregate is released; in simulation the driver reads
them to compute per-user metrics (FedEmbed reports the mean over
sub-populations of per-user F1, which needs per-user counts).

The numpy metric functions below are written by hand (F1 per user grouped by
sub-population, pooled ROC AUC); they are a few lines each and the project
avoids a scikit-learn dependency in the library.
"""

from __future__ import annotations

import collections
from typing import Any, Mapping, Sequence

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_personal.core import federated_map
from tff_personal.core import process as process_lib
from tff_personal.core import split_model as split_model_lib
from tff_personal.core import split_training


def build_personal_eval(model_fn: split_model_lib.SplitModelFn,
                        weights_type: tff.Type,
                        client_state_type: tff.Type) -> tff.Computation:
  """Per-client outputs on the client's eval data with its private state."""
  input_spec = process_lib.model_input_spec(model_fn)
  data_type = tff.SequenceType(tff.types.tensorflow_to_type(input_spec))

  @tff.tensorflow.computation(weights_type, client_state_type, data_type)
  def client_eval(weights, client_state, dataset):
    model = model_fn()

    @tf.function
    def run(weights, private, dataset):
      split_training.assign_weights(model, weights, private)
      return _outputs_and_labels(model, dataset)

    return run(weights,
               tuple(client_state[process_lib.CLIENT_STATE_PRIVATE]), dataset)

  return federated_map.broadcast_map(
      client_eval, weights_type, ('client_states', client_state_type),
      ('client_data', data_type))


def _outputs_and_labels(model, dataset):
  # The whole eval set as one batch (client eval sets are small).
  batch = dataset.unbatch().batch(1 << 30).get_single_element()
  return collections.OrderedDict(
      outputs=model.eval_output(batch, model.forward(batch, training=False)),
      labels=batch['y'])


def build_cold_start_eval(model_fn: split_model_lib.SplitModelFn,
                          weights_type: tff.Type,
                          client_state_type: tff.Type,
                          optimizer: tff.learning.optimizers.Optimizer,
                          ) -> tff.Computation:
  """Evaluation after local fine-tuning of the private state only.

    (<ModelWeights@SERVER, {C}@CLIENTS, {D*}@CLIENTS, {D*}@CLIENTS>
      -> {<outputs, labels>}@CLIENTS)

  Each client starts from the given private state (for a user who never took
  part in training: the documented initial state of the client-state store),
  trains only its private variables on its own training data (the shared model
  is frozen; repeat the dataset for more local epochs), then evaluates on its
  test data. Nothing leaves the client. This is FURL's stated future work
  (cold start) and the test-time fine-tuning of FedPerC.
  """
  input_spec = process_lib.model_input_spec(model_fn)
  data_type = tff.SequenceType(tff.types.tensorflow_to_type(input_spec))

  @tff.tensorflow.computation(weights_type, client_state_type, data_type,
                              data_type)
  def client_eval(weights, client_state, train_data, test_data):
    model = model_fn()

    @tf.function
    def run(weights, private, train_data, test_data):
      split_training.assign_weights(model, weights, private)
      split_training.fine_tune_private(model, optimizer, train_data)
      return _outputs_and_labels(model, test_data)

    return run(weights, tuple(client_state[process_lib.CLIENT_STATE_PRIVATE]),
               train_data, test_data)

  return federated_map.broadcast_map(
      client_eval, weights_type, ('client_states', client_state_type),
      ('train_data', data_type), ('test_data', data_type))


def format_metrics(metrics: Mapping[str, Any]) -> str:
  """A log line of `metrics`' float values: `name 0.1234, ...`."""
  return ', '.join(f'{k} {v:.4f}' for k, v in metrics.items()
                   if isinstance(v, float))


def classification_metrics(per_client: Sequence[Mapping[str, Any]]
                           ) -> dict[str, Any]:
  """Accuracy over all examples (`accuracy_pooled`; `accuracy` is the same
  value, the name the recorded tables use) and the mean of per-user
  accuracies (`accuracy_client_mean`, also `user_mean_accuracy`)."""
  correct, total, per_user = 0, 0, []
  for out in per_client:
    preds = np.asarray(out['outputs']).argmax(axis=-1)
    labels = np.asarray(out['labels'])
    correct += int(np.sum(preds == labels))
    total += len(labels)
    if len(labels):
      per_user.append(float(np.mean(preds == labels)))
  pooled = correct / total if total else float('nan')
  client_mean = float(np.mean(per_user)) if per_user else float('nan')
  return {'accuracy': pooled, 'accuracy_pooled': pooled,
          'accuracy_client_mean': client_mean,
          'user_mean_accuracy': client_mean,
          'num_clients': len(per_client), 'num_examples': total}


def pooled_perplexity(per_client_outputs) -> collections.OrderedDict:
  """Perplexity of per-example (sum of token NLLs, number of tokens) rows.

  `per_client_outputs[i]['outputs']` are client i's rows ([n, 2]; e.g. a
  language model's `eval_fn`). Returns the pooled perplexity
  exp(sum NLL / tokens) over every client's tokens, the mean of the
  clients' own perplexities, the tokens and the clients with a token (NaN
  perplexities when there is none).
  """
  nll, tokens, per_user = 0.0, 0.0, []
  for out in per_client_outputs:
    rows = np.asarray(out['outputs'], np.float64).reshape(-1, 2)
    user_nll, user_tokens = rows[:, 0].sum(), rows[:, 1].sum()
    nll, tokens = nll + user_nll, tokens + user_tokens
    if user_tokens:
      per_user.append(float(np.exp(user_nll / user_tokens)))
  return collections.OrderedDict(
      perplexity=float(np.exp(nll / tokens)) if tokens else float('nan'),
      perplexity_user_mean=float(np.mean(per_user)) if per_user
      else float('nan'),
      tokens=float(tokens), clients=len(per_user))


def binary_f1(labels: np.ndarray, predictions: np.ndarray) -> float:
  """F1 of the positive class; 0 when there are no true positives."""
  labels = np.asarray(labels).astype(bool)
  predictions = np.asarray(predictions).astype(bool)
  tp = np.sum(labels & predictions)
  fp = np.sum(~labels & predictions)
  fn = np.sum(labels & ~predictions)
  denom = 2 * tp + fp + fn
  return float(2 * tp / denom) if denom else 0.0


def macro_f1(labels: np.ndarray, predictions: np.ndarray) -> float:
  """Mean of the F1 of "like" (1) and the F1 of "dislike" (0).

  scikit-learn's `f1_score(average='macro')` over both labels (a class with
  no true positives scores 0, as in `binary_f1`). A constant answer scores
  1/3 on a user with both labels in the test set, whichever it is; chance
  guessing about 1/2.
  """
  return _macro_from_like(binary_f1(labels, predictions), labels,
                          predictions)


def _macro_from_like(like: float, labels, predictions) -> float:
  """`macro_f1` given the F1 of "like" (`binary_f1`) already computed."""
  labels = np.asarray(labels).astype(bool)
  predictions = np.asarray(predictions).astype(bool)
  return 0.5 * (like + binary_f1(~labels, ~predictions))


def roc_auc(labels: np.ndarray, scores: np.ndarray) -> float:
  """Area under the ROC curve (Mann-Whitney U with tie correction)."""
  labels = np.asarray(labels).astype(bool)
  scores = np.asarray(scores, dtype=np.float64)
  n_pos, n_neg = labels.sum(), (~labels).sum()
  if n_pos == 0 or n_neg == 0:
    return float('nan')
  order = np.argsort(scores, kind='mergesort')
  ranks = np.empty(len(scores), dtype=np.float64)
  sorted_scores = scores[order]
  i = 0
  while i < len(scores):  # average ranks over ties
    j = i
    while j + 1 < len(scores) and sorted_scores[j + 1] == sorted_scores[i]:
      j += 1
    ranks[order[i:j + 1]] = 0.5 * (i + j) + 1
    i = j + 1
  u = ranks[labels].sum() - n_pos * (n_pos + 1) / 2
  return float(u / (n_pos * n_neg))


def preference_metrics(per_client: Sequence[Mapping[str, Any]],
                       groups: Sequence[int]) -> dict[str, Any]:
  """FedEmbed's metrics from per-client binary logits and labels.

  Args:
    per_client: for each client, `outputs` ([n, 2] logits) and `labels` ([n]).
    groups: each client's sub-population.

  Returns:
    `f1`: mean over sub-populations of the mean per-user F1 of "like"
    (FedEmbed's "mean F1 across all K sub-populations"); `f1_per_group`;
    `f1_user_mean`; `f1_macro` and `f1_macro_per_group`: the same means of
    each user's F1 averaged over both labels (`macro_f1`; the reading of
    FedEmbed's F1 that its tables support: README, "Which F1 the paper
    reports");
    `accuracy` over all examples (also `accuracy_pooled`) and
    `accuracy_client_mean`, the mean of the users' accuracies; `auc` pooled
    over all examples.
  """
  if len(per_client) != len(groups):
    raise ValueError('per_client and groups differ in length')
  by_group = collections.defaultdict(list)
  macro_by_group = collections.defaultdict(list)
  all_labels, all_scores, all_preds, per_user = [], [], [], []
  for out, group in zip(per_client, groups):
    logits = np.asarray(out['outputs'], dtype=np.float64)
    labels = np.asarray(out['labels'])
    preds = logits.argmax(axis=-1)
    scores = logits[:, 1] - logits[:, 0]  # monotone in P(y = 1)
    like = binary_f1(labels, preds)
    by_group[int(group)].append(like)
    macro_by_group[int(group)].append(_macro_from_like(like, labels, preds))
    all_labels.append(labels)
    all_scores.append(scores)
    all_preds.append(preds)
    if len(labels):
      per_user.append(float(np.mean(labels == preds)))
  labels = np.concatenate(all_labels)
  preds = np.concatenate(all_preds)
  f1_per_group = {g: float(np.mean(v)) for g, v in sorted(by_group.items())}
  macro_per_group = {g: float(np.mean(v))
                     for g, v in sorted(macro_by_group.items())}
  return {
      'f1': float(np.mean(list(f1_per_group.values()))),
      'f1_per_group': f1_per_group,
      'f1_user_mean': float(np.mean(
          [f for v in by_group.values() for f in v])),
      'f1_macro': float(np.mean(list(macro_per_group.values()))),
      'f1_macro_per_group': macro_per_group,
      'accuracy': float(np.mean(labels == preds)),
      'accuracy_pooled': float(np.mean(labels == preds)),
      'accuracy_client_mean': float(np.mean(per_user)) if per_user else
                              float('nan'),
      'auc': roc_auc(labels, np.concatenate(all_scores)),
      'num_clients': len(per_client),
      'num_examples': int(len(labels)),
  }
