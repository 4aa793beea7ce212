"""Tests for the speech_preference task: users, datasets, models, a round."""

import os
import shutil

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tasks import mnist_preference
from tasks import preference_users
from tasks import registry
from tasks import speech_data
from tasks import speech_preference
from tasks import speech_spectrogram
from tff_personal.algorithms import fedavg
from tff_personal.algorithms import registry as algorithms
from tff_personal.core import sharded
from tff_personal.models import fedembed
from tff_personal.models import fedembed_speech

SHARED_DATA = os.path.abspath(
    os.path.join(os.path.dirname(__file__), '..', '..', 'shared', 'data'))


def _fake_pool(n=12420, seed=0):
  """n all-zero spectrograms (a 0-byte broadcast view) with balanced voices."""
  voices = np.random.default_rng(seed).permutation(np.arange(n) % 20)
  spectrograms = np.broadcast_to(np.zeros((1, 200, 375), np.uint8),
                                 (n, 200, 375))
  return spectrograms, voices.astype(np.int32)


def test_generic_users_reproduce_the_mnist_construction():
  rng = np.random.default_rng(1)
  labels = np.repeat(np.arange(10, dtype=np.uint8), 40)
  images = rng.integers(0, 256, size=(labels.size, 28, 28), dtype=np.uint8)
  for population in ('balanced', 'imbalanced'):
    mnist = mnist_preference.make_preference_data(
        images, labels, num_users=60, population=population, seed=5)
    users = preference_users.make_users(
        labels, 10, mnist_preference.POPULATION_PERCENT[population],
        num_users=60, train_per_user=20, test_per_user=10, seed=5)
    for name in ('train_idx', 'test_idx', 'train_y', 'train_type', 'test_y',
                 'test_type', 'subpopulation'):
      np.testing.assert_array_equal(getattr(users, name),
                                    getattr(mnist, name), err_msg=name)


@pytest.mark.parametrize('population,sizes', [
    ('balanced', [45] * 20),
    ('imbalanced', [180, 36, 36, 36, 36, 72] + [36] * 14)])
def test_paper_populations(population, sizes):
  spectrograms, voices = _fake_pool()
  data = speech_preference.make_preference_data(
      spectrograms, voices, num_users=900, population=population, seed=0)
  u = data.users
  assert data.num_users == 900 and data.num_subpopulations == 20
  np.testing.assert_array_equal(np.bincount(u.subpopulation), sizes)
  assert u.train_idx.shape == (900, 20) and u.test_idx.shape == (900, 10)
  np.testing.assert_array_equal(u.train_y.sum(1), np.full(900, 10))
  np.testing.assert_array_equal(u.test_y.sum(1), np.full(900, 5))
  np.testing.assert_array_equal(u.train_type, voices[u.train_idx])
  np.testing.assert_array_equal(u.test_type, voices[u.test_idx])
  own = u.subpopulation[:, None]
  np.testing.assert_array_equal(u.train_y, u.train_type == own)
  both = np.concatenate([u.train_idx, u.test_idx], axis=1)
  assert all(len(set(row)) == 30 for row in both)  # Distinct per user.
  # Negatives spread over the other 19 voices.
  neg = np.concatenate([u.train_type[u.train_y == 0],
                        u.test_type[u.test_y == 0]])
  assert np.bincount(neg, minlength=20).min() > 0
  # Every utterance of a voice is used before any is reused.
  counts = np.bincount(both.ravel(), minlength=voices.size)
  for v in range(20):
    c = counts[voices == v]
    assert c.max() - c.min() <= 1, (v, c.min(), c.max())


def test_bad_arguments_are_named():
  spectrograms, voices = _fake_pool(400)
  with pytest.raises(ValueError, match='population'):
    speech_preference.make_preference_data(spectrograms, voices,
                                           population='skewed')
  with pytest.raises(ValueError, match='without users'):
    speech_preference.make_preference_data(spectrograms, voices, num_users=19)
  with pytest.raises(ValueError, match='uint8'):
    speech_preference.make_preference_data(
        np.zeros((4, 200, 300), np.uint8), voices[:4])
  with pytest.raises(ValueError, match='make_speech_data'):
    registry.build_task('speech_preference', data_dir=None, num_users=20,
                        population='balanced', seed=0)


def test_encoder_matches_appendix_b2_shapes():
  encoder = fedembed_speech.build_encoder(channels=2)
  shapes = {l.name: l.output_shape[1:] for l in encoder.layers}
  assert shapes['ln1'] == (50, 41, 16)   # LayerNorm([16, 50, 41])
  assert shapes['ln2'] == (7, 6, 32)     # LayerNorm([32, 7, 6])
  assert shapes['ln3'] == (3, 3, 64)     # LayerNorm([64, 3, 3])
  assert shapes['flatten'] == (576,)     # Linear(576, 256)
  assert shapes['ln4'] == (256,)


def test_embedding_channel_is_the_rectangular_diagonal():
  e = tf.random.normal([2, 200])
  channel = fedembed_speech.embedding_channel(e).numpy()[..., 0]
  assert channel.shape == (2, 200, 375)
  i = np.arange(200)
  np.testing.assert_array_equal(channel[:, i, i], e.numpy())
  channel[:, i, i] = 0
  assert not channel.any()


def test_preference_models():
  plus = fedembed_speech.build_preference_model(200)
  assert [v.shape for v in plus.private_variables] == [(200,)]
  x = tf.random.uniform([3, 200, 375, 1])
  with tf.GradientTape() as tape:
    logits = plus.model(x)
    first = logits[:, 0]
  assert logits.shape == (3, 2)
  grad = tape.gradient(first, plus.private_variables[0])
  assert np.count_nonzero(grad.numpy()) == 200
  assert not fedembed_speech.build_preference_model(0).private_variables
  with pytest.raises(ValueError, match='--embedding_dim=200'):
    fedembed_speech.build_preference_model(28)


def _loud_mean_reference(x):
  """np.median-gated frame mean of [n, bins, frames] floats (any count)."""
  level = x.mean(axis=1)
  loud = level > np.median(level, axis=1, keepdims=True)
  loud[~loud.any(axis=1)] = True
  return np.stack([x[i][:, loud[i]].mean(axis=1) for i in range(len(x))])


def test_mean_loud_spectrum_layer_equals_the_numpy_feature():
  # The spectral encoder's front end computes, in the model, exactly the
  # feature of the local_spectrum row (speech_spectrogram.mean_loud_spectrum).
  rng = np.random.default_rng(3)
  # Frames of distinct loudness (as in speech), so that no frame's level is
  # within float round-off of the median (summation order may differ).
  gain = np.stack([rng.permutation(375) * 0.6 for _ in range(4)])
  q = (rng.integers(0, 10, (4, 200, 375)) + gain[:, None, :]).astype(np.uint8)
  q[1, :, 200:] = 0      # padded with silence: never counted as loud
  q[2] = 77              # every frame equally loud: all of them kept
  x = speech_spectrogram.to_unit(q)[..., np.newaxis]
  layer = fedembed_speech.MeanLoudSpectrum()
  got = layer(tf.constant(x)).numpy()
  want = speech_spectrogram.mean_loud_spectrum(q)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(got[2], np.full(200, 77 / 255), rtol=1e-5)
  assert not np.allclose(got[0], x[0, :, :, 0].mean(axis=1))  # gated
  # The embedding channel is ignored; an even frame count takes the mean of
  # the two middle levels as its median, as np.median does.
  with_channel = np.concatenate([x, rng.normal(size=x.shape)], axis=-1)
  np.testing.assert_array_equal(layer(tf.constant(with_channel)).numpy(), got)
  even = rng.random((3, 5, 6)).astype(np.float32)
  even[0, :, :2] = 0.5   # two middle levels differ from every level
  np.testing.assert_allclose(layer(tf.constant(even[..., None])).numpy(),
                             _loud_mean_reference(even), rtol=1e-6)
  # A frame count known only at run time (odd and even) computes the same.
  dynamic = tf.function(layer, input_signature=[
      tf.TensorSpec([None, None, None, None], tf.float32)])
  for frames in (5, 6):
    odd_or_even = even[..., :frames]
    np.testing.assert_allclose(
        dynamic(tf.constant(odd_or_even[..., None])).numpy(),
        _loud_mean_reference(odd_or_even), rtol=1e-6)


def test_spectral_encoder_is_small_and_the_embedding_reaches_the_heads():
  encoder = fedembed_speech.build_spectral_encoder(channels=2)
  assert not [l for l in encoder.layers
              if isinstance(l, tf.keras.layers.Conv2D)]
  assert encoder.output_shape == (None, fedembed_speech.SPECTRAL_FEATURES)
  assert encoder.count_params() == 200 * 64 + 64 + 2 * 64  # 12,992
  b2 = fedembed_speech.build_encoder(channels=2).count_params()
  assert encoder.count_params() < 0.06 * b2
  plus = fedembed_speech.build_preference_model(200, encoder='spectral')
  x = tf.random.uniform([3, 200, 375, 1])
  with tf.GradientTape() as tape:
    logits = plus.model(x)
    first = logits[:, 0]
  grads = tape.gradient(first, [plus.private_variables[0]] +
                        plus.model.trainable_variables)
  assert logits.shape == (3, 2)
  assert np.count_nonzero(grads[0].numpy()) == 200  # through the concat
  assert all(g is not None and np.any(g.numpy()) for g in grads[1:])
  # 'spectrum': no weights; the standardised feature itself.
  spectrum = fedembed_speech.build_spectral_encoder(channels=2, features=None)
  assert spectrum.count_params() == 0
  xx = tf.concat([x, tf.zeros_like(x)], axis=-1)
  feature = fedembed_speech.MeanLoudSpectrum()(xx).numpy()
  want = ((feature - feature.mean(1, keepdims=True))
          / np.sqrt(feature.var(1, keepdims=True) + 1e-3))
  np.testing.assert_allclose(spectrum(xx).numpy(), want, rtol=1e-4,
                             atol=1e-4)
  only_heads = fedembed_speech.build_preference_model(200, encoder='spectrum')
  assert [tuple(v.shape) for v in only_heads.model.trainable_variables] == [
      (200,), (400, 2), (2,)]  # the embedding and the head
  with pytest.raises(ValueError, match="must be one of .'b2', 'spectral', "
                     "'spectrum'."):
    fedembed_speech.build_preference_model(200, encoder='mel')
  with pytest.raises(ValueError, match='spectral encoder has none to load'):
    fedembed_speech.fedembed_model_kwargs(
        encoder='spectral', encoder_weights=[np.zeros(1)])


@pytest.fixture(scope='module')
def speech_dir(tmp_path_factory):
  """A small speech_preference data directory, synthesised here."""
  if shutil.which('espeak-ng') is None:
    pytest.skip('espeak-ng is not installed (sudo apt-get install espeak-ng)')
  if not os.path.isdir(os.path.join(SHARED_DATA, 'shakespeare')):
    pytest.skip(f'no text data under {SHARED_DATA}')
  path = str(tmp_path_factory.mktemp('speech') / 'data')
  speech_data.generate(
      path, SHARED_DATA,
      speech_data.GenerationConfig(num_utterances=60, seed=1, min_words=3,
                                   max_words=6),
      workers=2, chunk_size=30, log_fn=lambda s: None)
  return path


def _tiny_task(path, **kwargs):
  return registry.build_task(
      'speech_preference', data_dir=path, num_users=20,
      population='balanced', seed=0, batch_size=3, local_epochs=1,
      train_per_user=4, test_per_user=2, **kwargs)


@pytest.fixture(scope='module')
def tiny_task(speech_dir):
  return _tiny_task(speech_dir)


def test_task_datasets_hold_the_users_spectrograms(tiny_task):
  spec = tiny_task.element_spec
  assert spec['x'].shape.as_list() == [None, 200, 375, 1]
  assert tiny_task.population == 20
  data = tiny_task.data
  raw = speech_data.load(os.path.dirname(
      data.spectrograms.filename)).spectrograms
  (ds,) = tiny_task.eval_datasets([7])
  assert ds.element_spec == spec
  batch = next(iter(ds))
  idx = data.users.test_idx[7]
  np.testing.assert_array_equal(
      batch['x'].numpy()[..., 0], speech_spectrogram.to_unit(raw[idx]))
  np.testing.assert_array_equal(batch['y'].numpy(), data.users.test_y[7])
  np.testing.assert_array_equal(batch['type'].numpy(),
                                data.users.test_type[7])
  (train,) = tiny_task.train_datasets([7], round_num=3)
  ys = np.concatenate([b['y'].numpy() for b in train])
  assert sorted(ys) == sorted(data.users.train_y[7])


def test_fedembed_model_has_one_head_per_voice(tiny_task):
  factory = tiny_task.fedembed_model_fn_factory(
      fedembed.FedEmbedConfig(embedding_dim=200))
  model = factory()
  kernel = model.model.get_layer('heads').kernel
  assert kernel.shape == (20, 456, 2)  # K = 20 voices; 256 + 200 inputs.
  assert model.model.get_layer('type_head').kernel.shape == (456, 20)
  with pytest.raises(ValueError, match='--embedding_dim=200'):
    tiny_task.fedembed_model_fn_factory(fedembed.FedEmbedConfig())
  # K as Appendix B.2 writes it (21 heads for 20 voices) is kept; fewer
  # heads than voices only where nothing is indexed by voice.
  b2 = tiny_task.fedembed_model_fn_factory(
      fedembed.FedEmbedConfig(embedding_dim=200, num_subpopulations=21))()
  assert b2.model.get_layer('heads').kernel.shape == (21, 456, 2)
  with pytest.raises(ValueError, match="smaller than the task's 20 types"):
    tiny_task.fedembed_model_fn_factory(
        fedembed.FedEmbedConfig(embedding_dim=200, num_subpopulations=5))
  few = tiny_task.fedembed_model_fn_factory(fedembed.FedEmbedConfig(
      embedding_dim=200, num_subpopulations=5, assignment='kmeans',
      use_type_head=False, use_global_head=False))()  # PFedKM's clusters
  assert few.model.get_layer('heads').kernel.shape == (5, 456, 2)


def test_reproduction_names_the_speech_models_private_state(tiny_task):
  # papers/fedembed.py labels the exported private states of a cell with the
  # model's private variables, built at the cell's embedding size.
  from papers import fedembed as fedembed_paper  # pylint: disable=g-import-not-at-top
  names = fedembed_paper._private_names(tiny_task, 'fedembed_prototype', 200)
  assert names[0] == 'personal_embedding' and len(names) >= 2
  with pytest.raises(ValueError, match='--embedding_dim=200'):
    fedembed_paper._private_names(tiny_task, 'fedembed_prototype')


def _client_states(proc, n, seed):
  """n client states: private floats ~ N(0, 0.1), counters zero."""
  specs = tff.types.type_to_tf_tensor_specs(proc.client_state_type)
  rng = np.random.default_rng(seed)
  return [tf.nest.map_structure(
      lambda s: rng.normal(0, 0.1, s.shape).astype(s.dtype.as_numpy_dtype)
      if s.dtype.is_floating else np.zeros(s.shape, s.dtype.as_numpy_dtype),
      specs) for _ in range(n)]


def test_one_global_plus_round_keeps_embeddings_private(tiny_task):
  proc = algorithms.build(
      'global_plus', tiny_task.model_fn_factory,
      client_optimizer=fedavg.adam(1e-3),
      server_optimizer=tff.learning.optimizers.build_sgdm(1.0),
      metrics_fn=tiny_task.metrics_fn, seed=0, embedding_dim=200)
  sig = proc.next.type_signature
  assert sig.result[1].placement is tff.CLIENTS
  embedding = tff.TensorType(np.float32, [200])
  shared = list(sig.result[0].member.global_model_weights.trainable)
  assert embedding not in shared
  assert embedding in list(proc.client_state_type.private)
  state = proc.initialize()
  clients = _client_states(proc, 2, seed=0)
  before = proc.get_model_weights(state).trainable
  state, new_clients, metrics = proc.next(
      state, clients, tiny_task.train_datasets([0, 1], round_num=0))
  after = proc.get_model_weights(state).trainable
  assert any(not np.allclose(a, b) for a, b in zip(before, after))
  for old, new in zip(clients, new_clients):
    assert not np.allclose(old['private'][0], new['private'][0])
  assert np.isfinite(
      [float(np.sum(w)) for w in after]).all(), metrics


def test_training_batches_travel_as_uint8_and_decode_to_model_input(
    tiny_task):
  (cb,) = tiny_task.train_batches([7], round_num=3)
  assert cb.examples['x'].dtype == np.uint8
  assert cb.examples['x'].shape == (4, 200, 375)  # each sample once
  x, y, _ = tiny_task.data.user_arrays(7, 'train')
  batches = list(cb.to_dataset())
  assert len(batches) == len(cb.index_batches) == 2  # 4 samples, batch 3
  for got, idx in zip(batches, cb.index_batches):
    np.testing.assert_array_equal(got['x'].numpy(), x[idx])
    np.testing.assert_array_equal(got['y'].numpy(), y[idx])


def test_speech_eval_batches_are_the_eval_datasets_in_uint8(tiny_task):
  ids = [3, 11]
  for cb, ds in zip(tiny_task.eval_batches(ids), tiny_task.eval_datasets(ids)):
    assert cb.examples['x'].dtype == np.uint8
    got, want = list(cb.to_dataset()), list(ds)
    assert len(got) == len(want) == 1  # 2 test samples, batch 3
    for a, b in zip(got, want):
      for key in ('x', 'y', 'type'):
        np.testing.assert_array_equal(a[key].numpy(), b[key].numpy())


def _sharded_and_one_user_rounds(task):
  """One global_plus round of 3 users, sharded (2 shards, the task's wire
  form) and one user per TFF client, from the same states.

  Returns:
    (server, clients): for the server model's trainable leaves and for each
    user's personal embedding, (sharded, one-user, before) triples of lists.
  """
  build = lambda: algorithms.build(
      'global_plus', task.model_fn_factory,
      client_optimizer=tff.learning.optimizers.build_sgdm(0.05),
      server_optimizer=tff.learning.optimizers.build_sgdm(1.0),
      metrics_fn=task.metrics_fn, seed=0, embedding_dim=200)
  base = build()
  clients = _client_states(base, 3, seed=1)
  ids = [0, 5, 9]
  want_state, want_clients, _ = base.next(
      base.initialize(), clients, task.train_datasets(ids, round_num=1))
  proc = sharded.ShardedProcess(build(), 2, wire=task.wire_format)
  got_state, got_clients, _ = proc.next(
      proc.initialize(), clients, task.train_batches(ids, round_num=1))
  server = (proc.get_model_weights(got_state).trainable,
            base.get_model_weights(want_state).trainable,
            base.get_model_weights(base.initialize()).trainable)
  users = [([got['private'][0]], [want['private'][0]], [old['private'][0]])
           for got, want, old in zip(got_clients, want_clients, clients)]
  for _, want, old in users:
    assert np.any(want[0] != old[0])  # The embeddings moved.
  return server, users


def test_sharded_speech_round_equals_one_user_per_client(speech_dir):
  # The spectral encoder (no convolutions): each leaf is held to 1e-3 of the
  # change the round made to it; summation order moves it by about 1e-6 of
  # it, and a swapped or doubled user's data by more than 0.1.
  server, users = _sharded_and_one_user_rounds(
      _tiny_task(speech_dir, encoder='spectral'))
  for name, (got, want, old) in [('server', server)] + [
      (f'user {i}', u) for i, u in enumerate(users)]:
    for leaf, (g, w, o) in enumerate(zip(got, want, old)):
      change = np.max(np.abs(np.asarray(w) - np.asarray(o)))
      gap = np.max(np.abs(np.asarray(g) - np.asarray(w)))
      assert gap <= 1e-3 * change, (
          f'{name} leaf {leaf} differs by {gap:.3g}, more than 1e-3 of the '
          f'round\'s change {change:.3g}')


def _relative_gap(got, want, old):
  """|got - want| / |want - old| over all leaves (L2)."""
  flat = lambda xs: np.concatenate([np.ravel(np.asarray(x)) for x in xs])
  return (np.linalg.norm(flat(got) - flat(want))
          / np.linalg.norm(flat(want) - flat(old)))


def test_sharded_speech_round_with_the_papers_encoder(tiny_task):
  # The paper's encoder (Appendix B.2) runs its convolutions in two
  # programs here, the worker's TensorFlow and this process's, whose kernels
  # may round differently on a given CPU, and some of its leaves are
  # ill-conditioned: a convolution's bias before a LayerNorm over all
  # positions has a gradient summed over thousands of positions that nearly
  # cancel (about 100x the float32 error of the kernel beside it), and a
  # ReLU over silent frames, where positions hold equal values, can switch
  # many at once. One leaf may then move by percents of its change. So the
  # whole update is compared, in L2, to 1e-2 of its length: rounding moves
  # it by about 1e-6, a swapped or doubled user's data by more than 5e-2,
  # and another user's data moves an embedding by more than its change. The
  # spectral encoder's test above holds every leaf.
  server, users = _sharded_and_one_user_rounds(tiny_task)
  gap = _relative_gap(*server)
  assert gap <= 1e-2, f'the server model differs by {gap:.3g} of its change'
  for i, user in enumerate(users):
    gap = _relative_gap(*user)
    assert gap <= 1e-2, f'user {i}\'s embedding differs by {gap:.3g}'


def _dp_prototype_process(task):
  """FedEmbed-Prototype on `task` with user-level DP (2 of 20 clients)."""
  from tff_personal.core import privacy  # pylint: disable=g-import-not-at-top
  return algorithms.build(
      'fedembed_prototype', algorithms.model_factory('fedembed_prototype',
                                                     task),
      client_optimizer=fedavg.adam(1e-2),
      server_optimizer=tff.learning.optimizers.build_sgdm(1.0),
      aggregator_factory=privacy.build_aggregator(privacy.DPConfig(
          mechanism='gaussian_fixed', noise_multiplier=1.0, clip_norm=1.0,
          clients_per_round=2, population=20, rounds=1)),
      metrics_fn=task.metrics_fn, seed=0, embedding_dim=200)


def test_frozen_public_encoder_is_never_trained_sent_or_noised(
    tiny_task, tmp_path):
  # A frozen pre-trained encoder: under DP only heads, prototypes and the
  # classifier are in the noised update; the encoder stays bit for bit.
  rng = np.random.default_rng(5)
  enc = fedembed_speech.build_encoder(channels=2)
  want = [rng.normal(0, 0.1, w.shape).astype(np.float32)
          for w in enc.get_weights()]
  enc.set_weights(want)
  path = str(tmp_path / 'encoder.npz')
  fedembed_speech.save_encoder_weights(path, enc, {})
  data_dir = os.path.dirname(tiny_task.data.spectrograms.filename)
  with pytest.raises(ValueError, match='needs encoder_weights'):
    registry.build_task('speech_preference', data_dir=data_dir, num_users=20,
                        freeze_encoder=True)
  task = registry.build_task(
      'speech_preference', data_dir=data_dir, num_users=20,
      population='balanced', seed=0, batch_size=3, local_epochs=1,
      train_per_user=4, test_per_user=2, encoder_weights=path,
      freeze_encoder=True)
  proc = _dp_prototype_process(task)
  weights_type = proc.model_weights_type
  trainable_shapes = [tuple(t.shape) for t in weights_type.trainable]
  assert (576, 256) not in trainable_shapes  # the encoder's dense kernel
  assert (20, 456, 2) in trainable_shapes     # the heads
  state = proc.initialize()
  before = proc.get_model_weights(state)
  frozen = [np.asarray(w) for w in before.non_trainable
            if tuple(np.shape(w)) in {x.shape for x in want}]
  assert len(frozen) == 16
  for got, w in zip(frozen, want):
    np.testing.assert_array_equal(got, w)
  state, _, _ = proc.next(state, _client_states(proc, 2, seed=1),
                          task.train_datasets([0, 1], round_num=0))
  after = proc.get_model_weights(state)
  for old, new in zip(before.non_trainable, after.non_trainable):
    np.testing.assert_array_equal(old, new)
  assert any(not np.allclose(a, b) for a, b in
             zip(before.trainable, after.trainable))


def test_local_rows_fit_every_user_alone_and_ignore_dp(
    tiny_task, tmp_path, monkeypatch):
  # The `local_spectrum` / `local` rows of tables 3 / 3_public, through
  # papers.fedembed.run_cell on the tiny task: no federation, so the DP
  # column computes exactly the no-DP one, and no epsilon is claimed.
  import types  # pylint: disable=g-import-not-at-top
  from papers import fedembed as paper  # pylint: disable=g-import-not-at-top
  from tff_personal.core import evaluation  # pylint: disable=g-import-not-at-top
  from tff_personal.models import local_head  # pylint: disable=g-import-not-at-top
  from tff_personal.reports import reporting  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(paper, '_build_task', lambda *a, **k: tiny_task)
  f = types.SimpleNamespace(
      seeds=1, data_dir='unused', rounds=None, clients_per_round=None,
      num_users=20, fedembed_local_epochs=None, fedembed_eval_clients=None,
      fedembed_eval_every=None, fedembed_target_epsilon=10.0,
      fedembed_clip_norm=None, fedembed_speech_encoder=None)
  def cell(method, dp, **extra):
    return reporting.Cell('fedembed', method, {
        'task': paper.SPEECH, 'population': 'balanced', 'dp': dp, **extra}, 0)
  none = paper.run_cell(cell(paper.LOCAL_SPECTRUM, 'none'), f, str(tmp_path))
  dp = paper.run_cell(cell(paper.LOCAL_SPECTRUM, 'gaussian_fixed'), f,
                      str(tmp_path))
  for m in (none, dp):
    m.pop('seconds')
  assert none == dp
  assert none['shared_parameters'] == 0 and 'epsilon' not in none
  assert none['eval_clients'] == 20 and none['rounds'] == 0
  # The cell's F1 is the users' own heads on their own spectra.
  data = tiny_task.data
  def split(user, name):
    q, y, _ = data.user_spectrograms(user, name)
    return speech_spectrogram.mean_loud_spectrum(q), y
  want = evaluation.preference_metrics(
      local_head.local_outputs([split(u, 'train') for u in range(20)],
                               [split(u, 'test') for u in range(20)]),
      list(data.subpopulation))
  assert none['f1'] == pytest.approx(want['f1'])
  assert none['accuracy'] == pytest.approx(want['accuracy'])
  assert {'f1_c_0.01', 'f1_c_0.1', 'f1_c_10'} <= set(none)
  # `local` reads the frozen public encoder; the rows refuse the wrong one.
  enc = fedembed_speech.build_encoder(channels=1)
  path = str(tmp_path / 'encoder.npz')
  fedembed_speech.save_encoder_weights(path, enc, {'val_accuracy': [0.5]})
  public = paper.run_cell(cell(paper.LOCAL, 'none', encoder='public'),
                          types.SimpleNamespace(**{
                              **vars(f), 'fedembed_speech_encoder': path}),
                          str(tmp_path))
  assert public['encoder_public_accuracy'] == 0.5
  # An untrained encoder (`pretrain_speech_encoder --epochs=0`, the control)
  # has no held-out accuracy: recorded as None, not an error.
  fedembed_speech.save_encoder_weights(path, enc, {'val_accuracy': [],
                                                   'untrained': True})
  control = paper.run_cell(cell(paper.LOCAL, 'none', encoder='public'),
                           types.SimpleNamespace(**{
                               **vars(f), 'fedembed_speech_encoder': path}),
                           str(tmp_path))
  assert control['encoder_public_accuracy'] is None
  assert control['f1'] == pytest.approx(public['f1'])  # same weights
  assert 0.0 <= public['f1'] <= 1.0 and public['eval_clients'] == 20
  with pytest.raises(ValueError, match='local needs the frozen public'):
    paper.run_cell(cell(paper.LOCAL, 'none'), f, str(tmp_path))
  with pytest.raises(ValueError, match='--fedembed_speech_encoder'):
    paper.run_cell(cell(paper.LOCAL, 'none', encoder='public'), f,
                   str(tmp_path))


def test_spectral_encoder_trains_from_scratch_under_dp(tiny_task):
  # --speech_encoder=spectral: no pre-trained weights, every shared weight
  # trains and is noised; the update holds no convolution and under 20%
  # of B.2's; weights for it are refused by name.
  data_dir = os.path.dirname(tiny_task.data.spectrograms.filename)
  kwargs = dict(data_dir=data_dir, num_users=20, population='balanced',
                seed=0, batch_size=3, local_epochs=1, train_per_user=4,
                test_per_user=2)
  with pytest.raises(ValueError, match='spectral encoder has none to load'):
    registry.build_task('speech_preference', encoder='spectral',
                        encoder_weights='enc.npz', **kwargs)
  task = registry.build_task('speech_preference', encoder='spectral',
                             **kwargs)
  proc = _dp_prototype_process(task)
  shapes = [tuple(t.shape) for t in proc.model_weights_type.trainable]
  assert (200, 64) in shapes and (20, 264, 2) in shapes
  assert not [s for s in shapes if len(s) == 4]  # no convolution kernel
  assert not list(proc.model_weights_type.non_trainable)
  size = lambda p: sum(int(np.prod(t.shape))
                       for t in p.model_weights_type.trainable)
  assert size(proc) < 0.2 * size(_dp_prototype_process(tiny_task))
  state = proc.initialize()
  before = proc.get_model_weights(state).trainable
  state, _, _ = proc.next(state, _client_states(proc, 2, seed=1),
                          task.train_datasets([0, 1], round_num=0))
  after = proc.get_model_weights(state).trainable
  changed = {tuple(np.shape(a)) for a, b in zip(before, after)
             if not np.allclose(a, b)}
  assert (200, 64) in changed  # the encoder itself learns (and is noised)
