"""Tests of group personalized FL: stages, group isolation, degenerate cases."""

import collections
import math

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tasks import shakespeare_groups as sg
from tasks import speaker_context_io
from tff_personal.algorithms import group_fl
from tff_personal.core import process as process_lib
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
  return group_fl.build_fl(task.model_fn, client_learning_rate=0.5,
                           server_learning_rate=0.05,
                           metrics_fn=word_lm.metrics_fn, seed=1)


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
  evaluate = group_fl.build_lm_evaluation(
      task.model_fn, word_lm.metrics_fn, fl_process.model_weights_type)
  clients = [c for c in range(task.num_clients) if task.num_eval(c)]
  sums = group_fl.evaluate_global(evaluate, weights, clients,
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


# ----------------------------------------------------------------- stages


def test_three_stages_on_tiny_data(task, fl_process):
  clients = list(range(task.num_clients))
  train_fn = task.train_dataset_fn(1)
  state0 = fl_process.initialize()
  state, part, history = group_fl.run_rounds(
      fl_process, state0, clients, train_fn, rounds=3, clients_per_round=4,
      seed=0)
  assert sum(part.values()) == 12 and len(history) == 3
  global_w = fl_process.get_model_weights(state)
  assert not _close(global_w, fl_process.get_model_weights(state0))

  groups = {g: task.clients_of(g) for g in task.group_names}
  out = group_fl.fine_tune_groups(fl_process, global_w, groups, train_fn,
                                  rounds=2, clients_per_round=2, seed=0)
  assert set(out) == set(groups)
  for g, (w, gpart) in out.items():
    assert set(gpart) <= set(groups[g]) and sum(gpart.values()) == 4
    assert not _close(w, global_w)
  assert not _close(out[sg.COMEDY][0], out[sg.TRAGEDY][0])

  # Local personalization from the group model lowers each client's loss
  # on its own training data (what it fine-tuned on).
  wtype = fl_process.model_weights_type
  personalize = group_fl.build_local_personalization(
      task.model_fn, tff.learning.optimizers.build_sgdm(0.5), wtype)
  evaluate = group_fl.build_lm_evaluation(task.model_fn, word_lm.metrics_fn,
                                          wtype)
  evaluate_personal = group_fl.build_lm_evaluation(
      task.model_fn, word_lm.metrics_fn, wtype, tff.CLIENTS)
  members = groups[sg.HISTORY]
  start = out[sg.HISTORY][0]
  kept = {}
  sums = group_fl.personalize_and_evaluate(
      personalize, evaluate_personal, start, members,
      lambda c: task.train_dataset(c, 5), lambda c: task.train_dataset(c, 1),
      keep_fn=lambda c, w: kept.setdefault(c, w))
  before = group_fl.evaluate_global(evaluate, start, members,
                                    lambda c: task.train_dataset(c, 1))
  assert set(kept) == set(members)
  for c in members:
    assert not _close(kept[c], start)
    assert (group_fl.perplexity([sums[c]]) <
            group_fl.perplexity([before[c]]))


def test_personalized_models_and_updates_stay_at_clients(task, fl_process):
  wtype = fl_process.model_weights_type
  personalize = group_fl.build_local_personalization(
      task.model_fn, tff.learning.optimizers.build_sgdm(0.1), wtype)
  assert personalize.type_signature.result.placement == tff.CLIENTS
  assert personalize.type_signature.result.member == wtype
  updates = group_fl.build_client_updates(
      task.model_fn, tff.learning.optimizers.build_sgdm(0.1), wtype)
  assert updates.type_signature.result.placement == tff.CLIENTS
  ev = group_fl.build_lm_evaluation(task.model_fn, word_lm.metrics_fn, wtype,
                                    tff.CLIENTS)
  assert ev.type_signature.parameter[0].placement == tff.CLIENTS
  assert ev.type_signature.result.placement == tff.CLIENTS


def test_group_fine_tuning_only_sees_its_own_clients(task, fl_process):
  """Requests only group members; other groups' data cannot change it."""
  weights = fl_process.get_model_weights(fl_process.initialize())
  members = task.clients_of(sg.COMEDY)
  requested = []

  def dataset_fn(replace_others):
    def fn(client, round_num):
      requested.append(client)
      if replace_others and client not in members:
        raise AssertionError('a non-member was asked for data')
      return task.train_dataset(client, 1, round_num)
    return fn

  w1, part, _ = group_fl.fine_tune_group(
      fl_process, weights, members, dataset_fn(False), rounds=3,
      clients_per_round=2, seed=3)
  assert set(requested) <= set(members) and set(part) <= set(members)

  # Same run on a task whose other groups' speeches are replaced: identical.
  altered = sg.ShakespeareGroupsTask(
      client_ids=task.client_ids, client_groups=task.client_groups,
      train=[t if c in members else {k: np.roll(v, 1, axis=1)
                                     for k, v in t.items()}
             for c, t in enumerate(task.train)],
      eval=task.eval, vocab=task.vocab, model_config=task.model_config,
      batch_size=task.batch_size, seed=task.seed)
  w2, _, _ = group_fl.fine_tune_group(
      fl_process, weights, members,
      lambda c, r: altered.train_dataset(c, 1, r), rounds=3,
      clients_per_round=2, seed=3)
  assert _close(w1, w2, rtol=0)
  # ... while altering a member's data does change it (the test can fail).
  changed = sg.ShakespeareGroupsTask(
      client_ids=task.client_ids, client_groups=task.client_groups,
      train=[{k: np.roll(v, 1, axis=1) for k, v in t.items()}
             if c in members else t for c, t in enumerate(task.train)],
      eval=task.eval, vocab=task.vocab, model_config=task.model_config,
      batch_size=task.batch_size, seed=task.seed)
  w3, _, _ = group_fl.fine_tune_group(
      fl_process, weights, members,
      lambda c, r: changed.train_dataset(c, 1, r), rounds=3,
      clients_per_round=2, seed=3)
  assert not _close(w1, w3)
  with pytest.raises(ValueError, match='shares clients'):
    group_fl.fine_tune_groups(fl_process, weights, {'a': [0, 1], 'b': [1]},
                              dataset_fn(False), rounds=1,
                              clients_per_round=1, seed=0)


def test_one_group_equals_continuing_fl(task):
  """One group holding everyone: GroupFL = FL continued for T_g rounds.

  With a stateless server optimizer (SGD, i.e. FedAvg) exactly; with FedAdam
  it equals FL continued from a fresh optimizer state (each group has its own
  server-optimizer state) and differs from FL continued with the old one.
  """
  clients = list(range(task.num_clients))
  unshuffled = lambda c, r: task._dataset(task.train[c], 1, None)  # pylint: disable=protected-access
  t, t_g = 2, 2
  sgd = process_lib.build_split_model_process(
      task.model_fn, client_optimizer=tff.learning.optimizers.build_sgdm(0.5),
      server_optimizer=tff.learning.optimizers.build_sgdm(1.0), seed=1)
  full, _, _ = group_fl.run_rounds(sgd, sgd.initialize(), clients, unshuffled,
                                   rounds=t + t_g, clients_per_round=100,
                                   seed=0)
  mid, _, _ = group_fl.run_rounds(sgd, sgd.initialize(), clients, unshuffled,
                                  rounds=t, clients_per_round=100, seed=0)
  grouped = group_fl.fine_tune_groups(
      sgd, sgd.get_model_weights(mid), {'all': clients}, unshuffled,
      rounds=t_g, clients_per_round=100, seed=0)
  assert _close(grouped['all'][0], sgd.get_model_weights(full), rtol=1e-5)

  adam = group_fl.build_fl(task.model_fn, client_learning_rate=0.5,
                           server_learning_rate=0.05, seed=1)
  mid, _, _ = group_fl.run_rounds(adam, adam.initialize(), clients,
                                  unshuffled, rounds=t, clients_per_round=100,
                                  seed=0)
  fresh = adam.set_model_weights(adam.initialize(),
                                 adam.get_model_weights(mid))
  restarted, _, _ = group_fl.run_rounds(adam, fresh, clients, unshuffled,
                                        rounds=t_g, clients_per_round=100,
                                        seed=0)
  continued, _, _ = group_fl.run_rounds(adam, mid, clients, unshuffled,
                                        rounds=t_g, clients_per_round=100,
                                        seed=0, round_offset=t)
  grouped = group_fl.fine_tune_groups(
      adam, adam.get_model_weights(mid), {'all': clients}, unshuffled,
      rounds=t_g, clients_per_round=100, seed=0)
  assert _close(grouped['all'][0], adam.get_model_weights(restarted),
                rtol=1e-5)
  assert not _close(grouped['all'][0], adam.get_model_weights(continued))


def test_costs():
  assert group_fl.communication_cost(0) == 1
  assert group_fl.communication_cost(20) == 41
  assert group_fl.computation_cost(20, 1, 5) == 25
  assert group_fl.computation_cost(3, 2) == 6


def test_build_fl_rejects_bad_input(task):
  with pytest.raises(ValueError, match='learning rates'):
    group_fl.build_fl(task.model_fn, client_learning_rate=0.0)
  with pytest.raises(ValueError, match='at least one client'):
    group_fl.run_rounds(None, None, [], None, rounds=1, clients_per_round=1,
                        seed=0)
  with pytest.raises(ValueError, match='vocab_size'):
    sg.build_task(_speeches(), vocab_size=3)
