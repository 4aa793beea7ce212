"""The one algorithm registry: names, builders, and what each needs of a task.

Every entry (`AlgorithmSpec`) has a builder of one signature:

  builder(model_factory, *, client_optimizer, server_optimizer,
          aggregator_factory, metrics_fn, train_metrics, seed,
          embedding_dim, private_optimizer, **options)
      -> StatefulClientProcess, or a `core/stages.Staged` of them

`model_factory` is the task's `model_fn_factory` (embedding_dim -> model_fn)
for `model='split'` entries, its `fedembed_model_fn_factory` (FedEmbedConfig
-> model_fn) for `model='fedembed'` ones, its `fedperc_model_fn_factory`
((variant, seed) -> FedPercModel builder) for `model='fedperc'` ones. The builder's other keyword
arguments with a scalar default (e.g. pFedMe's `lam`, Ditto's `lam`, FedRep's
`head_epochs`) are its *options*: `algorithm_options(name)` lists them,
`parse_algorithm_options` reads them from `key=value` strings (the binaries'
`--algorithm_options`) and `check_algorithm_options` refuses unknown names and
wrong types, naming them. `needs` are the task capabilities
(`core/task.CAPABILITIES`) the algorithm uses; `check_compatible` refuses a
task that lacks one, naming it.

Example:

  from tff_personal.algorithms import registry
  proc = registry.build_for_task('ditto', task, client_optimizer=...,
                                 server_optimizer=..., lam=0.5)
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Mapping, Sequence

from tff_personal.algorithms import apfl
from tff_personal.algorithms import ditto
from tff_personal.algorithms import fedavg
from tff_personal.algorithms import fedavg_ft
from tff_personal.algorithms import fedbabu
from tff_personal.algorithms import feddva
from tff_personal.algorithms import fedembed
from tff_personal.algorithms import fedembed_som
from tff_personal.algorithms import fedper
from tff_personal.algorithms import fedperc
from tff_personal.algorithms import fedrep
from tff_personal.algorithms import furl
from tff_personal.algorithms import group_fl
from tff_personal.algorithms import hypcluster
from tff_personal.algorithms import knn_per
from tff_personal.algorithms import lg_fedavg
from tff_personal.algorithms import per_fedavg
from tff_personal.algorithms import pfedkm
from tff_personal.algorithms import pfedme
from tff_personal.core import imported
from tff_personal.core import options as options_lib
from tff_personal.core import task as task_lib

MODEL_KINDS = ('split', 'fedembed', 'fedperc')
# Model kind -> the task capability that provides its factory.
_KIND_NEEDS = {'split': 'split_model', 'fedembed': 'fedembed_model',
               'fedperc': 'fedperc_model'}


@dataclasses.dataclass(frozen=True)
class AlgorithmSpec:
  """A registered algorithm.

  Attributes:
    name: the `--algorithm` value.
    builder: the uniform builder (module docstring).
    model: 'split' (the task's `model_fn_factory`), 'fedembed' (its
      `fedembed_model_fn_factory`) or 'fedperc' (its
      `fedperc_model_fn_factory`).
    needs: task capabilities the algorithm uses (`core/task.CAPABILITIES`).
    family: the paper or family it belongs to.
    summary: one line: what it is.
    stage_rounds: for a multi-stage algorithm (its builder returns a
      `core/stages.Staged`), the options that give its earlier stages'
      rounds (the last stage runs the experiment's rounds).
    batched: its process (every stage's, when staged) has a batched form,
      a shard's users trained together (`--simulation_batched`,
      `core/batched.py`), on models that form covers (chains of the layers
      `batched.BatchedModel` lists; FedEmbed's and FedPerC's own models).
      `tests/conformance_test.py` holds the declaration to what
      `sharded.ShardedProcess(batched=True)` accepts, and the batched form
      to the per-user one.
    evaluation: the protocol the algorithm's evaluation declares, as a
      strategy text (`strategies.parse`; Per-FedAvg's one adaptation step
      `fine_tune(steps=1)`, FedAvg+FT's and FedBABU's one pass
      `fine_tune`); empty: each client's stored state as trained. Its
      process runs it by default (`--list` shows it; a strategy overrides
      it); `tests/registry_test.py` holds the two to each other.
    distributed_dp: empty when the algorithm runs the distributed DP
      mechanisms (`privacy.DISTRIBUTED_MECHANISMS`: noise added on the
      devices, sums by secure aggregation) wherever it runs
      'gaussian_fixed'; else why it does not. `tests/distributed_dp_test.py`
      holds one entry of each family, and each whose update has a structure
      of its own, to it (it runs, its production form carrying secure sums;
      or it fails).
    inprocess: empty when the in-process round (`core/inprocess.py`: the
      round's compiled MapReduceForm run as TensorFlow functions in the
      driver, `--simulation_round`) runs the algorithm, every stage of
      it; else why it does not. `tests/inprocess_test.py` holds the
      covered entries to `process.next`, round for round (one of each
      family by default, every one with TFF_PERSONAL_INPROCESS_ALL=1).
  """
  name: str
  builder: Callable[..., Any]
  model: str
  needs: tuple[str, ...]
  family: str
  summary: str
  stage_rounds: tuple[str, ...] = ()
  batched: bool = False
  evaluation: str = ''
  distributed_dp: str = ''
  inprocess: str = ''

  @property
  def staged(self) -> bool:
    return bool(self.stage_rounds)

  def __post_init__(self):
    if self.model not in MODEL_KINDS:
      raise ValueError(f'{self.name}: model must be one of {MODEL_KINDS}')
    needs = set(self.needs) | {_KIND_NEEDS[self.model]}
    unknown = needs - set(task_lib.CAPABILITIES)
    if unknown:
      raise ValueError(f'{self.name}: unknown needs {sorted(unknown)}')
    object.__setattr__(self, 'needs', tuple(sorted(needs)))

  @property
  def module(self) -> str:
    """The module that holds the algorithm's code."""
    return self.builder.__module__


_SPECS = (
    AlgorithmSpec('global', fedavg.build_global, 'split', (), 'fedavg',
                  'FedAvg: one shared model, nothing private',
                  batched=True),
    AlgorithmSpec('global_plus', fedavg.build_global_plus, 'split',
                  ('personal_embedding',), 'fedembed',
                  'FedAvg plus a private personal embedding per user'),
    AlgorithmSpec('furl', furl.build_furl, 'split', ('personal_embedding',),
                  'furl', 'federated vs private parameters (FURL)'),
    AlgorithmSpec('fedembed_prototype', fedembed.build_fedembed_prototype,
                  'fedembed', (), 'fedembed',
                  'sub-population heads chosen by nearest prototype',
                  batched=True),
    AlgorithmSpec('fedembed_type', fedembed.build_fedembed_type, 'fedembed',
                  (), 'fedembed',
                  'sub-population heads chosen by the identified type',
                  batched=True),
    AlgorithmSpec('fedembed_personal', fedembed.build_fedembed_personal,
                  'fedembed', (), 'fedembed',
                  'a private head per user on FedEmbed\'s model'),
    AlgorithmSpec('fedembed_som', fedembed_som.build_fedembed_som,
                  'fedembed', (), 'fedembed',
                  'sub-population heads chosen by a federated SOM',
                  distributed_dp=(
                      'its SOM update recognises DP by TFF\'s '
                      'DifferentiallyPrivateFactory only '
                      '(fedembed_som.SomConfig.resolve), so under the '
                      'distributed aggregator it would choose the paper\'s '
                      'best-client update, which hands one client\'s update '
                      'to the server verbatim')),
    AlgorithmSpec('fedrep', fedrep.build_fedrep, 'split', ('named_head',), 'baselines',
                  'FedRep: shared body, private head trained first'),
    AlgorithmSpec('pfedme', pfedme.build_pfedme, 'split', ('named_head',), 'baselines',
                  'pFedMe: Moreau-envelope personal heads'),
    AlgorithmSpec('pfedme_restart', pfedme.build_pfedme_restart, 'split', ('named_head',),
                  'baselines',
                  'pFedMe whose personal head restarts every round'),
    AlgorithmSpec('pfedkm', pfedkm.build_pfedkm, 'fedembed', (), 'baselines',
                  'PFedKM: heads chosen by federated k-means'),
    AlgorithmSpec('ditto', ditto.build_ditto_algorithm, 'split', (),
                  'baselines',
                  'Ditto: personal models regularized toward the global',
                  batched=True),
    AlgorithmSpec('fedavg_ft', fedavg_ft.build_fedavg_ft_algorithm, 'split',
                  (), 'baselines',
                  'FedAvg, then local fine-tuning at evaluation',
                  batched=True, evaluation='fine_tune'),
    AlgorithmSpec('fedper', fedper.build_fedper, 'split', ('named_head',),
                  'baselines',
                  'FedPer: shared body and private head, trained jointly',
                  batched=True),
    AlgorithmSpec('lg_fedavg', lg_fedavg.build_lg_fedavg, 'split',
                  ('named_head',), 'baselines',
                  'LG-FedAvg: private body (local representation), shared '
                  'head',
                  batched=True),
    AlgorithmSpec('fedbabu', fedbabu.build_fedbabu, 'split', ('named_head',),
                  'baselines',
                  'FedBABU: body trained under a fixed random head, all '
                  'fine-tuned at evaluation', evaluation='fine_tune'),
    AlgorithmSpec('per_fedavg', per_fedavg.build_per_fedavg, 'split', (),
                  'baselines',
                  'Per-FedAvg: FedAvg of a first-order (or Hessian-free) '
                  'MAML learner, adapted at evaluation',
                  evaluation='fine_tune(steps=1)'),
    AlgorithmSpec('apfl', apfl.build_apfl, 'split', (), 'baselines',
                  'APFL: a learned per-client mixture of a personal and the '
                  'global model'),
    AlgorithmSpec('hypcluster', hypcluster.build_hypcluster, 'split', (),
                  'baselines',
                  'HypCluster: k shared models, each client trains the one '
                  'that fits it best (a private choice)'),
    AlgorithmSpec('knn_per', knn_per.build_knn_per, 'split', ('named_head',),
                  'baselines',
                  'kNN-Per: FedAvg, its features plus a local kNN memory at '
                  'evaluation',
                  batched=True),
    AlgorithmSpec('feddva', feddva.build_feddva_algorithm, 'split',
                  ('digit_images',), 'feddva',
                  'dual VAE (shared encoders, private decoders), then a '
                  'classifier on its encoders',
                  stage_rounds=('pretrain_rounds',)),
    AlgorithmSpec('groupfl', group_fl.build_groupfl_algorithm, 'split',
                  ('groups',), 'group',
                  'Group personalized FL: FedAvg, then one FedAvg run per '
                  'group from its model, each client on its group\'s model',
                  stage_rounds=('fl_rounds',),
                  batched=True),
    AlgorithmSpec('groupperfl', group_fl.build_groupperfl_algorithm,
                  'split', ('groups',), 'group',
                  'GroupFL, then each client fine-tunes its group\'s model '
                  'locally at evaluation',
                  stage_rounds=('fl_rounds',),
                  batched=True),
    AlgorithmSpec('fedperc', fedperc.build_fedperc, 'fedperc', (), 'fedperc',
                  'FedPerC: private personal embedding x shared context '
                  'embeddings as a prefix of a frozen LM, fine-tuned at test '
                  'time',
                  batched=True),
    AlgorithmSpec('fedperc_frozen', fedperc.build_fedperc_frozen, 'fedperc',
                  (), 'fedperc',
                  'FedPerC without test-time fine-tuning',
                  batched=True),
    AlgorithmSpec('fedperc_generated', fedperc.build_fedperc_generated,
                  'fedperc', (), 'fedperc',
                  'FedPerC (Generated): shared generators predict the '
                  'embeddings from a user\'s utterances'),
    AlgorithmSpec('split_learning', fedperc.build_split_learning, 'fedperc',
                  (), 'fedperc',
                  'FedPerC\'s Split-Learning baseline: personal and context '
                  'output heads'),
    AlgorithmSpec('meta_learning', fedperc.build_meta_learning, 'fedperc', (),
                  'fedperc',
                  'FedPerC\'s Meta-Learning baseline: a shared output layer, '
                  'fine-tuned at test time'),
)

SPECS: dict[str, AlgorithmSpec] = {s.name: s for s in _SPECS}
# name -> builder (the registry's builders by name).
ALGORITHMS: dict[str, Callable[..., Any]] = {
    s.name: s.builder for s in _SPECS}

# Keyword arguments every builder takes from the experiment's own settings
# (flags of their own); not options.
EXPERIMENT_ARGUMENTS = ('client_optimizer', 'server_optimizer',
                        'aggregator_factory', 'metrics_fn', 'train_metrics',
                        'seed', 'embedding_dim', 'private_optimizer')


def spec(name: str) -> AlgorithmSpec:
  """The named algorithm's spec; a clear error for unknown names.

  `name` is a registered name, or `package.module:attribute` naming an
  `AlgorithmSpec` defined outside the repository (its builder of the
  uniform signature, its model kind and needs), listed and checked like
  the registered ones.
  """
  imported.check_name(name, 'algorithm')
  if imported.is_import_path(name):
    target = imported.load(name, 'algorithm')
    if not isinstance(target, AlgorithmSpec):
      raise ValueError(
          f'algorithm {name!r} is a {type(target).__name__}, not an '
          'AlgorithmSpec (tff_personal/algorithms/registry.py): declare '
          'its builder, model kind and needs with one')
    with imported.reported('algorithm', name, 'reading its builder'):
      inspect.signature(target.builder)
    # Whatever its builder raises is a ValueError naming it.
    return dataclasses.replace(target, name=name, builder=imported.guarded(
        target.builder, 'algorithm', name))
  if name not in SPECS:
    raise ValueError(f'unknown algorithm {name!r}; known: {sorted(SPECS)}, '
                     'or package.module:attribute for your own')
  return SPECS[name]


def _option_specs(name: str) -> options_lib.Specs:
  return options_lib.option_specs(spec(name).builder,
                                  exclude=EXPERIMENT_ARGUMENTS)


def algorithm_options(name: str) -> dict[str, tuple[type, Any]]:
  """The named algorithm's options: name -> (type, default)."""
  return options_lib.listing(_option_specs(name))


def check_algorithm_options(name: str, options: Mapping[str, Any]
                            ) -> dict[str, Any]:
  """`options` checked against the algorithm's (`options.check`)."""
  return options_lib.check(_option_specs(name), options, name,
                           reserved=EXPERIMENT_ARGUMENTS)


def parse_algorithm_options(name: str, items: Sequence[str]) -> dict[str, Any]:
  """`key=value` strings -> checked options (`options.parse`)."""
  return options_lib.parse(_option_specs(name), items, name,
                           reserved=EXPERIMENT_ARGUMENTS)


def earlier_rounds(name: str, options: Mapping[str, Any] = ()) -> int:
  """Rounds of the named algorithm's earlier stages under `options` (0 for
  a single-stage algorithm): they count in the privacy accounting."""
  defaults = algorithm_options(name)
  options = dict(options)
  return sum(int(options.get(o, defaults[o][1]))
             for o in spec(name).stage_rounds)


def build(name: str, model_fn_factory, **kwargs):
  """Builds the named algorithm's process from a model factory."""
  return spec(name).builder(model_fn_factory, **kwargs)


def missing_for(name: str, capabilities: Sequence[str],
                options: Mapping[str, Any] = ()) -> list[str]:
  """What the named algorithm needs beyond `capabilities`, each with what it
  is (empty: compatible). A `head_layer` (or LG-FedAvg's `shared_layers`)
  in `options` names the layer itself, so the task need not have one named
  'head'."""
  named = {'head_layer', 'shared_layers'} & set(dict(options))
  have = set(capabilities) | ({'named_head'} if named else set())
  return [f'{n} ({task_lib.CAPABILITIES[n][1]})' for n in spec(name).needs
          if n not in have]


def check_compatible(name: str, task, options: Mapping[str, Any] = ()
                     ) -> None:
  """Raises ValueError naming what `task` lacks for the named algorithm
  (with its `options`)."""
  missing = missing_for(name, task_lib.capabilities(task), options)
  if missing:
    # A generic task says how each capability is given (`capability_hints`).
    hints = getattr(task, 'capability_hints', None) or {}
    given = [hints[m.split(' (')[0]] for m in missing
             if m.split(' (')[0] in hints]
    raise ValueError(
        f'{name} cannot run on task {task_lib.task_name(task)!r}: it needs '
        + '; '.join(missing) + (
            '. The task gives it with: ' + '; '.join(given) if given else ''))


def model_factory(name: str, task, options: Mapping[str, Any] = ()):
  """The task's model factory that the named algorithm builds on."""
  check_compatible(name, task, options)
  if spec(name).model == 'fedembed':
    return task.fedembed_model_fn_factory
  if spec(name).model == 'fedperc':
    return task.fedperc_model_fn_factory
  return task.model_fn_factory


def build_for_task(name: str, task, **kwargs):
  """Builds the named algorithm on `task`'s model (refused, naming what is
  missing, when the task lacks a capability the algorithm needs); `kwargs`
  as the uniform builder takes them, options included."""
  return build(name, model_factory(name, task, kwargs), **kwargs)
