"""Conformance of every registered algorithm (parametrized over the registry).

For every `registry.SPECS` entry, on tiny synthetic clients:
* sharded equals one-user-per-client (`core/sharded.py`): the same server
  state and client states after two rounds, with ragged users; so does
  the batched form (users trained together), which exists exactly for
  the algorithms the registry declares `batched`;
* a new client's state is the process's declared one (`initial_private`)
  or the run's seeded draw, and evaluation takes the state type it declares;
* the privacy invariant on the types: client states stay at CLIENTS, and
  the one aggregated value is the shared weights' update;
* one round run twice from the same inputs is bit-identical, in both forms.
  Client randomness is stateless (seeded), and the rerun's data reshuffle on
  every iteration and repeat for two epochs, so a client computation whose
  passes over the data were not ordered (Ditto had one:
  `feddva_process_test`) shows as a difference.
FedPerC's entries (model kind 'fedperc') run on a tiny random-weight
backbone and utterance batches (`fedperc_testdata`). Degenerate cases:
Ditto's and FedAvg+FT's global model is FedAvg's
(`global`), exactly, whatever Ditto's lambda. (FedDVA's rounds run twice
are `determinism_test`.)
"""

import collections
import dataclasses
import types

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tests import fedembed_testdata
from tests import fedperc_testdata
from tests import graph_loops
from tests import process_test
from tff_personal.algorithms import registry
from tff_personal.config import experiment
from tff_personal.core import process as process_lib
from tff_personal.core import sharded


# The paper's models with a small encoder (`fedembed_testdata.tiny_encoder`):
# the invariants are of the wiring, not of the architecture.
_TASK = types.SimpleNamespace(
    name='synthetic',
    model_fn_factory=fedembed_testdata.tiny_preference_factory,
    fedembed_model_fn_factory=fedembed_testdata.tiny_factory,
    supports_personal_embedding=True, has_named_head=True,
    has_digit_images=True)


def _is_fedperc(name):
  return registry.spec(name).model == 'fedperc'


def _build(name, **overrides):
  # Local SGD, not Adam: weights whose gradients are zero but for float
  # noise (e.g. the attention key biases of FedPerC's generators, or a
  # CNN's rarely reached units) would get Adam steps of about the learning
  # rate whose sign follows the summation order, which sharding changes.
  kwargs = dict(client_optimizer=tff.learning.optimizers.build_sgdm(0.1),
                server_optimizer=tff.learning.optimizers.build_sgdm(1.0),
                seed=2)
  if _is_fedperc(name):
    kwargs['client_optimizer'] = tff.learning.optimizers.build_sgdm(0.5)
    return registry.build_for_task(name, fedperc_testdata.TASK,
                                   **dict(kwargs, **overrides))
  if name in ('pfedkm', 'fedembed_som'):
    kwargs['num_subpopulations'] = 3
  if name == 'fedembed_som' and 'aggregator_factory' not in overrides:
    kwargs['allow_unprotected_best_client'] = True  # The paper's SOM.
  if name in ('global_plus', 'furl'):
    kwargs['embedding_dim'] = 28  # the MNIST model's diagonal channel
  kwargs.update(overrides)
  return registry.build_for_task(name, _TASK, **kwargs)


def _datasets(sizes, round_num, typed=True):
  """Users with different example counts; fixed order (no reshuffling, so
  both forms see the same batches however often a step reads them)."""
  rng = np.random.default_rng([round_num, 5])
  out = []
  for u, n in enumerate(sizes):
    y = (np.arange(n) % 2).astype(np.int32)
    data = collections.OrderedDict(
        x=rng.random((n, 28, 28, 1), dtype=np.float32), y=y)
    if typed:
      data['type'] = np.where(y == 1, u % 3, (u + 1) % 3).astype(np.int32)
    out.append(tf.data.Dataset.from_tensor_slices(data).batch(3))
  return out


def _run(proc, client_states, sizes, rounds=2, typed=True,
         data_fn=None):
  data_fn = data_fn or (lambda sizes, r: _datasets(sizes, r, typed))
  state, metrics = proc.initialize(), None
  for r in range(rounds):
    state, client_states, metrics = proc.next(state, client_states,
                                              data_fn(sizes, r))
  return state, client_states, metrics


def _close(a, b, what):
  """Equal up to float32 summation order. Adam's first steps divide by the
  gradient's own scale, so an element whose gradient is near zero can move
  by a few 1e-5 more in one form than in the other (seen on some CPUs'
  oneDNN kernels); a wiring error moves weights by the learning rate."""
  flat_a, flat_b = tf.nest.flatten(a), tf.nest.flatten(b)
  assert len(flat_a) == len(flat_b), what
  for i, (x, y) in enumerate(zip(flat_a, flat_b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4,
                               atol=5e-5, err_msg=f'{what}: leaf {i}')


def _check_same_rounds(got, want, what):
  """Two forms' `_run` results agree: server weights, every client's
  state, the last round's training metrics (`_close`)."""
  (got_state, got_clients, got_metrics), (
      want_state, want_clients, want_metrics) = got, want
  _close(got_state.global_model_weights, want_state.global_model_weights,
         f'{what} server weights')
  for u, (g, w) in enumerate(zip(got_clients, want_clients)):
    _close(g, w, f'{what} client {u}')
  assert got_metrics['train'].keys() == want_metrics['train'].keys(), what
  _close(got_metrics['train'], want_metrics['train'], f'{what} metrics')


def _check_new_clients(name, proc, tmp_path):
  """A new client's state is the declared one; evaluation takes the state
  type the process declares."""
  config = experiment.ExperimentConfig(
      algorithm=name, rounds=1, clients_per_round=1,
      root_output_dir=str(tmp_path), experiment_name='x', seed=3)
  initial = experiment.initial_client_state_fn(proc, config)
  a, b = initial(0), initial(1)
  private = lambda s: [np.asarray(x)
                       for x in s[process_lib.CLIENT_STATE_PRIVATE]]
  if proc.initial_private is not None:  # e.g. Ditto: the initial global model
    want = [np.asarray(w) for w in proc.initial_private]
    for got in (private(a), private(b)):
      for x, y in zip(got, want):
        np.testing.assert_array_equal(x, y)
    if _is_fedperc(name):  # a fresh user: psi = 1, no head delta
      assert all(not np.any(w) for w in want)
    else:  # a personal model that starts as the initial global model
      weights = proc.get_model_weights(proc.initialize()).trainable
      for x, y in zip(want, weights):
        np.testing.assert_array_equal(x, np.asarray(y))
  else:
    # personal_init='model' (the default): the model's own initializers,
    # the same draw on every call; a layer initialized to a constant (a
    # zero embedding) starts every client alike.
    again = initial(0)
    for x, y in zip(private(a), private(again)):
      np.testing.assert_array_equal(x, y)
    # personal_init='normal': the seeded draw, whose float leaves differ
    # between clients.
    normal = experiment.initial_client_state_fn(
        proc, dataclasses.replace(config, personal_init='normal'))
    pairs = [(x, y) for x, y in zip(private(normal(0)), private(normal(1)))
             if x.dtype.kind == 'f' and x.size]
    assert not pairs or not all(np.array_equal(x, y) for x, y in pairs)
  evaluated = process_lib.eval_client_states(
      proc, proc.get_model_weights(proc.initialize()), [a])[0]
  want_type = proc.eval_client_state_type.private
  assert [tuple(np.shape(x)) for x in evaluated['private']] == [
      tuple(t.shape) for t in want_type]


def _shuffled_datasets(name, num=3, n=6):
  """Equal-sized users whose data reshuffle on every iteration (seeded) and
  repeat for two epochs."""
  if _is_fedperc(name):  # Batches of 4: generated scores 2 beyond its 2.
    return [d.unbatch().shuffle(n, seed=7, reshuffle_each_iteration=True)
            .repeat(2).batch(4)
            for d in fedperc_testdata.datasets([n] * num, 0)]
  return [d.unbatch().shuffle(n, seed=7, reshuffle_each_iteration=True)
          .repeat(2).batch(2) for d in _datasets([n] * num, 11)]


# Known exception: FedPerC-generated's round can differ from itself at
# float rounding, growing through the local steps (TensorFlow's CPU `AddN`
# sums in an order that follows the schedule; the cause and the
# measurements are in docs/architecture.md, "Crash consistency"). Every
# other algorithm, in both forms, is held bit-identical. This one is held
# to its round's change: per leaf, |first - second| <= 1e-2 of the change
# the round made (an unordered pass over the data changes a round by its
# own size, far more), plus 1e-9 for a leaf that the round moves by
# rounding alone (an attention key bias, whose exact gradient is zero, moved
# by 4e-13 and differed by 2e-13).
_ROUNDING_ONLY = ('fedperc_generated',)
_CHANGE_RTOL = 1e-2
_ROUNDING_ATOL = 1e-9
_flat = fedembed_testdata.flat


def _check_rerun_is_identical(name, proc, what):
  """One round from the same state, client states and data, twice."""
  state = proc.initialize()
  states = fedembed_testdata.initial_states(proc, 3, seed=5)
  first = proc.next(state, states, _shuffled_datasets(name))
  second = proc.next(state, states, _shuffled_datasets(name))
  a, b = _flat(first), _flat(second)
  assert len(a) == len(b), what
  if name in _ROUNDING_ONLY:
    # The round's inputs, leaf for leaf with its outputs (the metrics,
    # which have no input, are compared with themselves).
    before = _flat((state, states))
    before += [np.zeros_like(x) for x in a[len(before):]]
    assert [np.shape(x) for x in before] == [np.shape(x) for x in a]
    for i, (x, y, x0) in enumerate(zip(a, b, before)):
      change = np.linalg.norm(np.asarray(x, np.float64) - x0)
      gap = np.linalg.norm(np.asarray(x, np.float64) - y)
      assert gap <= _CHANGE_RTOL * change + _ROUNDING_ATOL, (
          f'{what}: leaf {i} differs by {gap:.3g}, more than '
          f'{_CHANGE_RTOL} of the round\'s change {change:.3g} plus '
          f'{_ROUNDING_ATOL}')
  else:
    for i, (x, y) in enumerate(zip(a, b)):
      np.testing.assert_array_equal(x, y, err_msg=f'{what}: leaf {i}')
  # The round did something (else equality would say nothing).
  assert any(not np.array_equal(x, y) for x, y in zip(
      _flat(first[0].global_model_weights.trainable),
      _flat(state.global_model_weights.trainable))), what


def _check_only_shared_weights_aggregate(proc, spy):
  """The privacy invariant on the types: client states stay at CLIENTS and
  the one aggregated value is the shared weights' update (plus statistics
  none of which has a private variable's shape)."""
  sig = proc.next.type_signature  # Builds the computation (and aggregator).
  assert [spy.value_types[0]] == [proc.aggregation_value_type]
  assert sig.parameter[1].placement is tff.CLIENTS
  assert sig.result[1].placement is tff.CLIENTS
  assert (sig.parameter[1].member == sig.result[1].member ==
          proc.client_state_type)
  server_weights = sig.parameter[0].member.global_model_weights.trainable
  aggregated = spy.value_types[0]
  if isinstance(aggregated[0], tff.StructType):
    # Algorithms that also aggregate statistics (the SOM update and score of
    # fedembed_som, the k-means sums of pfedkm) send <model update, stats>;
    # no statistic may have the shape of a private variable.
    model_update, statistics = aggregated[0], list(aggregated)[1:]
    flat = lambda t: tf.nest.flatten(tff.types.type_to_tf_tensor_specs(t))
    private_shapes = {tuple(s.shape) for s in flat(proc.client_state_type)
                      if s.dtype == tf.float32}
    assert not any(tuple(s.shape) in private_shapes
                   for t in statistics for s in flat(t))
    aggregated = model_update
  assert list(aggregated) == list(server_weights)
  # The aggregated value is exactly the trained model's shared trainable
  # variables; every private variable is in the client state instead (the
  # evaluated model's private part is the state evaluation reads: Ditto's
  # personal copy, FedAvg+FT's fine-tuned copy).
  with tf.Graph().as_default():
    model = proc.model_fn()
    shared = [tuple(v.shape) for v in model.shared_trainable_variables]
    private = [tuple(v.shape) for v in model.private_variables]
    private_refs = {v.ref() for v in model.private_variables}
    assert not any(v.ref() in private_refs
                   for v in model.shared_trainable_variables)
    evaluated = [tuple(v.shape) for v in proc.eval_model_fn().private_variables]
  assert [tuple(t.shape) for t in aggregated] == shared
  if proc.eval_model_fn is proc.model_fn:
    assert [tuple(t.shape) for t in proc.client_state_type.private] == private
  assert [tuple(t.shape) for t in
          proc.eval_client_state_type.private] == evaluated


_SINGLE = sorted(n for n, s in registry.SPECS.items() if not s.staged)


@pytest.mark.parametrize('name', _SINGLE)
def test_sharded_equals_one_user_per_client_new_clients_and_reruns(
    name, tmp_path):
  spy = process_test.SpyFactory()  # MeanFactory, the default, recording.
  base = _build(name, aggregator_factory=spy, **(
      {'allow_unprotected_best_client': True} if name == 'fedembed_som'
      else {}))
  _check_only_shared_weights_aggregate(base, spy)
  _check_new_clients(name, base, tmp_path)
  assert sharded.resolve_num_shards(base, sharded.AUTO) > 0, (
      f'{name} has no per-user client step: it cannot run sharded')
  sizes = [5, 8, 3, 6, 4]  # Two shards of unequal users, ragged batches.
  init = fedembed_testdata.initial_states(base, len(sizes), seed=4)
  data_fn = fedperc_testdata.datasets if _is_fedperc(name) else None
  want_state, want_clients, want_metrics = _run(base, init, sizes,
                                                data_fn=data_fn)
  # The sharded form of the same process: it traces its own shard loop
  # over its own model, and shares no variable with `base`'s rounds.
  in_shards = sharded.ShardedProcess(base, 2)
  # The last round's training metrics are shard sums, then their sum.
  _check_same_rounds(_run(in_shards, init, sizes, data_fn=data_fn),
                     (want_state, want_clients, want_metrics), name)
  # Each user's steps load and assign the shard's one model, so no graph
  # loop over them may run iterations at once (a read-only pass over the
  # model then overlapped the next user's assignment: PFedKM's rounds
  # differed between runs).
  loops = in_shards.driver_work.traced_loops
  assert loops, name
  for loop in loops:
    assert not graph_loops.overlapping_variable_loops(loop), (
        name, graph_loops.overlapping_variable_loops(loop))
  moved = [not np.allclose(np.asarray(x), np.asarray(y)) for x, y in zip(
      tf.nest.flatten(want_state.global_model_weights.trainable),
      tf.nest.flatten(base.initialize().global_model_weights.trainable))]
  assert any(moved), f'{name}: the rounds changed nothing'
  _check_rerun_is_identical(name, base, f'{name} run twice')
  _check_rerun_is_identical(name, in_shards, f'{name} sharded, run twice')
  _check_batched_form(name, base, init, sizes, data_fn,
                      (want_state, want_clients, want_metrics))


def _check_batched_form(name, base, init, sizes, data_fn, want):
  """The batched form (users trained together) exists exactly when the
  registry declares it, and then equals one user per client after two
  rounds of the same ragged users: server weights, every client's state,
  the metrics."""
  declared = registry.spec(name).batched
  try:
    batched = sharded.ShardedProcess(base, 2, batched=True)
  except ValueError as e:
    assert 'cannot run batched' in str(e), (name, str(e))
    assert not declared, f'{name} is declared batched, but: {e}'
    return
  assert declared, (f'{name} runs batched: declare it '
                    '(AlgorithmSpec.batched) so --list says so')
  _check_same_rounds(_run(batched, init, sizes, data_fn=data_fn), want,
                     f'{name} batched')


def test_staged_algorithms_declare_which_run_batched():
  """A staged algorithm runs batched when every stage's process does
  (the run path shards each stage alike), and the registry says which."""
  for name in sorted(n for n, s in registry.SPECS.items() if s.staged):
    # The stages' processes; a group stage's groups come from the run.
    staged = registry.build_for_task(
        name, types.SimpleNamespace(**vars(_TASK), groups=True),
        client_optimizer=tff.learning.optimizers.build_sgdm(0.1),
        server_optimizer=tff.learning.optimizers.build_sgdm(1.0), seed=2,
        **(dict(pretrain_rounds=2, dim=2, channels='2,2,2,3', hidden=5)
           if name == 'feddva' else {}))
    refused = []
    for stage in staged.stages:
      try:
        sharded.ShardedProcess(stage.process, 2, batched=True)
      except ValueError as e:
        refused.append(f'{stage.name}: {e}')
    assert registry.spec(name).batched == (not refused), (name, refused)


@pytest.mark.parametrize('name,options', [
    ('ditto', {'lam': 0.0}), ('ditto', {'lam': 5.0}), ('fedavg_ft', {})])
def test_global_model_is_fedavgs(name, options):
  """Ditto's personal pass and FedAvg+FT's fine-tuning never touch the
  global model: it follows FedAvg's trajectory exactly."""
  sizes = [4, 7, 5]
  fedavg = _build('global')
  proc = _build(name, **options)
  want, _, _ = _run(fedavg, fedembed_testdata.initial_states(fedavg, 3), sizes)
  init = [collections.OrderedDict(
      private=tuple(np.asarray(w) for w in (proc.initial_private or ())),
      rounds_participated=np.int32(0)) for _ in sizes]
  got, clients, _ = _run(proc, init, sizes)
  for x, y in zip(tf.nest.flatten(got.global_model_weights),
                  tf.nest.flatten(want.global_model_weights)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  if name == 'ditto':  # the personal models trained, apart from the global
    personal = tf.nest.flatten(clients[0]['private'])
    assert not all(np.array_equal(np.asarray(p), np.asarray(g)) for p, g in
                   zip(personal, tf.nest.flatten(
                       got.global_model_weights.trainable)))


def test_staged_feddva_stages_shard_and_hand_over():
  """FedDVA's two stages: each shards like one user per client (its
  reparameterisation noise is seeded per user), and the classifier starts
  from the pre-trained encoders."""
  staged = _build('feddva', pretrain_rounds=2, dim=2, channels='2,2,2,3',
                  hidden=5)
  assert registry.spec('feddva').staged
  assert registry.earlier_rounds('feddva', {'pretrain_rounds': 2}) == 2
  assert [s.name for s in staged.stages] == ['pretrain', 'classifier']
  sizes = [5, 8, 3]
  pretrain = staged.stages[0].process
  decoders = [collections.OrderedDict(
      private=tuple(np.asarray(w) for w in pretrain.initial_private),
      rounds_participated=np.int32(0)) for _ in sizes]
  want_state, want_clients, _ = _run(pretrain, decoders, sizes, typed=False)
  again = _build('feddva', pretrain_rounds=2, dim=2, channels='2,2,2,3',
                 hidden=5).stages[0].process
  got_state, got_clients, _ = _run(sharded.ShardedProcess(again, 2),
                                   decoders, sizes, typed=False)
  _close(got_state.global_model_weights, want_state.global_model_weights,
         'feddva pretrain server weights')
  for u, (got, want) in enumerate(zip(got_clients, want_clients)):
    _close(got, want, f'feddva decoder {u}')
  classifier = staged.final
  start = staged.stages[1].handoff(want_state)
  encoders = tf.nest.flatten(
      pretrain.get_model_weights(want_state).trainable)
  head = tf.nest.flatten(classifier.get_model_weights(start).trainable)
  assert len(head) > len(encoders)
  for x, y in zip(encoders, head):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  fresh = tf.nest.flatten(
      classifier.get_model_weights(classifier.initialize()).trainable)
  assert not all(np.array_equal(np.asarray(x), np.asarray(y))
                 for x, y in zip(fresh[:len(encoders)], head))
