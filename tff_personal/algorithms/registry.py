"""Algorithm names (the `--algorithm` flag values) and their builders.

Every builder takes a model factory from the task and keyword arguments
`client_optimizer`, `server_optimizer`, `aggregator_factory`, `metrics_fn`,
`train_metrics`, `seed`, `embedding_dim`, and returns a
`StatefulClientProcess`. Which factory: `model_factory(name, task)`: the
task's `model_fn_factory` (embedding_dim -> model_fn) for split models, its
`fedembed_model_fn_factory` (FedEmbedConfig -> model_fn) for FedEmbed.

A builder's other keyword arguments with a scalar default (e.g. pFedMe's
`lam`, `inner_steps`; FedRep's `head_epochs`) are its *options*:
`algorithm_options(name)` lists them, `parse_algorithm_options` reads them
from `key=value` strings (the binaries' `--algorithm_options`) and
`check_algorithm_options` refuses unknown names and wrong types, naming them.
"""

from __future__ import annotations

import ast
import inspect
import typing
from typing import Any, Mapping, Sequence

from tff_personal.algorithms import fedavg
from tff_personal.algorithms import fedembed
from tff_personal.algorithms import fedembed_som
from tff_personal.algorithms import fedrep
from tff_personal.algorithms import furl
from tff_personal.algorithms import pfedkm
from tff_personal.algorithms import pfedme

ALGORITHMS = {
    'global': fedavg.build_global,
    'global_plus': fedavg.build_global_plus,
    'furl': furl.build_furl,
    'fedembed_prototype': fedembed.build_fedembed_prototype,
    'fedembed_type': fedembed.build_fedembed_type,
    'fedembed_personal': fedembed.build_fedembed_personal,
    'fedembed_som': fedembed_som.build_fedembed_som,
    'fedrep': fedrep.build_fedrep,
    'pfedme': pfedme.build_pfedme,
    'pfedme_restart': pfedme.build_pfedme_restart,
    'pfedkm': pfedkm.build_pfedkm,
}

# Algorithms built on a task's FedEmbed model (K sub-population heads).
_FEDEMBED_MODEL = ('pfedkm',)


# Keyword arguments every builder takes from the experiment's own settings
# (flags of their own); not options.
EXPERIMENT_ARGUMENTS = ('client_optimizer', 'server_optimizer',
                        'aggregator_factory', 'metrics_fn', 'train_metrics',
                        'seed', 'embedding_dim', 'private_optimizer')
_OPTION_TYPES = (bool, int, float, str)


def _check_name(name: str) -> None:
  if name not in ALGORITHMS:
    raise ValueError(f'unknown algorithm {name!r}; known: {sorted(ALGORITHMS)}')


def _annotation(builder, parameter: inspect.Parameter):
  hint = parameter.annotation
  if isinstance(hint, str):  # postponed annotations: the builder's module's
    try:
      return eval(hint, getattr(builder, '__globals__', {}))  # pylint: disable=eval-used
    except Exception:  # pylint: disable=broad-except
      return None
  return hint


def _option_specs(name: str) -> dict[str, tuple[type, Any, bool]]:
  """The named algorithm's options: name -> (type, default, accepts None).

  The type is the default's, or X of an `Optional[X]` annotation when the
  default is None; keyword arguments of other types are not options.
  """
  _check_name(name)
  builder = ALGORITHMS[name]
  out = {}
  for p in inspect.signature(builder).parameters.values():
    if (p.default is inspect.Parameter.empty or p.name in EXPERIMENT_ARGUMENTS
        or p.kind not in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)):
      continue
    args = typing.get_args(_annotation(builder, p))
    if p.default is not None:
      kind = type(p.default)
    else:
      kinds = [a for a in args if a is not type(None)]
      kind = kinds[0] if len(kinds) == 1 else None
    if kind in _OPTION_TYPES:
      out[p.name] = (kind, p.default,
                     p.default is None or type(None) in args)
  return out


def algorithm_options(name: str) -> dict[str, tuple[type, Any]]:
  """The named algorithm's options: name -> (type, default)."""
  return {k: (kind, default)
          for k, (kind, default, _) in _option_specs(name).items()}


def _describe(options: Mapping[str, tuple[type, Any]]) -> str:
  return ', '.join(f'{k} ({t.__name__}, default {d!r})'
                   for k, (t, d) in sorted(options.items())) or 'none'


def check_algorithm_options(name: str, options: Mapping[str, Any]
                            ) -> dict[str, Any]:
  """`options` checked against the algorithm's; ints accepted as floats.

  Raises:
    ValueError: naming an unknown option (and listing the known ones) or a
      value of the wrong type.
  """
  specs = _option_specs(name)
  out = {}
  for key, value in options.items():
    if key in EXPERIMENT_ARGUMENTS:
      raise ValueError(f'algorithm option {key!r} is set by the experiment '
                       'itself (its own flag), not through algorithm options')
    if key not in specs:
      raise ValueError(f'{name} has no option {key!r}; its options: '
                       f'{_describe(algorithm_options(name))}')
    kind, _, accepts_none = specs[key]
    if value is None and accepts_none:  # Optional[X]
      out[key] = None
      continue
    if kind is float and type(value) is int:
      value = float(value)
    if type(value) is not kind:
      raise ValueError(f'{name} option {key}={value!r} must be of type '
                       f'{kind.__name__}, got {type(value).__name__}')
    out[key] = value
  return out


def parse_algorithm_options(name: str, items: Sequence[str]) -> dict[str, Any]:
  """`key=value` strings (values as Python literals; a bare word is a
  string) -> checked options. Raises ValueError naming a malformed item."""
  specs = _option_specs(name)
  options = {}
  for item in items:
    key, sep, text = item.partition('=')
    key, text = key.strip(), text.strip()
    if not sep or not key or not text:
      raise ValueError(f'algorithm option {item!r} is not key=value')
    if key in options:
      raise ValueError(f'algorithm option {key!r} given twice')
    try:
      value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
      value = text
    kind = specs.get(key, (None,))[0]
    if kind is str and value is not None and not isinstance(value, str):
      value = text  # e.g. head_layer=1 is the layer named '1'
    options[key] = value
  return check_algorithm_options(name, options)


def build(name: str, model_fn_factory, **kwargs):
  """Builds the named algorithm's process; a clear error for unknown names."""
  _check_name(name)
  return ALGORITHMS[name](model_fn_factory, **kwargs)


def model_factory(name: str, task):
  """The task's model factory that the named algorithm builds on."""
  if name.startswith('fedembed_') or name in _FEDEMBED_MODEL:
    if not hasattr(task, 'fedembed_model_fn_factory'):
      raise ValueError(f'task {getattr(task, "name", task)!r} has no FedEmbed '
                       f'model; {name} needs one')
    return task.fedembed_model_fn_factory
  return task.model_fn_factory
