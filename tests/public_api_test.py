"""The public surface, `import tff_personal as tp`, and the moved-name errors.

* Every name in `tp.__all__` is the object defined at its home module, and
  nothing else is public.
* `import tff_personal` loads neither TensorFlow nor TFF (workers and tools
  stay light); a name loads its module on first use.
* Every `tp.<name>` in README.md and docs/ is a public name, so the examples
  are held to the surface.
* Every moved name raises an error naming its new place, where it really
  is now; a moved module's old path raises naming the new module.
"""

import glob
import importlib
import os
import re
import subprocess
import sys

import pytest

import tff_personal as tp
from tff_personal.core import moved

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize('name', tp.__all__)
def test_public_name_is_its_home_object(name):
  module, attribute = tp.home(name)
  assert getattr(tp, name) is getattr(importlib.import_module(module),
                                      attribute)


def test_unknown_name_is_an_attribute_error():
  with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
    tp.no_such_name  # pylint: disable=pointless-statement
  assert not hasattr(tp, 'no_such_name')


def test_import_loads_no_tensorflow():
  code = ('import sys, tff_personal; '
          "heavy = [m for m in ('tensorflow', 'tensorflow_federated') "
          'if m in sys.modules]; '
          'assert not heavy, heavy; '
          "assert 'run_experiment' in dir(tff_personal)")
  subprocess.run([sys.executable, '-c', code], check=True, cwd=ROOT)


def _documented_public_names() -> dict[str, set[str]]:
  used = {}
  paths = [os.path.join(ROOT, 'README.md')] + sorted(
      glob.glob(os.path.join(ROOT, 'docs', '**', '*.md'), recursive=True))
  for path in paths:
    with open(path, encoding='utf-8') as f:
      text = f.read()
    for name in re.findall(r'\btp\.([A-Za-z]\w*)', text):
      used.setdefault(name, set()).add(os.path.relpath(path, ROOT))
  return used


def test_docs_use_only_public_names():
  used = _documented_public_names()
  assert {'Run', 'run_experiment', 'local_runtime'} <= set(used), used
  unknown = {name: sorted(paths) for name, paths in used.items()
             if name not in tp.__all__}
  assert not unknown, f'tp.<name> in docs that tp does not export: {unknown}'
  with open(os.path.join(ROOT, 'README.md'), encoding='utf-8') as f:
    assert 'import tff_personal as tp' in f.read()


def test_run_spec_sections_are_reachable_from_the_spec():
  from tff_personal.config import run_spec  # pylint: disable=g-import-not-at-top
  for section in run_spec.SECTIONS.values():
    assert getattr(tp.RunSpec, section.__name__) is section


_MOVED = sorted((module, name, new)
                for module, names in moved.MOVED_NAMES.items()
                for name, new in names.items())


@pytest.mark.parametrize('module,name,new', _MOVED)
def test_moved_name_raises_naming_its_new_place(module, name, new):
  old = importlib.import_module(module)
  with pytest.raises(AttributeError) as e:
    getattr(old, name)
  assert str(e.value).startswith(f'{module}.{name} moved to {new}.{name}')
  # The table is true: the name is really there now.
  assert hasattr(importlib.import_module(new), name)


def test_moved_name_that_is_public_says_so():
  from tff_personal.config import experiment  # pylint: disable=g-import-not-at-top
  with pytest.raises(AttributeError,
                     match=r'\(public: tff_personal\.run_experiment\)'):
    experiment.run_experiment  # pylint: disable=pointless-statement


@pytest.mark.parametrize('old,new', sorted(moved.MOVED_MODULES.items()))
def test_moved_module_raises_naming_its_new_path(old, new):
  with pytest.raises(moved.MovedModuleError, match=f'{old} moved to {new}$'):
    importlib.import_module(old)
  # The `from package import module` form keeps the message too.
  parent, _, leaf = old.rpartition('.')
  with pytest.raises(moved.MovedModuleError, match=f'{old} moved to {new}$'):
    exec(f'from {parent} import {leaf}', {})  # pylint: disable=exec-used
  assert importlib.util.find_spec(new) is not None
