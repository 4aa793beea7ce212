"""GroupFL and GroupPerFL on the one run path (a per-group last stage).

The one path (`runs.run_experiment` with `groupfl` / `groupperfl`,
`core/stages.Stage(per_group=True)`) must equal the paper's algorithms driven
by hand with `algorithms/group_fl`'s building blocks: FedAvg over everyone,
then per group FedAvg from the FL model with a fresh server optimizer and
cohorts among the group's clients, each client evaluated on its group's model
(after fine-tuning it, for GroupPerFL). Also: per-group DP accounting
against dp_accounting directly, resume, and the refusals.
"""

import collections
import dataclasses
import json
import os

import dp_accounting
from dp_accounting import rdp
import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tasks import shakespeare_groups as sg
from tasks import speaker_context_io
from tests import group_reference
from tff_personal.algorithms import fedavg
from tff_personal.algorithms import group_fl
from tff_personal.config import experiment
from tff_personal.config import strategies
from tff_personal.core import privacy
from tff_personal.core import stages
from tff_personal.core import task as task_lib
from tff_personal.core import training_loop
from tff_personal.models import word_lm
from tff_personal.records import run_records
from tff_personal.run import runs
from tff_personal.run import training

_WORDS = {
    sg.COMEDY: ('midsummer', 'merry jest fool love wedding laugh'),
    sg.TRAGEDY: ('hamlet', 'blood death murder grave poison dagger'),
    sg.HISTORY: ('henryv', 'king crown war england france battle'),
}
# Clients per genre: unequal, so the groups' privacy differs.
_SIZES = {sg.COMEDY: 3, sg.TRAGEDY: 4, sg.HISTORY: 5}
_LR, _SERVER_LR, _SEED = 0.5, 0.05, 1


def _task(seed=0):
  rng = np.random.default_rng(seed)
  speeches = []
  for genre, (play, words) in _WORDS.items():
    for i in range(_SIZES[genre]):
      for _ in range((1, 4, 6)[i % 3]):
        speeches.append(speaker_context_io.Utterance(
            f'shakespeare/{play}/C{i}', play,
            ' '.join(rng.choice(words.split(), 5)) + ' .'))
  return sg.build_task(speeches, vocab_size=30, seq_len=8, embedding_dim=4,
                       lstm_units=4, batch_size=2, seed=seed)


def _config(tmp_path, algorithm, name, rounds=2, options=None, **kwargs):
  return experiment.ExperimentConfig(
      algorithm=algorithm, rounds=rounds, clients_per_round=2,
      root_output_dir=str(tmp_path), experiment_name=name,
      client_optimizer='sgd', client_learning_rate=_LR,
      server_optimizer='adam', server_learning_rate=_SERVER_LR,
      algorithm_options={'fl_rounds': 2, **(options or {})},
      simulation_shards=0, seed=_SEED, **kwargs)


def _run(task, config):
  return runs.run_experiment(task, config, log_fn=lambda s: None)


def _close(a, b, rtol=1e-6):
  for x, y in zip(tf.nest.flatten(a), tf.nest.flatten(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol,
                               atol=1e-7)


def _rounds_by_hand(process, state, clients, train_fn, rounds):
  """FedAvg rounds driven by hand: cohorts of 2 drawn among `clients` by
  `training_loop.sample_clients`, rounds numbered from 1 (as the loop does,
  so the cohorts and local shuffles are the same)."""
  for r in range(1, rounds + 1):
    cohort = [clients[i] for i in training_loop.sample_clients(
        len(clients), 2, r, _SEED)]
    states = [collections.OrderedDict(private=(),
                                      rounds_participated=np.int32(0))
              for _ in cohort]
    state, _, _ = process.next(state, states,
                               [train_fn(c, r) for c in cohort])
  return state


def _by_hand(task, rounds=2):
  """The paper's Algorithms 1 and 2 by hand: FedAvg over everyone, then per
  group FedAvg from the FL model with a fresh server optimizer (a new
  `initialize()`), among the group's clients. Returns (FL process,
  {group: its model})."""
  fl = fedavg.build_global(
      task.model_fn_factory,
      client_optimizer=tff.learning.optimizers.build_sgdm(_LR),
      server_optimizer=fedavg.adam(_SERVER_LR), seed=_SEED,
      metrics_fn=task.metrics_fn)
  train_fn = lambda c, r: task.train_dataset(c, 1, r)
  state = _rounds_by_hand(fl, fl.initialize(), list(range(task.population)),
                          train_fn, 2)
  fl_weights = fl.get_model_weights(state)
  models = {}
  for g in task.group_names:
    start = fl.set_model_weights(fl.initialize(), fl_weights)
    end = _rounds_by_hand(fl, start, task.clients_of(g), train_fn, rounds)
    models[g] = fl.get_model_weights(end)
  return fl, models


def _perplexities(task, sums):
  out = {f'perplexity/{g}': group_fl.perplexity(
      [sums[c] for c in task.clients_of(g)]) for g in task.group_names}
  out['perplexity'] = group_fl.perplexity(list(sums.values()))
  return out


def test_groupfl_and_groupperfl_equal_the_paper_driven_by_hand(tmp_path):
  task = _task()
  # Identified (as a task built by name is): runs under one root share the
  # FL stage.
  task_lib.set_build_record(task, 'tiny_genres', {'seed': 0})
  requests = []  # Training data asked for, call by call.
  train_datasets = task.train_datasets
  task.train_datasets = lambda ids, r: (requests.append(list(ids)),
                                        train_datasets(ids, r))[1]
  summary = _run(task, _config(tmp_path, 'groupfl', 'groupfl'))
  # Two FL rounds over everyone, then each group's two rounds ask for its
  # own clients' data only.
  groups = len(task.group_names)
  assert len(requests) == 2 + 2 * groups
  for i, g in enumerate(task.group_names):
    for ids in requests[2 + 2 * i:4 + 2 * i]:
      assert set(ids) <= set(task.clients_of(g)), (g, ids)
  # The rounds each client trained in, as the handle replays them, are
  # those its data was asked for: FL's two rounds, then its group's.
  counted = lambda calls: dict(sorted(collections.Counter(
      int(c) for ids in calls for c in ids).items()))
  groupfl = runs.Run.open(_config(tmp_path, 'groupfl', 'groupfl'
                                  ).experiment_dir, task=task)
  assert groupfl.participations(stage='fl') == counted(requests[:2])
  assert groupfl.participations() == counted(requests[2:])
  # GroupPerFL and the shuffled control train no FL round: they continue
  # from the FL stage GroupFL trained (the hand-driven checks below hold
  # GroupPerFL to the paper's algorithm from that stage).
  personal = _run(task, _config(
      tmp_path, 'groupperfl', 'groupperfl',
      options={'personalization_lr': 0.3},
      eval_strategies=('lr05=fine_tune(learning_rate=0.5,optimizer=sgd)',)))
  _run(task, _config(tmp_path, 'groupfl', 'shuffled',
                     options={'grouping': 'shuffled'}))
  # Each run's group rounds, and GroupPerFL's evaluation, which fine-tunes
  # each group's evaluated clients on their own data (one call per group),
  # as does its strategy.
  assert len(requests) == 2 + 3 * 2 * groups + 2 * groups
  del task.train_datasets
  links = {os.path.realpath(experiment.stage_directory(
      _config(tmp_path, 'groupfl', name), 'fl'))
           for name in ('groupfl', 'groupperfl', 'shuffled')}
  assert len(links) == 1 and os.path.dirname(links.pop()) == os.path.join(
      os.path.realpath(tmp_path), training.SHARED_STAGES_DIRNAME)
  fl, models = _by_hand(task)
  wtype = fl.model_weights_type
  # Each group's checkpoint is its hand-driven model, in both algorithms.
  for name in ('groupfl', 'groupperfl'):
    config = _config(tmp_path, name, name)
    for g, weights in models.items():
      state = training_loop.load_checkpoint(
          fl, experiment.group_directory(config, g), 2)
      _close(fl.get_model_weights(state), weights)
  # GroupFL: each client evaluated on its group's model.
  evaluate = group_reference.build_lm_evaluation(
      task.model_fn, word_lm.metrics_fn, wtype)
  sums = {}
  for g, weights in models.items():
    sums.update(group_reference.evaluate_global(
        evaluate, weights, task.clients_of(g), task.eval_dataset))
  want = _perplexities(task, sums)
  for key, value in want.items():
    np.testing.assert_allclose(summary['eval'][key], value, rtol=1e-5,
                               err_msg=key)
  # GroupPerFL: each client fine-tunes its group's model (SGD 0.3, one pass
  # of the last round's data) and is evaluated on its own copy.
  personalize = group_reference.build_local_personalization(
      task.model_fn, tff.learning.optimizers.build_sgdm(0.3), wtype)
  evaluate_personal = group_reference.build_lm_evaluation(
      task.model_fn, word_lm.metrics_fn, wtype, tff.CLIENTS)
  personal_sums = {}
  for g, weights in models.items():
    personal_sums.update(group_reference.personalize_and_evaluate(
        personalize, evaluate_personal, weights, task.clients_of(g),
        lambda c: task.train_dataset(c, 1, round_num=2), task.eval_dataset))
  want_personal = _perplexities(task, personal_sums)
  for key, value in want_personal.items():
    np.testing.assert_allclose(personal['eval'][key], value, rtol=1e-5,
                               err_msg=key)
  assert abs(want_personal['perplexity'] - want['perplexity']) > 1e-3
  # The personalization sweep as strategies, in training and of the run
  # reopened: SGD at another rate, and two passes, each the paper's by hand.
  swept = runs.Run.open(
      _config(tmp_path, 'groupperfl', 'groupperfl').experiment_dir,
      task=task).evaluate(strategies={
          'none': strategies.AsTrained(),
          'lr05': strategies.FineTune(learning_rate=0.5, optimizer='sgd'),
          'twice': strategies.FineTune(epochs=2, learning_rate=0.3,
                                       optimizer='sgd')})['strategies']
  np.testing.assert_allclose(swept['none']['eval']['perplexity'],
                             want_personal['perplexity'], rtol=1e-5)
  np.testing.assert_allclose(personal['strategies']['lr05']['eval'][
      'perplexity'], swept['lr05']['eval']['perplexity'], rtol=1e-6)
  for name, lr, epochs in (('lr05', 0.5, 1), ('twice', 0.3, 2)):
    personalize = group_reference.build_local_personalization(
        task.model_fn, tff.learning.optimizers.build_sgdm(lr), wtype)
    sums = {}
    for g, weights in models.items():
      sums.update(group_reference.personalize_and_evaluate(
          personalize, evaluate_personal, weights, task.clients_of(g),
          lambda c, e=epochs: task.train_dataset(c, 1, round_num=2).repeat(e),
          task.eval_dataset))
    np.testing.assert_allclose(swept[name]['eval']['perplexity'],
                               _perplexities(task, sums)['perplexity'],
                               rtol=1e-5, err_msg=name)
  assert abs(swept['lr05']['eval']['perplexity'] -
             want_personal['perplexity']) > 1e-3
  assert set(summary['groups']) == set(task.group_names)
  assert summary['privacy'] is None


def test_server_state_keep_carries_the_fl_optimizer_state(tmp_path):
  """server_state='keep': each group's run starts from the FL stage's final
  server-optimizer state (Adam's moments and step), not a fresh one; the
  FL stage is the same run either way (shared)."""
  task = _task()
  task_lib.set_build_record(task, 'tiny_genres', {'seed': 0})
  _run(task, _config(tmp_path, 'groupfl', 'fresh'))
  kept = _config(tmp_path, 'groupfl', 'kept',
                 options={'server_state': 'keep'})
  _run(task, kept)
  staged = experiment.build_process(task, kept)
  fl = staged.stages[0]
  fl_final = training_loop.load_checkpoint(
      fl.process, experiment.stage_directory(kept, 'fl'), 2)
  fresh = staged.final.initialize()
  for g in task.group_names:
    starts = {name: training_loop.load_checkpoint(
        staged.final, experiment.group_directory(
            _config(tmp_path, 'groupfl', name), g), 0)
              for name in ('fresh', 'kept')}
    _close(starts['kept'].finalizer, fl_final.finalizer, rtol=0)
    _close(starts['fresh'].finalizer, fresh.finalizer, rtol=0)
    _close(starts['kept'].global_model_weights,
           starts['fresh'].global_model_weights, rtol=0)
  assert any(not np.allclose(a, b) for a, b in zip(
      tf.nest.flatten(fl_final.finalizer), tf.nest.flatten(fresh.finalizer)))
  # group_server_lr: the kept state with only its learning rate replaced,
  # and the group rounds run at it (their first step moves the weights
  # less than the kept state's at the run's learning rate).
  slow = _config(tmp_path, 'groupfl', 'kept_slow',
                 options={'server_state': 'keep', 'group_server_lr': 1e-4})
  _run(task, slow)
  g = task.group_names[0]
  start = training_loop.load_checkpoint(
      staged.final, experiment.group_directory(slow, g), 0)
  want = collections.OrderedDict(fl_final.finalizer)
  want['learning_rate'] = np.float32(1e-4)
  _close(start.finalizer, want, rtol=0)
  assert float(fl_final.finalizer['learning_rate']) != 1e-4
  def first_step(config):
    one = training_loop.load_checkpoint(
        staged.final, experiment.group_directory(config, g), 1)
    return sum(float(np.sum(np.square(a - b))) for a, b in zip(
        tf.nest.flatten(one.global_model_weights.trainable),
        tf.nest.flatten(start.global_model_weights.trainable)))
  assert 0 < first_step(slow) < 0.1 * first_step(kept)
  with pytest.raises(experiment.ConfigurationError, match='group_server_lr'):
    _run(task, _config(tmp_path, 'groupfl', 'bad_lr',
                       options={'group_server_lr': -1.0}))
  with pytest.raises(experiment.ConfigurationError, match='server_state'):
    _run(task, _config(tmp_path, 'groupfl', 'bad',
                       options={'server_state': 'warm'}))


def test_killed_between_rounds_and_resumed_equals_uninterrupted(tmp_path):
  task = _task()
  whole = _run(task, _config(tmp_path, 'groupfl', 'whole'))
  _run(task, _config(tmp_path, 'groupfl', 'parts', rounds=1))
  resumed = _run(task, _config(tmp_path, 'groupfl', 'parts', resume=True))
  assert resumed['eval'] == whole['eval']
  for g in task.group_names:
    assert resumed['groups'][g]['resumed_from_round'] == 1
    for name in ('whole', 'parts'):
      assert training_loop.checkpoint_rounds(experiment.group_directory(
          _config(tmp_path, 'groupfl', name), g))[-1] == 2
  with pytest.raises(run_records.ResumeError, match='completed 2 rounds'):
    _run(task, _config(tmp_path, 'groupfl', 'parts', rounds=1, resume=True))


def test_dp_epsilon_per_group_is_the_composed_accounting(tmp_path):
  task = _task()
  dp = privacy.DPConfig(mechanism='gaussian_fixed', noise_multiplier=1.0,
                        clip_norm=0.5)
  summary = _run(task, _config(tmp_path, 'groupfl', 'dp', dp=dp))
  report = summary['privacy']
  delta = report['delta']
  assert delta == privacy.default_target_delta(task.population)
  by_hand = {}
  for g in task.group_names:
    # Replace-one, fixed-size cohorts: GaussianDpEvent(z / 2).
    accountant = rdp.RdpAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    accountant.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.SampledWithoutReplacementDpEvent(
            task.population, 2, dp_accounting.GaussianDpEvent(0.5)), 2))
    accountant.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.SampledWithoutReplacementDpEvent(
            _SIZES[g], 2, dp_accounting.GaussianDpEvent(0.5)), 2))
    by_hand[g] = accountant.get_epsilon(delta)
    np.testing.assert_allclose(report['groups'][g]['epsilon'], by_hand[g],
                               rtol=1e-9)
  # The smallest group is sampled most often: its users spend the most.
  assert report['epsilon'] == max(by_hand.values()) == by_hand[sg.COMEDY]
  fl_only = privacy.compute_epsilon(
      privacy.DPConfig(mechanism='gaussian_fixed', noise_multiplier=1.0,
                       clip_norm=0.5, clients_per_round=2,
                       population=task.population, rounds=2), 2)['epsilon']
  assert report['epsilon'] > fl_only
  with open(os.path.join(tmp_path, 'dp', 'summary.json')) as f:
    assert json.load(f)['privacy']['groups'][sg.COMEDY]['population'] == 3
  # Under DP the training-metric sums are not released by default.
  assert not any(k.startswith('train/') for g in summary['groups'].values()
                 for k in g['final_train_metrics'])
  # Reopened: each group's final model and its members' states load into the
  # DP process, and evaluating them again gives the run's pooled and
  # per-group numbers and its privacy report.
  run = runs.Run.open(os.path.join(tmp_path, 'dp'), task=task)
  assert run.privacy_report()['groups'] == report['groups']
  members = task.clients_of(sg.COMEDY)
  assert len(run.client_states(members, group=sg.COMEDY)) == len(members)
  comedy = run.weights(group=sg.COMEDY)
  assert any(not np.allclose(a, b) for a, b in zip(
      comedy.trainable, run.weights(group=sg.HISTORY).trainable))
  again = run.evaluate()
  assert again['eval'] == summary['eval']
  for g in task.group_names:
    assert again['groups'][g] == summary['groups'][g]['eval']
  with pytest.raises(runs.RunError, match='name one: group='):
    run.weights()


def test_refusals_name_the_problem_and_leave_nothing(tmp_path):
  task = _task()
  with pytest.raises(experiment.ConfigurationError,
                     match=r"groups \{'comedy': 3\} have fewer clients"):
    _run(task, dataclasses.replace(
        _config(tmp_path, 'groupfl', 'big'), clients_per_round=4))
  dp = privacy.DPConfig(mechanism='gaussian_fixed', target_epsilon=5.0,
                        clip_norm=0.5)
  with pytest.raises(experiment.ConfigurationError,
                     match='give --noise_multiplier'):
    _run(task, _config(tmp_path, 'groupfl', 'target', dp=dp))
  dp = privacy.DPConfig(mechanism='gaussian_fixed', noise_multiplier=1.0)
  with pytest.raises(experiment.ConfigurationError,
                     match="stage 'fl' asks for 3"):
    _run(task, _config(tmp_path, 'groupfl', 'cohort', dp=dp,
                       options={'fl_clients_per_round': 3}))
  with pytest.raises(ValueError, match='grouping must be one of'):
    _run(task, _config(tmp_path, 'groupfl', 'grouping',
                       options={'grouping': 'genre'}))
  assert not list(tmp_path.iterdir())


def test_control_groupings():
  task = _task()
  config = _config('/nonexistent', 'groupfl', 'x')
  genres = experiment.group_members(task, config, 'task')
  assert {g: len(m) for g, m in genres.items()} == _SIZES
  shuffled = experiment.group_members(task, config, 'shuffled')
  assert sorted(len(m) for m in shuffled.values()) == sorted(_SIZES.values())
  assert sorted(c for m in shuffled.values() for c in m) == list(
      range(task.population))
  assert sorted(map(sorted, shuffled.values())) != sorted(
      map(sorted, genres.values()))
  assert shuffled == experiment.group_members(task, config, 'shuffled')
  assert experiment.group_members(task, config, 'one') == {
      'all': list(range(task.population))}


def test_task_subset_maps_every_client_id():
  task = _task()
  members = task.clients_of(sg.TRAGEDY)
  sub = task_lib.TaskSubset(task, members)
  assert sub.population == len(members)
  assert task_lib.capabilities(sub) == task_lib.capabilities(task)
  assert list(sub.groups([0, 1])) == [sg.TRAGEDY] * 2
  got = list(sub.train_datasets([1], round_num=3)[0].as_numpy_iterator())
  want = list(task.train_datasets([members[1]], 3)[0].as_numpy_iterator())
  for a, b in zip(got, want, strict=True):
    np.testing.assert_array_equal(a['x'], b['x'])
  with pytest.raises(ValueError, match='lists a client twice'):
    task_lib.TaskSubset(task, [0, 0])
  with pytest.raises(ValueError, match=r'clients \[99\] are not in'):
    task_lib.TaskSubset(task, [0, 99])


def test_only_the_last_stage_runs_per_group():
  proc = object()
  with pytest.raises(ValueError, match='only the last stage'):
    stages.Staged((stages.Stage('a', proc, rounds=1, per_group=True),
                   stages.Stage('b', proc, handoff=lambda s: s)))
