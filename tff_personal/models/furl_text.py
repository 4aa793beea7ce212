"""FURL's personalized document model (FURL paper, Figure 1 and section 4).

"The text is encoded into an input representation vector by using
character-level embeddings and a Bidirectional LSTM (BLSTM) layer. A trainable
embedding layer translates each user ID into a user embedding vector. Finally,
an MLP produces the prediction from the concatenation of the input
representation and the user embedding."

Two forms of the same network:

* `build_federated_model`: for FL. The user embedding is a single private
  vector (`PersonalEmbedding`), the client's row of the embedding table; it is
  client state and never leaves the client. With `user_embedding_dim=0` it is
  the Global model (no personalization).
* `build_centralized_model`: for server training (the paper's Global Server and
  Personalized Server). The user embedding is a `tf.keras.layers.Embedding`
  table indexed by the `user` feature.

Sizes are not given in the paper (it swept them); the defaults here are
scaled to a 2-core CPU and are flags of the experiment binaries.
"""

from __future__ import annotations

import collections
import dataclasses

import tensorflow as tf

from tff_personal.core import split_model
from tff_personal.models import fedembed_mnist
from tff_personal.models import word_lm


@dataclasses.dataclass(frozen=True)
class DocumentModelConfig:
  vocab_size: int
  num_classes: int
  max_chars: int
  user_embedding_dim: int = 32
  char_embedding_dim: int = 16
  lstm_units: int = 64
  mlp_units: int = 64

  def validate(self):
    for name in ('vocab_size', 'num_classes', 'max_chars', 'char_embedding_dim',
                 'lstm_units', 'mlp_units'):
      if getattr(self, name) < 1:
        raise ValueError(f'{name} must be positive, got {getattr(self, name)}')
    if self.user_embedding_dim < 0:
      raise ValueError('user_embedding_dim must be >= 0, got '
                       f'{self.user_embedding_dim}')


def _text_encoder(config: DocumentModelConfig, chars):
  x = tf.keras.layers.Embedding(config.vocab_size, config.char_embedding_dim,
                                mask_zero=True, name='char_embedding')(chars)
  return tf.keras.layers.Bidirectional(
      word_lm.lstm(config.lstm_units), name='blstm')(x)


def _head(config: DocumentModelConfig, features):
  h = tf.keras.layers.Dense(config.mlp_units, activation='relu',
                            name='mlp_hidden')(features)
  return tf.keras.layers.Dense(config.num_classes, name='mlp_out')(h)


def classification_loss(batch, logits):
  return tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
      batch['y'], logits, from_logits=True))


def accuracy_sums(batch, logits):
  correct = tf.cast(tf.equal(tf.argmax(logits, axis=-1, output_type=tf.int32),
                             tf.cast(batch['y'], tf.int32)), tf.float32)
  return collections.OrderedDict(accuracy_sum=tf.reduce_sum(correct))


def build_federated_model(config: DocumentModelConfig,
                          input_spec=None) -> split_model.SplitModel:
  """The FL form: the user embedding is the only private variable."""
  config.validate()
  chars = tf.keras.Input(shape=(config.max_chars,), dtype=tf.int32, name='x')
  features = _text_encoder(config, chars)
  private = []
  if config.user_embedding_dim:
    personal = fedembed_mnist.PersonalEmbedding(
        config.user_embedding_dim, name='user_embedding')
    features = tf.keras.layers.Concatenate()([features, personal(chars)])
  model = tf.keras.Model(chars, _head(config, features))
  if config.user_embedding_dim:
    private = [personal.embedding]
  return split_model.SplitModel(model=model, private_variables=private,
                                loss_fn=classification_loss,
                                input_spec=input_spec,
                                embedding_variables=private)


def build_centralized_model(config: DocumentModelConfig,
                            num_users: int) -> tf.keras.Model:
  """The server-training form: inputs {'x', 'user'}; a user-embedding table."""
  config.validate()
  chars = tf.keras.Input(shape=(config.max_chars,), dtype=tf.int32, name='x')
  user = tf.keras.Input(shape=(), dtype=tf.int32, name='user')
  features = _text_encoder(config, chars)
  if config.user_embedding_dim:
    table = tf.keras.layers.Embedding(num_users, config.user_embedding_dim,
                                      name='user_embedding_table')
    features = tf.keras.layers.Concatenate()([features, table(user)])
  return tf.keras.Model({'x': chars, 'user': user}, _head(config, features))
