"""The Bazel BUILD graph matches the Python imports (checked without Bazel).

Every BUILD file is executed as Python with stub rules (tools/build_graph.py)
and every repo `.py` file's imports (module- and function-level) are parsed
with `ast`. Fails when a module has no target (or several), a src is missing,
an in-repo import has no matching dep, a declared in-repo dep is not imported,
or a label names no target. `__init__.py` files need no target (rules_python
creates them); `conftest.py` is a testonly py_library that every test in its
directory depends on. Third-party deps (`requirement(...)`) are not checked.
"""

import os
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)

from tools import build_graph  # pylint: disable=g-import-not-at-top

_HEADER = textwrap.dedent("""\
    load("@pypi//:requirements.bzl", "requirement")
    load("@rules_python//python:defs.bzl", "py_binary", "py_library", "py_test")
    package(default_visibility = ["//visibility:public"])
    licenses(["notice"])
    """)


def _check(builds, sources, other=()):
  builds = {path: _HEADER + textwrap.dedent(text)
            for path, text in builds.items()}
  sources = {path: textwrap.dedent(text) for path, text in sources.items()}
  return build_graph.check_graph(builds, sources, other)


def _fake_sources(**overrides):
  sources = {
      'a/__init__.py': '',
      'a/x.py': 'from a import y\n',
      'a/y.py': 'import numpy as np\n',
      'b/z.py': ('def f():\n'
                 '  from a.y import thing  # function-level\n'
                 '  return thing\n'),
      'b/main.py': ("from b import z\n"
                    "if __name__ == '__main__':\n  z.f()\n"),
  }
  sources.update(overrides)
  return sources


_GOOD_BUILDS = {
    'a/BUILD': """
        py_library(name = "x", srcs = ["x.py"], deps = [":y"])
        py_library(name = "y", srcs = ["y.py"], deps = [requirement("numpy")])
        """,
    'b/BUILD': """
        py_library(name = "z", srcs = ["z.py"], deps = ["//a:y"])
        py_binary(name = "main", srcs = ["main.py"], deps = ["//b:z"])
        """,
}


def test_checker_accepts_a_consistent_fake_graph():
  assert _check(_GOOD_BUILDS, _fake_sources()) == []


def test_checker_reports_missing_dep():
  builds = dict(_GOOD_BUILDS)
  builds['a/BUILD'] = """
      py_library(name = "x", srcs = ["x.py"])
      py_library(name = "y", srcs = ["y.py"])
      """
  errors = _check(builds, _fake_sources())
  assert len(errors) == 1, errors
  assert 'a/x.py' in errors[0]
  assert 'from a import y' in errors[0]
  assert '//a:y' in errors[0] and 'add ":y" to deps of //a:x' in errors[0]


def test_checker_reports_missing_dep_of_function_level_import():
  builds = dict(_GOOD_BUILDS)
  builds['b/BUILD'] = """
      py_library(name = "z", srcs = ["z.py"])
      py_binary(name = "main", srcs = ["main.py"], deps = [":z"])
      """
  errors = _check(builds, _fake_sources())
  assert len(errors) == 1, errors
  assert 'b/z.py' in errors[0] and 'from a.y import thing' in errors[0]
  assert 'add "//a:y"' in errors[0]


def test_checker_reports_extra_dep():
  builds = dict(_GOOD_BUILDS)
  builds['b/BUILD'] = """
      py_library(name = "z", srcs = ["z.py"], deps = ["//a:y", "//a:x"])
      py_binary(name = "main", srcs = ["main.py"], deps = [":z"])
      """
  errors = _check(builds, _fake_sources())
  assert len(errors) == 1, errors
  assert '//b:z' in errors[0] and '"//a:x"' in errors[0]
  assert 'remove it from deps' in errors[0]


def test_checker_reports_untargeted_module_missing_src_and_bad_label():
  builds = dict(_GOOD_BUILDS)
  builds['a/BUILD'] = """
      py_library(name = "x", srcs = ["x.py"], deps = [":y"])
      py_library(name = "y", srcs = ["y.py", "gone.py"], deps = ["//c"])
      """
  errors = _check(builds, _fake_sources(**{'a/new.py': ''}))
  text = '\n'.join(errors)
  assert 'a/new.py: no target has it in srcs' in text
  assert 'py_library(name = "new"' in text
  assert 'a/gone.py does not exist' in text
  assert '"//c" names no existing target (//c:c)' in text


def test_checker_reports_wrong_rule_duplicate_owner_and_unknown_module():
  builds = dict(_GOOD_BUILDS)
  builds['b/BUILD'] = """
      py_library(name = "z", srcs = ["z.py"], deps = ["//a:y"])
      py_library(name = "main", srcs = ["main.py", "z.py"], deps = [":z"])
      """
  errors = _check(builds, _fake_sources(**{'a/x.py': 'from a import nope\n'}))
  text = '\n'.join(errors)
  assert 'b/main.py: owned by py_library //b:main, expected a py_binary' in text
  assert 'b/z.py: in srcs of several targets (//b:main, //b:z)' in text
  assert '`from a import nope` names no module' not in text  # a/__init__.py
  assert 'imports the package a itself' in text


def test_checker_requires_conftest_dep_for_tests():
  builds = dict(_GOOD_BUILDS)
  builds['t/BUILD'] = """
      py_library(name = "conftest", srcs = ["conftest.py"])
      py_test(name = "x_test", srcs = ["x_test.py"], deps = ["//a:x"])
      """
  sources = _fake_sources(**{'t/conftest.py': '', 't/x_test.py': 'import a.x\n'})
  text = '\n'.join(_check(builds, sources))
  assert 't/conftest.py: //t:conftest must be `testonly = True`' in text
  assert 'pytest loads t/conftest.py' in text and 'add ":conftest"' in text
  assert 'depends on testonly' not in text


def test_build_graph_matches_imports():
  errors = build_graph.check_repo(REPO)
  assert not errors, (
      f'{len(errors)} BUILD graph problem(s); fix the BUILD files (or the '
      'imports) as described:\n  ' + '\n  '.join(errors))


def test_repo_has_build_file_in_every_python_package():
  builds, sources, _ = build_graph.collect_repo(REPO)
  packages = {os.path.dirname(b) for b in builds}
  missing = sorted({os.path.dirname(p) for p in sources} - packages)
  assert not missing, f'directories with .py files but no BUILD: {missing}'


# The packages from the bottom up (docs/architecture.md): a module imports
# only its own package and the layers below it, at module or function
# level. Packages on one layer know nothing of each other (a task knows
# nothing of algorithms: the algorithm x task matrix is in config, above
# both). `tff_personal/__init__.py` (the public names, loaded lazily),
# binaries, papers, tools and tests sit above them all.
LAYERS = (
    ('tff_personal.core',),
    ('tff_personal.models',),
    ('tff_personal.algorithms', 'tasks'),
    ('tff_personal.config',),
    ('tff_personal.records',),
    ('tff_personal.evaluation',),
    ('tff_personal.run',),
    ('tff_personal.reports',),
)


def _layer(module: str):
  for i, packages in enumerate(LAYERS):
    for package in packages:
      if module == package or module.startswith(package + '.'):
        return i, package
  return None


def _upward_imports(sources) -> list[str]:
  """`path:line: import` for each import of a package not below its own."""
  bad = []
  for path, text in sorted(sources.items()):
    own = _layer(path[:-len('.py')].replace('/', '.'))
    if own is None:
      continue
    imports, _ = build_graph.parse_imports(text, path)
    for imp in imports:
      # The most specific candidate that is in the repo's layers.
      found = next((_layer(c) for c in imp.candidates if _layer(c)), None)
      if found and (found[0] > own[0] or
                    (found[0] == own[0] and found[1] != own[1])):
        bad.append(f'{path}:{imp.lineno}: {imp.text}')
  return bad


def test_packages_import_only_the_layers_below():
  _, sources, _ = build_graph.collect_repo(REPO)
  assert not _upward_imports(sources)
  # The check sees a function-level import, a package on the same layer,
  # and an import from above; an import from below passes.
  assert _upward_imports({
      'tasks/t.py': (
          'def f():\n  from tff_personal.algorithms import fedperc\n'),
      'tff_personal/core/c.py': 'from tff_personal.run import runs\n',
      'tff_personal/records/r.py': 'from tff_personal.config import x\n',
  }) == ['tasks/t.py:2: from tff_personal.algorithms import fedperc',
         'tff_personal/core/c.py:1: from tff_personal.run import runs']
