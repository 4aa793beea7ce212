"""Tests for the synthetic speech data: voices, spectrograms, generation."""

import hashlib
import os
import shutil
import wave

import numpy as np
import pytest

from tasks import speech_data
from tasks import speech_spectrogram
from tasks import speech_text
from tasks import speech_voices

SHARED_DATA = os.path.abspath(
    os.path.join(os.path.dirname(__file__), '..', '..', 'shared', 'data'))

needs_espeak = pytest.mark.skipif(
    shutil.which('espeak-ng') is None,
    reason='espeak-ng is not installed (sudo apt-get install espeak-ng)')
needs_text = pytest.mark.skipif(
    not os.path.isdir(os.path.join(SHARED_DATA, 'shakespeare')),
    reason=f'no wikitext2/shakespeare under {SHARED_DATA}')

TINY = speech_data.GenerationConfig(num_utterances=40, seed=3, min_words=3,
                                    max_words=6)

M1 = """language variant
name male1
pitch 75 109
flutter 5
formant 0  98 100 100
formant 2  97  95 100 40
"""
F1 = """language variant
name female1
pitch 140 200
speed 110
roughness 4
formant 1 120  80 180
formant 2 100  70 150  150
"""


def test_parse_variant_fills_documented_defaults():
  p = speech_voices.parse_variant(M1)
  assert p.pitch == (75.0, 109.0)
  assert p.speed == speech_voices.DEFAULT_SPEED
  assert p.formants[0] == (98.0, 100.0, 100.0, 0.0)
  assert p.formants[1] == speech_voices.DEFAULT_FORMANT
  assert p.formants[2] == (97.0, 95.0, 100.0, 40.0)
  assert p.quality == ('flutter 5',)
  with pytest.raises(ValueError, match='formant'):
    speech_voices.parse_variant('formant 12 100 100 100')


def test_interpolation_endpoints_midpoint_and_quality():
  a, b = speech_voices.parse_variant(M1), speech_voices.parse_variant(F1)
  np.testing.assert_allclose(speech_voices.interpolate(a, b, 0.0).vector(),
                             a.vector())
  np.testing.assert_allclose(speech_voices.interpolate(a, b, 1.0).vector(),
                             b.vector())
  mid = speech_voices.interpolate(a, b, 0.5)
  np.testing.assert_allclose(mid.vector(), (a.vector() + b.vector()) / 2)
  assert mid.pitch == (107.5, 154.5) and mid.speed == 105.0
  assert speech_voices.interpolate(a, b, 0.4).quality == a.quality
  assert speech_voices.interpolate(a, b, 0.6).quality == b.quality
  with pytest.raises(ValueError, match='t must be'):
    speech_voices.interpolate(a, b, 1.5)


def test_variant_file_round_trip():
  p = speech_voices.interpolate(speech_voices.parse_variant(M1),
                                speech_voices.parse_variant(F1), 0.3)
  back = speech_voices.parse_variant(speech_voices.to_variant_file('v', p))
  np.testing.assert_allclose(back.vector(), np.round(p.vector()), atol=0)
  assert back.quality == p.quality


@needs_espeak
def test_close_pairs_are_closer_than_typical():
  voices = speech_voices.voice_params(speech_voices.base_voice_params())
  assert len(voices) == speech_voices.NUM_VOICES == 20
  vectors = np.stack([v.vector() for v in voices])
  scale = vectors.std(axis=0) + 1e-9
  d = np.linalg.norm((vectors[:, None] - vectors[None]) / scale, axis=-1)
  typical = np.median(d[np.triu_indices(20, 1)])
  for u, v in [(8, 9), (10, 11), (18, 19)]:
    assert d[u, v] < 0.5 * typical, (u, v, d[u, v], typical)
  assert len({tuple(np.round(v, 6)) for v in vectors}) == 20  # All distinct.


def _f0(samples, rate):
  """Median autocorrelation pitch (Hz) over loud 40 ms frames."""
  x = speech_spectrogram.waveform_to_float(samples)
  n = int(0.04 * rate)
  estimates = []
  for start in range(0, x.shape[0] - n, n):
    frame = x[start:start + n] - x[start:start + n].mean()
    if np.sqrt(np.mean(frame ** 2)) < 0.05:
      continue
    ac = np.correlate(frame, frame, 'full')[n - 1:]
    lo, hi = int(rate / 400), int(rate / 50)  # 50 to 400 Hz.
    estimates.append(rate / (lo + np.argmax(ac[lo:hi])))
  return float(np.median(estimates))


@needs_espeak
def test_voice_files_reach_the_audio(tmp_path):
  root = speech_voices.prepare_espeak_root(str(tmp_path / 'root'))
  params = speech_voices.voice_params(speech_voices.base_voice_params())
  low = int(np.argmin([p.pitch[0] for p in params]))
  high = int(np.argmax([p.pitch[0] for p in params]))
  text = 'Now is the winter of our discontent made glorious summer.'
  f_low = _f0(*speech_voices.synthesize(text, low, root))
  f_high = _f0(*speech_voices.synthesize(text, high, root))
  # espeak-ng's pitch line sets the base f0; the intonation moves around it.
  ratio = params[high].pitch[0] / params[low].pitch[0]
  assert f_high / f_low > 0.6 * ratio > 1.0, (f_low, f_high, ratio)
  samples, rate = speech_voices.synthesize(text, low, root)
  again, _ = speech_voices.synthesize(text, low, root)
  assert rate == speech_spectrogram.SAMPLE_RATE
  np.testing.assert_array_equal(samples, again)  # Deterministic.


def test_spectrogram_of_a_sine_peaks_at_its_bin():
  rate = speech_spectrogram.SAMPLE_RATE
  t = np.arange(int(4.0 * rate)) / rate
  freq = 30 * speech_spectrogram.BIN_HZ  # Exactly bin 30.
  sine = (0.5 * 32767 * np.sin(2 * np.pi * freq * t)).astype(np.int16)
  q = speech_spectrogram.spectrograms([sine])
  assert q.shape == (1, 200, 375) and q.dtype == np.uint8
  assert (np.argmax(q[0], axis=0) == 30).all()
  # Hann window: |X| = amplitude * sum(window) / 2 = 0.5 * 256 / 2 = 64.
  peak_db = speech_spectrogram.dequantize_db(q[0, 30]).mean()
  step = (speech_spectrogram.DB_MAX - speech_spectrogram.DB_MIN) / 255
  assert abs(peak_db - 20 * np.log10(64)) < step


def test_spectrogram_pads_with_silence_and_ignores_its_batch():
  rng = np.random.default_rng(0)
  short = rng.integers(-3000, 3000, 22050).astype(np.int16)  # 1 s
  long = rng.integers(-3000, 3000, 5 * 22050).astype(np.int16)
  alone = speech_spectrogram.spectrograms([short])[0]
  frames = speech_spectrogram.num_frames(short.shape[0])
  assert 95 <= frames <= 100
  assert (alone[:, frames:] == 0).all() and (alone[:, :frames] > 0).all()
  np.testing.assert_array_equal(
      speech_spectrogram.spectrograms([long, short])[1], alone)
  db = np.linspace(-80, 50, 1000).astype(np.float32)
  back = speech_spectrogram.dequantize_db(
      speech_spectrogram.quantize(db).numpy())
  step = (speech_spectrogram.DB_MAX - speech_spectrogram.DB_MIN) / 255
  clipped = np.clip(db, speech_spectrogram.DB_MIN, speech_spectrogram.DB_MAX)
  assert np.abs(back - clipped).max() <= step / 2 + 1e-4


@needs_text
def test_sentences_are_clean_and_sized():
  pool = speech_text.sentence_pool(SHARED_DATA, 7, 13)
  assert len(pool) >= speech_data.DEFAULT_NUM_UTTERANCES
  assert pool == sorted(set(pool))
  for s in pool[::97]:
    assert 7 <= len(s.split()) <= 13 and '<unk>' not in s and '@' not in s
  assert not speech_text.keep('It was 1999 and the weather was fine.')


@pytest.fixture(scope='module')
def tiny_dir(tmp_path_factory):
  if shutil.which('espeak-ng') is None:
    pytest.skip('espeak-ng is not installed (sudo apt-get install espeak-ng)')
  if not os.path.isdir(os.path.join(SHARED_DATA, 'shakespeare')):
    pytest.skip(f'no text data under {SHARED_DATA}')
  path = str(tmp_path_factory.mktemp('speech') / 'data')
  speech_data.generate(path, SHARED_DATA, TINY, workers=2, chunk_size=16,
                       log_fn=lambda s: None)
  return path


def test_generated_set(tiny_dir):
  data = speech_data.load(tiny_dir)
  assert data.spectrograms.shape == (40, 200, 375)
  np.testing.assert_array_equal(np.bincount(data.voices), np.full(20, 2))
  assert data.manifest['config']['seed'] == 3
  with open(os.path.join(tiny_dir, speech_data.SPECTROGRAMS), 'rb') as f:
    assert hashlib.sha256(f.read()).hexdigest() == data.manifest['sha256']
  # Every utterance has sound, and the spectrograms differ.
  assert (data.spectrograms.reshape(40, -1).max(axis=1) > 128).all()
  assert len({hashlib.md5(s.tobytes()).hexdigest()
              for s in data.spectrograms}) == 40


def test_generation_is_reproducible_and_idempotent(tiny_dir, tmp_path):
  logs = []
  manifest = speech_data.generate(tiny_dir, SHARED_DATA, TINY,
                                  log_fn=logs.append)
  assert 'nothing to do' in logs[0]
  other = str(tmp_path / 'again')
  again = speech_data.generate(other, SHARED_DATA, TINY, workers=1,
                               chunk_size=7, log_fn=lambda s: None)
  assert again['sha256'] == manifest['sha256']
  with pytest.raises(speech_data.SpeechDataError, match='already holds'):
    speech_data.generate(tiny_dir, SHARED_DATA,
                         speech_data.GenerationConfig(40, seed=4, min_words=3,
                                                      max_words=6))


def test_listening_samples_are_the_generated_utterances(tiny_dir):
  paths = speech_data.write_listening_samples(tiny_dir, 3,
                                              log_fn=lambda s: None)
  data = speech_data.load(tiny_dir)
  assert [os.path.basename(p)[:7] for p in paths] == [
      'voice00', 'voice01', 'voice02']
  for path in paths:
    with wave.open(path) as w:
      rate = w.getframerate()
      samples = np.frombuffer(w.readframes(w.getnframes()), '<i2')
    index = int(path.rsplit('_utt', 1)[1][:-4])
    np.testing.assert_array_equal(
        speech_spectrogram.spectrograms([samples])[0],
        data.spectrograms[index])
    assert rate == speech_spectrogram.SAMPLE_RATE


def test_missing_data_names_the_command(tmp_path):
  with pytest.raises(speech_data.SpeechDataError, match='make_speech_data'):
    speech_data.load(str(tmp_path))


def test_public_voices_are_none_of_the_users():
  assert not set(speech_voices.PUBLIC_BASES) & set(speech_voices.BASE_VOICES)
  assert speech_voices.num_voices('public') == len(
      speech_voices.PUBLIC_RECIPES) == len(set(speech_voices.PUBLIC_RECIPES))
  assert speech_voices.voice_name(3, 'public') != speech_voices.voice_name(3)
  with pytest.raises(ValueError, match='voice_set must be one of'):
    speech_voices.num_voices('private')
  with pytest.raises(ValueError, match='voice_set must be one of'):
    speech_data.GenerationConfig(voice_set='mine').validate()


@needs_espeak
@needs_text
def test_public_set_is_spoken_by_public_voices(tmp_path):
  count = speech_voices.NUM_PUBLIC_VOICES
  config = speech_data.GenerationConfig(num_utterances=count, seed=2,
                                        min_words=3, max_words=5,
                                        voice_set='public')
  path = str(tmp_path / 'public')
  speech_data.generate(path, SHARED_DATA, config, workers=2,
                       log_fn=lambda s: None)
  data = speech_data.load(path)
  assert data.num_voices == count
  np.testing.assert_array_equal(np.sort(data.voices), np.arange(count))
  assert data.manifest['config']['voice_set'] == 'public'
  # The variant files the audio came from: none is a user voice.
  system = speech_voices.espeak_data_dir()
  users = speech_voices.voice_params(speech_voices.base_voice_params(system))
  public = speech_voices.voice_params(
      speech_voices.base_voice_params(system, speech_voices.PUBLIC_BASES),
      'public')
  gap = min(np.linalg.norm(p.vector() - u.vector())
            for p in public for u in users)
  assert gap > 0
  with pytest.raises(ValueError, match=r'in \[0, 20\) \(users voices\)'):
    speech_voices.synthesize('Hello there.', 25, path)
