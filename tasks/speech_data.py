"""The synthetic speech data set: generation into a cache dir, and loading.

`generate(data_dir, ...)` draws `num_utterances` sentences (`speech_text`),
gives utterance i the voice `voices[i]` (a seeded permutation of
`i mod NUM_VOICES`, so every voice speaks the same number of utterances,
621 of the default 12,420) and a seeded rendition jitter
(`speech_voices.sample_renditions`), speaks it with espeak-ng and stores its
quantized log-magnitude spectrogram (`speech_spectrogram`). Everything is a
function of `seed` (and of the espeak-ng version, recorded in the manifest).

Parallelism: espeak-ng runs as a subprocess per utterance, so a thread pool
(`workers` threads; the GIL is released while they wait) keeps all cores busy
without a process pool; the spectrograms of each chunk are computed in one
batched `tf.signal.stft` call in the main thread.

Cache layout (`data_dir`):
  spectrograms.npy  uint8 (N, 200, 375), scale in `speech_spectrogram`
  utterances.tsv    index, voice, pitch_adjust, wpm, amplitude, seconds, text
  manifest.json     the generation settings, shapes, scale, espeak-ng
                    version, sha256 of spectrograms.npy, generation time;
                    written last (atomically): a cache without it is
                    incomplete and is regenerated
  espeak_root/      the espeak-ng data root with the voice variants (the
                    20 user voices and the public ones)

`GenerationConfig(voice_set='public')` speaks with the public speakers
(`speech_voices.PUBLIC_RECIPES`, none of them a user voice or one of its
bases) instead: the data `binaries/pretrain_speech_encoder.py` pre-trains the
encoder on, in its own cache directory.
  listening/        WAV files written by `write_listening_samples`
"""

from __future__ import annotations

import concurrent.futures
import csv
import dataclasses
import hashlib
import json
import os
import time
from typing import Callable

import numpy as np

from tasks import speech_spectrogram
from tasks import speech_text
from tasks import speech_voices
from tff_personal.core import atomic_io

DEFAULT_NUM_UTTERANCES = 12420
SPECTROGRAMS = 'spectrograms.npy'
UTTERANCES = 'utterances.tsv'
MANIFEST = 'manifest.json'
ESPEAK_ROOT = 'espeak_root'
LISTENING = 'listening'
FORMAT_VERSION = 1


class SpeechDataError(ValueError):
  """A missing, incomplete or inconsistent data set; the message says why."""


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
  """What determines the generated data (besides the espeak-ng version)."""
  num_utterances: int = DEFAULT_NUM_UTTERANCES
  seed: int = 0
  min_words: int = speech_text.MIN_WORDS
  max_words: int = speech_text.MAX_WORDS
  # 'users': the task's 20 voices; 'public': public speakers for encoder
  # pre-training (speech_voices.PUBLIC_RECIPES), never a user's voice.
  voice_set: str = 'users'

  def validate(self):
    speech_voices.check_voice_set(self.voice_set)
    count = speech_voices.num_voices(self.voice_set)
    if (isinstance(self.num_utterances, bool) or
        not isinstance(self.num_utterances, int) or
        self.num_utterances < count):
      raise ValueError(
          f'num_utterances must be an int >= {count} (one per voice at '
          f'least), got {self.num_utterances!r}')
    if isinstance(self.seed, bool) or not isinstance(self.seed, int):
      raise ValueError(f'seed must be an int, got {self.seed!r}')


@dataclasses.dataclass(frozen=True)
class Plan:
  """What every utterance will be: its text, voice and rendition."""
  texts: list[str]
  voices: np.ndarray
  renditions: list[speech_voices.Rendition]


def make_plan(config: GenerationConfig, text_root: str) -> Plan:
  """Draws texts, voices and renditions from `config.seed`."""
  config.validate()
  rng = np.random.default_rng(config.seed)
  pool = speech_text.sentence_pool(text_root, config.min_words,
                                   config.max_words)
  texts = speech_text.choose_sentences(pool, config.num_utterances, rng)
  voices = rng.permutation(
      np.arange(config.num_utterances) %
      speech_voices.num_voices(config.voice_set)).astype(
          np.int32)
  renditions = speech_voices.sample_renditions(config.num_utterances, rng)
  return Plan(texts=texts, voices=voices, renditions=renditions)


def _sha256(path: str) -> str:
  digest = hashlib.sha256()
  with open(path, 'rb') as f:
    for block in iter(lambda: f.read(1 << 22), b''):
      digest.update(block)
  return digest.hexdigest()


def read_manifest(data_dir: str) -> dict | None:
  path = os.path.join(data_dir, MANIFEST)
  if not os.path.isfile(path):
    return None
  with open(path, encoding='utf-8') as f:
    return json.load(f)


def _config_of(manifest: dict) -> GenerationConfig:
  return GenerationConfig(**manifest['config'])


def generate(data_dir: str, text_root: str,
             config: GenerationConfig = GenerationConfig(), *,
             workers: int | None = None, chunk_size: int = 256,
             log_fn: Callable[[str], None] = print) -> dict:
  """Generates the data set into `data_dir` (a no-op if already there).

  Args:
    data_dir: The cache directory.
    text_root: The folder holding `wikitext2/` and `shakespeare/`.
    config: What to generate.
    workers: espeak-ng processes running at once (default: CPU count).
    chunk_size: Utterances per spectrogram batch and progress line.
    log_fn: Receives progress lines.

  Returns:
    The manifest.

  Raises:
    SpeechDataError: `data_dir` holds a different data set (another config).
    speech_voices.EspeakNotFoundError: espeak-ng is not installed.
  """
  config.validate()
  existing = read_manifest(data_dir)
  if existing is not None:
    if _config_of(existing) != config:
      raise SpeechDataError(
          f'{data_dir} already holds a speech data set generated with '
          f'{_config_of(existing)}, not {config}; use another --data_dir or '
          'delete it.')
    log_fn(f'speech data already generated in {data_dir} '
           f'({existing["num_utterances"]} utterances); nothing to do.')
    return existing
  workers = workers or os.cpu_count() or 1
  os.makedirs(data_dir, exist_ok=True)
  start = time.time()
  plan = make_plan(config, text_root)
  root = speech_voices.prepare_espeak_root(os.path.join(data_dir, ESPEAK_ROOT))
  n = config.num_utterances
  partial = os.path.join(data_dir, SPECTROGRAMS + '.partial')
  out = np.lib.format.open_memmap(
      partial, mode='w+', dtype=np.uint8, shape=(n, *speech_spectrogram.SHAPE))
  seconds = np.zeros(n, np.float64)
  log_fn(f'generating {n} utterances into {data_dir} with {workers} espeak-ng '
         f'workers (espeak-ng {speech_voices.espeak_version()}) ...')
  speak = lambda i: speech_voices.synthesize(
      plan.texts[i], int(plan.voices[i]), root, plan.renditions[i],
      voice_set=config.voice_set)
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    for lo in range(0, n, chunk_size):
      hi = min(lo + chunk_size, n)
      waves = []
      for i, (samples, rate) in zip(range(lo, hi),
                                    pool.map(speak, range(lo, hi))):
        if rate != speech_spectrogram.SAMPLE_RATE:
          raise speech_voices.EspeakError(
              f'espeak-ng produced {rate} Hz audio; expected '
              f'{speech_spectrogram.SAMPLE_RATE} Hz')
        seconds[i] = samples.shape[0] / rate
        waves.append(samples)
      out[lo:hi] = speech_spectrogram.spectrograms(waves)
      elapsed = time.time() - start
      log_fn(f'  {hi}/{n} utterances, {elapsed:.0f} s elapsed, '
             f'~{elapsed / hi * (n - hi):.0f} s to go')
  out.flush()
  del out
  final = os.path.join(data_dir, SPECTROGRAMS)
  os.replace(partial, final)
  _write_utterances(os.path.join(data_dir, UTTERANCES), plan, seconds)
  rate = speech_spectrogram.SAMPLE_RATE
  frames_untrimmed = np.asarray(
      [speech_spectrogram.num_frames(int(round(s * rate))) for s in seconds])
  frames = np.minimum(frames_untrimmed, speech_spectrogram.NUM_FRAMES)
  manifest = {
      'format_version': FORMAT_VERSION,
      'config': dataclasses.asdict(config),
      'num_utterances': n,
      'num_voices': speech_voices.num_voices(config.voice_set),
      'shape': list(speech_spectrogram.SHAPE),
      'dtype': 'uint8',
      'db_min': speech_spectrogram.DB_MIN,
      'db_max': speech_spectrogram.DB_MAX,
      'sample_rate': speech_spectrogram.SAMPLE_RATE,
      'frame_length': speech_spectrogram.FRAME_LENGTH,
      'frame_step': speech_spectrogram.FRAME_STEP,
      'fft_length': speech_spectrogram.FFT_LENGTH,
      'espeak_ng_version': speech_voices.espeak_version(),
      'voice_recipes': [list(r) for r in
                        speech_voices.recipes(config.voice_set)],
      'seconds_mean': float(seconds.mean()),
      'seconds_min': float(seconds.min()),
      'seconds_max': float(seconds.max()),
      'fraction_trimmed': float(np.mean(
          frames_untrimmed > speech_spectrogram.NUM_FRAMES)),
      'frames_mean': float(np.mean(frames)),
      'workers': workers,
      'text_root': os.path.abspath(text_root),
      'generation_seconds': time.time() - start,
      'sha256': _sha256(final),
  }
  with atomic_io.atomic_write(os.path.join(data_dir, MANIFEST)) as f:
    f.write(json.dumps(manifest, indent=1) + '\n')
  log_fn(f'done in {manifest["generation_seconds"]:.0f} s; utterances '
         f'{manifest["seconds_min"]:.1f}-{manifest["seconds_max"]:.1f} s '
         f'(mean {manifest["seconds_mean"]:.2f} s, '
         f'{100 * manifest["fraction_trimmed"]:.0f}% trimmed to 375 frames)')
  return manifest


def _write_utterances(path: str, plan: Plan, seconds: np.ndarray) -> None:
  tmp = path + '.tmp'
  with open(tmp, 'w', encoding='utf-8', newline='') as f:
    writer = csv.writer(f, delimiter='\t', lineterminator='\n')
    writer.writerow(['index', 'voice', 'pitch_adjust', 'wpm', 'amplitude',
                     'seconds', 'text'])
    for i, (text, voice, r) in enumerate(
        zip(plan.texts, plan.voices, plan.renditions)):
      writer.writerow([i, int(voice), r.pitch_adjust, r.words_per_minute,
                       r.amplitude, f'{seconds[i]:.3f}', text])
  os.replace(tmp, path)


@dataclasses.dataclass(frozen=True, eq=False)
class SpeechData:
  """A generated data set.

  Attributes:
    spectrograms: uint8 (N, 200, 375), memory-mapped.
    voices: int32 (N,) the voice of each utterance.
    texts: the N sentences.
    manifest: the manifest dict.
  """
  spectrograms: np.ndarray
  voices: np.ndarray
  texts: list[str]
  manifest: dict

  @property
  def num_voices(self) -> int:
    return int(self.manifest['num_voices'])


def _read_utterances(data_dir: str) -> list[dict[str, str]]:
  if read_manifest(data_dir) is None:
    raise SpeechDataError(
        f'no generated speech data in {data_dir!r} ({MANIFEST} missing). '
        'Generate it once with `python -m binaries.make_speech_data '
        f'--data_dir={data_dir}` (needs espeak-ng).')
  with open(os.path.join(data_dir, UTTERANCES), encoding='utf-8',
            newline='') as f:
    return list(csv.DictReader(f, delimiter='\t'))


def load(data_dir: str) -> SpeechData:
  """Loads a generated data set; a clear error if absent or inconsistent."""
  rows = _read_utterances(data_dir)
  manifest = read_manifest(data_dir)
  if manifest.get('format_version') != FORMAT_VERSION:
    raise SpeechDataError(f'{data_dir}: format_version '
                          f'{manifest.get("format_version")}, expected '
                          f'{FORMAT_VERSION}; regenerate it.')
  spectrograms = np.load(os.path.join(data_dir, SPECTROGRAMS), mmap_mode='r')
  expected = (manifest['num_utterances'], *speech_spectrogram.SHAPE)
  if spectrograms.shape != expected or spectrograms.dtype != np.uint8:
    raise SpeechDataError(
        f'{data_dir}/{SPECTROGRAMS} is {spectrograms.dtype} '
        f'{spectrograms.shape}, expected uint8 {expected}')
  voices = [int(row['voice']) for row in rows]
  texts = [row['text'] for row in rows]
  if len(voices) != expected[0]:
    raise SpeechDataError(f'{data_dir}/{UTTERANCES} has {len(voices)} rows, '
                          f'expected {expected[0]}')
  return SpeechData(spectrograms=spectrograms,
                    voices=np.asarray(voices, np.int32), texts=texts,
                    manifest=manifest)


def write_listening_samples(data_dir: str, count: int,
                            log_fn: Callable[[str], None] = print
                            ) -> list[str]:
  """Re-speaks `count` utterances of a generated data set as WAV files.

  The first utterance of each voice in turn (voice 0, 1, ..., then the
  second of each), exactly as generated (the text, voice and rendition of
  `utterances.tsv`), into `data_dir/listening/voiceVV_uttI.wav`.

  Args:
    data_dir: A generated data set.
    count: Number of WAV files.
    log_fn: Receives the written paths.

  Returns:
    The paths written.
  """
  rows = _read_utterances(data_dir)
  voice_set = _config_of(read_manifest(data_dir)).voice_set
  root = speech_voices.prepare_espeak_root(os.path.join(data_dir, ESPEAK_ROOT))
  out_dir = os.path.join(data_dir, LISTENING)
  os.makedirs(out_dir, exist_ok=True)
  voices = np.asarray([int(r['voice']) for r in rows])
  by_voice = [np.flatnonzero(voices == v)
              for v in range(speech_voices.num_voices(voice_set))]
  order = [int(idx[k]) for k in range(max(len(i) for i in by_voice))
           for idx in by_voice if k < len(idx)]
  paths = []
  for i in order[:count]:
    row = rows[i]
    rendition = speech_voices.Rendition(
        int(row['pitch_adjust']), int(row['wpm']), int(row['amplitude']))
    samples, rate = speech_voices.synthesize(
        row['text'], int(row['voice']), root, rendition, voice_set=voice_set)
    path = os.path.join(out_dir, f'voice{int(row["voice"]):02d}_utt{i}.wav')
    speech_voices.write_wav(path, samples, rate)
    log_fn(f'  wrote {path}: voice {row["voice"]}, '
           f'{samples.shape[0] / rate:.1f} s, "{row["text"]}"')
    paths.append(path)
  return paths
