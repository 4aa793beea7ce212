"""Named personalization strategies (`tff_personal/config/strategies.py`).

One small Ditto run evaluates four strategies at every evaluation. The
default fine-tuning equals the run's own `eval_fine_tune` evaluation;
fine-tuning at a vanishing learning rate equals no fine-tuning; more epochs
move the result; the reopened run evaluates its recorded strategies to the
same numbers; never-trained clients are counted in every strategy's result.
"""

import collections
import os

import numpy as np
import pytest
import tensorflow as tf

from tasks import client_data_task
from tests import tiny_client_data
from tff_personal.config import experiment
from tff_personal.config import strategies
from tff_personal.core import client_data as client_data_lib
from tff_personal.core import runtime
from tff_personal.core import training_loop
from tff_personal.evaluation import run_evaluation
from tff_personal.run import runs

_CLIENTS = [f'c{k}' for k in range(8)]






_STRATEGIES = ('none', 'ft=fine_tune', 'ft2=fine_tune(epochs=2)',
               'still=fine_tune(learning_rate=1e-12,optimizer=sgd)')


@pytest.fixture(scope='module')
def run(tmp_path_factory):
  task = client_data_task.ClientDataTask(
      'strategies', tiny_client_data.client_data(0),
      tiny_client_data.client_data(1),
      model_builder=client_data_task.keras_classifier(
          lambda: tf.keras.Sequential([tf.keras.layers.Input(shape=(4,)),
                                       tf.keras.layers.Dense(2)])),
      batch_size=4, evaluate_fn=tiny_client_data.mean_loss)
  config = experiment.ExperimentConfig(
      algorithm='ditto', rounds=2, clients_per_round=2, eval_every=1,
      root_output_dir=str(tmp_path_factory.mktemp('strategies')),
      experiment_name='run', client_optimizer='sgd',
      client_learning_rate=0.5, eval_strategies=_STRATEGIES, seed=3)
  with runtime.local_runtime():
    runs.run_experiment(task, config, log_fn=lambda s: None)
    opened = runs.Run.open(config.experiment_dir, task=task)
    yield opened


def test_strategies_equal_the_evaluations_they_name(run):
  got = run.summary['strategies']
  assert set(got) == {'none', 'ft', 'ft2', 'still'}
  assert got['ft2']['strategy'] == 'fine_tune(epochs=2)'
  loss = {name: r['eval']['loss'] for name, r in got.items()}
  # `none` is the run's own evaluation; `fine_tune` is eval_fine_tune's.
  assert loss['none'] == pytest.approx(run.summary['eval']['loss'],
                                       rel=1e-6)
  fine_tuned = run.evaluate(eval_fine_tune=True)
  assert loss['ft'] == pytest.approx(fine_tuned['eval']['loss'], rel=1e-6)
  # A vanishing step changes nothing; a second pass moves further.
  assert loss['still'] == pytest.approx(loss['none'], rel=1e-6)
  assert abs(loss['ft'] - loss['none']) > 1e-4
  assert abs(loss['ft2'] - loss['ft']) > 1e-4
  # Every result counts the evaluated clients that never trained (2 rounds
  # of 2 from 8 clients leave at least 4), and reports them apart.
  states = run.client_states(range(len(_CLIENTS)))
  never = sum(int(s['rounds_participated']) == 0 for s in states)
  assert never >= 4
  for r in got.values():
    assert r['eval']['never_trained_clients'] == never
    assert 'trained/loss' in r['eval'] and 'never_trained/loss' in r['eval']


def test_the_curve_and_the_reopened_run_carry_every_strategy(run):
  rows = training_loop.read_metrics(
      f'{run.directory}/eval_metrics.csv')
  assert [int(r['round']) for r in rows] == [1, 2]
  for name in ('none', 'ft', 'ft2', 'still'):
    assert all(f'strategies/{name}/loss' in r for r in rows)
  last = rows[-1]
  assert float(last['strategies/ft2/loss']) == pytest.approx(
      run.summary['strategies']['ft2']['eval']['loss'], rel=1e-5)
  # Evaluated again from the record alone: the same numbers.
  again = run.evaluate()['strategies']
  for name, r in run.summary['strategies'].items():
    assert again[name]['eval']['loss'] == pytest.approx(r['eval']['loss'],
                                                        rel=1e-6)
  only = run.evaluate(strategies={'ft3': strategies.FineTune(epochs=3)})
  assert set(only['strategies']) == {'ft3'}
  with pytest.raises(run_evaluation.EvaluationError,
                     match='no adaptation samples'):
    run.evaluate(strategies=['adapt(samples=1)'])


def test_strategies_a_run_cannot_take_are_refused_before_it_starts(
    run, tmp_path):
  for algorithm, text, named in (
      ('ditto', 'adapt(samples=1)', 'no adaptation samples'),
      ('ditto', 'cold_start', 'no withheld users')):
    config = experiment.ExperimentConfig(
        algorithm=algorithm, rounds=1, clients_per_round=2,
        root_output_dir=str(tmp_path), experiment_name=algorithm,
        eval_strategies=(text,))
    with pytest.raises(experiment.ConfigurationError, match=named):
      runs.run_experiment(run.task, config, log_fn=lambda s: None)
    assert not os.path.exists(os.path.join(config.experiment_dir,
                                           'run_config.json'))


def test_fine_tune_of_fedavg_is_fedavg_ft_and_client_outputs_pool_to_it(
    run, tmp_path):
  """FedAvg's clients hold no private variables: `fine_tune` tunes a copy of
  the whole global model, which is FedAvg+FT's evaluation (the two train
  the same model). `client_outputs` pools to the run's metrics."""
  results = {}
  with runtime.local_runtime():
    for algorithm, text in (('global', 'ft=fine_tune(epochs=2)'),
                            ('fedavg_ft', 'none')):
      config = experiment.ExperimentConfig(
          algorithm=algorithm, rounds=3, clients_per_round=2, eval_every=1,
          root_output_dir=str(tmp_path), experiment_name=algorithm,
          client_optimizer='sgd', client_learning_rate=0.5, seed=3,
          eval_strategies=(text,))
      results[algorithm] = runs.run_experiment(run.task, config,
                                               log_fn=lambda s: None)
    fedavg_ft = runs.Run.open(results['fedavg_ft'].directory, task=run.task)
    ids = [1, 4, 6]
    twice = fedavg_ft.client_outputs(ids, 'fine_tune(epochs=2)')
    tuned = results['global'].client_outputs(ids, 'fine_tune(epochs=2)')
    plain = results['global'].client_outputs(ids)
  # fine_tune(epochs=2) of FedAvg = FedAvg+FT's fine-tuning, twice.
  for a, b in zip(tuned, twice):
    np.testing.assert_allclose(a['outputs'], b['outputs'], rtol=1e-5)
  assert not np.allclose(tuned[0]['outputs'], plain[0]['outputs'])
  # Per-client outputs pool to the run's own metrics, at any kept round
  # (its client states kept with each checkpoint).
  everyone = list(range(len(_CLIENTS)))
  curve = {int(r['round']): r for r in results['global'].curves()['eval']}
  with runtime.local_runtime():
    for round_num in (1, 3):
      pooled = run.task.evaluate(results['global'].client_outputs(
          everyone, 'ft=fine_tune(epochs=2)', round=round_num), everyone)
      assert pooled['loss'] == pytest.approx(
          float(curve[round_num]['strategies/ft/loss']), rel=1e-5)
  assert fedavg_ft['eval']['loss'] != pytest.approx(
      results['global']['eval']['loss'], rel=1e-4)


def test_fine_tune_steps_equal_the_passes_they_count(run):
  # 12 training examples a client in batches of 4: a pass is 3 steps.
  got = run.evaluate(strategies=[
      'ft=fine_tune', 'ft2=fine_tune(epochs=2)', 's3=fine_tune(steps=3)',
      's6=fine_tune(steps=6)', 's1=fine_tune(steps=1)',
      'whole=fine_tune(batch_size=12)',
      'one=fine_tune(steps=1,batch_size=12)',
      'two=fine_tune(steps=2,batch_size=12)'])['strategies']
  loss = {name: r['eval']['loss'] for name, r in got.items()}
  assert loss['s3'] == pytest.approx(loss['ft'], rel=1e-6)
  assert loss['s6'] == pytest.approx(loss['ft2'], rel=1e-6)
  assert loss['one'] == pytest.approx(loss['whole'], rel=1e-6)
  for a, b in (('s1', 'ft'), ('one', 's1'), ('two', 'one')):
    assert abs(loss[a] - loss[b]) > 1e-5, (a, b)
  assert got['one']['strategy'] == 'fine_tune(steps=1,batch_size=12)'


def test_fine_tune_data_cuts_batches_and_steps_alike_in_both_forms():
  examples = collections.OrderedDict(
      x=np.arange(5, dtype=np.float32)[:, None], y=np.arange(5, dtype=np.int32))
  spec = collections.OrderedDict(x=tf.TensorSpec([None, 1], tf.float32),
                                 y=tf.TensorSpec([None], tf.int32))
  order = np.array([3, 0, 4, 1, 2])
  batches = client_data_lib.ClientBatches.from_arrays(examples, 2, [order],
                                                      spec)
  dataset = tf.data.Dataset.from_tensor_slices(collections.OrderedDict(
      x=examples['x'][order], y=examples['y'][order])).batch(2)
  for tune, want in (
      (strategies.FineTune(), [[3, 0], [4, 1], [2]]),
      (strategies.FineTune(epochs=2), [[3, 0], [4, 1], [2]] * 2),
      (strategies.FineTune(steps=4), [[3, 0], [4, 1], [2], [3, 0]]),
      (strategies.FineTune(steps=3, batch_size=3), [[3, 0, 4], [1, 2],
                                                    [3, 0, 4]]),
      (strategies.FineTune(batch_size=5), [[3, 0, 4, 1, 2]])):
    cut, = run_evaluation.fine_tune_data([batches], tune)
    assert [list(b) for b in cut.index_batches] == want, tune
    from_dataset, = run_evaluation.fine_tune_data([dataset], tune)
    assert [list(b['y'].numpy()) for b in from_dataset] == want, tune
  empty = tf.data.Dataset.from_tensor_slices(collections.OrderedDict(
      x=np.zeros([0, 1], np.float32), y=np.zeros([0], np.int32))).batch(2)
  cut, = run_evaluation.fine_tune_data([empty], strategies.FineTune(steps=3))
  assert not list(cut)


def test_strategy_texts_round_trip_and_bad_ones_are_named():
  for text in ('none', 'fine_tune(epochs=3,learning_rate=0.01,optimizer=sgd)',
               'fine_tune(learning_rate=0.01,optimizer=sgd,steps=1,'
               'batch_size=10)',
               'adapt(samples=5)',
               'cold_start(samples=1/5/all,start=dp_average,clip_norm=2.0)'):
    name, strategy = strategies.parse(text)
    assert strategies.parse(strategies.to_text(strategy)) == (name, strategy)
  assert strategies.parse('ft3=fine_tune(epochs=3)') == (
      'ft3', strategies.FineTune(epochs=3))
  for text, named in (('fine_tun', 'unknown kind'),
                      ('fine_tune(epoch=3)', 'epoch=3'),
                      ('fine_tune(epochs=0)', 'epochs'),
                      ('fine_tune(steps=0)', 'steps'),
                      ('fine_tune(batch_size=0)', 'batch_size'),
                      ('fine_tune(epochs=2,steps=1)', 'not both'),
                      ('fine_tune(optimizer=sgd)', 'learning_rate'),
                      ('cold_start(start=zero)', 'start'),
                      ('cold_start(samples=-1/all)', 'samples'),
                      ('adapt(samples=-1)', 'samples')):
    with pytest.raises(ValueError, match=named):
      strategies.parse(text)
  with pytest.raises(ValueError, match='given twice'):
    strategies.resolve(['fine_tune', 'fine_tune(epochs=2)'])
  config = experiment.ExperimentConfig(
      algorithm='fedavg', rounds=1, clients_per_round=1, root_output_dir='/x',
      experiment_name='y', eval_strategies=('fine_tune(epochs=-1)',))
  with pytest.raises(ValueError, match='eval_strategies'):
    experiment.check_values(config)
