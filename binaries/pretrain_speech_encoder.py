r"""Pre-trains the speech encoder on public speakers (not users' data).

  python -m binaries.make_speech_data --data_dir=out/speech_public \
    --voice_set=public --num_utterances=3900 --seed=1
  python -m binaries.pretrain_speech_encoder --data_dir=out/speech_public \
    --output=out/speech_encoder.npz [--epochs=6]

Then `binaries.train --task=speech_preference --encoder_weights=
out/speech_encoder.npz [--freeze_encoder]` starts the shared encoder there
(see `tff_personal/models/speech_encoder_pretraining.py`).
"""

import json
import os

from absl import app
from absl import flags

from tasks import speech_data
from tff_personal.models import fedembed_speech
from tff_personal.models import speech_encoder_pretraining as pretraining

FLAGS = flags.FLAGS


def define_flags():
  """Defines the binary's flags (called under __main__, not at import)."""
  flags.DEFINE_string('data_dir', None,
                      'A public-speaker set (make_speech_data '
                      '--voice_set=public).')
  flags.DEFINE_string('output', None, 'Where to write the encoder (.npz).')
  defaults = pretraining.PretrainConfig()
  flags.DEFINE_integer('epochs', defaults.epochs,
                       'Passes over the set (0: write the seeded, untrained '
                       'encoder, a control).')
  flags.DEFINE_integer('batch_size', defaults.batch_size, 'Batch size.')
  flags.DEFINE_float('learning_rate', defaults.learning_rate, 'Adam rate.')
  flags.DEFINE_float('validation_fraction', defaults.validation_fraction,
                     'Utterances held out to report speaker accuracy.')
  flags.DEFINE_integer('seed', defaults.seed, 'Seed of split and weights.')
  flags.DEFINE_bool('overwrite', False,
                    'Replace an existing --output (refused otherwise).')
  flags.mark_flags_as_required(['data_dir', 'output'])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  if os.path.exists(FLAGS.output) and not FLAGS.overwrite:
    raise app.UsageError(
        f'--output={FLAGS.output} exists (a trained encoder?); pass '
        '--overwrite to replace it, or choose another path')
  try:
    data = speech_data.load(FLAGS.data_dir)
  except speech_data.SpeechDataError as e:
    raise app.UsageError(str(e)) from e
  voice_set = data.manifest['config'].get('voice_set', 'users')
  if voice_set != 'public':
    raise app.UsageError(
        f'{FLAGS.data_dir} holds the users\' voices (voice_set={voice_set!r}); '
        'pre-training must use public speakers: make a set with '
        '`python -m binaries.make_speech_data --voice_set=public ...`')
  config = pretraining.PretrainConfig(
      epochs=FLAGS.epochs, batch_size=FLAGS.batch_size,
      learning_rate=FLAGS.learning_rate,
      validation_fraction=FLAGS.validation_fraction, seed=FLAGS.seed)
  encoder, metrics = pretraining.pretrain(
      data.spectrograms, data.voices, data.num_voices, config)
  metrics['data_dir'] = FLAGS.data_dir
  metrics['data_sha256'] = data.manifest['sha256']
  fedembed_speech.save_encoder_weights(FLAGS.output, encoder, metrics)
  print(json.dumps({k: metrics[k] for k in (
      'val_accuracy', 'chance', 'untrained', 'seconds')}, indent=1))
  print(f'wrote {FLAGS.output}')


if __name__ == '__main__':
  define_flags()
  app.run(main)
