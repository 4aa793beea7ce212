"""Tests of group personalized FL's building blocks: the task, perplexity,
costs, and the paper's evaluation by hand that group_stage_test holds the
one path to (`tests/group_reference.py`)."""

import collections
import math

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tasks import shakespeare_groups as sg
from tasks import speaker_context_io
from tests import group_reference
from tff_personal.algorithms import fedavg
from tff_personal.algorithms import group_fl
from tff_personal.models import word_lm

_WORDS = {
    sg.COMEDY: 'merry jest fool love wedding laugh',
    sg.TRAGEDY: 'blood death murder grave poison dagger',
    sg.HISTORY: 'king crown war england france battle',
}
_PLAYS = {sg.COMEDY: 'midsummer', sg.TRAGEDY: 'hamlet',
          sg.HISTORY: 'henryv'}


def _speeches(clients_per_genre=3, speeches=(1, 4, 6), seed=0):
  """Synthetic speeches: each genre draws from its own words."""
  rng = np.random.default_rng(seed)
  out = []
  for genre, words in _WORDS.items():
    words = words.split()
    for i in range(clients_per_genre):
      for _ in range(speeches[i % len(speeches)]):
        text = ' '.join(rng.choice(words, 5)) + ' .'
        out.append(speaker_context_io.Utterance(
            f'shakespeare/{_PLAYS[genre]}/C{i}', _PLAYS[genre], text))
  return out


@pytest.fixture(scope='module')
def task():
  return sg.build_task(_speeches(), vocab_size=40, seq_len=8,
                       embedding_dim=4, lstm_units=4, batch_size=4)


@pytest.fixture(scope='module')
def fl_process(task):
  return fedavg.build_global(
      task.model_fn_factory,
      client_optimizer=tff.learning.optimizers.build_sgdm(0.5),
      server_optimizer=fedavg.adam(0.05), metrics_fn=word_lm.metrics_fn,
      seed=1)


def _close(a, b, rtol=1e-6):
  return all(np.allclose(x, y, rtol=rtol, atol=1e-7)
             for x, y in zip(tf.nest.flatten(a), tf.nest.flatten(b)))


# ------------------------------------------------------------------ the task


def test_split_keeps_long_tail_and_vocab_is_from_train_only():
  assert sg.split_counts(1) == (1, 0)
  assert sg.split_counts(2) == (1, 1)
  assert sg.split_counts(4) == (3, 1)
  assert sg.split_counts(8) == (6, 2)
  speeches = _speeches()
  t = sg.build_task(speeches, vocab_size=100, seq_len=8)
  assert t.num_clients == 9  # every character kept, one-speech ones too
  assert sorted(set(t.client_groups)) == sorted(_WORDS)
  assert [t.num_train(c) + t.num_eval(c) for c in range(9)] == [1, 4, 6] * 3
  # A client with two speeches: one is trained on, the other held out; each
  # has a word nobody else says. Only the training one is in the vocabulary.
  two = [speaker_context_io.Utterance('shakespeare/tempest/ARIEL', 'tempest',
                                      text) for text in ('alpha .', 'omega .')]
  t2 = sg.build_task(speeches + two, vocab_size=100, seq_len=8)
  ariel = t2.client_ids.index('shakespeare/tempest/ARIEL')
  assert t2.client_groups[ariel] == sg.ROMANCE
  assert (t2.num_train(ariel), t2.num_eval(ariel)) == (1, 1)
  trained = t2.vocab[t2.train[ariel]['y'][0][0]]
  assert trained in ('alpha', 'omega')
  held_out = 'omega' if trained == 'alpha' else 'alpha'
  assert held_out not in t2.vocab
  assert t2.eval[ariel]['y'][0][0] == sg.UNK_ID


def test_encoding_shifts_targets_and_pads():
  vocab = {w: i for i, w in enumerate(sg.SPECIALS + ('a', 'b'))}
  enc = sg.encode(['a b c', 'a b a b a b a b'], vocab, seq_len=5)
  np.testing.assert_array_equal(enc['x'][0], [sg.BOS_ID, 4, 5, 1, 0])
  np.testing.assert_array_equal(enc['y'][0], [4, 5, 1, sg.EOS_ID, 0])
  # Truncated: first seq_len words as targets, no <eos>.
  np.testing.assert_array_equal(enc['y'][1], [4, 5, 4, 5, 4])
  np.testing.assert_array_equal(enc['x'][1][1:], enc['y'][1][:-1])


def test_genre_table_covers_every_play(shared_shakespeare):
  speeches = sg.load_speeches(shared_shakespeare)
  plays = {u.community for u in speeches}
  assert plays == set(sg.GENRES)
  counts = collections.Counter(sg.GENRES.values())
  assert counts == {sg.COMEDY: 12, sg.HISTORY: 10, sg.TRAGEDY: 11,
                    sg.ROMANCE: 4}


@pytest.fixture(scope='module')
def shared_shakespeare():
  import os  # pylint: disable=g-import-not-at-top
  from tests import conftest  # pylint: disable=g-import-not-at-top
  path = os.path.join(conftest.SHARED_DATA, 'shakespeare')
  if not os.path.isdir(path):
    pytest.skip(f'Shakespeare data not found at {path}')
  return path


# ------------------------------------------------------------- perplexity


def test_perplexity_is_exp_of_keras_token_cross_entropy(task, fl_process):
  weights = fl_process.get_model_weights(fl_process.initialize())
  evaluate = group_reference.build_lm_evaluation(
      task.model_fn, word_lm.metrics_fn, fl_process.model_weights_type)
  clients = [c for c in range(task.num_clients) if task.num_eval(c)]
  sums = group_reference.evaluate_global(evaluate, weights, clients,
                                         task.eval_dataset)
  # Reference: Keras model, same weights, masked mean cross-entropy.
  model = task.model_fn()
  for v, w in zip(model.shared_trainable_variables, weights.trainable):
    v.assign(w)
  nll, count = 0.0, 0
  for c in clients:
    x, y = task.eval[c]['x'], task.eval[c]['y']
    logp = tf.nn.log_softmax(model.model(x)).numpy()
    mask = y != 0
    nll -= np.take_along_axis(logp, y[..., None], -1)[..., 0][mask].sum()
    count += mask.sum()
  assert sum(s['tokens'] for s in sums.values()) == count
  assert group_fl.perplexity(list(sums.values())) == pytest.approx(
      math.exp(nll / count), rel=1e-4)


# ------------------------------------------------------- personalization


def test_personalization_lowers_each_clients_training_loss(task,
                                                           fl_process):
  """Local personalization (Algorithm 3) lowers each client's loss on its
  own training data (what it fine-tuned on) and keeps a model per client."""
  wtype = fl_process.model_weights_type
  personalize = group_reference.build_local_personalization(
      task.model_fn, tff.learning.optimizers.build_sgdm(0.5), wtype)
  evaluate = group_reference.build_lm_evaluation(
      task.model_fn, word_lm.metrics_fn, wtype)
  evaluate_personal = group_reference.build_lm_evaluation(
      task.model_fn, word_lm.metrics_fn, wtype, tff.CLIENTS)
  members = task.clients_of(sg.HISTORY)
  start = fl_process.get_model_weights(fl_process.initialize())
  kept = {}
  sums = group_reference.personalize_and_evaluate(
      personalize, evaluate_personal, start, members,
      lambda c: task.train_dataset(c, 5), lambda c: task.train_dataset(c, 1),
      keep_fn=lambda c, w: kept.setdefault(c, w))
  before = group_reference.evaluate_global(
      evaluate, start, members, lambda c: task.train_dataset(c, 1))
  assert set(kept) == set(members)
  for c in members:
    assert not _close(kept[c], start)
    assert (group_fl.perplexity([sums[c]]) <
            group_fl.perplexity([before[c]]))


def test_personalized_models_and_updates_stay_at_clients(task, fl_process):
  wtype = fl_process.model_weights_type
  personalize = group_reference.build_local_personalization(
      task.model_fn, tff.learning.optimizers.build_sgdm(0.1), wtype)
  assert personalize.type_signature.result.placement == tff.CLIENTS
  assert personalize.type_signature.result.member == wtype
  updates = group_fl.build_client_updates(
      task.model_fn, tff.learning.optimizers.build_sgdm(0.1), wtype)
  assert updates.type_signature.result.placement == tff.CLIENTS
  ev = group_reference.build_lm_evaluation(
      task.model_fn, word_lm.metrics_fn, wtype, tff.CLIENTS)
  assert ev.type_signature.parameter[0].placement == tff.CLIENTS
  assert ev.type_signature.result.placement == tff.CLIENTS


def test_costs():
  assert group_fl.communication_cost(0) == 1
  assert group_fl.communication_cost(20) == 41
  assert group_fl.computation_cost(20, 1, 5) == 25
  assert group_fl.computation_cost(3, 2) == 6


def test_token_sums_pool_a_clients_rows_into_perplexity():
  # Two speeches: (NLL sum, tokens) = (6, 3) and (2, 1).
  sums = group_fl.token_sums({'outputs': np.array([[6.0, 3.0], [2.0, 1.0]],
                                                  np.float32)})
  assert sums == {'token_nll_sum': 8.0, 'tokens': 4.0}
  assert group_fl.token_sums({'outputs': [6.0, 3.0]})['tokens'] == 3.0
  assert group_fl.perplexity([sums, {'token_nll_sum': 0.0, 'tokens': 4.0}]
                             ) == pytest.approx(math.exp(1.0))
