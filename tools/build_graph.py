"""Checks that the Bazel BUILD graph matches the Python imports, without Bazel.

BUILD files are executed as Python with stub rule functions that record the
targets; `.py` files are parsed with `ast`. `check_graph` works on in-memory
data (so it can be tested on fake input); `check_repo` feeds it the repository.

Rules enforced (each failure says what to change):
  * every `.py` module has exactly one target listing it in `srcs`, in the
    Bazel package of its directory; `__init__.py` files are exempt (Bazel's
    rules_python creates them), but if a target lists one it is checked too;
  * the target's rule and name follow the convention: `py_test` for
    `*_test.py`, `py_binary` for a module with an `if __name__ == '__main__':`
    block, `py_library` otherwise; named after the module (`process` for
    `process.py`); `conftest.py` is a `testonly` `py_library`;
  * every `srcs` entry exists and is in the target's own package;
  * every in-repo import (module-level or inside functions) is matched by a
    dep on the target owning the imported module, and every in-repo dep is
    matched by an import (extras fail too); a `conftest.py` counts as imported
    by every test module in its directory and below (pytest loads it);
  * every in-repo label in `deps`/`data` names an existing target, and no
    non-testonly target depends on a testonly one.
Third-party deps (`requirement("tensorflow")`, `@...` labels) are not checked.
"""

from __future__ import annotations

import ast
import dataclasses
import fnmatch
import os
import posixpath
from typing import Iterable, Mapping, Optional

BUILD_NAMES = ('BUILD', 'BUILD.bazel')
SKIP_DIRS = frozenset({'.venv', 'venv', 'build', 'out', '__pycache__',
                       'node_modules'})
RULES = ('py_library', 'py_binary', 'py_test', 'filegroup')


@dataclasses.dataclass
class Target:
  package: str  # '' for the root package, else e.g. 'tff_personal/core'.
  name: str
  rule: str
  srcs: list[str]
  deps: list[str]
  data: list[str]
  testonly: bool
  build_file: str

  @property
  def label(self) -> str:
    return f'//{self.package}:{self.name}'


@dataclasses.dataclass(frozen=True)
class Import:
  lineno: int
  text: str  # As written, e.g. 'from tff_personal.core import process'.
  candidates: tuple[str, ...]  # Dotted names, most specific first.


# ---------------------------------------------------------------- BUILD files


class BuildError(Exception):
  pass


def parse_build(package: str, text: str, files: Iterable[str] = (),
                build_file: str = 'BUILD') -> list[Target]:
  """Executes one BUILD file with stub rules; returns the targets it declares.

  Args:
    package: the package path ('' for the root).
    text: the BUILD file's contents.
    files: repo-relative paths of all files (for `glob`).
    build_file: the BUILD file's path, for messages.
  """
  targets: list[Target] = []
  files = list(files)

  def as_list(value, attr, name):
    if value is None:
      return []
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
      raise BuildError(f'{build_file}: target "{name}": `{attr}` must be a '
                       f'list of strings, got {value!r}')
    return list(value)

  def rule(kind):
    def fn(name=None, srcs=None, deps=None, data=None, testonly=False,
           **unused_kwargs):
      if not name:
        raise BuildError(f'{build_file}: a {kind} has no `name`')
      targets.append(Target(
          package=package, name=name, rule=kind,
          srcs=as_list(srcs, 'srcs', name), deps=as_list(deps, 'deps', name),
          data=as_list(data, 'data', name),
          testonly=bool(testonly) or kind == 'py_test',
          build_file=build_file))
    return fn

  def glob(include, exclude=(), **unused_kwargs):
    prefix = package + '/' if package else ''
    local = [f[len(prefix):] for f in files if f.startswith(prefix)]
    return sorted(f for f in local
                  if any(fnmatch.fnmatch(f, p) for p in include)
                  and not any(fnmatch.fnmatch(f, p) for p in exclude))

  def noop(*unused_args, **unused_kwargs):
    return None

  env = {
      '__builtins__': {'True': True, 'False': False, 'None': None,
                       'len': len, 'sorted': sorted, 'list': list,
                       'dict': dict, 'str': str, 'range': range},
      'load': noop, 'package': noop, 'licenses': noop,
      'package_group': noop, 'exports_files': noop,
      'requirement': lambda name: f'@pypi//{name}',
      'glob': glob,
  }
  for kind in RULES:
    env[kind] = rule(kind)
  try:
    exec(compile(text, build_file, 'exec'), env)  # pylint: disable=exec-used
  except BuildError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    raise BuildError(f'{build_file}: cannot evaluate ({type(e).__name__}: '
                     f'{e}); add a stub for it in tools/build_graph.py') from e
  return targets


def normalize_label(label: str, package: str) -> Optional[str]:
  """'//pkg:name', '//pkg', ':name', 'name' -> '//pkg:name'; None if external."""
  if label.startswith('@'):
    return None
  if label.startswith('//'):
    pkg, _, name = label[2:].partition(':')
    return f'//{pkg}:{name or posixpath.basename(pkg)}'
  return f'//{package}:{label.lstrip(":")}'


# ------------------------------------------------------------------- imports


def parse_imports(source: str, path: str) -> tuple[list[Import], bool]:
  """Returns (all imports anywhere in the file, has a __main__ block)."""
  tree = ast.parse(source, filename=path)
  package_parts = posixpath.dirname(path).split('/') if '/' in path else []
  imports = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        parts = alias.name.split('.')
        cands = tuple('.'.join(parts[:i]) for i in range(len(parts), 0, -1))
        imports.append(Import(node.lineno, f'import {alias.name}', cands))
    elif isinstance(node, ast.ImportFrom):
      if node.level:  # Relative: resolve against this module's package.
        base = package_parts[:len(package_parts) - (node.level - 1)]
        mod = '.'.join(base + (node.module.split('.') if node.module else []))
      else:
        mod = node.module or ''
      if mod == '__future__':
        continue
      dots = '.' * node.level
      for alias in node.names:
        own = [] if alias.name == '*' else [f'{mod}.{alias.name}' if mod
                                            else alias.name]
        parts = mod.split('.') if mod else []
        cands = tuple(own + ['.'.join(parts[:i])
                             for i in range(len(parts), 0, -1)])
        imports.append(Import(
            node.lineno,
            f'from {dots}{node.module or ""} import {alias.name}', cands))
  has_main = any(
      isinstance(n, ast.If) and isinstance(n.test, ast.Compare)
      and isinstance(n.test.left, ast.Name) and n.test.left.id == '__name__'
      and any(isinstance(c, ast.Constant) and c.value == '__main__'
              for c in n.test.comparators)
      for n in tree.body)
  return imports, has_main


def resolve(imp: Import, modules: Mapping[str, object],
            top_level: set[str]) -> tuple[bool, Optional[str]]:
  """Returns (in_repo, repo-relative file of the imported module or None)."""
  if imp.candidates[-1] not in top_level:
    return False, None
  for dotted in imp.candidates:
    base = dotted.replace('.', '/')
    for path in (base + '.py', base + '/__init__.py'):
      if path in modules:
        return True, path
  return True, None


def expected_rule(path: str, has_main: bool) -> str:
  name = posixpath.basename(path)
  if name.endswith('_test.py') or name.startswith('test_'):
    return 'py_test'
  if name == 'conftest.py':
    return 'py_library'
  return 'py_binary' if has_main else 'py_library'


# ------------------------------------------------------------------- checker


def _package_of(path: str, packages: set[str]) -> Optional[str]:
  d = posixpath.dirname(path)
  while True:
    if d in packages:
      return d
    if not d:
      return None
    d = posixpath.dirname(d)


def check_graph(build_texts: Mapping[str, str], sources: Mapping[str, str],
                other_files: Iterable[str] = ()) -> list[str]:
  """Checks BUILD files against module imports; returns failure messages.

  Args:
    build_texts: BUILD file path (e.g. 'tff_personal/core/BUILD') -> text.
    sources: repo-relative `.py` path -> source text.
    other_files: any other repo files (they may appear in srcs/data/glob).
  """
  errors: list[str] = []
  all_files = set(sources) | set(other_files) | set(build_texts)
  packages = {posixpath.dirname(b) for b in build_texts}

  # Parse BUILD files.
  targets: dict[str, Target] = {}
  for build_file, text in sorted(build_texts.items()):
    package = posixpath.dirname(build_file)
    try:
      parsed = parse_build(package, text, all_files, build_file)
    except BuildError as e:
      errors.append(str(e))
      continue
    for t in parsed:
      if t.label in targets:
        errors.append(f'{build_file}: target "{t.name}" is declared twice; '
                      'rename or merge one of them.')
      targets[t.label] = t

  # Ownership of files by targets.
  owners: dict[str, list[Target]] = {}
  for t in targets.values():
    for src in t.srcs:
      path = posixpath.normpath(posixpath.join(t.package, src))
      if src.startswith(('//', ':', '@')) or '..' in src.split('/'):
        errors.append(f'{t.build_file}: {t.label} srcs entry "{src}" must be '
                      'a file name in the same package.')
        continue
      if path not in all_files:
        errors.append(f'{t.build_file}: {t.label} lists "{src}" in srcs but '
                      f'{path} does not exist; remove it or fix the name.')
        continue
      if _package_of(path, packages) != t.package:
        errors.append(f'{t.build_file}: {t.label} lists "{src}", which '
                      f'belongs to package //{_package_of(path, packages)}; '
                      'move it to a target in that BUILD file.')
      owners.setdefault(path, []).append(t)

  # Labels referenced exist; testonly respected.
  for t in targets.values():
    for attr in ('deps', 'data'):
      for raw in getattr(t, attr):
        label = normalize_label(raw, t.package)
        if label is None:
          continue
        dep_pkg, _, dep_name = label[2:].partition(':')
        dep = targets.get(label)
        if dep is None and not (attr == 'data' and posixpath.join(
            dep_pkg, dep_name) in all_files):
          errors.append(f'{t.build_file}: {t.label} {attr} "{raw}" names no '
                        f'existing target ({label}); fix or remove the label.')
        elif dep is not None and dep.testonly and not t.testonly:
          errors.append(f'{t.build_file}: {t.label} depends on testonly '
                        f'{label}; mark {t.name} `testonly = True` or drop '
                        'the dep.')

  # Modules: ownership, rule kind, imports vs deps.
  # Import roots the repo provides: top-level directories and modules.
  top_level = {p.split('/')[0] if '/' in p else p[:-3] for p in sources}
  parsed_sources = {}
  for path, text in sorted(sources.items()):
    try:
      parsed_sources[path] = parse_imports(text, path)
    except SyntaxError as e:
      errors.append(f'{path}: cannot parse ({e}); imports not checked.')
  conftests = [p for p in sources if posixpath.basename(p) == 'conftest.py']

  used: dict[str, set[str]] = {label: set() for label in targets}
  for path, (imports, has_main) in sorted(parsed_sources.items()):
    is_init = posixpath.basename(path) == '__init__.py'
    owned = owners.get(path, [])
    pkg = _package_of(path, packages)
    if not owned:
      if not is_init:
        where = (f'{pkg}/BUILD' if pkg is not None else
                 f'a new {posixpath.dirname(path) or "."}/BUILD')
        stem = posixpath.basename(path)[:-3]
        errors.append(
            f'{path}: no target has it in srcs; add a '
            f'{expected_rule(path, has_main)}(name = "{stem}", srcs = '
            f'["{posixpath.basename(path)}"], deps = [...]) to {where}.')
      continue
    if len(owned) > 1:
      errors.append(f'{path}: in srcs of several targets '
                    f'({", ".join(sorted(t.label for t in owned))}); keep it '
                    'in exactly one and depend on that one.')
    target = owned[0]
    stem = posixpath.basename(path)[:-3]
    want_rule = expected_rule(path, has_main)
    if not is_init and target.rule != want_rule:
      errors.append(f'{path}: owned by {target.rule} {target.label}, expected '
                    f'a {want_rule} (`*_test.py` -> py_test, a __main__ block '
                    '-> py_binary, else py_library).')
    if not is_init and len(target.srcs) == 1 and target.name != stem:
      errors.append(f'{path}: its target is named "{target.name}"; name it '
                    f'"{stem}" after the module.')
    if posixpath.basename(path) == 'conftest.py' and not target.testonly:
      errors.append(f'{path}: {target.label} must be `testonly = True`.')

    declared = {}
    for raw in target.deps:
      label = normalize_label(raw, target.package)
      if label is not None:
        declared[label] = raw
    needed: dict[str, str] = {}  # label -> why
    for imp in imports:
      in_repo, mod_path = resolve(imp, sources, top_level)
      if not in_repo:
        continue
      if mod_path is None:
        errors.append(f'{path}:{imp.lineno}: `{imp.text}` names no module in '
                      'the repo; fix the import.')
        continue
      if mod_path == path:
        continue
      dep_owners = owners.get(mod_path, [])
      if not dep_owners:
        if posixpath.basename(mod_path) == '__init__.py':
          errors.append(
              f'{path}:{imp.lineno}: `{imp.text}` imports the package '
              f'{posixpath.dirname(mod_path)} itself, and no target has its '
              '__init__.py; import a module instead, or add a py_library '
              'for the __init__.py and depend on it.')
        # A non-__init__ module without a target is reported on its own.
        continue
      dep_label = dep_owners[0].label
      if dep_label != target.label:
        needed.setdefault(dep_label, f'`{imp.text}` (line {imp.lineno})')
    if want_rule == 'py_test':
      for conf in conftests:
        conf_dir = posixpath.dirname(conf)
        if (posixpath.dirname(path) + '/').startswith(
            conf_dir + '/' if conf_dir else '') and owners.get(conf):
          needed.setdefault(owners[conf][0].label,
                            f'pytest loads {conf} for this test')
    for label, why in sorted(needed.items()):
      used.setdefault(target.label, set()).add(label)
      if label not in declared:
        short = (f':{label.partition(":")[2]}'
                 if label.startswith(f'//{target.package}:') else label)
        errors.append(f'{path}: {why} needs a dep on {label}; add "{short}" '
                      f'to deps of {target.label} in {target.build_file}.')

  # Extra in-repo deps: declared but not matched by any import of any src.
  for t in targets.values():
    if t.rule == 'filegroup':
      continue
    for raw in t.deps:
      label = normalize_label(raw, t.package)
      if label is None or label not in targets:
        continue
      if label not in used.get(t.label, set()):
        errors.append(f'{t.build_file}: {t.label} declares dep "{raw}" but '
                      'none of its srcs import it; remove it from deps (or '
                      'add the import).')
  return errors


def _walk(root: str):
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if not d.startswith('.')
                         and d not in SKIP_DIRS and not d.endswith('.egg-info'))
    for f in filenames:
      yield posixpath.relpath(os.path.join(dirpath, f), root).replace(
          os.sep, '/')


def collect_repo(root: str):
  """Reads (build_texts, sources, other_files) from a checkout."""
  build_texts, sources, other = {}, {}, []
  for rel in _walk(root):
    full = os.path.join(root, rel)
    if posixpath.basename(rel) in BUILD_NAMES:
      with open(full, encoding='utf-8') as f:
        build_texts[rel] = f.read()
    elif rel.endswith('.py'):
      with open(full, encoding='utf-8') as f:
        sources[rel] = f.read()
    else:
      other.append(rel)
  return build_texts, sources, other


def check_repo(root: str) -> list[str]:
  return check_graph(*collect_repo(root))
