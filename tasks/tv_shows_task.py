"""FedPerC's "TV Shows" task on the one run path (`core/task.py`).

The data are `tasks/tv_shows.py`'s: 19 characters of Friends and Game of
Thrones, each utterance in its show's context, every user's utterances split
60 / 20 / 20 into train / fine-tune / test (seeded by the task's seed). The
task's clients are the 15 users that are not withheld
(`tv_shows.training_users(withheld=True)`, client i is the i-th of them).

* Training: in a round, a client's data are `local_steps` batches of
  `batch_size` utterances sampled from its training split with the
  generator seeded by (seed, round - 1, client): the batches
  `papers/fedperc.py`'s loop draws for the same seed (`tv_shows.round_dataset`).
* Evaluation (`eval_datasets`, `eval_batches`): each user's fine-tuning
  utterances (role `y` = 0) then its test utterances (`y` = 1); the
  algorithm adapts on the former and scores the latter
  (`algorithms/fedperc.FedPercEvalModel`), and `evaluate` reports the pooled
  perplexity exp(sum NLL / tokens) over the users' test tokens after the
  first three (the prompt).
* Model: `fedperc_model_fn_factory(variant, seed)` builds
  `models/fedperc.FedPercModel` on the backbone (`backbone`, a keras-nlp
  GPT-2 preset name or directory, e.g. made by `binaries.pretrain_backbone`).

Example:

  from tasks import registry
  task = registry.build_task('tv_shows', data_dir='../shared/data', seed=0,
                             backbone='out/fedperc/backbone')
"""

from __future__ import annotations

import collections
import os
from typing import Optional, Sequence

import numpy as np
import tensorflow as tf

from tasks import tv_shows
from tff_personal.algorithms import fedperc as fedperc_alg
from tff_personal.core import client_data as client_data_lib
from tff_personal.models import bpe_trainer
from tff_personal.models import fedperc
from tff_personal.models import fedperc_backbone

_KEYS = ('ids', 'mask', 'context')
EVAL_BATCH = 64


class TvShowsTask:
  """The tv_shows task (module docstring) over tokenized users.

  Attributes:
    name: 'tv_shows'.
    spec: the loaded backbone.
    users: the users' tokenized splits, by name (`tv_shows.build_users`).
    client_names: the user of each client index.
  """

  name = 'tv_shows'

  def __init__(self, spec: fedperc_backbone.BackboneSpec,
               users: dict[str, tv_shows.UserData], *, max_tokens: int,
               local_steps: int, batch_size: int, generator_tokens: int,
               seed: int):
    if local_steps < 1 or batch_size < 1:
      raise ValueError(f'local_steps ({local_steps}) and batch_size '
                       f'({batch_size}) must be >= 1')
    if generator_tokens < 0:
      raise ValueError(f'generator_tokens must be >= 0, got '
                       f'{generator_tokens}')
    self.spec = spec
    self.users = users
    self.client_names = tv_shows.training_users(withheld=True)
    missing = [u for u in self.client_names if u not in users]
    if missing:
      raise ValueError(f'tv_shows: no data for users {missing}')
    self.max_tokens = max_tokens
    self.local_steps = local_steps
    self.batch_size = batch_size
    self.generator_tokens = generator_tokens
    self.seed = seed
    self._train_spec = fedperc.batch_spec(max_tokens)
    self._eval_spec = fedperc_alg.eval_batch_spec(max_tokens)

  @property
  def population(self) -> int:
    return len(self.client_names)

  # ------------------------------------------------------------ models

  def config(self, variant: str) -> fedperc.FedPercConfig:
    return fedperc.FedPercConfig(
        variant=variant, num_contexts=len(tv_shows.CONTEXTS),
        max_tokens=self.max_tokens, generator_tokens=self.generator_tokens)

  def fedperc_model_fn_factory(self, variant: str, seed: int = 0):
    """`(variant, seed) -> builder of a fresh FedPercModel` on the backbone."""
    config = self.config(variant)
    spec = self.spec
    return lambda: fedperc.FedPercModel(spec, config, seed)

  def metrics_fn(self, batch, outputs):
    del batch, outputs  # FedPerC's client step sums its own loss.
    return collections.OrderedDict()

  # ------------------------------------------------------------ data

  def _check_ids(self, client_ids: Sequence[int]) -> None:
    for c in client_ids:
      if not 0 <= int(c) < self.population:
        raise ValueError(f'tv_shows: client index {c} is not in '
                         f'[0, {self.population})')

  def _round_rows(self, client: int, round_num: int) -> np.ndarray:
    """The training rows of a client's round, drawn as
    `tv_shows.round_dataset` draws them."""
    n = len(self.users[self.client_names[client]].splits['train']['ids'])
    rng = np.random.default_rng([self.seed, round_num - 1, client])
    return np.concatenate([
        rng.choice(n, self.batch_size, replace=n < self.batch_size)
        for _ in range(self.local_steps)])

  def train_batches(self, client_ids: Sequence[int], round_num: int
                    ) -> list[client_data_lib.ClientBatches]:
    """Each client's `local_steps` sampled batches of a round (1-based)."""
    self._check_ids(client_ids)
    out = []
    for c in client_ids:
      arrays = self.users[self.client_names[int(c)]].splits['train']
      rows = self._round_rows(int(c), round_num)
      examples = collections.OrderedDict((k, arrays[k][rows]) for k in _KEYS)
      out.append(client_data_lib.ClientBatches.from_arrays(
          examples, self.batch_size, [np.arange(len(rows))],
          self._train_spec))
    return out

  def train_datasets(self, client_ids: Sequence[int], round_num: int
                     ) -> list[tf.data.Dataset]:
    return [tf.data.Dataset.from_tensor_slices(b.examples).batch(
        self.batch_size) for b in self.train_batches(client_ids, round_num)]

  def _eval_arrays(self, client: int) -> collections.OrderedDict:
    splits = self.users[self.client_names[client]].splits
    tune, test = splits['fine_tune'], splits['test']
    out = collections.OrderedDict(
        (k, np.concatenate([tune[k], test[k]])) for k in _KEYS)
    out[fedperc_alg.ROLE] = np.concatenate([
        np.full(len(tune['ids']), fedperc_alg.ROLE_FINE_TUNE, np.int32),
        np.full(len(test['ids']), fedperc_alg.ROLE_TEST, np.int32)])
    return out

  def eval_batches(self, client_ids: Sequence[int]
                   ) -> list[client_data_lib.ClientBatches]:
    """Each client's fine-tuning then test utterances, with their roles."""
    self._check_ids(client_ids)
    out = []
    for c in client_ids:
      arrays = self._eval_arrays(int(c))
      out.append(client_data_lib.ClientBatches.from_arrays(
          arrays, EVAL_BATCH, [np.arange(len(arrays['ids']))],
          self._eval_spec))
    return out

  def eval_datasets(self, client_ids: Sequence[int]) -> list[tf.data.Dataset]:
    return [tf.data.Dataset.from_tensor_slices(b.examples).batch(EVAL_BATCH)
            for b in self.eval_batches(client_ids)]

  def evaluate(self, per_client_outputs, client_ids) -> dict:
    """Pooled test perplexity (`algorithms/fedperc.pooled_perplexity`)."""
    del client_ids
    return dict(fedperc_alg.pooled_perplexity(per_client_outputs))


def _default_data_dir() -> str:
  return os.path.join(os.path.dirname(__file__), '..', '..', 'shared', 'data')


def tv_shows_task(data_dir: Optional[str] = None, *,
                  backbone: Optional[str] = None, max_tokens: int = 24,
                  max_utterances: int = 200, local_steps: int = 10,
                  batch_size: int = 15, generator_tokens: int = 12,
                  allow_random_backbone: bool = False,
                  seed: int = 0) -> TvShowsTask:
  """Builds the tv_shows task.

  Args:
    data_dir: the folder holding `friends/` and `game_of_thrones/` (default
      `../shared/data`).
    backbone: required: a keras-nlp GPT-2 preset name or preset directory
      (`binaries.pretrain_backbone` makes one).
    max_tokens: tokens per utterance, the end token included.
    max_utterances: utterances kept per user before the split (0: all).
    local_steps, batch_size: a client's local steps per round, utterances
      per step.
    generator_tokens: tokens of each utterance the embedding generators read
      (0: all).
    allow_random_backbone: accept a random-weight backbone (one marked by
      `fedperc_backbone.write_random_preset`), for time and memory
      measurements only: its perplexities mean nothing.
    seed: the data seed: the users' splits and the rounds' batches.
  """
  if not backbone:
    raise ValueError('tv_shows needs --task_options=backbone=<a keras-nlp '
                     'GPT-2 preset or a directory made by '
                     'binaries.pretrain_backbone>')
  if max_utterances < 0:
    raise ValueError(f'max_utterances must be >= 0, got {max_utterances}')
  spec = fedperc_backbone.load_backbone(backbone)
  if (fedperc_backbone.has_random_weights(backbone) and
      not allow_random_backbone):
    raise ValueError(f'backbone {backbone} has random weights '
                     f'({fedperc_backbone.RANDOM_WEIGHTS_FILE}): it cannot '
                     'model language; pre-train one (or, for time and '
                     'memory measurements only, allow_random_backbone=True)')
  if max_tokens + 1 > spec.max_sequence_length:
    raise ValueError(f'max_tokens {max_tokens} + 1 prefix token exceeds the '
                     f'backbone\'s max_sequence_length '
                     f'{spec.max_sequence_length}')
  users = tv_shows.build_users(
      tv_shows.load_sentences(data_dir or _default_data_dir()),
      spec.tokenizer(), max_tokens=max_tokens,
      end_id=spec.vocabulary[bpe_trainer.END_TOKEN], seed=seed,
      max_utterances_per_user=max_utterances or None)
  return TvShowsTask(spec, users, max_tokens=max_tokens,
                     local_steps=local_steps, batch_size=batch_size,
                     generator_tokens=generator_tokens, seed=seed)
