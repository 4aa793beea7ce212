"""The `shakespeare_groups` task: characters as clients, genres as groups.

Group Personalized FL (section 5) treats wiki pages (or video uploaders) as
clients, their sentences as examples, and topics as groups. Here:

* a client is a character, i.e. a (play, speaker) pair of the Moby
  Shakespeare, read by `tasks.speaker_context_io.load_shakespeare` (speaker
  names normalised, pseudo-speakers such as 'All' dropped): 1,326 clients;
* an example is one speech;
* a client's group is its play's genre, `GENRES` below;
* each client's speeches are shuffled (seeded) and split 75 / 25 into train /
  eval, as the paper split wiki pages: `n_eval = max(1, round(n / 4))` for
  n >= 2 speeches; a client with a single speech keeps it for training (it
  takes part in training but has nothing to evaluate). Every client is kept,
  however few its speeches: the long tail is where group knowledge helps
  most (the paper's section 5.4).

Genres (`GENRES`). Source: the First Folio (1623) sorts the plays into
"Comedies", "Histories" and "Tragedies"; the four late plays Pericles,
Cymbeline, The Winter's Tale and The Tempest are the "romances" since
Dowden (Shakespeare: A Critical Study of His Mind and Art, 1875), the usual
modern grouping. So The Tempest and The Winter's Tale (Folio comedies) and
Cymbeline (a Folio tragedy) are romances; Pericles (not in the First Folio;
added in the Third Folio, 1664) is a romance; Troilus and Cressida, printed
between the histories and tragedies and titled "The Tragedie of Troylus and
Cressida" in the Folio, is a tragedy.

Text. Speeches are lower-cased and tokenized into words (letters with inner
apostrophes, e.g. "walk'd", "'tis") and the punctuation marks . , ! ? ; :.
The vocabulary is built from the *training* speeches only: the most frequent
`vocab_size - 4` tokens (ties broken alphabetically) plus <pad> (0), <unk>
(1), <bos> (2), <eos> (3). An example is `x = [<bos>, w1..wm]`,
`y = [w1..wm, <eos>]` padded with 0 to `seq_len`; speeches longer than
`seq_len - 1` words are truncated to their first `seq_len` words (then `y`
has no <eos>), which caps the cost of a long speech. Perplexity counts every
target token including <eos> and <unk>.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
from typing import Callable, Optional, Sequence

import numpy as np
import tensorflow as tf

from tasks import speaker_context_io
from tff_personal.core import evaluation
from tff_personal.models import word_lm

COMEDY = 'comedy'
TRAGEDY = 'tragedy'
HISTORY = 'history'
ROMANCE = 'romance'
GROUP_NAMES = (COMEDY, TRAGEDY, HISTORY, ROMANCE)

# Play id of shakespeare.tsv.gz -> genre (source: module docstring).
GENRES = {
    # First Folio comedies (less The Tempest, The Winter's Tale).
    'allswell': COMEDY, 'asyoulikeit': COMEDY, 'comedy_errors': COMEDY,
    'lll': COMEDY, 'measure': COMEDY, 'merchant': COMEDY,
    'merry_wives': COMEDY, 'midsummer': COMEDY, 'much_ado': COMEDY,
    'taming_shrew': COMEDY, 'twelfth_night': COMEDY, 'two_gentlemen': COMEDY,
    # First Folio histories.
    '1henryiv': HISTORY, '2henryiv': HISTORY, '1henryvi': HISTORY,
    '2henryvi': HISTORY, '3henryvi': HISTORY, 'henryv': HISTORY,
    'henryviii': HISTORY, 'john': HISTORY, 'richardii': HISTORY,
    'richardiii': HISTORY,
    # First Folio tragedies (less Cymbeline), with Troilus and Cressida.
    'cleopatra': TRAGEDY, 'coriolanus': TRAGEDY, 'hamlet': TRAGEDY,
    'julius_caesar': TRAGEDY, 'lear': TRAGEDY, 'macbeth': TRAGEDY,
    'othello': TRAGEDY, 'romeo_juliet': TRAGEDY, 'timon': TRAGEDY,
    'titus': TRAGEDY, 'troilus_cressida': TRAGEDY,
    # Romances (late plays).
    'pericles': ROMANCE, 'cymbeline': ROMANCE, 'winters_tale': ROMANCE,
    'tempest': ROMANCE,
}

PAD, UNK, BOS, EOS = '<pad>', '<unk>', '<bos>', '<eos>'
SPECIALS = (PAD, UNK, BOS, EOS)
UNK_ID, BOS_ID, EOS_ID = 1, 2, 3
EVAL_FRACTION = 0.25
_TOKEN_RE = re.compile(r"[a-z]+(?:'[a-z]+)*|'[a-z]+|[.,!?;:]")


def tokenize(text: str) -> list[str]:
  return _TOKEN_RE.findall(text.lower())


def build_vocab(texts: Sequence[str], vocab_size: int) -> list[str]:
  """The specials, then the most frequent tokens of `texts` (ties: a-z)."""
  if vocab_size <= len(SPECIALS):
    raise ValueError(f'vocab_size must exceed {len(SPECIALS)} (the special '
                     f'tokens), got {vocab_size}')
  counts = collections.Counter(t for text in texts for t in tokenize(text))
  ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
  return list(SPECIALS) + [w for w, _ in ranked[:vocab_size - len(SPECIALS)]]


def encode(texts: Sequence[str], vocab: dict[str, int],
           seq_len: int) -> dict[str, np.ndarray]:
  """`{'x', 'y'}` int32 arrays [len(texts), seq_len] (module docstring)."""
  x = np.zeros((len(texts), seq_len), np.int32)
  y = np.zeros((len(texts), seq_len), np.int32)
  for i, text in enumerate(texts):
    ids = [vocab.get(t, UNK_ID) for t in tokenize(text)][:seq_len]
    inputs = ([BOS_ID] + ids)[:seq_len]
    targets = (ids + [EOS_ID])[:seq_len]
    x[i, :len(inputs)] = inputs
    y[i, :len(targets)] = targets
  return {'x': x, 'y': y}


def split_counts(n: int) -> tuple[int, int]:
  """(train, eval) sizes of a client with n speeches (module docstring)."""
  if n < 1:
    raise ValueError(f'a client needs at least one speech, got {n}')
  if n == 1:
    return 1, 0
  n_eval = max(1, int(np.floor(n * EVAL_FRACTION + 0.5)))
  return n - n_eval, n_eval


@dataclasses.dataclass
class ShakespeareGroupsTask:
  """Clients, their groups and encoded train / eval speeches: a `Task`.

  `client_ids[i]` is 'shakespeare/<play>/<NAME>'; `client_groups[i]` its
  genre. As a `core/task.Task` (client ids `0 .. population - 1`) it has
  the capabilities `split_model` (the word LM, every variable shared) and
  `groups` (`groups(ids)`: the genres), and `evaluate` reports the pooled
  perplexity of every evaluated speech and of each genre's.
  """
  client_ids: list[str]
  client_groups: list[str]
  train: list[dict[str, np.ndarray]]
  eval: list[dict[str, np.ndarray]]
  vocab: list[str]
  model_config: word_lm.WordLMConfig
  batch_size: int = 8
  seed: int = 0
  local_epochs: int = 1

  name = 'shakespeare_groups'

  @property
  def num_clients(self) -> int:
    return len(self.client_ids)

  @property
  def population(self) -> int:
    return len(self.client_ids)

  @property
  def group_names(self) -> list[str]:
    return [g for g in GROUP_NAMES if g in set(self.client_groups)] + sorted(
        set(self.client_groups) - set(GROUP_NAMES))

  def clients_of(self, group: str) -> list[int]:
    return [i for i, g in enumerate(self.client_groups) if g == group]

  def groups(self, client_ids: Sequence[int]) -> np.ndarray:
    """The genre of each of `client_ids`."""
    return np.asarray(self.client_groups, dtype=object)[
        np.asarray(client_ids, np.int64)]

  @property
  def model_fn(self):
    return word_lm.model_fn_for(self.model_config)

  def model_fn_factory(self, embedding_dim: int = 0):
    """The word LM (`split_model` capability); it has no personal part."""
    if embedding_dim:
      raise ValueError('shakespeare_groups\' word LM has no personal '
                       f'embedding; embedding_dim must be 0, got '
                       f'{embedding_dim}')
    return self.model_fn

  @staticmethod
  def metrics_fn(batch, logits):
    return word_lm.metrics_fn(batch, logits)

  def num_train(self, client: int) -> int:
    return len(self.train[client]['x'])

  def num_eval(self, client: int) -> int:
    return len(self.eval[client]['x'])

  def _dataset(self, arrays, epochs: int, shuffle_seed: Optional[int]):
    ds = tf.data.Dataset.from_tensor_slices(arrays)
    if shuffle_seed is not None:
      ds = ds.shuffle(len(arrays['x']), seed=shuffle_seed)
    return ds.repeat(epochs).batch(self.batch_size)

  def train_dataset(self, client: int, epochs: int = 1,
                    round_num: int = 0) -> tf.data.Dataset:
    """`epochs` passes over the client's training speeches, reshuffled.

    The shuffle is a pure function of (task seed, round, client).
    """
    seed = int(np.random.default_rng(
        [self.seed, round_num, client]).integers(2**31))
    return self._dataset(self.train[client], epochs, seed)

  def eval_dataset(self, client: int) -> tf.data.Dataset:
    return self._dataset(self.eval[client], 1, None)

  def train_dataset_fn(self, epochs: int) -> Callable[[int, int], tf.data.Dataset]:
    return lambda client, round_num: self.train_dataset(client, epochs,
                                                        round_num)

  def _check_ids(self, client_ids: Sequence[int]) -> None:
    bad = [c for c in client_ids if not 0 <= int(c) < self.population]
    if bad:
      raise ValueError(f'shakespeare_groups: client ids {bad[:5]} are not in '
                       f'[0, {self.population})')

  def train_datasets(self, client_ids: Sequence[int],
                     round_num: int) -> list[tf.data.Dataset]:
    """`local_epochs` passes over each client's speeches (`train_dataset`)."""
    self._check_ids(client_ids)
    return [self.train_dataset(int(c), self.local_epochs, round_num)
            for c in client_ids]

  def eval_datasets(self, client_ids: Sequence[int]
                    ) -> list[tf.data.Dataset]:
    """Each client's evaluation speeches; a client with none (a single
    speech, kept for training) gets one all-padding row, which scores no
    token."""
    self._check_ids(client_ids)
    out = []
    for c in client_ids:
      arrays = self.eval[int(c)]
      if not len(arrays['x']):
        arrays = {k: np.zeros((1,) + v.shape[1:], v.dtype)
                  for k, v in arrays.items()}
      out.append(self._dataset(arrays, 1, None))
    return out

  def evaluate(self, per_client_outputs, client_ids) -> dict:
    """Pooled perplexity over every evaluated speech (`perplexity`, with
    the tokens, the clients with a token and their mean perplexity:
    `core/evaluation.pooled_perplexity`) and per genre
    (`perplexity/<genre>`).

    `per_client_outputs[i]['outputs']` are the word LM's `per_example_nll`
    rows of client `client_ids[i]`.
    """
    result = evaluation.pooled_perplexity(per_client_outputs)
    groups = self.groups(client_ids)
    for g in self.group_names:
      outputs = [o for o, h in zip(per_client_outputs, groups) if h == g]
      if outputs:
        result[f'perplexity/{g}'] = evaluation.pooled_perplexity(
            outputs)['perplexity']
    return result


def load_speeches(data_dir: str) -> list[speaker_context_io.Utterance]:
  """Shakespeare speeches; `data_dir` holds `shakespeare/` or is that folder."""
  folder = os.path.join(data_dir, 'shakespeare')
  if not os.path.isdir(folder):
    folder = data_dir
  speeches = speaker_context_io.load_shakespeare(folder)
  unknown = sorted({u.community for u in speeches} - set(GENRES))
  if unknown:
    raise ValueError(f'plays with no genre in GENRES: {unknown}')
  return speeches


def build_task(speeches: Sequence[speaker_context_io.Utterance], *,
               vocab_size: int = 3000, seq_len: int = 24,
               embedding_dim: int = 64, lstm_units: int = 128,
               lstm_layers: int = 1, batch_size: int = 8, seed: int = 0,
               max_clients: Optional[int] = None,
               local_epochs: int = 1) -> ShakespeareGroupsTask:
  """Splits, builds the vocabulary from train speeches, encodes.

  Args:
    speeches: utterances with user 'shakespeare/<play>/<NAME>' and community
      = play id.
    vocab_size: including the four special tokens.
    seq_len: tokens per example (input and target).
    embedding_dim, lstm_units, lstm_layers: the word LM's sizes.
    batch_size: local batch size (the paper: 8).
    seed: of the train / eval split and of local shuffling.
    max_clients: keep only this many clients (a seeded uniform sample, for
      tests and smoke runs); None keeps all.
    local_epochs: K, passes over a client's speeches per round
      (`train_datasets`).
  """
  if local_epochs < 1:
    raise ValueError(f'local_epochs must be >= 1, got {local_epochs}')
  if seq_len < 2:
    raise ValueError(f'seq_len must be >= 2, got {seq_len}')
  if batch_size < 1:
    raise ValueError(f'batch_size must be >= 1, got {batch_size}')
  by_client = collections.OrderedDict()
  for u in speeches:
    if u.community not in GENRES:
      raise ValueError(f'play {u.community!r} has no genre in GENRES')
    by_client.setdefault(u.user, (u.community, []))[1].append(u.text)
  if not by_client:
    raise ValueError('no speeches')
  client_ids = sorted(by_client)
  if max_clients is not None:
    if max_clients < 1:
      raise ValueError(f'max_clients must be >= 1, got {max_clients}')
    rng = np.random.default_rng([seed, 0x6C])
    keep = rng.choice(len(client_ids), min(max_clients, len(client_ids)),
                      replace=False)
    client_ids = [client_ids[i] for i in sorted(keep)]
  train_texts, eval_texts = [], []
  for index, cid in enumerate(client_ids):
    texts = by_client[cid][1]
    order = np.random.default_rng([seed, 0x5B1, index]).permutation(len(texts))
    n_train, _ = split_counts(len(texts))
    train_texts.append([texts[i] for i in order[:n_train]])
    eval_texts.append([texts[i] for i in order[n_train:]])
  vocab = build_vocab([t for ts in train_texts for t in ts], vocab_size)
  ids = {w: i for i, w in enumerate(vocab)}
  return ShakespeareGroupsTask(
      client_ids=client_ids,
      client_groups=[GENRES[by_client[c][0]] for c in client_ids],
      train=[encode(ts, ids, seq_len) for ts in train_texts],
      eval=[encode(ts, ids, seq_len) for ts in eval_texts],
      vocab=vocab,
      model_config=word_lm.WordLMConfig(
          vocab_size=len(vocab), seq_len=seq_len, embedding_dim=embedding_dim,
          lstm_units=lstm_units, lstm_layers=lstm_layers),
      batch_size=batch_size, seed=seed, local_epochs=local_epochs)


def _default_data_dir() -> str:
  return os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..',
                      'shared', 'data')


def shakespeare_groups_task(data_dir: Optional[str] = None, *,
                            vocab_size: int = 2000, seq_len: int = 16,
                            embedding_dim: int = 32, lstm_units: int = 64,
                            lstm_layers: int = 1, batch_size: int = 8,
                            local_epochs: int = 1,
                            max_clients: Optional[int] = 0,
                            seed: int = 0) -> ShakespeareGroupsTask:
  """Loads the speeches under `data_dir` and builds the task (`build_task`).

  The defaults are the sizes of the group reproduction (`papers/group.py`).
  `max_clients` 0 (or None) keeps every character; `data_dir` None reads
  `../shared/data` beside the repository.
  """
  return build_task(load_speeches(data_dir or _default_data_dir()),
                    vocab_size=vocab_size, seq_len=seq_len,
                    embedding_dim=embedding_dim, lstm_units=lstm_units,
                    lstm_layers=lstm_layers, batch_size=batch_size,
                    seed=seed, max_clients=max_clients or None,
                    local_epochs=local_epochs)
