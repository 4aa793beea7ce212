"""binaries.shaped_backbone: a random preset of another shape, same text ids."""

import json
import os
import subprocess
import sys
import types

import pytest

from papers import fedperc as fedperc_paper
from tff_personal.models import bpe_trainer
from tff_personal.models import fedperc_backbone

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXTS = ['I think we must go to the river before night comes.',
         'We must not stay here, said the old king to his son.',
         'How you doin? I think you are right about the house.'] * 4


def _run(*flags):
  """`python -m binaries.shaped_backbone FLAGS`, its output captured."""
  return subprocess.run(
      [sys.executable, '-m', 'binaries.shaped_backbone', *flags],
      cwd=REPO, capture_output=True, text=True, timeout=600,
      env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2'))


def test_padded_vocabulary_adds_tokens_that_text_never_uses():
  vocabulary, merges = bpe_trainer.train_bpe(TEXTS, 300)
  padded = fedperc_backbone.padded_vocabulary(vocabulary, 1000)
  assert len(padded) == 1000
  assert sorted(padded.values()) == list(range(1000))
  assert all(padded[t] == i for t, i in vocabulary.items())
  small = fedperc_backbone.random_backbone(vocabulary, merges)
  large = fedperc_backbone.random_backbone(padded, merges)
  ids = small.tokenizer()(TEXTS).to_list()
  assert large.tokenizer()(TEXTS).to_list() == ids
  assert max(max(row) for row in ids) < len(vocabulary)
  with pytest.raises(ValueError, match='cannot pad a vocabulary of 300'):
    fedperc_backbone.padded_vocabulary(vocabulary, 299)


def test_binary_writes_a_marked_preset_that_perplexity_tables_refuse(
    tmp_path):
  vocabulary, merges = bpe_trainer.train_bpe(TEXTS, 300)
  source = fedperc_backbone.random_backbone(vocabulary, merges, seed=3)
  backbone = source.build_backbone()
  backbone.set_weights(source.weights)
  trained = str(tmp_path / 'trained')
  fedperc_backbone.save_preset(backbone, source.tokenizer(), trained)
  out = str(tmp_path / 'shaped')
  proc = _run(f'--tokenizer_from={trained}', f'--output_dir={out}',
              '--vocabulary_size=512', '--num_layers=2', '--num_heads=2',
              '--hidden_dim=8', '--intermediate_dim=16',
              '--max_sequence_length=40')
  assert proc.returncode == 0, proc.stderr[-3000:]
  spec = fedperc_backbone.load_backbone(out)
  assert (spec.vocabulary_size, spec.hidden_dim,
          spec.config['num_layers'], spec.max_sequence_length) == (
              512, 8, 2, 40)
  assert spec.tokenizer()(TEXTS).to_list() == (
      source.tokenizer()(TEXTS).to_list())
  with open(os.path.join(out, fedperc_backbone.RANDOM_WEIGHTS_FILE)) as f:
    assert json.load(f)['random_weights'] is True
  assert fedperc_backbone.has_random_weights(out)
  assert not fedperc_backbone.has_random_weights(trained)

  flag_values = types.SimpleNamespace(
      fedperc_backbone=out, fedperc_rounds=1, fedperc_clients_per_round=1,
      fedperc_local_steps=1, fedperc_batch_size=1, fedperc_max_tokens=8,
      fedperc_fine_tune_steps=1, seeds=1)
  assert fedperc_paper.cells('table3_train', flag_values)
  assert fedperc_paper.cells('memory', flag_values)
  for table in ('table1', 'table2'):
    with pytest.raises(ValueError, match=f'random weights.*{table} measures'):
      fedperc_paper.cells(table, flag_values)
  flag_values.fedperc_backbone = trained
  assert fedperc_paper.cells('table1', flag_values)

  too_small = _run(f'--tokenizer_from={trained}',
                   f'--output_dir={tmp_path / "no"}', '--vocabulary_size=10')
  assert too_small.returncode == 2
  assert 'cannot pad a vocabulary of 300 tokens to 10' in too_small.stderr
  assert not os.path.exists(tmp_path / 'no')

  # A preset (here the trained one) is never overwritten with random weights.
  before = sorted(os.listdir(trained))
  overwrite = _run(f'--tokenizer_from={trained}', f'--output_dir={trained}')
  assert overwrite.returncode == 2
  assert 'exists and is not empty' in overwrite.stderr
  assert sorted(os.listdir(trained)) == before
  assert not fedperc_backbone.has_random_weights(trained)
