"""FedPer and LG-FedAvg, the two layer splits: each is FedAvg with part of
the model kept on the client (one round from a shared start equals FedAvg's
round, split), and each reduces to FedAvg when nothing is private."""

import numpy as np
import pytest
import tensorflow as tf

from tests import method_testdata as data
from tff_personal.algorithms import fedavg
from tff_personal.algorithms import fedper
from tff_personal.algorithms import lg_fedavg
from tff_personal.core import process

_ALGORITHMS = {'fedper': fedper.build_fedper,
               'lg_fedavg': lg_fedavg.build_lg_fedavg}


def _build(name, **options):
  return _ALGORITHMS[name](data.model_fn_factory, client_optimizer=data.sgd(
      0.1), server_optimizer=data.sgd(1.0), seed=3, **options)


def _global():
  return fedavg.build_global(data.model_fn_factory,
                             client_optimizer=data.sgd(0.1),
                             server_optimizer=data.sgd(1.0), seed=3)


@pytest.mark.parametrize('name,options', [
    ('fedper', {'head_layer': None}),
    ('lg_fedavg', {'shared_layers': 'encoder,head'})])
def test_nothing_private_is_fedavg(name, options):
  proc = _build(name, **options)
  assert not proc.client_state_type.private
  clients = data.datasets(3, seed=1)
  want, _ = data.run(_global(), data.states((), 3), clients, rounds=2)
  got, _ = data.run(proc, data.states((), 3), clients, rounds=2)
  data.assert_same(got.global_model_weights, want.global_model_weights,
                   name)


@pytest.mark.parametrize('name', ['fedper', 'lg_fedavg'])
def test_one_round_from_the_global_model_is_fedavgs_round_split(name):
  """Every client's private part starting at the global model's values,
  one round trains each client's whole model as FedAvg does: the shared
  weights become FedAvg's, and each client keeps its locally trained
  private part (FedAvg's local model there), which never reached the
  server."""
  proc = _build(name)
  fedavg_proc = _global()
  full = [np.asarray(w) for w in
          fedavg_proc.get_model_weights(fedavg_proc.initialize()).trainable]
  shared = [np.asarray(w) for w in
            proc.get_model_weights(proc.initialize()).trainable]
  # Which of the full model's variables are shared, by position and shape.
  with tf.Graph().as_default():
    model = proc.model_fn()
    private_refs = {v.ref() for v in model.private_variables}
    is_private = [v.ref() in private_refs
                  for v in model.model.trainable_variables]
  assert any(is_private) and not all(is_private)
  assert [s.shape for s in shared] == [
      f.shape for f, p in zip(full, is_private) if not p]
  start = [f for f, p in zip(full, is_private) if p]
  shared_start = [f for f, p in zip(full, is_private) if not p]
  state = proc.set_model_weights(proc.initialize(), process.ModelWeights(
      trainable=tuple(shared_start), non_trainable=()))
  clients = data.datasets(3, seed=2, flip=(1,))
  want, _ = data.run(fedavg_proc, data.states((), 3), clients)
  state, new_clients, _ = proc.next(state, data.states(start, 3), clients)
  want_full = [np.asarray(w) for w in want.global_model_weights.trainable]
  data.assert_same(state.global_model_weights.trainable,
                   [w for w, p in zip(want_full, is_private) if not p],
                   f'{name} shared weights')
  # Each client's private part is its own local model's: they differ, and
  # none equals the averaged one.
  privates = [[np.asarray(x) for x in c['private']] for c in new_clients]
  averaged = [w for w, p in zip(want_full, is_private) if p]
  assert not all(np.allclose(a, b) for a, b in zip(privates[0], privates[1]))
  assert not all(np.allclose(a, b) for a, b in zip(privates[1], averaged))
  mean = [np.mean([p[i] for p in privates], axis=0)
          for i in range(len(averaged))]
  data.assert_same(mean, averaged, f'{name}: mean of the private parts')
