"""Synthetic FedEmbed clients shared by the FedEmbed algorithm tests."""

import collections
import dataclasses

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_personal.models import fedembed as fedembed_model
from tff_personal.models import fedembed_mnist

SPEC = collections.OrderedDict(
    x=tf.TensorSpec([None, 28, 28, 1], tf.float32),
    y=tf.TensorSpec([None], tf.int32),
    type=tf.TensorSpec([None], tf.int32))


def with_k(config, k=10):
  """`config` with K = `k` where the builder left it to the task (None)."""
  if config.num_subpopulations is not None:
    return config
  return dataclasses.replace(config, num_subpopulations=k)


def factory(config):
  return lambda: fedembed_model.build_fedembed_model(with_k(config),
                                                     input_spec=SPEC)


# `tiny_encoder`'s feature count and trainable tensors (kernel, bias).
TINY_FEATURES = 16
TINY_ENCODER_TENSORS = 2


def tiny_encoder(channels: int) -> tf.keras.Model:
  """A small encoder of 28 x 28 x `channels` images (16 features): one
  7 x 7 convolution of stride 7 and a ReLU. For tests of an algorithm's
  wiring, where the paper's CNN only costs building and tracing time."""
  return tf.keras.Sequential([
      tf.keras.layers.InputLayer(input_shape=(28, 28, channels)),
      tf.keras.layers.Conv2D(1, 7, strides=7, activation='relu'),
      tf.keras.layers.Flatten(),
  ], name='encoder')


def tiny_factory(config):
  """`factory` with `tiny_encoder`."""
  return lambda: fedembed_model.build_fedembed_model(
      with_k(config), encoder_fn=tiny_encoder, input_spec=SPEC)


def tiny_preference_factory(dim):
  """`embedding_dim -> model_fn` of the MNIST preference model (Global,
  Global+) with `tiny_encoder`."""
  return lambda: fedembed_mnist.build_preference_model(
      dim, input_spec=SPEC, encoder_fn=tiny_encoder)


def datasets(types_of_positives, seed=0, n=20, other=None):
  """Clients whose positives all have the given type (negatives: `other`,
  by default the next type); random images, two batches of n / 2."""
  rng = np.random.default_rng(seed)
  out = []
  for t in types_of_positives:
    y = np.tile([1, 0], n // 2).astype(np.int32)
    neg = other if other is not None else (t + 1) % 10
    out.append(tf.data.Dataset.from_tensor_slices(collections.OrderedDict(
        x=rng.random((n, 28, 28, 1), dtype=np.float32), y=y,
        type=np.where(y == 1, t, neg).astype(np.int32))).batch(n // 2))
  return out


def initial_states(proc, num, seed=0):
  """`num` client states of `proc`'s type: small random floats, zero ints."""
  specs = tff.types.type_to_tf_tensor_specs(proc.client_state_type)
  rng = np.random.default_rng(seed)

  def init(spec):
    if spec.dtype.is_floating:
      return (0.1 * rng.normal(size=spec.shape)).astype(
          spec.dtype.as_numpy_dtype)
    return np.zeros(spec.shape, spec.dtype.as_numpy_dtype)

  return [tf.nest.map_structure(init, specs) for _ in range(num)]


def flat(value) -> list:
  """The leaves of a round's output (a TFF `Struct` or nested Python
  containers) as numpy arrays, in order: for comparing rounds leaf by leaf."""
  return [np.asarray(v) for v in tf.nest.flatten(
      tff.structure.to_odict_or_tuple(value, recursive=True)
      if isinstance(value, tff.structure.Struct) else value)]
