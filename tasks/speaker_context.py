"""The `speaker_context` task: the FURL paper's Subreddit analogue.

Users are speakers of TV shows and plays, each utterance is a document, and a
document's label is the community it was said in: 'friends',
'game_of_thrones', or one of the 37 Shakespeare plays (39 classes,
`COMMUNITIES`). A user belongs to exactly one community, so all of a user's
labels are the same: the task rewards a user representation (FURL's private
user embedding), as FURL's Subreddit task does. Utterances come from
`speaker_context_io` (speaker-name normalisation and pseudo-speaker dropping
are documented there).

Users. A user is kept when it has at least `min_docs` utterances; users with
more than `max_docs` keep a seeded random `max_docs` of them (FURL kept users
with 150-500 comments; our speakers are far fewer, so the thresholds are
lower). Users surviving `min_docs` on the real data (`../shared/data`), as
friends / game_of_thrones / Shakespeare (plays with at least one user):

  min_docs   users   friends   got   shakespeare (plays)
     10      1,055      216     223      616 (37)
     20        684      115     159      410 (37)
     25        587       93     140      354 (37)
     30        516       77     126      313 (37)   <- default
     40        400       58      98      244 (37)
     50        332       51      84      197 (37)
     75        206       31      64      111 (35)
    100        149       25      54       70 (30)
    150         74       15      37       22 (17)

Defaults `min_docs=30, max_docs=300`: 516 users, every one of the 39
communities present; per play 5-13 users (1henryiv 5, 1henryvi 5, 2henryiv 8,
2henryvi 8, 3henryvi 10, allswell 11, asyoulikeit 7, cleopatra 9,
comedy_errors 7, coriolanus 10, cymbeline 9, hamlet 9, henryv 6, henryviii 8,
john 6, julius_caesar 5, lear 13, lll 11, macbeth 6, measure 8, merchant 8,
merry_wives 11, midsummer 8, much_ado 9, othello 8, pericles 8, richardii 5,
richardiii 12, romeo_juliet 8, taming_shrew 9, tempest 11, timon 6, titus 8,
troilus_cressida 13, twelfth_night 10, two_gentlemen 9, winters_tale 9). The
cap of 300 touches 25 users (7 Friends, 17 GoT, shakespeare/hamlet/HAMLET)
and leaves 45,653 documents (36,503 train / 4,575 eval / 4,575 test).

Splits. Each user's (subsampled) documents are shuffled and split 0.8 / 0.1 /
0.1 into train / eval / test: `n_eval = n_test = max(1, round(0.1 n))`
(halves rounded up), the rest train. A user's random draws come from
`np.random.default_rng([seed, crc32(user)])`, so a user's split does not
depend on which other users are present.

Characters. Texts are lower-cased by default (`lowercase=True`: it halves the
alphabet and removes transcript conventions such as upper-case shouting;
punctuation is kept), then truncated to their first `max_chars` characters
and right-padded with PAD=0. The vocabulary holds PAD (id 0, '<pad>'), OOV
(id 1, '<oov>') and every character occurring at least `min_char_count` times
in the (truncated) *train* documents, ids 2.. in order of decreasing count
(ties by code point); any other character, including one that occurs only in
eval/test, maps to OOV. Real data, defaults: 49 characters + PAD + OOV
(vocab_size 51; OOV is ~3e-6 of train characters). Utterance lengths in characters (after cleaning), median 43,
90th percentile 164, 95th 251, mean 77 (Friends median 36, GoT 38,
Shakespeare 67; 99th percentiles 253, 349, 1,070); 92.7% of utterances fit in
the default `max_chars=200` (Friends 97.7%, GoT 95.6%, Shakespeare 80.7%).

Loading builds the arrays from the three sources each time; nothing is
cached on disk.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Sequence
import zlib

import numpy as np
import tensorflow as tf

from tasks import speaker_context_io

# The 37 Moby Shakespeare play ids, as in the TSV's `play` column (sorted).
PLAYS = (
    '1henryiv', '1henryvi', '2henryiv', '2henryvi', '3henryvi', 'allswell',
    'asyoulikeit', 'cleopatra', 'comedy_errors', 'coriolanus', 'cymbeline',
    'hamlet', 'henryv', 'henryviii', 'john', 'julius_caesar', 'lear', 'lll',
    'macbeth', 'measure', 'merchant', 'merry_wives', 'midsummer', 'much_ado',
    'othello', 'pericles', 'richardii', 'richardiii', 'romeo_juliet',
    'taming_shrew', 'tempest', 'timon', 'titus', 'troilus_cressida',
    'twelfth_night', 'two_gentlemen', 'winters_tale')

COMMUNITIES = ([speaker_context_io.FRIENDS, speaker_context_io.GAME_OF_THRONES]
               + list(PLAYS))
NUM_CLASSES = 39
COMMUNITY_INDEX = {c: i for i, c in enumerate(COMMUNITIES)}

SPLITS = ('train', 'eval', 'test')
SPLIT_FRACTIONS = (0.8, 0.1, 0.1)

PAD_ID = 0
OOV_ID = 1
PAD_TOKEN = '<pad>'
OOV_TOKEN = '<oov>'

DEFAULT_MIN_DOCS = 30
DEFAULT_MAX_DOCS = 300
DEFAULT_MAX_CHARS = 200
DEFAULT_MIN_CHAR_COUNT = 5

assert len(COMMUNITIES) == NUM_CLASSES


@dataclasses.dataclass(frozen=True, eq=False)
class SpeakerData:
  """Per-user character-encoded documents, split into train/eval/test.

  Attributes:
    users: User ids (e.g. 'friends/MONICA'), sorted; index = user number.
    user_community: int32 [num_users], each user's index in `COMMUNITIES`.
    x: split -> per-user int32 [n_docs, max_chars] character ids.
    y: split -> per-user int32 [n_docs] labels (= the user's community).
    doc_ids: split -> per-user int32 [n_docs], each document's position among
      that user's utterances in the order they were given to `build_users`
      (so the three splits of a user are disjoint sets of positions).
    vocab: id -> token: vocab[0] = '<pad>', vocab[1] = '<oov>', then one
      character per id.
    max_chars: Document length after truncation/padding.
    lowercase: Whether texts were lower-cased before encoding.
  """
  users: list[str]
  user_community: np.ndarray
  x: dict[str, list[np.ndarray]]
  y: dict[str, list[np.ndarray]]
  doc_ids: dict[str, list[np.ndarray]]
  vocab: list[str]
  max_chars: int
  lowercase: bool = True

  @property
  def num_users(self) -> int:
    return len(self.users)

  @property
  def vocab_size(self) -> int:
    return len(self.vocab)

  @property
  def num_classes(self) -> int:
    return NUM_CLASSES

  def user_index(self, user: int | str) -> int:
    """Returns the index of `user`, given as an index or a user id."""
    if isinstance(user, (str, bytes)):
      if isinstance(user, bytes):
        user = user.decode('utf-8')
      try:
        return self._index[user]
      except KeyError:
        raise KeyError(f'Unknown user {user!r}.') from None
    user = int(user)
    if not 0 <= user < self.num_users:
      raise IndexError(f'user must be in [0, {self.num_users}), got {user}.')
    return user

  @property
  def _index(self) -> dict[str, int]:
    cached = self.__dict__.get('_index_cache')
    if cached is None:
      cached = {u: i for i, u in enumerate(self.users)}
      object.__setattr__(self, '_index_cache', cached)
    return cached

  def arrays(self, user: int | str,
             split: str = 'train') -> tuple[np.ndarray, np.ndarray]:
    """Returns one user's `(x, y)` for `split`."""
    _check_split(split)
    u = self.user_index(user)
    return self.x[split][u], self.y[split][u]

  def num_docs(self, split: str) -> np.ndarray:
    """int64 [num_users]: each user's number of documents in `split`."""
    _check_split(split)
    return np.array([len(y) for y in self.y[split]], np.int64)

  def decode(self, ids: Sequence[int] | np.ndarray) -> str:
    """Maps char ids back to text (PAD dropped, OOV shown as '<oov>')."""
    return ''.join(self.vocab[int(i)] for i in np.asarray(ids).ravel()
                   if int(i) != PAD_ID)


def _check_split(split: str) -> None:
  if split not in SPLITS:
    raise ValueError(f'split must be one of {SPLITS}, got {split!r}.')


def split_sizes(n: int) -> tuple[int, int, int]:
  """(train, eval, test) sizes for a user with `n` >= 3 documents."""
  if n < 3:
    raise ValueError(f'A user needs at least 3 documents, got {n}.')
  n_eval = max(1, int(np.floor(SPLIT_FRACTIONS[1] * n + 0.5)))
  n_test = max(1, int(np.floor(SPLIT_FRACTIONS[2] * n + 0.5)))
  return n - n_eval - n_test, n_eval, n_test


def _user_rng(seed: int, user: str) -> np.random.Generator:
  return np.random.default_rng([seed, zlib.crc32(user.encode('utf-8'))])


def build_vocab(texts: Sequence[str], min_char_count: int) -> list[str]:
  """PAD, OOV, then characters seen >= `min_char_count` times, by count."""
  counts = collections.Counter()
  for text in texts:
    counts.update(text)
  chars = sorted((c for c, n in counts.items() if n >= min_char_count),
                 key=lambda c: (-counts[c], ord(c)))
  return [PAD_TOKEN, OOV_TOKEN] + chars


def encode_texts(texts: Sequence[str], vocab: Sequence[str],
                 max_chars: int) -> np.ndarray:
  """Encodes texts (already truncated or not) as int32 [n, max_chars] ids.

  Args:
    texts: The texts; each is truncated to its first `max_chars` characters.
    vocab: As `SpeakerData.vocab` (entries 2.. are single characters).
    max_chars: Output width; shorter texts are right-padded with PAD_ID.

  Returns:
    int32 [len(texts), max_chars].
  """
  out = np.zeros((len(texts), max_chars), np.int32)
  if not texts:
    return out
  truncated = [t[:max_chars] for t in texts]
  lengths = np.fromiter(map(len, truncated), np.int64, len(truncated))
  codes = np.frombuffer(''.join(truncated).encode('utf-32-le'), np.uint32)
  vocab_codes = np.array([ord(c) for c in vocab[2:]], np.uint32)
  order = np.argsort(vocab_codes, kind='stable')
  sorted_codes = vocab_codes[order]
  if sorted_codes.size:
    pos = np.minimum(np.searchsorted(sorted_codes, codes),
                     sorted_codes.size - 1)
    hit = sorted_codes[pos] == codes
    ids = np.where(hit, order[pos] + 2, OOV_ID).astype(np.int32)
  else:
    ids = np.full(codes.shape, OOV_ID, np.int32)
  rows = np.repeat(np.arange(len(texts)), lengths)
  starts = np.cumsum(lengths) - lengths
  cols = np.arange(codes.size) - np.repeat(starts, lengths)
  out[rows, cols] = ids
  return out


def build_users(utterances: Sequence[speaker_context_io.Utterance], *,
                min_docs: int = DEFAULT_MIN_DOCS,
                max_docs: int = DEFAULT_MAX_DOCS,
                seed: int = 0,
                max_chars: int = DEFAULT_MAX_CHARS,
                min_char_count: int = DEFAULT_MIN_CHAR_COUNT,
                lowercase: bool = True) -> SpeakerData:
  """Selects users, subsamples and splits their documents, encodes them.

  Args:
    utterances: `(user, community, text)` triples; a user's community must be
      the same in all of its utterances and be one of `COMMUNITIES`.
    min_docs: Users with fewer documents are dropped (>= 3).
    max_docs: Users with more are subsampled to this many (>= min_docs).
    seed: Non-negative seed of the subsampling and the splits.
    max_chars: Documents are truncated/padded to this many characters.
    min_char_count: Minimum count of a character in the train documents to
      get its own id.
    lowercase: Lower-case texts before building the vocabulary and encoding.

  Returns:
    A `SpeakerData` with users sorted by id.

  Raises:
    ValueError: Bad arguments, an unknown or inconsistent community, or no
      user with `min_docs` documents.
  """
  if min_docs < 3:
    raise ValueError(f'min_docs must be >= 3 (one document per split), got '
                     f'{min_docs}.')
  if max_docs < min_docs:
    raise ValueError(f'max_docs ({max_docs}) must be >= min_docs '
                     f'({min_docs}).')
  if max_chars < 1 or min_char_count < 1 or seed < 0:
    raise ValueError(
        f'max_chars ({max_chars}) and min_char_count ({min_char_count}) must '
        f'be >= 1 and seed ({seed}) >= 0.')

  texts_by_user = collections.defaultdict(list)
  community_of = {}
  for user, community, text in utterances:
    if community not in COMMUNITY_INDEX:
      raise ValueError(f'User {user!r} has unknown community {community!r}; '
                       f'expected one of {COMMUNITIES}.')
    if community_of.setdefault(user, community) != community:
      raise ValueError(f'User {user!r} occurs in two communities: '
                       f'{community_of[user]!r} and {community!r}.')
    texts_by_user[user].append(text.lower() if lowercase else text)

  users = sorted(u for u, t in texts_by_user.items() if len(t) >= min_docs)
  if not users:
    most = max((len(t) for t in texts_by_user.values()), default=0)
    raise ValueError(f'No user has min_docs={min_docs} documents (the most '
                     f'any of the {len(texts_by_user)} users has is {most}).')

  doc_ids = {s: [] for s in SPLITS}
  for user in users:
    n = len(texts_by_user[user])
    rng = _user_rng(seed, user)
    chosen = rng.permutation(n)[:max_docs]
    n_train, n_eval, _ = split_sizes(chosen.size)
    parts = (chosen[:n_train], chosen[n_train:n_train + n_eval],
             chosen[n_train + n_eval:])
    for split, part in zip(SPLITS, parts):
      doc_ids[split].append(np.sort(part).astype(np.int32))

  def split_texts(split: str, u: int) -> list[str]:
    texts = texts_by_user[users[u]]
    return [texts[i][:max_chars] for i in doc_ids[split][u]]

  vocab = build_vocab(
      [t for u in range(len(users)) for t in split_texts('train', u)],
      min_char_count)
  user_community = np.array([COMMUNITY_INDEX[community_of[u]] for u in users],
                            np.int32)
  x = {s: [] for s in SPLITS}
  y = {s: [] for s in SPLITS}
  for split in SPLITS:
    counts = [len(d) for d in doc_ids[split]]
    encoded = encode_texts(
        [t for u in range(len(users)) for t in split_texts(split, u)],
        vocab, max_chars)
    bounds = np.cumsum([0] + counts)
    for u in range(len(users)):
      x[split].append(encoded[bounds[u]:bounds[u + 1]])
      y[split].append(np.full(counts[u], user_community[u], np.int32))
  return SpeakerData(users=users, user_community=user_community, x=x, y=y,
                     doc_ids=doc_ids, vocab=vocab, max_chars=max_chars,
                     lowercase=lowercase)


def load_task_data(data_root: str, *,
                   min_docs: int = DEFAULT_MIN_DOCS,
                   max_docs: int = DEFAULT_MAX_DOCS,
                   max_chars: int = DEFAULT_MAX_CHARS,
                   seed: int = 0,
                   min_char_count: int = DEFAULT_MIN_CHAR_COUNT,
                   lowercase: bool = True) -> SpeakerData:
  """Loads the three sources from `data_root` and builds the task's users.

  Args:
    data_root: Folder holding friends/, game_of_thrones/ and shakespeare/.
    min_docs: See `build_users`.
    max_docs: See `build_users`.
    max_chars: See `build_users`.
    seed: See `build_users`.
    min_char_count: See `build_users`.
    lowercase: See `build_users`.

  Returns:
    The `SpeakerData`.

  Raises:
    speaker_context_io.SpeakerDataError: Missing or malformed data files.
    ValueError: Bad arguments.
  """
  return build_users(
      speaker_context_io.load_all(data_root), min_docs=min_docs,
      max_docs=max_docs, seed=seed, max_chars=max_chars,
      min_char_count=min_char_count, lowercase=lowercase)


def element_spec(max_chars: int) -> collections.OrderedDict:
  """The element spec of `client_dataset` batches."""
  return collections.OrderedDict(
      x=tf.TensorSpec([None, max_chars], tf.int32),
      y=tf.TensorSpec([None], tf.int32))


def centralized_element_spec(max_chars: int) -> collections.OrderedDict:
  """The element spec of `centralized_dataset` batches."""
  return collections.OrderedDict(
      x=tf.TensorSpec([None, max_chars], tf.int32),
      y=tf.TensorSpec([None], tf.int32),
      user=tf.TensorSpec([None], tf.int32))


def _batched(tensors: collections.OrderedDict, batch_size: int,
             shuffle_seed: int | None) -> tf.data.Dataset:
  if batch_size < 1:
    raise ValueError(f'batch_size must be >= 1, got {batch_size}.')
  ds = tf.data.Dataset.from_tensor_slices(tensors)
  if shuffle_seed is not None:
    n = int(next(iter(tensors.values())).shape[0])
    ds = ds.shuffle(max(n, 1), seed=shuffle_seed,
                    reshuffle_each_iteration=True)
  return ds.batch(batch_size)


def client_dataset(data: SpeakerData, user: int | str, split: str = 'train',
                   batch_size: int = 16,
                   shuffle_seed: int | None = None) -> tf.data.Dataset:
  """One user's documents as batches of `OrderedDict(x=, y=)`.

  Args:
    data: The task data.
    user: User index or user id.
    split: 'train', 'eval' or 'test'.
    batch_size: Batch size (the last batch may be smaller).
    shuffle_seed: If not None, documents are shuffled (afresh on every
      iteration, deterministically given the seed); else kept in order.

  Returns:
    A dataset with `element_spec(data.max_chars)`.
  """
  x, y = data.arrays(user, split)
  return _batched(collections.OrderedDict(x=x, y=y), batch_size, shuffle_seed)


def centralized_dataset(data: SpeakerData, split: str, batch_size: int,
                        shuffle_seed: int | None = None) -> tf.data.Dataset:
  """All users' documents of `split` pooled, with each document's user index.

  Args:
    data: The task data.
    split: 'train', 'eval' or 'test'.
    batch_size: Batch size (the last batch may be smaller).
    shuffle_seed: If not None, documents are shuffled across users.

  Returns:
    A dataset of `OrderedDict(x=int32 [b, max_chars], y=int32 [b],
    user=int32 [b])` (`centralized_element_spec(data.max_chars)`), in user
    order when not shuffled.
  """
  _check_split(split)
  counts = data.num_docs(split)
  tensors = collections.OrderedDict(
      x=np.concatenate(data.x[split]).reshape(-1, data.max_chars),
      y=np.concatenate(data.y[split]).astype(np.int32),
      user=np.repeat(np.arange(data.num_users, dtype=np.int32), counts))
  return _batched(tensors, batch_size, shuffle_seed)
