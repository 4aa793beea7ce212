"""FedEmbed's speech-preference models (FedEmbed paper, Appendix B.2).

The paper gives the encoder in the PyTorch API, for a 200 x 375 x 2 input
(the spectrogram and the personal-embedding channel):

    global_encoder = Sequential(
        Conv2d(2, 16, kernel=(3, 5), stride=(2, 3)), AvgPool2d((2, 3)),
        LayerNorm([16, 50, 41]),
        Conv2d(16, 32, kernel=(5, 5), stride=(2, 2)), AvgPool2d(3, 3),
        LayerNorm([32, 7, 6]),
        Conv2d(32, 64, kernel=(3, 2), stride=(2, 2)), LayerNorm([64, 3, 3]),
        Flatten(1), Linear(576, 256), LayerNorm([256]))
    global_prediction_head = Linear(92, 2)
    model_head_0 ... model_head_20 = Linear(92, 2)
    classifier_head = Linear(92, 20)

Readings (where the appendix is silent or inconsistent):
* Padding: without padding the first convolution gives 99 x 124 and the
  pooling 49 x 41, not the 50 x 41 of the LayerNorm that follows; PyTorch's
  `padding=1` on the first convolution gives exactly 50 x 41, so we pad it by
  one on every side (`ZeroPadding2D(1)` + 'valid', as for MNIST). The other
  two convolutions are unpadded (their LayerNorm shapes 32 x 7 x 6 and
  64 x 3 x 3 then hold as written; tested).
* Activations: none are listed (the encoder would stack linear maps between
  LayerNorms); as for MNIST we put a ReLU after each convolution's LayerNorm
  (`activation`, 'linear' gives the literal reading), none after the final
  LayerNorm(256).
* Head sizes: `Linear(92, 2)` and `Linear(92, 20)` are the MNIST sizes copied
  over (64 features + 28 embedding); here a head sees the 256 features plus
  the 200-dim embedding, 456 inputs.
* Number of heads: the appendix lists 21 sub-population heads
  (`model_head_0 ... model_head_20`) but a 20-way classifier, and the text has
  20 voices: we use K = the number of voices (20) for both (`FedEmbedConfig.
  num_subpopulations`, set by the task).
* The personal embedding (200 x 1) enters as the second input channel
  `I e_u` with `I` the 200 x 375 rectangular identity (e_u on the main
  diagonal of a 200 x 375 matrix; section 4's "diagonal matrix") and is
  concatenated to the 256 encoder features.
"""

from __future__ import annotations

import tensorflow as tf

from tff_personal.models import fedembed_mnist
from tff_personal.models import split_model

INPUT_SHAPE = (200, 375, 1)
EMBEDDING_DIM = 200
FEATURES = 256


def build_encoder(activation: str = 'relu', channels: int = 1,
                  name: str = 'encoder') -> tf.keras.Sequential:
  """The Appendix B.2 encoder for a (200, 375, channels) input -> 256."""
  return tf.keras.Sequential([
      tf.keras.layers.InputLayer(input_shape=(*INPUT_SHAPE[:2], channels)),
      tf.keras.layers.ZeroPadding2D(1),
      tf.keras.layers.Conv2D(16, (3, 5), strides=(2, 3), padding='valid'),
      tf.keras.layers.AveragePooling2D((2, 3)),
      tf.keras.layers.LayerNormalization(axis=[1, 2, 3], name='ln1'),
      tf.keras.layers.Activation(activation),
      tf.keras.layers.Conv2D(32, (5, 5), strides=(2, 2), padding='valid'),
      tf.keras.layers.AveragePooling2D((3, 3)),
      tf.keras.layers.LayerNormalization(axis=[1, 2, 3], name='ln2'),
      tf.keras.layers.Activation(activation),
      tf.keras.layers.Conv2D(64, (3, 2), strides=(2, 2), padding='valid'),
      tf.keras.layers.LayerNormalization(axis=[1, 2, 3], name='ln3'),
      tf.keras.layers.Activation(activation),
      tf.keras.layers.Flatten(name='flatten'),
      tf.keras.layers.Dense(FEATURES),
      tf.keras.layers.LayerNormalization(name='ln4'),
  ], name=name)


def embedding_channel(embedding_batch: tf.Tensor) -> tf.Tensor:
  """[b, 200] -> [b, 200, 375, 1]: e_u on the diagonal of a 200 x 375 map."""
  return tf.linalg.diag(embedding_batch, num_rows=INPUT_SHAPE[0],
                        num_cols=INPUT_SHAPE[1])[..., tf.newaxis]


def check_embedding_dim(embedding_dim: int) -> None:
  if embedding_dim not in (0, EMBEDDING_DIM):
    raise ValueError(
        f'embedding_dim must be 0 or {EMBEDDING_DIM} for the speech model (the '
        f'embedding is the diagonal of the {INPUT_SHAPE[0]} x {INPUT_SHAPE[1]}'
        f' spectrogram channel; Appendix B.2); got {embedding_dim}. Pass '
        f'--embedding_dim={EMBEDDING_DIM}.')


def build_preference_model(embedding_dim: int = EMBEDDING_DIM,
                           activation: str = 'relu',
                           input_spec=None) -> split_model.SplitModel:
  """Global (embedding_dim=0) or Global+ (embedding_dim=200) speech model.

  Args:
    embedding_dim: Size of the private personal embedding: 0 or 200.
    activation: Activation after the convolutions' LayerNorms.
    input_spec: The element spec of client datasets.

  Returns:
    A `SplitModel` with [batch, 2] logits whose only private variable is the
    personal embedding (none for embedding_dim=0).
  """
  check_embedding_dim(embedding_dim)
  x = tf.keras.Input(shape=INPUT_SHAPE, name='x')
  private = []
  if embedding_dim:
    personal = fedembed_mnist.PersonalEmbedding(embedding_dim, name='personal')
    e = personal(x)
    features = build_encoder(activation, channels=2)(
        tf.keras.layers.Concatenate(axis=-1)([x, embedding_channel(e)]))
    features = tf.keras.layers.Concatenate(axis=-1)([features, e])
    private = [personal.embedding]
  else:
    features = build_encoder(activation, channels=1)(x)
  logits = tf.keras.layers.Dense(2, name='head')(features)
  return split_model.SplitModel(
      model=tf.keras.Model(inputs=x, outputs=logits),
      private_variables=private, loss_fn=fedembed_mnist.preference_loss,
      input_spec=input_spec)


def fedembed_model_kwargs(activation: str = 'relu') -> dict:
  """Keyword arguments of `fedembed.build_fedembed_model` for speech."""
  return dict(
      encoder_fn=lambda channels: build_encoder(activation, channels=channels),
      input_shape=INPUT_SHAPE)
