"""Trains a byte-level BPE vocabulary and merges for keras-nlp's GPT-2 tokenizer.

keras-nlp has a BPE *tokenizer* (`keras_nlp.models.GPT2Tokenizer`) but no BPE
*trainer*, so this module is hand-written. It follows GPT-2's byte-level BPE
(Radford et al., 2019) exactly as keras-nlp 0.11.1 applies it, so that its
output loads into `GPT2Tokenizer(vocabulary=..., merges=...)` and tokenizes
the training text into the learned symbols:

* pre-tokenization with the GPT-2 split regex (the same pattern keras-nlp
  emulates with re2: contractions, ` ?letters`, ` ?digits`, ` ?other`,
  whitespace runs);
* bytes mapped to printable unicode characters with keras-nlp's own
  `bytes_to_unicode` table (so a leading space is `Ġ`);
* the base vocabulary is all 256 byte symbols; merges are learned greedily
  (most frequent adjacent pair, ties broken by the lexicographically smallest
  pair so the result is deterministic), each adding one token;
* `<|endoftext|>` (GPT-2's start/end/padding token) is the last id.

The merge loop keeps an index pair -> words containing it, so each merge only
touches the words that contain the merged pair.
"""

from __future__ import annotations

import collections
import heapq
from typing import Iterable

import regex


END_TOKEN = '<|endoftext|>'

# GPT-2's pre-tokenization pattern (with the lookahead keras-nlp emulates).
_SPLIT_RE = regex.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")


def byte_encoder() -> dict[int, str]:
  """keras-nlp's byte -> printable-unicode table (GPT-2's)."""
  # Imported here: importing keras-nlp prints Keras Core's backend to stdout.
  from keras_nlp.src.tokenizers import byte_pair_tokenizer  # pylint: disable=g-import-not-at-top
  byte_list, unicode_list = byte_pair_tokenizer.bytes_to_unicode()
  return {b[0]: u for b, u in zip(byte_list, unicode_list)}


def pretokenize(text: str) -> list[str]:
  """Splits text into GPT-2 pre-tokens, each mapped to byte symbols."""
  table = byte_encoder()
  return [''.join(table[b] for b in piece.encode('utf-8'))
          for piece in _SPLIT_RE.findall(text)]


def train_bpe(texts: Iterable[str], vocabulary_size: int,
              min_frequency: int = 2) -> tuple[dict[str, int], list[str]]:
  """Learns a byte-level BPE vocabulary of `vocabulary_size` tokens.

  Args:
    texts: the training text, any number of strings.
    vocabulary_size: total size including the 256 byte symbols and
      `<|endoftext|>`; must be at least 257 + 1.
    min_frequency: stop early when the best pair occurs fewer times.

  Returns:
    `(vocabulary, merges)`: token -> id (bytes first, then merges in order,
    then `<|endoftext|>`), and the merge rules as `"a b"` strings, in the
    formats `keras_nlp.models.GPT2Tokenizer` takes.
  """
  if vocabulary_size < 258:
    raise ValueError(
        f'vocabulary_size must be at least 258 (256 bytes, one merge and '
        f'{END_TOKEN}), got {vocabulary_size}')
  word_counts = collections.Counter()
  for text in texts:
    word_counts.update(pretokenize(text))
  if not word_counts:
    raise ValueError('train_bpe got no text')
  words = [list(w) for w in word_counts]
  counts = [word_counts[w] for w in word_counts]

  pair_counts = collections.Counter()
  pair_words = collections.defaultdict(set)
  for i, symbols in enumerate(words):
    for pair in zip(symbols, symbols[1:]):
      pair_counts[pair] += counts[i]
      pair_words[pair].add(i)

  # Max-heap of (-count, pair) with lazy deletion of stale entries.
  heap = [(-c, p) for p, c in pair_counts.items()]
  heapq.heapify(heap)

  base = list(byte_encoder().values())
  vocabulary = {symbol: i for i, symbol in enumerate(base)}
  merges = []
  num_merges = vocabulary_size - len(base) - 1
  while len(merges) < num_merges and heap:
    neg, pair = heapq.heappop(heap)
    if pair_counts.get(pair, 0) != -neg:
      continue  # stale
    if -neg < min_frequency:
      break
    merged = pair[0] + pair[1]
    merges.append(f'{pair[0]} {pair[1]}')
    vocabulary.setdefault(merged, len(vocabulary))
    touched = set()
    for i in list(pair_words.get(pair, ())):
      symbols = words[i]
      # Remove this word's old pair counts.
      for p in zip(symbols, symbols[1:]):
        pair_counts[p] -= counts[i]
        touched.add(p)
      new_symbols, j = [], 0
      while j < len(symbols):
        if (j + 1 < len(symbols) and symbols[j] == pair[0]
            and symbols[j + 1] == pair[1]):
          new_symbols.append(merged)
          j += 2
        else:
          new_symbols.append(symbols[j])
          j += 1
      words[i] = new_symbols
      for p in zip(new_symbols, new_symbols[1:]):
        pair_counts[p] += counts[i]
        pair_words[p].add(i)
        touched.add(p)
    pair_words.pop(pair, None)
    pair_counts.pop(pair, None)
    for p in touched:
      c = pair_counts.get(p, 0)
      if c > 0:
        heapq.heappush(heap, (-c, p))
      else:
        pair_counts.pop(p, None)
  vocabulary[END_TOKEN] = len(vocabulary)
  return vocabulary, merges
