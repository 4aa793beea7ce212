"""FedDVA gives bit-identical rounds for identical inputs.

Its clients sample z and c every batch from a stateless seed per client
round, pass and batch, so one round run twice from the same state, client
states and data must give exactly the same server state, client states and
metrics, in each schedule and decoder mode, on data that reshuffle on every
iteration. (Every registered algorithm's reruns, in both of its forms, are
checked by `conformance_test`, which builds each one already.)
"""

import collections

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tests import fedembed_testdata
from tff_personal.algorithms import feddva
from tff_personal.models import feddva as feddva_lib
from tff_personal.models import feddva_losses
from tff_personal.models import feddva_recipes
from tff_personal.models import feddva_training


_flat = fedembed_testdata.flat


def _datasets(num=3, n=6):
  rng = np.random.default_rng(11)
  out = []
  for i in range(num):
    y = (np.arange(n) % 2).astype(np.int32)
    out.append(tf.data.Dataset.from_tensor_slices(collections.OrderedDict(
        x=rng.random((n, 28, 28, 1), dtype=np.float32), y=y,
        type=np.where(y == 1, i % 3, (i + 1) % 3).astype(np.int32))).shuffle(
            n, seed=7, reshuffle_each_iteration=True).repeat(2).batch(2))
  return out


_FEDDVA = feddva_lib.FeddvaConfig(z_dim=2, c_dim=2, channels=(2, 2, 2, 3),
                                  hidden=5)


@pytest.mark.parametrize('schedule, decoder', [
    ('paper', 'private'), ('reference', 'private'), ('paper', 'shared'),
    ('authors', 'private')])
def test_feddva_round_twice_is_bit_identical(schedule, decoder):
  """FedDVA samples z and c every batch: its noise is seeded too."""
  # The authors' schedule runs with the rest of their recipe, resampled.
  authors = feddva_recipes.recipe('authors')
  extra = (dict(resamples=2) if schedule == 'authors' else {})
  proc = feddva.build_feddva(
      _FEDDVA, authors.loss if schedule == 'authors' else
      feddva_losses.LossConfig(), **extra,
      schedule=schedule, decoder=decoder, seed=4,
      decoder_optimizer=tff.learning.optimizers.build_adam(1e-2),
      encoder_optimizer=tff.learning.optimizers.build_adam(1e-2))
  _, decoder0 = feddva.initial_weights(_FEDDVA, seed=4)
  states = [feddva.initial_client_state(
      () if decoder == 'shared' else decoder0) for _ in range(3)]
  state = proc.initialize()
  data = lambda: [d.map(lambda b: collections.OrderedDict(x=b['x'],
                                                          y=b['y']))
                  for d in _datasets()]
  first = proc.next(state, states, data())
  second = proc.next(state, states, data())
  for i, (x, y) in enumerate(zip(_flat(first), _flat(second))):
    np.testing.assert_array_equal(x, y, err_msg=f'leaf {i}')
  moved = [not np.array_equal(x, y) for x, y in zip(
      _flat(first[0].global_model_weights.trainable),
      _flat(state.global_model_weights.trainable))]
  assert any(moved)


def _images(order, n=6, seed=3):
  rng = np.random.default_rng(seed)
  x = rng.integers(0, 256, (n, 28, 28, 1)).astype(np.float32) / 255.0
  return tf.data.Dataset.from_tensor_slices(collections.OrderedDict(
      x=x[order], y=np.zeros(n, np.int32))).batch(2)


def test_feddva_client_seed_ignores_order_but_not_data_or_round():
  seed = lambda rounds, data, base=0: feddva_training.client_seed(
      base, rounds, data).numpy().tolist()
  forward, backward = _images(np.arange(6)), _images(np.arange(6)[::-1])
  assert seed(0, forward) == seed(0, backward)
  assert seed(0, forward) != seed(1, forward)
  assert seed(0, forward) != seed(0, _images(np.arange(6), seed=4))
  assert seed(0, forward) != seed(0, forward, base=1)
