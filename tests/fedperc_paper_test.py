"""The FedPerC paper module: what its cells share is keyed by its flags."""

import collections
import json
import os
import types

import numpy as np
import pytest

from papers import fedperc as paper
from tasks import tv_shows_task
from tests import fedperc_testdata
from tff_personal.config import experiment
from tff_personal.core import runtime
from tff_personal.models import fedperc
from tff_personal.reports import curve_bands


def _flags(**overrides):
  values = dict(fedperc_backbone='preset', fedperc_rounds=3,
                fedperc_clients_per_round=2, fedperc_server_optimizer='sgd',
                fedperc_timing_repeats=5, data_dir=None, rounds=None,
                clients_per_round=None, num_users=None, seeds=1,
                other_flag=1)
  values.update(overrides)
  return types.SimpleNamespace(**values)


def test_trained_models_are_shared_only_under_the_same_flags(tmp_path):
  root = str(tmp_path)
  base = paper.trained_cache_dir(root, _flags())
  assert base.startswith(str(tmp_path / 'runs' / 'fedperc' / '_trained'))
  assert paper.trained_cache_dir(root, _flags()) == base
  # Flags of other papers or of the binary do not split the cache.
  assert paper.trained_cache_dir(root, _flags(other_flag=2, seeds=3)) == base
  for name, value in (('fedperc_rounds', 60), ('fedperc_backbone', 'other'),
                      ('fedperc_server_optimizer', 'adam'),
                      ('data_dir', '/elsewhere')):
    assert paper.trained_cache_dir(root, _flags(**{name: value})) != base, (
        name)


def _tiny_flags(rounds=2, clients=15):
  return _flags(fedperc_rounds=rounds, fedperc_clients_per_round=clients,
                fedperc_local_steps=2, fedperc_batch_size=3,
                fedperc_max_tokens=fedperc_testdata.MAX_TOKENS,
                fedperc_generator_tokens=4, fedperc_proximal_mu=1.0,
                fedperc_fine_tune_steps=2, fedperc_client_learning_rate=0.05,
                fedperc_server_learning_rate=1.0)


def _train(flags, root):
  """The trained run's weights, {user: private state} and `_curves`."""
  run = paper.trained_run(fedperc.EMBEDDING, flags, 0, root)
  with runtime.local_runtime():
    weights = run.weights()
    states = run.client_states(range(run.task.population))
  return dict(weights=weights, states={
      name: s['private'] for name, s in zip(run.task.client_names, states)},
              **paper._curves(run))


def test_training_is_the_registered_algorithm_on_the_one_path(
    tmp_path, monkeypatch):
  """`trained_run` is one run of the registered algorithm on the tv_shows task:
  its weights, private states and losses are those of the same process
  driven by hand over the task's rounds (full cohorts), read back from the
  run's checkpoint, store and metrics."""
  task = tv_shows_task.from_users(
      fedperc_testdata.spec(), fedperc_testdata.tv_show_users(),
      max_tokens=fedperc_testdata.MAX_TOKENS, local_steps=2, batch_size=3,
      generator_tokens=4, seed=0)
  monkeypatch.setattr(paper, 'task_of', lambda flag_values, seed: task)
  flags = _tiny_flags()
  trained = _train(flags, str(tmp_path))
  again = _train(flags, str(tmp_path))  # Read back.
  config = paper.train_config(fedperc.EMBEDDING, flags, 0, str(tmp_path))
  assert config.algorithm == 'fedperc'
  assert config.algorithm_options == {'proximal_mu': 1.0,
                                      'fine_tune_steps': 2}
  process = experiment.build_process(task, config)
  state = process.initialize()
  states = [collections.OrderedDict(
      private=process.initial_private, rounds_participated=np.int32(0))
            for _ in range(task.population)]
  losses = []
  for r in (1, 2):
    state, states, metrics = process.next(
        state, states, task.train_datasets(range(task.population), r))
    losses.append(float(metrics['train']['loss']))
  want = process.get_model_weights(state)
  initial = process.get_model_weights(process.initialize())
  for got in (trained, again):
    for x, y in zip(got['weights'].trainable, want.trainable, strict=True):
      np.testing.assert_allclose(x, np.asarray(y), rtol=1e-5, atol=1e-6)
    for x, y in zip(got['weights'].non_trainable, initial.non_trainable,
                    strict=True):  # The backbone stays frozen.
      np.testing.assert_array_equal(x, y)
    for name, s in zip(task.client_names, states, strict=True):
      for x, y in zip(got['states'][name], s['private'], strict=True):
        np.testing.assert_allclose(x, np.asarray(y), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got['train_loss'], losses, rtol=1e-5)
  assert any(not np.allclose(x, y) for x, y in zip(
      want.trainable, process.get_model_weights(
          process.initialize()).trainable))
  # Without curve points the run evaluates after its last round only; with
  # them it evaluates more often and trains exactly the same.
  assert trained['eval_curve']['round'] == [2]
  curved = _train(types.SimpleNamespace(**vars(flags), fedperc_curve_points=2),
                  str(tmp_path / 'curve'))
  assert curved['eval_curve']['round'] == [1, 2]
  assert curved['eval_curve']['perplexity'][-1] == (
      trained['eval_curve']['perplexity'][0])
  for x, y in zip(curved['weights'].trainable, trained['weights'].trainable,
                  strict=True):
    np.testing.assert_array_equal(x, y)
  assert curved['train_loss'] == trained['train_loss']


def test_curve_figures_band_each_variant_over_its_seeds(
    tmp_path, monkeypatch):
  root, f = str(tmp_path), _flags()
  cache = paper.trained_cache_dir(root, f)
  os.makedirs(cache)
  curve = lambda *p: {'round': [3, 6], 'perplexity': list(p)}
  for method, seed, loss, evals in (
      ('fedperc', 0, [5.0, 4.0], curve(90.0, 80.0)),
      ('fedperc', 1, [5.2, 4.4], curve(92.0, 81.0)),
      # Cached before the runs recorded curves: a loss curve only.
      ('split_learning', 0, [6.0, 5.5], None)):
    with open(os.path.join(cache, f'eval_{method}_seed{seed}.json'),
              'w') as fh:
      json.dump({'train_loss': loss, 'eval_curve': evals}, fh)
  drawn = []
  real = curve_bands.plot_seed_band
  monkeypatch.setattr(
      curve_bands, 'plot_seed_band', lambda ax, curves, *a, **k: drawn.append(
          (k['label'], curves)) or real(ax, curves, *a, **k))
  paths = paper.make_figures(root, f)
  assert [os.path.basename(p) for p in paths] == [
      'fedperc_train_loss.png', 'fedperc_eval_curves.png']
  assert all(os.path.exists(p) for p in paths)
  variant = {m: paper.fedperc_alg.algorithm(m).variant
             for m in ('fedperc', 'split_learning')}
  fedperc_label = f'{variant["fedperc"]} (fedperc, fedperc_frozen)'
  split_label = f'{variant["split_learning"]} (split_learning)'
  loss_drawn, eval_drawn = dict(drawn[:2]), dict(drawn[2:])
  assert [c['value'] for c in loss_drawn[fedperc_label]] == [[5.0, 4.0],
                                                             [5.2, 4.4]]
  assert loss_drawn[split_label] == [{'round': [1, 2], 'value': [6.0, 5.5]}]
  assert eval_drawn == {fedperc_label: [
      {'round': [3, 6], 'value': [90.0, 80.0]},
      {'round': [3, 6], 'value': [92.0, 81.0]}]}
  assert paper.make_figures(str(tmp_path / 'empty'), f) == []


def test_curve_points_set_the_evaluation_interval_not_the_cache_key(
    tmp_path):
  f = _flags(fedperc_rounds=60)
  assert paper.eval_every(f) == 0  # No flag: the last round only.
  for points, every in ((10, 6), (7, 8), (100, 1), (0, 0)):
    assert paper.eval_every(_flags(fedperc_rounds=60,
                                   fedperc_curve_points=points)) == every
  assert paper.trained_cache_dir(str(tmp_path), _flags(
      fedperc_curve_points=10)) == paper.trained_cache_dir(str(tmp_path),
                                                           _flags())
  with pytest.raises(ValueError, match='fedperc_curve_points'):
    paper.eval_every(_flags(fedperc_curve_points=-1))
