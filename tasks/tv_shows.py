"""FedPerC's "TV Shows" task: Friends and Game of Thrones characters.

Users are 19 characters, contexts are the two shows (FedPerC Appendix C):

* Friends: the six main characters (`FRIENDS_USERS`);
* Game of Thrones: the thirteen characters with the most turns in
  `../shared/data/game_of_thrones` as read by `tasks/speaker_context_io.py`
  (whose name normalisation maps 'Jon Snow'/'JON' and so on to one user):
  `GOT_USERS`, checked against the data when loading.

Utterances: every turn is split into sentences (after `.`, `!` or `?`
followed by a space); a sentence is kept when it has at least three tokens of
the backbone's tokenizer (section 4.1). Each is tokenized with GPT-2's
`<|endoftext|>` appended and truncated to `max_tokens`.

Splits: each user's utterances are shuffled (seeded) and split 60 / 20 / 20
into train / fine-tune / test (the paper's train / validation / test: the
"fine-tuning samples" of Tables 1-2 are taken from the second part, never
tested on). `max_utterances_per_user` subsamples each user first (the paper
uses all, 3,370 on average; a CPU run uses fewer; the docs state how many).

Withheld users (Table 2): `WITHHELD_USERS`, chosen per show by hand as the
paper did (one Friends and three Game of Thrones characters, about a fifth
of each show's users), never trained on; their fine-tune and test parts are
made the same way.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
from typing import Sequence

import numpy as np
import tensorflow as tf

from tasks import speaker_context_io

CONTEXTS = (speaker_context_io.FRIENDS, speaker_context_io.GAME_OF_THRONES)
FRIENDS_USERS = tuple(speaker_context_io.FRIENDS_PREFIX + n for n in (
    'RACHEL', 'ROSS', 'CHANDLER', 'MONICA', 'JOEY TRIBBIANI', 'PHOEBE BUFFAY'))
GOT_USERS = tuple(speaker_context_io.GOT_PREFIX + n for n in (
    'TYRION', 'JON', 'JAIME', 'CERSEI', 'DAENERYS', 'SANSA', 'ARYA', 'DAVOS',
    'THEON', 'BRONN', 'SAM', 'TYWIN', 'VARYS'))
USERS = FRIENDS_USERS + GOT_USERS
WITHHELD_USERS = ('friends/PHOEBE BUFFAY', 'got/DAVOS', 'got/BRONN',
                  'got/VARYS')
SPLITS = ('train', 'fine_tune', 'test')
_FRACTIONS = (0.6, 0.2, 0.2)
_SENTENCE_END = re.compile(r'(?<=[.!?])\s+')
MIN_TOKENS = 3


def split_sentences(text: str) -> list[str]:
  return [s.strip() for s in _SENTENCE_END.split(text) if s.strip()]


def load_sentences(data_root: str) -> dict[str, list[str]]:
  """Sentences of the 19 users, in transcript order, keyed by user."""
  utterances = (
      speaker_context_io.load_friends(
          os.path.join(data_root, speaker_context_io.FRIENDS)) +
      speaker_context_io.load_game_of_thrones(
          os.path.join(data_root, speaker_context_io.GOT_DIR)))
  counts = collections.Counter(u.user for u in utterances)
  got = [u for u, _ in counts.most_common()
         if u.startswith(speaker_context_io.GOT_PREFIX)][:len(GOT_USERS)]
  if sorted(got) != sorted(GOT_USERS):
    raise speaker_context_io.SpeakerDataError(
        f'The thirteen Game of Thrones characters with most turns in '
        f'{data_root} are {got}, not the task\'s {list(GOT_USERS)}')
  missing = [u for u in FRIENDS_USERS if counts[u] == 0]
  if missing:
    raise speaker_context_io.SpeakerDataError(
        f'Friends characters {missing} have no utterance in {data_root}')
  sentences = {u: [] for u in USERS}
  for u in utterances:
    if u.user in sentences:
      sentences[u.user].extend(split_sentences(u.text))
  return sentences


@dataclasses.dataclass
class UserData:
  """One user's padded token arrays per split."""
  user: str
  context: int
  splits: dict[str, dict[str, np.ndarray]]  # split -> ids, mask, context
  texts: dict[str, list[str]]


def encode(tokenizer, texts: Sequence[str], context: int, max_tokens: int,
           end_id: int) -> tuple[dict[str, np.ndarray], list[str]]:
  """Tokenizes, keeps >= MIN_TOKENS tokens, appends the end token, pads."""
  if not texts:
    empty = np.zeros([0, max_tokens], np.int32)
    return dict(ids=empty, mask=empty.copy(),
                context=np.zeros([0], np.int32)), []
  rows = tokenizer(tf.constant(list(texts))).to_list()
  kept, kept_texts = [], []
  for row, text in zip(rows, texts):
    if len(row) >= MIN_TOKENS:
      kept.append((row + [end_id])[:max_tokens])
      kept_texts.append(text)
  ids = np.zeros([len(kept), max_tokens], np.int32)
  mask = np.zeros([len(kept), max_tokens], np.int32)
  for i, row in enumerate(kept):
    ids[i, :len(row)] = row
    mask[i, :len(row)] = 1
  return (dict(ids=ids, mask=mask,
               context=np.full([len(kept)], context, np.int32)), kept_texts)


def build_users(sentences: dict[str, list[str]], tokenizer, *,
                max_tokens: int, end_id: int, seed: int,
                max_utterances_per_user: int | None = None,
                users: Sequence[str] = USERS,
                context_of: dict[str, int] | None = None
                ) -> dict[str, UserData]:
  """Tokenized, subsampled and split data of every user.

  Args:
    sentences: each user's sentences.
    tokenizer: the backbone's tokenizer.
    max_tokens, end_id: `encode`'s.
    seed: the subsample's and the split's seed (with the user's index in
      `users`).
    max_utterances_per_user: utterances kept per user before the split
      (None: all).
    users: the users, in order (default: the TV-show users).
    context_of: each user's context index (default: its TV show's).

  Returns:
    `{user: UserData}`.
  """
  out = {}
  for index, user in enumerate(users):
    context = context_of[user] if context_of is not None else (
        CONTEXTS.index(speaker_context_io.FRIENDS if user in FRIENDS_USERS
                       else speaker_context_io.GAME_OF_THRONES))
    rng = np.random.default_rng([seed, index])
    candidates = [sentences[user][i]
                  for i in rng.permutation(len(sentences[user]))]
    if max_utterances_per_user:
      # Tokenize only what can be kept (short sentences are dropped).
      candidates = candidates[:2 * max_utterances_per_user + 20]
    arrays, texts = encode(tokenizer, candidates, context, max_tokens, end_id)
    order = np.arange(len(texts))
    if max_utterances_per_user:
      order = order[:max_utterances_per_user]
    n = len(order)
    if n < 5:
      raise ValueError(f'user {user} has only {n} utterances of at least '
                       f'{MIN_TOKENS} tokens')
    n_train = int(round(_FRACTIONS[0] * n))
    n_tune = int(round(_FRACTIONS[1] * n))
    parts = dict(train=order[:n_train],
                 fine_tune=order[n_train:n_train + n_tune],
                 test=order[n_train + n_tune:])
    out[user] = UserData(
        user=user, context=context,
        splits={s: {k: v[idx] for k, v in arrays.items()}
                for s, idx in parts.items()},
        texts={s: [texts[i] for i in idx] for s, idx in parts.items()})
  return out


def training_users(withheld: bool) -> list[str]:
  """Users trained on: all 19 (known-user experiments) or all but withheld."""
  return [u for u in USERS if not (withheld and u in WITHHELD_USERS)]


def round_dataset(arrays: dict[str, np.ndarray], *, steps: int,
                  batch_size: int, rng: np.random.Generator) -> tf.data.Dataset:
  """`steps` batches of `batch_size` utterances sampled for one local round
  (without replacement within a batch when the user has enough)."""
  n = len(arrays['ids'])
  rows = np.concatenate([
      rng.choice(n, batch_size, replace=n < batch_size) for _ in range(steps)])
  return tf.data.Dataset.from_tensor_slices(
      collections.OrderedDict((k, arrays[k][rows])
                              for k in ('ids', 'mask', 'context'))
  ).batch(batch_size)


def batched(arrays: dict[str, np.ndarray], batch_size: int,
            rows: np.ndarray | None = None) -> tf.data.Dataset:
  """The given rows (default: all) in order, in batches."""
  if rows is None:
    rows = np.arange(len(arrays['ids']))
  return tf.data.Dataset.from_tensor_slices(
      collections.OrderedDict((k, arrays[k][rows])
                              for k in ('ids', 'mask', 'context'))
  ).batch(batch_size)
