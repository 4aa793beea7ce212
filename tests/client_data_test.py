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
