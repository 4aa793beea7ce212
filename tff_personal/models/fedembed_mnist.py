"""FedEmbed's MNIST preference models (FedEmbed paper, Appendix B.1).

The paper gives the architecture in the PyTorch API:

    global_encoder = Sequential(
        Conv2d(2, 16, 3, stride=2, padding=1), LayerNorm([16, 14, 14]),
        Conv2d(16, 32, 3, stride=2, padding=1), LayerNorm([32, 7, 7]),
        Conv2d(32, 64, 7, stride=1, padding=0), LayerNorm([64, 1, 1]))
    global_prediction_head = Linear(92, 2)   # 92 = 64 features + 28 embedding

Readings (where the appendix is silent or ambiguous):
* Activations: none are listed; without them the encoder is affine. We put a
  ReLU after the first two LayerNorms (flag `activation`, 'linear' gives the
  literal reading).
* PyTorch's symmetric `padding=1` is reproduced with `ZeroPadding2D(1)` and a
  'valid' convolution (Keras 'same' pads asymmetrically for stride 2).
* `LayerNorm([C, H, W])` normalises over all of C, H, W with an element-wise
  affine of that shape: `LayerNormalization(axis=[1, 2, 3])`.
* The personal embedding e_u (size 28) enters twice (paper section 4,
  "concatenated both to the input data and to the intermediate
  representations"): as a second input channel `diag(e_u)` (a 28 x 28 matrix
  with e_u on its diagonal) and concatenated to the 64 encoder features.
* Without a personal embedding (Global), the input has one channel and the
  head sees the 64 features only.
"""

from __future__ import annotations

import tensorflow as tf

from tff_personal.core import split_model

IMAGE_SHAPE = (28, 28, 1)
DEFAULT_EMBEDDING_DIM = 28


class PersonalEmbedding(tf.keras.layers.Layer):
  """A single trainable vector shared by every example of one client.

  Its variable is the client's private state: it is loaded from the client
  state store before local training and written back after, and never sent.
  """

  def __init__(self, dim: int, initializer='zeros', **kwargs):
    super().__init__(**kwargs)
    self.dim = dim
    self.initializer = tf.keras.initializers.get(initializer)

  def build(self, input_shape):
    self.embedding = self.add_weight(
        name='personal_embedding', shape=(self.dim,),
        initializer=self.initializer, trainable=True)
    super().build(input_shape)

  def call(self, x):
    batch = tf.shape(x)[0]
    return tf.tile(self.embedding[tf.newaxis, :], [batch, 1])


def _diag_channel(embedding_batch):
  # [b, d] -> [b, d, d, 1] with the embedding on the diagonal.
  return tf.linalg.diag(embedding_batch)[..., tf.newaxis]


def build_encoder(activation: str = 'relu', channels: int = 1,
                  name: str = 'encoder') -> tf.keras.Sequential:
  act = tf.keras.layers.Activation(activation)
  return tf.keras.Sequential([
      tf.keras.layers.InputLayer(input_shape=(28, 28, channels)),
      tf.keras.layers.ZeroPadding2D(1),
      tf.keras.layers.Conv2D(16, 3, strides=2, padding='valid'),
      tf.keras.layers.LayerNormalization(axis=[1, 2, 3]),
      act,
      tf.keras.layers.ZeroPadding2D(1),
      tf.keras.layers.Conv2D(32, 3, strides=2, padding='valid'),
      tf.keras.layers.LayerNormalization(axis=[1, 2, 3]),
      tf.keras.layers.Activation(activation),
      tf.keras.layers.Conv2D(64, 7, strides=1, padding='valid'),
      tf.keras.layers.LayerNormalization(axis=[1, 2, 3]),
      tf.keras.layers.Flatten(),
  ], name=name)


def preference_loss(batch, logits):
  return tf.reduce_mean(
      tf.keras.losses.sparse_categorical_crossentropy(
          batch['y'], logits, from_logits=True))


def build_preference_model(embedding_dim: int = DEFAULT_EMBEDDING_DIM,
                           activation: str = 'relu',
                           input_spec=None,
                           encoder_fn=None) -> split_model.SplitModel:
  """Global (embedding_dim=0) or Global+ (embedding_dim>0) preference model.

  Args:
    embedding_dim: size of the private personal embedding; 0 for none. When
      positive it must be 28 (the image side), since it forms a diagonal input
      channel.
    activation: activation after the first two LayerNorms.
    input_spec: the element spec of client datasets (for the SplitModel).
    encoder_fn: `channels -> Keras encoder` of 28 x 28 x channels images to
      a flat feature vector, in place of the paper's (`build_encoder` with
      `activation`), as `fedembed.build_fedembed_model` takes it.

  Returns:
    A `SplitModel` whose output is a [batch, 2] logit tensor and whose only
    private variable is the personal embedding (none for embedding_dim=0).
  """
  if embedding_dim not in (0, IMAGE_SHAPE[0]):
    raise ValueError(
        f'embedding_dim must be 0 or {IMAGE_SHAPE[0]} for the MNIST model '
        f'(it forms a diagonal image channel); got {embedding_dim}')
  if encoder_fn is None:
    encoder_fn = lambda channels: build_encoder(activation, channels=channels)
  x = tf.keras.Input(shape=IMAGE_SHAPE, name='x')
  private = []
  if embedding_dim:
    personal = PersonalEmbedding(embedding_dim, name='personal')
    e = personal(x)
    encoder = encoder_fn(2)
    features = encoder(
        tf.keras.layers.Concatenate(axis=-1)([x, _diag_channel(e)]))
    features = tf.keras.layers.Concatenate(axis=-1)([features, e])
  else:
    personal = None
    encoder = encoder_fn(1)
    features = encoder(x)
  logits = tf.keras.layers.Dense(2, name='head')(features)
  model = tf.keras.Model(inputs=x, outputs=logits)
  if personal is not None:
    private = [personal.embedding]
  return split_model.SplitModel(
      model=model, private_variables=private, loss_fn=preference_loss,
      input_spec=input_spec, embedding_variables=private)
