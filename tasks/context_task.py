"""FedPerC's kind of task: users who write text in contexts, on a frozen GPT-2.

`ContextTask` is the one run path's task (`core/task.py`) over any users
whose utterances are tokenized and split by `tasks/tv_shows.build_users`
(60 / 20 / 20 into train / fine-tune / test, seeded); two builders make it:

* `tasks/tv_shows_task.tv_shows_task`: the paper's Friends and Game of
  Thrones characters (`--task=tv_shows`);
* `context_table_task` here: any table of (user, context, text) rows, a
  CSV or TSV file, from options alone (`--task=context_table`), for
  example the Moby Shakespeare with characters as users and plays as
  contexts:

    python -m binaries.train --task=context_table \
      --data_dir=../shared/data/shakespeare \
      --task_options=path=shakespeare.tsv.gz,user_column=play+speaker \
      --task_options=context_column=play,backbone=out/backbone ...

What the task gives the run:

* Training: in a round, a client's data are `local_steps` batches of
  `batch_size` utterances sampled from its training split with the
  generator seeded by (seed, round - 1, client).
* Evaluation (`eval_datasets`, `eval_batches`): each user's fine-tuning
  utterances (role `y` = 0) then its test utterances (`y` = 1); the
  algorithm adapts on the former and scores the latter
  (`algorithms/fedperc.FedPercEvalModel`), and `evaluate` reports the pooled
  perplexity exp(sum NLL / tokens) over the users' test tokens after the
  first three (the prompt).
* Withheld users (`withheld_names`, the `withheld` capability): never
  trained on; `withheld_eval_datasets(ids, samples)` gives each one's first
  `samples` fine-tuning utterances (None: all) and its test utterances, in
  the evaluation's form, for the new-user evaluation
  (`new_user_evaluation.evaluate_new_users`: a start state, then the
  algorithm's own adaptation on those samples).
* Model: `fedperc_model_fn_factory(variant, seed)` builds
  `models/fedperc.FedPercModel` on the backbone.
"""

from __future__ import annotations

import collections
import csv
import gzip
import io
import os
from typing import Optional, Sequence

import numpy as np
import tensorflow as tf

from tasks import tv_shows
from tff_personal.core import client_data as client_data_lib
from tff_personal.core import evaluation
from tff_personal.models import bpe_trainer
from tff_personal.models import fedperc
from tff_personal.models import fedperc_backbone

_KEYS = ('ids', 'mask', 'context')
EVAL_BATCH = 64


class ContextTask:
  """Users' utterances in contexts, on a frozen backbone (module docstring).

  Attributes:
    name: the task's name ('tv_shows', 'context_table', ...).
    spec: the loaded backbone.
    users: every user's tokenized splits, by name (`tv_shows.build_users`).
    contexts: the contexts' names; a user's `context` indexes them.
    client_names: the user of each client index (the trained users).
    withheld_names: the users never trained on.

  Example:

    users = tv_shows.build_users(sentences, spec.tokenizer(), ...)
    task = ContextTask(spec, users, contexts=('a', 'b'),
                       client_names=['u1', 'u2'], withheld_names=['u3'],
                       max_tokens=24, local_steps=10, batch_size=15,
                       generator_tokens=12, seed=0)
  """

  def __init__(self, spec: fedperc_backbone.BackboneSpec,
               users: dict[str, tv_shows.UserData], *,
               contexts: Sequence[str], client_names: Sequence[str],
               withheld_names: Sequence[str] = (), max_tokens: int,
               local_steps: int, batch_size: int, generator_tokens: int,
               seed: int, name: str = 'context_table'):
    if local_steps < 1 or batch_size < 1:
      raise ValueError(f'local_steps ({local_steps}) and batch_size '
                       f'({batch_size}) must be >= 1')
    if generator_tokens < 0:
      raise ValueError(f'generator_tokens must be >= 0, got '
                       f'{generator_tokens}')
    if not client_names:
      raise ValueError(f'{name}: no users to train on')
    both = sorted(set(client_names) & set(withheld_names))
    if both:
      raise ValueError(f'{name}: users {both} are both trained and withheld')
    missing = [u for u in list(client_names) + list(withheld_names)
               if u not in users]
    if missing:
      raise ValueError(f'{name}: no data for users {missing}')
    self.name = name
    self.spec = spec
    self.users = users
    self.contexts = tuple(contexts)
    self.client_names = list(client_names)
    self.withheld_names = list(withheld_names)
    self.max_tokens = max_tokens
    self.local_steps = local_steps
    self.batch_size = batch_size
    self.generator_tokens = generator_tokens
    self.seed = seed
    self._train_spec = fedperc.batch_spec(max_tokens)
    self._eval_spec = fedperc.eval_batch_spec(max_tokens)

  @property
  def population(self) -> int:
    return len(self.client_names)

  # ------------------------------------------------------------ models

  def config(self, variant: str) -> fedperc.FedPercConfig:
    return fedperc.FedPercConfig(
        variant=variant, num_contexts=len(self.contexts),
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

  def _check_ids(self, client_ids: Sequence[int], names: Sequence[str],
                 what: str = 'client') -> None:
    for c in client_ids:
      if not 0 <= int(c) < len(names):
        raise ValueError(f'{self.name}: {what} index {c} is not in '
                         f'[0, {len(names)})')

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
    self._check_ids(client_ids, self.client_names)
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

  def _eval_arrays(self, user: str, samples: Optional[int] = None
                   ) -> collections.OrderedDict:
    splits = self.users[user].splits
    tune, test = splits['fine_tune'], splits['test']
    tune = {k: v[:samples] for k, v in tune.items()}
    out = collections.OrderedDict(
        (k, np.concatenate([tune[k], test[k]])) for k in _KEYS)
    out[fedperc.ROLE] = np.concatenate([
        np.full(len(tune['ids']), fedperc.ROLE_FINE_TUNE, np.int32),
        np.full(len(test['ids']), fedperc.ROLE_TEST, np.int32)])
    return out

  def _eval_batches(self, users: Sequence[str], samples: Optional[int]
                    ) -> list[client_data_lib.ClientBatches]:
    out = []
    for user in users:
      arrays = self._eval_arrays(user, samples)
      out.append(client_data_lib.ClientBatches.from_arrays(
          arrays, EVAL_BATCH, [np.arange(len(arrays['ids']))],
          self._eval_spec))
    return out

  def eval_batches(self, client_ids: Sequence[int],
                   samples: Optional[int] = None
                   ) -> list[client_data_lib.ClientBatches]:
    """Each client's fine-tuning (its first `samples` of them; None: all)
    then test utterances, with their roles."""
    _check_samples(samples)
    self._check_ids(client_ids, self.client_names)
    return self._eval_batches([self.client_names[int(c)] for c in client_ids],
                              samples)

  def eval_datasets(self, client_ids: Sequence[int],
                    samples: Optional[int] = None) -> list[tf.data.Dataset]:
    return [tf.data.Dataset.from_tensor_slices(b.examples).batch(EVAL_BATCH)
            for b in self.eval_batches(client_ids, samples)]

  def withheld_eval_datasets(self, ids: Sequence[int],
                             samples: Optional[int] = None
                             ) -> list[tf.data.Dataset]:
    """Withheld users `ids` (indices of `withheld_names`): each one's first
    `samples` fine-tuning utterances (None: all), then its test ones, in the
    form of `eval_datasets`."""
    _check_samples(samples)
    self._check_ids(ids, self.withheld_names, 'withheld user')
    return [tf.data.Dataset.from_tensor_slices(b.examples).batch(EVAL_BATCH)
            for b in self._eval_batches(
                [self.withheld_names[int(i)] for i in ids], samples)]

  def evaluate(self, per_client_outputs, client_ids) -> dict:
    """Pooled test perplexity (`core/evaluation.pooled_perplexity`)."""
    del client_ids
    return dict(evaluation.pooled_perplexity(per_client_outputs))


def _check_samples(samples: Optional[int]) -> None:
  if samples is not None and samples < 0:
    raise ValueError(f'samples must be >= 0 or None (all), got {samples}')


# ------------------------------------------------------------ from a table


class TableError(ValueError):
  """A (user, context, text) table cannot be read as the options say."""


def _open_text(path: str):
  if path.endswith('.gz'):
    return io.TextIOWrapper(gzip.open(path, 'rb'), encoding='utf-8')
  return open(path, encoding='utf-8')


def load_table(path: str, *, user_column: str = 'user',
               context_column: str = 'context', text_column: str = 'text',
               contexts: Sequence[str] = ()
               ) -> dict[str, tuple[str, list[str]]]:
  """A table's users: `{user: (context, [sentence, ...])}`, in file order.

  Args:
    path: a CSV file, or TSV if its name ends in `.tsv` or `.tsv.gz`
      (`.gz`: gzip), with a header row naming its columns.
    user_column: the column naming a row's user; `a+b` joins columns `a`
      and `b` with '/' (e.g. `play+speaker`, when a name means a different
      person in each play).
    context_column, text_column: the context's and the utterance's columns.
    contexts: keep only rows of these contexts (all if empty).

  Returns:
    Each user's one context and the sentences of its rows
    (`tv_shows.split_sentences`).

  Raises:
    TableError: the file is missing, a column is not in its header, or a
      user has rows in two contexts.
  """
  if not os.path.isfile(path):
    raise TableError(f'context table {path} does not exist')
  delimiter = '\t' if path.endswith(('.tsv', '.tsv.gz')) else ','
  user_parts = user_column.split('+')
  out: dict[str, tuple[str, list[str]]] = {}
  keep = set(contexts)
  with _open_text(path) as f:
    reader = csv.DictReader(f, delimiter=delimiter)
    header = reader.fieldnames or []
    for column in user_parts + [context_column, text_column]:
      if column not in header:
        raise TableError(f'{path}: no column {column!r}; its columns: '
                         f'{header}')
    for line, row in enumerate(reader, start=2):
      if any(row[c] is None for c in user_parts + [context_column,
                                                   text_column]):
        raise TableError(f'{path}, line {line}: fewer columns than its '
                         f'header ({header})')
      context = row[context_column]
      if keep and context not in keep:
        continue
      user = '/'.join(row[c] for c in user_parts)
      known = out.setdefault(user, (context, []))
      if known[0] != context:
        raise TableError(
            f'{path}, line {line}: user {user!r} has rows in contexts '
            f'{known[0]!r} and {context!r}; a user has one context (join '
            f'the context into the user: user_column='
            f'{context_column}+{user_column})')
      known[1].extend(tv_shows.split_sentences(row[text_column] or ''))
  missing = sorted(keep - {c for c, _ in out.values()})
  if missing:
    raise TableError(f'{path}: no rows of contexts {missing}')
  return out


def choose_users(table: dict[str, tuple[str, list[str]]], max_users: int,
                 withheld_users: int) -> tuple[list[str], list[str]]:
  """(trained users, withheld users) of a table.

  The `max_users` users with the most sentences are kept (ties by name; 0:
  all); `withheld_users` of them, evenly spaced in that ranking (so that
  big and small users are withheld alike), are never trained on.
  """
  if max_users < 0 or withheld_users < 0:
    raise ValueError(f'max_users ({max_users}) and withheld_users '
                     f'({withheld_users}) must be >= 0')
  ranked = sorted(table, key=lambda u: (-len(table[u][1]), u))
  if max_users:
    ranked = ranked[:max_users]
  if withheld_users >= len(ranked):
    raise ValueError(f'withheld_users ({withheld_users}) must leave users to '
                     f'train: the table has {len(ranked)} users to keep')
  picks = {int((i + 0.5) * len(ranked) / withheld_users)
           for i in range(withheld_users)} if withheld_users else set()
  withheld = [u for i, u in enumerate(ranked) if i in picks]
  return [u for u in ranked if u not in withheld], withheld


def load_checked_backbone(backbone: Optional[str], max_tokens: int,
                          allow_random_backbone: bool, task_name: str
                          ) -> fedperc_backbone.BackboneSpec:
  """The backbone preset, refused when missing, random (unless allowed) or
  too short for `max_tokens`."""
  if not backbone:
    raise ValueError(f'{task_name} needs --task_options=backbone=<a '
                     'keras-nlp GPT-2 preset or a directory made by '
                     'binaries.pretrain_backbone>')
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
  return spec


def context_table_task(data_dir: Optional[str] = None, *, path: str = '',
                       user_column: str = 'user',
                       context_column: str = 'context',
                       text_column: str = 'text', contexts: str = '',
                       max_users: int = 20, withheld_users: int = 4,
                       backbone: str = '', max_tokens: int = 24,
                       max_utterances: int = 200, local_steps: int = 10,
                       batch_size: int = 15, generator_tokens: int = 12,
                       allow_random_backbone: bool = False,
                       seed: int = 0) -> ContextTask:
  """A FedPerC task over a (user, context, text) table, from options.

  Args:
    data_dir: the folder `path` is relative to.
    path: the table (`load_table`: CSV, or TSV by its name; gzip if `.gz`).
    user_column, context_column, text_column: its columns (`load_table`;
      `a+b` joins user columns).
    contexts: '|'-separated contexts to keep (empty: all).
    max_users, withheld_users: users kept, and of them never trained on
      (`choose_users`).
    backbone: a keras-nlp GPT-2 preset name or directory
      (`binaries.pretrain_backbone` makes one).
    max_tokens, max_utterances, local_steps, batch_size, generator_tokens,
    allow_random_backbone: as for `tv_shows_task`.
    seed: the data seed: the users' splits and the rounds' batches.
  """
  if not path:
    raise ValueError('context_table needs --task_options=path=<a CSV or TSV '
                     'file of user, context and text columns>')
  if max_utterances < 0:
    raise ValueError(f'max_utterances must be >= 0, got {max_utterances}')
  full = path if os.path.isabs(path) or not data_dir else os.path.join(
      data_dir, path)
  table = load_table(full, user_column=user_column,
                     context_column=context_column, text_column=text_column,
                     contexts=[c for c in contexts.split('|') if c])
  trained, withheld = choose_users(table, max_users, withheld_users)
  kept = trained + withheld
  names = sorted({table[u][0] for u in kept})
  spec = load_checked_backbone(backbone, max_tokens, allow_random_backbone,
                               'context_table')
  users = tv_shows.build_users(
      {u: table[u][1] for u in kept}, spec.tokenizer(),
      max_tokens=max_tokens, end_id=spec.vocabulary[bpe_trainer.END_TOKEN],
      seed=seed, max_utterances_per_user=max_utterances or None, users=kept,
      context_of={u: names.index(table[u][0]) for u in kept})
  return ContextTask(spec, users, contexts=names, client_names=trained,
                     withheld_names=withheld, max_tokens=max_tokens,
                     local_steps=local_steps, batch_size=batch_size,
                     generator_tokens=generator_tokens, seed=seed,
                     name='context_table')
