"""Typed `key=value` options read from a builder's signature.

An algorithm's builder (`--algorithm_options`) and a task's builder
(`--task_options`) declare their own settings as keyword arguments with
scalar defaults; this module lists them, parses `key=value` strings and
checks names and types, so that a bad option is refused before any work with
an error that names it and lists the valid ones. Written by hand: absl flags
are global and cannot be declared per builder.

Example:

  def build(data_dir, *, num_clients: int = 20, alpha: float = 0.5): ...
  specs = options.option_specs(build, exclude=('data_dir',))
  options.parse(specs, ['alpha=0.1'], 'label_skew_mnist', 'task option')
  # -> {'alpha': 0.1}
"""

from __future__ import annotations

import ast
import inspect
import typing
from typing import Any, Callable, Mapping, Sequence

OPTION_TYPES = (bool, int, float, str)

# The largest integer a run accepts in a flag, config field or option: the
# loop's counters are 32-bit where they reach TensorFlow (the round number in
# a checkpoint, step counters, seeds of stateless ops).
INT_LIMIT = 2**31 - 1


def check_int_range(name: str, value: Any) -> None:
  """Raises ValueError naming `name` if the int `value` is outside
  [-INT_LIMIT - 1, INT_LIMIT]; anything but an int passes."""
  if (isinstance(value, int) and not isinstance(value, bool)
      and not -INT_LIMIT - 1 <= value <= INT_LIMIT):
    raise ValueError(f'{name}={value} is out of range: integers must be in '
                     f'[{-INT_LIMIT - 1}, {INT_LIMIT}] (32-bit, what a '
                     'run\'s counters hold)')

# name -> (type, default, accepts None)
Specs = dict[str, tuple[type, Any, bool]]


def _annotation(fn, parameter: inspect.Parameter):
  hint = parameter.annotation
  if isinstance(hint, str):  # postponed annotations: the builder's module's
    try:
      return eval(hint, getattr(fn, '__globals__', {}))  # pylint: disable=eval-used
    except Exception:  # pylint: disable=broad-except
      return None
  return hint


def option_specs(fn: Callable[..., Any], exclude: Sequence[str] = ()
                 ) -> Specs:
  """`fn`'s options: keyword arguments with a scalar default.

  The type is the default's, or X of an `Optional[X]` annotation when the
  default is None; keyword arguments of other types, those without a
  default and those in `exclude` are not options.
  """
  out = {}
  for p in inspect.signature(fn).parameters.values():
    if (p.default is inspect.Parameter.empty or p.name in exclude
        or p.kind not in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)):
      continue
    args = typing.get_args(_annotation(fn, p))
    if p.default is not None:
      kind = type(p.default)
    else:
      kinds = [a for a in args if a is not type(None)]
      kind = kinds[0] if len(kinds) == 1 else None
    if kind in OPTION_TYPES:
      out[p.name] = (kind, p.default, p.default is None or type(None) in args)
  return out


def listing(specs: Specs) -> dict[str, tuple[type, Any]]:
  """name -> (type, default)."""
  return {k: (kind, default) for k, (kind, default, _) in specs.items()}


def describe(specs: Specs) -> str:
  """'name (type, default d), ...' or 'none'."""
  return ', '.join(f'{k} ({t.__name__}, default {d!r})'
                   for k, (t, d, _) in sorted(specs.items())) or 'none'


def check(specs: Specs, values: Mapping[str, Any], owner: str,
          what: str = 'option', reserved: Sequence[str] = ()
          ) -> dict[str, Any]:
  """`values` checked against `specs`; ints accepted as floats.

  Args:
    specs: from `option_specs`.
    values: name -> value.
    owner: the builder's name, for messages (e.g. 'pfedme').
    what: what the options are called (e.g. 'algorithm option').
    reserved: names set elsewhere (their own flags), refused here.

  Raises:
    ValueError: naming an unknown option (listing the known ones), a
      reserved one, or a value of the wrong type.
  """
  out = {}
  for key, value in values.items():
    if key in reserved:
      raise ValueError(f'{what} {key!r} is set by the experiment itself '
                       '(its own flag), not through options')
    if key not in specs:
      raise ValueError(f'{owner} has no {what} {key!r}; its options: '
                       f'{describe(specs)}')
    kind, _, accepts_none = specs[key]
    if value is None and accepts_none:  # Optional[X]
      out[key] = None
      continue
    if kind is float and type(value) is int:
      value = float(value)
    if type(value) is not kind:
      raise ValueError(f'{owner} {what} {key}={value!r} must be of type '
                       f'{kind.__name__}, got {type(value).__name__}')
    check_int_range(f'{owner} {what} {key}', value)
    out[key] = value
  return out


def parse(specs: Specs, items: Sequence[str], owner: str,
          what: str = 'option', reserved: Sequence[str] = ()
          ) -> dict[str, Any]:
  """`key=value` strings (values as Python literals; a bare word is a
  string) -> checked options (`check`). Raises ValueError naming a
  malformed item."""
  values = {}
  for item in items:
    key, sep, text = item.partition('=')
    key, text = key.strip(), text.strip()
    if not sep or not key or not text:
      raise ValueError(f'{what} {item!r} is not key=value')
    if key in values:
      raise ValueError(f'{what} {key!r} given twice')
    try:
      value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
      value = text
    kind = specs.get(key, (None,))[0]
    if kind is str and value is not None and not isinstance(value, str):
      value = text  # e.g. head_layer=1 is the layer named '1'
    values[key] = value
  return check(specs, values, owner, what, reserved)
