"""Checks on README.md and docs/: generated tables, length, links, hygiene.

* The README's algorithm x task matrix and results table equal what
  `tools/readme_tables.py` generates (run it with `--write` to refresh).
* The paper reports' marked result tables equal what
  `tools/paper_tables.py` renders from `docs/results/` (`--write`).
* README.md has at most 300 lines.
* No line names a commit hash, a machine load average or an internal issue
  number.
* Every relative link and image points to an existing file (and, for
  Markdown targets with `#anchor`, to an existing heading).
* The python blocks of docs/your_own_task.md run, in order, on tiny data.
* The python blocks of README.md's quickstart run, each on tiny data
  standing in for its placeholders.
"""

import collections
import glob
import json
import os
import re

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tools import paper_tables
from tools import readme_tables

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, 'README.md')
MAX_README_LINES = 300


def _markdown_files() -> list[str]:
  return [README] + sorted(
      glob.glob(os.path.join(ROOT, 'docs', '**', '*.md'), recursive=True))


def _rel(path: str) -> str:
  return os.path.relpath(path, ROOT)


def _read(path: str) -> str:
  with open(path, encoding='utf-8') as f:
    return f.read()


# ------------------------------------------------------------ generated


@pytest.mark.parametrize('name', readme_tables.SECTIONS)
def test_readme_tables_are_generated(name):
  expected = readme_tables.generated()[name]
  actual = readme_tables.readme_section(_read(README), name)
  assert actual == expected, (
      f'README.md\'s {name} table is stale: run '
      '`python tools/readme_tables.py --write`')


def test_rewrite_replaces_only_the_marked_sections():
  text = ('a\n<!-- matrix:begin -->\nold\n<!-- matrix:end -->\nb\n'
          '<!-- results:begin -->\n<!-- results:end -->\nc\n')
  new = readme_tables.rewrite(text, {'matrix': 'M', 'results': 'R'})
  assert new == ('a\n<!-- matrix:begin -->\nM\n<!-- matrix:end -->\nb\n'
                 '<!-- results:begin -->\nR\n<!-- results:end -->\nc\n')
  assert readme_tables.readme_section(new, 'results') == 'R'


@pytest.mark.parametrize('path', paper_tables.reports(),
                         ids=lambda p: os.path.basename(p))
def test_paper_tables_are_generated_from_committed_results(path):
  assert not paper_tables.stale_blocks(path), (
      f'{_rel(path)}: stale result tables; run '
      '`python tools/paper_tables.py --write`')


def test_paper_tables_rewrite_and_add(tmp_path, monkeypatch):
  monkeypatch.setattr(paper_tables, 'RESULTS_DIR', str(tmp_path))
  source = tmp_path / 'root.jsonl'
  record = {'paper': 'group', 'method': 'fl', 'seed': 0,
            'setting': {'fl': 'plateau', 'group': 'all'},
            'metrics': {'fl_rounds': 200}}
  lines = [dict(record, seed=s, metrics={'fl_rounds': r})
           for s, r in ((0, 200), (1, 300))]
  lines.append(dict(record, paper='furl'))  # another paper's: not added
  source.write_text(''.join(json.dumps(l) + '\n'
                            for l in lines))
  assert paper_tables.add('group', str(source)) == 2
  assert paper_tables.add('group', str(source)) == 0  # idempotent
  text = ('x\n<!-- table group control_rounds: begin -->\nold\n'
          '<!-- table: end -->\ny\n')
  new = paper_tables.rewrite(text)
  assert new.startswith('x\n<!-- table group control_rounds: begin -->\n###')
  assert '| fl | 250 ± 71 (2) |' in new and 'old' not in new
  assert new.endswith('<!-- table: end -->\ny\n')
  with pytest.raises(ValueError, match='no table'):
    paper_tables.rewrite(text.replace('control_rounds', 'nope'))
  monkeypatch.setattr(paper_tables, 'RESULTS_DIR', str(tmp_path / 'none'))
  with pytest.raises(ValueError, match='is missing'):
    paper_tables.render('group', 'control_rounds')


def test_every_target_links_its_report():
  for t in readme_tables.load_targets():
    path = t['report'].split('#')[0]
    assert os.path.isfile(os.path.join(ROOT, path)), t


# ------------------------------------------------------------ length


def test_readme_is_short():
  n = len(_read(README).splitlines())
  assert n <= MAX_README_LINES, f'README.md has {n} lines (max 300)'


# ------------------------------------------------------------ hygiene

HEX = r'[0-9a-f]{7,40}'
FORBIDDEN = {
    'commit hash': re.compile(
        rf'\b(?:commits?|snapshots?)(?:\s+of)?\s+`?{HEX}\b'
        rf'|\b{HEX}`?\s+(?:commit|snapshot)\b'
        r'|\b[0-9a-f]{40}\b', re.I),
    'load average': re.compile(r'\bload\s+av(?:erage|g)\b', re.I),
    'internal issue number': re.compile(r'\bissues?\s+#?\d+', re.I),
}


def hygiene_problems(name: str, text: str) -> list[str]:
  """`file:line: what` for every forbidden mention in `text`."""
  problems = []
  for i, line in enumerate(text.splitlines(), 1):
    for what, pattern in FORBIDDEN.items():
      match = pattern.search(line)
      if match:
        problems.append(f'{name}:{i}: {what}: {match.group(0)!r}')
  return problems


@pytest.mark.parametrize('text,what', [
    ('from a snapshot of commit c146733, 4.8 min', 'commit hash'),
    ('snapshot of 53ce4c5', 'commit hash'),
    ('at commit 0123456789abcdef0123456789abcdef01234567', 'commit hash'),
    ('0123456789abcdef0123456789abcdef01234567', 'commit hash'),
    ('11 minutes (load average ~40)', 'load average'),
    ('at load avg 65', 'load average'),
    ('FedDVA (issue 7): built', 'internal issue number'),
    ('see issue #5', 'internal issue number'),
])
def test_hygiene_patterns_catch(text, what):
  problems = hygiene_problems('x.md', text)
  assert problems and what in problems[0] and problems[0].startswith('x.md:1')


@pytest.mark.parametrize('text', [
    'a commit of code changes nothing', 'the accent color is #c146733',
    'epsilon 9.999 at delta 1.111e-4', 'the issue is the noise'])
def test_hygiene_patterns_pass(text):
  assert not hygiene_problems('x.md', text)


def test_no_commit_hash_load_or_issue_number():
  problems = []
  for path in _markdown_files():
    problems += hygiene_problems(_rel(path), _read(path))
  assert not problems, '\n'.join(problems)


# ------------------------------------------------------------ links

LINK = re.compile(r'!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+"[^"]*")?\s*\)')
FENCE = re.compile(r'^(```|~~~)')


def _lines_outside_code(text: str):
  in_code = False
  for i, line in enumerate(text.splitlines(), 1):
    if FENCE.match(line.strip()):
      in_code = not in_code
      continue
    if not in_code:
      yield i, re.sub(r'`[^`]*`', '', line)


def heading_anchors(text: str) -> set[str]:
  """GitHub's anchors of the Markdown headings in `text`."""
  anchors, seen = set(), {}
  for _, line in _lines_outside_code(text):
    match = re.match(r'^#{1,6}\s+(.*?)\s*#*\s*$', line)
    if not match:
      continue
    slug = re.sub(r'[^\w\- ]', '', match.group(1).lower()).replace(' ', '-')
    n = seen.get(slug, 0)
    seen[slug] = n + 1
    anchors.add(slug if n == 0 else f'{slug}-{n}')
  return anchors


def _anchors_with_code(path: str) -> set[str]:
  # Headings keep their inline code for anchors (`x` -> x).
  text = re.sub(r'`([^`]*)`', r'\1', _read(path))
  return heading_anchors(text)


def link_problems(path: str) -> list[str]:
  problems = []
  text = _read(path)
  for i, line in _lines_outside_code(text):
    for target in LINK.findall(line):
      if re.match(r'^[a-z][a-z0-9+.-]*:', target, re.I):
        continue  # http:, https:, mailto:
      file_part, _, anchor = target.partition('#')
      dest = (os.path.normpath(os.path.join(os.path.dirname(path), file_part))
              if file_part else path)
      if not os.path.exists(dest):
        problems.append(f'{_rel(path)}:{i}: missing {target}')
      elif anchor and dest.endswith('.md') and (
          anchor not in _anchors_with_code(dest)):
        problems.append(f'{_rel(path)}:{i}: no heading for #{anchor} '
                        f'in {_rel(dest)}')
  return problems


def test_link_checker_catches(tmp_path):
  (tmp_path / 'a.md').write_text('# Top\n[ok](a.md#top) ![x](nope.png)\n'
                                 '[bad](a.md#nowhere)\n')
  problems = link_problems(str(tmp_path / 'a.md'))
  assert len(problems) == 2, problems
  assert 'nope.png' in problems[0] and 'nowhere' in problems[1]


def test_relative_links_and_images_exist():
  problems = []
  for path in _markdown_files():
    problems += link_problems(path)
  assert not problems, '\n'.join(problems)


# ------------------------------------------------------------ your_own_task

OWN_TASK = os.path.join(ROOT, 'docs', 'your_own_task.md')


def python_blocks(text: str) -> list[str]:
  return re.findall(r'^```python\n(.*?)^```', text, re.S | re.M)


def test_your_own_task_code_runs(tmp_path):
  blocks = python_blocks(_read(OWN_TASK))
  assert len(blocks) >= 4
  namespace = {'__name__': 'your_own_task'}
  for n, block in enumerate(blocks):
    # A real file per block, so that AutoGraph and tracebacks can read it.
    path = tmp_path / f'your_own_task_block{n}.py'
    path.write_text(block)
    exec(compile(block, str(path), 'exec'), namespace)  # pylint: disable=exec-used
  assert 'accuracy' in namespace['summary']['eval']
  assert len(namespace['states']) == 3 and namespace['run'].finished
  assert namespace['metrics']['train']['clients'] == 3


# ------------------------------------------------------------ README quickstart


def _exec_block(block: str, path, namespace: dict) -> None:
  # A real file per block, so that AutoGraph and tracebacks can read it.
  path.write_text(block)
  exec(compile(block, str(path), 'exec'), namespace)  # pylint: disable=exec-used


def _tiny_client_data(num_clients: int, seed: int):
  """ClientData of `num_clients` clients of 8 random 28x28x1 images."""
  rng = np.random.default_rng(seed)
  arrays = {f'c{i}': (rng.random((8, 28, 28, 1), dtype=np.float32),
                      rng.integers(0, 10, 8, dtype=np.int32))
            for i in range(num_clients)}

  def dataset_fn(client_id):
    x, y = tf.py_function(lambda c: arrays[c.numpy().decode()],
                          [client_id], [tf.float32, tf.int32])
    x.set_shape([8, 28, 28, 1])
    y.set_shape([8])
    return tf.data.Dataset.from_tensor_slices(
        collections.OrderedDict(x=x, y=y))

  return tff.simulation.datasets.ClientData.from_clients_and_tf_fn(
      sorted(arrays), dataset_fn)


def readme_quickstart_blocks() -> list[str]:
  return python_blocks(_read(README))


def test_readme_client_data_block_runs(tmp_path):
  block = next(b for b in readme_quickstart_blocks()
               if 'ClientDataTask(' in b)
  assert "root_output_dir='/tmp/out'" in block
  block = block.replace("root_output_dir='/tmp/out'",
                        f'root_output_dir={str(tmp_path / "out")!r}')
  namespace = {'__name__': 'readme_quickstart',
               'train_client_data': _tiny_client_data(6, seed=0),
               'test_client_data': _tiny_client_data(6, seed=1)}
  _exec_block(block, tmp_path / 'readme_client_data.py', namespace)
  assert namespace['summary']
  assert os.listdir(tmp_path / 'out')


def test_readme_builder_block_runs(tmp_path, mnist_dir):
  from tasks import client_data_task  # pylint: disable=g-import-not-at-top
  from tff_personal.core import privacy  # pylint: disable=g-import-not-at-top
  block = next(b for b in readme_quickstart_blocks()
               if 'process.next(' in b)
  task = client_data_task.mnist_client_data_task(mnist_dir, num_users=10,
                                                 seed=0)
  namespace = {
      '__name__': 'readme_quickstart', 'task': task,
      'dp_config': privacy.resolve(privacy.DPConfig(
          mechanism='gaussian_fixed', noise_multiplier=1.0, clip_norm=1.0,
          clients_per_round=2, population=10, rounds=1)),
      'client_datasets': task.train_datasets([0, 1], 1)}
  # The block builds `process` and then runs a round on `client_states`:
  # run it unchanged in two parts, with the clients' initial states (zeros
  # of the process's client state type) set in between.
  head, sep, tail = block.partition('with tp.local_runtime():')
  assert sep, block
  _exec_block(head, tmp_path / 'readme_builder_head.py', namespace)
  specs = tff.types.type_to_tf_tensor_specs(
      namespace['process'].client_state_type)
  namespace['client_states'] = [
      tf.nest.map_structure(
          lambda s: np.zeros(s.shape, s.dtype.as_numpy_dtype), specs)
      for _ in range(2)]
  _exec_block('\n' * head.count('\n') + sep + tail,
              tmp_path / 'readme_builder_tail.py', namespace)
  assert len(namespace['client_states']) == 2
  assert namespace['metrics']
