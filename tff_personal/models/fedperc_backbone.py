"""The frozen keras-nlp GPT-2 of FedPerC: loading, building and pre-training.

`--backbone=PRESET_OR_DIR` is either a keras-nlp preset name (with network
access, `distil_gpt2_base_en` is the paper's DistilGPT2) or a local preset
directory as written by `save_preset` (both `GPT2Backbone.from_preset(dir)`
and `GPT2Tokenizer.from_preset(dir)` read it: keras-nlp 0.11.1's
`save_to_preset` writes `config.json`, `model.weights.h5`, `metadata.json`,
`tokenizer.json` and `assets/tokenizer/{vocabulary.json,merges.txt}`).

TFF computations build their models in graph mode from a `model_fn`, where
Keras cannot restore `.h5` weights; so a backbone is loaded eagerly once into
a `BackboneSpec` (its config and its weights as numpy arrays), and each
`model_fn` builds a fresh `GPT2Backbone` from the config whose (frozen)
weights then arrive as the shared non-trainable `ModelWeights`.

Pre-training (used by `binaries/pretrain_backbone.py`) is plain next-token
language modelling with the token embedding tied as output layer, as GPT-2.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Sequence

import numpy as np
import tensorflow as tf

from tff_personal.core import atomic_io


def _keras_nlp():
  """keras-nlp, imported on first use: importing it starts Keras Core,
  which prints its backend to stdout, so the library imports it only when a
  FedPerC backbone is built or loaded."""
  import keras_nlp  # pylint: disable=g-import-not-at-top
  return keras_nlp


def _preset_utils():
  from keras_nlp.src.utils import preset_utils  # pylint: disable=g-import-not-at-top
  return preset_utils



@dataclasses.dataclass(frozen=True)
class BackboneSpec:
  """An eagerly loaded backbone: its config, weights and tokenizer assets."""
  config: dict[str, Any]
  weights: tuple[np.ndarray, ...]
  vocabulary: dict[str, int]
  merges: tuple[str, ...]
  name: str = ''

  @property
  def hidden_dim(self) -> int:
    return int(self.config['hidden_dim'])

  @property
  def vocabulary_size(self) -> int:
    return int(self.config['vocabulary_size'])

  @property
  def max_sequence_length(self) -> int:
    return int(self.config['max_sequence_length'])

  def build_backbone(self) -> 'keras_nlp.models.GPT2Backbone':
    """A fresh frozen backbone of this config, without dropout.

    Its weights are not loaded (graph mode); callers assign `weights` (eagerly
    with `set_weights`, or in TFF through the broadcast non-trainable weights).
    """
    config = dict(self.config)
    config['dropout'] = 0.0
    backbone = _keras_nlp().models.GPT2Backbone(**config)
    backbone.trainable = False
    return backbone

  def tokenizer(self, sequence_length: int | None = None):
    return _keras_nlp().models.GPT2Tokenizer(
        vocabulary=dict(self.vocabulary), merges=list(self.merges),
        sequence_length=sequence_length)


_CONFIG_KEYS = ('vocabulary_size', 'num_layers', 'num_heads', 'hidden_dim',
                'intermediate_dim', 'dropout', 'max_sequence_length')


def spec_from_backbone(backbone, tokenizer, name: str = '') -> BackboneSpec:
  config = backbone.get_config()
  return BackboneSpec(
      config={k: config[k] for k in _CONFIG_KEYS},
      weights=tuple(np.asarray(w) for w in backbone.get_weights()),
      vocabulary=dict(tokenizer.vocabulary), merges=tuple(tokenizer.merges),
      name=name)


def load_backbone(preset_or_dir: str) -> BackboneSpec:
  """Loads a keras-nlp GPT-2 preset name or a local preset directory."""
  if not preset_or_dir:
    raise ValueError('--backbone is empty: give a keras-nlp GPT-2 preset name '
                     '(e.g. distil_gpt2_base_en) or a preset directory')
  is_dir = os.path.isdir(preset_or_dir)
  presets = _keras_nlp().models.GPT2Backbone.presets
  if not is_dir and preset_or_dir not in presets:
    raise ValueError(
        f'--backbone={preset_or_dir!r} is neither a directory nor a keras-nlp '
        f'GPT-2 preset ({sorted(presets)}); '
        'make a local one with `python -m binaries.pretrain_backbone`')
  if is_dir:
    for name in ('config.json', 'metadata.json', 'tokenizer.json'):
      if not os.path.exists(os.path.join(preset_or_dir, name)):
        raise ValueError(f'--backbone directory {preset_or_dir} has no {name}; '
                         'is it a keras-nlp preset directory?')
  backbone = _keras_nlp().models.GPT2Backbone.from_preset(preset_or_dir)
  tokenizer = _keras_nlp().models.GPT2Tokenizer.from_preset(preset_or_dir)
  return spec_from_backbone(backbone, tokenizer, name=preset_or_dir)


def random_backbone(vocabulary: dict[str, int], merges: Sequence[str], *,
                    num_layers: int = 1, num_heads: int = 2,
                    hidden_dim: int = 16, intermediate_dim: int = 32,
                    max_sequence_length: int = 32,
                    seed: int = 0) -> BackboneSpec:
  """A randomly initialised backbone (tests; shape-only measurements)."""
  tf.keras.utils.set_random_seed(seed)
  backbone = _keras_nlp().models.GPT2Backbone(
      vocabulary_size=len(vocabulary), num_layers=num_layers,
      num_heads=num_heads, hidden_dim=hidden_dim,
      intermediate_dim=intermediate_dim, dropout=0.0,
      max_sequence_length=max_sequence_length)
  tokenizer = _keras_nlp().models.GPT2Tokenizer(
      vocabulary=dict(vocabulary), merges=list(merges))
  return spec_from_backbone(backbone, tokenizer, name='random')


UNUSED_TOKEN = '<|unused_{}|>'


def padded_vocabulary(vocabulary: dict[str, int],
                      size: int) -> dict[str, int]:
  """`vocabulary` extended to `size` ids by tokens no merge produces.

  The added tokens (`<|unused_i|>`) are never emitted by the tokenizer, so
  text tokenizes exactly as before; only the embedding and output layers
  grow. Used to build a backbone of another model's shape (e.g. DistilGPT2's
  50,257-token vocabulary) for measurements that depend on shape only.

  Raises:
    ValueError: `size` is below the vocabulary's size, or the ids are not
      0..len(vocabulary) - 1.
  """
  if sorted(vocabulary.values()) != list(range(len(vocabulary))):
    raise ValueError('vocabulary ids must be 0..len(vocabulary) - 1')
  if size < len(vocabulary):
    raise ValueError(f'cannot pad a vocabulary of {len(vocabulary)} tokens to '
                     f'{size}')
  out = dict(vocabulary)
  for i in range(size - len(vocabulary)):
    token = UNUSED_TOKEN.format(i)
    if token in out:
      raise ValueError(f'vocabulary already holds {token}')
    out[token] = len(out)
  return out


# Written into a preset directory whose weights are random (shape-only
# measurements); perplexity tables refuse such a backbone.
RANDOM_WEIGHTS_FILE = 'random_weights.json'


def has_random_weights(preset_or_dir: str) -> bool:
  return os.path.exists(os.path.join(preset_or_dir, RANDOM_WEIGHTS_FILE))


def save_preset(backbone, tokenizer, preset_dir: str) -> None:
  """Writes a keras-nlp preset directory, as `save_to_preset` would.

  keras-nlp 0.11.1's `Backbone.save_to_preset` / `Tokenizer.save_to_preset`
  refuse to run under Keras 2 (`check_keras_3`) because Keras 3 reads weight
  files differently. This writes the same files with keras-nlp's own helpers
  (`config.json`, `tokenizer.json`, `metadata.json`, the tokenizer assets) and
  the weights with Keras 2's `save_weights`, which Keras 2's `load_weights`
  (called by `from_preset` here) reads back. Under Keras 3 it would need
  `save_to_preset` itself.
  """
  os.makedirs(preset_dir, exist_ok=True)
  preset_utils = _preset_utils()
  for layer, config_file in ((backbone, preset_utils.CONFIG_FILE),
                             (tokenizer, preset_utils.TOKENIZER_CONFIG_FILE)):
    config = tf.keras.saving.serialize_keras_object(layer)
    for key in ('compile_config', 'build_config'):
      preset_utils.recursive_pop(config, key)
    with open(os.path.join(preset_dir, config_file), 'w') as f:
      f.write(json.dumps(config, indent=4))
  backbone.save_weights(
      os.path.join(preset_dir, preset_utils.MODEL_WEIGHTS_FILE))
  preset_utils.save_metadata(backbone, preset_dir)
  preset_utils.save_tokenizer_assets(tokenizer, preset_dir)


def write_random_preset(vocabulary: dict[str, int], merges: Sequence[str],
                        preset_dir: str, note: str = '',
                        provenance: dict[str, Any] | None = None,
                        **shape) -> dict[str, Any]:
  """Writes a random-weight preset directory, marked as random.

  `shape`: `random_backbone`'s keyword arguments (num_layers, num_heads,
  hidden_dim, intermediate_dim, max_sequence_length, seed). The marker file
  (`RANDOM_WEIGHTS_FILE`, read by `has_random_weights`) is written first, so
  a preset written halfway is still marked random. Refuses a non-empty
  directory (never overwrites a trained preset). `provenance` (e.g. where
  the tokenizer came from) goes into the marker. Returns the marker's
  summary (config, parameter count, note, provenance).

  Example:
    vocabulary, merges = bpe_trainer.train_bpe(texts, 500)
    write_random_preset(vocabulary, merges, '/tmp/tiny', hidden_dim=32)
  """
  if os.path.isdir(preset_dir) and os.listdir(preset_dir):
    raise ValueError(f'{preset_dir} exists and is not empty')
  spec = random_backbone(vocabulary, merges, **shape)
  backbone = spec.build_backbone()
  backbone.set_weights(spec.weights)
  summary = dict(random_weights=True, **(provenance or {}),
                 trained_tokens=len(vocabulary),
                 config=spec.config, parameters=int(backbone.count_params()),
                 note=note or 'Random weights: for time and memory '
                 'measurements only.')
  os.makedirs(preset_dir, exist_ok=True)
  with atomic_io.atomic_write(os.path.join(preset_dir,
                                          RANDOM_WEIGHTS_FILE)) as f:
    f.write(json.dumps(summary, indent=2))
  save_preset(backbone, spec.tokenizer(), preset_dir)
  return summary


def lm_logits(backbone, hidden: tf.Tensor) -> tf.Tensor:
  """GPT-2's output layer: the token embedding, transposed (tied weights)."""
  return backbone.token_embedding(hidden, reverse=True)


# ---------------------------------------------------------------- pretraining

_WIKI_FIXES = ((' @-@ ', '-'), (' @,@ ', ','), (' @.@ ', '.'), (' <unk>', ''),
               ('<unk> ', ''), (' , ', ', '), (' . ', '. '), (" 's", "'s"),
               (" n't", "n't"), (' ; ', '; '), (' : ', ': '), ('( ', '('),
               (' )', ')'), (" '", "'"), (' ? ', '? '), (' ! ', '! '))


def wikitext_paragraphs(path: str) -> list[str]:
  """WikiText-2 paragraphs, lightly detokenized; headings dropped.

  WikiText is word-tokenized (`word , word`, `@-@` for hyphens) and has
  `<unk>` for rare words: the detokenization undoes the spacing so that the
  learned vocabulary sees ordinary English; `<unk>` tokens are removed.
  """
  if not os.path.exists(path):
    raise FileNotFoundError(f'WikiText-2 file not found: {path}')
  paragraphs = []
  with open(path, encoding='utf-8') as f:
    for line in f:
      line = line.strip()
      if not line or re.fullmatch(r'(= )+.*( =)+', line):
        continue
      for a, b in _WIKI_FIXES:
        line = line.replace(a, b)
      paragraphs.append(line)
  return paragraphs


def token_blocks(tokenizer, paragraphs: Sequence[str], block: int,
                 end_id: int) -> np.ndarray:
  """Concatenates tokenized paragraphs (end token between) into blocks."""
  ids = []
  for start in range(0, len(paragraphs), 256):
    chunk = tokenizer(tf.constant(list(paragraphs[start:start + 256])))
    for row in chunk.to_list():
      ids.extend(row)
      ids.append(end_id)
  n = len(ids) // block
  return np.asarray(ids[:n * block], np.int32).reshape(n, block)


class CausalLM(tf.keras.Model):
  """Backbone + tied output layer, for pre-training only."""

  def __init__(self, backbone):
    super().__init__()
    self.backbone = backbone

  def call(self, token_ids, training=False):
    hidden = self.backbone(
        {'token_ids': token_ids, 'padding_mask': tf.ones_like(token_ids)},
        training=training)
    return lm_logits(self.backbone, hidden)


def lm_dataset(blocks: np.ndarray, batch_size: int, shuffle: bool,
               seed: int) -> tf.data.Dataset:
  ds = tf.data.Dataset.from_tensor_slices(blocks)
  if shuffle:
    ds = ds.shuffle(len(blocks), seed=seed, reshuffle_each_iteration=True)
  return ds.batch(batch_size).map(lambda b: (b[:, :-1], b[:, 1:]))
