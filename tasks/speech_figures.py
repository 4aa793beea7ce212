"""Pictures of the speech data: spectrograms per voice, voice parameters."""

from __future__ import annotations

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
import numpy as np

from tasks import speech_data  # pylint: disable=g-import-not-at-top
from tasks import speech_spectrogram
from tasks import speech_voices


def plot_spectrograms(data: speech_data.SpeechData, path: str,
                      voices: tuple[int, ...] = (0, 1, 18, 19),
                      per_voice: int = 2) -> None:
  """A grid of spectrograms: a row per voice, `per_voice` utterances each.

  The voices default to two close pairs (0/1 mix the same two bases at
  t = 0.25 / 0.75, 18/19 at 0.45 / 0.55).
  """
  fig, axes = plt.subplots(len(voices), per_voice,
                           figsize=(4.2 * per_voice, 1.9 * len(voices)),
                           squeeze=False, sharex=True, sharey=True)
  khz = speech_spectrogram.NUM_BINS * speech_spectrogram.BIN_HZ / 1000
  seconds = speech_spectrogram.NUM_FRAMES * (
      speech_spectrogram.FRAME_STEP / speech_spectrogram.SAMPLE_RATE)
  for row, voice in enumerate(voices):
    idx = np.flatnonzero(data.voices == voice)[:per_voice]
    for col in range(per_voice):
      ax = axes[row, col]
      if col < len(idx):
        image = speech_spectrogram.dequantize_db(data.spectrograms[idx[col]])
        ax.imshow(image, origin='lower', aspect='auto', cmap='magma',
                  extent=(0, seconds, 0, khz),
                  vmin=speech_spectrogram.DB_MIN,
                  vmax=speech_spectrogram.DB_MAX)
        text = data.texts[idx[col]]
        ax.set_title(text if len(text) < 48 else text[:45] + '...',
                     fontsize=7)
      a, b, t = speech_voices.VOICE_RECIPES[voice]
      if col == 0:
        ax.set_ylabel(f'voice {voice}\n{a}/{b} t={t}\nkHz', fontsize=7)
      if row == len(voices) - 1:
        ax.set_xlabel('s', fontsize=7)
      ax.tick_params(labelsize=6)
  fig.suptitle('Log-magnitude spectrograms (dB, 200 bins x 375 frames)',
               fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=80)
  plt.close(fig)


def plot_voice_map(path: str) -> None:
  """Pitch base vs. formant-1 frequency of the base and the mixed voices."""
  bases = speech_voices.base_voice_params()
  mixed = speech_voices.voice_params(bases)
  fig, ax = plt.subplots(figsize=(5.5, 4.2))
  for name, p in bases.items():
    ax.scatter(p.pitch[0], p.formants[1][0], marker='s', color='k')
    ax.annotate(name, (p.pitch[0], p.formants[1][0]), fontsize=8,
                xytext=(3, 3), textcoords='offset points')
  for v, p in enumerate(mixed):
    ax.scatter(p.pitch[0], p.formants[1][0], color='tab:orange')
    ax.annotate(str(v), (p.pitch[0], p.formants[1][0]), fontsize=7,
                color='tab:orange', xytext=(3, -9), textcoords='offset points')
  ax.set_xlabel('pitch base (Hz)')
  ax.set_ylabel('formant 1 frequency (% of default)')
  ax.set_title('Base voices (black) and the 20 mixed voices', fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
