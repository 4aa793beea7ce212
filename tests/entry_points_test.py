"""Every entry point refuses bad input with one line and exit code 2.

Spec files of any JSON value or structure, outside task and algorithm
plugins that fail in any way (at import, a SyntaxError, `sys.exit`, any
exception of their factory or builder), names that are no module, and a
noise multiplier whose epsilon cannot be accounted: each ends
`binaries.train` with one `error:` line, exit code 2 and no traceback,
before any training. A seeded fuzz feeds random values and structures,
and random plugin names and failures, through the binary's main in this
process; two cases run as real subprocesses. A run whose record is damaged
ends `binaries.evaluate --run_dir` with one line and exit code 3;
`binaries.benchmark` refuses bad flags with one line and exit code 2.
"""

import json
import os
import subprocess
import sys
import textwrap

from absl import flags
from absl.testing import flagsaver
import numpy as np
import pytest

from binaries import evaluate
from binaries import train
from tff_personal.config import run_spec

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = flags.FLAGS

_VALID = {'task': 'mnist_preference', 'algorithm': 'global_plus'}


def _parse_flags():
  if not FLAGS.is_parsed():
    FLAGS(['train'])


def _train(tmp_path, capsys, **values):
  """`binaries.train`'s main in this process: (exit code, stderr). No data
  directory exists, so nothing that passes the checks could train."""
  _parse_flags()
  capsys.readouterr()
  base = dict(data_dir=str(tmp_path / 'no_data'))
  if 'spec' not in values:  # A spec states where its run lives.
    base['root_output_dir'] = str(tmp_path / 'out')
  with flagsaver.flagsaver(**dict(base, **values)):
    code = train.main(['train'])
  return code, capsys.readouterr().err


def _assert_one_line(code, err, want_code=2, match=None):
  lines = [line for line in err.splitlines() if line.strip()]
  assert code == want_code, err
  assert len(lines) == 1 and lines[0].startswith('error: '), err
  assert 'Traceback' not in err
  if match is not None:
    assert match in lines[0], lines[0]


def _spec_file(tmp_path, text, name='spec.json'):
  path = tmp_path / name
  path.write_text(text)
  return str(path)


@pytest.mark.parametrize('text,named', [
    ('42', 'got 42 (int)'),
    ('null', 'got None (NoneType)'),
    ('"a string"', "got 'a string' (str)"),
    (json.dumps(dict(_VALID, loop=[1, 2])), 'loop must be an object'),
    (json.dumps(dict(_VALID, privacy='x')), 'privacy must be an object'),
    (json.dumps(dict(_VALID, task=5)), 'task must be a string'),
    (json.dumps(dict(_VALID, task=None)), 'task must be a string'),
    (json.dumps(dict(_VALID, algorithm=[1])), 'algorithm must be a string'),
    (json.dumps(dict(_VALID, task_options=['a'])),
     'task_options must be an object'),
    (json.dumps(dict(_VALID, evaluation={'strategies': [1]})),
     'evaluation.strategies=[1] must be a list of strings'),
    (json.dumps(dict(_VALID, loop={'sampling': 'zzz'},
                     output={'experiment_name': 'e'})), 'sampling'),
    ('[' * 200_000, 'RecursionError'),
    ('{"task": ', 'is not valid JSON'),
])
def test_spec_files_that_ended_in_a_traceback(tmp_path, capsys, text, named):
  path = _spec_file(tmp_path, text)
  code, err = _train(tmp_path, capsys, spec=path)
  _assert_one_line(code, err, match=named)
  assert path in err or 'sampling' in named  # The file, or the setting.


_FAILING_MODULES = {
    'raises_at_import': "raise RuntimeError('broken at import')\n",
    'syntax_error': 'def make(:\n',
    'exits_at_import': 'import sys\nsys.exit(5)\n',
    'factories': textwrap.dedent('''
        def runtime_error(data_dir, seed=0):
          raise RuntimeError('the factory failed')

        def key_error(data_dir, seed=0):
          raise KeyError('missing')

        def exits(data_dir, seed=0):
          raise SystemExit(7)

        def not_a_task(data_dir, seed=0):
          return None

        for f in (runtime_error, key_error, exits, not_a_task):
          f.capabilities = ('split_model', 'batches')

        def caps_not_names(data_dir, seed=0):
          pass
        caps_not_names.capabilities = 5
        number = 42
        '''),
}


@pytest.fixture
def plugins(tmp_path, monkeypatch):
  """A directory on sys.path holding the `_FAILING_MODULES`, under names
  unique to the test (a module that failed to import is not cached, but
  one that imported is)."""
  root = tmp_path / 'plugins'
  root.mkdir()
  prefix = f'ep_{os.getpid()}_{tmp_path.name}'.replace('-', '_')
  for name, source in _FAILING_MODULES.items():
    (root / f'{prefix}_{name}.py').write_text(source)
  monkeypatch.syspath_prepend(str(root))
  return prefix


@pytest.mark.parametrize('task,named', [
    ('raises_at_import:make', 'RuntimeError: broken at import'),
    ('syntax_error:make', 'SyntaxError'),
    ('exits_at_import:make', 'SystemExit: 5'),
    ('factories:caps_not_names', 'capabilities'),
    ('factories:number', 'is a int, not a task builder'),
    ('factories:no_such_name', "has no 'no_such_name'"),
])
def test_task_plugins_that_fail_to_load(tmp_path, capsys, plugins, task,
                                        named):
  task = f'{plugins}_{task}'
  code, err = _train(tmp_path, capsys, task=task, algorithm='global')
  _assert_one_line(code, err, match=named)
  assert f'--task={task!r}' in err
  # --list beside it: the same line, not a listing.
  code, err = _train(tmp_path, capsys, task=task, list=True)
  _assert_one_line(code, err, match=named)


@pytest.mark.parametrize('task', [
    '.relative:x', '../../etc/passwd:x', 'a b:c', 'mod:', ':make',
    'mod:a:b', 'mod:a.b'])
def test_names_that_are_no_module_are_refused(tmp_path, capsys, task):
  code, err = _train(tmp_path, capsys, task=task, algorithm='global')
  _assert_one_line(code, err, match='package.module:attribute')


@pytest.mark.parametrize('factory,named', [
    ('runtime_error', 'RuntimeError: the factory failed'),
    ('key_error', "KeyError: 'missing'"),
    ('exits', 'SystemExit: 7'),
    ('not_a_task', 'is not a Task'),
])
def test_task_factories_that_fail_when_called(tmp_path, capsys, plugins,
                                              factory, named):
  task = f'{plugins}_factories:{factory}'
  code, err = _train(tmp_path, capsys, task=task, algorithm='global',
                     rounds=1, clients_per_round=1)
  _assert_one_line(code, err, match=named)
  assert repr(task) in err
  assert not os.path.exists(tmp_path / 'out')  # Nothing ran.


def test_an_algorithm_plugin_whose_builder_fails(tmp_path, capsys, plugins,
                                                 mnist_dir):
  del plugins
  (tmp_path / 'plugins' / 'ep_algorithm.py').write_text(textwrap.dedent('''
      import dataclasses
      from tff_personal.algorithms import registry

      def _fails(model_fn_factory, **kwargs):
        raise KeyError('no such layer')

      BROKEN = dataclasses.replace(registry.SPECS['global'], builder=_fails)
      '''))
  code, err = _train(tmp_path, capsys, algorithm='ep_algorithm:BROKEN',
                     data_dir=mnist_dir, num_users=20, rounds=1,
                     clients_per_round=2, experiment_name='broken')
  _assert_one_line(code, err, match="KeyError: 'no such layer'")
  assert "'ep_algorithm:BROKEN'" in err
  assert not os.path.exists(tmp_path / 'out' / 'broken')


@pytest.mark.parametrize('noise_multiplier,sampling', [
    (1e300, 'fixed_size'), (1e-300, 'fixed_size'), (1e30, 'poisson')])
def test_an_unaccountable_noise_multiplier_is_refused_before_round_1(
    tmp_path, capsys, mnist_dir, noise_multiplier, sampling):
  spec = dict(_VALID, privacy={'mechanism': 'gaussian_fixed',
                               'noise_multiplier': noise_multiplier},
              loop={'rounds': 2, 'clients_per_round': 5,
                    'sampling': sampling},
              task_options={'num_users': 20},
              output={'root_output_dir': str(tmp_path / 'out'),
                      'experiment_name': 'huge_noise'})
  code, err = _train(tmp_path, capsys, data_dir=mnist_dir,
                     spec=_spec_file(tmp_path, json.dumps(spec)))
  _assert_one_line(code, err, match=f'noise_multiplier={noise_multiplier!r}')
  assert 'cannot be accounted' in err
  assert not os.path.exists(tmp_path / 'out' / 'huge_noise')


# The fuzz: values and structures of any JSON, and plugin names.
_STRINGS = ('', 'x', 'mnist_preference', 'global_plus', 'ditto', 'a:b',
            '../x:y', '.rel:x', 'sys:exit', 'os:system', 'json:loads',
            'ep_fuzz_missing:make', ',', 'lam=1', '\u00e9\u4e2d', '\x00',
            'none', 'gaussian_fixed', 'fine_tune(epochs=1)')
_NUMBERS = (0, 1, -1, 2, 2**31, 10**30, -10**30, 0.5, -0.5, 1e300, 1e-300,
            float('nan'), float('inf'), float('-inf'), True, False)
_EXCEPTIONS = ('RuntimeError("x")', 'KeyError("k")', 'TypeError("t")',
               'ZeroDivisionError()', 'RecursionError()', 'SystemExit(3)',
               'SystemExit("text")', 'AssertionError()', 'OSError(5, "io")',
               'ImportError("i")', 'ValueError("v")', 'MemoryError()',
               'NotImplementedError()', 'StopIteration()')


def _value(rng, depth=0):
  """A random JSON value, nested up to 3 deep."""
  kind = rng.integers(0, 6 if depth < 3 else 4)
  if kind == 0:
    return None
  if kind == 1:
    return _NUMBERS[rng.integers(len(_NUMBERS))]
  if kind == 2:
    return _STRINGS[rng.integers(len(_STRINGS))]
  if kind == 3:
    return int(rng.integers(-5, 50))
  if kind == 4:
    return [_value(rng, depth + 1) for _ in range(rng.integers(0, 4))]
  keys = list(run_spec.SECTIONS) + ['task', 'rounds', 'lam', 'alpha', 'x']
  return {keys[rng.integers(len(keys))]: _value(rng, depth + 1)
          for _ in range(rng.integers(0, 4))}


def _fuzz_spec(rng):
  """A spec text that no run can take: a random value, or a valid spec
  with one part replaced by a random value or structure."""
  case = rng.integers(0, 6)
  spec = dict(_VALID)
  if case == 0:
    return json.dumps(_value(rng))
  if case == 1:  # A section (or the options) of any value.
    names = list(run_spec.SECTIONS) + ['task_options', 'algorithm_options']
    spec[names[rng.integers(len(names))]] = _value(rng)
  elif case == 2:  # A field of the wrong type or out of range.
    section = list(run_spec.SECTIONS)[rng.integers(len(run_spec.SECTIONS))]
    fields = [f.name for f in
              run_spec.dataclasses.fields(run_spec.SECTIONS[section])]
    value = _value(rng)
    spec[section] = {fields[rng.integers(len(fields))]: value}
    if isinstance(value, (int, float)) and not isinstance(value, bool) and (
        abs(value) < 2**31):  # A valid number might run: make sure not.
      spec['loop'] = dict(spec.get('loop') or {}, rounds=-1)
  elif case == 3:  # The task or the algorithm of any value or name.
    spec[('task', 'algorithm')[rng.integers(2)]] = _value(rng)
  elif case == 4:  # Options of any name and value.
    key = ('task_options', 'algorithm_options')[rng.integers(2)]
    spec[key] = {f'o{rng.integers(3)}': _value(rng)}
  else:  # Keys no spec has.
    spec[f'k{rng.integers(100)}'] = _value(rng)
  return json.dumps(spec)


def _fuzz_plugin(rng, root, i):
  """`--task` naming a generated module that fails at import or in its
  factory, with a random exception, or a random name."""
  module = f'ep_fuzz_{os.getpid()}_{i}'
  error = _EXCEPTIONS[rng.integers(len(_EXCEPTIONS))]
  case = rng.integers(0, 4)
  if case == 0:
    source = f'raise {error}\n'
  elif case == 1:
    source = textwrap.dedent(f'''
        def make(data_dir, seed=0):
          raise {error}
        make.capabilities = ('split_model', 'batches')
        ''')
  elif case == 2:
    source = ''.join(chr(c) for c in rng.integers(32, 127, size=30)) + '\n('
  else:
    letters = 'ab./:_-1 '
    return ''.join(letters[c] for c in rng.integers(0, len(letters), 8))
  (root / f'{module}.py').write_text(source)
  return f'{module}:make'


def test_fuzzed_specs_and_plugins_give_one_line_and_exit_2(
    tmp_path, capsys, monkeypatch):
  rng = np.random.default_rng(20261207)
  root = tmp_path / 'plugins'
  root.mkdir()
  monkeypatch.syspath_prepend(str(root))
  for i in range(40):
    text = _fuzz_spec(rng)
    code, err = _train(tmp_path, capsys,
                       spec=_spec_file(tmp_path, text, f'spec_{i}.json'))
    try:
      _assert_one_line(code, err)
    except AssertionError as e:
      raise AssertionError(f'spec {text[:300]!r}: {e}') from e
  for i in range(30):
    task = _fuzz_plugin(rng, root, i)
    code, err = _train(tmp_path, capsys, task=task, algorithm='global',
                       rounds=1, clients_per_round=1)
    try:
      _assert_one_line(code, err)
    except AssertionError as e:
      raise AssertionError(f'--task={task!r}: {e}') from e
  assert not os.path.exists(tmp_path / 'out')  # Nothing ran.


def _subprocess(args, tmp_path, **env):
  return subprocess.run(
      [sys.executable, '-m', 'binaries.train',
       f'--data_dir={tmp_path / "no_data"}', *args],
      cwd=REPO, capture_output=True, text=True, timeout=300,
      env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3', **env))


def test_the_binary_ends_with_one_line_and_exit_2(tmp_path):
  (tmp_path / 'ep_exits.py').write_text('import sys\nsys.exit(5)\n')
  for args in ([f'--spec={_spec_file(tmp_path, "null")}'],
               ['--task=ep_exits:make']):
    proc = _subprocess(args, tmp_path, PYTHONPATH=f'{tmp_path}:{REPO}')
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith('error: '), proc.stderr
  assert 'SystemExit: 5' in lines[0]


@pytest.mark.parametrize('record,named', [
    ('{"config": ', 'is not valid JSON'),
    ('[1]', 'not an object'),
    ('{"config": 3}', 'does not hold a run record'),
    ('{"config": {"rounds": 2}}', 'does not hold a run configuration'),
    ('{"config": {"algorithm": "nope", "rounds": 2, "clients_per_round": '
     '2}}', "unknown algorithm 'nope'"),
    # Edited by hand: the run's flags name another algorithm.
    ('{"config": {"algorithm": "ditto", "rounds": 2, "clients_per_round": '
     '2}, "flags": {"training": {"algorithm": "global_plus"}}}',
     "but the run's flags record 'global_plus'"),
])
def test_a_damaged_run_record_ends_evaluate_with_exit_3(tmp_path, capsys,
                                                        record, named):
  run_dir = tmp_path / 'run'
  run_dir.mkdir()
  (run_dir / 'run_config.json').write_text(record)
  _parse_flags()
  capsys.readouterr()
  with flagsaver.flagsaver(run_dir=str(run_dir)):
    code = evaluate.main(['evaluate'])
  _assert_one_line(code, capsys.readouterr().err, want_code=3, match=named)


def test_the_benchmark_refuses_bad_flags_with_one_line(tmp_path):
  for args, named in ((['--cohorts=x'], "--cohorts must be whole numbers"),
                      (['--families=zzz'], "unknown --families ['zzz']")):
    proc = subprocess.run(
        [sys.executable, '-m', 'binaries.benchmark',
         f'--output_dir={tmp_path / "bench"}', *args],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3'))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and named in lines[0], proc.stderr
  assert not os.path.exists(tmp_path / 'bench')  # Nothing ran.
