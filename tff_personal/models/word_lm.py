"""A word-level LSTM language model as a `SplitModel` with no private part.

The group-personalization paper (Group Personalized FL, section 5.2) uses an
LSTM LM with character-aware word embeddings of dimension 100 and two LSTM
layers of 512 units over a ~33K-word vocabulary. That is far beyond a shared
2-core CPU for the ~40 local-training passes a reproduction needs, so this
builder is configurable and the reproduction uses a scaled-down model (plain
word embeddings, see `papers/group.py` for the sizes). Character-aware
embeddings are not built: with a vocabulary of a few thousand words built from
the training data, a word-embedding table is the standard small-scale choice.

Batches are `{'x': int32[B, L], 'y': int32[B, L]}`: `x` is the input tokens
(starting with <bos>), `y` the next tokens; id 0 is padding in both and is
excluded from the loss and from perplexity.

Every variable is shared: the personalization of this paper is whole-model
fine-tuning (the personalized model is the client state, see
`algorithms/group_fl.py`), not a split of the model.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from tff_personal.core import moved
from tff_personal.core import split_model as split_model_lib

PAD_ID = 0


@dataclasses.dataclass(frozen=True)
class WordLMConfig:
  vocab_size: int
  seq_len: int
  embedding_dim: int = 64
  lstm_units: int = 128
  lstm_layers: int = 1

  def __post_init__(self):
    for name in ('vocab_size', 'seq_len', 'embedding_dim', 'lstm_units',
                 'lstm_layers'):
      if getattr(self, name) < 1:
        raise ValueError(f'WordLMConfig.{name} must be >= 1, got '
                         f'{getattr(self, name)}')
    if self.vocab_size < 2:
      raise ValueError('WordLMConfig.vocab_size must hold padding and a word')


def _masked_nll(batch, logits) -> tuple[tf.Tensor, tf.Tensor]:
  """[B, L] next-token NLLs with padding zeroed, and the [B, L] token mask."""
  labels = batch['y']
  mask = tf.cast(tf.not_equal(labels, PAD_ID), tf.float32)
  nll = tf.keras.losses.sparse_categorical_crossentropy(
      labels, logits, from_logits=True)
  return nll * mask, mask


def token_nll_sums(batch, logits) -> tuple[tf.Tensor, tf.Tensor]:
  """(sum of next-token negative log-likelihoods, number of real tokens)."""
  nll, mask = _masked_nll(batch, logits)
  return tf.reduce_sum(nll), tf.reduce_sum(mask)


def _loss(batch, logits) -> tf.Tensor:
  """Mean next-token cross-entropy over the batch's real (non-pad) tokens."""
  nll_sum, count = token_nll_sums(batch, logits)
  return nll_sum / tf.maximum(count, 1.0)


def metrics_fn(batch, logits):
  """Per-batch sums for training metrics (`core.split_training` contract)."""
  nll_sum, count = token_nll_sums(batch, logits)
  return {'token_nll_sum': nll_sum, 'tokens': count}


def per_example_nll(batch, logits) -> tf.Tensor:
  """float32 [n, 2]: each example's (sum of token NLLs, number of real tokens).

  What evaluation reports per speech (`SplitModel.eval_fn`): pooled over
  speeches, clients or groups it gives a perplexity
  (`core/evaluation.pooled_perplexity`).
  """
  nll, mask = _masked_nll(batch, logits)
  return tf.stack([tf.reduce_sum(nll, axis=1), tf.reduce_sum(mask, axis=1)],
                  axis=1)


def lstm(units: int, **kwargs) -> tf.keras.layers.Layer:
  """An LSTM layer as `tf.keras.layers.RNN(tf.keras.layers.LSTMCell(units))`.

  The same weights (kernel, recurrent kernel, bias, in that order) and the
  same math as `tf.keras.layers.LSTM` on CPU, outputs and gradients equal;
  built without `LSTM`'s per-call implementation-selector functions, so a
  model builds several times faster (TFF calls `model_fn` many times).

  Args:
    units: The cell's units.
    **kwargs: `tf.keras.layers.RNN`'s keywords (`return_sequences`, `name`).

  Returns:
    The layer.
  """
  return tf.keras.layers.RNN(tf.keras.layers.LSTMCell(units), **kwargs)


def build_word_lm(config: WordLMConfig) -> split_model_lib.SplitModel:
  """A fresh Keras word LM: embedding, LSTM layers, softmax over the vocab."""
  tokens = tf.keras.Input(shape=(config.seq_len,), dtype=tf.int32, name='x')
  h = tf.keras.layers.Embedding(config.vocab_size, config.embedding_dim,
                                name='embedding')(tokens)
  for i in range(config.lstm_layers):
    h = lstm(config.lstm_units, return_sequences=True, name=f'lstm_{i}')(h)
  logits = tf.keras.layers.Dense(config.vocab_size, name='logits')(h)
  model = tf.keras.Model(tokens, logits)
  spec = {'x': tf.TensorSpec([None, config.seq_len], tf.int32),
          'y': tf.TensorSpec([None, config.seq_len], tf.int32)}
  return split_model_lib.SplitModel(
      model=model, private_variables=[], loss_fn=_loss, input_spec=spec,
      eval_fn=per_example_nll, loss_terms_fn=per_example_nll)


def model_fn_for(config: WordLMConfig) -> split_model_lib.SplitModelFn:
  return lambda: build_word_lm(config)


# Names that moved away raise an error naming their new place.
__getattr__ = moved.module_getattr(__name__)
