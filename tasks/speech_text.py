"""Sentences of public text for the synthetic utterances.

Sources (both under `../shared/data`): WikiText-2's validation and test
splits (`wikitext2/{valid,test}.txt`; the train split is not available here)
and the Moby Shakespeare speeches (`shakespeare/shakespeare.tsv.gz`, read
with `speaker_context_io.load_shakespeare`).

Readings: a sentence is split at `.`, `!` or `?` followed by a space; WikiText
tokenisation is undone (`@-@` -> `-`, `@,@` -> `,`, `@.@` -> `.`, no space
before punctuation); sentences holding `<unk>`, digits or characters other
than letters, spaces and `, ; : ' - . ! ?` are dropped (espeak-ng would spell
them out or read them oddly); sentences of `min_words` to `max_words` words
are kept (7 to 13 by default: at espeak-ng's 175 words per minute about 2.5
to 4.5 s, around 375 spectrogram frames). Duplicates are removed; the result
is sorted, so a seed picks the same sentences on every machine. With the
defaults the pool holds 14,765 sentences, 883 of them from WikiText-2 (its
text is dense with digits, `<unk>` and quotes), so about 94% of the spoken
text is Shakespeare's.
"""

from __future__ import annotations

import os
import re

import numpy as np

from tasks import speaker_context_io

WIKITEXT_FILES = ('valid.txt', 'test.txt')
MIN_WORDS = 7
MAX_WORDS = 13

_ALLOWED = re.compile(r"^[A-Za-z][A-Za-z ,;:'\-.!?]*$")
_SENTENCE_END = re.compile(r'(?<=[.!?])\s+')
_SPACE_BEFORE_PUNCT = re.compile(r'\s+([,;:.!?])')
_WIKI_JOINS = (('@-@', '-'), ('@,@', ','), ('@.@', '.'))


def _detokenize_wiki(line: str) -> str:
  for token, text in _WIKI_JOINS:
    line = line.replace(f' {token} ', text)
  line = _SPACE_BEFORE_PUNCT.sub(r'\1', line)
  return re.sub(r'\s+', ' ', line).strip()


def split_sentences(text: str) -> list[str]:
  return [s.strip() for s in _SENTENCE_END.split(text) if s.strip()]


def keep(sentence: str, min_words: int = MIN_WORDS,
         max_words: int = MAX_WORDS) -> bool:
  """Whether a sentence is usable (see the module docstring)."""
  if '<unk>' in sentence or not _ALLOWED.match(sentence):
    return False
  return min_words <= len(sentence.split()) <= max_words


def wikitext_sentences(wikitext_dir: str, min_words: int = MIN_WORDS,
                       max_words: int = MAX_WORDS) -> list[str]:
  """Usable sentences of WikiText-2's valid and test splits."""
  out = []
  for name in WIKITEXT_FILES:
    path = os.path.join(wikitext_dir, name)
    if not os.path.isfile(path):
      raise FileNotFoundError(
          f'WikiText-2 file {path} not found (expected {WIKITEXT_FILES} in '
          f'{wikitext_dir}).')
    with open(path, encoding='utf-8') as f:
      for line in f:
        line = line.strip()
        if not line or line.startswith('='):
          continue
        out.extend(s for s in split_sentences(_detokenize_wiki(line))
                   if keep(s, min_words, max_words))
  return out


def shakespeare_sentences(shakespeare_dir: str, min_words: int = MIN_WORDS,
                          max_words: int = MAX_WORDS) -> list[str]:
  """Usable sentences of the Shakespeare speeches."""
  out = []
  for utterance in speaker_context_io.load_shakespeare(shakespeare_dir):
    out.extend(s for s in split_sentences(utterance.text)
               if keep(s, min_words, max_words))
  return out


def sentence_pool(data_root: str, min_words: int = MIN_WORDS,
                  max_words: int = MAX_WORDS) -> list[str]:
  """All usable, distinct sentences of both sources, sorted.

  Args:
    data_root: The folder holding `wikitext2/` and `shakespeare/`.
    min_words: Fewest words of a kept sentence.
    max_words: Most words of a kept sentence.

  Returns:
    The sorted distinct sentences.
  """
  if not 1 <= min_words <= max_words:
    raise ValueError(f'need 1 <= min_words <= max_words, got {min_words}, '
                     f'{max_words}')
  pool = set(wikitext_sentences(os.path.join(data_root, 'wikitext2'),
                                min_words, max_words))
  pool.update(shakespeare_sentences(os.path.join(data_root, 'shakespeare'),
                                    min_words, max_words))
  return sorted(pool)


def choose_sentences(pool: list[str], count: int,
                     rng: np.random.Generator) -> list[str]:
  """`count` distinct sentences of `pool`, drawn with `rng`."""
  if count > len(pool):
    raise ValueError(f'asked for {count} sentences but only {len(pool)} '
                     'usable ones exist; widen min_words/max_words')
  return [pool[i] for i in rng.choice(len(pool), size=count, replace=False)]
