"""End-to-end tests of binaries.pretrain_backbone on tiny text files."""

import csv
import gzip
import io
import json
import os

import numpy as np
import pytest

from tests import process_utils
from tff_personal.models import fedperc_backbone

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_WORDS = ('the king said that we must go to the river before the night comes '
          'and I think you are right about the old house on the hill').split()


def _sentence(rng, n=12):
  return ' '.join(rng.choice(_WORDS, n)) + ' .'


def _write_wikitext(d, rng):
  os.makedirs(d, exist_ok=True)
  for name in ('valid.txt', 'test.txt'):
    with open(os.path.join(d, name), 'w', encoding='utf-8') as f:
      f.write(' = Page = \n')
      for _ in range(30):
        f.write(' ' + _sentence(rng) + ' \n')


def _write_shakespeare(d, rng, speeches):
  os.makedirs(d, exist_ok=True)
  buf = io.StringIO()
  writer = csv.writer(buf, delimiter='\t', lineterminator='\n')
  writer.writerow(('play', 'title', 'act', 'scene', 'speech', 'speaker',
                   'text'))
  for i in range(speeches):
    writer.writerow(('hamlet', 'Hamlet', '1', '1', str(i),
                     'HAMLET' if i % 2 else 'HORATIO', _sentence(rng, 8)))
  with gzip.open(os.path.join(d, 'shakespeare.tsv.gz'), 'wt',
                 encoding='utf-8', newline='') as f:
    f.write(buf.getvalue())


@pytest.fixture(scope='module')
def binary():
  """`python -m binaries.pretrain_backbone`, each run a process of its own
  forked from one that imported the binary (TensorFlow and KerasNLP) once."""
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2')
  with process_utils.ForkServer('binaries.pretrain_backbone', REPO,
                                env=env) as server:
    yield server


def _run(binary, tmp_path, *extra):
  argv = [f'--data_dir={tmp_path / "wiki"}',
          f'--output_dir={tmp_path / "out"}',
          '--vocabulary_size=300', '--num_layers=1', '--num_heads=2',
          '--hidden_dim=16', '--intermediate_dim=32', '--sequence_length=15',
          '--max_sequence_length=32', '--batch_size=4',
          '--heldout_paragraphs=5', *extra]
  return binary.run(argv, timeout=600)


def test_max_steps_and_shakespeare_text(binary, tmp_path):
  rng = np.random.default_rng(0)
  _write_wikitext(str(tmp_path / 'wiki'), rng)
  _write_shakespeare(str(tmp_path / 'shake'), rng, 40)
  proc = _run(binary, tmp_path, '--max_steps=3', '--max_epochs=50',
              f'--shakespeare_dir={tmp_path / "shake"}',
              '--heldout_speeches=10')
  assert proc.returncode == 0, proc.stderr[-3000:]
  with open(tmp_path / 'out' / 'pretrain_summary.json') as f:
    summary = json.load(f)
  # Training stops at --max_steps although --max_epochs would allow more.
  assert summary['steps'] == 3
  assert summary['flags']['shakespeare_dir'] == str(tmp_path / 'shake')
  # The held-out speeches are scored: a finite perplexity of a (nearly
  # untrained) model over a 300-token vocabulary is above 1 and not far
  # above the vocabulary size.
  assert 1.0 < summary['heldout_shakespeare_perplexity'] < 3000.0
  # The speeches are training text: more tokens than WikiText alone gives.
  wiki_only = _run(binary, tmp_path, '--max_steps=1',
                   f'--output_dir={tmp_path / "out_wiki"}')
  assert wiki_only.returncode == 0, wiki_only.stderr[-3000:]
  with open(tmp_path / 'out_wiki' / 'pretrain_summary.json') as f:
    wiki_summary = json.load(f)
  assert wiki_summary['heldout_shakespeare_perplexity'] is None
  assert summary['train_tokens'] > wiki_summary['train_tokens']
  spec = fedperc_backbone.load_backbone(str(tmp_path / 'out'))
  assert spec.hidden_dim == 16
  # An existing preset is not replaced without --overwrite.
  weights = tmp_path / 'out' / 'model.weights.h5'
  before = weights.read_bytes()
  again = _run(binary, tmp_path, '--max_steps=1', '--hidden_dim=8')
  assert again.returncode == 2
  assert 'exists and is not empty' in again.stderr
  assert weights.read_bytes() == before
  replaced = _run(binary, tmp_path, '--max_steps=1', '--hidden_dim=8',
                  '--overwrite')
  assert replaced.returncode == 0, replaced.stderr[-3000:]
  assert fedperc_backbone.load_backbone(str(tmp_path / 'out')).hidden_dim == 8


def test_holding_out_every_speech_is_refused(binary, tmp_path):
  rng = np.random.default_rng(1)
  _write_wikitext(str(tmp_path / 'wiki'), rng)
  _write_shakespeare(str(tmp_path / 'shake'), rng, 5)
  proc = _run(binary, tmp_path, '--max_steps=1',
              f'--shakespeare_dir={tmp_path / "shake"}',
              '--heldout_speeches=5')
  assert proc.returncode == 2
  assert '--heldout_speeches=5 leaves no Shakespeare speech' in proc.stderr
  # 0 would hold out every speech too (speeches[-0:] is all of them).
  zero = _run(binary, tmp_path, '--max_steps=1',
              f'--shakespeare_dir={tmp_path / "shake"}',
              '--heldout_speeches=0')
  assert zero.returncode == 2
  assert '--heldout_speeches must be at least 1' in zero.stderr
  missing = _run(binary, tmp_path, '--max_steps=1',
                 f'--shakespeare_dir={tmp_path / "nowhere"}')
  assert missing.returncode == 2
  assert 'shakespeare.tsv.gz' in missing.stderr
  assert 'Traceback' not in missing.stderr
  assert not os.path.exists(tmp_path / 'out')
