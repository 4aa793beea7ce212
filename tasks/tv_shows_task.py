"""FedPerC's "TV Shows" task on the one run path: `tasks/context_task.py`'s
`ContextTask` over `tasks/tv_shows.py`'s users.

The data are 19 characters of Friends and Game of Thrones, each utterance in
its show's context, every user's utterances split 60 / 20 / 20 into train /
fine-tune / test (seeded by the task's seed). The task's clients are the 15
users that are not withheld (`tv_shows.training_users(withheld=True)`,
client i is the i-th of them); the four withheld users
(`tv_shows.WITHHELD_USERS`) are its `withheld_names`. Training batches,
evaluation and the model are `ContextTask`'s: a round's batches are those
`tv_shows.round_dataset` draws for the same seed.

Example:

  from tasks import registry
  task = registry.build_task('tv_shows', data_dir='../shared/data', seed=0,
                             backbone='out/fedperc/backbone')
"""

from __future__ import annotations

import os
from typing import Optional

from tasks import context_task
from tasks import tv_shows
from tff_personal.models import bpe_trainer
from tff_personal.models import fedperc_backbone


def from_users(spec: fedperc_backbone.BackboneSpec,
               users: dict[str, tv_shows.UserData], *, max_tokens: int,
               local_steps: int, batch_size: int, generator_tokens: int,
               seed: int) -> context_task.ContextTask:
  """The tv_shows task over already tokenized users
  (`tv_shows.build_users`)."""
  return context_task.ContextTask(
      spec, users, contexts=tv_shows.CONTEXTS,
      client_names=tv_shows.training_users(withheld=True),
      withheld_names=tv_shows.WITHHELD_USERS, max_tokens=max_tokens,
      local_steps=local_steps, batch_size=batch_size,
      generator_tokens=generator_tokens, seed=seed, name='tv_shows')


def _default_data_dir() -> str:
  return os.path.join(os.path.dirname(__file__), '..', '..', 'shared', 'data')


def tv_shows_task(data_dir: Optional[str] = None, *,
                  backbone: Optional[str] = None, max_tokens: int = 24,
                  max_utterances: int = 200, local_steps: int = 10,
                  batch_size: int = 15, generator_tokens: int = 12,
                  allow_random_backbone: bool = False,
                  seed: int = 0) -> context_task.ContextTask:
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
  if max_utterances < 0:
    raise ValueError(f'max_utterances must be >= 0, got {max_utterances}')
  spec = context_task.load_checked_backbone(backbone, max_tokens,
                                            allow_random_backbone, 'tv_shows')
  users = tv_shows.build_users(
      tv_shows.load_sentences(data_dir or _default_data_dir()),
      spec.tokenizer(), max_tokens=max_tokens,
      end_id=spec.vocabulary[bpe_trainer.END_TOKEN], seed=seed,
      max_utterances_per_user=max_utterances or None)
  return from_users(spec, users, max_tokens=max_tokens,
                    local_steps=local_steps, batch_size=batch_size,
                    generator_tokens=generator_tokens, seed=seed)
