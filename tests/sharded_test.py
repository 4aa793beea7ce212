"""The sharded simulation computes what the one-user-per-client form computes."""

import collections
import dataclasses
import gc
import os
import time

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tests import fedembed_testdata
from tff_personal.algorithms import fedavg
from tff_personal.algorithms import fedembed as fedembed_algorithms
from tff_personal.algorithms import fedembed_som
from tff_personal.algorithms import pfedkm
from tff_personal.core import best_scoring
from tff_personal.core import client_data
from tff_personal.core import evaluation
from tff_personal.core import flat_transport
from tff_personal.core import privacy
from tff_personal.core import process as process_lib
from tff_personal.core import shard_threads
from tff_personal.core import sharded
from tff_personal.core import sharded_eval
from tff_personal.models import fedembed as fedembed_model
from tff_personal.models import fedembed_mnist

SPEC = collections.OrderedDict(
    x=tf.TensorSpec([None, 28, 28, 1], tf.float32),
    y=tf.TensorSpec([None], tf.int32))
# FedEmbed's users identify their positive sub-population from `type`.
TYPED_SPEC = collections.OrderedDict(
    SPEC, type=tf.TensorSpec([None], tf.int32))


def model_fn_factory(dim):
  # The small encoder: these tests are of the sharded form's wiring.
  return lambda: fedembed_mnist.build_preference_model(
      dim, input_spec=SPEC, encoder_fn=fedembed_testdata.tiny_encoder)


def make_datasets(sizes, seed, batch=4, typed=False):
  """Users with different example counts (ragged last batches included)."""
  rng = np.random.default_rng(seed)
  out = []
  for u, n in enumerate(sizes):
    data = collections.OrderedDict(
        x=rng.random((n, 28, 28, 1), dtype=np.float32),
        y=rng.integers(0, 2, n).astype(np.int32))
    if typed:  # user u prefers sub-population u % 3
      data['type'] = np.where(data['y'] == 1, u % 3,
                              (u + 1) % 3).astype(np.int32)
    out.append(tf.data.Dataset.from_tensor_slices(data).batch(batch))
  return out


def states(proc, num_users, seed):
  rng = np.random.default_rng(seed)
  template = tff.types.type_to_tf_tensor_specs(proc.client_state_type)
  return [tf.nest.map_structure(
      lambda s: (rng.normal(size=s.shape) * 0.1).astype(s.dtype.as_numpy_dtype)
      if s.dtype.is_floating else np.zeros(s.shape, s.dtype.as_numpy_dtype),
      template) for _ in range(num_users)]


def run_rounds(proc, rounds, client_states, sizes, typed=False):
  state = proc.initialize()
  metrics = None
  for r in range(rounds):
    state, client_states, metrics = proc.next(
        state, client_states, make_datasets(sizes, seed=r, typed=typed))
  return state, client_states, metrics


def local_sgd():
  """The equivalence tests' local optimizer. Not Adam: a weight whose
  gradient is zero but for float noise gets an Adam step of about the
  learning rate whose sign follows that noise, so two summation orders
  (sharded and one-user, driver and executor, or two CPUs' kernels) would
  differ there by steps of the learning rate, not by rounding."""
  return tff.learning.optimizers.build_sgdm(0.1)


def assert_close_structures(a, b, rtol=1e-4, atol=1e-5):
  # Summation order differs (shard means, then a mean of shards).
  for x, y in zip(tf.nest.flatten(a), tf.nest.flatten(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol,
                               atol=atol)


@pytest.mark.parametrize('dp', [False, True])
def test_shards_in_the_driver_equal_shards_in_the_executor(dp):
  """The driver runs the shard computation's own TF code: the same round as
  TFF's executor running the shards as its clients (plain and DP; noise 0
  so that the comparison is of the clipped sums), to float rounding (the
  two TensorFlow runtimes order a few float reductions differently; the
  local Adam steps magnify that on tiny gradients, as between the sharded
  and one-user forms)."""
  sizes = [6, 9, 3, 8, 5]
  if dp:
    config = dp_config(0.0, len(sizes))
    build = lambda where: sharded.ShardedProcess(
        build_dp_global(config), 2, shards_in=where)
    init = [collections.OrderedDict(private=(),
                                    rounds_participated=np.int32(0))
            ] * len(sizes)
  else:
    build = lambda where: sharded.ShardedProcess(
        fedavg.build_global_plus(
            model_fn_factory, client_optimizer=local_sgd(),
            server_optimizer=tff.learning.optimizers.build_sgdm(1.0), seed=1,
            embedding_dim=28, metrics_fn=None), 2, shards_in=where)
    init = states(build(sharded.IN_EXECUTOR), len(sizes), seed=7)
  driver = build(sharded.IN_DRIVER)
  got = run_rounds(driver, 2, init, sizes)
  want = run_rounds(build(sharded.IN_EXECUTOR), 2, init, sizes)
  # In the driver form no client state crosses into TFF's executor: the
  # round's TFF call takes only what the aggregation reads.
  call = driver._process_from_results().next.type_signature  # pylint: disable=protected-access
  assert isinstance(call.parameter[1].member, tff.StructType)
  assert not call.parameter[1].member and not call.result[1].member
  for x, y in zip(tf.nest.flatten(got), tf.nest.flatten(want), strict=True):
    x, y = np.asarray(x), np.asarray(y)
    if np.issubdtype(x.dtype, np.floating):
      assert_close_structures(x, y)
    else:
      np.testing.assert_array_equal(x, y)
  start = build(sharded.IN_DRIVER).initialize().global_model_weights
  assert any(not np.array_equal(a, b) for a, b in zip(
      got[0].global_model_weights.trainable, start.trainable))


@pytest.mark.parametrize('kind', ['plain', 'dp', 'pfedkm', 'fedembed_som'])
def test_shard_result_type_is_the_traced_computation_s(kind):
  """The driver form types the shards' results without tracing the TFF
  shard computation: the type must be the one that computation has (with
  a selection and user counts for the statistics processes, DP's sums)."""
  if kind == 'plain':
    proc = sharded.ShardedProcess(fedavg.build_global_plus(
        model_fn_factory, client_optimizer=local_sgd(),
        server_optimizer=tff.learning.optimizers.build_sgdm(1.0), seed=1,
        embedding_dim=28, metrics_fn=None), 2)
  elif kind == 'dp':
    config = dp_config(1.0, 4)
    proc = sharded.ShardedProcess(build_dp_global(config), 2)
  else:
    proc = sharded.ShardedProcess(
        build_statistics_process(kind, 'best' if kind == 'fedembed_som'
                                 else None), 2)
  traced = proc._shard_work.type_signature.result  # pylint: disable=protected-access
  derived = proc._result_type  # pylint: disable=protected-access
  assert derived.is_equivalent_to(traced), (derived, traced)
  assert ('selected' in dir(traced)) == (kind == 'fedembed_som')
  assert ('users' in dir(traced)) == (kind in ('pfedkm', 'fedembed_som'))


def test_an_unknown_place_for_shards_is_refused():
  base = fedavg.build_global_plus(
      model_fn_factory, client_optimizer=local_sgd(),
      server_optimizer=tff.learning.optimizers.build_sgdm(1.0), seed=1,
      embedding_dim=28, metrics_fn=None)
  with pytest.raises(ValueError, match='shards_in'):
    sharded.ShardedProcess(base, 2, shards_in='gpu')


def test_pack_keeps_batch_boundaries():
  datasets = make_datasets([5, 2], seed=0, batch=2)
  packed = sharded.pack_datasets(datasets, SPEC)
  assert packed['num_batches'].tolist() == [3, 1]
  assert packed['batch_sizes'].tolist() == [[2, 2, 1], [2, 0, 0]]
  shard = tf.nest.map_structure(tf.constant, packed)
  for u, ds in enumerate(datasets):
    user = sharded.PackedBatches(shard, u, SPEC)
    rebuilt = [user.batch(j) for j in range(int(packed['num_batches'][u]))]
    original = list(ds)
    assert len(rebuilt) == len(original)
    for a, b in zip(rebuilt, original):
      np.testing.assert_array_equal(a['x'].numpy(), b['x'].numpy())
      np.testing.assert_array_equal(a['y'].numpy(), b['y'].numpy())
    # reduce visits exactly the user's examples.
    total = user.reduce(tf.constant(0.0),
                        lambda s, b: s + tf.reduce_sum(b['x']))
    want = sum(float(np.sum(b['x'])) for b in original)
    np.testing.assert_allclose(total.numpy(), want, rtol=1e-5)


def dp_config(noise_multiplier, cohort):
  return privacy.DPConfig(mechanism='gaussian_fixed',
                          noise_multiplier=noise_multiplier, clip_norm=0.05,
                          clients_per_round=cohort, population=100,
                          target_delta=1e-3)


def build_dp_global(config, learning_rate=3e-3, factory=model_fn_factory):
  return fedavg.build_global(
      factory, client_optimizer=fedavg.adam(learning_rate)
      if learning_rate else tff.learning.optimizers.build_sgdm(0.0),
      server_optimizer=tff.learning.optimizers.build_sgdm(1.0),
      aggregator_factory=privacy.build_aggregator(config), seed=0)


def test_dp_is_read_from_the_aggregator_and_an_unknown_one_is_refused():
  """The sharded form takes DP from the process's own aggregator: a DP
  factory not made by `privacy.build_aggregator` (its clip unknown) is
  refused, naming it, and is never sharded automatically."""
  config = dp_config(1.0, 4)
  assert privacy.config_of(privacy.build_aggregator(config)) == (
      privacy.resolve(config))
  foreign = fedavg.build_global(
      model_fn_factory, client_optimizer=fedavg.adam(3e-3),
      server_optimizer=tff.learning.optimizers.build_sgdm(1.0),
      aggregator_factory=tff.aggregators.DifferentiallyPrivateFactory
      .gaussian_fixed(noise_multiplier=1.0, clients_per_round=4.0, clip=1.0),
      seed=0)
  with pytest.raises(ValueError, match='build_aggregator'):
    sharded.ShardedProcess(foreign, 2)
  assert sharded.resolve_num_shards(foreign, sharded.AUTO) == 0


def test_dp_sharded_clips_per_user_like_the_dp_aggregator():
  """Noise 0: per-user clipping + sum + /cohort equals TFF's DP mean."""
  sizes = [6, 9, 3, 8]
  config = dp_config(0.0, len(sizes))
  init = [collections.OrderedDict(private=(), rounds_participated=np.int32(0))
          ] * len(sizes)
  want_state, _, _ = run_rounds(build_dp_global(config), 2, init, sizes)
  # Both forms in the worker, whose thread pools are fixed (the driver's
  # are whichever an earlier test started TensorFlow with, and Adam turns
  # their rounding differences into steps of about the learning rate).
  got_state, _, _ = run_rounds(
      sharded.ShardedProcess(build_dp_global(config), 2,
                             shards_in=sharded.IN_EXECUTOR), 2, init, sizes)
  start = build_dp_global(config).initialize().global_model_weights
  moved = [np.abs(np.asarray(a) - np.asarray(b)).max() for a, b in zip(
      want_state.global_model_weights.trainable, start.trainable)]
  assert max(moved) > 1e-4  # the comparison is not of untouched weights
  assert_close_structures(got_state.global_model_weights,
                          want_state.global_model_weights)


def test_dp_sharded_noise_has_the_stated_scale():
  """Zero updates (lr 0): the server step is the noise / cohort alone."""
  sizes = [4, 4, 4, 4]
  config = dp_config(2.0, len(sizes))
  # The paper's CNN: its 0.1 M weights are the noise's samples.
  cnn = lambda dim: lambda: fedembed_mnist.build_preference_model(
      dim, input_spec=SPEC)
  proc = sharded.ShardedProcess(
      build_dp_global(config, learning_rate=0.0, factory=cnn), 2)
  init = [collections.OrderedDict(private=(), rounds_participated=np.int32(0))
          ] * len(sizes)
  start = proc.initialize().global_model_weights
  state, _, _ = run_rounds(proc, 1, init, sizes)
  delta = np.concatenate([
      (np.asarray(a) - np.asarray(b)).ravel()
      for a, b in zip(state.global_model_weights.trainable, start.trainable)])
  want_std = 2.0 * 0.05 / len(sizes)
  assert delta.size > 50_000
  np.testing.assert_allclose(delta.std(), want_std, rtol=0.02)
  assert abs(delta.mean()) < 5 * want_std / np.sqrt(delta.size)


def test_sharded_personal_eval_equals_per_client_eval():
  proc = fedavg.build_global_plus(
      model_fn_factory, client_optimizer=local_sgd(),
      server_optimizer=tff.learning.optimizers.build_sgdm(1.0), seed=1,
      embedding_dim=28)
  weights = proc.get_model_weights(proc.initialize())
  sizes = [5, 2, 7]
  client_states = states(proc, len(sizes), seed=4)
  datasets = make_datasets(sizes, seed=9, batch=3)
  want = evaluation.build_personal_eval(
      proc.model_fn, proc.model_weights_type, proc.client_state_type)(
          weights, client_states, datasets)
  got = sharded_eval.ShardedPersonalEval(proc.model_fn, num_shards=2)(
          weights, client_states, datasets)
  assert len(got) == len(sizes)
  for g, w, n in zip(got, want, sizes):
    assert g['outputs'].shape[0] == n
    np.testing.assert_allclose(g['outputs'], np.asarray(w['outputs']),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(g['labels'], np.asarray(w['labels']))


# Examples that travel as uint8 (as speech spectrograms do) and are decoded
# to the model's float input inside the shard.
EPOCHS = 2
WIRE = client_data.WireFormat(
    spec=collections.OrderedDict(
        x=tf.TensorSpec([None, 28, 28, 1], tf.uint8),
        y=tf.TensorSpec([None], tf.int32)),
    decode=lambda b: collections.OrderedDict(
        x=tf.cast(b['x'], tf.float32) / 255.0, y=b['y']))


def wire_batches(sizes, seed, batch=4, epochs=EPOCHS, wire=WIRE):
  """Users' uint8 examples, `epochs` shuffled passes; and the same in float."""
  rng = np.random.default_rng(seed)
  out = []
  for n in sizes:
    q = rng.integers(0, 256, (n, 28, 28, 1)).astype(np.uint8)
    y = rng.integers(0, 2, n).astype(np.int32)
    orders = [rng.permutation(n) for _ in range(epochs)]
    out.append(client_data.ClientBatches.from_arrays(
        collections.OrderedDict(x=q, y=y), batch, orders, SPEC, wire=wire))
  return out


def test_wire_form_shards_equal_float_datasets_one_user_per_client():
  # Local SGD (Adam's division by sqrt(v) would magnify summation-order
  # differences over 2 rounds x 2 epochs into the last digits compared).
  build = lambda: fedavg.build_global_plus(
      model_fn_factory,
      client_optimizer=tff.learning.optimizers.build_sgdm(0.1),
      server_optimizer=tff.learning.optimizers.build_sgdm(1.0), seed=1,
      embedding_dim=28, metrics_fn=None)
  base = build()
  sizes = [6, 3, 5]
  init = states(base, len(sizes), seed=4)
  sharded_proc = sharded.ShardedProcess(build(), 2, wire=WIRE)
  want_state, got_state = base.initialize(), sharded_proc.initialize()
  want_clients = got_clients = init
  for r in range(2):
    data = wire_batches(sizes, seed=r)
    # The one-user form gets float32 datasets (decoded in a tf.data map).
    want_state, want_clients, _ = base.next(
        want_state, want_clients, [d.to_dataset() for d in data])
    got_state, got_clients, metrics = sharded_proc.next(
        got_state, got_clients, data)
  tol = dict(rtol=1e-4, atol=1e-5)
  assert_close_structures(got_state.global_model_weights,
                          want_state.global_model_weights, **tol)
  for got, want in zip(got_clients, want_clients):
    assert_close_structures(got, want, **tol)
  assert not np.allclose(got_clients[0]['private'][0], init[0]['private'][0],
                         **tol)
  # Two epochs of each user's examples were trained on.
  assert metrics['train']['num_examples'] == 2 * sum(sizes)


def test_shard_sends_each_users_examples_once_in_the_wire_form():
  data = wire_batches([5, 2], seed=0, batch=2, epochs=3)
  packed = sharded.pack_datasets(data, SPEC, WIRE)
  assert packed['examples']['x'].dtype == np.uint8
  assert packed['examples']['x'].shape == (2, 5, 28, 28, 1)
  assert packed['num_batches'].tolist() == [9, 3]
  shard = tf.nest.map_structure(tf.constant, packed)
  for u, d in enumerate(data):
    user = sharded.PackedBatches(shard, u, SPEC, WIRE)
    for j, want in enumerate(d.to_dataset()):
      got = user.batch(j)
      np.testing.assert_array_equal(got['x'].numpy(), want['x'].numpy())
      np.testing.assert_array_equal(got['y'].numpy(), want['y'].numpy())


def test_wire_and_model_forms_are_not_mixed():
  with pytest.raises(ValueError, match='disagree on the wire format'):
    sharded.pack_datasets(wire_batches([3], seed=0), SPEC)  # no wire given
  with pytest.raises(ValueError, match='needs ClientBatches'):
    sharded.pack_datasets(make_datasets([3], seed=0), SPEC, WIRE)


@pytest.mark.parametrize('algorithm', ['global_plus', 'fedembed_prototype'])
def test_sharded_fine_tune_eval_equals_per_client_cold_start_eval(algorithm):
  """Test-time fine-tuning of the private state, then evaluation, sharded.

  FedEmbed-Prototype's `prepare_fn` (head assignment from the user's data)
  runs on the shard's packed batches as on the user's dataset; training
  batches come in the uint8 wire form, evaluation data as tf.data.
  """
  if algorithm == 'global_plus':
    proc = fedavg.build_global_plus(
        model_fn_factory, client_optimizer=local_sgd(),
        server_optimizer=tff.learning.optimizers.build_sgdm(1.0), seed=1,
        embedding_dim=28)
  else:
    proc = fedembed_algorithms.build_fedembed_prototype(
        lambda config: (lambda: fedembed_model.build_fedembed_model(
            dataclasses.replace(config, num_subpopulations=3),
            encoder_fn=fedembed_testdata.tiny_encoder,
            input_spec=TYPED_SPEC)),
        client_optimizer=local_sgd(),
        server_optimizer=tff.learning.optimizers.build_sgdm(1.0), seed=2)
  typed = algorithm != 'global_plus'
  spec = TYPED_SPEC if typed else SPEC
  wire = client_data.WireFormat(
      spec=collections.OrderedDict(
          [('x', tf.TensorSpec([None, 28, 28, 1], tf.uint8))] +
          [(k, v) for k, v in spec.items() if k != 'x']),
      decode=lambda b: collections.OrderedDict(
          [('x', tf.cast(b['x'], tf.float32) / 255.0)] +
          [(k, v) for k, v in b.items() if k != 'x']))
  weights = proc.get_model_weights(proc.initialize())
  sizes = [5, 2, 7]
  rng = np.random.default_rng(5)
  train = []
  for u, n in enumerate(sizes):
    y = rng.integers(0, 2, n).astype(np.int32)
    examples = collections.OrderedDict(
        x=rng.integers(0, 256, (n, 28, 28, 1)).astype(np.uint8), y=y)
    if typed:
      examples['type'] = np.where(y == 1, u % 3, (u + 1) % 3).astype(np.int32)
    train.append(client_data.ClientBatches.from_arrays(
        examples, 2, [rng.permutation(n), rng.permutation(n)], spec,
        wire=wire))
  client_states = states(proc, len(sizes), seed=4)
  test = make_datasets(sizes, seed=9, batch=3, typed=typed)
  optimizer = tff.learning.optimizers.build_sgdm(0.5)
  want = evaluation.build_cold_start_eval(
      proc.model_fn, proc.model_weights_type, proc.client_state_type,
      optimizer)(weights, client_states, [t.to_dataset() for t in train],
                 test)
  no_tuning = evaluation.build_personal_eval(
      proc.model_fn, proc.model_weights_type, proc.client_state_type)(
          weights, client_states, test)
  evaluate = sharded_eval.ShardedPersonalEval(
      proc.model_fn, num_shards=2, fine_tune_optimizer=optimizer,
      train_wire=wire)
  got = evaluate(weights, client_states, train, test)
  assert len(got) == len(sizes)
  # The evaluator keeps one model between calls: a second call (other users,
  # other shapes) gives each user what the first did.
  again = evaluate(weights, [client_states[2], client_states[0]],
                   [train[2], train[0]], [test[2], test[0]])
  for g, u in zip(again, [2, 0]):
    np.testing.assert_allclose(g['outputs'], got[u]['outputs'],
                               rtol=1e-5, atol=1e-6)
  for g, w, plain, n in zip(got, want, no_tuning, sizes):
    assert g['outputs'].shape[0] == n
    np.testing.assert_allclose(g['outputs'], np.asarray(w['outputs']),
                               rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(g['labels'], np.asarray(w['labels']))
  # The fine-tuning changed the outputs (the comparison is not vacuous).
  assert not np.allclose(got[0]['outputs'], np.asarray(no_tuning[0]['outputs']),
                         atol=1e-4)
  with pytest.raises(ValueError, match='train_data, datasets'):
    sharded_eval.ShardedPersonalEval(
        proc.model_fn, fine_tune_optimizer=optimizer)(
            weights, client_states, test)


# --- processes with a server step (statistics_process): PFedKM, FedEmbed-SOM --

def typed_fedembed_factory(config):
  return lambda: fedembed_model.build_fedembed_model(
      fedembed_testdata.with_k(config),
      encoder_fn=fedembed_testdata.tiny_encoder, input_spec=TYPED_SPEC)


def build_statistics_process(algorithm, som_update=None,
                             aggregator_factory=None):
  common = dict(client_optimizer=tff.learning.optimizers.build_sgdm(0.1),
                server_optimizer=tff.learning.optimizers.build_sgdm(1.0),
                aggregator_factory=aggregator_factory, seed=3,
                num_subpopulations=3)
  if algorithm == 'pfedkm':
    return pfedkm.build_pfedkm(typed_fedembed_factory, **common)
  return fedembed_som.build_fedembed_som(
      typed_fedembed_factory,
      som_config=fedembed_som.SomConfig(update=som_update),
      allow_unprotected_best_client=True, **common)


def assert_statistics_runs_equal(got, want, start):
  """Server weights (trainable and non-trainable), client states, metrics."""
  (got_state, got_clients, got_metrics) = got
  (want_state, want_clients, want_metrics) = want
  assert_close_structures(got_state.global_model_weights.trainable,
                          want_state.global_model_weights.trainable)
  assert_close_structures(got_state.global_model_weights.non_trainable,
                          want_state.global_model_weights.non_trainable)
  assert len(got_clients) == len(want_clients)
  for g, w in zip(got_clients, want_clients):
    assert_close_structures(g, w)
  for key in ('train', 'server_step'):
    assert got_metrics[key].keys() == want_metrics[key].keys()
    assert_close_structures(got_metrics[key], want_metrics[key])
  assert got_metrics['train']['clients'] == len(want_clients)
  # The server-side structure (centroids / SOM) moved: not a vacuous check.
  assert any(not np.allclose(a, b) for a, b in zip(
      got_state.global_model_weights.non_trainable, start.non_trainable))


@pytest.mark.parametrize('algorithm,som_update', [
    ('fedembed_som', 'best'), ('fedembed_som', 'mean')])
def test_statistics_process_sharded_equals_one_user_per_client(algorithm,
                                                               som_update):
  """5 users in 2 shards (2 + 3), 2 rounds, same seed and initial states.

  PFedKM (whose centroid update multiplies the mean statistics by the
  cohort size: 5 users, not 2 shards) is held to the same equality over
  the registry (`conformance_test`). SOM 'best' selects one user's
  update through the shards; with these initial states the first round's
  best user is the first of the second shard (user 2; checked by hand), so
  selecting any other user of a shard would change the map.
  """
  build = lambda: build_statistics_process(algorithm, som_update)
  base = build()
  assert sharded.resolve_num_shards(base, sharded.AUTO) > 0
  sizes = [6, 9, 3, 8, 5]
  init = states(base, len(sizes), seed=11)
  want = run_rounds(base, 2, init, sizes, typed=True)
  # Both forms in the worker, whose thread pools are fixed (as in the
  # FedEmbed-Prototype test above): in a full run, the driver's pools are
  # whichever an earlier test started TensorFlow with, and PFedKM's
  # centroid assignment turned a rounding difference into a different
  # centroid once. The driver form is held to the executor's by
  # test_shards_in_the_driver_equal_shards_in_the_executor.
  proc = sharded.ShardedProcess(build(), 2, shards_in=sharded.IN_EXECUTOR)
  assert [len(r) for r in proc.shards(len(sizes))] == [2, 3]
  got = run_rounds(proc, 2, init, sizes, typed=True)
  assert_statistics_runs_equal(got, want,
                               base.initialize().global_model_weights)


@pytest.mark.parametrize('algorithm', ['pfedkm', 'fedembed_som'])
def test_statistics_process_dp_sharded_clips_per_user(algorithm):
  """Noise 0, fixed clip 0.05 (below the norm of the statistics alone, so
  every user's joint update is clipped): per-user clipping in the shards
  equals TFF's DP aggregator over the users. SOM under DP uses 'mean'."""
  sizes = [6, 9, 3, 8, 5]
  config = dp_config(0.0, len(sizes))
  build = lambda: build_statistics_process(
      algorithm, aggregator_factory=privacy.build_aggregator(config))
  base = build()
  assert sharded.resolve_num_shards(base, sharded.AUTO) > 0
  adaptive = dataclasses.replace(config, mechanism='gaussian_adaptive',
                                 noise_multiplier=0.1)
  assert sharded.resolve_num_shards(build_statistics_process(
      algorithm, aggregator_factory=privacy.build_aggregator(adaptive)),
                                    sharded.AUTO) == 0
  init = states(base, len(sizes), seed=11)
  want = run_rounds(base, 2, init, sizes, typed=True)
  # Both forms in the worker (as in the test without DP above).
  got = run_rounds(sharded.ShardedProcess(build(), 2,
                                          shards_in=sharded.IN_EXECUTOR),
                   2, init, sizes, typed=True)
  assert_statistics_runs_equal(got, want,
                               base.initialize().global_model_weights)


def test_best_scoring_over_shards_selects_the_first_best_user():
  """Each shard keeps its first best user (`best_scoring.better` in user
  order, as the shard work does); the aggregator over the shards then gives
  the aggregator's result over the users, ties and -inf included."""
  value_type = tff.types.to_type(collections.OrderedDict(
      score=np.float32, value=tff.TensorType(np.float32, [2])))
  proc = best_scoring.BestScoringFactory().create(value_type)
  spec = tff.types.type_to_tf_tensor_specs(value_type.value)
  for scores in ([1.0, 3.0, 3.0, 2.0, 3.0], [2.0, -np.inf, 5.0, 5.0, 1.0],
                 [-np.inf] * 4, [np.nan, 1.0, 1.0]):
    users = [collections.OrderedDict(score=np.float32(s),
                                     value=np.float32([i, -i]))
             for i, s in enumerate(scores)]
    want = proc.next(proc.initialize(), users).result
    for num_shards in range(1, len(users) + 1):
      shard_best = []
      for r in sharded.shard_ranges(len(users), num_shards):
        best = best_scoring.no_candidate(spec)
        for i in r:
          best = best_scoring.better(best, users[i])
        shard_best.append(tf.nest.map_structure(np.asarray, best))
      got = proc.next(proc.initialize(), shard_best).result
      np.testing.assert_array_equal(got['score'], want['score'])
      np.testing.assert_array_equal(got['value'], want['value'])
  # The first of the tied best users (user 1 of [1, 3, 3, 2, 3]) is chosen.
  users = [collections.OrderedDict(score=np.float32(s),
                                   value=np.float32([i, -i]))
           for i, s in enumerate([1.0, 3.0, 3.0, 2.0, 3.0])]
  np.testing.assert_array_equal(
      proc.next(proc.initialize(), users).result['value'], [1.0, -1.0])


def test_an_unknown_selection_aggregator_is_not_sharded():
  """Only the best-scoring selection has a known reduction over a shard."""
  composition = process_lib.Composition(
      initial_model_weights=None, client_state_type=None,
      client_data_type=None, client_work_result_type=None,
      aggregator_factory=tff.aggregators.MeanFactory(), server_optimizer=None,
      train_metrics=True, client_step=lambda: None, server_step=object(),
      selection_factory=tff.aggregators.UnweightedMeanFactory())
  proc = collections.namedtuple('Proc', 'composition')(composition)
  assert sharded.resolve_num_shards(proc, sharded.AUTO) == 0
  with pytest.raises(ValueError, match='BestScoringFactory'):
    sharded.ShardedProcess(proc, 2)
  best = dataclasses.replace(
      composition, selection_factory=best_scoring.BestScoringFactory())
  assert sharded.resolve_num_shards(
      collections.namedtuple('Proc', 'composition')(best), sharded.AUTO) > 0


def test_shard_pool_works_in_a_forked_child():
  """The kept pool of shard threads is not inherited by a fork (which has
  none of its threads): the child's shard loops still run, in its own."""
  runs = [lambda x: x + 1, lambda x: x + 2]
  for _ in range(5):  # Rounds: the parent's threads are started and idle.
    assert shard_threads.run_concurrently(runs, None, [(1,), (2,)]) == [2, 4]
  time.sleep(0.5)
  pid = os.fork()
  if pid == 0:  # The child: exit 0 only if the loops ran.
    ok = shard_threads.run_concurrently(runs, None, [(1,), (2,)]) == [2, 4]
    os._exit(0 if ok else 1)
  deadline = time.monotonic() + 30
  while time.monotonic() < deadline:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
      assert os.waitstatus_to_exitcode(status) == 0
      return
    time.sleep(0.1)
  os.kill(pid, 9)
  os.waitpid(pid, 0)
  pytest.fail('the forked child\'s shard loops never ran')


def test_flat_transport_carries_a_structure_bit_for_bit():
  specs = collections.OrderedDict(
      update=[tf.TensorSpec([2, 3], tf.float32), tf.TensorSpec([4], tf.float32)],
      count=tf.TensorSpec([], tf.int64),
      weight=tf.TensorSpec([], tf.float32),
      flags=tf.TensorSpec([2], tf.int32))
  rng = np.random.default_rng(0)
  value = collections.OrderedDict(
      update=[rng.standard_normal((2, 3)).astype(np.float32),
              np.array([1e-38, -0.0, np.inf, np.nan], np.float32)],
      count=np.int64(2**40 + 3), weight=np.float32(0.1),
      flags=np.array([-7, 9], np.int32))
  transport = flat_transport.FlatTransport(specs)
  packed = transport.pack(value)
  # One vector per dtype: float32 (6 + 4 + 1), int32 (2), int64 (1).
  assert [(p.dtype, p.shape) for p in packed] == [
      (np.float32, (11,)), (np.int32, (2,)), (np.int64, (1,))]
  assert [s.shape.as_list() for s in transport.packed_spec] == [[11], [2], [1]]
  packed_in_tf = transport.pack_tensors(
      tf.nest.map_structure(tf.constant, value))
  for got, want in zip(packed_in_tf, packed, strict=True):
    np.testing.assert_array_equal(got.numpy().view(np.uint8),
                                  want.view(np.uint8))
  unpacked_in_tf = tf.nest.map_structure(
      lambda t: t.numpy(),
      transport.unpack_tensors(tuple(tf.constant(p) for p in packed)))
  for back in (transport.unpack(packed), unpacked_in_tf):
    assert tf.nest.map_structure(lambda _: 0, back) == tf.nest.map_structure(
        lambda _: 0, value)  # The same structure.
    for got, want in zip(tf.nest.flatten(back), tf.nest.flatten(value),
                         strict=True):
      want = np.asarray(want)
      got = np.asarray(got)
      assert (got.dtype, got.shape) == (want.dtype, want.shape)
      np.testing.assert_array_equal(got.reshape(-1).view(np.uint8),
                                    want.reshape(-1).view(np.uint8))
  with pytest.raises(ValueError, match='fully known shapes'):
    flat_transport.FlatTransport([tf.TensorSpec([None, 3], tf.float32)])
  strings = [tf.TensorSpec([2], tf.float32), tf.TensorSpec([], tf.string)]
  assert not flat_transport.FlatTransport.fits(strings)
  assert flat_transport.FlatTransport.fits(strings[:1])
  with pytest.raises(ValueError, match='numbers and booleans'):
    flat_transport.FlatTransport(strings)


@pytest.mark.parametrize('dp', [False, True])
def test_packed_transport_changes_no_bit_of_a_round(dp, monkeypatch):
  """The driver form's TFF call takes the server state and the shards'
  results packed (`FlatTransport`); sent leaf by leaf instead, two rounds
  give the same bits."""
  sizes = [6, 9, 3, 8, 5]
  if dp:
    config = dp_config(0.0, len(sizes))
    build = lambda: sharded.ShardedProcess(build_dp_global(config), 2)
    init = [collections.OrderedDict(private=(),
                                    rounds_participated=np.int32(0))
            ] * len(sizes)
  else:
    build = lambda: sharded.ShardedProcess(
        fedavg.build_global_plus(
            model_fn_factory, client_optimizer=local_sgd(),
            server_optimizer=tff.learning.optimizers.build_sgdm(1.0), seed=1,
            embedding_dim=28, metrics_fn=None), 2)
    init = states(build(), len(sizes), seed=7)
  packed = run_rounds(build(), 2, init, sizes)
  monkeypatch.setattr(flat_transport.FlatTransport, 'fits',
                      classmethod(lambda cls, specs: False))
  leafwise = build()
  plain = run_rounds(leafwise, 2, init, sizes)
  assert leafwise._transport is None  # pylint: disable=protected-access
  for x, y in zip(tf.nest.flatten(packed), tf.nest.flatten(plain),
                  strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert type(packed[0]) is type(plain[0])  # The state's own containers.


def _dense_loop_factory(traces):
  """`make_fn` for `trace_loop`: a Dense model and a loop that loads `w`
  into it and returns its loss and gradient on `x`; `traces` counts the
  times its Python runs (is traced)."""

  def make_fn():
    layer = tf.keras.layers.Dense(3)
    layer.build((None, 4))

    def fn(w, x):
      traces.append(1)
      layer.kernel.assign(w)
      with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.square(layer(x)))
      return loss, tape.gradient(loss, layer.kernel)

    return fn

  return make_fn


_DENSE_SIGNATURE = (tf.TensorSpec([4, 3]), tf.TensorSpec([None, 4]))


def test_concurrent_shard_loops_each_run_their_own_trace_and_variables():
  """Each loop is traced over its own model (one trace shared by threads
  with other variables bound in corrupted memory); run at once, each gives
  what a loop traced alone gives, on its own variables."""
  traces = []
  runs = [shard_threads.trace_loop(_dense_loop_factory(traces),
                                   _DENSE_SIGNATURE) for _ in range(3)]
  assert len(traces) == 3
  own = []
  reference = tf.function(_dense_loop_factory(own)(),
                          input_signature=_DENSE_SIGNATURE)
  rng = np.random.default_rng(0)
  args = [(rng.normal(size=(4, 3)).astype(np.float32),
           rng.normal(size=(5, 4)).astype(np.float32)) for _ in runs]
  gc.collect()  # The builds' models are gone; their variables must not be.
  futures = [shard_threads.shard_pool().submit(run, *a)
             for run, a in zip(runs, args)]
  got = [f.result() for f in futures]
  for (loss, grad), a in zip(got, args):
    want_loss, want_grad = reference(*a)
    assert float(loss) == float(want_loss)
    np.testing.assert_array_equal(grad, want_grad)
  assert len(traces) == 3  # Not traced again in the threads.


def test_auto_shard_count_takes_the_environment_s_share(monkeypatch):
  monkeypatch.setenv(sharded.AUTO_SHARDS_VAR, '3')
  assert sharded.auto_shard_count() == 3
  monkeypatch.delenv(sharded.AUTO_SHARDS_VAR)
  assert sharded.auto_shard_count() == min(len(os.sched_getaffinity(0)), 8)
  for bad in ('0', '-2', 'two'):
    monkeypatch.setenv(sharded.AUTO_SHARDS_VAR, bad)
    with pytest.raises(ValueError, match=sharded.AUTO_SHARDS_VAR):
      sharded.auto_shard_count()
