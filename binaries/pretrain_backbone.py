r"""Pre-trains a small GPT-2 on public text and saves it as a keras-nlp preset.

  python -m binaries.pretrain_backbone --data_dir=../shared/data/wikitext2 \
    --output_dir=out/fedperc/backbone [--vocabulary_size=4096 --num_layers=3 \
    --hidden_dim=128 --minutes=20] \
    [--shakespeare_dir=../shared/data/shakespeare --max_steps=N]

FedPerC's backbone (the paper's DistilGPT2) cannot be downloaded here, so the
project trains its own: a byte-level BPE vocabulary learned on the training
text (`tff_personal/models/bpe_trainer.py`; keras-nlp has no trainer), then a
`keras_nlp.models.GPT2Backbone` trained on next-token prediction. The text is
public and not user data of the tv_shows task: WikiText-2 (`valid.txt` and all
but the last `--heldout_paragraphs` paragraphs of `test.txt` train; the rest
measure held-out perplexity) and, with `--shakespeare_dir`, the Moby
Shakespeare's speeches (dialogue; the last `--heldout_speeches` held out, or
every speech of the plays `--heldout_contexts` names). The
output directory is a keras-nlp preset: `GPT2Backbone.from_preset(dir)` and
`GPT2Tokenizer.from_preset(dir)` load it, and `--backbone=dir` selects it for
FedPerC. `pretrain_summary.json` records the flags, step count, time and
perplexities. A non-empty `--output_dir` is refused before any work unless
`--overwrite` is given (results depend on the preset they were made with).
"""

import json
import math
import os
import sys
import time

from absl import app
from absl import flags
import keras_nlp
import numpy as np
import tensorflow as tf

from tasks import speaker_context_io
from tff_personal.core import atomic_io
from tff_personal.models import bpe_trainer
from tff_personal.models import fedperc_backbone

FLAGS = flags.FLAGS


def define_flags():
  """Defines the binary's flags (called under __main__, not at import)."""
  flags.DEFINE_string('data_dir', None, 'Directory with WikiText-2 '
                      'valid.txt and test.txt.')
  flags.DEFINE_string('output_dir', None, 'Preset directory to write.')
  flags.DEFINE_bool('overwrite', False,
                    'Replace an existing non-empty --output_dir (refused '
                    'otherwise, before any training).')
  flags.DEFINE_integer('vocabulary_size', 4096, 'BPE vocabulary size.')
  flags.DEFINE_integer('num_layers', 3, 'Transformer layers.')
  flags.DEFINE_integer('num_heads', 4, 'Attention heads.')
  flags.DEFINE_integer('hidden_dim', 128, 'Hidden size.')
  flags.DEFINE_integer('intermediate_dim', 512, 'Feed-forward size.')
  flags.DEFINE_integer('sequence_length', 64, 'Training block length.')
  flags.DEFINE_integer('max_sequence_length', 128, 'Position embeddings.')
  flags.DEFINE_integer('batch_size', 32, 'Batch size.')
  flags.DEFINE_float('learning_rate', 1e-3, 'Peak Adam learning rate.')
  flags.DEFINE_float('minutes', 20.0, 'Wall-clock training budget.')
  flags.DEFINE_integer('max_epochs', 30, 'Upper bound on epochs.')
  flags.DEFINE_integer(
      'max_steps', 0,
      'If > 0, train at most this many steps, and the cosine learning-rate '
      'decay ends there (otherwise it ends after --max_epochs; a run cut by '
      '--minutes then stops before the rate has decayed).')
  flags.DEFINE_string(
      'shakespeare_dir', None,
      'Optional folder holding shakespeare.tsv.gz (the Moby Shakespeare, '
      'public domain): its speeches are added to the training text (dialogue '
      'that is not user data of tv_shows); the last --heldout_speeches are '
      'held out and their perplexity reported.')
  flags.DEFINE_integer('heldout_speeches', 1000,
                       'Last Shakespeare speeches kept for held-out '
                       'perplexity (with --shakespeare_dir).')
  flags.DEFINE_list('heldout_contexts', [],
                    'Plays (the `play` ids of shakespeare.tsv.gz) whose '
                    'speeches are all held out instead of the last '
                    '--heldout_speeches: a context task on those plays then '
                    'meets a backbone that never read them.')
  flags.DEFINE_integer(
      'heldout_paragraphs', 200,
      'Last paragraphs of test.txt kept for held-out perplexity.')
  flags.DEFINE_integer('seed', 0, 'Seed.')


class _Deadline(tf.keras.callbacks.Callback):
  """Stops training at a wall-clock deadline or after `max_steps` (if > 0)."""

  def __init__(self, seconds, max_steps=0):
    super().__init__()
    self._end = time.time() + seconds
    self._max_steps = max_steps

  def on_train_batch_end(self, batch, logs=None):
    steps = int(self.model.optimizer.iterations.numpy())
    if time.time() > self._end or 0 < self._max_steps <= steps:
      self.model.stop_training = True


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if not FLAGS.data_dir or not FLAGS.output_dir:
    print('error: --data_dir and --output_dir are required', file=sys.stderr)
    return 2
  if (os.path.isdir(FLAGS.output_dir) and os.listdir(FLAGS.output_dir)
      and not FLAGS.overwrite):
    print(f'error: --output_dir={FLAGS.output_dir} exists and is not empty '
          '(a backbone that results depend on?); pass --overwrite to replace '
          'it', file=sys.stderr)
    return 2
  if FLAGS.max_steps < 0:
    print('error: --max_steps must be >= 0 (0: no step limit)',
          file=sys.stderr)
    return 2
  if FLAGS.sequence_length + 1 > FLAGS.max_sequence_length:
    print('error: --sequence_length must be below --max_sequence_length',
          file=sys.stderr)
    return 2
  tf.keras.utils.set_random_seed(FLAGS.seed)
  start = time.time()
  train_text = fedperc_backbone.wikitext_paragraphs(
      os.path.join(FLAGS.data_dir, 'valid.txt'))
  test_text = fedperc_backbone.wikitext_paragraphs(
      os.path.join(FLAGS.data_dir, 'test.txt'))
  heldout = test_text[-FLAGS.heldout_paragraphs:]
  train_text += test_text[:-FLAGS.heldout_paragraphs]
  heldout_speeches = []
  if FLAGS.shakespeare_dir:
    if FLAGS.heldout_speeches < 1:
      print('error: --heldout_speeches must be at least 1', file=sys.stderr)
      return 2
    try:
      speeches = [u.text for u in speaker_context_io.load_shakespeare(
          FLAGS.shakespeare_dir)]
    except speaker_context_io.SpeakerDataError as e:
      print(f'error: --shakespeare_dir: {e}', file=sys.stderr)
      return 2
    if len(speeches) <= FLAGS.heldout_speeches:
      print(f'error: --heldout_speeches={FLAGS.heldout_speeches} leaves no '
            f'Shakespeare speech to train on ({len(speeches)} read)',
            file=sys.stderr)
      return 2
    if FLAGS.heldout_contexts:
      utterances = speaker_context_io.load_shakespeare(FLAGS.shakespeare_dir)
      plays = set(FLAGS.heldout_contexts)
      unknown = sorted(plays - {u.community for u in utterances})
      if unknown:
        print(f'error: --heldout_contexts: no speeches of plays {unknown} in '
              f'{FLAGS.shakespeare_dir}', file=sys.stderr)
        return 2
      heldout_speeches = [u.text for u in utterances if u.community in plays]
      train_text += [u.text for u in utterances
                     if u.community not in plays]
    else:
      heldout_speeches = speeches[-FLAGS.heldout_speeches:]
      train_text += speeches[:-FLAGS.heldout_speeches]

  vocabulary, merges = bpe_trainer.train_bpe(train_text, FLAGS.vocabulary_size)
  bpe_seconds = time.time() - start
  print(f'BPE: {len(vocabulary)} tokens, {len(merges)} merges in '
        f'{bpe_seconds:.0f} s', flush=True)
  tokenizer = keras_nlp.models.GPT2Tokenizer(vocabulary=vocabulary,
                                             merges=merges)
  end_id = vocabulary[bpe_trainer.END_TOKEN]
  block = FLAGS.sequence_length + 1
  train_blocks = fedperc_backbone.token_blocks(tokenizer, train_text, block,
                                               end_id)
  heldout_blocks = fedperc_backbone.token_blocks(tokenizer, heldout, block,
                                                 end_id)
  speech_blocks = (fedperc_backbone.token_blocks(
      tokenizer, heldout_speeches, block, end_id) if heldout_speeches
                   else None)
  print(f'{train_blocks.size} training tokens, {heldout_blocks.size} held out',
        flush=True)

  backbone = keras_nlp.models.GPT2Backbone(
      vocabulary_size=len(vocabulary), num_layers=FLAGS.num_layers,
      num_heads=FLAGS.num_heads, hidden_dim=FLAGS.hidden_dim,
      intermediate_dim=FLAGS.intermediate_dim, dropout=0.1,
      max_sequence_length=FLAGS.max_sequence_length)
  model = fedperc_backbone.CausalLM(backbone)
  steps_per_epoch = math.ceil(len(train_blocks) / FLAGS.batch_size)
  decay_steps = steps_per_epoch * FLAGS.max_epochs
  if FLAGS.max_steps > 0:
    decay_steps = min(decay_steps, FLAGS.max_steps)
  schedule = tf.keras.optimizers.schedules.CosineDecay(
      0.0, decay_steps=decay_steps,
      warmup_target=FLAGS.learning_rate, warmup_steps=200)
  model.compile(
      optimizer=tf.keras.optimizers.Adam(schedule),
      loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  train_ds = fedperc_backbone.lm_dataset(train_blocks, FLAGS.batch_size, True,
                                         FLAGS.seed)
  heldout_ds = fedperc_backbone.lm_dataset(heldout_blocks, FLAGS.batch_size,
                                           False, FLAGS.seed)
  budget = FLAGS.minutes * 60 - (time.time() - start)
  history = model.fit(train_ds, epochs=FLAGS.max_epochs,
                      validation_data=heldout_ds, verbose=2,
                      callbacks=[_Deadline(budget, FLAGS.max_steps)])
  heldout_loss = model.evaluate(heldout_ds, verbose=0)
  speech_perplexity = None
  if speech_blocks is not None:
    speech_perplexity = float(np.exp(model.evaluate(
        fedperc_backbone.lm_dataset(speech_blocks, FLAGS.batch_size, False,
                                    FLAGS.seed), verbose=0)))

  os.makedirs(FLAGS.output_dir, exist_ok=True)
  fedperc_backbone.save_preset(backbone, tokenizer, FLAGS.output_dir)
  # The saved preset must load as the issue requires.
  spec = fedperc_backbone.load_backbone(FLAGS.output_dir)
  for a, b in zip(spec.weights, backbone.get_weights()):
    np.testing.assert_array_equal(a, b)
  summary = dict(
      flags={name: FLAGS[name].value for name in (
          'data_dir', 'vocabulary_size', 'num_layers', 'num_heads',
          'hidden_dim', 'intermediate_dim', 'sequence_length',
          'max_sequence_length', 'batch_size', 'learning_rate', 'minutes',
          'max_epochs', 'max_steps', 'heldout_paragraphs', 'shakespeare_dir',
          'heldout_speeches', 'heldout_contexts', 'seed')},
      parameters=int(backbone.count_params()),
      train_tokens=int(train_blocks.size),
      heldout_tokens=int(heldout_blocks.size),
      epochs=len(history.history['loss']),
      steps=int(model.optimizer.iterations.numpy()),
      bpe_seconds=bpe_seconds, seconds=time.time() - start,
      train_perplexity=float(np.exp(history.history['loss'][-1])),
      heldout_perplexity=float(np.exp(heldout_loss)),
      heldout_shakespeare_perplexity=speech_perplexity)
  with atomic_io.atomic_write(
      os.path.join(FLAGS.output_dir, 'pretrain_summary.json')) as f:
    f.write(json.dumps(summary, indent=2))
  print(json.dumps(summary, indent=2))
  return 0


if __name__ == '__main__':
  define_flags()
  app.run(main)
