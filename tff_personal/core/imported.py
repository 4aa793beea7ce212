"""Tasks and algorithms defined outside the repository, named by import path.

`binaries.train --task=mypkg.mytask:make` and `--algorithm=mypkg.algo:SPEC`
name an object as `package.module:attribute`; the task and algorithm
registries (`tasks/registry.py`, `algorithms/registry.py`) resolve such a
name with `load` and then list and check it like their own entries.
Whatever such a plugin raises, at import or when called (any exception, a
SyntaxError of its module, `sys.exit`), reaches the caller as one
ValueError naming it (`load`, `reported`, `guarded`), so a binary ends with
one line and exit code 2.

Example:

  from tff_personal.core import imported
  make = imported.load('mypkg.mytask:make', 'task')
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import re
from typing import Any, Callable, Iterator

# `package.module` and `attribute`: Python identifiers, the module's dotted
# (no relative `.module`, no path).
_MODULE = re.compile(r'[A-Za-z_]\w*(\.[A-Za-z_]\w*)*')
_ATTRIBUTE = re.compile(r'[A-Za-z_]\w*')


def is_import_path(name: Any) -> bool:
  """Whether `name` is `package.module:attribute` rather than a registry
  name."""
  return isinstance(name, str) and ':' in name


def check_name(name: Any, what: str) -> str:
  """`name` if it is a string that can name a registry entry or an outside
  `package.module:attribute`; else a ValueError naming it."""
  if not isinstance(name, str):
    raise ValueError(f'a {what} is named by a string, got {name!r} '
                     f'({type(name).__name__})')
  return name


def _one_line(e: BaseException) -> str:
  text = ' '.join(str(e).split())
  if len(text) > 300:
    text = text[:300] + '...'
  return f'{type(e).__name__}: {text}' if text else type(e).__name__


@contextlib.contextmanager
def reported(what: str, name: str, doing: str) -> Iterator[None]:
  """Within the block, whatever an outside plugin raises is a ValueError
  naming it: any exception (a SyntaxError of its module included) and
  `SystemExit` (a plugin that calls `sys.exit`). A ValueError already
  naming it passes unchanged; another gets the name in front.

  Args:
    what: 'task' or 'algorithm'.
    name: the plugin's `package.module:attribute`.
    doing: what failed, for the message ('import', 'call', ...).
  """
  prefix = f'{what} {name!r}'
  try:
    yield
  except ValueError as e:
    if str(e).startswith(prefix):
      raise
    raise ValueError(f'{prefix}: {doing} failed: {_one_line(e)}') from e
  except (Exception, SystemExit) as e:  # pylint: disable=broad-except
    raise ValueError(f'{prefix}: {doing} failed: {_one_line(e)}') from e


def guarded(fn: Callable[..., Any], what: str, name: str) -> Callable[..., Any]:
  """`fn` (an outside plugin's builder) whose failures are ValueErrors
  naming the plugin (`reported`); its signature is `fn`'s."""
  @functools.wraps(fn)
  def call(*args, **kwargs):
    with reported(what, name, 'its call'):
      return fn(*args, **kwargs)
  return call


def load(name: str, what: str) -> Any:
  """The object `package.module:attribute` names.

  Args:
    name: `package.module:attribute` (the module importable from
      `sys.path`, e.g. with `PYTHONPATH` set).
    what: what it should be ('task', 'algorithm'), for the error messages.

  Returns:
    The attribute.

  Raises:
    ValueError: the name is malformed, the module cannot be imported (any
      failure at import: an exception, a SyntaxError, `sys.exit`), or it
      has no such attribute; the message names which.
  """
  check_name(name, what)
  module_name, _, attribute = name.partition(':')
  if not (_MODULE.fullmatch(module_name) and _ATTRIBUTE.fullmatch(attribute)):
    raise ValueError(f'{what} {name!r}: an outside {what} is named '
                     'package.module:attribute (Python identifiers; no '
                     'relative module, no path)')
  try:
    module = importlib.import_module(module_name)
  except ImportError as e:
    raise ValueError(f'{what} {name!r}: cannot import {module_name!r} ({e}); '
                     'is its directory on PYTHONPATH?') from e
  except (Exception, SystemExit) as e:  # pylint: disable=broad-except
    raise ValueError(f'{what} {name!r}: importing {module_name!r} failed: '
                     f'{_one_line(e)}') from e
  try:
    return getattr(module, attribute)
  except AttributeError as e:
    raise ValueError(f'{what} {name!r}: module {module_name!r} '
                     f'({getattr(module, "__file__", "?")}) has no '
                     f'{attribute!r}') from e
  except (Exception, SystemExit) as e:  # pylint: disable=broad-except
    raise ValueError(f'{what} {name!r}: reading {attribute!r} failed: '
                     f'{_one_line(e)}') from e
