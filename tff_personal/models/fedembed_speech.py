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

`encoder='spectral'` (ours, not the paper's) swaps the B.2 convolutions for a
parameter-free front end, each utterance's mean log-spectrum over its louder
frames (`MeanLoudSpectrum`), and one Dense layer: a from-scratch model with
5% of B.2's encoder weights (see `build_spectral_encoder`).
`encoder='spectrum'` (ours) keeps the front end alone, standardised per
utterance and with no weights at all: the heads, prototypes and k-way
classifier are all that is shared (and noised under DP).
"""

from __future__ import annotations

import functools
import json
import os

import numpy as np
import tensorflow as tf

from tff_personal.core import atomic_io
from tff_personal.core import split_model
from tff_personal.models import fedembed_mnist

INPUT_SHAPE = (200, 375, 1)
EMBEDDING_DIM = 200
FEATURES = 256
# The spectral encoder's output width: the MNIST encoder's 64 (Appendix B.1).
SPECTRAL_FEATURES = 64
# Encoder kinds: the Appendix B.2 convolutions, or the spectral front end.
B2 = 'b2'
SPECTRAL = 'spectral'
SPECTRUM = 'spectrum'
ENCODERS = (B2, SPECTRAL, SPECTRUM)


# Layers of the encoder with weights, in `build_encoder` order: each has a
# kernel (gamma) and a bias (beta), so an encoder has 2 * 8 weight arrays.
_WEIGHTED_LAYERS = 8
ENCODER_WEIGHTS_FORMAT = 'tff_personal.fedembed_speech.encoder/1'


def build_encoder(activation: str = 'relu', channels: int = 1,
                  name: str = 'encoder', weights=None,
                  trainable: bool = True) -> tf.keras.Sequential:
  """The Appendix B.2 encoder for a (200, 375, channels) input -> 256.

  Args:
    activation: Activation after the convolutions' LayerNorms.
    channels: Input channels (1: spectrogram; 2: and the embedding channel).
    name: The Keras name.
    weights: None (Keras' initialisers) or the 16 arrays of an encoder in
      `encoder.get_weights()` order (`load_encoder_weights`), made the
      variables' initial values (initialisers, so that TFF's `initialize`
      and every `model_fn()` start from them). A first-convolution kernel
      with more input channels than `channels` is cut to its first
      `channels` (a 2-channel pre-trained encoder for the 1-channel Global
      model: the embedding channel's kernel was never trained, its input
      being zero in pre-training).
    trainable: False freezes the encoder: its variables are non-trainable,
      so a federated process broadcasts them and never trains, sends or
      noises them (only the heads, prototypes and personal state learn).

  Returns:
    The encoder (a `tf.keras.Sequential`).
  """
  if weights is not None:
    weights = _check_weights(weights, channels)
  init = iter(weights or ())
  def kw(first='kernel_initializer', second='bias_initializer'):
    if weights is None:
      return {}
    return {first: tf.keras.initializers.Constant(next(init)),
            second: tf.keras.initializers.Constant(next(init))}
  ln = lambda **k: tf.keras.layers.LayerNormalization(
      **k, **kw('gamma_initializer', 'beta_initializer'))
  encoder = tf.keras.Sequential([
      tf.keras.layers.InputLayer(input_shape=(*INPUT_SHAPE[:2], channels)),
      tf.keras.layers.ZeroPadding2D(1),
      tf.keras.layers.Conv2D(16, (3, 5), strides=(2, 3), padding='valid',
                             **kw()),
      tf.keras.layers.AveragePooling2D((2, 3)),
      ln(axis=[1, 2, 3], name='ln1'),
      tf.keras.layers.Activation(activation),
      tf.keras.layers.Conv2D(32, (5, 5), strides=(2, 2), padding='valid',
                             **kw()),
      tf.keras.layers.AveragePooling2D((3, 3)),
      ln(axis=[1, 2, 3], name='ln2'),
      tf.keras.layers.Activation(activation),
      tf.keras.layers.Conv2D(64, (3, 2), strides=(2, 2), padding='valid',
                             **kw()),
      ln(axis=[1, 2, 3], name='ln3'),
      tf.keras.layers.Activation(activation),
      tf.keras.layers.Flatten(name='flatten'),
      tf.keras.layers.Dense(FEATURES, **kw()),
      ln(name='ln4'),
  ], name=name)
  encoder.trainable = trainable
  return encoder


class MeanLoudSpectrum(tf.keras.layers.Layer):
  """[b, 200, 375, c] -> [b, 200]: channel 0's mean spectrum over loud frames.

  The TF form of `tasks.speech_spectrogram.mean_loud_spectrum` (tested equal
  on the model's [0, 1] input): each example's mean over the frames whose
  mean level over the bins is strictly above the example's median frame
  level (np.median's median: the middle value, or the mean of the two middle
  values for an even count); an example whose frames are all equally loud
  keeps all of them. Other channels (the personal-embedding diagonal) are
  ignored. A frame whose level is within float round-off of the median may
  fall on the other side than in NumPy (the sums' order differs); speech
  frames are not that close. No weights; written by hand because neither Keras nor tf.signal
  has a median-gated average.
  """

  def call(self, x):
    spectrum = x[..., 0]  # [b, bins, frames]
    level = tf.reduce_mean(spectrum, axis=1)  # [b, frames]
    # The frame count may be static or not; for an odd count both middle
    # indices are the same frame and 0.5 * (a + a) is a exactly.
    n = tf.shape(level)[-1]
    ordered = tf.sort(level, axis=-1)
    median = 0.5 * (tf.gather(ordered, (n - 1) // 2, axis=-1)
                    + tf.gather(ordered, n // 2, axis=-1))
    loud = tf.cast(level > median[:, tf.newaxis], x.dtype)
    count = tf.reduce_sum(loud, axis=-1, keepdims=True)
    loud = tf.where(count > 0, loud, tf.ones_like(loud))
    return (tf.einsum('nbf,nf->nb', spectrum, loud)
            / tf.reduce_sum(loud, axis=-1, keepdims=True))


def build_spectral_encoder(channels: int = 1, name: str = 'encoder',
                           features: int | None = SPECTRAL_FEATURES,
                           trainable: bool = True) -> tf.keras.Sequential:
  """A small from-scratch encoder (ours): mean loud spectrum -> Dense -> LN.

  Why: under user-level DP the noise on each round's mean update has a norm
  that grows with the square root of the number of noised parameters, while
  900 users' signal does not (README, "Speaker preferences"). The B.2
  encoder has 243k parameters; this one has 200 x `features` + 3 x
  `features` (12,992 at 64), with no public data: its front end is fixed
  signal processing (`MeanLoudSpectrum`, the feature of the local
  logistic-regression reference, row `local_spectrum`). As in B.2 the
  last layer is a LayerNorm with no activation after it; unlike B.2 the
  personal embedding reaches the heads only through the concatenation
  (the embedding channel is ignored). `features` defaults to the MNIST
  encoder's 64 outputs, so a head sees 64 + 200 inputs.

  With `features=None` (encoder 'spectrum') there is no Dense layer: the
  200-bin spectrum, standardised per utterance (a LayerNorm without scale
  or offset), is the feature vector, and the encoder has no weights, so
  nothing about the features is learned or noised; the heads see 200 + 200
  inputs.

  Args:
    channels: Input channels (1, or 2 with the embedding channel).
    name: The Keras name.
    features: Output width, or None for the standardised spectrum itself.
    trainable: False freezes it (only the Dense and LayerNorm have weights).

  Returns:
    The encoder (a `tf.keras.Sequential`).
  """
  if features is not None and features <= 0:
    raise ValueError(f'features must be positive or None, got {features}')
  layers = [tf.keras.layers.InputLayer(input_shape=(*INPUT_SHAPE[:2],
                                                    channels)),
            MeanLoudSpectrum(name='mean_loud_spectrum')]
  if features is None:
    layers.append(tf.keras.layers.LayerNormalization(center=False,
                                                     scale=False, name='ln'))
  else:
    layers += [tf.keras.layers.Dense(features, name='dense'),
               tf.keras.layers.LayerNormalization(name='ln')]
  encoder = tf.keras.Sequential(layers, name=name)
  encoder.trainable = trainable
  return encoder


def check_encoder(encoder: str, encoder_weights=None) -> None:
  """A ValueError naming the problem for an unknown encoder kind, or
  pre-trained weights (B.2's) with the spectral encoder."""
  if encoder not in ENCODERS:
    raise ValueError(f'speech encoder must be one of {ENCODERS}, got '
                     f'{encoder!r}')
  if encoder != B2 and encoder_weights is not None:
    raise ValueError('pre-trained encoder weights are Appendix B.2 '
                     f'convolutions; the {encoder} encoder has none to load '
                     '(drop --encoder_weights or use --speech_encoder=b2)')


def _encoder_fn(encoder: str, activation: str, encoder_weights,
                train_encoder: bool):
  """`channels -> Keras encoder` for `encoder` (checked)."""
  check_encoder(encoder, encoder_weights)
  if encoder in (SPECTRAL, SPECTRUM):
    features = SPECTRAL_FEATURES if encoder == SPECTRAL else None
    return lambda channels: build_spectral_encoder(
        channels, features=features, trainable=train_encoder)
  return lambda channels: build_encoder(activation, channels=channels,
                                        weights=encoder_weights,
                                        trainable=train_encoder)


@functools.lru_cache(maxsize=None)
def _encoder_shapes(channels: int) -> tuple[tuple[int, ...], ...]:
  """The weight shapes of a `channels` encoder (built once per count)."""
  with tf.init_scope():
    return tuple(tuple(w.shape) for w in
                 build_encoder('relu', channels, name='shapes').weights)


def _check_weights(weights, channels: int) -> list:
  """The arrays for a `channels` encoder, or a ValueError naming the problem."""
  weights = list(weights)
  if len(weights) != 2 * _WEIGHTED_LAYERS:
    raise ValueError(f'an encoder has {2 * _WEIGHTED_LAYERS} weight arrays, '
                     f'got {len(weights)}')
  kernel = weights[0]
  if kernel.ndim == 4 and kernel.shape[2] > channels:
    weights[0] = kernel[:, :, :channels, :]
  for i, (w, shape) in enumerate(zip(weights, _encoder_shapes(channels))):
    if tuple(w.shape) != shape:
      raise ValueError(f'encoder weight {i} has shape {tuple(w.shape)}, the '
                       f'{channels}-channel Appendix B.2 encoder needs {shape}')
  return weights


def save_encoder_weights(path: str, encoder: tf.keras.Model,
                         metadata: dict) -> None:
  """Writes an encoder's weights and `metadata` (JSON-able) to an .npz file.

  Atomically (`atomic_io.atomic_write`): a reader never sees a partial file.
  """
  arrays = {f'w{i:02d}': w for i, w in enumerate(encoder.get_weights())}
  with atomic_io.atomic_write(path, 'wb') as fh:
    np.savez(fh, format=np.asarray(ENCODER_WEIGHTS_FORMAT),
             metadata=np.asarray(json.dumps(metadata)), **arrays)


def load_encoder_weights(path: str) -> tuple[list[np.ndarray], dict]:
  """(weights in `get_weights()` order, metadata) of `save_encoder_weights`.

  Raises:
    ValueError: No such file, or not an encoder file (named in the message).
  """
  if not os.path.isfile(path):
    raise ValueError(
        f'encoder weights {path!r} not found; make them with `python -m '
        'binaries.pretrain_speech_encoder --data_dir=<public set> '
        f'--output={path}`')
  with np.load(path) as z:
    if 'format' not in z or str(z['format']) != ENCODER_WEIGHTS_FORMAT:
      raise ValueError(f'{path} is not a speech-encoder weights file (format '
                       f'{ENCODER_WEIGHTS_FORMAT!r} expected)')
    weights = [z[f'w{i:02d}'] for i in range(2 * _WEIGHTED_LAYERS)
               if f'w{i:02d}' in z]
    metadata = json.loads(str(z['metadata']))
  if not weights or weights[0].ndim != 4:
    raise ValueError(f'{path} holds no encoder weights (first convolution '
                     'kernel missing)')
  _check_weights(weights, weights[0].shape[2])
  return weights, metadata


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
                           input_spec=None, encoder_weights=None,
                           train_encoder: bool = True,
                           encoder: str = B2) -> split_model.SplitModel:
  """Global (embedding_dim=0) or Global+ (embedding_dim=200) speech model.

  Args:
    embedding_dim: Size of the private personal embedding: 0 or 200.
    activation: Activation after the convolutions' LayerNorms.
    input_spec: The element spec of client datasets.
    encoder_weights: None or a pre-trained encoder's weights
      (`build_encoder`'s `weights`).
    train_encoder: False freezes the encoder (`build_encoder`'s `trainable`).
    encoder: `B2` (the paper's), `SPECTRAL` or `SPECTRUM`
      (`build_spectral_encoder` with 64 features or none).

  Returns:
    A `SplitModel` with [batch, 2] logits whose only private variable is the
    personal embedding (none for embedding_dim=0).
  """
  check_embedding_dim(embedding_dim)
  encoder_fn = _encoder_fn(encoder, activation, encoder_weights, train_encoder)
  x = tf.keras.Input(shape=INPUT_SHAPE, name='x')
  private = []
  if embedding_dim:
    personal = fedembed_mnist.PersonalEmbedding(embedding_dim, name='personal')
    e = personal(x)
    features = encoder_fn(2)(
        tf.keras.layers.Concatenate(axis=-1)([x, embedding_channel(e)]))
    features = tf.keras.layers.Concatenate(axis=-1)([features, e])
    private = [personal.embedding]
  else:
    features = encoder_fn(1)(x)
  logits = tf.keras.layers.Dense(2, name='head')(features)
  return split_model.SplitModel(
      model=tf.keras.Model(inputs=x, outputs=logits),
      private_variables=private, loss_fn=fedembed_mnist.preference_loss,
      input_spec=input_spec, embedding_variables=private)


def fedembed_model_kwargs(activation: str = 'relu', encoder_weights=None,
                          train_encoder: bool = True,
                          encoder: str = B2) -> dict:
  """Keyword arguments of `fedembed.build_fedembed_model` for speech."""
  return dict(
      encoder_fn=_encoder_fn(encoder, activation, encoder_weights,
                             train_encoder),
      input_shape=INPUT_SHAPE)
