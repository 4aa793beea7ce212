"""Tests for tasks.speaker_context."""

import collections
import os

import numpy as np
import pytest
import tensorflow as tf

from tasks import speaker_context as sc
from tasks import speaker_context_io as sio

DATA_ROOT = os.environ.get(
    'TFF_PERSONAL_DATA_ROOT',
    os.path.abspath(os.path.join(os.path.dirname(__file__), '..', '..',
                                 'shared', 'data')))

U = sio.Utterance


def _user(name, community, n, text=lambda i: f'doc {i} abc'):
  return [U(name, community, text(i)) for i in range(n)]


def _toy(n_a=40, n_b=10, n_c=2):
  return (_user('friends/A', 'friends', n_a)
          + _user('got/B', 'game_of_thrones', n_b)
          + _user('shakespeare/hamlet/C', 'hamlet', n_c))


def test_communities():
  assert len(sc.COMMUNITIES) == sc.NUM_CLASSES == 39
  assert sc.COMMUNITIES[:2] == ['friends', 'game_of_thrones']
  assert sc.COMMUNITIES[2:] == sorted(sc.COMMUNITIES[2:])
  assert len(set(sc.COMMUNITIES)) == 39
  assert sc.COMMUNITY_INDEX['hamlet'] == sc.COMMUNITIES.index('hamlet')


@pytest.mark.parametrize('n,expected', [
    (3, (1, 1, 1)), (4, (2, 1, 1)), (10, (8, 1, 1)), (14, (12, 1, 1)),
    (15, (11, 2, 2)), (30, (24, 3, 3)), (35, (27, 4, 4)), (300, (240, 30, 30)),
])
def test_split_sizes(n, expected):
  assert sc.split_sizes(n) == expected


def test_build_users_filters_subsamples_and_splits():
  data = sc.build_users(_toy(n_a=40, n_b=10, n_c=2), min_docs=5, max_docs=20,
                        seed=3, max_chars=8)
  assert data.users == ['friends/A', 'got/B']  # C has 2 < 5 documents.
  np.testing.assert_array_equal(data.user_community, [0, 1])
  assert data.user_community.dtype == np.int32
  np.testing.assert_array_equal(data.num_docs('train'), [16, 8])
  np.testing.assert_array_equal(data.num_docs('eval'), [2, 1])
  np.testing.assert_array_equal(data.num_docs('test'), [2, 1])
  for u, n_total in ((0, 40), (1, 10)):
    parts = [data.doc_ids[s][u] for s in sc.SPLITS]
    union = np.concatenate(parts)
    assert len(set(union.tolist())) == union.size  # Disjoint.
    assert union.min() >= 0 and union.max() < n_total
    for split in sc.SPLITS:
      x, y = data.arrays(u, split)
      assert x.shape == (len(data.doc_ids[split][u]), 8)
      assert x.dtype == np.int32 and y.dtype == np.int32
      np.testing.assert_array_equal(y, data.user_community[u])
      # Each row decodes to its document's text, truncated to 8 chars, with
      # characters seen < 5 times in train (here: some digits) as OOV.
      for row, i in zip(x, data.doc_ids[split][u]):
        text = f'doc {i} abc'[:8]
        assert data.decode(row) == ''.join(
            c if c in data.vocab else '<oov>' for c in text)
        assert int((row != sc.PAD_ID).sum()) == len(text)
  # got/B has 10 <= max_docs documents: all of them are used.
  assert sorted(np.concatenate(
      [data.doc_ids[s][1] for s in sc.SPLITS]).tolist()) == list(range(10))


def test_build_users_seeding():
  a = sc.build_users(_toy(), min_docs=5, max_docs=20, seed=1)
  b = sc.build_users(_toy(), min_docs=5, max_docs=20, seed=1)
  c = sc.build_users(_toy(), min_docs=5, max_docs=20, seed=2)
  for s in sc.SPLITS:
    for u in range(2):
      np.testing.assert_array_equal(a.doc_ids[s][u], b.doc_ids[s][u])
      np.testing.assert_array_equal(a.x[s][u], b.x[s][u])
  assert not np.array_equal(a.doc_ids['train'][0], c.doc_ids['train'][0])
  # A user's split does not depend on the other users.
  alone = sc.build_users(_user('friends/A', 'friends', 40), min_docs=5,
                         max_docs=20, seed=1)
  for s in sc.SPLITS:
    np.testing.assert_array_equal(alone.doc_ids[s][0], a.doc_ids[s][0])


def _split_of_each_doc(data, user):
  where = {}
  for split in sc.SPLITS:
    for i in data.doc_ids[split][user]:
      where[int(i)] = split
  return where


@pytest.mark.parametrize('target_split', ['test', 'eval', 'train'])
def test_vocab_is_built_from_train_only(target_split):
  base = _user('friends/A', 'friends', 20, lambda i: f'hello {i}')
  data = sc.build_users(base, min_docs=3, max_docs=20, seed=0, max_chars=12,
                        min_char_count=1)
  where = _split_of_each_doc(data, 0)
  doc = min(i for i, s in where.items() if s == target_split)
  # Same user, same number of documents, same seed: same split; only one
  # document changes, and it holds the only '@'s.
  texts = [f'hello {i}' for i in range(20)]
  texts[doc] = '@@@@@@ hello'
  data2 = sc.build_users([U('friends/A', 'friends', t) for t in texts],
                         min_docs=3, max_docs=20, seed=0, max_chars=12,
                         min_char_count=1)
  assert _split_of_each_doc(data2, 0) == where
  row = list(data2.doc_ids[target_split][0]).index(doc)
  ids = data2.x[target_split][0][row]
  if target_split == 'train':
    assert '@' in data2.vocab
    assert data2.decode(ids) == '@@@@@@ hello'
  else:
    assert '@' not in data2.vocab
    np.testing.assert_array_equal(ids[:6], [sc.OOV_ID] * 6)
    assert data2.decode(ids) == '<oov>' * 6 + ' hello'
    assert data2.vocab == data.vocab


def test_vocab_min_count_lowercase_and_order():
  texts = ['aaaab', 'AAbb', 'cc ~']  # a: 6, b: 3, c: 2, ' ': 1, '~': 1.
  utts = [U('friends/A', 'friends', t) for t in texts * 3]  # 9 docs.
  data = sc.build_users(utts, min_docs=3, max_docs=9, seed=0, max_chars=6,
                        min_char_count=4)
  n_train = sc.split_sizes(9)[0]
  assert n_train == 7
  train_texts = [texts[i % 3].lower()
                 for i in data.doc_ids['train'][0]]
  counts = collections.Counter(''.join(train_texts))
  expected = sorted((c for c, n in counts.items() if n >= 4),
                    key=lambda c: (-counts[c], ord(c)))
  assert data.vocab == ['<pad>', '<oov>'] + expected
  assert data.vocab[2] == 'a' and 'A' not in data.vocab
  assert data.vocab_size == len(data.vocab)
  cased = sc.build_users(utts, min_docs=3, max_docs=9, seed=0, max_chars=6,
                         min_char_count=1, lowercase=False)
  assert 'A' in cased.vocab


def test_encode_texts_truncates_and_pads():
  vocab = ['<pad>', '<oov>', 'a', 'b', '\u00e9']
  got = sc.encode_texts(['ab', 'b\u00e9zab', '', 'aaaaaaa'], vocab, 4)
  np.testing.assert_array_equal(got, [[2, 3, 0, 0], [3, 4, 1, 2],
                                      [0, 0, 0, 0], [2, 2, 2, 2]])
  assert got.dtype == np.int32
  only_specials = sc.encode_texts(['xy'], ['<pad>', '<oov>'], 3)
  np.testing.assert_array_equal(only_specials, [[1, 1, 0]])


def test_build_users_errors():
  with pytest.raises(ValueError, match='min_docs must be >= 3'):
    sc.build_users(_toy(), min_docs=2, max_docs=10, seed=0)
  with pytest.raises(ValueError, match='max_docs'):
    sc.build_users(_toy(), min_docs=10, max_docs=5, seed=0)
  with pytest.raises(ValueError, match='unknown community'):
    sc.build_users([U('x/A', 'simpsons', 't')] * 5, min_docs=3, max_docs=5,
                   seed=0)
  with pytest.raises(ValueError, match='two communities'):
    sc.build_users([U('x/A', 'hamlet', 't'), U('x/A', 'lear', 't')],
                   min_docs=3, max_docs=5, seed=0)
  with pytest.raises(ValueError, match='No user has min_docs=50'):
    sc.build_users(_toy(), min_docs=50, max_docs=60, seed=0)


def test_user_index():
  data = sc.build_users(_toy(), min_docs=5, max_docs=20, seed=0)
  assert data.user_index('got/B') == 1 and data.user_index(0) == 0
  with pytest.raises(KeyError):
    data.user_index('got/NOBODY')
  with pytest.raises(IndexError):
    data.user_index(2)
  with pytest.raises(ValueError, match='split'):
    data.arrays(0, 'validation')


def test_client_dataset():
  data = sc.build_users(_toy(), min_docs=5, max_docs=40, seed=0, max_chars=10)
  ds = sc.client_dataset(data, 'friends/A', 'train', batch_size=16)
  assert ds.element_spec == sc.element_spec(10)
  assert list(ds.element_spec) == ['x', 'y']
  batches = list(ds.as_numpy_iterator())
  assert [b['x'].shape for b in batches] == [(16, 10), (16, 10)]  # 32 train.
  x, y = data.arrays(0, 'train')
  np.testing.assert_array_equal(np.concatenate([b['x'] for b in batches]), x)
  np.testing.assert_array_equal(np.concatenate([b['y'] for b in batches]), y)
  shuffled = list(sc.client_dataset(data, 0, 'train', batch_size=5,
                                    shuffle_seed=7).as_numpy_iterator())
  sx = np.concatenate([b['x'] for b in shuffled])
  assert [b['x'].shape[0] for b in shuffled] == [5] * 6 + [2]
  assert sorted(map(bytes, sx)) == sorted(map(bytes, x))
  assert not np.array_equal(sx, x)
  eval_batches = list(sc.client_dataset(data, 1, 'eval').as_numpy_iterator())
  assert len(eval_batches) == 1 and eval_batches[0]['y'].tolist() == [1]


def test_centralized_dataset():
  data = sc.build_users(_toy(), min_docs=5, max_docs=40, seed=0, max_chars=10)
  ds = sc.centralized_dataset(data, 'train', batch_size=7)
  assert ds.element_spec == sc.centralized_element_spec(10)
  assert ds.element_spec['user'] == tf.TensorSpec([None], tf.int32)
  batches = list(ds.as_numpy_iterator())
  users = np.concatenate([b['user'] for b in batches])
  ys = np.concatenate([b['y'] for b in batches])
  xs = np.concatenate([b['x'] for b in batches])
  np.testing.assert_array_equal(users, [0] * 32 + [1] * 8)
  np.testing.assert_array_equal(ys, data.user_community[users])
  np.testing.assert_array_equal(xs, np.concatenate(data.x['train']))
  shuffled = list(sc.centralized_dataset(
      data, 'train', batch_size=40, shuffle_seed=1).as_numpy_iterator())
  assert len(shuffled) == 1
  assert sorted(shuffled[0]['user'].tolist()) == users.tolist()
  assert shuffled[0]['user'].tolist() != users.tolist()


# Real data (skipped when ../shared/data is absent).


@pytest.fixture(scope='module')
def real_utterances():
  if not os.path.isdir(os.path.join(DATA_ROOT, 'friends')):
    pytest.skip(f'Real transcripts not found under {DATA_ROOT}')
  return sio.load_all(DATA_ROOT)


@pytest.fixture(scope='module')
def real_data(real_utterances):
  return sc.build_users(real_utterances)  # The defaults of load_task_data.


def test_real_defaults_leave_enough_users(real_data):
  assert real_data.num_users == 516 >= 300
  per_community = collections.Counter(
      sc.COMMUNITIES[c] for c in real_data.user_community)
  assert per_community['friends'] == 77
  assert per_community['game_of_thrones'] == 126
  assert sum(per_community.values()) - 77 - 126 == 313
  assert set(per_community) == set(sc.COMMUNITIES)  # All 39 communities.
  assert min(per_community[p] for p in sc.PLAYS) == 5


def test_real_labels_match_communities(real_data):
  for u, user in enumerate(real_data.users):
    if user.startswith('friends/'):
      community = 'friends'
    elif user.startswith('got/'):
      community = 'game_of_thrones'
    else:
      community = user.split('/')[1]
    label = sc.COMMUNITY_INDEX[community]
    assert real_data.user_community[u] == label, user
    for split in sc.SPLITS:
      assert set(real_data.y[split][u].tolist()) == {label}, (user, split)


def test_real_splits(real_data, real_utterances):
  docs_per_user = collections.Counter(u.user for u in real_utterances)
  total = 0
  for u, user in enumerate(real_data.users):
    n_all = docs_per_user[user]
    ids = [real_data.doc_ids[s][u] for s in sc.SPLITS]
    n = sum(len(i) for i in ids)
    assert n == min(n_all, sc.DEFAULT_MAX_DOCS) and n >= sc.DEFAULT_MIN_DOCS
    union = np.concatenate(ids)
    assert np.unique(union).size == n and union.max() < n_all  # Disjoint.
    n_train, n_eval, n_test = (len(i) for i in ids)
    assert min(n_train, n_eval, n_test) >= 1
    assert abs(n_eval - 0.1 * n) <= 0.5 and abs(n_test - 0.1 * n) <= 0.5
    assert abs(n_train - 0.8 * n) <= 1
    total += n
  assert total == 45653
  assert real_data.num_docs('train').sum() == 36503


def test_real_vocab_from_train_only(real_data, real_utterances):
  texts = collections.defaultdict(list)
  for utt in real_utterances:
    texts[utt.user].append(utt.text.lower())
  train = [texts[user][i][:real_data.max_chars]
           for u, user in enumerate(real_data.users)
           for i in real_data.doc_ids['train'][u]]
  assert real_data.vocab == sc.build_vocab(train, sc.DEFAULT_MIN_CHAR_COUNT)
  assert real_data.vocab_size == 51
  # Spot-check the encoding of test documents.
  for u in (0, real_data.num_users // 2, real_data.num_users - 1):
    user = real_data.users[u]
    for row, i in zip(real_data.x['test'][u], real_data.doc_ids['test'][u]):
      text = texts[user][i][:real_data.max_chars]
      expected = ''.join(c if c in real_data.vocab else '<oov>' for c in text)
      assert real_data.decode(row) == expected


def test_real_datasets(real_data):
  assert real_data.max_chars == sc.DEFAULT_MAX_CHARS == 200
  ds = sc.client_dataset(real_data, 'got/JON', 'train', batch_size=16)
  assert ds.element_spec == sc.element_spec(200)
  sizes = [b['x'].shape for b in ds.as_numpy_iterator()]
  assert sizes == [(16, 200)] * 15  # 240 train documents (capped at 300).
  cds = sc.centralized_dataset(real_data, 'test', batch_size=1024)
  assert cds.element_spec == sc.centralized_element_spec(200)
  first = next(iter(cds))
  assert first['x'].shape == (1024, 200) and first['user'].shape == (1024,)
  assert sum(int(b['y'].shape[0]) for b in cds) == 4575


def test_load_task_data_small(real_utterances):
  del real_utterances  # Only for the skip.
  data = sc.load_task_data(DATA_ROOT, min_docs=150, max_docs=200,
                           max_chars=50, seed=5)
  assert data.num_users == 74 and data.max_chars == 50
  assert all(len(x) for x in data.x['test'])
  assert data.x['train'][0].shape[1] == 50
