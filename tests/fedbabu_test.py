"""FedBABU: the head never moves in training (not even under DP noise), the
evaluation fine-tunes the whole model from the global one, and with no head
frozen it is FedAvg+FT."""

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tests import method_testdata as data
from tff_personal.algorithms import fedavg_ft
from tff_personal.algorithms import fedbabu
from tff_personal.core import process


def _build(**options):
  return fedbabu.build_fedbabu(data.model_fn_factory,
                               client_optimizer=data.sgd(0.1),
                               server_optimizer=data.sgd(1.0), seed=3,
                               **options)


def test_no_frozen_head_is_fedavg_ft():
  proc = _build(head_layer=None)
  want = fedavg_ft.build_fedavg_ft_algorithm(
      data.model_fn_factory, client_optimizer=data.sgd(0.1),
      server_optimizer=data.sgd(1.0), seed=3)
  clients = data.datasets(3, seed=1)
  got, _ = data.run(proc, data.states((), 3), clients, rounds=2)
  ref, _ = data.run(want, data.states((), 3), clients, rounds=2)
  data.assert_same(got.global_model_weights, ref.global_model_weights)
  assert proc.eval_fine_tune and want.eval_fine_tune


def test_head_fixed_under_dp_and_evaluation_starts_from_the_whole_model():
  dp = tff.aggregators.DifferentiallyPrivateFactory.gaussian_fixed(
      noise_multiplier=1.0, clients_per_round=3, clip=0.5)
  proc = _build(aggregator_factory=dp)
  initial = proc.get_model_weights(proc.initialize())
  # The head is the only non-trainable weight: broadcast, never aggregated.
  assert [np.shape(w)[-1] for w in initial.non_trainable] == [2, 2]
  assert [t.shape for t in proc.aggregation_value_type] == [
      tuple(np.shape(w)) for w in initial.trainable]
  state, _ = data.run(proc, data.states((), 3), data.datasets(3, seed=2),
                      rounds=2)
  weights = proc.get_model_weights(state)
  for got, want in zip(weights.non_trainable, initial.non_trainable):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert not np.allclose(np.asarray(weights.trainable[0]),
                         np.asarray(initial.trainable[0]))
  # Evaluation: every weight of the unfrozen model, the head trainable
  # again, starting from the global values (head last, as in the model).
  evaluated = process.eval_client_states(
      proc, weights, data.states((), 1))[0]['private']
  with tf.Graph().as_default():
    full = proc.eval_model_fn()
    assert len(full.private_variables) == len(evaluated)
    assert [tuple(v.shape) for v in full.private_variables] == [
        np.shape(x) for x in evaluated]
  flat = list(weights.trainable) + list(weights.non_trainable)
  for got, want in zip(evaluated, flat):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert proc.eval_fine_tune
