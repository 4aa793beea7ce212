"""The tv_shows task on the run path: its batches, roles and perplexity."""

import collections
import os

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tasks import registry as task_registry
from tasks import tv_shows
from tasks import tv_shows_task
from tests import conftest
from tests import fedperc_testdata
from tff_personal.algorithms import fedperc as fedperc_alg
from tff_personal.algorithms import registry
from tff_personal.config import experiment
from tff_personal.core import evaluation
from tff_personal.core import task as task_lib
from tff_personal.models import fedperc
from tff_personal.models import fedperc_backbone
from tff_personal.models import fedperc_training


def _users():
  return fedperc_testdata.tv_show_users()


@pytest.fixture(scope='module')
def task():
  return tv_shows_task.from_users(
      fedperc_testdata.spec(), _users(), max_tokens=fedperc_testdata.MAX_TOKENS,
      local_steps=3, batch_size=5, generator_tokens=4, seed=7)


def test_round_batches_are_the_papers(task):
  assert task.population == 15
  assert not set(task.client_names) & set(tv_shows.WITHHELD_USERS)
  for round_num in (1, 4):
    batches = task.train_batches([0, 9], round_num)
    for client, got in zip([0, 9], batches):
      user = task.client_names[client]
      want = tv_shows.round_dataset(
          task.users[user].splits['train'], steps=3, batch_size=5,
          rng=np.random.default_rng([7, round_num - 1, client]))
      want = list(want.as_numpy_iterator())
      assert len(got.batches) == len(want) == 3
      for g, w in zip(got.batches, want):
        for key in ('ids', 'mask', 'context'):
          np.testing.assert_array_equal(g[key], w[key])
  with pytest.raises(ValueError, match='client index 15'):
    task.train_batches([15], 1)


def test_eval_scores_test_utterances_after_the_prompt(task):
  """Adaptation 'none': the pooled perplexity is the model's on the test
  utterances, fine-tuning utterances not scored."""
  model_fn = task.fedperc_model_fn_factory(fedperc.EMBEDDING, 3)
  proc = fedperc_alg.build_step_process(
      model_fn, 'none', client_optimizer=tff.learning.optimizers.build_adam(
          1e-3), server_optimizer=tff.learning.optimizers.build_sgdm(1.0))
  weights = proc.get_model_weights(proc.initialize())
  rng = np.random.default_rng(0)
  states = [collections.OrderedDict(
      private=(0.1 * rng.normal(size=fedperc_testdata.HIDDEN).astype(
          np.float32),), rounds_participated=np.int32(0)) for _ in range(2)]
  ids = [2, 11]
  personal_eval = evaluation.build_personal_eval(
      proc.eval_model_fn, proc.model_weights_type, proc.eval_client_state_type)
  metrics = task.evaluate(personal_eval(weights, states,
                                        task.eval_datasets(ids)), ids)
  model = model_fn()
  nll, tokens = 0.0, 0.0
  for client, state in zip(ids, states):
    fedperc_training.assign_weights(model, weights, state['private'])
    test = task.users[task.client_names[client]].splits['test']
    total, count = fedperc_training.nll_sums(
        model, tv_shows.batched(test, 64), prompt=3)
    nll, tokens = nll + float(total), tokens + float(count)
  assert metrics['tokens'] == tokens > 0
  assert metrics['clients'] == 2
  np.testing.assert_allclose(metrics['perplexity'], np.exp(nll / tokens),
                             rtol=1e-5)
  roles = task.eval_batches([2])[0].examples[fedperc.ROLE]
  np.testing.assert_array_equal(roles, [0, 0, 1, 1])


def test_generation_adapts_and_backbone_is_required(task):
  """'generate' reads the fine-tuning utterances: the test utterances'
  scores change with them; a task without a backbone is refused, naming
  the option."""
  model_fn = task.fedperc_model_fn_factory(fedperc.GENERATED, 3)
  batch = next(iter(task.eval_datasets([1])[0]))
  other = next(iter(task.eval_datasets([4])[0]))
  swapped = {k: tf.concat([other[k][:2], batch[k][2:]], 0) for k in batch}

  def score(adapt, data):
    return tf.function(fedperc_alg.FedPercEvalModel(model_fn(), adapt).forward
                       )(data).numpy()

  plain, first, second = (score('none', batch), score('generate', batch),
                          score('generate', swapped))
  assert first[:2].sum() == 0 and first[2:, 1].sum() > 0  # roles
  np.testing.assert_array_equal(plain[:, 1], first[:, 1])
  assert not np.allclose(plain[2:, 0], first[2:, 0])
  assert not np.allclose(first[2:, 0], second[2:, 0])
  with pytest.raises(ValueError, match='backbone'):
    tv_shows_task.tv_shows_task('/nonexistent')


def test_declared_capabilities_are_the_tasks(task):
  """tv_shows has FedPerC's model and batches, and no split model: the
  registry refuses the split algorithms on it, naming what is missing."""
  assert task_lib.capabilities(task) == task_registry.spec(
      'tv_shows').capabilities
  task_lib.check_task(task)
  with pytest.raises(ValueError, match='split_model'):
    registry.check_compatible('ditto', task)
  registry.check_compatible('fedperc_generated', task)


def test_noised_personal_heads_are_refused_for_fedperc(task, tmp_path):
  config = experiment.ExperimentConfig(
      algorithm='split_learning', rounds=1, clients_per_round=1,
      root_output_dir=str(tmp_path), experiment_name='x',
      dp_personal_heads='noised')
  with pytest.raises(ValueError, match="split_learning trains FedPerC"):
    experiment.build_process(task, config)


def test_fine_tuning_adapts_inside_a_tf_function(task):
  """'fine_tune' takes Adam steps on the fine-tuning utterances (traced by
  autograph, as the evaluations trace it) and changes the test scores."""
  model_fn = task.fedperc_model_fn_factory(fedperc.EMBEDDING, 3)
  batch = next(iter(task.eval_datasets([5])[0]))
  plain = tf.function(fedperc_alg.FedPercEvalModel(model_fn(), 'none').forward
                      )(batch).numpy()
  tuned = tf.function(fedperc_alg.FedPercEvalModel(
      model_fn(), 'fine_tune', tff.learning.optimizers.build_adam(0.1),
      fine_tune_steps=3).forward)(batch).numpy()
  assert tuned[:2].sum() == 0
  np.testing.assert_array_equal(plain[:, 1], tuned[:, 1])
  assert not np.allclose(plain[2:, 0], tuned[2:, 0])

  # Minibatches of the fine-tuning utterances (2 here): a batch size of at
  # least 2 is every step on all of them; 1 is another sequence of steps.
  # (The model's context embeddings start from an unseeded draw, which an
  # evaluation replaces by the run's weights: seeded here instead.)
  def minibatched(size):
    tf.keras.utils.set_random_seed(5)
    return tf.function(fedperc_alg.FedPercEvalModel(
        model_fn(), 'fine_tune', tff.learning.optimizers.build_adam(0.1),
        fine_tune_steps=3, fine_tune_batch_size=size).forward)(batch).numpy()
  all_at_once = minibatched(0)
  np.testing.assert_array_equal(minibatched(2), all_at_once)
  np.testing.assert_array_equal(minibatched(15), all_at_once)
  one = minibatched(1)
  assert not np.allclose(one[2:, 0], all_at_once[2:, 0])
  np.testing.assert_array_equal(minibatched(1), one)  # A fixed draw.


def test_random_backbone_only_when_allowed(tmp_path):
  """A random-weight preset is refused unless the run says it only
  measures time or memory (the benchmark's fedperc row)."""
  data = conftest.SHARED_DATA
  if not os.path.isdir(os.path.join(data, 'friends')):
    pytest.skip('tv-show transcripts not found')
  spec = fedperc_testdata.spec()
  preset = str(tmp_path / 'random')
  fedperc_backbone.write_random_preset(
      spec.vocabulary, spec.merges, preset, hidden_dim=8, num_heads=2,
      intermediate_dim=16, max_sequence_length=32)
  with pytest.raises(ValueError, match='random weights'):
    tv_shows_task.tv_shows_task(data, backbone=preset, max_utterances=20)
  task = tv_shows_task.tv_shows_task(data, backbone=preset, max_utterances=20,
                                     allow_random_backbone=True)
  assert task.population > 0
  # The marker refuses to overwrite the preset.
  with pytest.raises(ValueError, match='not empty'):
    fedperc_backbone.write_random_preset(spec.vocabulary, spec.merges, preset)
