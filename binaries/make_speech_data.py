r"""Generates the synthetic speech-preference data set once, into a cache dir.

  python -m binaries.make_speech_data --data_dir=out/speech_data \
    [--text_root=../shared/data] [--num_utterances=12420] [--seed=0] \
    [--workers=2] [--wav_samples=20] [--figures_dir=docs/figures]

Speaks `num_utterances` sentences of WikiText-2 and Shakespeare with 20
espeak-ng voices and stores their log-magnitude spectrograms (see
`tasks/speech_data.py`). Rerunning with the same settings does nothing;
`--wav_samples=N` (also on an existing cache) writes N listening WAV files,
the first utterance of each voice in turn, to <data_dir>/listening/;
`--figures_dir` draws speech_spectrograms.png (two close voice pairs) and
speech_voices.png (the voices' pitch and first formant) there.
`--voice_set=public --num_utterances=3900 --seed=1` makes the public-speaker
set that `binaries.pretrain_speech_encoder` pre-trains an encoder on.
Needs espeak-ng (`sudo apt-get install espeak-ng`).
"""

import os

from absl import app
from absl import flags

from tasks import speech_data
from tasks import speech_figures
from tasks import speech_text

FLAGS = flags.FLAGS


def define_flags():
  """Defines the binary's flags (called under __main__, not at import)."""
  flags.DEFINE_string('data_dir', None, 'Cache directory to generate into.')
  flags.DEFINE_string(
      'text_root', os.path.join('..', 'shared', 'data'),
      'Folder holding wikitext2/ and shakespeare/.')
  flags.DEFINE_integer(
      'num_utterances', speech_data.DEFAULT_NUM_UTTERANCES,
      'Number of utterances (the paper: 12,420).')
  flags.DEFINE_integer('seed', 0, 'Seed of texts, voices, jitter.')
  flags.DEFINE_enum(
      'voice_set', 'users', ['users', 'public'],
      "'users': the task's 20 voices; 'public': public speakers (not users) "
      'for binaries.pretrain_speech_encoder, in their own --data_dir.')
  flags.DEFINE_integer('min_words', speech_text.MIN_WORDS,
                       'Fewest words of a sentence.')
  flags.DEFINE_integer('max_words', speech_text.MAX_WORDS,
                       'Most words of a sentence.')
  flags.DEFINE_integer('workers', None,
                       'espeak-ng processes at once (default: CPUs).')
  flags.DEFINE_integer(
      'wav_samples', 0, 'Listening WAV files to write after generation.')
  flags.DEFINE_string(
      'figures_dir', None, 'If set, spectrogram and voice pictures go here.')
  flags.mark_flag_as_required('data_dir')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  if FLAGS.wav_samples < 0:
    raise app.UsageError('--wav_samples must be >= 0')
  if FLAGS.workers is not None and FLAGS.workers < 1:
    raise app.UsageError('--workers must be >= 1')
  config = speech_data.GenerationConfig(
      num_utterances=FLAGS.num_utterances, seed=FLAGS.seed,
      min_words=FLAGS.min_words, max_words=FLAGS.max_words,
      voice_set=FLAGS.voice_set)
  speech_data.generate(FLAGS.data_dir, FLAGS.text_root, config,
                       workers=FLAGS.workers)
  if FLAGS.wav_samples:
    speech_data.write_listening_samples(FLAGS.data_dir, FLAGS.wav_samples)
  if FLAGS.figures_dir:
    os.makedirs(FLAGS.figures_dir, exist_ok=True)
    data = speech_data.load(FLAGS.data_dir)
    for name, draw in [
        ('speech_spectrograms.png',
         lambda p: speech_figures.plot_spectrograms(data, p)),
        ('speech_voices.png', speech_figures.plot_voice_map)]:
      path = os.path.join(FLAGS.figures_dir, name)
      draw(path)
      print(f'wrote {path}')


if __name__ == '__main__':
  define_flags()
  app.run(main)
