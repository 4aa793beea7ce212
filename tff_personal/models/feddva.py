"""FedDVA's networks (appendix G) and the classifiers built on them.

* `encoder_z` f(x) -> q(z|x): a 4-layer CNN backbone and two fully connected
  embedding layers (a hidden layer, then one layer giving the mean and the
  log-variance; our reading of "two FC embedding layers").
* `encoder_c` h(x, z) -> q(c|x, z): first an FC layer on [flatten(x); z]
  giving a 28x28 map (the "embedding of [x; z]"), then the same kind of
  backbone and two FC layers.
* `decoder` p_k(x|z, c): the reverse: FC layers on [z; c] to a 7x7 map, then
  four (transposed) convolutions to 28x28 Bernoulli logits.

Backbone: conv 3x3 stride 1, conv stride 2 (14x14), conv stride 2 (7x7),
conv stride 1, ReLU after each; channel counts and the FC width are
`FeddvaConfig` fields (flags of the paper module), so the appendix's sizes can
be scaled to the CPU. Log-variances are soft-clipped to (-`LOGVAR_LIMIT`,
`LOGVAR_LIMIT`) with a scaled tanh (keeps the closed-form KLs finite; the
paper does not say how it bounds them).

Variables: the two encoders are shared (FedAvg), the decoder is the client's
private state. The classifiers for the personalized-classification
experiment (paper Figures 6, 7):

* `build_cnn_classifier`: the CNN baseline of appendix G (the same 4-layer
  backbone and a 2-FC classification head), trained end to end by FedAvg,
  FedAvg+FT and Ditto.
* `build_feddva_classifier`: the two encoders (loadable from a FedDVA model)
  and a 2-FC head on [mu_z; mu_c], tuned together federatedly.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Sequence

import tensorflow as tf

from tff_personal.core import split_model as split_model_lib
from tff_personal.models import feddva_losses

IMAGE_SHAPE = (28, 28, 1)
NUM_CLASSES = 10
LOGVAR_LIMIT = 8.0


@dataclasses.dataclass(frozen=True)
class FeddvaConfig:
  """Sizes (appendix G/H; defaults scaled to a 2-core CPU)."""
  z_dim: int = 4
  c_dim: int = 4
  channels: Sequence[int] = (32, 32, 64, 64)
  hidden: int = 256

  def __post_init__(self):
    object.__setattr__(self, 'channels', tuple(int(c) for c in self.channels))
    if self.z_dim < 1 or self.c_dim < 1:
      raise ValueError(f'z_dim and c_dim must be >= 1, got {self.z_dim}, '
                       f'{self.c_dim}')
    if len(self.channels) != 4 or min(self.channels) < 1:
      raise ValueError(f'channels must be 4 positive ints (the 4-layer '
                       f'backbone), got {self.channels}')
    if self.hidden < 1:
      raise ValueError(f'hidden must be >= 1, got {self.hidden}')


def _backbone(channels, name):
  c = channels
  return [
      tf.keras.layers.Conv2D(c[0], 3, 1, 'same', activation='relu',
                             name=f'{name}_conv1'),
      tf.keras.layers.Conv2D(c[1], 3, 2, 'same', activation='relu',
                             name=f'{name}_conv2'),
      tf.keras.layers.Conv2D(c[2], 3, 2, 'same', activation='relu',
                             name=f'{name}_conv3'),
      tf.keras.layers.Conv2D(c[3], 3, 1, 'same', activation='relu',
                             name=f'{name}_conv4'),
      tf.keras.layers.Flatten(name=f'{name}_flatten'),
  ]


def _apply(layers, x):
  for layer in layers:
    x = layer(x)
  return x


def _gaussian_head(features, dim, hidden, name):
  h = tf.keras.layers.Dense(hidden, activation='relu', name=f'{name}_fc1')(
      features)
  out = tf.keras.layers.Dense(2 * dim, name=f'{name}_fc2')(h)
  mu, raw = tf.split(out, 2, axis=-1)
  logvar = LOGVAR_LIMIT * tf.tanh(raw / LOGVAR_LIMIT)
  return mu, logvar


def build_encoder_z(config: FeddvaConfig) -> tf.keras.Model:
  x = tf.keras.Input(IMAGE_SHAPE, name='x')
  features = _apply(_backbone(config.channels, 'fz'), x)
  mu, logvar = _gaussian_head(features, config.z_dim, config.hidden, 'fz')
  return tf.keras.Model(x, [mu, logvar], name='encoder_z')


def build_encoder_c(config: FeddvaConfig) -> tf.keras.Model:
  x = tf.keras.Input(IMAGE_SHAPE, name='x')
  z = tf.keras.Input((config.z_dim,), name='z')
  joint = tf.keras.layers.Concatenate(name='hc_xz')(
      [tf.keras.layers.Flatten(name='hc_flatten_x')(x), z])
  embedded = tf.keras.layers.Dense(28 * 28, activation='relu',
                                   name='hc_combine')(joint)
  embedded = tf.keras.layers.Reshape(IMAGE_SHAPE, name='hc_reshape')(embedded)
  features = _apply(_backbone(config.channels, 'hc'), embedded)
  mu, logvar = _gaussian_head(features, config.c_dim, config.hidden, 'hc')
  return tf.keras.Model([x, z], [mu, logvar], name='encoder_c')


def build_decoder(config: FeddvaConfig) -> tf.keras.Model:
  z = tf.keras.Input((config.z_dim,), name='z')
  c = tf.keras.Input((config.c_dim,), name='c')
  ch = config.channels
  h = tf.keras.layers.Concatenate(name='g_zc')([z, c])
  h = tf.keras.layers.Dense(config.hidden, activation='relu', name='g_fc1')(h)
  h = tf.keras.layers.Dense(7 * 7 * ch[3], activation='relu', name='g_fc2')(h)
  h = tf.keras.layers.Reshape((7, 7, ch[3]), name='g_reshape')(h)
  h = tf.keras.layers.Conv2DTranspose(ch[2], 3, 1, 'same', activation='relu',
                                      name='g_deconv1')(h)
  h = tf.keras.layers.Conv2DTranspose(ch[1], 3, 2, 'same', activation='relu',
                                      name='g_deconv2')(h)  # 14x14
  h = tf.keras.layers.Conv2DTranspose(ch[0], 3, 2, 'same', activation='relu',
                                      name='g_deconv3')(h)  # 28x28
  logits = tf.keras.layers.Conv2D(1, 3, 1, 'same', name='g_out')(h)
  return tf.keras.Model([z, c], logits, name='decoder')


class FeddvaModel:
  """The dual encoders and a decoder; shared = encoders, private = decoder."""

  def __init__(self, config: FeddvaConfig):
    self.config = config
    self.encoder_z = build_encoder_z(config)
    self.encoder_c = build_encoder_c(config)
    self.decoder = build_decoder(config)

  @property
  def shared_variables(self) -> list[tf.Variable]:
    return (self.encoder_z.trainable_variables
            + self.encoder_c.trainable_variables)

  @property
  def decoder_variables(self) -> list[tf.Variable]:
    return self.decoder.trainable_variables

  def encode(self, x, training: bool = False):
    """Posterior parameters: (mu_z, logvar_z, mu_c, logvar_c), c given mu_z."""
    mu_z, logvar_z = self.encoder_z(x, training=training)
    mu_c, logvar_c = self.encoder_c([x, mu_z], training=training)
    return mu_z, logvar_z, mu_c, logvar_c

  def forward(self, x, eps_z=None, eps_c=None, training: bool = True,
              c_from_prior: bool = False, stop_z: bool = False, seed=None):
    """One reparameterised sample: z ~ q(z|x), c ~ q(c|x, z), logits of x.

    `eps_z`, `eps_c` (standard normal noise) default to draws from `seed`
    (a shape-[2] integer tensor: `tf.random.stateless_normal`, so equal
    seeds give equal draws; the training loop passes one per batch), or to
    fresh stateful draws when `seed` is None. `c_from_prior=True`
    does not run the c-encoder: c = eps_c ~ N(0, I), reported as mu_c = 0,
    logvar_c = 0 (so R_c is the constant xi and gives no gradient);
    `stop_z=True` stops the gradient at z (into the c-encoder and the
    decoder). Both serve the 'reference' schedule of `feddva_training`.
    """
    n = tf.shape(x)[0]
    seed_z = seed_c = None
    if seed is not None:
      seed_z, seed_c = tf.unstack(tf.random.experimental.stateless_split(
          seed, num=2))
    mu_z, logvar_z = self.encoder_z(x, training=training)
    if eps_z is None:
      eps_z = _normal([n, self.config.z_dim], seed_z)
    z = mu_z + tf.exp(0.5 * logvar_z) * eps_z
    if stop_z:
      z = tf.stop_gradient(z)
    if c_from_prior:
      mu_c = tf.zeros([n, self.config.c_dim])
      logvar_c = tf.zeros([n, self.config.c_dim])
    else:
      mu_c, logvar_c = self.encoder_c([x, z], training=training)
    if eps_c is None:
      eps_c = _normal([n, self.config.c_dim], seed_c)
    c = mu_c + tf.exp(0.5 * logvar_c) * eps_c
    logits = self.decoder([z, c], training=training)
    return collections.OrderedDict(
        logits=logits, z=z, c=c, mu_z=mu_z, logvar_z=logvar_z, mu_c=mu_c,
        logvar_c=logvar_c)

  def loss(self, x, loss_config: feddva_losses.LossConfig, eps_z=None,
           eps_c=None, c_from_prior: bool = False, stop_z: bool = False,
           seed=None):
    outputs = self.forward(x, eps_z, eps_c, c_from_prior=c_from_prior,
                           stop_z=stop_z, seed=seed)
    return feddva_losses.feddva_loss(x, outputs, loss_config,
                                     self.config.c_dim)

  def decode_mean(self, z, c, reconstruction: str = 'bernoulli'):
    """The decoded image of p_k(x | z, c): the pixel means (sigmoid of the
    logits) or, for the authors' `reconstruction='focal'`, tanh of them."""
    return feddva_losses.decoder_mean(self.decoder([z, c], training=False),
                                      reconstruction)


def _normal(shape, seed):
  if seed is None:
    return tf.random.normal(shape)
  return tf.random.stateless_normal(shape, seed)


def classification_input_spec():
  return collections.OrderedDict(
      x=tf.TensorSpec([None, *IMAGE_SHAPE], tf.float32),
      y=tf.TensorSpec([None], tf.int32))


def _classification_loss(batch, logits):
  return tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
      batch['y'], logits, from_logits=True))


def _classification_head(features, hidden, num_classes,
                         output_name='head_fc2'):
  h = tf.keras.layers.Dense(hidden, activation='relu', name='head_fc1')(
      features)
  return tf.keras.layers.Dense(num_classes, name=output_name)(h)


def build_cnn_classifier(config: FeddvaConfig,
                         num_classes: int = NUM_CLASSES,
                         output_name: str = 'head_fc2'
                         ) -> split_model_lib.SplitModel:
  """Appendix G's CNN: the 4-layer backbone and a 2-FC head; all shared.

  `output_name` names the last layer (e.g. 'head', the personal head that
  FedRep and pFedMe look for).
  """
  x = tf.keras.Input(IMAGE_SHAPE, name='x')
  features = _apply(_backbone(config.channels, 'cnn'), x)
  logits = _classification_head(features, config.hidden, num_classes,
                                output_name)
  model = tf.keras.Model(x, logits, name='cnn_classifier')
  return split_model_lib.SplitModel(
      model=model, private_variables=[], loss_fn=_classification_loss,
      input_spec=classification_input_spec())


def build_feddva_classifier(config: FeddvaConfig,
                            num_classes: int = NUM_CLASSES
                            ) -> split_model_lib.SplitModel:
  """FedDVA's encoders and a 2-FC head on [mu_z; mu_c]; all shared.

  The trainable variables are ordered encoder_z's, encoder_c's, then the
  head's, so `FeddvaModel.shared_variables` values load into the first ones
  (`load_encoders`). The head reads the posterior means (no sampling).
  """
  x = tf.keras.Input(IMAGE_SHAPE, name='x')
  encoder_z = build_encoder_z(config)
  encoder_c = build_encoder_c(config)
  mu_z, _ = encoder_z(x)
  mu_c, _ = encoder_c([x, mu_z])
  features = tf.keras.layers.Concatenate(name='zc')([mu_z, mu_c])
  logits = _classification_head(features, config.hidden, num_classes)
  model = tf.keras.Model(x, logits, name='feddva_classifier')
  expected = encoder_z.trainable_variables + encoder_c.trainable_variables
  got = model.trainable_variables[:len(expected)]
  if [v.ref() for v in got] != [v.ref() for v in expected]:
    raise AssertionError('feddva classifier: encoder variables are not first')
  return split_model_lib.SplitModel(
      model=model, private_variables=[], loss_fn=_classification_loss,
      input_spec=classification_input_spec())


def load_encoders(classifier_trainable: Sequence, feddva_shared: Sequence
                  ) -> tuple:
  """The classifier's trainable weights with the encoders from a FedDVA model."""
  n = len(feddva_shared)
  for i, (a, b) in enumerate(zip(classifier_trainable[:n], feddva_shared)):
    if tuple(a.shape) != tuple(b.shape):
      raise ValueError(f'encoder weight {i}: classifier shape {a.shape} != '
                       f'FedDVA shape {b.shape}; build both from one config')
  return tuple(feddva_shared) + tuple(classifier_trainable[n:])
