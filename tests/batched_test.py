"""Batched local training equals each user trained alone."""

import collections
import dataclasses

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tests import conformance_test as conformance
from tests import fedembed_testdata
from tests import fedperc_testdata
from tests import graph_loops
from tff_personal.algorithms import ditto
from tff_personal.algorithms import fedavg
from tff_personal.algorithms import fedembed
from tff_personal.algorithms import registry
from tff_personal.core import batched
from tff_personal.core import client_data
from tff_personal.core import privacy
from tff_personal.core import shard_packing
from tff_personal.core import sharded
from tff_personal.core import split_model
from tff_personal.core import split_training
from tff_personal.models import fedembed_mnist
from tff_personal.models import word_lm


def _mnist_model():
  return fedembed_mnist.build_preference_model(embedding_dim=0)


def _perturbed(weights, users, seed):
  rng = np.random.RandomState(seed)
  return [np.stack([w + 0.05 * rng.standard_normal(w.shape).astype(w.dtype)
                    for _ in range(users)]) for w in weights]


def test_apply_is_each_users_model_with_its_own_weights():
  model = _mnist_model()
  b = batched.BatchedModel(model)
  base = [v.numpy() for v in model.shared_trainable_variables]
  stacked = _perturbed(base, 3, seed=0)
  x = np.random.RandomState(1).rand(3, 4, 28, 28, 1).astype(np.float32)
  got = b.apply([tf.constant(w) for w in stacked], tf.constant(x)).numpy()
  for c in range(3):
    for v, w in zip(model.shared_trainable_variables, stacked):
      v.assign(w[c])
    np.testing.assert_allclose(got[c], model.model(x[c]).numpy(),
                               rtol=1e-4, atol=1e-5)


def _user_dataset(rng, n, epochs, batch):
  """n examples, each epoch in its own order, batched across epochs."""
  x = rng.rand(n, 28, 28, 1).astype(np.float32)
  y = rng.randint(0, 2, n).astype(np.int32)
  order = np.concatenate([rng.permutation(n) for _ in range(epochs)])
  return tf.data.Dataset.from_tensor_slices(
      {'x': x[order], 'y': y[order]}).batch(batch)


@pytest.mark.parametrize('optimizer', ['adam', 'sgd'])
def test_ragged_users_train_as_they_would_alone(optimizer):
  """Users of 3, 20 and 13 examples, two shuffled epochs in batches of 10
  (ragged: 1 to 4 batches, the last one partial): each user's update,
  example count and loss sum equal `split_training.local_train` on that
  user alone."""
  opt = (fedavg.adam(1e-2) if optimizer == 'adam' else
         tff.learning.optimizers.build_sgdm(learning_rate=0.02))
  rng = np.random.RandomState(0)
  datasets = [_user_dataset(rng, n, 2, 10) for n in (3, 20, 13)]
  model = _mnist_model()
  spec = datasets[0].element_spec
  shard = shard_packing.pack_datasets(datasets, spec)
  initial = tuple(tf.constant(v.numpy())
                  for v in model.shared_trainable_variables)

  out = tf.function(lambda s: batched.batched_local_train(
      batched.BatchedModel(model), opt, initial, s))(shard)

  alone_model = _mnist_model()

  @tf.function
  def alone(dataset):
    return split_training.local_train(
        alone_model, opt,
        tff.learning.models.ModelWeights(trainable=initial,
                                         non_trainable=()), (), dataset)

  for u, dataset in enumerate(datasets):
    update, weight, _, metrics = alone(dataset)
    for a, b in zip(out.updates, update):
      if optimizer == 'sgd':
        # Gradients agree to about 1e-6 of their scale; steps through three
        # LayerNorms grow that.
        np.testing.assert_allclose(a[u], b, rtol=1e-3, atol=1e-5)
      else:
        # Adam divides by the gradient's running scale, so float rounding of
        # the batched ops (which differs between CPUs: up to 3e-5 on a
        # quarter of the first kernel on one) moves small-gradient steps by a
        # fraction of the learning rate (1e-2). A padded step that was not
        # masked would move every coordinate by about a whole step.
        a, b = a[u].numpy(), b.numpy()
        assert np.linalg.norm(a - b) <= 1e-2 * np.linalg.norm(b)
        assert np.abs(a - b).max() < 2e-3
    assert int(out.num_examples[u]) == int(metrics['num_examples']) == int(
        weight)
    assert float(out.loss_sum[u]) == pytest.approx(
        float(metrics['loss_sum']), rel=1e-4)
  assert out.nonfinite.numpy().tolist() == [0, 0, 0]


def test_word_lm_users_train_as_they_would_alone():
  """The word LSTM LM (embedding, LSTM, token-weighted loss): users of 2,
  7 and 5 sentences of 1 to 6 real tokens, in batches of 3, each train as
  `split_training.local_train` trains it alone: update, loss sum and the
  token metrics. The loss pools tokens over a batch, not examples, so a
  batch mean of per-example losses would differ."""
  config = word_lm.WordLMConfig(vocab_size=30, seq_len=6, embedding_dim=8,
                                lstm_units=8)
  model_fn = word_lm.model_fn_for(config)
  opt = tff.learning.optimizers.build_sgdm(learning_rate=0.5)
  rng = np.random.RandomState(0)

  def user(n):
    lengths = rng.randint(1, 7, n)
    x = rng.randint(1, 30, (n, 6)).astype(np.int32)
    y = rng.randint(1, 30, (n, 6)).astype(np.int32)
    for i, k in enumerate(lengths):
      x[i, k:] = y[i, k:] = 0
    return tf.data.Dataset.from_tensor_slices({'x': x, 'y': y}).batch(3)

  datasets = [user(n) for n in (2, 7, 5)]
  model = model_fn()
  shard = shard_packing.pack_datasets(datasets, datasets[0].element_spec)
  initial = tuple(tf.constant(v.numpy())
                  for v in model.shared_trainable_variables)
  out = tf.function(lambda s: batched.batched_local_train(
      batched.BatchedModel(model), opt, initial, s,
      word_lm.metrics_fn))(shard)
  alone_model = model_fn()

  @tf.function
  def alone(dataset):
    return split_training.local_train(
        alone_model, opt, tff.learning.models.ModelWeights(
            trainable=initial, non_trainable=()), (), dataset,
        word_lm.metrics_fn)

  tokens = 0.0
  for u, dataset in enumerate(datasets):
    update, _, _, metrics = alone(dataset)
    assert max(np.abs(b).max() for b in update) > 1e-3  # It trained.
    for a, b in zip(out.updates, update):
      np.testing.assert_allclose(a[u], b, rtol=1e-3, atol=1e-6)
    assert float(out.loss_sum[u]) == pytest.approx(
        float(metrics['loss_sum']), rel=1e-5)
    tokens += float(metrics['tokens'])
  assert float(out.metrics['tokens']) == tokens


def test_refuses_what_it_does_not_cover_by_name():
  with pytest.raises(ValueError, match=r"'personal' \(PersonalEmbedding\)"):
    batched.BatchedModel(fedembed_mnist.build_preference_model(
        embedding_dim=28))
  x = tf.keras.Input(shape=(4,), name='x')
  h = tf.keras.layers.Dense(3)(x)
  out = tf.keras.layers.Dense(2, name='head')(
      tf.keras.layers.Concatenate()([h, x]))
  model = split_model.SplitModel(
      model=tf.keras.Model(x, out), private_variables=[],
      loss_fn=fedembed_mnist.preference_loss, input_spec=None)
  with pytest.raises(ValueError, match="'concatenate.*Concatenate"):
    batched.BatchedModel(model)


def _accuracy_sums(batch, predictions):
  correct = tf.equal(tf.argmax(predictions, -1, output_type=tf.int32),
                     batch['y'])
  return {'correct': tf.reduce_sum(tf.cast(correct, tf.float32))}


def _two_rounds(proc, init, datasets_fn):
  """Two rounds of `proc` from client states `init`, round r's data
  `datasets_fn(r)`; returns the last (state, client states, metrics)."""
  state, states = proc.initialize(), init
  for r in range(2):
    state, states, metrics = proc.next(state, states, datasets_fn(r))
  # No graph loop over the shard's model variables runs iterations at once
  # (the driver's loops; the executor form traces none here).
  for loop in proc.driver_work.traced_loops:
    assert not graph_loops.overlapping_variable_loops(loop)
  return state, states, metrics


def _mnist_users(sizes, round_num):
  """Users of `sizes` random images with binary labels, batches of 4."""
  rng = np.random.RandomState(round_num)
  return [tf.data.Dataset.from_tensor_slices(
      {'x': rng.rand(n, 28, 28, 1).astype(np.float32),
       'y': rng.randint(0, 2, n).astype(np.int32)}).batch(4) for n in sizes]


_SPEC = {'x': tf.TensorSpec([None, 28, 28, 1], tf.float32),
         'y': tf.TensorSpec([None], tf.int32)}


def _global(aggregator_factory=None):
  spec = _SPEC
  return fedavg.build_global(
      lambda dim: lambda: fedembed_mnist.build_preference_model(
          dim, input_spec=spec),
      client_optimizer=tff.learning.optimizers.build_sgdm(0.1),
      server_optimizer=tff.learning.optimizers.build_sgdm(1.0),
      aggregator_factory=aggregator_factory, metrics_fn=_accuracy_sums,
      seed=0)


@pytest.mark.parametrize('dp,shards_in', [
    (False, sharded.IN_DRIVER), (True, sharded.IN_EXECUTOR)])
def test_batched_process_equals_sharded_on_ragged_users(dp, shards_in):
  """`global` batched and sharded (per user), two rounds of users of 5, 8,
  3 and 6 examples in batches of 4, in two shards: the same server
  weights, metrics and client states; with DP (noise 0, a clip that binds)
  each user's update is clipped before the sum, in TFF's executor."""
  sizes = [5, 8, 3, 6]
  config = privacy.DPConfig(
      mechanism='gaussian_fixed', noise_multiplier=0.0, clip_norm=0.05,
      clients_per_round=len(sizes), population=100,
      target_delta=1e-3) if dp else None
  build = lambda: _global(privacy.build_aggregator(config) if dp else None)
  init = [collections.OrderedDict(private=(), rounds_participated=np.int32(0))
          ] * len(sizes)

  run = lambda proc: _two_rounds(proc, init, lambda r: _mnist_users(sizes, r))

  want = run(sharded.ShardedProcess(build(), 2, shards_in=shards_in))
  got = run(sharded.ShardedProcess(build(), 2, shards_in=shards_in,
                                   batched=True))
  start = build().initialize().global_model_weights.trainable
  moved = max(np.abs(np.asarray(a) - np.asarray(b)).max() for a, b in zip(
      want[0].global_model_weights.trainable, start))
  assert moved > 1e-3  # The rounds trained.
  for a, b in zip(tf.nest.flatten(got[0].global_model_weights),
                  tf.nest.flatten(want[0].global_model_weights)):
    np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5)
  assert [s['rounds_participated'] for s in got[1]] == [2] * len(sizes)
  got_m = got[2]['train']
  want_m = want[2]['train']
  assert sorted(got_m) == sorted(want_m)
  for k in want_m:
    np.testing.assert_allclose(got_m[k], want_m[k], rtol=1e-4, err_msg=k)


def test_batched_shards_group_users_of_similar_sizes():
  """A batched round cuts its shards from the users sorted by batch count
  (a shard runs its largest user's steps for every user); sharded keeps
  the users' order; an unknown cardinality keeps it too. The tasks'
  `ClientBatches` (what the binaries hand in) are sorted the same way."""
  sizes = [5, 12, 3, 9]  # 2, 3, 1 and 3 batches of 4
  data = [tf.data.Dataset.from_tensor_slices(
      {'x': np.zeros((n, 28, 28, 1), np.float32),
       'y': np.zeros(n, np.int32)}).batch(4) for n in sizes]
  proc = _global()
  order = lambda p, d: p._user_order(d)  # pylint: disable=protected-access
  assert order(sharded.ShardedProcess(proc, 2, batched=True), data) == [
      2, 0, 1, 3]
  assert order(sharded.ShardedProcess(proc, 2), data) == [0, 1, 2, 3]
  unknown = [d.filter(lambda b: True) for d in data]
  assert order(sharded.ShardedProcess(proc, 2, batched=True),
               unknown) == [0, 1, 2, 3]
  batches = [client_data.ClientBatches.from_arrays(
      {'x': np.zeros((n, 28, 28, 1), np.float32), 'y': np.zeros(n, np.int32)},
      4, [np.arange(n)], data[0].element_spec) for n in sizes]
  assert order(sharded.ShardedProcess(proc, 2, batched=True), batches) == [
      2, 0, 1, 3]


def test_a_process_it_does_not_cover_is_refused_saying_why():
  proc = fedavg.build_global_plus(
      lambda dim: lambda: fedembed_mnist.build_preference_model(
          dim, input_spec=_SPEC),
      client_optimizer=tff.learning.optimizers.build_sgdm(0.1),
      server_optimizer=tff.learning.optimizers.build_sgdm(1.0))
  with pytest.raises(ValueError, match='cannot run batched: .*'):
    sharded.ShardedProcess(proc, 2, batched=True)


def test_ditto_batched_equals_sharded_on_ragged_users():
  """Ditto's batched form (both passes batched, the personal one from each
  user's own model toward the broadcast one): two rounds of users of 5, 8,
  3 and 6 examples in batches of 4, in two shards, give the sharded
  form's server weights, personal models and metrics (the personal
  pass's loss included). Each user starts from its own personal model, so a mix-up of
  users shows. SGD, not Adam: Adam turns float rounding of near-zero
  gradients into steps of about its learning rate (as in conformance)."""
  sizes = [5, 8, 3, 6]
  build = lambda: ditto.build_ditto(
      lambda: fedembed_mnist.build_preference_model(0, input_spec=_SPEC),
      lam=0.5, client_optimizer=tff.learning.optimizers.build_sgdm(0.1),
      personal_optimizer=tff.learning.optimizers.build_sgdm(0.05),
      server_optimizer=tff.learning.optimizers.build_sgdm(1.0),
      metrics_fn=_accuracy_sums, seed=0)
  base = build()
  personal = _perturbed(base.initial_private, len(sizes), seed=4)
  init = [collections.OrderedDict(
      private=tuple(p[u] for p in personal),
      rounds_participated=np.int32(0)) for u in range(len(sizes))]

  run = lambda proc: _two_rounds(proc, init, lambda r: _mnist_users(sizes, r))

  want = run(sharded.ShardedProcess(base, 2))
  got = run(sharded.ShardedProcess(build(), 2, batched=True))
  for a, b in zip(tf.nest.flatten(got[0].global_model_weights),
                  tf.nest.flatten(want[0].global_model_weights)):
    np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5)
  for u, (g, w) in enumerate(zip(got[1], want[1])):
    assert not np.allclose(w['private'][0], init[u]['private'][0])
    for a, b in zip(g['private'], w['private']):
      np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5,
                                 err_msg=f'user {u}')
  assert sorted(got[2]['train']) == sorted(want[2]['train'])
  assert want[2]['train']['personal_loss'] > 0
  for k in want[2]['train']:
    np.testing.assert_allclose(got[2]['train'][k], want[2]['train'][k],
                               rtol=1e-4, err_msg=k)


@pytest.mark.parametrize('name,batch_users', [('fedper', None),
                                              ('lg_fedavg', 1)])
def test_private_layers_ride_along_batched(name, batch_users):
  """A model whose private variables are layers of its chain (FedPer's
  head, LG-FedAvg's body) trains them stacked with the shared ones: two
  rounds of ragged users from their own random private layers give the
  sharded form's server weights, private layers and metrics. With
  `batch_users`, each shard runs its users in groups, one after another
  (here four groups of one dealt to two shards): each user's state still
  comes back to it."""
  sizes = [5, 8, 3, 6]
  base = conformance._build(name)  # pylint: disable=protected-access
  init = fedembed_testdata.initial_states(base, len(sizes), seed=4)
  typed = hasattr(base.client_data_type.element, 'type')

  run = lambda proc: _two_rounds(
      proc, init, lambda r: conformance._datasets(sizes, r, typed))  # pylint: disable=protected-access

  want = run(sharded.ShardedProcess(base, 2))
  got = run(sharded.ShardedProcess(conformance._build(name), 2,  # pylint: disable=protected-access
                                   batched=True, batch_users=batch_users))
  for a, b in zip(tf.nest.flatten(got[0].global_model_weights),
                  tf.nest.flatten(want[0].global_model_weights)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  for u, (g, w) in enumerate(zip(got[1], want[1])):
    assert not np.allclose(w['private'][0], init[u]['private'][0])
    for a, b in zip(g['private'], w['private'], strict=True):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6,
                                 err_msg=f'user {u}')
  for k in want[2]['train']:
    np.testing.assert_allclose(got[2]['train'][k], want[2]['train'][k],
                               rtol=1e-4, err_msg=k)


@pytest.mark.parametrize('name', ['fedembed_prototype', 'fedembed_type'])
def test_fedembed_batched_equals_sharded_on_ragged_users(name):
  """FedEmbed's batched form (its prepare step for every user at once, each
  user's head gathered from its own copy of the K heads, the triplet's
  random negatives from each user's draw count and salt): two rounds of
  users of 5, 8, 3 and 6 examples in batches of 3, in two shards, from
  random personal embeddings and zero assignments, give the sharded
  form's server weights, metrics and every part of each user's private
  state (embedding, positive, head, draws, salt). The triplet margin is
  large enough that the hinge is always active, so each step's negative
  shows in the gradient."""
  sizes = [5, 8, 3, 6]

  def build():
    return fedembed.build_fedembed(
        lambda config: fedembed_testdata.factory(
            dataclasses.replace(config, triplet_margin=50.0)),
        assignment=name[len('fedembed_'):],
        client_optimizer=tff.learning.optimizers.build_sgdm(0.1),
        server_optimizer=tff.learning.optimizers.build_sgdm(1.0),
        metrics_fn=_accuracy_sums, seed=2)

  base = build()
  init = fedembed_testdata.initial_states(base, len(sizes), seed=4)

  run = lambda proc: _two_rounds(
      proc, init, lambda r: conformance._datasets(sizes, r))  # pylint: disable=protected-access

  want = run(sharded.ShardedProcess(base, 2))
  got = run(sharded.ShardedProcess(build(), 2, batched=True))
  for a, b in zip(tf.nest.flatten(got[0].global_model_weights),
                  tf.nest.flatten(want[0].global_model_weights)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  heads = set()
  for u, (g, w) in enumerate(zip(got[1], want[1])):
    assert not np.allclose(w['private'][0], init[u]['private'][0])
    np.testing.assert_allclose(g['private'][0], w['private'][0], rtol=1e-4,
                               atol=1e-6, err_msg=f'user {u}')
    assert [int(v) for v in g['private'][1:]] == [
        int(v) for v in w['private'][1:]], f'user {u}'
    heads.add(int(w['private'][2]))
  assert len(heads) > 1  # Users are assigned apart, so a mix-up shows.
  assert sorted(got[2]['train']) == sorted(want[2]['train'])
  for k in want[2]['train']:
    np.testing.assert_allclose(got[2]['train'][k], want[2]['train'][k],
                               rtol=1e-4, err_msg=k)


def test_fedperc_batched_equals_sharded_on_ragged_users():
  """FedPerC (embedding variant) has a batched form of its own: two rounds
  of users of 5, 8, 3 and 6 utterances in batches of 3, in two shards,
  give the sharded (per-user) form's server weights, personal offsets and
  metrics. Each user starts from its own offset, so a mix-up of users
  shows. Adam, whose slots are stacked and masked with the weights (an
  optimizer without state is the simpler case of
  `test_ragged_users_train_as_they_would_alone`)."""
  build = lambda: registry.build_for_task(
      'fedperc', fedperc_testdata.TASK, seed=2,
      client_optimizer=tff.learning.optimizers.build_adam(0.01),
      server_optimizer=tff.learning.optimizers.build_sgdm(1.0))
  sizes = [5, 8, 3, 6]
  rng = np.random.RandomState(3)
  base = build()
  init = [collections.OrderedDict(
      private=tuple(0.1 * rng.standard_normal(np.shape(w)).astype(np.float32)
                    for w in base.initial_private),
      rounds_participated=np.int32(0)) for _ in sizes]

  run = lambda proc: _two_rounds(
      proc, init, lambda r: fedperc_testdata.datasets(sizes, r))

  want = run(sharded.ShardedProcess(base, 2))
  got = run(sharded.ShardedProcess(build(), 2, batched=True))
  start = base.initialize().global_model_weights.trainable
  assert max(np.abs(np.asarray(a) - np.asarray(b)).max() for a, b in zip(
      want[0].global_model_weights.trainable, start)) > 1e-4
  for a, b in zip(tf.nest.flatten(got[0].global_model_weights),
                  tf.nest.flatten(want[0].global_model_weights)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  for u, (g, w) in enumerate(zip(got[1], want[1])):
    assert not np.allclose(w['private'][0], init[u]['private'][0])
    np.testing.assert_allclose(g['private'][0], w['private'][0], rtol=1e-4,
                               atol=1e-6, err_msg=f'user {u}')
    assert g['rounds_participated'] == w['rounds_participated'] == 2
  assert sorted(got[2]['train']) == sorted(want[2]['train'])
  for k in want[2]['train']:
    np.testing.assert_allclose(got[2]['train'][k], want[2]['train'][k],
                               rtol=1e-4, err_msg=k)
