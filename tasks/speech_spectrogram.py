"""Log-magnitude spectrograms of utterances (tf.signal), stored as uint8.

Frames and bins (FedEmbed Appendix B.2 trims or pads every spectrogram to
200 x 375; the paper gives no frame settings, these are ours):

* espeak-ng speaks at 22,050 Hz. `tf.signal.stft` with a 512-sample Hann
  window (23.2 ms), a 220-sample hop (9.98 ms) and a 512-point FFT gives 257
  bins of 43.07 Hz; we keep the lowest `NUM_BINS` = 200 (0 to 8.57 kHz, where
  pitch, formants and most fricative energy are). An utterance of 3.75 s has
  375 frames (3 s: 298, 4 s: 398).
* The magnitude is in dB, `20 log10(max(|X|, 1e-6))`, of the waveform scaled
  to [-1, 1], clipped to [`DB_MIN`, `DB_MAX`] = [-60, 40] dB. A full-scale
  sine peaks near +42 dB with this window, espeak-ng's loudest frames reach
  about +35 dB, and -60 dB is below its quietest voiced sounds.
* Layout: [bins, frames] = [200, 375] (frequency as the image height, low
  frequencies first, time as the width), the last frames trimmed, or padded
  with silence (`DB_MIN`), to `NUM_FRAMES`.
* Storage: uint8 `q = round(255 * (dB - DB_MIN) / (DB_MAX - DB_MIN))`, a step
  of 0.39 dB (below the spectrogram's frame-to-frame variation). The model
  reads `q / 255`, i.e. dB mapped linearly onto [0, 1] (`to_unit`), as MNIST
  reads pixels. 12,420 x 200 x 375 bytes is 931 MB, against 3.7 GB as float32
  and 1.9 GB as float16.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

SAMPLE_RATE = 22050
FRAME_LENGTH = 512
FRAME_STEP = 220
FFT_LENGTH = 512
NUM_BINS = 200
NUM_FRAMES = 375
DB_MIN = -60.0
DB_MAX = 40.0
SHAPE = (NUM_BINS, NUM_FRAMES)
BIN_HZ = SAMPLE_RATE / FFT_LENGTH


def log_magnitude_db(waveforms: tf.Tensor) -> tf.Tensor:
  """dB magnitude spectrogram, [batch, samples] -> [batch, frames, 257]."""
  stft = tf.signal.stft(
      tf.convert_to_tensor(waveforms, tf.float32), frame_length=FRAME_LENGTH,
      frame_step=FRAME_STEP, fft_length=FFT_LENGTH,
      window_fn=tf.signal.hann_window, pad_end=False)
  magnitude = tf.abs(stft)
  return 20.0 * tf.math.log(tf.maximum(magnitude, 1e-6)) / tf.math.log(10.0)


def quantize(db: tf.Tensor) -> tf.Tensor:
  """dB -> uint8 on the fixed scale of the module docstring."""
  scaled = (tf.clip_by_value(db, DB_MIN, DB_MAX) - DB_MIN) / (DB_MAX - DB_MIN)
  return tf.cast(tf.round(scaled * 255.0), tf.uint8)


def dequantize_db(q: np.ndarray) -> np.ndarray:
  """uint8 -> dB (float32), the inverse of `quantize` up to half a step."""
  return (DB_MIN + np.asarray(q, np.float32) * np.float32(
      (DB_MAX - DB_MIN) / 255.0)).astype(np.float32)


def to_unit(q: np.ndarray) -> np.ndarray:
  """uint8 -> float32 in [0, 1] (the model's input scale)."""
  return np.asarray(q, np.float32) / np.float32(255.0)


def waveform_to_float(samples: np.ndarray) -> np.ndarray:
  """int16 samples -> float32 in [-1, 1)."""
  return np.asarray(samples, np.float32) / np.float32(32768.0)


def num_frames(num_samples: int) -> int:
  """Frames `log_magnitude_db` gives for `num_samples` samples."""
  if num_samples < FRAME_LENGTH:
    return 0
  return 1 + (num_samples - FRAME_LENGTH) // FRAME_STEP


def spectrograms(waveforms: list[np.ndarray]) -> np.ndarray:
  """Quantized [bins, frames] spectrograms of int16 waveforms (22,050 Hz).

  The batch is zero-padded to its longest waveform; every utterance is then
  trimmed or padded to `NUM_FRAMES` frames, padding being silence (uint8 0).

  Args:
    waveforms: int16 arrays of samples.

  Returns:
    uint8 (len(waveforms), NUM_BINS, NUM_FRAMES).
  """
  if not waveforms:
    return np.zeros((0, *SHAPE), np.uint8)
  longest = max(FRAME_LENGTH + FRAME_STEP * (NUM_FRAMES - 1),
                max(w.shape[0] for w in waveforms))
  batch = np.zeros((len(waveforms), longest), np.float32)
  for i, w in enumerate(waveforms):
    batch[i, :w.shape[0]] = waveform_to_float(w)
  q = quantize(log_magnitude_db(batch)[:, :NUM_FRAMES, :NUM_BINS]).numpy()
  q = np.transpose(q, (0, 2, 1))
  for i, w in enumerate(waveforms):
    q[i, :, num_frames(w.shape[0]):] = 0  # Frames past the end: silence.
  return np.ascontiguousarray(q)


def mean_loud_spectrum(q: np.ndarray) -> np.ndarray:
  """[n, 200, 375] uint8 spectrograms -> [n, 200] float32 in [0, 1].

  Each utterance's mean log-spectrum over its louder frames: those whose
  mean level over the bins is strictly above the utterance's median frame
  level (about the louder half; padding is silence at `DB_MIN`, so it is
  never counted). A fixed, hand-made feature with no learned parameter, on
  the model's input scale (`to_unit`); an utterance whose frames are all
  equally loud keeps all of them.
  """
  x = to_unit(q)
  if x.ndim != 3 or x.shape[1:] != SHAPE:
    raise ValueError(f'spectrograms must be [n, {NUM_BINS}, {NUM_FRAMES}], '
                     f'got {x.shape}')
  level = x.mean(axis=1)  # [n, frames]
  loud = level > np.median(level, axis=1, keepdims=True)
  loud[~loud.any(axis=1)] = True
  return (np.einsum('nbf,nf->nb', x, loud.astype(np.float32))
          / loud.sum(axis=1, keepdims=True)).astype(np.float32)
