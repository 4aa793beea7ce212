"""The task registry: names (the `--task` flag values), builders, capabilities.

Every entry (`TaskSpec`) builds a task (`tff_personal/core/task.py`) from a
data directory and keyword arguments. The builder's keyword arguments with a
scalar default are the task's *options* (`--task_options=key=value`, typed
and checked like `--algorithm_options`); `capabilities` are declared here so
that the algorithm x task matrix (`tff_personal/config/matrix.py`,
`binaries.train --list`) is known without loading data, and a test checks them against the
built tasks. Tasks know nothing of algorithms.

Example:

  from tasks import registry
  task = registry.build_task('label_skew_mnist', data_dir='../shared/data/mnist',
                             alpha=0.1)
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
from typing import Any, Callable, Mapping, Sequence

from tasks import client_data_task
from tasks import context_task
from tasks import preference_task
from tasks import shakespeare_groups
from tasks import speaker_task
from tasks import speech_task
from tasks import synthetic_task
from tasks import tv_shows_task
from tff_personal.core import imported
from tff_personal.core import moved
from tff_personal.core import options as options_lib
from tff_personal.core import task as task_lib
from tff_personal.core import worker_threads

# This process's TensorFlow gets the binaries' thread pools unless set,
# before a task's data start TensorFlow (`worker_threads`).
worker_threads.set_process_defaults()


@dataclasses.dataclass(frozen=True)
class TaskSpec:
  """A registered task.

  Attributes:
    name: the `--task` value.
    builder: `(data_dir, **kwargs) -> task`.
    capabilities: what the built task provides (`core/task.CAPABILITIES`).
    summary: one line: the data and the paper it comes from.
    flags: shared binary flags (`--batch_size`, `--num_users`, ...) always
      passed to the builder; other shared flags that the builder accepts are
      passed only when given on the command line.
  """
  name: str
  builder: Callable[..., Any]
  capabilities: tuple[str, ...]
  summary: str
  flags: tuple[str, ...] = ()

  def __post_init__(self):
    unknown = set(self.capabilities) - set(task_lib.CAPABILITIES)
    if unknown:
      raise ValueError(f'{self.name}: unknown capabilities {sorted(unknown)}')
    object.__setattr__(self, 'capabilities',
                       tuple(sorted(self.capabilities)))


_PREFERENCE = ('split_model', 'personal_embedding', 'fedembed_model',
               'batches', 'groups', 'named_head')
_SPECS = (
    TaskSpec('mnist_preference', preference_task.mnist_preference_task,
             _PREFERENCE,
             'FedEmbed 4.2: users who each like one MNIST digit',
             flags=('num_users', 'population', 'batch_size', 'local_epochs')),
    TaskSpec('speech_preference', speech_task.speech_preference_task,
             _PREFERENCE,
             'FedEmbed 4.3: users who each like one synthetic voice',
             flags=('num_users', 'population', 'batch_size', 'local_epochs')),
    TaskSpec('speaker_context', speaker_task.speaker_context_task,
             ('split_model', 'personal_embedding', 'batches', 'test_split',
              'cold_start'),
             'FURL: who speaks a line of Friends, Game of Thrones, '
             'Shakespeare',
             flags=('batch_size', 'local_epochs', 'max_chars', 'lstm_units',
                    'cold_fraction')),
    TaskSpec('label_skew_mnist', client_data_task.label_skew_mnist_task,
             ('split_model', 'batches', 'named_head', 'digit_images'),
             'FedDVA: MNIST with Dirichlet label skew, a CNN classifier'),
    TaskSpec('marked_mnist', client_data_task.marked_mnist_task,
             ('split_model', 'batches', 'named_head', 'digit_images'),
             'FedDVA: MNIST whose clients mark their images, a CNN '
             'classifier'),
    TaskSpec('mnist_client_data', client_data_task.mnist_client_data_task,
             ('split_model', 'personal_embedding', 'fedembed_model',
              'batches', 'named_head'),
             'FedEmbed\'s MNIST users handed over as a TFF ClientData '
             '(the generic task)'),
    TaskSpec('shakespeare_groups', shakespeare_groups.shakespeare_groups_task,
             ('split_model', 'groups'),
             'Group personalized FL: Shakespeare characters as clients, '
             'genres as groups, a word LSTM language model'),
    TaskSpec('synthetic', synthetic_task.synthetic_task,
             ('split_model', 'personal_embedding', 'batches', 'named_head'),
             'Generated users of any population, drawn on demand (the '
             'loop at a million users)',
             flags=('num_users', 'batch_size', 'local_epochs')),
    TaskSpec('tv_shows', tv_shows_task.tv_shows_task,
             ('batches', 'fedperc_model', 'withheld'),
             'FedPerC: Friends and Game of Thrones characters\' utterances, '
             'a frozen GPT-2 language model'),
    TaskSpec('context_table', context_task.context_table_task,
             ('batches', 'fedperc_model', 'withheld'),
             'FedPerC on any (user, context, text) table, from options: '
             'e.g. Shakespeare\'s characters in their plays'),
)

SPECS: dict[str, TaskSpec] = {s.name: s for s in _SPECS}
TASKS = [s.name for s in _SPECS]

# Builder arguments set by the run itself, not options.
RUN_ARGUMENTS = ('data_dir', 'seed')


def spec(name: str) -> TaskSpec:
  """The named task's spec: a registered name, or `package.module:factory`
  for a task defined outside the repository (`outside_spec`)."""
  imported.check_name(name, 'task')
  if imported.is_import_path(name):
    return outside_spec(name)
  if name not in SPECS:
    raise ValueError(f'unknown task {name!r}; known: {TASKS}, or '
                     'package.module:factory for your own')
  return SPECS[name]


def outside_spec(name: str) -> TaskSpec:
  """The spec of the task `package.module:factory` names.

  The attribute is either a `TaskSpec` or a builder `(data_dir, **kwargs)
  -> task` that declares what the task provides in a `capabilities`
  attribute (names of `core/task.CAPABILITIES`), and optionally `flags`
  (shared binary flags it always takes). Its keyword arguments with
  scalar defaults are its options, as for a registered task. The summary
  is the first line of its docstring.

  Example (mypkg/mytask.py; then `--task=mypkg.mytask:make`):

    def make(data_dir, seed=0, clients=100):
      # Docstring: its first line is the summary --list shows.
      return client_data_task.ClientDataTask(...)
    make.capabilities = ('split_model', 'batches')
  """
  target = imported.load(name, 'task')
  with imported.reported('task', name, 'reading its declaration'):
    return _outside_spec(name, target)


def _outside_spec(name: str, target) -> TaskSpec:
  """`outside_spec` of the loaded `target`."""
  if isinstance(target, TaskSpec):
    target = dataclasses.replace(target, name=name)
    return dataclasses.replace(
        target, builder=imported.guarded(target.builder, 'task', name))
  if not callable(target):
    raise ValueError(f'task {name!r} is a {type(target).__name__}, not a '
                     'task builder or a tasks.registry.TaskSpec')
  capabilities = getattr(target, 'capabilities', None)
  if capabilities is None:
    raise ValueError(
        f'task {name!r} declares no capabilities: set '
        f'`{name.partition(":")[2]}.capabilities = (...)` to the names of '
        f'what its tasks provide (from {sorted(task_lib.CAPABILITIES)}), or '
        'export a tasks.registry.TaskSpec; the algorithm x task matrix is '
        'read from them without loading data')
  if not isinstance(capabilities, (list, tuple)) or not all(
      isinstance(c, str) for c in capabilities):
    raise ValueError(f'task {name!r}: its capabilities must be a sequence '
                     f'of names, got {capabilities!r}')
  summary = ((inspect.getdoc(target) or name).splitlines() or [name])[0]
  inspect.signature(target)  # One that has none fails here, named.
  return TaskSpec(name, imported.guarded(target, 'task', name),
                  tuple(capabilities), summary.rstrip('.'),
                  flags=tuple(getattr(target, 'flags', ())))


def task_factory(capabilities: Sequence[str], flags: Sequence[str] = ()
                 ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
  """Declares a task builder `(data_dir, **options) -> task` of your own.

  The builder gets its `capabilities` (and `flags`), so that
  `--task=package.module:factory` names it, as `outside_spec` reads. And a
  task it builds when called directly in Python records how it was built,
  as `build_task` records a task built by name: a run of it gives its
  `Run.spec` and `Run.open` rebuilds its task from the run's record. That
  holds while the builder is importable by `module:qualname` (defined at
  the top level of a module other than `__main__`) and its arguments are
  JSON scalars; otherwise the task is returned unrecorded, as a task made
  directly is.

  Args:
    capabilities: names of `core/task.CAPABILITIES` its tasks provide.
    flags: shared binary flags it always takes (`TaskSpec.flags`).

  Returns:
    A decorator that returns the builder with those attributes.

  Example (mypkg/mytask.py):

    @tp.task_factory(capabilities=('split_model', 'batches'))
    def make(data_dir, seed=0, users=100):
      \"\"\"My users' sentences, a small classifier.\"\"\"
      return tp.ClientDataTask(...)

    task = make(None, users=20)  # recorded as 'mypkg.mytask:make'
  """
  unknown = sorted(set(capabilities) - set(task_lib.CAPABILITIES))
  if unknown:
    raise ValueError(f'task_factory: unknown capabilities {unknown}; known: '
                     f'{sorted(task_lib.CAPABILITIES)}')

  def declare(builder: Callable[..., Any]) -> Callable[..., Any]:
    name = f'{builder.__module__}:{builder.__qualname__}'
    signature = inspect.signature(builder)
    if not signature.parameters:
      raise TypeError(f'task_factory: {name} takes no data_dir argument')
    first = next(iter(signature.parameters))

    @functools.wraps(builder)
    def build(*args, **kwargs):
      task = builder(*args, **kwargs)
      arguments = dict(signature.bind(*args, **kwargs).arguments)
      data_dir = arguments.pop(first, None)
      arguments['data_dir'] = (os.path.abspath(data_dir)
                               if isinstance(data_dir, str) else data_dir)
      if (task_lib.build_record(task) is None and
          builder.__module__ != '__main__' and
          '<locals>' not in builder.__qualname__ and
          all(v is None or isinstance(v, (bool, int, float, str))
              for v in arguments.values())):
        task_lib.set_build_record(task, name, arguments)
      return task

    build.capabilities = tuple(capabilities)
    build.flags = tuple(flags)
    return build

  return declare


# Every task's option: clients withheld from training (the `withheld`
# capability). A builder that takes it handles it (`ClientDataTask`);
# any other task is wrapped in `task.WithheldTask`.
WITHHELD_OPTION = 'withheld_clients'


def _option_specs(name: str) -> options_lib.Specs:
  specs = options_lib.option_specs(spec(name).builder, exclude=RUN_ARGUMENTS)
  # A count or a fraction, whatever the builder's default's type.
  specs[WITHHELD_OPTION] = (float, 0.0, False)
  return specs


def task_options(name: str) -> dict[str, tuple[type, Any]]:
  """The named task's options: name -> (type, default)."""
  return options_lib.listing(_option_specs(name))


def accepts(name: str, argument: str) -> bool:
  """Whether the named task's builder takes `argument`."""
  return argument in inspect.signature(spec(name).builder).parameters


def parse_task_options(name: str, items: Sequence[str]) -> dict[str, Any]:
  """`key=value` strings -> the task's checked options."""
  return options_lib.parse(_option_specs(name), items, name, 'task option',
                           reserved=RUN_ARGUMENTS)


def check_task_options(name: str, values: Mapping[str, Any]
                       ) -> dict[str, Any]:
  return options_lib.check(_option_specs(name), values, name, 'task option',
                           reserved=RUN_ARGUMENTS)


def build_task(name: str, **kwargs):
  """Builds the named task; a clear error for unknown names.

  `kwargs`: `data_dir`, `seed` and the builder's other arguments. Arguments
  the builder does not take are refused, naming them.
  """
  task_spec = spec(name)
  params = inspect.signature(task_spec.builder).parameters
  if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
    unknown = sorted(set(kwargs) - set(params) - {WITHHELD_OPTION})
    if unknown:
      raise ValueError(f'task {name!r} takes no {unknown}; its options: '
                       f'{options_lib.describe(_option_specs(name))}')
  data_dir = kwargs.pop('data_dir', None)
  if data_dir is not None:
    data_dir = os.path.abspath(data_dir)
  arguments = dict(kwargs)
  withheld = 0
  if WITHHELD_OPTION not in params:
    withheld = kwargs.pop(WITHHELD_OPTION, 0)
  task = task_spec.builder(data_dir, **kwargs)
  if withheld:
    task = task_lib.WithheldTask(task, withheld, seed=kwargs.get('seed', 0))
  if imported.is_import_path(name):  # Its own code: checked here, named.
    try:
      task_lib.check_task(task)
    except TypeError as e:
      raise ValueError(f'task {name!r}: its factory returned {e}') from e
  task_lib.set_build_record(task, name, dict(arguments, data_dir=data_dir))
  return task


# Names that moved away raise an error naming their new place.
__getattr__ = moved.module_getattr(__name__)
