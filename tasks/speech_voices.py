"""Synthetic voices for the speech-preference task, made with espeak-ng.

The FedEmbed paper (section 4, Appendix B.2) builds 20 voices by
interpolating the parameterised voices of 8 LibriTTS speakers; that data set
was never released. This module builds the closest analogue this machine can
make with a real TTS engine, espeak-ng (a formant synthesiser):

* 8 *base voices* are espeak-ng's voice variants `m1 m3 m4 m6 m7 f1 f3 f5`
  (files in `espeak-ng-data/voices/!v/`), each given a speaking-rate percent
  of its own (`BASE_SPEED`: our addition; the variants all speak at the same
  rate, human speakers do not).
* Each of the 20 *voices* is `(base_a, base_b, t)`: its `pitch` (base and
  range, Hz), `speed` (percent) and every `formant` line (frequency, strength,
  width, freq_add: percentages of espeak-ng's defaults) are
  `(1 - t) * a + t * b`, with espeak-ng's documented defaults (pitch 82 118,
  formant 100 100 100 0, speed 100) where a base file omits a line. Voice
  quality lines that are not interpolable settings (flutter, roughness,
  echo, breath, voicing, consonants, stress and intonation) are copied from
  the nearer base (t < 0.5: a; otherwise b).
* Some voices are deliberately close (`VOICE_RECIPES`): pairs mixing the same
  two bases at t and 1 - t, and three pairs only 0.1 or 0.2 apart in t, so the
  sub-populations are not trivially separable (the paper's point: "two
  different voice-types might be two different mixtures of the same source
  voices").

Each utterance also gets a small seeded jitter of espeak-ng's command-line
pitch adjustment (`-p`), rate (`-s`) and amplitude (`-a`), so a voice is a
distribution of renditions rather than one fixed pitch and loudness (LibriTTS
speakers vary too).

The voice files are written as espeak-ng *variants* into
`<cache>/espeak_root/espeak-ng-data/voices/!v/`, next to symlinks to the
installed data, and used with `--path=<cache>/espeak_root -v en-us+<name>`.
espeak-ng is a system package (`apt-get install espeak-ng`); everything here
raises `EspeakNotFoundError` with the install command when it is missing.
"""

from __future__ import annotations

import dataclasses
import io
import os
import re
import shutil
import subprocess
import wave

import numpy as np

LANGUAGE = 'en-us'
BASE_VOICES = ('m1', 'm3', 'm4', 'm6', 'm7', 'f1', 'f3', 'f5')
# Speaking rate of each base voice, percent of espeak-ng's (our addition).
BASE_SPEED = {'m1': 100, 'm3': 90, 'm4': 110, 'm6': 96, 'm7': 104,
              'f1': 108, 'f3': 94, 'f5': 102}

# The 20 voices: (base_a, base_b, t). Voice v is `VOICE_RECIPES[v]`.
VOICE_RECIPES = (
    ('m1', 'f1', 0.25), ('m1', 'f1', 0.75),    # 0, 1: one mixture, t / 1-t
    ('m3', 'f3', 0.3), ('m3', 'f3', 0.7),      # 2, 3
    ('m4', 'f5', 0.3), ('m4', 'f5', 0.7),      # 4, 5
    ('m6', 'm7', 0.3), ('m6', 'm7', 0.7),      # 6, 7
    ('m1', 'm4', 0.4), ('m1', 'm4', 0.6),      # 8, 9: close
    ('f1', 'f3', 0.4), ('f1', 'f3', 0.6),      # 10, 11: close
    ('m3', 'm6', 0.5), ('m7', 'f5', 0.5),      # 12, 13
    ('m1', 'm7', 0.5), ('f3', 'f5', 0.5),      # 14, 15
    ('m4', 'f1', 0.5), ('m6', 'f3', 0.5),      # 16, 17
    ('m3', 'm7', 0.45), ('m3', 'm7', 0.55),    # 18, 19: closest
)
NUM_VOICES = len(VOICE_RECIPES)

# Public speakers (not users): espeak-ng variants disjoint from BASE_VOICES,
# for pre-training a speech encoder on data that is not any user's (the role
# a public speaker corpus such as LibriTTS plays for a real system; see
# `tff_personal/models/speech_encoder_pretraining.py`). The public voices are
# these variants alone and mixtures of two of them, made as the user voices
# are (11 + 28 = 39 voices).
PUBLIC_BASES = ('m2', 'm5', 'm8', 'f2', 'f4', 'john', 'linda', 'paul',
                'steph', 'max', 'grandma')
PUBLIC_RECIPES = tuple(
    [(a, a, 0.0) for a in PUBLIC_BASES] +
    [(a, b, (0.3, 0.5, 0.7)[k % 3]) for k, (a, b) in enumerate(
        [(x, y) for i, x in enumerate(PUBLIC_BASES)
         for y in PUBLIC_BASES[i + 1:]][::2])])
NUM_PUBLIC_VOICES = len(PUBLIC_RECIPES)
VOICE_SETS = ('users', 'public')

# espeak-ng's documented defaults (docs/voices.md).
DEFAULT_PITCH = (82.0, 118.0)
DEFAULT_FORMANT = (100.0, 100.0, 100.0, 0.0)
DEFAULT_SPEED = 100.0
NUM_FORMANTS = 9  # formant 0..8

# Per-utterance jitter ranges (uniform), on espeak-ng's command line.
PITCH_ADJUST_RANGE = (44, 56)   # -p, default 50
WPM_RANGE = (165, 185)          # -s, default 175
AMPLITUDE_RANGE = (70, 130)     # -a, default 100

INSTALL_HINT = ('espeak-ng is not installed. Install it with '
                '`sudo apt-get install -y --no-install-recommends espeak-ng` '
                '(Debian/Ubuntu; `bash scripts/setup_env.sh` does this when '
                'run as root), or put an `espeak-ng` binary on the PATH.')

_INTERPOLATED = ('pitch', 'formant', 'speed')
_IDENTITY = ('language', 'name', 'gender')


class EspeakNotFoundError(RuntimeError):
  """espeak-ng is missing; the message says how to install it."""


class EspeakError(RuntimeError):
  """espeak-ng failed on an input; the message names it."""


@dataclasses.dataclass(frozen=True)
class VoiceParams:
  """The settings of one espeak-ng variant.

  Attributes:
    pitch: (base Hz, range) of the `pitch` line.
    formants: NUM_FORMANTS x (frequency %, strength %, width %, freq_add Hz).
    speed: the `speed` percent.
    quality: the other attribute lines, verbatim (not interpolated).
  """
  pitch: tuple[float, float] = DEFAULT_PITCH
  formants: tuple[tuple[float, float, float, float], ...] = (
      (DEFAULT_FORMANT,) * NUM_FORMANTS)
  speed: float = DEFAULT_SPEED
  quality: tuple[str, ...] = ()

  def vector(self) -> np.ndarray:
    """The interpolated settings as one float vector (for distances)."""
    return np.asarray([*self.pitch, self.speed,
                       *np.ravel(self.formants)], np.float64)


def parse_variant(text: str, speed: float = DEFAULT_SPEED) -> VoiceParams:
  """Parses an espeak-ng voice-variant file.

  Args:
    text: The file's text.
    speed: The speed percent when the file has no `speed` line.

  Returns:
    Its `VoiceParams` (defaults for omitted pitch/formant/speed lines).

  Raises:
    ValueError: A pitch/formant/speed line is malformed.
  """
  pitch = DEFAULT_PITCH
  formants = [DEFAULT_FORMANT] * NUM_FORMANTS
  quality = []
  for raw in text.splitlines():
    line = raw.split('//', 1)[0].strip()
    if not line:
      continue
    key, *values = line.split()
    if key in _IDENTITY:
      continue
    if key not in _INTERPOLATED:
      quality.append(' '.join([key, *values]))
      continue
    try:
      numbers = [float(v) for v in values]
    except ValueError:
      raise ValueError(f'bad voice line {raw!r}: non-numeric value') from None
    if key == 'pitch':
      if len(numbers) != 2:
        raise ValueError(f'bad voice line {raw!r}: pitch needs 2 values')
      pitch = (numbers[0], numbers[1])
    elif key == 'speed':
      if len(numbers) != 1:
        raise ValueError(f'bad voice line {raw!r}: speed needs 1 value')
      speed = numbers[0]
    else:
      if not 4 <= len(numbers) <= 5 or not numbers[0].is_integer() or not (
          0 <= numbers[0] < NUM_FORMANTS):
        raise ValueError(f'bad voice line {raw!r}: expected `formant <0-8> '
                         '<freq> <strength> <width> [<freq_add>]`')
      formants[int(numbers[0])] = tuple(numbers[1:] + [0.0] * (
          5 - len(numbers)))
  return VoiceParams(pitch=pitch, formants=tuple(formants), speed=speed,
                     quality=tuple(quality))


def interpolate(a: VoiceParams, b: VoiceParams, t: float) -> VoiceParams:
  """`(1 - t) * a + t * b` for pitch, speed and formants (module docstring)."""
  if not 0.0 <= t <= 1.0:
    raise ValueError(f't must be in [0, 1], got {t}')
  mix = lambda x, y: tuple(float((1.0 - t) * u + t * v) for u, v in zip(x, y))
  return VoiceParams(
      pitch=mix(a.pitch, b.pitch),
      formants=tuple(mix(fa, fb) for fa, fb in zip(a.formants, b.formants)),
      speed=float((1.0 - t) * a.speed + t * b.speed),
      quality=a.quality if t < 0.5 else b.quality)


def voice_name(voice: int, voice_set: str = 'users') -> str:
  check_voice_set(voice_set)
  if voice_set == 'public':
    return f'tffp_public{voice:02d}'
  return f'tffp_voice{voice:02d}'


def check_voice_set(voice_set: str) -> None:
  if voice_set not in VOICE_SETS:
    raise ValueError(f'voice_set must be one of {VOICE_SETS}, got '
                     f'{voice_set!r}')


def num_voices(voice_set: str = 'users') -> int:
  """Voices of the set: NUM_VOICES (users) or NUM_PUBLIC_VOICES (public)."""
  check_voice_set(voice_set)
  return NUM_PUBLIC_VOICES if voice_set == 'public' else NUM_VOICES


def recipes(voice_set: str = 'users') -> tuple[tuple[str, str, float], ...]:
  check_voice_set(voice_set)
  return PUBLIC_RECIPES if voice_set == 'public' else VOICE_RECIPES


def to_variant_file(name: str, params: VoiceParams) -> str:
  """The espeak-ng variant file text for `params` (values rounded to ints)."""
  r = lambda x: str(int(round(x)))
  lines = ['language variant', f'name {name}',
           f'pitch {r(params.pitch[0])} {r(params.pitch[1])}',
           f'speed {r(params.speed)}']
  for k, (freq, strength, width, add) in enumerate(params.formants):
    lines.append(f'formant {k} {r(freq)} {r(strength)} {r(width)} {r(add)}')
  lines.extend(params.quality)
  return '\n'.join(lines) + '\n'


def espeak_binary() -> str:
  """The espeak-ng executable, or raises `EspeakNotFoundError`."""
  path = shutil.which('espeak-ng')
  if path is None:
    raise EspeakNotFoundError(INSTALL_HINT)
  return path


def espeak_data_dir() -> str:
  """The installed `espeak-ng-data` directory (from `espeak-ng --version`)."""
  out = subprocess.run([espeak_binary(), '--version'], capture_output=True,
                       text=True, check=True).stdout
  match = re.search(r'Data at:\s*(\S.*?)\s*$', out, re.MULTILINE)
  if not match or not os.path.isdir(match.group(1)):
    raise EspeakNotFoundError(
        f'cannot find espeak-ng-data from `espeak-ng --version`: {out!r}. '
        + INSTALL_HINT)
  return match.group(1)


def espeak_version() -> str:
  out = subprocess.run([espeak_binary(), '--version'], capture_output=True,
                       text=True, check=True).stdout
  match = re.search(r'text-to-speech:\s*(\S+)', out)
  return match.group(1) if match else out.strip()


def base_voice_params(data_dir: str | None = None,
                      names: tuple[str, ...] = BASE_VOICES
                      ) -> dict[str, VoiceParams]:
  """Base voices (default: the users' 8), parsed from the variant files.

  A base without its own rate in `BASE_SPEED` (the public ones) speaks at
  espeak-ng's default rate, before each utterance's jitter.
  """
  data_dir = data_dir or espeak_data_dir()
  out = {}
  for name in names:
    path = os.path.join(data_dir, 'voices', '!v', name)
    if not os.path.isfile(path):
      raise EspeakNotFoundError(
          f'espeak-ng variant {path} is missing (espeak-ng-data incomplete?). '
          + INSTALL_HINT)
    with open(path, encoding='utf-8', errors='replace') as f:
      out[name] = parse_variant(f.read(),
                                speed=BASE_SPEED.get(name, DEFAULT_SPEED))
  return out


def voice_params(bases: dict[str, VoiceParams], voice_set: str = 'users'
                 ) -> list[VoiceParams]:
  """The voices of the set, in `VOICE_RECIPES` (`PUBLIC_RECIPES`) order."""
  return [interpolate(bases[a], bases[b], t)
          for a, b, t in recipes(voice_set)]


def prepare_espeak_root(root: str) -> str:
  """Writes a private espeak-ng data root holding every voice variant.

  The 20 user voices and the NUM_PUBLIC_VOICES public ones.

  `<root>/espeak-ng-data/` gets symlinks to every entry of the installed data
  except `voices/`, whose `!v/` holds only our variant files. Idempotent.

  Args:
    root: A directory (created if needed).

  Returns:
    `root`, for `espeak-ng --path=<root>`.
  """
  system = espeak_data_dir()
  data = os.path.join(root, 'espeak-ng-data')
  variants = os.path.join(data, 'voices', '!v')
  os.makedirs(variants, exist_ok=True)
  for entry in os.listdir(system):
    if entry == 'voices':
      continue
    link = os.path.join(data, entry)
    if not os.path.lexists(link):
      os.symlink(os.path.join(system, entry), link)
  for voice_set, names in (('users', BASE_VOICES), ('public', PUBLIC_BASES)):
    bases = base_voice_params(system, names)
    for v, params in enumerate(voice_params(bases, voice_set)):
      name = voice_name(v, voice_set)
      with open(os.path.join(variants, name), 'w', encoding='utf-8') as f:
        f.write(to_variant_file(name, params))
  return root


@dataclasses.dataclass(frozen=True)
class Rendition:
  """The per-utterance command-line settings (see `sample_renditions`)."""
  pitch_adjust: int
  words_per_minute: int
  amplitude: int


def sample_renditions(count: int, rng: np.random.Generator
                      ) -> list[Rendition]:
  """`count` seeded jitters, uniform over the `*_RANGE` constants."""
  p = rng.integers(PITCH_ADJUST_RANGE[0], PITCH_ADJUST_RANGE[1] + 1, count)
  s = rng.integers(WPM_RANGE[0], WPM_RANGE[1] + 1, count)
  a = rng.integers(AMPLITUDE_RANGE[0], AMPLITUDE_RANGE[1] + 1, count)
  return [Rendition(int(x), int(y), int(z)) for x, y, z in zip(p, s, a)]


def synthesize(text: str, voice: int, root: str,
               rendition: Rendition = Rendition(50, 175, 100),
               timeout: float = 60.0, voice_set: str = 'users'
               ) -> tuple[np.ndarray, int]:
  """Speaks `text` with voice `voice` and returns its waveform.

  Args:
    text: The sentence.
    voice: Voice index in [0, num_voices(voice_set)).
    root: A root prepared by `prepare_espeak_root`.
    rendition: The command-line pitch adjustment, rate and amplitude.
    timeout: Seconds before espeak-ng is considered hung.
    voice_set: 'users' (the task's voices) or 'public' (public speakers).

  Returns:
    (int16 samples, sample rate in Hz).

  Raises:
    EspeakNotFoundError: No espeak-ng.
    EspeakError: espeak-ng failed or returned no audio.
  """
  count = num_voices(voice_set)
  if not 0 <= voice < count:
    raise ValueError(f'voice must be in [0, {count}) ({voice_set} voices), '
                     f'got {voice}')
  if not text.strip():
    raise ValueError('text is empty')
  cmd = [espeak_binary(), f'--path={root}', '-v',
         f'{LANGUAGE}+{voice_name(voice, voice_set)}', '-p', str(rendition.pitch_adjust),
         '-s', str(rendition.words_per_minute), '-a', str(rendition.amplitude),
         '--stdin', '--stdout']
  proc = subprocess.run(cmd, input=text.encode('utf-8'), capture_output=True,
                        timeout=timeout, check=False)
  if proc.returncode != 0 or len(proc.stdout) <= 44:
    raise EspeakError(
        f'espeak-ng failed (exit {proc.returncode}) on {text[:60]!r} with '
        f'voice {voice}: {proc.stderr.decode(errors="replace").strip()}')
  return read_wav_bytes(proc.stdout)


def read_wav_bytes(data: bytes) -> tuple[np.ndarray, int]:
  """Parses mono 16-bit WAV bytes (espeak-ng's `--stdout` header has a
  placeholder length, so the samples are whatever data follows it)."""
  with wave.open(io.BytesIO(data)) as w:
    if w.getnchannels() != 1 or w.getsampwidth() != 2:
      raise EspeakError(f'expected mono 16-bit audio, got '
                        f'{w.getnchannels()} channels, {w.getsampwidth()} '
                        'bytes per sample')
    rate = w.getframerate()
    frames = w.readframes(w.getnframes())
  return np.frombuffer(frames[:len(frames) // 2 * 2], '<i2').copy(), rate


def write_wav(path: str, samples: np.ndarray, rate: int) -> None:
  """Writes int16 mono samples as a WAV file."""
  with wave.open(path, 'wb') as w:
    w.setnchannels(1)
    w.setsampwidth(2)
    w.setframerate(rate)
    w.writeframes(np.asarray(samples, '<i2').tobytes())
