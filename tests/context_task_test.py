"""Context tasks from a table, and withheld users evaluated as new users."""

import dataclasses
import json

from absl import flags
from absl.testing import flagsaver
import numpy as np
import pytest

from binaries import evaluate
from binaries import train
from tasks import context_task
from tasks import tv_shows_task
from tests import fedperc_testdata
from tff_personal.algorithms import fedperc as fedperc_alg
from tff_personal.config import experiment
from tff_personal.config import strategies
from tff_personal.core import evaluation
from tff_personal.core import new_users
from tff_personal.core import process as process_lib
from tff_personal.evaluation import run_evaluation
from tff_personal.models import fedperc as fedperc_model
from tff_personal.models import fedperc_backbone
from tff_personal.run import runs

FLAGS = flags.FLAGS

# (play, speaker, number of speeches): 'b/X' is the biggest user; the same
# name in two plays is two users.
_SPEAKERS = (('a', 'X', 3), ('a', 'Y', 6), ('b', 'X', 9), ('b', 'Z', 5),
             ('c', 'W', 8), ('c', 'V', 7), ('a', 'U', 4))


def _write_table(path, rows=_SPEAKERS):
  lines = ['play\tspeaker\ttext']
  for play, speaker, n in rows:
    for i in range(n):
      text = ' '.join(fedperc_testdata.TEXTS[(i + j) % 8] for j in range(2))
      lines.append(f'{play}\t{speaker}\t{text}')
  path.write_text('\n'.join(lines) + '\n')


@pytest.fixture(scope='module')
def preset(tmp_path_factory):
  """The tiny random backbone as a preset directory."""
  spec = fedperc_testdata.spec()
  path = str(tmp_path_factory.mktemp('backbone') / 'preset')
  fedperc_backbone.write_random_preset(
      spec.vocabulary, spec.merges, path, hidden_dim=fedperc_testdata.HIDDEN,
      num_heads=2, intermediate_dim=16,
      max_sequence_length=fedperc_testdata.MAX_TOKENS + 2, seed=2)
  return path


def _table_options(**overrides):
  return dict(dict(path='t.tsv', user_column='play+speaker',
                   context_column='play', max_users=6, withheld_users=2,
                   max_tokens=fedperc_testdata.MAX_TOKENS, max_utterances=0,
                   local_steps=2, batch_size=3, generator_tokens=4,
                   allow_random_backbone=True), **overrides)


def test_table_task_takes_its_users_contexts_and_withheld_users_from_options(
    tmp_path, preset):
  _write_table(tmp_path / 't.tsv')
  task = context_task.context_table_task(str(tmp_path), backbone=preset,
                                         **_table_options())
  # The six biggest users; two withheld at evenly spaced ranks (1 and 4 of
  # b/X c/W c/V a/Y b/Z a/U); contexts are the kept users' plays.
  assert task.client_names == ['b/X', 'c/V', 'a/Y', 'a/U']
  assert task.withheld_names == ['c/W', 'b/Z']
  assert task.contexts == ('a', 'b', 'c')
  assert task.users['c/W'].context == 2
  # A withheld user: its first k fine-tuning utterances, then every test one.
  split = task.users['b/Z'].splits
  for samples, tuned in ((1, 1), (None, len(split['fine_tune']['ids']))):
    (data,) = task.withheld_eval_datasets([1], samples)
    batch = data.unbatch().batch(100).get_single_element()
    roles = batch[fedperc_model.ROLE].numpy()
    assert list(roles) == [0] * tuned + [1] * len(split['test']['ids'])
    np.testing.assert_array_equal(batch['ids'].numpy()[:tuned],
                                  split['fine_tune']['ids'][:tuned])
  with pytest.raises(ValueError, match='withheld user index 2'):
    task.withheld_eval_datasets([2])
  with pytest.raises(context_task.TableError, match="no column 'who'"):
    context_task.context_table_task(str(tmp_path), backbone=preset,
                                    **_table_options(user_column='who'))
  # A name in two plays is one user only if the play is not in its name.
  with pytest.raises(context_task.TableError,
                     match="user 'X' has rows in contexts 'a' and 'b'"):
    context_task.context_table_task(str(tmp_path), backbone=preset,
                                    **_table_options(user_column='speaker'))
  (tmp_path / 'short.tsv').write_text('play\tspeaker\ttext\na\tX\n')
  with pytest.raises(context_task.TableError,
                     match='line 2: fewer columns than its header'):
    context_task.context_table_task(str(tmp_path), backbone=preset,
                                    **_table_options(path='short.tsv'))
  with pytest.raises(ValueError, match='must leave users to train'):
    context_task.context_table_task(str(tmp_path), backbone=preset,
                                    **_table_options(withheld_users=6))


def _tiny_tv_task():
  return tv_shows_task.from_users(
      fedperc_testdata.spec(), fedperc_testdata.tv_show_users(),
      max_tokens=fedperc_testdata.MAX_TOKENS, local_steps=2, batch_size=3,
      generator_tokens=4, seed=0)


def _perplexity_from(run, task, private, samples):
  """The withheld users' pooled perplexity, each started from `private`,
  by hand: the run's evaluation model on their first `samples`."""
  proc = run.process()
  weights = run.weights()
  state = process_lib.eval_client_states(
      proc, weights, [run.client_states([0])[0]])[0]
  state['private'] = private
  ids = list(range(len(task.withheld_names)))
  personal_eval = evaluation.build_personal_eval(
      proc.eval_model_fn, proc.model_weights_type,
      proc.eval_client_state_type)
  outputs = personal_eval(weights, [state] * len(ids),
                          task.withheld_eval_datasets(ids, samples))
  return task.evaluate(outputs, ids)['perplexity']


def test_new_users_start_from_the_seeded_dp_average(tmp_path):
  """The dp_average start is the clipped mean of the trained users' states
  plus noise drawn from the run's seed: the run reopened evaluates its
  withheld users to the same numbers, and the release's epsilon is
  stated."""
  task = _tiny_tv_task()
  config = experiment.ExperimentConfig(
      algorithm='fedperc', rounds=2, clients_per_round=4,
      root_output_dir=str(tmp_path), experiment_name='run',
      client_learning_rate=0.05, eval_clients=4, seed=5)
  runs.run_experiment(task, config, log_fn=lambda s: None)
  run = runs.Run.open(config.experiment_dir, task=task)
  exact = run.evaluate(strategies={'new': strategies.ColdStart(
      samples=(1, 'all'), start='dp_average', noise_multiplier=0.0,
      clip_norm=1e6)})['strategies']['new']
  states = [s for s in run.client_states(range(task.population))
            if s['rounds_participated'] > 0]
  assert exact['dp_average']['users'] == len(states) < task.population
  mean = tuple(np.mean([np.asarray(s['private'][i]) for s in states], 0)
               for i in range(len(states[0]['private'])))
  for samples in (1, 'all'):
    assert exact['samples'][str(samples)]['perplexity'] == pytest.approx(
        _perplexity_from(run, task, mean,
                         None if samples == 'all' else samples), rel=1e-5)
  assert exact['samples']['1'] != exact['samples']['all']

  noisy = ['cold_start(start=dp_average)']  # As text: the same strategy.
  first = run.evaluate(strategies=noisy)['strategies']['cold_start']
  again = runs.Run.open(config.experiment_dir, task=task).evaluate(
      strategies=noisy)['strategies']['cold_start']
  assert first['samples'] == again['samples']  # Same seed, same draw.
  assert first['samples'] != exact['samples']['all']
  clip = fedperc_alg.DP_CLIP_NORMS['embedding']
  assert first['dp_average']['clip_norm'] == clip
  assert first['dp_average']['epsilon'] == pytest.approx(
      new_users.dp_mean_epsilon(1.0, 1e-5))
  initial = run.evaluate(strategies={'new': strategies.ColdStart()})[
      'strategies']['new']
  zero = tuple(np.zeros_like(m) for m in mean)
  assert initial['samples']['all']['perplexity'] == pytest.approx(
      _perplexity_from(run, task, zero, None), rel=1e-5)

  # The known users, adapted on their first k samples (`adapt`): by hand
  # for k=1; all of them for a k past every user's count, as `none`; none
  # of them for k=0, as fedperc_frozen (no test-time adaptation) scores
  # the same run.
  known = run.evaluate(strategies=[
      'none', 'a1=adapt(samples=1)', 'every=adapt(samples=1000000)',
      'a0=adapt(samples=0)'])['strategies']
  ids = run_evaluation.eval_client_ids(task.population, 4, 5)
  proc, weights = run.process(), run.weights()
  personal_eval = evaluation.build_personal_eval(
      proc.eval_model_fn, proc.model_weights_type,
      proc.eval_client_state_type)
  outputs = personal_eval(
      weights, process_lib.eval_client_states(proc, weights,
                                              run.client_states(ids)),
      task.eval_datasets(ids, samples=1))
  assert known['a1']['eval']['perplexity'] == pytest.approx(
      task.evaluate(outputs, ids)['perplexity'], rel=1e-5)
  assert known['every']['eval']['perplexity'] == pytest.approx(
      known['none']['eval']['perplexity'], rel=1e-6)
  frozen = experiment.build_process(task, dataclasses.replace(
      config, algorithm='fedperc_frozen'))
  outputs = evaluation.build_personal_eval(
      frozen.eval_model_fn, frozen.model_weights_type,
      frozen.eval_client_state_type)(
          weights, process_lib.eval_client_states(frozen, weights,
                                                  run.client_states(ids)),
          task.eval_datasets(ids))
  assert known['a0']['eval']['perplexity'] == pytest.approx(
      task.evaluate(outputs, ids)['perplexity'], rel=1e-5)
  assert abs(known['a0']['eval']['perplexity'] -
             known['a1']['eval']['perplexity']) > 1e-3
  assert abs(known['a1']['eval']['perplexity'] -
             known['none']['eval']['perplexity']) > 1e-3


def test_context_table_trains_from_the_binary_and_evaluates_new_users(
    tmp_path, preset, capsys):
  """binaries.train --task=context_table with DP, then binaries.evaluate
  --run_dir with the dp_average start at 1 and all samples."""
  _write_table(tmp_path / 't.tsv')
  if not FLAGS.is_parsed():
    FLAGS(['train'])
  options = _table_options(backbone=preset)
  with flagsaver.flagsaver(
      task='context_table', algorithm='fedperc_generated',
      data_dir=str(tmp_path),
      task_options=[f'{k}={v}' for k, v in options.items()],
      rounds=2, clients_per_round=2, dp='gaussian_fixed',
      noise_multiplier=1.0, root_output_dir=str(tmp_path / 'out'),
      experiment_name='run', client_optimizer='adam',
      client_learning_rate=0.01, eval_clients=0):
    assert train.main(['train']) == 0
  capsys.readouterr()
  with flagsaver.flagsaver(run_dir=str(tmp_path / 'out' / 'run'),
                           eval_name='new_users',
                           eval_strategies=[
                               'new=cold_start(start=dp_average,'
                               'samples=1/all)']):
    assert evaluate.main(['evaluate']) == 0
  with open(tmp_path / 'out' / 'run' / 'evaluations' / 'new_users.json') as f:
    record = json.load(f)
  got = record['strategies']['new']
  assert got['users'] == 2 and set(got['samples']) == {'1', 'all'}
  assert all(np.isfinite(m['perplexity']) for m in got['samples'].values())
  assert got['dp_average']['clip_norm'] == fedperc_alg.DP_CLIP_NORMS[
      'generated']
  # The run's delta is the release's; its epsilon is stated apart from the
  # run's own.
  assert got['dp_average']['delta'] == record['privacy']['delta']
  assert record['privacy']['epsilon'] > 0
  assert [r['covered'] for r in record['privacy']['released']
          if r['name'] == 'new-user DP average (strategy new)'] == [False]
  with flagsaver.flagsaver(run_dir=str(tmp_path / 'out' / 'run'),
                           eval_strategies=['cold_start(samples=-1)']):
    assert evaluate.main(['evaluate']) == 2
  assert 'samples must be ints >= 0' in capsys.readouterr().err
