"""Tasks and algorithms defined outside the repository, named by import path.

`binaries.train --task=mypkg.mytask:make` and `--algorithm=mypkg.algo:SPEC`
name an object as `package.module:attribute`; the task and algorithm
registries (`tasks/registry.py`, `algorithms/registry.py`) resolve such a
name with `load` and then list and check it like their own entries.

Example:

  from tff_personal.core import imported
  make = imported.load('mypkg.mytask:make', 'task')
"""

from __future__ import annotations

import importlib
from typing import Any


def is_import_path(name: str) -> bool:
  """Whether `name` is `package.module:attribute` rather than a registry
  name."""
  return ':' in name


def load(name: str, what: str) -> Any:
  """The object `package.module:attribute` names.

  Args:
    name: `package.module:attribute` (the module importable from
      `sys.path`, e.g. with `PYTHONPATH` set).
    what: what it should be ('task', 'algorithm'), for the error messages.

  Returns:
    The attribute.

  Raises:
    ValueError: the name is malformed, the module cannot be imported, or it
      has no such attribute; the message names which.
  """
  module_name, _, attribute = name.partition(':')
  if not module_name or not attribute or ':' in attribute:
    raise ValueError(f'{what} {name!r}: an outside {what} is named '
                     'package.module:attribute')
  try:
    module = importlib.import_module(module_name)
  except ImportError as e:
    raise ValueError(f'{what} {name!r}: cannot import {module_name!r} ({e}); '
                     'is its directory on PYTHONPATH?') from e
  try:
    return getattr(module, attribute)
  except AttributeError as e:
    raise ValueError(f'{what} {name!r}: module {module_name!r} '
                     f'({getattr(module, "__file__", "?")}) has no '
                     f'{attribute!r}') from e
