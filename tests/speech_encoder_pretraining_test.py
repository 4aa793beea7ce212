"""Tests for the public-speaker encoder: weights in and out, pre-training."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from tff_personal.models import fedembed_speech
from tff_personal.models import speech_encoder_pretraining as pretraining


def _random_weights(channels=2, seed=0):
  rng = np.random.default_rng(seed)
  enc = fedembed_speech.build_encoder(channels=channels)
  return [rng.normal(0, 0.1, w.shape).astype(np.float32)
          for w in enc.get_weights()]


def test_encoder_starts_from_given_weights_and_freezes():
  weights = _random_weights()
  enc = fedembed_speech.build_encoder(channels=2, weights=weights)
  for got, want in zip(enc.get_weights(), weights):
    np.testing.assert_array_equal(got, want)
  assert len(enc.trainable_weights) == 16
  frozen = fedembed_speech.build_encoder(channels=2, weights=weights,
                                         trainable=False)
  assert not frozen.trainable_weights
  assert len(frozen.non_trainable_weights) == 16
  # The 1-channel (Global) encoder takes the spectrogram channel's kernel.
  one = fedembed_speech.build_encoder(channels=1, weights=weights)
  np.testing.assert_array_equal(one.get_weights()[0], weights[0][:, :, :1])
  np.testing.assert_array_equal(one.get_weights()[12], weights[12])


def test_bad_encoder_weights_are_named(tmp_path):
  weights = _random_weights()
  with pytest.raises(ValueError, match='16 weight arrays, got 15'):
    fedembed_speech.build_encoder(channels=2, weights=weights[:15])
  bad = list(weights)
  bad[12] = np.zeros((500, 256), np.float32)
  with pytest.raises(ValueError, match=r'weight 12 has shape \(500, 256\)'):
    fedembed_speech.build_encoder(channels=2, weights=bad)
  with pytest.raises(ValueError, match='pretrain_speech_encoder'):
    fedembed_speech.load_encoder_weights(str(tmp_path / 'missing.npz'))
  other = tmp_path / 'other.npz'
  np.savez(other, w00=np.zeros(3))
  with pytest.raises(ValueError, match='not a speech-encoder weights file'):
    fedembed_speech.load_encoder_weights(str(other))


def test_save_load_round_trip(tmp_path):
  enc = fedembed_speech.build_encoder(channels=2,
                                      weights=_random_weights(seed=3))
  path = str(tmp_path / 'enc.npz')
  fedembed_speech.save_encoder_weights(path, enc, {'val_accuracy': [0.5]})
  weights, meta = fedembed_speech.load_encoder_weights(path)
  assert meta == {'val_accuracy': [0.5]}
  for got, want in zip(weights, enc.get_weights()):
    np.testing.assert_array_equal(got, want)
  assert not list(tmp_path.glob('*.tmp*'))  # written atomically


def _voice_bands(n_per_voice, num_voices, seed):
  """Spectrograms whose voice is a bright frequency band, plus noise."""
  rng = np.random.default_rng(seed)
  voices = np.repeat(np.arange(num_voices), n_per_voice)
  x = rng.integers(0, 60, (len(voices), 200, 375)).astype(np.uint8)
  for i, v in enumerate(voices):
    x[i, 20 + 50 * v: 40 + 50 * v, :] += 150
  return x, voices


def test_pretraining_learns_to_tell_the_voices_apart():
  x, voices = _voice_bands(12, 3, seed=0)
  logs = []
  encoder, metrics = pretraining.pretrain(
      x, voices, 3, pretraining.PretrainConfig(
          epochs=3, batch_size=6, learning_rate=3e-3,
          validation_fraction=0.25, seed=0), log_fn=logs.append)
  assert len(logs) == 3 and metrics['val_utterances'] == 9
  assert metrics['val_accuracy'][-1] >= 0.8, metrics
  assert metrics['chance'] == pytest.approx(1 / 3)
  json.dumps(metrics)  # stored as the weights file's metadata
  # The trained encoder separates the voices: its features of two voices
  # are further apart than those of two utterances of one voice.
  unit = np.concatenate([x[..., None] / 255.0, np.zeros_like(x[..., None],
                                                             np.float64)], -1)
  f = encoder(tf.constant(unit, tf.float32)).numpy()
  centers = np.stack([f[voices == v].mean(0) for v in range(3)])
  within = np.mean([np.linalg.norm(f[voices == v] - centers[v], axis=1).mean()
                    for v in range(3)])
  between = np.mean([np.linalg.norm(centers[a] - centers[b])
                     for a in range(3) for b in range(a + 1, 3)])
  assert between > within


def test_zero_epochs_gives_the_seeded_untrained_encoder():
  """The control: no step taken, the encoder is the seed's initialisation."""
  x, voices = _voice_bands(4, 2, seed=2)
  logs = []
  encoder, metrics = pretraining.pretrain(
      x, voices, 2, pretraining.PretrainConfig(epochs=0, seed=3),
      log_fn=logs.append)
  assert not logs and metrics['untrained'] is True
  assert metrics['val_accuracy'] == [] == metrics['train_accuracy']
  _, fresh = pretraining.build_classifier(2, seed=3)
  for a, b in zip(encoder.get_weights(), fresh.get_weights()):
    np.testing.assert_array_equal(a, b)
  _, other = pretraining.build_classifier(2, seed=4)
  assert not np.array_equal(encoder.get_weights()[0], other.get_weights()[0])
  json.dumps(metrics)
  trained = pretraining.pretrain(x, voices, 2, pretraining.PretrainConfig(
      epochs=1, seed=3), log_fn=logs.append)[1]
  assert trained['untrained'] is False and len(trained['val_accuracy']) == 1


def test_pretraining_refuses_bad_input():
  x, voices = _voice_bands(2, 2, seed=1)
  with pytest.raises(ValueError, match=r'in \[0, 1\)'):
    pretraining.pretrain(x, voices, 1)
  with pytest.raises(ValueError, match=r'\[N, 200, 375\]'):
    pretraining.pretrain(x[:, :100], voices, 2)
  with pytest.raises(ValueError, match='validation_fraction'):
    pretraining.pretrain(x, voices, 2, pretraining.PretrainConfig(
        validation_fraction=1.0))
  with pytest.raises(ValueError, match='epochs must be >= 0'):
    pretraining.pretrain(x, voices, 2, pretraining.PretrainConfig(epochs=-1))


def test_binary_refuses_to_overwrite_an_encoder(tmp_path):
  """The check runs before any data is read; the file is left as it was."""
  output = tmp_path / 'encoder.npz'
  output.write_bytes(b'a trained encoder')
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.run(
      [sys.executable, '-m', 'binaries.pretrain_speech_encoder',
       f'--data_dir={tmp_path / "missing"}', f'--output={output}'],
      cwd=repo, capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode != 0
  assert f'--output={output} exists' in proc.stderr
  assert '--overwrite' in proc.stderr
  assert output.read_bytes() == b'a trained encoder'
  # With --overwrite the check passes and the missing data is what fails,
  # named, without a traceback.
  proc = subprocess.run(
      [sys.executable, '-m', 'binaries.pretrain_speech_encoder',
       f'--data_dir={tmp_path / "missing"}', f'--output={output}',
       '--overwrite'],
      cwd=repo, capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode != 0
  assert 'no generated speech data' in proc.stderr
  assert 'Traceback' not in proc.stderr
  assert output.read_bytes() == b'a trained encoder'
