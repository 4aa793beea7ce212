"""HypCluster: one cluster is FedAvg; with two, each model moves to the mean
of the local models of the clients that chose it (FedAvg over its cluster),
the choices are each client's best fit, and evaluation re-selects from the
client's own data (a never-trained client of the second population is
served the second model)."""

import numpy as np

from tests import method_testdata as data
from tff_personal.algorithms import fedavg
from tff_personal.algorithms import hypcluster
from tff_personal.core import evaluation
from tff_personal.core import process


def _build(**options):
  return hypcluster.build_hypcluster(
      data.model_fn_factory, client_optimizer=data.sgd(0.1),
      server_optimizer=data.sgd(1.0), seed=3, **options)


def _fedavg(weights=None):
  proc = fedavg.build_global(data.model_fn_factory,
                             client_optimizer=data.sgd(0.1),
                             server_optimizer=data.sgd(1.0), seed=3)
  if weights is None:
    return proc, proc.initialize()
  return proc, proc.set_model_weights(proc.initialize(), process.ModelWeights(
      trainable=tuple(weights), non_trainable=()))


def _members(proc, weights):
  """The trainable weights of each member model, in order."""
  layout = hypcluster.owners(proc.model_fn)
  k = 1 + max(j for _, j in layout)
  return [[w for w, (kind, j) in zip(weights.trainable, layout)
           if kind == 'model' and j == c] for c in range(k)]


def test_one_cluster_is_fedavg():
  proc = _build(num_clusters=1)
  ref, ref_state = _fedavg()
  start = _members(proc, proc.get_model_weights(proc.initialize()))[0]
  ref_state = ref.set_model_weights(ref_state, process.ModelWeights(
      trainable=tuple(start), non_trainable=()))
  clients = data.datasets(3, seed=1)
  state, _ = data.run(proc, data.states([np.int32(0)], 3), clients, rounds=2)
  for _ in range(2):
    ref_state, _, _ = ref.next(ref_state, data.states((), 3), clients)
  data.assert_same(_members(proc, proc.get_model_weights(state))[0],
                   ref_state.global_model_weights.trainable)


def test_each_model_is_its_clusters_fedavg_and_evaluation_reselects():
  # Model 0 fits population A (FedAvg on it); model 1 is model 0 with its
  # head negated, so it fits population B (labels flipped).
  ref, ref_state = _fedavg()
  for r in range(4):
    ref_state, _, _ = ref.next(ref_state, data.states((), 2),
                               data.datasets(2, seed=10 + r, n=8))
  fitted = [np.asarray(w) for w in ref_state.global_model_weights.trainable]
  flipped = fitted[:-2] + [-fitted[-2], -fitted[-1]]
  proc = _build(num_clusters=2)
  layout = hypcluster.owners(proc.model_fn)
  start = [np.float32(0) if kind == 'share' else None for kind, _ in layout]
  it = {0: iter(fitted), 1: iter(flipped)}
  start = [s if kind == 'share' else next(it[j])
           for s, (kind, j) in zip(start, layout)]
  state = proc.set_model_weights(proc.initialize(), process.ModelWeights(
      trainable=tuple(start), non_trainable=()))
  clients = data.datasets(5, seed=2, n=8, flip=(1, 3))
  state, states, _ = proc.next(state, data.states([np.int32(0)], 5), clients)
  choices = [int(s['private'][0]) for s in states]
  assert choices == [0, 1, 0, 1, 0]
  members = _members(proc, proc.get_model_weights(state))
  for cluster, weights in ((0, fitted), (1, flipped)):
    chosen = [c for c, j in zip(clients, choices) if j == cluster]
    fed, fed_state = _fedavg(weights)
    fed_state, _, _ = fed.next(fed_state, data.states((), len(chosen)),
                               chosen)
    data.assert_same(members[cluster],
                     fed_state.global_model_weights.trainable,
                     f'cluster {cluster}')
  for w, (kind, _) in zip(proc.get_model_weights(state).trainable, layout):
    if kind == 'share':
      assert float(w) == 0.0
  # A never-trained client of population B (stored choice 0) is served
  # model 1: evaluation selects on its own training data.
  weights = proc.get_model_weights(state)
  new_b = data.datasets(1, seed=7, n=8, flip=(0,))
  tuned = evaluation.build_cold_start_eval(
      proc.model_fn, proc.model_weights_type, proc.client_state_type,
      proc.eval_fine_tune_optimizer)(
          weights, data.states([np.int32(0)], 1), new_b, new_b)
  plain = evaluation.build_personal_eval(
      proc.model_fn, proc.model_weights_type, proc.client_state_type)
  for choice, same in ((1, True), (0, False)):
    got = plain(weights, data.states([np.int32(choice)], 1), new_b)
    assert np.allclose(tuned[0]['outputs'], got[0]['outputs']) == same
  assert proc.eval_fine_tune
