r"""Writes a randomly initialised GPT-2 preset of a given shape (timing only).

  python -m binaries.shaped_backbone --tokenizer_from=out/fedperc/backbone \
    --output_dir=out/fedperc/distilgpt2_shape   # DistilGPT2's shape (default)

FedPerC's Table 3 (train and test pass time) and the per-user memory depend
on the backbone's shape (layers, width, vocabulary), not on its weights. This
machine cannot download DistilGPT2, but it can build a `GPT2Backbone` of
DistilGPT2's shape (6 layers, hidden 768, 12 heads, FFN 3072, 50,257 tokens)
with random weights. The tokenizer is a trained preset's, its vocabulary
padded with tokens no merge produces (`fedperc_backbone.padded_vocabulary`),
so the task's text tokenizes as with that preset. The directory is a keras-nlp
preset marked with `random_weights.json`: `binaries.reproduce --paper=fedperc`
times it (`--table=table3_train`, `table3_test`, `memory`) and refuses its
perplexity tables.
"""

import json
import os
import sys

from absl import app
from absl import flags

from tff_personal.models import fedperc_backbone

FLAGS = flags.FLAGS


def define_flags():
  """Defines the binary's flags (called under __main__, not at import)."""
  flags.DEFINE_string('tokenizer_from', None,
                      'Preset directory whose tokenizer is reused.')
  flags.DEFINE_string('output_dir', None, 'Preset directory to write.')
  flags.DEFINE_integer('vocabulary_size', 50257,
                       'Vocabulary size (DistilGPT2: 50257).')
  flags.DEFINE_integer('num_layers', 6, 'Transformer layers (DistilGPT2: 6).')
  flags.DEFINE_integer('num_heads', 12, 'Attention heads (DistilGPT2: 12).')
  flags.DEFINE_integer('hidden_dim', 768, 'Hidden size (DistilGPT2: 768).')
  flags.DEFINE_integer('intermediate_dim', 3072,
                       'Feed-forward size (DistilGPT2: 3072).')
  flags.DEFINE_integer('max_sequence_length', 1024,
                       'Position embeddings (DistilGPT2: 1024).')
  flags.DEFINE_integer('seed', 0, 'Initialisation seed.')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if not FLAGS.tokenizer_from or not FLAGS.output_dir:
    print('error: --tokenizer_from and --output_dir are required',
          file=sys.stderr)
    return 2
  if os.path.isdir(FLAGS.output_dir) and os.listdir(FLAGS.output_dir):
    # Never overwrite a preset (e.g. a trained backbone) with random weights.
    print(f'error: --output_dir={FLAGS.output_dir} exists and is not empty',
          file=sys.stderr)
    return 2
  source = fedperc_backbone.load_backbone(FLAGS.tokenizer_from)
  try:
    vocabulary = fedperc_backbone.padded_vocabulary(source.vocabulary,
                                                    FLAGS.vocabulary_size)
  except ValueError as e:
    print(f'error: --vocabulary_size: {e}', file=sys.stderr)
    return 2
  summary = fedperc_backbone.write_random_preset(
      vocabulary, source.merges, FLAGS.output_dir,
      num_layers=FLAGS.num_layers, num_heads=FLAGS.num_heads,
      hidden_dim=FLAGS.hidden_dim, intermediate_dim=FLAGS.intermediate_dim,
      max_sequence_length=FLAGS.max_sequence_length, seed=FLAGS.seed,
      provenance={'tokenizer_from': FLAGS.tokenizer_from})
  print(json.dumps(summary, indent=2))
  return 0


if __name__ == '__main__':
  define_flags()
  app.run(main)
