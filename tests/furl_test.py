"""FURL: the split-personalization constraint, and private rows stay on clients."""

import collections

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tff_personal.algorithms import furl
from tff_personal.core import evaluation
from tff_personal.core import process
from tff_personal.core import split_model
from tff_personal.models import fedembed_mnist
from tff_personal.models import furl_text
from tff_personal.models import word_lm

NUM_USERS, FEATURES, DIM, LR = 4, 5, 3, 0.1
SPEC = collections.OrderedDict(
    x=tf.TensorSpec([None, FEATURES], tf.float32),
    y=tf.TensorSpec([None], tf.int32))


def _layers():
  return (tf.keras.layers.Dense(8, activation='tanh', name='hidden'),
          tf.keras.layers.Dense(2, name='out'))


def split_model_fn():
  """Federated form: the user's embedding row is a private variable."""
  x = tf.keras.Input(shape=(FEATURES,))
  personal = fedembed_mnist.PersonalEmbedding(DIM, name='user')
  hidden, out = _layers()
  logits = out(hidden(tf.keras.layers.Concatenate()([x, personal(x)])))
  return split_model.SplitModel(
      model=tf.keras.Model(x, logits), private_variables=[personal.embedding],
      loss_fn=furl_text.classification_loss, input_spec=SPEC)


def _user_data(seed):
  rng = np.random.default_rng(seed)
  data = []
  for u in range(NUM_USERS):
    n = 6 + 2 * u
    data.append(collections.OrderedDict(
        x=rng.normal(size=(n, FEATURES)).astype(np.float32),
        y=((np.arange(n) + u) % 2).astype(np.int32)))
  return data


def _reference_round(theta, table, data):
  """All parameters shared (the table too); FedAvg for theta, identity for rows.

  Each user trains a copy of everything on its own data with SGD (batches of
  3); the server sets theta to the example-weighted mean of the users'
  thetas, and row u of the table to user u's locally trained row (FURL eq. 6).
  """
  hidden, out = _layers()
  hidden.build((None, FEATURES + DIM))
  out.build((None, 8))
  params = hidden.trainable_variables + out.trainable_variables
  new_thetas, weights, new_table = [], [], table.copy()
  for u, d in enumerate(data):
    for p, v in zip(params, theta):
      p.assign(v)
    local_table = tf.Variable(table)
    for start in range(0, len(d['y']), 3):
      x = d['x'][start:start + 3]
      y = d['y'][start:start + 3]
      with tf.GradientTape() as tape:
        e = tf.gather(local_table, tf.fill([len(y)], u))
        logits = out(hidden(tf.concat([x, e], axis=1)))
        loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
            y, logits, from_logits=True))
      grads = tape.gradient(loss, params + [local_table])
      for p, g in zip(params, grads[:-1]):
        p.assign_sub(LR * g)
      local_table.assign_sub(LR * tf.convert_to_tensor(grads[-1]))
      # Other users' rows get zero gradient (independent local training).
      others = np.delete(np.arange(NUM_USERS), u)
      np.testing.assert_array_equal(local_table.numpy()[others], table[others])
    new_thetas.append([p.numpy() for p in params])
    weights.append(len(d['y']))
    new_table[u] = local_table.numpy()[u]
  w = np.asarray(weights, np.float64) / np.sum(weights)
  theta = [sum(wi * t[i] for wi, t in zip(w, new_thetas)).astype(np.float32)
           for i in range(len(params))]
  return theta, new_table


def test_split_personalization_constraint():
  """Private rows on clients == shared table with the identity update rule."""
  proc = furl.build_furl(
      lambda dim: split_model_fn,
      client_optimizer=tff.learning.optimizers.build_sgdm(LR),
      server_optimizer=tff.learning.optimizers.build_sgdm(1.0),
      embedding_dim=DIM, seed=11)
  state = proc.initialize()
  theta = [np.asarray(t) for t in proc.get_model_weights(state).trainable]
  table = np.random.default_rng(3).normal(size=(NUM_USERS, DIM)).astype(
      np.float32)
  client_states = [collections.OrderedDict(private=(table[u].copy(),),
                                           rounds_participated=np.int32(0))
                   for u in range(NUM_USERS)]
  for r in range(3):
    data = _user_data(r)
    datasets = [tf.data.Dataset.from_tensor_slices(d).batch(3) for d in data]
    state, client_states, _ = proc.next(state, client_states, datasets)
    theta, table = _reference_round(theta, table, data)
    for ours, ref in zip(proc.get_model_weights(state).trainable, theta):
      np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-5)
    for u in range(NUM_USERS):
      np.testing.assert_allclose(client_states[u]['private'][0], table[u],
                                 rtol=1e-4, atol=1e-5)
  assert np.abs(table).sum() > 0


def test_private_rows_never_reach_the_server():
  config = furl_text.DocumentModelConfig(vocab_size=20, num_classes=5,
                                         max_chars=12, user_embedding_dim=7,
                                         lstm_units=4, mlp_units=6)
  spec = collections.OrderedDict(x=tf.TensorSpec([None, 12], tf.int32),
                                 y=tf.TensorSpec([None], tf.int32))
  proc = furl.build_furl(
      lambda dim: lambda: furl_text.build_federated_model(
          config, input_spec=spec),
      client_optimizer=tff.learning.optimizers.build_sgdm(0.1),
      server_optimizer=tff.learning.optimizers.build_sgdm(1.0), embedding_dim=7)
  sig = proc.next.type_signature
  private = tff.TensorType(np.float32, [7])
  assert list(proc.client_state_type.private) == [private]
  assert sig.result[1].placement is tff.CLIENTS
  server_member = sig.result[0].member
  shared = list(server_member.global_model_weights.trainable)
  assert private not in shared
  assert list(proc.aggregation_value_type) == shared
  # No server-placed value anywhere in the result carries a [7] tensor.
  def tensors(t):
    if isinstance(t, tff.TensorType):
      return [t]
    return [x for child in getattr(t, 'children', lambda: [])() for x in tensors(child)]
  server_tensors = tensors(sig.result[0].member) + tensors(sig.result[2].member)
  assert len(server_tensors) > len(shared)  # weights, optimizer state, metrics
  assert private not in server_tensors
  with pytest.raises(ValueError, match='private parameters'):
    furl.build_furl(lambda dim: None, client_optimizer=None,
                    server_optimizer=None, embedding_dim=0)


def test_cold_start_fine_tunes_only_the_private_state():
  proc = furl.build_furl(
      lambda dim: split_model_fn,
      client_optimizer=tff.learning.optimizers.build_sgdm(LR),
      server_optimizer=tff.learning.optimizers.build_sgdm(1.0),
      embedding_dim=DIM, seed=2)
  weights = proc.get_model_weights(proc.initialize())
  weights_type = proc.next.type_signature.parameter[0].member.global_model_weights
  cold = evaluation.build_cold_start_eval(
      split_model_fn, weights_type, proc.client_state_type,
      tff.learning.optimizers.build_sgdm(1.0))
  plain = evaluation.build_personal_eval(split_model_fn, weights_type,
                                         proc.client_state_type)
  d = _user_data(0)[1]
  train = tf.data.Dataset.from_tensor_slices(d).batch(4).repeat(20)
  test = tf.data.Dataset.from_tensor_slices(d).batch(4)
  state = collections.OrderedDict(private=(np.zeros(DIM, np.float32),),
                                  rounds_participated=np.int32(0))
  before = plain(weights, [state], [test])[0]
  after = cold(weights, [state], [train], [test])[0]
  loss = lambda o: float(np.mean(tf.keras.losses.sparse_categorical_crossentropy(
      o['labels'], o['outputs'], from_logits=True)))
  assert loss(after) < loss(before)  # the embedding adapted to the user
  # With zero steps it is the plain evaluation (shared weights untouched).
  empty = tf.data.Dataset.from_tensor_slices(d).batch(4).take(0)
  np.testing.assert_allclose(cold(weights, [state], [empty], [test])[0]['outputs'],
                             before['outputs'], rtol=1e-6)


def test_private_optimizer_trains_only_private_variables():
  """A separate private optimizer: lr 0 freezes the embedding, not the rest."""
  def build(private_lr):
    return furl.build_furl(
        lambda dim: split_model_fn,
        client_optimizer=tff.learning.optimizers.build_sgdm(LR),
        server_optimizer=tff.learning.optimizers.build_sgdm(1.0),
        embedding_dim=DIM, seed=11,
        private_optimizer=tff.learning.optimizers.build_sgdm(private_lr))
  data = [tf.data.Dataset.from_tensor_slices(d).batch(3)
          for d in _user_data(0)]
  states = [collections.OrderedDict(private=(np.full(DIM, 0.5, np.float32),),
                                    rounds_participated=np.int32(0))
            for _ in range(NUM_USERS)]
  frozen = build(0.0)
  s0 = frozen.initialize()
  s1, new_states, _ = frozen.next(s0, states, data)
  for s in new_states:
    np.testing.assert_array_equal(s['private'][0], states[0]['private'][0])
  moved = sum(float(np.abs(a - b).sum()) for a, b in zip(
      frozen.get_model_weights(s1).trainable,
      frozen.get_model_weights(s0).trainable))
  assert moved > 0
  # The same learning rate as the shared optimizer reproduces the single
  # optimizer exactly (SGD is element-wise).
  single = furl.build_furl(
      lambda dim: split_model_fn,
      client_optimizer=tff.learning.optimizers.build_sgdm(LR),
      server_optimizer=tff.learning.optimizers.build_sgdm(1.0),
      embedding_dim=DIM, seed=11)
  split = build(LR)
  _, a, _ = single.next(single.initialize(), states, data)
  _, b, _ = split.next(split.initialize(), states, data)
  for x, y in zip(a, b):
    np.testing.assert_allclose(x['private'][0], y['private'][0], rtol=1e-6)


@pytest.mark.parametrize('bidirectional', [False, True])
def test_lstm_helper_computes_what_keras_lstm_computes(bidirectional):
  """`word_lm.lstm` (the LSTM of the word LM and of FURL's text encoder)
  equals `tf.keras.layers.LSTM` on the same weights: outputs and gradients,
  on masked, right-padded sequences, forwards and both ways."""
  def build(layer_fn):
    chars = tf.keras.Input(shape=(9,), dtype=tf.int32)
    h = tf.keras.layers.Embedding(30, 4, mask_zero=True)(chars)
    layer = layer_fn(5, return_sequences=not bidirectional)
    if bidirectional:
      layer = tf.keras.layers.Bidirectional(layer)
    return tf.keras.Model(chars, tf.keras.layers.Dense(3)(layer(h)))

  ours, keras = build(word_lm.lstm), build(tf.keras.layers.LSTM)
  ours.set_weights(keras.get_weights())
  rng = np.random.RandomState(0)
  x = rng.randint(1, 30, size=(6, 9))
  for i, length in enumerate(rng.randint(2, 10, size=6)):
    x[i, length:] = 0

  def outputs_and_gradients(model):
    with tf.GradientTape() as tape:
      out = model(x)
      loss = tf.reduce_sum(out ** 2)
    grads = tape.gradient(loss, model.trainable_variables)
    return [out] + [tf.convert_to_tensor(g) for g in grads]

  for a, b in zip(outputs_and_gradients(ours), outputs_and_gradients(keras)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
