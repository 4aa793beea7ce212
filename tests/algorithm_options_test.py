"""An algorithm's own options: listed, parsed, checked and passed to its builder."""

import re

from absl import flags
from absl.testing import flagsaver
import numpy as np
import pytest

from binaries import common
from binaries import train  # pylint: disable=unused-import  (defines the flags)
from tasks import registry as task_registry
from tff_personal.algorithms import registry
from tff_personal.config import experiment

FLAGS = flags.FLAGS


def test_options_are_the_builders_scalar_keywords():
  pfedme = registry.algorithm_options('pfedme')
  assert pfedme['lam'] == (float, 1.0)
  assert pfedme['inner_steps'] == (int, 5)
  assert pfedme['beta'] == (float, None)  # from Optional[float]
  assert pfedme['head_layer'] == (str, 'head')
  assert registry.algorithm_options('fedrep')['head_epochs'] == (int, 2)
  for name in registry.ALGORITHMS:
    assert not set(registry.algorithm_options(name)) & set(
        registry.EXPERIMENT_ARGUMENTS), name
  # Wrappers show the builder they wrap, less what they fix themselves.
  restart = registry.algorithm_options('pfedme_restart')
  assert 'restart_personal_head' not in restart
  assert restart['lam'] == (float, 1.0)
  assert registry.algorithm_options('fedembed_prototype') == {
      'num_subpopulations': (int, None), 'head_mean': (str, 'cohort')}
  assert registry.algorithm_options('global') == {}
  # som_config is a dataclass: not settable from a string, not listed.
  assert 'som_config' not in registry.algorithm_options('fedembed_som')


def test_parse_converts_by_the_option_type():
  got = registry.parse_algorithm_options(
      'pfedme', ['lam=15', 'inner_steps=3', 'beta=0.5', 'head_layer=1',
                 'restart_personal_head=True'])
  assert got == {'lam': 15.0, 'inner_steps': 3, 'beta': 0.5,
                 'head_layer': '1', 'restart_personal_head': True}
  assert type(got['lam']) is float  # pylint: disable=unidiomatic-typecheck
  assert registry.parse_algorithm_options('pfedme', []) == {}
  # None where the default is None; not where it is a number.
  assert registry.parse_algorithm_options('pfedme', ['beta=None']) == {
      'beta': None}
  with pytest.raises(ValueError, match='lam=None must be of type float'):
    registry.parse_algorithm_options('pfedme', ['lam=None'])
  # FedRep's head_layer is Optional[str] (None: FedAvg); pFedMe's is not.
  assert registry.parse_algorithm_options('fedrep', ['head_layer=None']) == {
      'head_layer': None}
  with pytest.raises(ValueError, match='head_layer=None must be of type str'):
    registry.parse_algorithm_options('pfedme', ['head_layer=None'])


@pytest.mark.parametrize('items,message', [
    (['foo=1'], "pfedme has no option 'foo'; its options: beta (float"),
    (['lam=x'], "lam='x' must be of type float, got str"),
    (['inner_steps=2.5'], 'inner_steps=2.5 must be of type int, got float'),
    (['restart_personal_head=1'], 'must be of type bool, got int'),
    (['seed=3'], "'seed' is set by the experiment itself"),
    (['lam'], "'lam' is not key=value"),
    (['lam='], "'lam=' is not key=value"),
    (['lam=1', 'lam=2'], "'lam' given twice"),
])
def test_bad_options_are_named(items, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    registry.parse_algorithm_options('pfedme', items)


def test_unknown_algorithm_is_named():
  with pytest.raises(ValueError, match="unknown algorithm 'fedfoo'"):
    registry.algorithm_options('fedfoo')


def _shared_size(options, mnist_dir):
  if not FLAGS.is_parsed():
    FLAGS(['test'])
  with flagsaver.flagsaver(task='mnist_preference',
                           algorithm='fedembed_prototype', data_dir=mnist_dir,
                           num_users=20, clients_per_round=2, rounds=1,
                           algorithm_options=options):
    config, task_kwargs = common.configs_from_flags(FLAGS)
  assert config.algorithm_options == registry.parse_algorithm_options(
      'fedembed_prototype', options)
  task = task_registry.build_task('mnist_preference', **task_kwargs)
  weights = experiment.build_process(task, config).initialize()[0]
  return sum(int(np.size(w)) for w in weights.trainable)


def test_flag_reaches_the_builder(mnist_dir):
  """--algorithm_options=num_subpopulations=K builds FedEmbed with K heads
  (the task's 10 types by default; more heads may be asked for, fewer are
  refused, since the type head and the prototypes are indexed by type)."""
  default = _shared_size([], mnist_dir)
  assert _shared_size(['num_subpopulations=10'], mnist_dir) == default
  eleven = _shared_size(['num_subpopulations=11'], mnist_dir)
  per_head = _shared_size(['num_subpopulations=12'], mnist_dir) - eleven
  assert per_head > 0 and eleven - default == per_head
  with pytest.raises(ValueError, match="num_subpopulations=3 is smaller than "
                     "the task's 10 types"):
    _shared_size(['num_subpopulations=3'], mnist_dir)


def test_config_is_checked_before_work(tmp_path):
  config = experiment.ExperimentConfig(
      algorithm='fedrep', rounds=1, clients_per_round=1,
      root_output_dir=str(tmp_path), experiment_name='x',
      algorithm_options={'head_epochs': 'two'})
  with pytest.raises(ValueError, match="head_epochs='two' must be of type int"):
    experiment.validate(config, population=10)
  assert not list(tmp_path.iterdir())
