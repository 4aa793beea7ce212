"""The `feddva` process: decoders stay on clients; Algorithm 1's passes;
the classifier loads FedDVA's encoders; Ditto's global part is FedAvg."""

import collections

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tff_personal.algorithms import ditto
from tff_personal.algorithms import fedavg_ft
from tff_personal.algorithms import feddva
from tff_personal.core import process as process_lib
from tff_personal.models import feddva as feddva_lib

CONFIG = feddva_lib.FeddvaConfig(z_dim=2, c_dim=2, channels=(2, 2, 2, 3),
                                 hidden=5)


def _data(seed, n=12, batch=6):
  rng = np.random.default_rng(seed)
  return tf.data.Dataset.from_tensor_slices(collections.OrderedDict(
      x=rng.uniform(size=(n, 28, 28, 1)).astype(np.float32),
      y=rng.integers(0, 10, n).astype(np.int32))).batch(batch)


def _sgd(lr):
  return tff.learning.optimizers.build_sgdm(lr)


def _flat_types(type_spec):
  if isinstance(type_spec, tff.TensorType):
    return [type_spec]
  if isinstance(type_spec, (tff.StructType, tff.FederatedType)):
    members = ([type_spec.member] if isinstance(type_spec, tff.FederatedType)
               else [t for _, t in tff.structure.iter_elements(type_spec)])
    return [t for m in members for t in _flat_types(m)]
  return []


@pytest.fixture(scope='module')
def process():
  return feddva.build_feddva(CONFIG, decoder_optimizer=_sgd(0.05),
                             encoder_optimizer=_sgd(0.05), seed=1)


def test_decoders_never_leave_their_clients(process):
  encoders, decoder = feddva.initial_weights(CONFIG, seed=1)
  sig = process.next.type_signature
  state_in, clients_in, _ = sig.parameter
  state_out, clients_out, metrics = sig.result
  # Client state (the decoder) enters and leaves at CLIENTS only.
  for t in (clients_in, clients_out):
    assert t.placement is tff.CLIENTS
    private = t.member[process_lib.CLIENT_STATE_PRIVATE]
    assert [tuple(p.shape) for p in private] == [d.shape for d in decoder]
  # What reaches the server: the encoders' update (the aggregator's value
  # type) and the encoders in the server state; no decoder-sized tensor.
  enc_shapes = sorted(tuple(e.shape) for e in encoders)
  assert sorted(tuple(t.shape) for t in _flat_types(
      process.aggregation_value_type)) == enc_shapes
  for server_value in (state_in, state_out, metrics):
    assert server_value.placement is tff.SERVER
  weights = state_out.member.global_model_weights
  assert sorted(tuple(t.shape) for t in _flat_types(weights)) == enc_shapes
  decoder_only = {d.shape for d in decoder} - {e.shape for e in encoders}
  assert decoder_only  # e.g. the 7x7 map and the output conv
  server_shapes = {tuple(t.shape) for t in _flat_types(state_out)}
  server_shapes |= {tuple(t.shape) for t in _flat_types(metrics)}
  assert not decoder_only & server_shapes


def _round(p, clients=2, state=None, states=None):
  _, decoder = feddva.initial_weights(CONFIG, seed=1)
  state = state if state is not None else p.initialize()
  states = states or [feddva.initial_client_state(decoder)
                      for _ in range(clients)]
  return (state,) + tuple(p.next(state, states,
                                 [_data(k) for k in range(clients)]))


def test_round_trains_encoders_and_each_clients_own_decoder(process):
  state0, state1, states, metrics = _round(process)
  enc0 = state0.global_model_weights.trainable
  enc1 = state1.global_model_weights.trainable
  assert any(not np.allclose(a, b) for a, b in zip(enc0, enc1))
  _, decoder = feddva.initial_weights(CONFIG, seed=1)
  dec_a = states[0][process_lib.CLIENT_STATE_PRIVATE]
  dec_b = states[1][process_lib.CLIENT_STATE_PRIVATE]
  assert any(not np.allclose(a, d) for a, d in zip(dec_a, decoder))
  # Different data, different private decoders.
  assert any(not np.allclose(a, b) for a, b in zip(dec_a, dec_b))
  assert [int(s[process_lib.CLIENT_STATE_ROUNDS]) for s in states] == [1, 1]
  assert int(metrics['train']['num_examples']) == 24
  assert np.isfinite(float(metrics['train']['loss']))


def test_frozen_encoders_give_zero_update_frozen_decoder_keeps_state():
  frozen_enc = feddva.build_feddva(CONFIG, decoder_optimizer=_sgd(0.05),
                                   encoder_optimizer=_sgd(0.0), seed=1)
  state0, state1, states, _ = _round(frozen_enc, clients=1)
  for a, b in zip(state0.global_model_weights.trainable,
                  state1.global_model_weights.trainable):
    np.testing.assert_array_equal(a, b)
  frozen_dec = feddva.build_feddva(CONFIG, decoder_optimizer=_sgd(0.0),
                                   encoder_optimizer=_sgd(0.05), seed=1)
  _, decoder = feddva.initial_weights(CONFIG, seed=1)
  _, _, states, _ = _round(frozen_dec, clients=1)
  for a, b in zip(states[0][process_lib.CLIENT_STATE_PRIVATE], decoder):
    np.testing.assert_array_equal(a, b)


def test_classifier_starts_from_the_feddva_encoders(process):
  _, state1, _, _ = _round(process)
  encoders = state1.global_model_weights.trainable
  classifier = feddva.build_feddva_classifier_process(CONFIG, seed=2)
  state = feddva.with_encoders(classifier, classifier.initialize(), encoders)
  model = feddva_lib.build_feddva_classifier(CONFIG)
  for v, w in zip(model.model.trainable_variables,
                  classifier.get_model_weights(state).trainable):
    v.assign(w)
  vae = feddva_lib.FeddvaModel(CONFIG)
  for v, w in zip(vae.shared_variables, encoders):
    v.assign(w)
  x = next(iter(_data(5)))['x']
  mu_z, _, mu_c, _ = vae.encode(x)
  # The head's input is [mu_z; mu_c] of the loaded encoders.
  features = tf.keras.Model(model.model.input,
                            model.model.get_layer('zc').output)(x)
  np.testing.assert_allclose(features.numpy(),
                             np.concatenate([mu_z, mu_c], -1), rtol=1e-5,
                             atol=1e-6)


def test_ditto_global_part_is_fedavg_and_personal_models_stay_local():
  model_fn = lambda: feddva_lib.build_cnn_classifier(CONFIG)
  d = ditto.build_ditto(model_fn, lam=0.5, client_optimizer=_sgd(0.1), seed=3)
  f = fedavg_ft.build_fedavg_ft(model_fn, client_optimizer=_sgd(0.1), seed=3)
  data = [_data(k) for k in range(2)]
  d_state, f_state = d.initialize(), f.initialize()
  w0 = d.get_model_weights(d_state).trainable
  d_state, personal, _ = d.next(
      d_state, [ditto.initial_client_state(w0) for _ in range(2)], data)
  empty = collections.OrderedDict([(process_lib.CLIENT_STATE_PRIVATE, ()),
                                   (process_lib.CLIENT_STATE_ROUNDS, 0)])
  f_state, _, _ = f.next(f_state, [empty, empty], data)
  for a, b in zip(d.get_model_weights(d_state).trainable,
                  f.get_model_weights(f_state).trainable):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
  # The personal models moved, differ per client, and are client-placed.
  p0 = personal[0][process_lib.CLIENT_STATE_PRIVATE]
  p1 = personal[1][process_lib.CLIENT_STATE_PRIVATE]
  assert any(not np.allclose(a, b) for a, b in zip(p0, w0))
  assert any(not np.allclose(a, b) for a, b in zip(p0, p1))
  assert d.next.type_signature.result[1].placement is tff.CLIENTS
  # The proximal term pulls toward the global model: with a huge lambda the
  # personal model moves less from w0 than with lambda = 0.
  def drift(lam):
    p = ditto.build_ditto(model_fn, lam=lam, client_optimizer=_sgd(0.1),
                          personal_optimizer=_sgd(1e-3), seed=3)
    s = p.initialize()
    _, out, _ = p.next(s, [ditto.initial_client_state(w0)], data[:1])
    return sum(float(np.sum((a - b) ** 2)) for a, b in zip(
        out[0][process_lib.CLIENT_STATE_PRIVATE], w0))
  assert drift(100.0) < drift(0.0)


def test_ditto_personal_pass_reads_the_second_shuffle_of_the_data():
  """Both passes iterate one reshuffling dataset; the personal pass must
  deterministically come second (it once raced the global pass for the
  first order, and two runs of one seed differed)."""
  model_fn = lambda: feddva_lib.build_cnn_classifier(CONFIG)
  p = ditto.build_ditto(model_fn, lam=0.1, client_optimizer=_sgd(0.2),
                        seed=3)
  state = p.initialize()
  w0 = p.get_model_weights(state).trainable

  def reshuffling():
    rng = np.random.default_rng(4)
    return tf.data.Dataset.from_tensor_slices(collections.OrderedDict(
        x=rng.uniform(size=(12, 28, 28, 1)).astype(np.float32),
        y=rng.integers(0, 10, 12).astype(np.int32))).shuffle(
            12, seed=5, reshuffle_each_iteration=True).batch(4)

  # Reference, eagerly: the first iteration is the global pass's, the
  # second (another order) the personal pass's.
  orders = reshuffling()
  first, second = ([b['y'].numpy().tolist() for b in orders]
                   for _ in range(2))
  assert first != second  # Else this test could not tell them apart.
  reference = reshuffling()
  for _ in reference:  # The global pass's iteration.
    pass
  personal_model = model_fn()
  expected, _ = ditto.personal_train(personal_model, _sgd(0.2), w0, w0,
                                     reference, 0.1)
  for _ in range(4):  # A race would show as a mismatch in some run.
    _, out, _ = p.next(state, [ditto.initial_client_state(w0)],
                       [reshuffling()])
    for a, b in zip(out[0][process_lib.CLIENT_STATE_PRIVATE], expected):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_unknown_decoder_mode_is_refused():
  with pytest.raises(ValueError, match="decoder must be one of.*'local'"):
    feddva.build_feddva(CONFIG, decoder='local')


def test_shared_decoder_ablation_averages_the_decoder_weighted_by_data(
    monkeypatch):
  """decoder='shared': the server holds encoders + decoder; each client's
  decoder update is averaged like the encoders' (weighted by examples) and
  the client state holds no weights.

  The client step is replaced by a deterministic one (the real step samples
  the reparameterisation noise) so that the expected average is exact:
  client k returns the decoder moved by the mean pixel of its data and the
  encoders unchanged.
  """
  def fake_update(model, dec_opt, enc_opt, encoder_weights, decoder_weights,
                  dataset, loss_config, decoder_first=True, schedule='paper',
                  seed=None, resamples=1):
    del model, dec_opt, enc_opt, loss_config, decoder_first
    assert schedule == 'paper' and seed.shape == [2] and resamples == 1
    total, count = dataset.reduce(
        (0.0, 0), lambda s, b: (s[0] + tf.reduce_sum(b['x']),
                                s[1] + tf.shape(b['x'])[0]))
    shift = total / tf.cast(count * 28 * 28, tf.float32)
    metrics = collections.OrderedDict(
        (f'{k}_sum', tf.constant(0.0)) for k in ('loss',))
    metrics['num_examples'] = tf.cast(count, tf.int64)
    return (tuple(tf.zeros_like(e) for e in encoder_weights),
            tf.cast(count, tf.float32),
            tuple(d + shift for d in decoder_weights), metrics)

  monkeypatch.setattr(feddva.feddva_training, 'client_update', fake_update)
  p = feddva.build_feddva(CONFIG, seed=1, decoder='shared')
  encoders, decoder = feddva.initial_weights(CONFIG, seed=1)
  trainable_type = p.next.type_signature.parameter[0].member
  trainable_type = trainable_type.global_model_weights.trainable
  assert [tuple(t.shape) for t in trainable_type] == (
      [e.shape for e in encoders] + [d.shape for d in decoder])
  assert sorted(tuple(t.shape) for t in _flat_types(
      p.aggregation_value_type)) == sorted(
          [e.shape for e in encoders] + [d.shape for d in decoder])
  sizes = (12, 6)
  data = [_data(k, n=n) for k, n in enumerate(sizes)]
  shifts = [float(np.mean(np.concatenate([b['x'] for b in d])))
            for d in data]
  expected_shift = np.average(shifts, weights=sizes)
  state, states, _ = p.next(
      p.initialize(), [feddva.initial_client_state(()) for _ in sizes], data)
  assert all(len(s[process_lib.CLIENT_STATE_PRIVATE]) == 0 for s in states)
  new_enc, new_dec = feddva.split_shared_weights(
      CONFIG, p.get_model_weights(state).trainable)
  for a, b in zip(new_enc, encoders):
    np.testing.assert_allclose(a, b, atol=1e-6)
  for a, b in zip(new_dec, decoder):
    np.testing.assert_allclose(a, b + expected_shift, rtol=1e-5, atol=1e-5)
  # The shifts differ, so an unweighted mean would fail the check above.
  assert abs(np.mean(shifts) - expected_shift) > 1e-4


def test_shared_decoder_real_step_moves_the_server_decoder_only_if_trained():
  encoders, decoder = feddva.initial_weights(CONFIG, seed=1)
  empty = [feddva.initial_client_state(()) for _ in range(2)]
  data = [_data(k) for k in range(2)]
  for dec_lr, moved in ((0.0, False), (0.05, True)):
    p = feddva.build_feddva(CONFIG, decoder_optimizer=_sgd(dec_lr),
                            encoder_optimizer=_sgd(0.05), seed=1,
                            decoder='shared')
    state, _, metrics = p.next(p.initialize(), empty, data)
    enc, dec = feddva.split_shared_weights(
        CONFIG, p.get_model_weights(state).trainable)
    assert any(not np.allclose(a, b) for a, b in zip(enc, encoders))
    assert any(not np.allclose(a, b) for a, b in zip(dec, decoder)) == moved
    assert int(metrics['train']['num_examples']) == 24
