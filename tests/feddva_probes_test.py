"""FedDVA's probes, decoder effects, figures and its pre-trained model.

`models/feddva_probes.py` (what linear probes and decoder swaps read from
the latents; the figures of a trained model; what a finished run reports)
and `algorithms/feddva.py`'s reading of a run's pre-trained model.
"""

import os
import types

import numpy as np
import pytest

from tff_personal.algorithms import feddva
from tff_personal.core import process as process_lib
from tff_personal.models import feddva as feddva_lib
from tff_personal.reports import feddva_probes as probes


def test_linear_probes_find_what_is_there_and_not_what_is_not():
  rng = np.random.default_rng(0)
  n, clients = 800, 4
  client = rng.integers(0, clients, n)
  digit = rng.integers(0, 10, n)
  centers_c = rng.normal(scale=4.0, size=(clients, 3))
  centers_z = rng.normal(scale=4.0, size=(10, 6))
  reps = {'client': client, 'digit': digit,
          'c': centers_c[client] + rng.normal(size=(n, 3)) * 0.3,
          'z': centers_z[digit] + rng.normal(size=(n, 6)) * 0.3}
  out = probes.linear_probes(reps, seed=0)
  assert out['client_from_c'] > 0.95 and out['digit_from_z'] > 0.95
  assert out['client_from_z'] < out['chance_client'] + 0.1
  assert out['digit_from_c'] < 0.25
  assert 0.2 < out['chance_client'] < 0.35
  assert out['digit_from_z_within_client'] > 0.9


def test_linear_probes_without_c_leave_the_c_probes_out():
  rng = np.random.default_rng(1)
  n = 400
  digit = rng.integers(0, 10, n)
  reps = {'client': rng.integers(0, 4, n), 'digit': digit,
          'z': rng.normal(scale=4.0, size=(10, 5))[digit]
               + rng.normal(size=(n, 5)) * 0.3}
  with_c = probes.linear_probes({**reps, 'c': reps['z']}, seed=0)
  out = probes.linear_probes(reps, seed=0)
  assert not any(k.endswith('_from_c') for k in out)
  assert {k for k in with_c if not k.endswith('_from_c')} == set(out)
  # The z probes do not depend on whether c is there.
  assert all(out[k] == with_c[k] for k in out)
  assert out['digit_from_z'] > 0.95


def test_within_client_probe_reads_client_specific_digit_codes():
  """z holds the digit, but each client places the digits differently (as
  private decoders may): one linear map for all clients fails, a map fitted
  per client does not."""
  rng = np.random.default_rng(1)
  n, clients = 1600, 4
  client = rng.integers(0, clients, n)
  digit = rng.integers(0, 10, n)
  centers = rng.normal(scale=4.0, size=(10, 6))
  perms = [rng.permutation(10) for _ in range(clients)]
  z = np.stack([centers[perms[k][d]] for k, d in zip(client, digit)])
  reps = {'client': client, 'digit': digit,
          'c': rng.normal(size=(n, 3)),
          'z': z + rng.normal(size=(n, 6)) * 0.3}
  out = probes.linear_probes(reps, seed=0)
  assert out['digit_from_z'] < 0.6
  assert out['digit_from_z_within_client'] > 0.9


def test_mark_probe_reads_the_mark_angle_where_it_is_and_not_elsewhere():
  """c holds each image's mark angle (on a circle, scaled per client), z
  does not: mark_from_c near 1, mark_from_z near 0; a client without marks
  (NaN) is left out, and with no varying marks the probe is None."""
  rng = np.random.default_rng(2)
  n, clients = 1200, 4
  client = rng.integers(0, clients, n)
  angle = rng.uniform(0, 2 * np.pi, n)
  angle[client == 3] = np.nan  # Plain digits.
  circle = np.stack([np.cos(angle), np.sin(angle)], -1)
  circle[client == 3] = 0.0
  scale = rng.uniform(1, 3, size=(clients, 1, 1))[client, 0]
  c = np.concatenate([circle * scale, rng.normal(size=(n, 2))], axis=1)
  reps = {'client': client, 'digit': rng.integers(0, 10, n),
          'mark': angle, 'c': c + rng.normal(size=c.shape) * 0.05,
          'z': rng.normal(size=(n, 6))}
  out = probes.linear_probes(reps, seed=0)
  assert out['mark_from_c'] > 0.95
  assert out['mark_from_z'] < 0.05
  # Fixed marks: every angle 0 (or NaN), nothing to read.
  fixed = dict(reps, mark=np.where(client == 3, np.nan, 0.0))
  out = probes.linear_probes(fixed, seed=0)
  assert out['mark_from_c'] is None and out['mark_from_z'] is None
  # Representations of tasks without marks leave the probe out as well.
  out = probes.linear_probes({k: v for k, v in reps.items() if k != 'mark'},
                            seed=0)
  assert out['mark_from_c'] is None


def test_mark_r2_is_one_for_an_exact_map_and_negative_when_worse():
  rng = np.random.default_rng(3)
  angle = rng.uniform(0, 2 * np.pi, 200)
  exact = np.stack([np.cos(angle), np.sin(angle)], -1) @ [[2.0, 1.0],
                                                         [0.0, 3.0]]
  fit, score = np.arange(100), np.arange(100, 200)
  assert probes.mark_r2(exact, angle, fit, score) == pytest.approx(1.0)
  noise = rng.normal(size=(200, 8))
  assert probes.mark_r2(noise, angle, fit, score) < 0.1
  # Too few images to fit 8 weights and an intercept.
  assert probes.mark_r2(noise, angle, fit[:9], score) is None


def test_decoder_effects_swap_each_code_with_another_image_of_the_client():
  """The pairing is a permutation with no fixed point, and each effect is
  the mean absolute change of the decoded pixels under that swap."""
  rng = np.random.default_rng(4)
  z, c = rng.normal(size=(37, 3)), rng.normal(size=(37, 2))
  a, b = rng.normal(size=(3, 5)), rng.normal(size=(2, 5))
  calls = []

  def decode(zz, cc):
    calls.append((np.array(zz), np.array(cc)))
    return np.tanh(zz @ a) + np.tanh(cc @ b)

  out = probes.decoder_effects(decode, z, c, seed=0)
  (z0, c0), (z1, c1), (z2, c2) = calls
  np.testing.assert_allclose(z0, z)
  np.testing.assert_allclose(c0, c)
  # The swapped codes: each row another image's, every image used once.
  partner_c = [int(np.argmin(np.abs(c - row).sum(1))) for row in c1]
  partner_z = [int(np.argmin(np.abs(z - row).sum(1))) for row in z2]
  assert partner_c == partner_z
  assert sorted(partner_c) == list(range(37))
  assert all(p != i for i, p in enumerate(partner_c))
  np.testing.assert_allclose(z1, z, rtol=1e-6)
  np.testing.assert_allclose(c2, c, rtol=1e-6)
  base = np.tanh(z @ a) + np.tanh(c @ b)
  expect_c = np.mean(np.abs(np.tanh(z @ a) + np.tanh(c[partner_c] @ b)
                            - base))
  expect_z = np.mean(np.abs(np.tanh(z[partner_z] @ a) + np.tanh(c @ b)
                            - base))
  assert out['c'] == pytest.approx(expect_c, rel=1e-5)
  assert out['z'] == pytest.approx(expect_z, rel=1e-5)
  assert out['images'] == 37
  # Only the first max_images rows are used.
  assert probes.decoder_effects(decode, z, c, seed=0, max_images=5)[
      'images'] == 5


def test_decoder_effects_are_zero_for_a_code_the_decoder_cannot_read():
  """FedDVA's own decoder with the weights that read c (then z) zeroed."""
  config = feddva_lib.FeddvaConfig(z_dim=3, c_dim=2, channels=(4, 4, 4, 4),
                                   hidden=16)
  rng = np.random.default_rng(5)
  z = rng.normal(size=(20, 3)).astype(np.float32)
  c = rng.normal(size=(20, 2)).astype(np.float32)
  for blind, rows in (('c', slice(3, 5)), ('z', slice(0, 3))):
    model = feddva_lib.FeddvaModel(config)
    kernel = model.decoder.get_layer('g_fc1').kernel
    value = kernel.numpy()
    value[rows] = 0.0
    kernel.assign(value)
    out = probes.decoder_effects(model.decode_mean, z, c, seed=1)
    seen = 'z' if blind == 'c' else 'c'
    assert out[blind] == 0.0, blind
    assert out[seen] > 1e-4, seen


def test_decoder_effects_name_bad_input():
  decode = lambda zz, cc: zz
  with pytest.raises(ValueError, match='same n'):
    probes.decoder_effects(decode, np.zeros((4, 2)), np.zeros((3, 2)), 0)
  with pytest.raises(ValueError, match='shape'):
    probes.decoder_effects(decode, np.zeros(4), np.zeros((4, 2)), 0)
  with pytest.raises(ValueError, match='at least 2'):
    probes.decoder_effects(decode, np.zeros((1, 2)), np.zeros((1, 2)), 0)


_CONFIG = feddva_lib.FeddvaConfig(z_dim=3, c_dim=2, channels=(4, 4, 4, 4),
                                  hidden=16)


def _weights(seed):
  """Encoder and decoder weights of a FeddvaModel initialised from `seed`."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf.keras.utils.set_random_seed(seed)
  model = feddva_lib.FeddvaModel(_CONFIG)
  return ([v.numpy() for v in model.shared_variables],
          [v.numpy() for v in model.decoder_variables])


def _clients(n_clients=3, images=6, marks=True, seed=0):
  rng = np.random.default_rng(seed)
  return [types.SimpleNamespace(
      train_x=rng.uniform(size=(images, 28, 28, 1)).astype(np.float32),
      test_x=rng.uniform(size=(images, 28, 28, 1)).astype(np.float32),
      test_y=rng.integers(0, 10, images),
      test_mark=rng.uniform(0, 6, images) if marks and k else None)
          for k in range(n_clients)]


def test_representations_keep_each_client_s_images_and_marks_in_order():
  encoders, _ = _weights(0)
  clients = _clients()
  reps = probes.representations(probes.feddva_model(_CONFIG, encoders),
                                clients)
  assert reps['z'].shape == (18, 3) and reps['c'].shape == (18, 2)
  np.testing.assert_array_equal(reps['client'], np.repeat([0, 1, 2], 6))
  np.testing.assert_array_equal(reps['digit'],
                                np.concatenate([c.test_y for c in clients]))
  assert np.isnan(reps['mark'][:6]).all()  # Client 0 has no marks.
  np.testing.assert_array_equal(reps['mark'][6:], np.concatenate(
      [c.test_mark for c in clients[1:]]))
  # The loaded encoders are the ones read: other weights, other codes.
  other = probes.representations(
      probes.feddva_model(_CONFIG, _weights(1)[0]), clients)
  assert not np.allclose(other['z'], reps['z'])


def test_client_decoder_effects_weight_each_client_s_own_decoder():
  """Each client's images go through its own decoder; the result is the
  clients' decoder_effects averaged weighted by their images, and a client
  with fewer than 2 images is left out."""
  encoders, _ = _weights(0)
  decoders = [_weights(s)[1] for s in (2, 3, 4)]
  rng = np.random.default_rng(0)
  client = np.array([0] * 5 + [1] * 9 + [2])
  reps = {'client': client, 'z': rng.normal(size=(15, 3)),
          'c': rng.normal(size=(15, 2))}
  out = probes.client_decoder_effects(_CONFIG, encoders, decoders, reps,
                                      seed=3)
  each = [probes.decoder_effects(
      probes.feddva_model(_CONFIG, encoders, decoders[k]).decode_mean,
      reps['z'][client == k], reps['c'][client == k], 3) for k in (0, 1)]
  for name in ('c', 'z'):
    assert out[name] == pytest.approx(
        (5 * each[0][name] + 9 * each[1][name]) / 14, rel=1e-6)
  none = probes.client_decoder_effects(
      _CONFIG, encoders, decoders, {**reps, 'client': np.arange(15)}, 3)
  assert none == {'c': None, 'z': None}


def test_probe_feddva_reports_the_probes_and_the_decoder_effects():
  encoders, _ = _weights(0)
  clients = _clients(n_clients=2, images=40)
  decoders = [_weights(s)[1] for s in (2, 3)]
  reps, metrics = probes.probe_feddva(_CONFIG, encoders, decoders, clients,
                                      seed=0)
  assert metrics == {
      **probes.linear_probes(reps, 0),
      **{f'decoder_{k}_effect': v for k, v in probes.client_decoder_effects(
          _CONFIG, encoders, decoders, reps, 0).items()}}


def test_figures_are_written_for_latents_of_one_two_and_more_dims(tmp_path):
  rng = np.random.default_rng(0)
  client = rng.integers(0, 3, 60)
  for dim in (1, 2, 5):
    reps = {'client': client, 'z': rng.normal(size=(60, dim)),
            'c': rng.normal(size=(60, dim))}
    path = str(tmp_path / f'tsne{dim}.png')
    assert probes.latent_figure(path, reps, ['a', 'b', 'c']) == path
    assert os.path.getsize(path) > 0
  encoders, _ = _weights(0)
  clients = _clients(n_clients=3, images=6)
  path = str(tmp_path / 'grid.png')
  assert probes.reconstruction_grid(
      path, _CONFIG, encoders, [_weights(s)[1] for s in (2, 3, 4)], clients,
      ['a', 'b', 'c'], size=4) == path
  assert os.path.getsize(path) > 0


def _fake_feddva_run(directory, decoder, population=3):
  """What `feddva.pretrained_model` reads of a run of `feddva`."""
  encoders, shared = _weights(0)
  trainable = encoders + (shared if decoder == 'shared' else [])
  private = [_weights(s)[1] for s in range(2, 2 + population)]

  def client_states(ids, stage):
    assert stage == 'pretrain'
    return [{process_lib.CLIENT_STATE_PRIVATE: tuple(private[i])}
            for i in ids]

  def curves(stage):
    assert stage == 'pretrain'
    return {'train': [{'round': 1, 'round_seconds': 2.0, 'train/kl_z': 1.5},
                      {'round': 2, 'round_seconds': 4.0, 'train/kl_z': 0.5}],
            'eval': []}

  run = types.SimpleNamespace(
      directory=str(directory), task=types.SimpleNamespace(
          population=population),
      weights=lambda stage: types.SimpleNamespace(trainable=trainable),
      client_states=client_states, curves=curves)
  return run, encoders, shared, private


@pytest.mark.parametrize('decoder', feddva.DECODERS)
def test_pretrained_model_is_kept_beside_the_run_and_read_back(tmp_path,
                                                               decoder):
  run, encoders, shared, private = _fake_feddva_run(tmp_path, decoder)
  assert feddva.load_pretrained(str(tmp_path), 3) is None
  feddva.save_pretrained(run, _CONFIG, decoder, dim=3, client_names=['a'])
  pre = feddva.load_pretrained(str(tmp_path), 3)
  assert len(pre['encoders']) == len(encoders)
  for got, want in zip(pre['encoders'], encoders):
    np.testing.assert_array_equal(got, want)
  want = private if decoder == 'private' else [shared] * 3
  assert len(pre['decoders']) == 3
  for got_k, want_k in zip(pre['decoders'], want):
    assert len(got_k) == len(want_k)
    for got, w in zip(got_k, want_k):
      np.testing.assert_array_equal(got, w)
  assert pre['curve'] == [{'kl_z': 1.5}, {'kl_z': 0.5}]
  assert pre['seconds_per_round'] == 3.0
  assert pre['dim'] == 3 and pre['client_names'] == ['a']
  # Fewer clients read the first ones.
  assert len(feddva.load_pretrained(str(tmp_path), 2)['decoders']) == 2
