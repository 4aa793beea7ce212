"""Named personalization strategies: how an evaluated client gets its model.

After TFF's `personalize_fn_dict` pattern (`tff.learning.algorithms.
build_personalization_eval_computation`): an evaluation takes a dict from
names to strategies and reports each one's metrics under its name. Written
here rather than taken from TFF because TFF's personalization evaluation
starts every client from the global model only; these strategies start from
each client's own private state, as trained.

* `AsTrained()` (`none`): each client's stored private state with the final
  shared model, without the run's `eval_fine_tune` pass (an algorithm whose
  evaluation always fine-tunes, such as FedAvg+FT, still does).
* `FineTune(epochs | steps, batch_size, learning_rate, optimizer)`
  (`fine_tune`): first `epochs` local passes (or exactly `steps` steps)
  over the client's own training data that update only its private
  variables; nothing leaves the client. A process whose clients hold no
  private variables (FedAvg's) tunes a copy of the whole global model, as
  FedAvg+FT does. `fine_tune(steps=1,batch_size=10)` is one SGD step on
  one batch of 10, Per-FedAvg's test-time step.
* `Adapt(samples=k)` (`adapt`): each client's stored private state, and
  the algorithm's own test-time adaptation (FedPerC's fine-tuning or
  generation) reads only the first k of the client's adaptation samples
  (tasks whose evaluation data has them: `eval_datasets(ids, samples=)`);
  k = 0 scores the stored state with no adaptation (FedPerC-frozen's
  reading of a FedPerC run).
* `ColdStart(start, samples, ...)` (`cold_start`): the task's withheld
  users, never trained on, as new users: each starts from `initial` (the
  process's new-user state; FedPerC's is zero offsets), `global` (the
  private state of the final shared model, where there is one) or
  `dp_average` (the DP average of the trained users' private states,
  released once), then adapts on its first k samples, for each k of
  `samples` (the algorithm's own test-time adaptation, or one fine-tuning
  pass on a task that gives the samples apart; k = 0: none).

Strategies are typed values, and also text for flags and records
(`parse` / `to_text`): `[name=]kind[(field=value,...)]`, a list value
separated by `/`:

  none
  ft3=fine_tune(epochs=3,learning_rate=0.01,optimizer=sgd)
  step=fine_tune(steps=1,batch_size=10,learning_rate=0.01,optimizer=sgd)
  a5=adapt(samples=5)
  cold=cold_start(start=dp_average,samples=1/5/all)

Example:

  run = runs.Run.open(directory)
  with runtime.local_runtime():
    record = run.evaluate(strategies={
        'none': strategies.AsTrained(),
        'ft3': strategies.FineTune(epochs=3),
        'new': strategies.ColdStart(start='dp_average', samples=(1, 'all'))})
  record['strategies']['ft3']['eval']
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping, Optional, Sequence, Union

# How a new user starts (`ColdStart.start`).
COLD_STARTS = ('initial', 'global', 'dp_average')
FINE_TUNE_OPTIMIZERS = ('sgd', 'adam')
DEFAULT_NEW_USERS_DELTA = 1e-5


@dataclasses.dataclass(frozen=True)
class AsTrained:
  """Each client's stored private state, as trained (`none`)."""
  kind = 'none'


@dataclasses.dataclass(frozen=True)
class FineTune:
  """Local passes over the client's own training data, then the test.

  Attributes:
    epochs: passes over the client's training data of the run's last
      round (a client with fewer examples than a batch takes one step per
      pass); each step updates only the client's private variables.
    learning_rate: the fine-tuning learning rate; None: the algorithm's own
      fine-tuning optimizer if it declares one, else the run's
      `private_learning_rate` (Adam), else its client optimizer.
    optimizer: 'sgd' or 'adam' with `learning_rate`; None: Adam when a
      learning rate is given.
    steps: exactly this many steps instead of whole passes: the first
      `steps` batches of the passes repeated (a client without training
      examples takes none). Given with `epochs` left at 1.
    batch_size: the examples of one step, the pass cut anew in its order
      (the last batch of a pass may be smaller); None: the task's batches.
  """
  epochs: int = 1
  learning_rate: Optional[float] = None
  optimizer: Optional[str] = None
  steps: Optional[int] = None
  batch_size: Optional[int] = None
  kind = 'fine_tune'

  def __post_init__(self):
    for name in ('epochs', 'steps', 'batch_size'):
      value = getattr(self, name)
      if (value is not None or name == 'epochs') and (
          isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f'fine_tune {name} must be an int >= 1, got '
                         f'{value!r}')
    if self.steps is not None and self.epochs != 1:
      raise ValueError(f'fine_tune takes epochs or steps, not both; got '
                       f'epochs={self.epochs}, steps={self.steps}')
    if self.learning_rate is not None and not self.learning_rate > 0:
      raise ValueError(f'fine_tune learning_rate must be > 0, got '
                       f'{self.learning_rate}')
    if self.optimizer is not None:
      if self.optimizer not in FINE_TUNE_OPTIMIZERS:
        raise ValueError(f'fine_tune optimizer must be one of '
                         f'{FINE_TUNE_OPTIMIZERS}, got {self.optimizer!r}')
      if self.learning_rate is None:
        raise ValueError('fine_tune optimizer needs a learning_rate')

  def build_optimizer(self):
    """The strategy's own optimizer, or None (the run's)."""
    if self.learning_rate is None:
      return None
    import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top
    if self.optimizer == 'sgd':
      return tff.learning.optimizers.build_sgdm(
          learning_rate=self.learning_rate)
    return tff.learning.optimizers.build_adam(
        learning_rate=self.learning_rate)


@dataclasses.dataclass(frozen=True)
class Adapt:
  """The algorithm's own test-time adaptation on the first `samples`
  adaptation samples of each evaluated client (its stored private state).

  Attributes:
    samples: how many adaptation samples (>= 0) the adaptation reads; 0:
      none, so the client is scored on its stored state with no test-time
      adaptation at all.
  """
  samples: int = 1
  kind = 'adapt'

  def __post_init__(self):
    if isinstance(self.samples, bool) or not isinstance(self.samples, int) or (
        self.samples < 0):
      raise ValueError(f'adapt samples must be an int >= 0, got '
                       f'{self.samples!r}')


@dataclasses.dataclass(frozen=True)
class ColdStart:
  """The task's withheld users, evaluated as new users.

  Each withheld user (never trained on) starts from `start`, then the
  algorithm's own test-time adaptation (its evaluation model: FedPerC's
  fine-tuning or generation) reads its first k adaptation samples, for
  each k of `samples`, and its test split is scored.

  Attributes:
    samples: the adaptation sample counts, ints >= 0 (0: no adaptation) or
      'all'.
    start: 'initial': the process's new-user state (FedPerC's: zero
      offsets; others: the store's documented initial state of an id past
      the population). 'global': the private state of the final shared
      model, where the private state has a shared counterpart (Ditto's
      and APFL's personal model, pFedMe's head; a process with nothing
      private starts every user from the global model anyway). 'dp_average': the DP average of the trained users'
      private states (`core/new_users.build_dp_mean`), released once, its
      noise drawn from the run's seed.
    noise_multiplier: the DP average's noise stddev over its clip.
    clip_norm: each trained user's state is clipped to this L2 norm; None:
      the process's `new_user_dp_clip` (FedPerC's per variant).
    delta: the DP average's delta (None: the run's DP delta, else 1e-5).
  """
  samples: tuple = ('all',)
  start: str = 'initial'
  noise_multiplier: float = 1.0
  clip_norm: Optional[float] = None
  delta: Optional[float] = None
  kind = 'cold_start'

  def __post_init__(self):
    samples = self.samples
    if isinstance(samples, (str, int)):
      samples = (samples,)
    try:
      samples = tuple(s if s == 'all' else int(s) for s in samples)
    except (TypeError, ValueError) as e:
      raise ValueError(f'cold_start samples must be ints >= 0 or "all", got '
                       f'{self.samples}') from e
    if not samples or any(s != 'all' and s < 0 for s in samples):
      raise ValueError(f'cold_start samples must be ints >= 0 or "all", got '
                       f'{self.samples}')
    object.__setattr__(self, 'samples', samples)
    if self.start not in COLD_STARTS:
      raise ValueError(f'cold_start start must be one of {COLD_STARTS}, '
                       f'got {self.start!r}')
    if self.noise_multiplier < 0 or (self.clip_norm is not None and
                                     not self.clip_norm > 0):
      raise ValueError(f'cold_start DP average needs noise_multiplier >= 0 '
                       f'and clip_norm > 0, got {self.noise_multiplier}, '
                       f'{self.clip_norm}')
    if self.delta is not None and not 0 < self.delta < 1:
      raise ValueError(f'cold_start delta must be in (0, 1), got '
                       f'{self.delta}')


Strategy = Union[AsTrained, FineTune, Adapt, ColdStart]
KINDS = {c.kind: c for c in (AsTrained, FineTune, Adapt, ColdStart)}
# Strategies that score the evaluated (trained) clients, e.g. at every
# point of the learning curve; the others score other users, once.
PER_CLIENT = (AsTrained, FineTune, Adapt)

_TEXT = re.compile(r'^(?:(?P<name>[A-Za-z0-9_.-]+)=)?(?P<kind>[a-z_]+)'
                   r'(?:\((?P<args>[^()]*)\))?$')
_NAME = re.compile(r'^[A-Za-z0-9_.-]+$')


def _value(field: dataclasses.Field, text: str) -> Any:
  if field.name == 'samples':
    if field.type in ('int', int):  # Adapt's one count.
      return int(text)
    return tuple(s.strip() for s in text.split('/') if s.strip())
  if text in ('None', 'none', ''):
    return None
  if field.name in ('epochs', 'steps', 'batch_size'):
    return int(text)
  if field.name in ('learning_rate', 'noise_multiplier', 'clip_norm',
                    'delta'):
    return float(text)
  return text


def parse(text: str) -> tuple[str, Strategy]:
  """`'[name=]kind[(field=value,...)]'` -> `(name, strategy)`; the name
  defaults to the kind.

  Raises:
    ValueError: the text, its kind, a field or a value is not valid (the
      message names it and the valid ones).
  """
  match = _TEXT.match(text.replace(' ', ''))
  if not match:
    raise ValueError(f'strategy {text!r} is not [name=]kind[(field=value,'
                     f'...)], e.g. ft3=fine_tune(epochs=3)')
  kind = match.group('kind')
  if kind not in KINDS:
    raise ValueError(f'strategy {text!r}: unknown kind {kind!r}; the kinds '
                     f'are {sorted(KINDS)}')
  cls = KINDS[kind]
  fields = {f.name: f for f in dataclasses.fields(cls)}
  values = {}
  for item in filter(None, (match.group('args') or '').split(',')):
    key, sep, value = item.partition('=')
    if not sep or key not in fields:
      raise ValueError(f'strategy {text!r}: {item!r} is not field=value '
                       f'with a field of {kind} ({sorted(fields) or "none"})')
    try:
      values[key] = _value(fields[key], value)
    except ValueError as e:
      raise ValueError(f'strategy {text!r}: {key}={value!r} is not a valid '
                       'value') from e
  return match.group('name') or kind, cls(**values)


def to_text(strategy: Strategy) -> str:
  """The strategy as `kind(field=value,...)` (its non-default fields);
  `parse(to_text(s))[1] == s`."""
  args = []
  for f in dataclasses.fields(strategy):
    value = getattr(strategy, f.name)
    if value == f.default:
      continue
    if isinstance(value, tuple):
      value = '/'.join(str(v) for v in value)
    args.append(f'{f.name}={value}')
  return strategy.kind + (f'({",".join(args)})' if args else '')


def resolve(strategies: Union[None, Mapping[str, Any], Sequence[str]]
            ) -> dict[str, Strategy]:
  """A `{name: strategy}` from a mapping of names to strategies or texts,
  or from a list of texts (`parse`).

  Raises:
    ValueError: a name repeats or is not a plain name, or a strategy is not
      valid.
  """
  if not strategies:
    return {}
  items = []
  if isinstance(strategies, Mapping):
    for name, s in strategies.items():
      items.append((name, parse(s)[1] if isinstance(s, str) else s))
  else:
    items = [parse(s) if isinstance(s, str) else
             (getattr(s, 'kind', type(s).__name__), s) for s in strategies]
  out = {}
  for name, s in items:
    if not isinstance(s, tuple(KINDS.values())):
      raise ValueError(f'strategy {name!r} is a {type(s).__name__}, not one '
                       f'of {sorted(KINDS)}')
    if not isinstance(name, str) or not _NAME.match(name):
      raise ValueError(f'strategy name {name!r} must be letters, digits, '
                       '_ . -')
    if name in out:
      raise ValueError(f'strategy name {name!r} is given twice')
    out[name] = s
  return out


def texts(strategies: Mapping[str, Strategy]) -> tuple[str, ...]:
  """`{name: strategy}` as the texts `resolve` reads back."""
  return tuple(f'{name}={to_text(s)}' for name, s in strategies.items())
