"""FedPerC models without TFF: BPE trainer, presets, prefix, generator, costs."""

import os

import keras_nlp
import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tasks import tv_shows
from tff_personal.models import bpe_trainer
from tff_personal.models import fedperc
from tff_personal.models import fedperc_backbone
from tff_personal.models import fedperc_training

TEXTS = ['How you doin? We were on a break!', 'Winter is coming.',
         'A Lannister always pays his debts.', 'I think we must go north.',
         'Could this BE any more awkward?'] * 4
MAX_TOKENS = 12


@pytest.fixture(scope='module')
def spec():
  vocabulary, merges = bpe_trainer.train_bpe(TEXTS, 320)
  return fedperc_backbone.random_backbone(
      vocabulary, merges, hidden_dim=16, num_heads=2, intermediate_dim=32,
      max_sequence_length=16, seed=1)


@pytest.fixture(scope='module')
def batch(spec):
  arrays, _ = tv_shows.encode(spec.tokenizer(), TEXTS[:5], 1, MAX_TOKENS,
                              spec.vocabulary[bpe_trainer.END_TOKEN])
  arrays['context'] = np.array([0, 1, 1, 0, 0], np.int32)
  return {k: tf.constant(v) for k, v in arrays.items()}


def _model(spec, variant, **kwargs):
  model = fedperc.FedPercModel(
      spec, fedperc.FedPercConfig(variant, num_contexts=2,
                                  max_tokens=MAX_TOKENS, generator_heads=2,
                                  generator_utterances=2, **kwargs))
  model.backbone.set_weights(spec.weights)
  return model


def test_bpe_merges_load_into_keras_nlp_tokenizer():
  vocabulary, merges = bpe_trainer.train_bpe(TEXTS, 320)
  assert len(vocabulary) == 320
  assert sorted(vocabulary.values()) == list(range(320))
  assert len(merges) == 320 - 256 - 1
  tokenizer = keras_nlp.models.GPT2Tokenizer(vocabulary=vocabulary,
                                             merges=merges)
  text = 'Winter is coming. Could this BE a break?'
  ids = tokenizer(text)
  assert tokenizer.detokenize(ids).numpy().decode() == text
  # Frequent words were merged into single tokens: fewer ids than bytes.
  assert len(ids) < len(text.encode()) / 2
  # A learned whole-word token is what keras-nlp produces for that word.
  decoder = {u: b for b, u in bpe_trainer.byte_encoder().items()}
  words = [t for t in list(vocabulary)[256:-1]
           if t.startswith('Ġ') and len(t) >= 4]
  assert words
  for token in words:
    word = bytes(decoder[c] for c in token).decode()
    assert tokenizer(word).numpy().tolist() == [vocabulary[token]], word


def test_bpe_rejects_a_too_small_vocabulary():
  with pytest.raises(ValueError, match='vocabulary_size'):
    bpe_trainer.train_bpe(TEXTS, 100)


def test_preset_directory_loads_with_keras_nlp(spec, tmp_path):
  backbone = spec.build_backbone()
  backbone.set_weights(spec.weights)
  preset = str(tmp_path / 'preset')
  fedperc_backbone.save_preset(backbone, spec.tokenizer(), preset)
  loaded = keras_nlp.models.GPT2Backbone.from_preset(preset)
  for a, b in zip(loaded.get_weights(), spec.weights):
    np.testing.assert_array_equal(a, b)
  tokenizer = keras_nlp.models.GPT2Tokenizer.from_preset(preset)
  assert tokenizer.vocabulary == spec.vocabulary
  again = fedperc_backbone.load_backbone(preset)
  assert again.config == {**spec.config, 'dropout': again.config['dropout']}
  with pytest.raises(ValueError, match='neither a directory nor'):
    fedperc_backbone.load_backbone(str(tmp_path / 'missing'))
  os.remove(os.path.join(preset, 'tokenizer.json'))
  with pytest.raises(ValueError, match='tokenizer.json'):
    fedperc_backbone.load_backbone(preset)


def test_zero_head_deltas_equal_the_pretrained_language_model(spec, batch):
  """Split/meta with zero deltas are GPT-2 itself (keras-nlp's own call)."""
  hidden = spec.build_backbone()
  hidden.set_weights(spec.weights)
  states = hidden({'token_ids': batch['ids'], 'padding_mask': batch['mask']})
  logits = fedperc_backbone.lm_logits(hidden, states)[:, :-1]
  losses = tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=batch['ids'][:, 1:], logits=logits)
  weights = tf.cast(batch['mask'][:, 1:], tf.float32) * tf.cast(
      tf.range(1, MAX_TOKENS) >= 3, tf.float32)
  expected = float(tf.reduce_sum(losses * weights))
  for variant in (fedperc.SPLIT, fedperc.META):
    total, count = _model(spec, variant).nll(batch, prompt=3)
    np.testing.assert_allclose(float(total), expected, rtol=1e-5)
    assert float(count) == float(tf.reduce_sum(weights))


def test_prefix_is_personal_times_context_and_changes_predictions(spec, batch):
  model = _model(spec, fedperc.EMBEDDING)
  phi = model.context_embeddings.numpy()
  prefix = model.preference_embeddings(batch['context']).numpy()
  np.testing.assert_allclose(prefix, phi[batch['context'].numpy()])
  model.personal_offset.assign(tf.fill([16], 1.0))  # psi = 2
  np.testing.assert_allclose(
      model.preference_embeddings(batch['context']).numpy(), 2 * prefix,
      rtol=1e-6)
  before = float(model.nll(batch, 3)[0])
  # (A constant shift would be invisible: the first LayerNorm removes it.)
  model.context_embeddings.assign(
      phi + np.random.default_rng(0).normal(size=phi.shape).astype('float32'))
  assert abs(float(model.nll(batch, 3)[0]) - before) > 1e-3
  # Scored tokens are the same for every variant (prompt of three tokens).
  count = float(model.nll(batch, 3)[1])
  assert count == float(_model(spec, fedperc.META).nll(batch, 3)[1])


def test_generator_forward_only_right_shapes_and_future_masked(spec, batch):
  model = _model(spec, fedperc.GENERATED)
  before = [v.numpy().copy() for v in model.shared_trainable_variables +
            model.private_variables]
  offset, table = model.generate(model.personal_offset, batch)
  assert offset.shape == (16,) and table.shape == (2, 16)
  after = [v.numpy() for v in model.shared_trainable_variables +
           model.private_variables]
  for a, b in zip(before, after):
    np.testing.assert_array_equal(a, b)  # Forward passes only.
  # Only context 0 present: context 1 keeps its embedding.
  row = int(np.argmin(batch['mask'].numpy().sum(1)))
  assert int(batch['context'][row]) == 1
  one = {k: v[row:row + 1] for k, v in batch.items()}
  _, table1 = model.generate(model.personal_offset, one)
  np.testing.assert_array_equal(table1[0], model.context_embeddings[0])
  assert not np.allclose(table1[1], model.context_embeddings[1])
  # Padding after the utterance's end does not change what is generated;
  # its last real token does.
  length = int(one['mask'].numpy().sum())
  assert length < MAX_TOKENS
  ids = one['ids'].numpy().copy()
  ids[0, length:] = 7
  padded = dict(one, ids=tf.constant(ids))
  np.testing.assert_allclose(
      model.generate(model.personal_offset, padded)[0],
      model.generate(model.personal_offset, one)[0], rtol=1e-6)
  ids[0, length - 1] = (ids[0, length - 1] + 1) % spec.vocabulary_size
  changed = dict(one, ids=tf.constant(ids))
  assert not np.allclose(model.generate(model.personal_offset, changed)[0],
                         model.generate(model.personal_offset, one)[0])
  # Test-time generation sets the embeddings the prefix uses.
  fedperc_training.generate_embeddings(model, batch)
  np.testing.assert_allclose(model.personal_offset.numpy(), offset, rtol=1e-6)


def test_memory_of_fedperc_is_one_over_vocabulary_of_split(spec):
  embedding = _model(spec, fedperc.EMBEDDING).per_user_parameters()
  split = _model(spec, fedperc.SPLIT).per_user_parameters()
  assert embedding == 16 * (1 + 2)
  assert split == embedding * spec.vocabulary_size


def test_proximal_term_shrinks_the_shared_update(spec, batch):
  data = tf.data.Dataset.from_tensor_slices(batch).batch(5).repeat(10)
  model = _model(spec, fedperc.EMBEDDING)
  weights = tff.learning.models.ModelWeights(
      trainable=tuple(v.numpy() for v in model.shared_trainable_variables),
      non_trainable=tuple(spec.weights))
  private = tuple(v.numpy() for v in model.private_variables)
  norms = []
  for mu in (0.0, 50.0):
    update, _, _, _ = fedperc_training.local_train(
        _model(spec, fedperc.EMBEDDING),
        tff.learning.optimizers.build_sgdm(0.01), weights, private, data, mu)
    norms.append(float(tf.linalg.global_norm(update)))
  # Without the term the update grows with the steps (10 lr g); with it, it
  # stays near g / mu (2 lr g here).
  assert norms[0] > 0 and norms[1] < 0.35 * norms[0]


def test_fine_tune_moves_only_adaptable_variables(spec, batch):
  model = _model(spec, fedperc.EMBEDDING)
  backbone = [w.copy() for w in model.backbone.get_weights()]
  data = tf.data.Dataset.from_tensor_slices(batch).batch(5).repeat(2)
  before = float(model.nll(batch, 0)[0])
  steps = fedperc_training.fine_tune(
      model, tff.learning.optimizers.build_adam(0.05), data)
  assert int(steps) == 2
  assert float(model.nll(batch, 0)[0]) < before
  for a, b in zip(backbone, model.backbone.get_weights()):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize('graph', [False, True])
def test_generator_variables_are_the_ones_a_first_call_makes(graph):
  """`create_variables` makes the variables a first call would make: the
  same order, shapes and (seeded) initial values, eagerly and in a graph."""

  def make(by_call):
    tf.keras.utils.set_random_seed(3)
    generator = fedperc.EmbeddingGenerator(8, 2, name='generator')
    if by_call:
      generator(tf.zeros([1, 8]), tf.zeros([1, 2, 8]), tf.ones([1, 2]))
    else:
      generator.create_variables()
    return generator.trainable_variables

  def values(by_call):
    if not graph:
      return [v.numpy() for v in make(by_call)]
    with tf.Graph().as_default():
      variables = make(by_call)
      with tf.compat.v1.Session() as session:
        session.run(tf.compat.v1.global_variables_initializer())
        return session.run(variables)

  want, got = values(True), values(False)
  assert len(got) == len(want) == 20
  for x, y in zip(got, want):
    np.testing.assert_array_equal(x, y)
