"""Per-FedAvg: one local step is the MAML step computed independently here
(first order and Hessian-free, the Hessian-vector product by forward-over-
reverse autodiff), and with no adaptation (inner_lr 0) it is FedAvg on the
second halves of the batches."""

import collections

import numpy as np
import pytest
import tensorflow as tf

from tasks import client_data_task
from tests import method_testdata as data
from tests import tiny_client_data
from tff_personal.algorithms import fedavg
from tff_personal.algorithms import per_fedavg
from tff_personal.algorithms import registry
from tff_personal.config import experiment
from tff_personal.config import strategies
from tff_personal.core import runtime
from tff_personal.run import runs


def _build(**options):
  return per_fedavg.build_per_fedavg(data.model_fn_factory,
                                     client_optimizer=data.sgd(0.1),
                                     server_optimizer=data.sgd(1.0), seed=3,
                                     **options)


def test_no_adaptation_is_fedavg_on_the_second_halves():
  clients = data.datasets(3, seed=1, n=8, batch=4)
  second = [d.map(lambda b: per_fedavg.halves(b)[1]) for d in clients]
  want, _ = data.run(fedavg.build_global(
      data.model_fn_factory, client_optimizer=data.sgd(0.1),
      server_optimizer=data.sgd(1.0), seed=3), data.states((), 3), second,
                     rounds=2)
  got, _ = data.run(_build(inner_lr=0.0), data.states((), 3), clients,
                    rounds=2)
  data.assert_same(got.global_model_weights, want.global_model_weights)


def _maml_step(weights, batch, alpha, beta, hessian_free):
  """One MAML step on `batch`, written without the library's step."""
  model = data.model_fn_factory(0)()
  variables = model.model.trainable_variables
  first = tf.nest.map_structure(lambda t: t[:2], batch)
  second = tf.nest.map_structure(lambda t: t[2:], batch)

  def grad(on, at):
    for v, w in zip(variables, at):
      v.assign(w)
    with tf.GradientTape() as tape:
      loss = model.loss(on, model.forward(on, training=True))
    return tape.gradient(loss, variables)

  adapted = [w - alpha * g for w, g in zip(weights, grad(first, weights))]
  meta = grad(second, adapted)
  if hessian_free:
    for v, w in zip(variables, weights):
      v.assign(w)
    with tf.autodiff.ForwardAccumulator(variables, meta) as acc:
      with tf.GradientTape() as tape:
        loss = model.loss(first, model.forward(first, training=True))
      g = tape.gradient(loss, variables)
    hvp = acc.jvp(g)
    meta = [m - alpha * h for m, h in zip(meta, hvp)]
  return [w - beta * m for w, m in zip(weights, meta)]


def test_one_step_is_the_maml_step():
  rng = np.random.default_rng(0)
  batch = collections.OrderedDict(
      x=rng.random((4, 28, 28, 1), dtype=np.float32),
      y=np.array([0, 1, 1, 0], np.int32))
  for hessian_free in (False, True):
    proc = _build(inner_lr=0.3, hessian_free=hessian_free)
    weights = proc.get_model_weights(proc.initialize())
    state, _, _ = proc.next(
        proc.initialize(), data.states((), 1),
        [tf.data.Dataset.from_tensor_slices(batch).batch(4)])
    want = _maml_step([tf.constant(w) for w in weights.trainable],
                      {k: tf.constant(v) for k, v in batch.items()},
                      0.3, 0.1, hessian_free)
    got = state.global_model_weights
    for g, w in zip(got.trainable, want):
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-4,
                                 atol=2e-6)
    if hessian_free:  # the Hessian term mattered
      fo = _maml_step([tf.constant(w) for w in weights.trainable],
                      {k: tf.constant(v) for k, v in batch.items()},
                      0.3, 0.1, False)
      assert max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                 for a, b in zip(fo, want)) > 1e-6






def test_evaluation_is_the_declared_one_step_unless_a_strategy_overrides(
    tmp_path):
  spec = registry.spec('per_fedavg')
  assert strategies.parse(spec.evaluation)[1] == strategies.FineTune(steps=1)
  task = client_data_task.ClientDataTask(
      'one_step', tiny_client_data.client_data(0, num_clients=6),
      tiny_client_data.client_data(1, num_clients=6),
      model_builder=client_data_task.keras_classifier(
          lambda: tf.keras.Sequential([tf.keras.layers.Input(shape=(4,)),
                                       tf.keras.layers.Dense(2)])),
      batch_size=4, evaluate_fn=tiny_client_data.mean_loss)
  config = experiment.ExperimentConfig(
      algorithm='per_fedavg', rounds=1, clients_per_round=3,
      root_output_dir=str(tmp_path), experiment_name='p',
      client_optimizer='sgd', client_learning_rate=0.1, seed=1,
      algorithm_options={'inner_lr': 0.5})
  with runtime.local_runtime():
    run = runs.run_experiment(task, config, log_fn=lambda s: None)
    got = run.evaluate(strategies=[
        'one=fine_tune(steps=1,learning_rate=0.5,optimizer=sgd)',
        'pass=fine_tune(learning_rate=0.5,optimizer=sgd)'])['strategies']
  # The run's own evaluation is the paper's one step at inner_lr (12
  # examples in batches of 4: a pass would be three steps).
  assert run['eval']['loss'] == pytest.approx(got['one']['eval']['loss'],
                                              rel=1e-6)
  assert run['eval']['loss'] != pytest.approx(got['pass']['eval']['loss'],
                                              rel=1e-4)
  whole = registry.build_for_task(
      'per_fedavg', task, client_optimizer=data.sgd(0.1),
      server_optimizer=data.sgd(1.0), test_steps=0)
  assert whole.eval_fine_tune_steps is None
