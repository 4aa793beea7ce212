"""`run_spec.RunSpec`: every config field has one place in it, a spec and
the binary's flags that say the same thing are the same run (same recorded
config, same digest), and overrides are checked by name and type."""

import dataclasses
import json

from absl import flags
from absl.testing import flagsaver
import pytest

from binaries import common
from binaries import train  # pylint: disable=unused-import  (defines the flags)
from tff_personal.config import experiment
from tff_personal.config import run_spec
from tff_personal.core import privacy
from tff_personal.records import run_records
from tff_personal.run import runs

FLAGS = flags.FLAGS


def test_every_config_field_has_one_place():
  config_fields = {f.name for f in dataclasses.fields(
      experiment.ExperimentConfig)} - {'algorithm', 'algorithm_options', 'dp'}
  mapped = list(run_spec.CONFIG_FIELDS.values())
  assert sorted(mapped) == sorted(config_fields)  # Each once, none missing.
  for section, field in run_spec.CONFIG_FIELDS:
    assert field in {f.name for f in dataclasses.fields(
        run_spec.SECTIONS[section])}, (section, field)
  # DP: the spec's fields, and what the run fills in from the loop/task.
  assert set(run_spec.DP_FIELDS) | {
      'clients_per_round', 'population', 'rounds', 'sampling'} == {
          f.name for f in dataclasses.fields(privacy.DPConfig)}


def _non_default(field, i):
  """A value of `field`'s type other than its default."""
  kind = field.type
  if 'bool' in kind:
    return not field.default
  if 'int' in kind:
    return 7 + i
  if 'float' in kind:
    return 0.25 + i
  if 'tuple' in kind:
    return ('ft=fine_tune(epochs=2)',)
  return {'sampling': 'poisson', 'client': 'sgd', 'server': 'adam',
          'mechanism': 'gaussian_fixed', 'personal_heads': 'noised',
          'client_state_backend': 'sqlite'}.get(field.name, f'v{i}')


def test_from_config_gives_config_back_for_every_field():
  sections = {}
  for name, kind in run_spec.SECTIONS.items():
    sections[name] = kind(**{f.name: _non_default(f, i) for i, f in
                             enumerate(dataclasses.fields(kind))})
  spec = run_spec.RunSpec(task='label_skew_mnist', algorithm='ditto',
                          algorithm_options={'lam': 2}, **sections)
  config = spec.config()
  for (section, field), config_field in run_spec.CONFIG_FIELDS.items():
    assert getattr(config, config_field) == getattr(
        getattr(spec, section), field), config_field
  assert config.algorithm_options == {'lam': 2.0}
  again = run_spec.RunSpec.from_config(config, 'label_skew_mnist')
  assert again == spec and again.config() == config


def test_the_binarys_flags_and_the_spec_are_the_same_run(tmp_path):
  """binaries.train's flags go through a RunSpec: the config they give
  and the one the equivalent spec gives record alike and have one
  digest."""
  if not FLAGS.is_parsed():
    FLAGS(['test'])
  with flagsaver.flagsaver(
      task='label_skew_mnist', algorithm='ditto', rounds=3,
      clients_per_round=4, num_users=40, root_output_dir=str(tmp_path),
      experiment_name='x', algorithm_options=['lam=0.5'],
      server_learning_rate=0.5, dp='gaussian_fixed', noise_multiplier=1.0,
      clip_norm=0.2, eval_every=2, seed=3):
    config, _ = common.configs_from_flags(FLAGS)
  spec = run_spec.RunSpec(
      task='label_skew_mnist', algorithm='ditto',
      algorithm_options={'lam': 0.5},
      loop=run_spec.Loop(rounds=3, clients_per_round=4, seed=3),
      optimizers=run_spec.Optimizers(server_learning_rate=0.5),
      privacy=run_spec.Privacy(mechanism='gaussian_fixed',
                               noise_multiplier=1, clip_norm=0.2),
      evaluation=run_spec.Evaluation(every=2),
      output=run_spec.Output(str(tmp_path), 'x'))
  from_spec = spec.config()
  # The defaults the binary applies per (task, algorithm) aside.
  from_spec = dataclasses.replace(from_spec, **{
      f.name: getattr(config, f.name)
      for f in dataclasses.fields(config)
      if f.name in ('client_learning_rate', 'client_optimizer',
                    'keep_checkpoints')})
  record = lambda c: run_records.run_record(
      c, experiment.validate(c, 40), None, {'name': 'label_skew_mnist'})
  assert record(from_spec) == record(config)
  assert runs.digest(record(from_spec)) == runs.digest(record(config))
  other = spec.override({'algorithm_options.lam': 0.6}).config()
  assert runs.digest(record(other)) != runs.digest(record(config))


@pytest.mark.parametrize('changes,message', [
    ({'loop.roundz': 3}, "loop has no field 'roundz'; its fields: "
     "['rounds'"),
    ({'loop.rounds': 2.5}, 'loop.rounds=2.5 must be of type int'),
    ({'algorithm_options.foo': 1}, "ditto has no option 'foo'"),
    ({'algorithm_options.lam': 'x'}, "lam='x' must be of type float"),
    ({'task_options.alpha': 'x'}, "alpha='x' must be of type float"),
    ({'privacy.mechanism': 'laplace'}, 'privacy.mechanism must be one of'),
    ({'rounds': 3}, 'rounds: not a run spec setting'),
    ({'task': 'nosuch'}, 'nosuch'),
])
def test_overrides_are_checked_by_name_and_type(changes, message):
  base = run_spec.RunSpec(task='label_skew_mnist', algorithm='ditto')
  with pytest.raises(ValueError, match=message.replace('[', r'\[')
                     .replace('(', r'\(')):
    base.override(changes)


def test_override_changes_only_what_it_names():
  base = run_spec.RunSpec(task='label_skew_mnist', algorithm='ditto',
                          task_options={'alpha': 0.1},
                          loop=run_spec.Loop(rounds=5))
  cell = base.override({'loop.seed': 2, 'task_options.num_clients': 30,
                        'privacy.noise_multiplier': 1})
  assert cell.loop == dataclasses.replace(base.loop, seed=2)
  assert cell.task_options == {'alpha': 0.1, 'num_clients': 30}
  assert cell.privacy.noise_multiplier == 1.0  # Typed: a float.
  assert base.loop.seed == 0 and base.task_options == {'alpha': 0.1}
  # A new algorithm keeps options only when they are its own.
  with pytest.raises(ValueError, match="global has no option 'lam'"):
    base.override({'algorithm_options.lam': 1.0, 'algorithm': 'global'})


def test_the_binary_runs_a_spec_file_as_stated(tmp_path):
  """`--spec=FILE` gives the spec's own config and task arguments; a run
  flag beside it, or a file that is not a spec, is an error naming it."""
  if not FLAGS.is_parsed():
    FLAGS(['test'])
  spec = run_spec.RunSpec(
      task='label_skew_mnist', algorithm='ditto',
      task_options={'alpha': 0.1, 'num_clients': 20},
      algorithm_options={'lam': 0.5},
      loop=run_spec.Loop(rounds=3, clients_per_round=4, seed=2),
      privacy=run_spec.Privacy(mechanism='gaussian_fixed',
                               noise_multiplier=0.8, clip_norm=0.3),
      evaluation=run_spec.Evaluation(strategies=('ft=fine_tune(epochs=2)',)),
      output=run_spec.Output(str(tmp_path), 'from_spec'))
  path = tmp_path / 'spec.json'
  path.write_text(json.dumps(spec.to_dict()))
  with flagsaver.flagsaver(spec=str(path), data_dir='/data'):
    config, task_kwargs = common.configs_from_flags(FLAGS)
  assert config == spec.config()
  assert task_kwargs == {'data_dir': '/data', 'seed': 2, 'alpha': 0.1,
                         'num_clients': 20}
  with flagsaver.flagsaver(spec=str(path), rounds=5):
    with pytest.raises(ValueError, match='--rounds given beside it'):
      common.configs_from_flags(FLAGS)
  path.write_text('{"task": "label_skew_mnist", "algorithm": "ditto", '
                  '"loop": {"roundz": 3}}')
  with flagsaver.flagsaver(spec=str(path)):
    with pytest.raises(ValueError, match="loop has no field 'roundz'"):
      common.configs_from_flags(FLAGS)
  path.write_text('{"task": ')
  with flagsaver.flagsaver(spec=str(path)):
    with pytest.raises(ValueError, match=f'{path} is not valid JSON'):
      common.configs_from_flags(FLAGS)
