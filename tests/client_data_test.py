"""ClientBatches: the same batches as numpy and as a tf.data dataset."""

import collections

import numpy as np
import pytest
import tensorflow as tf

from tff_personal.core import client_data

SPEC = collections.OrderedDict(x=tf.TensorSpec([None, 2], tf.float32),
                               y=tf.TensorSpec([None], tf.int32))


def examples(n):
  return collections.OrderedDict(
      x=np.arange(2 * n, dtype=np.float32).reshape(n, 2),
      y=np.arange(n, dtype=np.int32))


@pytest.mark.parametrize('n,batch,epochs', [(6, 3, 1), (5, 2, 1), (5, 2, 3),
                                            (4, 8, 2)])
def test_batches_follow_each_epoch_order(n, batch, epochs):
  rng = np.random.default_rng(0)
  orders = [rng.permutation(n) for _ in range(epochs)]
  cb = client_data.ClientBatches.from_arrays(examples(n), batch, orders, SPEC)
  want_y = np.concatenate(orders)
  got_y = np.concatenate([b['y'] for b in cb.batches])
  np.testing.assert_array_equal(got_y, want_y)
  # Batches never straddle epochs: each epoch ends with its own last batch.
  per_epoch = -(-n // batch)
  assert len(cb.batches) == per_epoch * epochs
  assert cb.num_examples == n * epochs
  np.testing.assert_array_equal(
      np.concatenate([b['x'] for b in cb.batches]), examples(n)['x'][want_y])


@pytest.mark.parametrize('n,batch,epochs', [(6, 3, 1), (5, 2, 1), (5, 2, 3),
                                            (0, 2, 1)])
def test_to_dataset_yields_the_same_batches(n, batch, epochs):
  rng = np.random.default_rng(1)
  orders = [rng.permutation(n) for _ in range(epochs)]
  cb = client_data.ClientBatches.from_arrays(examples(n), batch, orders, SPEC)
  got = list(cb.to_dataset())
  assert len(got) == len(cb.batches)
  for a, b in zip(got, cb.batches):
    np.testing.assert_array_equal(a['x'].numpy(), b['x'])
    np.testing.assert_array_equal(a['y'].numpy(), b['y'])
  assert cb.to_dataset().element_spec['x'].shape.as_list() == [None, 2]


def test_bad_batch_size_is_refused():
  with pytest.raises(ValueError, match='batch_size'):
    client_data.ClientBatches.from_arrays(examples(3), 0, [np.arange(3)], SPEC)


def test_examples_are_stored_once_whatever_the_epochs():
  orders = [np.arange(5)[::-1], np.arange(5)]
  cb = client_data.ClientBatches.from_arrays(examples(5), 2, orders, SPEC)
  assert cb.examples['x'].shape == (5, 2)  # not 10 rows for two epochs
  assert [i.tolist() for i in cb.index_batches] == [
      [4, 3], [2, 1], [0], [0, 1], [2, 3], [4]]


def test_an_order_outside_the_examples_is_refused():
  with pytest.raises(ValueError, match='outside the 3 examples'):
    client_data.ClientBatches.from_arrays(examples(3), 2, [np.arange(4)], SPEC)


# A wire format: x travels as uint8 q and the model reads q / 255.
WIRE = client_data.WireFormat(
    spec=collections.OrderedDict(x=tf.TensorSpec([None, 2], tf.uint8),
                                 y=tf.TensorSpec([None], tf.int32)),
    decode=lambda b: collections.OrderedDict(
        x=tf.cast(b['x'], tf.float32) / 255.0, y=b['y']))


def test_wire_form_dataset_decodes_to_the_model_form():
  q = np.random.default_rng(2).integers(0, 256, (7, 2)).astype(np.uint8)
  y = np.arange(7, dtype=np.int32)
  orders = [np.random.default_rng(3).permutation(7) for _ in range(2)]
  wire = client_data.ClientBatches.from_arrays(
      collections.OrderedDict(x=q, y=y), 3, orders, SPEC, wire=WIRE)
  model_form = client_data.ClientBatches.from_arrays(
      collections.OrderedDict(x=q.astype(np.float32) / np.float32(255), y=y),
      3, orders, SPEC)
  assert wire.batches[0]['x'].dtype == np.uint8  # stored as the wire form
  got = list(wire.to_dataset())
  assert len(got) == len(model_form.batches) == 6
  for a, b in zip(got, model_form.batches):
    np.testing.assert_array_equal(a['x'].numpy(), b['x'])
    np.testing.assert_array_equal(a['y'].numpy(), b['y'])
  assert wire.to_dataset().element_spec['x'].dtype == tf.float32
