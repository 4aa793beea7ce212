"""Tiny MNIST-shaped clients and the task model of the personalization
methods' tests (FedPer, LG-FedAvg, FedBABU, Per-FedAvg, APFL, HypCluster,
kNN-Per)."""

import collections

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tests import fedembed_testdata
from tff_personal.core import process as process_lib
from tff_personal.models import fedembed_mnist

SPEC = collections.OrderedDict(
    x=tf.TensorSpec([None, 28, 28, 1], tf.float32),
    y=tf.TensorSpec([None], tf.int32))


def model_fn_factory(dim):
  # The paper's model with a small encoder: the tests are of the methods.
  return lambda: fedembed_mnist.build_preference_model(
      dim, input_spec=SPEC, encoder_fn=fedembed_testdata.tiny_encoder)


def sgd(lr):
  return tff.learning.optimizers.build_sgdm(lr)


def datasets(num, seed=0, n=6, flip=(), batch=3):
  """Random images; label 1 for bright-left images (flipped for the
  clients in `flip`, a second population)."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(num):
    x = rng.random((n, 28, 28, 1), dtype=np.float32) * 0.2
    kind = np.arange(n) % 2
    x[kind == 1, :, :14] += 0.8
    y = (kind if i not in flip else 1 - kind).astype(np.int32)
    out.append(tf.data.Dataset.from_tensor_slices(collections.OrderedDict(
        x=x, y=y)).batch(batch))
  return out


def states(private, num):
  """`num` client states holding `private` (numpy leaves), never trained."""
  return [collections.OrderedDict([
      (process_lib.CLIENT_STATE_PRIVATE,
       tuple(np.asarray(p) for p in private)),
      (process_lib.CLIENT_STATE_ROUNDS, np.int32(0))]) for _ in range(num)]


def run(proc, client_states, data, rounds=1):
  """`rounds` rounds of `proc` on the same clients; (state, client states)."""
  state = proc.initialize()
  for _ in range(rounds):
    state, client_states, _ = proc.next(state, client_states, data)
  return state, client_states


def assert_same(a, b, what=''):
  flat_a, flat_b = tf.nest.flatten(a), tf.nest.flatten(b)
  assert len(flat_a) == len(flat_b), what
  for i, (x, y) in enumerate(zip(flat_a, flat_b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6,
                               atol=1e-7, err_msg=f'{what}: leaf {i}')
