"""broadcast_map: weights broadcast (or per client), client values mapped."""

import numpy as np
import pytest
import tensorflow_federated as tff

from tff_personal.core import federated_map


@tff.tensorflow.computation(np.float32, np.float32)
def _add(weights, value):
  return weights + value


@tff.tensorflow.computation(np.float32, np.float32, np.float32)
def _scale_minus(weights, scale, offset):
  return weights * scale - offset


def test_server_weights_are_broadcast_to_every_client():
  comp = federated_map.broadcast_map(_add, np.float32,
                                     ('client_data', np.float32))
  assert str(comp.type_signature) == (
      '(<weights=float32@SERVER,client_data={float32}@CLIENTS>'
      ' -> {float32}@CLIENTS)')
  np.testing.assert_allclose(comp(10.0, [1.0, 2.0, 3.0]), [11.0, 12.0, 13.0])


def test_client_weights_are_each_clients_own():
  comp = federated_map.broadcast_map(_add, np.float32,
                                     ('client_data', np.float32),
                                     weights_placement=tff.CLIENTS)
  assert str(comp.type_signature) == (
      '(<weights={float32}@CLIENTS,client_data={float32}@CLIENTS>'
      ' -> {float32}@CLIENTS)')
  np.testing.assert_allclose(comp([10.0, 20.0, 30.0], [1.0, 2.0, 3.0]),
                             [11.0, 22.0, 33.0])


def test_client_values_keep_their_names_and_order():
  comp = federated_map.broadcast_map(
      _scale_minus, np.float32, ('scales', np.float32),
      ('offsets', np.float32))
  assert str(comp.type_signature) == (
      '(<weights=float32@SERVER,scales={float32}@CLIENTS,'
      'offsets={float32}@CLIENTS> -> {float32}@CLIENTS)')
  want = [2.0 * 1.0 - 0.5, 2.0 * 3.0 - 1.0, 2.0 * 5.0 - 0.0]
  np.testing.assert_allclose(comp(2.0, [1.0, 3.0, 5.0], [0.5, 1.0, 0.0]),
                             want)
  np.testing.assert_allclose(
      comp(offsets=[0.5, 1.0, 0.0], weights=2.0, scales=[1.0, 3.0, 5.0]),
      want)


def test_bad_arguments():
  with pytest.raises(ValueError, match='at least one client value'):
    federated_map.broadcast_map(_add, np.float32)
  with pytest.raises(ValueError, match='weights_placement'):
    federated_map.broadcast_map(_add, np.float32, ('client_data', np.float32),
                                weights_placement='server')
  with pytest.raises(ValueError, match='distinct'):
    federated_map.broadcast_map(_add, np.float32, ('weights', np.float32))
  with pytest.raises(TypeError):  # client_fn takes (float32, float32)
    federated_map.broadcast_map(_add, np.float32, ('client_data', np.int32))
