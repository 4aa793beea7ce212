"""The Task interface: what a federated task gives the one run path.

A task is federated data plus model factories plus metrics. It builds
`tf.data` datasets (or numpy `ClientBatches`) and Keras-backed `SplitModel`
builders; it never builds TFF computations. `runs.run_experiment`
drives any object that satisfies `Task`; an algorithm spec
(`algorithms/registry.py`) names the capabilities it needs beyond it, and
`missing_capabilities` says which of them a task lacks.

Required (`Task`):

* `name`, `population` (client ids are `0 .. population - 1`);
* `metrics_fn(batch, outputs) -> OrderedDict` of training-metric sums;
* `train_datasets(ids, round_num)`: each client's local-training data of a
  round (every local epoch included), a pure function of (seed, round, id);
* `eval_datasets(ids)`; `evaluate(per_client_outputs, ids) -> dict`.

Optional capabilities (`CAPABILITIES`; `capabilities(task)` lists those a
task has):

* `split_model`: `model_fn_factory(embedding_dim) -> SplitModelFn`, the
  task's split model; with `embedding_dim > 0` a private personal embedding
  per user, with 0 an ordinary federated model (no private variables). What
  the algorithms of model kind 'split' train (every task but `tv_shows`,
  whose model is FedPerC's);
* `personal_embedding`: `model_fn_factory(d)` with `d > 0` gives a personal
  embedding (declared by `supports_personal_embedding = True`);
* `fedembed_model`: `fedembed_model_fn_factory(FedEmbedConfig)`, FedEmbed's
  model with one head per type of sample (`num_types`);
* `batches`: `train_batches` (numpy `ClientBatches`, with an optional
  `wire_format`; `eval_batches` too where it has them) for the sharded
  simulation; without them sharded runs read the `tf.data` datasets;
* `test_split`: `test_datasets(ids)`, a held-out split tested after training;
* `cold_start`: `cold_client_ids` and `cold_start_datasets(ids, epochs)`,
  users withheld from training;
* `withheld`: `withheld_names` and `withheld_eval_datasets(ids, samples)`,
  users never trained on, each with its first `samples` adaptation
  examples and its test examples in the evaluation's form
  (`new_user_evaluation.evaluate_new_users`);
* `groups`: `groups(ids)`, a group (sub-population) per client;
* `named_head`: the model's output layer is named 'head' (declared by
  `has_named_head = True`), FedRep's and pFedMe's personal head;
* `digit_images`: examples are MNIST-shaped images with a digit label
  (declared by `has_digit_images = True`), what FedDVA's models take;
* `fedperc_model`: `fedperc_model_fn_factory(variant, seed)`, a builder of
  FedPerC's model (`models/fedperc.FedPercModel`: a frozen language-model
  backbone plus the variant's learned parts) on the task's utterances. Its
  algorithms train on `ids`/`mask`/`context` batches and evaluate on
  batches that add a role `y` (0: fine-tuning utterance, 1: test
  utterance; `algorithms/fedperc.FedPercEvalModel`), whose per-utterance
  outputs `evaluate` pools into a perplexity.

Example:

  from tff_personal.core import task as task_lib
  task = my_task()            # any object with the members above
  task_lib.check_task(task)   # raises, naming what is missing
  task_lib.capabilities(task) # e.g. ('batches', 'personal_embedding')
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Protocol, Sequence, runtime_checkable

import numpy as np
import tensorflow as tf



@runtime_checkable
class Task(Protocol):
  """What every task gives (see the module docstring)."""

  name: str

  @property
  def population(self) -> int:
    ...

  def metrics_fn(self, batch, outputs) -> Any:
    ...

  def train_datasets(self, client_ids: Sequence[int],
                     round_num: int) -> list[tf.data.Dataset]:
    ...

  def eval_datasets(self, client_ids: Sequence[int]
                    ) -> list[tf.data.Dataset]:
    ...

  def evaluate(self, per_client_outputs, client_ids) -> dict:
    ...


REQUIRED = ('name', 'population', 'metrics_fn',
            'train_datasets', 'eval_datasets', 'evaluate')

# Capability -> (members that provide it, what it is for).
CAPABILITIES: dict[str, tuple[tuple[str, ...], str]] = {
    'split_model': (
        ('model_fn_factory',),
        'model_fn_factory(embedding_dim) gives the task\'s split model'),
    'personal_embedding': (
        ('supports_personal_embedding',),
        'model_fn_factory(embedding_dim > 0) gives a private personal '
        'embedding'),
    'fedembed_model': (
        ('fedembed_model_fn_factory',),
        "FedEmbed's model: one head per type of sample"),
    'batches': (
        ('train_batches',),
        'numpy ClientBatches for the sharded simulation'),
    'test_split': (('test_datasets',), 'a held-out test split'),
    'withheld': (
        ('withheld_names', 'withheld_eval_datasets'),
        'users never trained on, evaluated as new users: a start state, then '
        'the algorithm\'s adaptation on k of their samples'),
    'cold_start': (
        ('cold_client_ids', 'cold_start_datasets'),
        'users withheld from training, evaluated after local steps'),
    'groups': (('groups',), 'a group (sub-population) per client'),
    'digit_images': (
        ('has_digit_images',),
        'examples are 28 x 28 x 1 images in [0, 1] with a class label in '
        "0..9 (FedDVA's VAE and classifier)"),
    'named_head': (
        ('has_named_head',),
        "the model's output layer is named 'head' (the personal head of "
        'FedRep and pFedMe; their head_layer option names another)'),
    'fedperc_model': (
        ('fedperc_model_fn_factory',),
        "FedPerC's model: a frozen language model with personal and "
        'context embeddings (utterances with a context)'),
}


def _has(task, member: str) -> bool:
  value = getattr(task, member, None)
  if member.startswith(('supports_', 'has_')):
    return value is True
  return value is not None


def capabilities(task) -> tuple[str, ...]:
  """The optional capabilities `task` provides, sorted."""
  return tuple(sorted(name for name, (members, _) in CAPABILITIES.items()
                      if all(_has(task, m) for m in members)))


def missing_capabilities(task, needs: Sequence[str]) -> list[str]:
  """Those of `needs` that `task` lacks, each as 'name (what it is)'.

  Raises:
    ValueError: `needs` names an unknown capability.
  """
  unknown = sorted(set(needs) - set(CAPABILITIES))
  if unknown:
    raise ValueError(f'unknown task capabilities {unknown}; known: '
                     f'{sorted(CAPABILITIES)}')
  have = set(capabilities(task))
  return [f'{n} ({CAPABILITIES[n][1]})' for n in needs if n not in have]


def check_task(task) -> None:
  """Raises TypeError naming each required member `task` lacks."""
  missing = [m for m in REQUIRED if not hasattr(task, m)]
  not_callable = [m for m in REQUIRED[2:]
                  if hasattr(task, m) and not callable(getattr(task, m))]
  if missing or not_callable:
    raise TypeError(
        f'{type(task).__name__} is not a Task: '
        + '; '.join(([f'missing {missing}'] if missing else []) +
                    ([f'not callable {not_callable}'] if not_callable
                     else []))
        + ' (tff_personal/core/task.py says what a task gives)')


def task_name(task) -> str:
  return getattr(task, 'name', type(task).__name__)


# The attribute a task built by name carries: how to build it again.
_BUILD_RECORD = '_tff_personal_build_record'


def set_build_record(task, name: str, arguments: dict) -> None:
  """Records on `task` how it was built (`tasks/registry.build_task`): its
  registry name (or `package.module:factory`) and the builder's keyword
  arguments. A run records it (run_config.json), so that `Run.open`
  rebuilds the task from the run's directory alone. A task object that
  takes no attributes is left as it is."""
  try:
    setattr(task, _BUILD_RECORD, {'name': name, 'arguments': dict(arguments)})
  except AttributeError:
    pass


def build_record(task) -> Optional[dict]:
  """`{'name', 'arguments'}` of a task built by name, else None (a task
  built directly: a run of it is reopened with the task given)."""
  return getattr(task, _BUILD_RECORD, None)


def describe(task) -> str:
  """One line: the task's name, population and capabilities."""
  caps = ', '.join(capabilities(task)) or 'none'
  return f'{task_name(task)}: {task.population} clients; capabilities: {caps}'



# Members that take client ids first, and what their ids are mapped through.
_ID_METHODS = ('train_datasets', 'train_batches', 'eval_datasets',
               'eval_batches', 'test_datasets', 'groups')


class TaskSubset:
  """`task` restricted to some of its clients, renumbered `0 .. n - 1`.

  Client `i` of the subset is client `client_ids[i]` of `task`: every
  member that takes client ids (`train_datasets`, `train_batches`,
  `eval_datasets`, `eval_batches`, `test_datasets`, `groups`, `evaluate`)
  maps them, and exists only where `task` has it, so the subset has the
  task's capabilities (but `cold_start`, whose users are not in the
  subset). The model factories, `metrics_fn` and `wire_format` are the
  task's. What a per-group stage (`core/stages.py`) trains and evaluates:
  one group's clients, as a task of its own.

  Example:

    comedy = task_lib.TaskSubset(task, task.clients_of('comedy'))
    comedy.train_datasets([0, 1], round_num=3)  # clients_of('comedy')[:2]
  """

  def __init__(self, task, client_ids: Sequence[int], name: str = ''):
    ids = [int(i) for i in client_ids]
    if not ids:
      raise ValueError('a task subset needs at least one client')
    if len(set(ids)) != len(ids):
      raise ValueError('a task subset lists a client twice')
    bad = [i for i in ids if not 0 <= i < task.population]
    if bad:
      raise ValueError(f'clients {bad[:5]} are not in [0, '
                       f'{task.population}) of task {task_name(task)!r}')
    self.task = task
    self.client_ids = ids
    self.name = name or task_name(task)
    for member in _ID_METHODS:
      method = getattr(task, member, None)
      if method is not None:
        setattr(self, member, self._mapped(method))
    for member in ('model_fn_factory', 'fedembed_model_fn_factory',
                   'fedperc_model_fn_factory', 'wire_format',
                   'supports_personal_embedding', 'has_named_head',
                   'has_digit_images'):
      if hasattr(task, member):
        setattr(self, member, getattr(task, member))

  def _mapped(self, method):
    @functools.wraps(method)  # Its signature is the task's method's.
    def call(client_ids, *args, **kwargs):
      return method(self.global_ids(client_ids), *args, **kwargs)
    return call

  def global_ids(self, client_ids: Sequence[int]) -> list[int]:
    """The task's ids of the subset's clients `client_ids`."""
    return [self.client_ids[int(i)] for i in client_ids]

  @property
  def population(self) -> int:
    return len(self.client_ids)

  def metrics_fn(self, batch, outputs):
    return self.task.metrics_fn(batch, outputs)

  def evaluate(self, per_client_outputs, client_ids) -> dict:
    return self.task.evaluate(per_client_outputs, self.global_ids(client_ids))


def choose_withheld(population: int, withheld: float, seed: int,
                    name: str) -> list[int]:
  """The clients `withheld` keeps out of training, in increasing order.

  Args:
    population: the task's clients, `0 .. population - 1`.
    withheld: a count (>= 1), a fraction in (0, 1), or 0 (none).
    seed: the task's seed; the draw is a function of it alone.
    name: the task's name, for errors.

  Returns:
    The withheld clients' ids (at least one client is left to train).

  Raises:
    ValueError: `withheld` is not a count, a fraction or 0, or leaves no
      client to train.
  """
  if isinstance(withheld, bool) or not isinstance(withheld, (int, float)) or (
      not withheld >= 0):
    raise ValueError(f'{name}: withheld_clients must be a count >= 1, a '
                     f'fraction in (0, 1) or 0, got {withheld!r}')
  if withheld == 0:
    return []
  if withheld < 1:
    count = max(1, int(round(withheld * population)))
  elif float(withheld).is_integer():
    count = int(withheld)
  else:
    raise ValueError(f'{name}: withheld_clients={withheld} is neither a '
                     'whole count nor a fraction in (0, 1)')
  if count >= population:
    raise ValueError(f'{name}: withheld_clients={withheld} withholds '
                     f'{count} of {population} clients; at least one must '
                     'train')
  rng = np.random.default_rng([seed, 0x57a7])
  return sorted(rng.choice(population, size=count, replace=False).tolist())


class WithheldTask(TaskSubset):
  """`task` with some clients withheld from training: the `withheld`
  capability for a task that has no option of its own for it.

  The trained clients are a `TaskSubset` (renumbered `0 .. n - 1`, every
  capability of `task` kept); the withheld ones are evaluated as new users
  (`strategies.ColdStart`): `withheld_eval_datasets` gives their
  evaluation data, `withheld_adaptation_datasets` the first examples of
  their round-0 training data (every local epoch of it), and
  `withheld_evaluate` scores them as `task.evaluate` scores them. Which
  clients are withheld is `choose_withheld` of the task's seed.
  `tasks.registry.build_task` wraps a registered task in it for
  `withheld_clients`, unless the task's builder takes that option itself
  (`ClientDataTask`).

  Example:

    task = WithheldTask(preference_task, withheld_clients=0.1, seed=0)
    task.withheld_names  # ['3', '17', ...]: the task's own client ids
  """

  def __init__(self, task, withheld_clients: float, seed: int = 0):
    withheld = choose_withheld(task.population, withheld_clients, seed,
                               task_name(task))
    if not withheld:
      raise ValueError(f'{task_name(task)}: WithheldTask needs '
                       'withheld_clients > 0')
    held = set(withheld)
    super().__init__(task, [i for i in range(task.population)
                            if i not in held])
    self.withheld_ids = withheld
    self.withheld_clients = withheld_clients
    batch_size = getattr(task, 'batch_size', None)
    self._batch_size = int(batch_size) if batch_size else None

  @property
  def withheld_names(self) -> list[str]:
    """The task's ids of the withheld clients, in the order the withheld_*
    methods index them."""
    return [str(i) for i in self.withheld_ids]

  def _withheld_ids(self, ids: Sequence[int]) -> list[int]:
    bad = [int(i) for i in ids if not 0 <= int(i) < len(self.withheld_ids)]
    if bad:
      raise ValueError(f'{self.name}: withheld client indices {bad[:5]} are '
                       f'not in [0, {len(self.withheld_ids)})')
    return [self.withheld_ids[int(i)] for i in ids]

  def withheld_eval_datasets(self, ids: Sequence[int],
                             samples: Optional[int] = None
                             ) -> list[tf.data.Dataset]:
    """Withheld clients `ids`: each one's evaluation data (`samples` is
    checked only; adaptation reads `withheld_adaptation_datasets`)."""
    if samples is not None and samples < 0:
      raise ValueError(f'samples must be >= 0 or None (all), got {samples}')
    return self.task.eval_datasets(self._withheld_ids(ids))

  def withheld_adaptation_datasets(self, ids: Sequence[int],
                                   samples: Optional[int] = None
                                   ) -> list[tf.data.Dataset]:
    """Withheld clients `ids`: the first `samples` examples (None: all) of
    each one's round-0 training data, in the task's batches."""
    if samples is not None and samples < 0:
      raise ValueError(f'samples must be >= 0 or None (all), got {samples}')
    out = []
    for data in self.task.train_datasets(self._withheld_ids(ids), 0):
      if samples is not None:
        data = data.unbatch().take(samples).batch(self._batch_size or 16)
      out.append(data)
    return out

  def withheld_evaluate(self, per_client_outputs, ids) -> dict:
    """`task.evaluate` of the withheld clients `ids`."""
    return self.task.evaluate(per_client_outputs, self._withheld_ids(ids))
