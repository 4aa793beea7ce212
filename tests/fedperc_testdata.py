"""Tiny FedPerC fixtures for the registry-wide tests: a random-weight
backbone, a task that supplies FedPerC's model, and utterance datasets."""

import collections
import functools
import types

import numpy as np
import tensorflow as tf

from tasks import tv_shows
from tff_personal.models import bpe_trainer
from tff_personal.models import fedperc
from tff_personal.models import fedperc_backbone

TEXTS = ['How you doin? We were on a break!', 'Winter is coming.',
         'A Lannister always pays his debts.', 'I think we must go north.',
         'Could this BE any more awkward?', 'You know nothing, Jon Snow.',
         'Pivot! Pivot! Pivot!', 'The night is dark and full of terrors.']
MAX_TOKENS = 8
HIDDEN = 8


@functools.lru_cache(maxsize=None)
def spec() -> fedperc_backbone.BackboneSpec:
  vocabulary, merges = bpe_trainer.train_bpe(TEXTS * 3, 300)
  return fedperc_backbone.random_backbone(
      vocabulary, merges, hidden_dim=HIDDEN, num_heads=2, intermediate_dim=16,
      max_sequence_length=MAX_TOKENS + 2, seed=2)


@functools.lru_cache(maxsize=None)
def arrays(context: int) -> dict:
  out, _ = tv_shows.encode(spec().tokenizer(), TEXTS, context, MAX_TOKENS,
                           spec().vocabulary[bpe_trainer.END_TOKEN])
  return out


def config(variant: str) -> fedperc.FedPercConfig:
  return fedperc.FedPercConfig(variant, num_contexts=2, max_tokens=MAX_TOKENS,
                               generator_heads=2, generator_utterances=2,
                               generator_tokens=4)


def factory(variant: str, seed: int = 0):
  """The tiny task's `fedperc_model_fn_factory`."""
  return lambda: fedperc.FedPercModel(spec(), config(variant), seed)


TASK = types.SimpleNamespace(name='tiny_tv', fedperc_model_fn_factory=factory)


def user_rows(u: int, n: int, round_num: int) -> collections.OrderedDict:
  """User u's n utterances of a round (its context: u % 2)."""
  data = arrays(u % 2)
  rows = np.random.default_rng([round_num, u]).choice(len(data['ids']), n)
  return collections.OrderedDict((k, data[k][rows])
                                 for k in ('ids', 'mask', 'context'))


def datasets(sizes, round_num: int, batch: int = 3) -> list:
  """Training datasets of users with `sizes` utterances (fixed order)."""
  return [tf.data.Dataset.from_tensor_slices(user_rows(u, n, round_num)
                                             ).batch(batch)
          for u, n in enumerate(sizes)]


def eval_datasets(sizes) -> list:
  """Evaluation datasets: the first half fine-tuning, the rest test."""
  out = []
  for u, n in enumerate(sizes):
    rows = user_rows(u, n, 99)
    rows[fedperc.ROLE] = (np.arange(n) >= n // 2).astype(np.int32)
    out.append(tf.data.Dataset.from_tensor_slices(rows).batch(4))
  return out


def tv_show_users():
  """Every user of the task with the tiny backbone's utterances."""
  out = {}
  for i, user in enumerate(tv_shows.USERS):
    data = arrays(i % 2)
    rows = np.random.default_rng(i).permutation(len(data['ids']))
    parts = dict(train=rows[:4], fine_tune=rows[4:6], test=rows[6:])
    out[user] = tv_shows.UserData(
        user=user, context=i % 2,
        splits={s: {k: v[idx] for k, v in data.items()}
                for s, idx in parts.items()}, texts={})
  return out
