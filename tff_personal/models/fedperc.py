"""FedPerC's models: a frozen GPT-2 with preference embeddings, and baselines.

All variants share one frozen keras-nlp `GPT2Backbone` (its weights are the
shared *non-trainable* `ModelWeights`, broadcast and never updated) and differ
in what is learned (Silva, Tambwekar & Gombolay, FedPerC):

* `embedding` (FedPerC, FedPerC (Frozen)): a personal embedding psi (private
  client state) and one context embedding phi_c per context (shared) are
  multiplied element-wise into one preference embedding, which is prepended to
  the token embeddings as a one-token prefix (prefix-tuning, section 3.1).
  Reading: psi is parametrised as `1 + personal_offset` and the offset is the
  client state (zero for a fresh user), so a fresh user's preference
  embedding is exactly phi_c, and the DP average of section 3.2 is taken over
  offsets whose scale is known (clipping needs that). The paper does not say
  how psi and phi are initialised.
* `generated` (FedPerC (Generated), Algorithm 2): as `embedding`, but psi and
  phi_c are *predicted* from a user's utterances by two embedding generators
  (`EmbeddingGenerator`, Appendix A; shared parameters), so a new user is
  personalized with forward passes only.
* `split` (Split-Learning baseline): a personal output head per user (client
  state) and one output head per context (shared); "the last layer is
  unfrozen". Reading: logits = h (E^T + D_user + D_context) where E^T is
  GPT-2's tied output layer and the D's are learned deltas starting at zero;
  this equals two heads W_user = E^T/2 + D_user and W_context = E^T/2 +
  D_context whose logits are summed, started from the pre-trained layer.
* `meta` (Meta-Learning baseline): one shared unfrozen output layer
  E^T + D (D shared, zero at the start), fine-tuned locally at test time.

Batches are dicts `ids` (int32 [B, L], right-padded), `mask` (int32 [B, L])
and `context` (int32 [B]). Utterances end with GPT-2's `<|endoftext|>`.
With a prefix, output position t predicts token t (the prefix predicts the
first token); without one, position t predicts token t+1. Losses and
perplexities count a token t only when `t >= prompt` (prompt 3 in the
evaluation: the first three tokens are given), so all variants are scored on
the same tokens.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import tensorflow as tf

from tff_personal.models import fedperc_backbone

EMBEDDING = 'embedding'
GENERATED = 'generated'
SPLIT = 'split'
META = 'meta'
VARIANTS = (EMBEDDING, GENERATED, SPLIT, META)


@dataclasses.dataclass(frozen=True)
class FedPercConfig:
  """What is learned on top of the frozen backbone.

  Attributes:
    variant: one of `VARIANTS`.
    num_contexts: number of contexts (shows, subreddits).
    max_tokens: padded utterance length L (prefix excluded).
    generator_heads: attention heads of each embedding generator.
    generator_utterances: in each local training step of `generated`, the
      first this many utterances of the batch feed the generators and the
      loss is taken on the others (so the generator cannot copy the tokens it
      is scored on; at test time it reads the fine-tuning utterances and is
      scored on unseen ones). The paper does not say how a batch is split.
    context_init_stddev: stddev of the initial context embeddings.
    generator_tokens: the generators read at most this many first tokens
      of each utterance (0: all). The recurrence of Appendix A is sequential
      in the tokens; on a CPU a bound keeps it affordable.
  """
  variant: str
  num_contexts: int
  max_tokens: int = 32
  generator_heads: int = 4
  generator_utterances: int = 5
  context_init_stddev: float = 0.02
  generator_tokens: int = 0

  def __post_init__(self):
    if self.variant not in VARIANTS:
      raise ValueError(f'unknown FedPerC variant {self.variant!r}; '
                       f'known: {VARIANTS}')
    if self.num_contexts < 1:
      raise ValueError(f'num_contexts must be >= 1, got {self.num_contexts}')
    if self.max_tokens < 4:
      raise ValueError(f'max_tokens must be >= 4 (3 prompt tokens and one to '
                       f'predict), got {self.max_tokens}')


def _build(layer: tf.keras.layers.Layer, shape: tf.TensorShape) -> None:
  with tf.name_scope(layer.name):
    layer.build(shape)
  layer.built = True


class EmbeddingGenerator(tf.keras.layers.Layer):
  """FedPerC Appendix A: a transformer decoder block that updates an embedding.

  For each utterance, starting from `e_0` (the current personal or context
  embedding), at every time step t (future-masked: only the word embeddings
  W_{<t} are visible):

      e_t = MultiHeadAttn(query=LN(e_{t-1}), keys=values=W_{<t})
      e_t = LN(LN(e_t) + LN(e_{t-1}))
      e_t = LN(FFN(e_t) + LN(e_{t-1}))

  and the final e_T is the utterance's generated embedding. Padding steps
  leave e unchanged. Keras' `MultiHeadAttention` and `LayerNormalization` do
  the work; the recurrence over time steps is a `tf.while_loop`. The layers'
  variables are made by `create_variables`, before any call: the loop's body
  can create none.
  """

  def __init__(self, hidden_dim: int, num_heads: int, **kwargs):
    super().__init__(**kwargs)
    if hidden_dim % num_heads:
      raise ValueError(f'hidden_dim {hidden_dim} is not divisible by '
                       f'generator_heads {num_heads}')
    self._hidden_dim = hidden_dim
    self.attention = tf.keras.layers.MultiHeadAttention(
        num_heads=num_heads, key_dim=hidden_dim // num_heads, name='attention')
    self.ln_previous = tf.keras.layers.LayerNormalization(name='ln_previous')
    self.ln_attention = tf.keras.layers.LayerNormalization(name='ln_attention')
    self.ln_middle = tf.keras.layers.LayerNormalization(name='ln_middle')
    self.ln_output = tf.keras.layers.LayerNormalization(name='ln_output')
    self.ffn_in = tf.keras.layers.Dense(4 * hidden_dim, activation='gelu',
                                        name='ffn_in')
    self.ffn_out = tf.keras.layers.Dense(hidden_dim, name='ffn_out')

  def create_variables(self) -> None:
    """Makes every variable, in the order a first call would make them.

    Each layer is built from its input shape, so no trace of the recurrence
    is needed (a dummy call would trace and autograph the `tf.while_loop`,
    which in graph mode costs more than the rest of the model's build). The
    initial values are the ones a first call would give.
    """
    hidden = self._hidden_dim
    vector = tf.TensorShape([None, hidden])
    sequence = tf.TensorShape([None, None, hidden])
    with tf.name_scope(self.name):
      _build(self.ln_previous, vector)
      attention = self.attention
      with tf.name_scope(attention.name):
        attention._build_from_signature(  # pylint: disable=protected-access
            tf.TensorShape([None, 1, hidden]), sequence, sequence)
        # pylint: disable=protected-access
        _build(attention._query_dense, tf.TensorShape([None, 1, hidden]))
        _build(attention._key_dense, sequence)
        _build(attention._value_dense, sequence)
        _build(attention._output_dense, tf.TensorShape(
            [None, 1, attention._num_heads, attention._value_dim]))
        # pylint: enable=protected-access
      attention.built = True
      for layer, shape in ((self.ln_attention, vector),
                           (self.ln_middle, vector), (self.ffn_in, vector),
                           (self.ffn_out, tf.TensorShape([None, 4 * hidden])),
                           (self.ln_output, vector)):
        _build(layer, shape)
    self.built = True

  def call(self, initial: tf.Tensor, words: tf.Tensor,
           mask: tf.Tensor) -> tf.Tensor:
    """initial [N, H], words [N, T, H], mask [N, T] -> generated [N, H]."""
    mask = tf.cast(mask, tf.bool)
    length = tf.shape(words)[1]
    positions = tf.range(length)

    def step(t, e):
      visible = tf.logical_and(mask, positions[None, :] < t)  # W_{<t}
      previous = self.ln_previous(e)
      attended = self.attention(previous[:, None, :], words, words,
                                attention_mask=visible[:, None, :])[:, 0]
      x = self.ln_middle(self.ln_attention(attended) + previous)
      x = self.ln_output(self.ffn_out(self.ffn_in(x)) + previous)
      return t + 1, tf.where(tf.gather(mask, t - 1, axis=1)[:, None], x, e)

    # One time step at a time: the steps read the layers' variables, which
    # the training around them assigns (`shard_packing.PackedBatches.reduce`).
    _, e = tf.while_loop(lambda t, _: t <= length, step,
                         (tf.constant(1), initial), parallel_iterations=1)
    return e


class FedPercModel:
  """The frozen backbone plus the variant's learned parts (fresh variables).

  `shared_trainable_variables` are averaged by the server,
  `private_variables` are client state, `shared_non_trainable_variables` are
  the frozen backbone's weights.
  """

  def __init__(self, spec: fedperc_backbone.BackboneSpec,
               config: FedPercConfig, seed: int = 0):
    self.spec = spec
    self.config = config
    self.backbone = spec.build_backbone()
    hidden, vocab, contexts = (spec.hidden_dim, spec.vocabulary_size,
                               config.num_contexts)
    if config.max_tokens + 1 > spec.max_sequence_length:
      raise ValueError(
          f'max_tokens {config.max_tokens} + 1 prefix exceeds the backbone\'s '
          f'max_sequence_length {spec.max_sequence_length}')
    self.shared_trainable_variables: list[tf.Variable] = []
    self.private_variables: list[tf.Variable] = []
    variant = config.variant
    if variant in (EMBEDDING, GENERATED):
      self.context_embeddings = tf.Variable(
          tf.random.stateless_normal([contexts, hidden], seed=[seed, 17]) *
          config.context_init_stddev, name='context_embeddings')
      self.personal_offset = tf.Variable(tf.zeros([hidden]),
                                         name='personal_offset')
      self.shared_trainable_variables.append(self.context_embeddings)
      self.private_variables.append(self.personal_offset)
    if variant == GENERATED:
      self.personal_generator = EmbeddingGenerator(
          hidden, config.generator_heads, name='personal_generator')
      self.context_generator = EmbeddingGenerator(
          hidden, config.generator_heads, name='context_generator')
      tf.keras.utils.set_random_seed(seed)
      for generator in (self.personal_generator, self.context_generator):
        generator.create_variables()
        self.shared_trainable_variables.extend(generator.trainable_variables)
    if variant == SPLIT:
      self.personal_head = tf.Variable(tf.zeros([hidden, vocab]),
                                       name='personal_head')
      self.context_heads = tf.Variable(tf.zeros([contexts, hidden, vocab]),
                                       name='context_heads')
      self.shared_trainable_variables.append(self.context_heads)
      self.private_variables.append(self.personal_head)
    if variant == META:
      self.head = tf.Variable(tf.zeros([hidden, vocab]), name='head')
      self.shared_trainable_variables.append(self.head)

  @property
  def shared_non_trainable_variables(self) -> list[tf.Variable]:
    return list(self.backbone.weights)

  @property
  def input_spec(self) -> collections.OrderedDict:
    """The spec of a training batch: `ids`, `mask` [B, L] and `context` [B]."""
    return batch_spec(self.config.max_tokens)

  @property
  def has_prefix(self) -> bool:
    return self.config.variant in (EMBEDDING, GENERATED)

  # ------------------------------------------------------------ forward

  def hidden_states(self, ids: tf.Tensor, mask: tf.Tensor,
                    prefix: tf.Tensor | None = None) -> tf.Tensor:
    """The backbone's last hidden states, optionally with a prefix token."""
    backbone = self.backbone
    x = backbone.token_embedding(ids)
    mask = tf.cast(mask, tf.int32)
    if prefix is not None:
      x = tf.concat([tf.cast(prefix, x.dtype)[:, None, :], x], axis=1)
      mask = tf.concat([tf.ones_like(mask[:, :1]), mask], axis=1)
    x = x + backbone.position_embedding(x)
    for layer in backbone.transformer_layers:
      x = layer(x, decoder_padding_mask=mask)
    return backbone.layer_norm(x)

  def preference_embeddings(self, contexts: tf.Tensor,
                            personal_offset: tf.Tensor | None = None,
                            context_table: tf.Tensor | None = None
                            ) -> tf.Tensor:
    """psi * phi_c for each example: [B, H]."""
    offset = self.personal_offset if personal_offset is None else personal_offset
    table = (self.context_embeddings if context_table is None
             else context_table)
    return (1.0 + offset)[None, :] * tf.gather(table, contexts)

  def logits_and_targets(self, batch, prefix: tf.Tensor | None = None):
    """(logits [B, L', V], targets [B, L'], target positions [L'], mask)."""
    ids, mask = batch['ids'], tf.cast(batch['mask'], tf.float32)
    embedding_t = tf.transpose(self.backbone.token_embedding.embeddings)
    if self.has_prefix:
      if prefix is None:
        prefix = self.preference_embeddings(batch['context'])
      hidden = self.hidden_states(ids, batch['mask'], prefix)[:, :-1]
      logits = tf.matmul(hidden, embedding_t)
      targets, target_mask = ids, mask
      positions = tf.range(tf.shape(ids)[1])
    else:
      hidden = self.hidden_states(ids, batch['mask'])[:, :-1]
      logits = tf.matmul(hidden, embedding_t)
      if self.config.variant == META:
        logits += tf.matmul(hidden, self.head)
      else:  # SPLIT
        logits += tf.matmul(hidden, self.personal_head)
        heads = tf.gather(self.context_heads, batch['context'])
        logits += tf.einsum('bth,bhv->btv', hidden, heads)
      targets, target_mask = ids[:, 1:], mask[:, 1:]
      positions = tf.range(1, tf.shape(ids)[1])
    return logits, targets, positions, target_mask

  def nll(self, batch, prompt: int = 0,
          prefix: tf.Tensor | None = None) -> tuple[tf.Tensor, tf.Tensor]:
    """(sum of token NLLs, number of tokens) over tokens at position >= prompt."""
    logits, targets, positions, mask = self.logits_and_targets(batch, prefix)
    weights = mask * tf.cast(positions >= prompt, tf.float32)[None, :]
    losses = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=targets, logits=logits)
    return tf.reduce_sum(losses * weights), tf.reduce_sum(weights)

  def loss(self, batch, prefix: tf.Tensor | None = None) -> tf.Tensor:
    total, count = self.nll(batch, 0, prefix)
    return total / tf.maximum(count, 1.0)

  # ------------------------------------------------------------ generated

  def generate(self, personal_offset: tf.Tensor, batch
               ) -> tuple[tf.Tensor, tf.Tensor]:
    """Algorithm 2's generators on a batch: (new offset [H], contexts [C, H]).

    Every utterance runs both generators from the current embeddings; the
    user's new personal embedding is the mean over its utterances, each
    context's new embedding the mean over the utterances in that context
    (contexts without an utterance keep phi_c). Forward passes only.
    """
    ids, mask = batch['ids'], batch['mask']
    if self.config.generator_tokens:
      ids = ids[:, :self.config.generator_tokens]
      mask = mask[:, :self.config.generator_tokens]
    words = self.backbone.token_embedding(ids)
    n = tf.shape(words)[0]
    psi = tf.tile((1.0 + personal_offset)[None, :], [n, 1])
    personal = tf.reduce_mean(self.personal_generator(psi, words, mask), 0)
    contexts = batch['context']
    phi = tf.gather(self.context_embeddings, contexts)
    generated = self.context_generator(phi, words, mask)
    onehot = tf.one_hot(contexts, self.config.num_contexts)
    sums = tf.matmul(onehot, generated, transpose_a=True)
    counts = tf.reduce_sum(onehot, 0)[:, None]
    table = tf.where(counts > 0, sums / tf.maximum(counts, 1.0),
                     self.context_embeddings)
    return personal - 1.0, table

  # ------------------------------------------------------------ accounting

  def per_user_parameters(self) -> int:
    """Parameters a user holds on device beyond the frozen backbone.

    FedPerC: psi and every context's phi (a user may write in any context);
    Generated: the same plus both generators; Split-Learning: the personal
    head and every context head (the paper's accounting, section 4.2);
    Meta-Learning: its copy of the fine-tuned output layer.
    """
    count = lambda vs: sum(int(v.shape.num_elements()) for v in vs)
    return count(self.private_variables) + count(
        self.shared_trainable_variables)


def batch_spec(max_tokens: int) -> collections.OrderedDict:
  """Element spec of batches of `max_tokens`-token utterances."""
  return collections.OrderedDict(
      ids=tf.TensorSpec([None, max_tokens], tf.int32),
              mask=tf.TensorSpec([None, max_tokens], tf.int32),
              context=tf.TensorSpec([None], tf.int32))


# Evaluation batches add each utterance's role: one of the user's
# fine-tuning (adaptation) utterances, or a test utterance.
ROLE = 'y'
ROLE_FINE_TUNE = 0
ROLE_TEST = 1


def eval_batch_spec(max_tokens: int) -> collections.OrderedDict:
  """Element spec of evaluation batches: a training batch plus `ROLE`."""
  spec = batch_spec(max_tokens)
  spec[ROLE] = tf.TensorSpec([None], tf.int32)
  return spec


def token_count_weights(batch, prompt: int, has_prefix: bool) -> Any:
  """Number of scored tokens per example (for tests and bookkeeping)."""
  mask = tf.cast(batch['mask'], tf.int32)
  length = tf.shape(mask)[1]
  start = prompt if has_prefix else tf.maximum(prompt, 1)
  positions = tf.range(length)
  return tf.reduce_sum(mask * tf.cast(positions >= start, tf.int32)[None, :], 1)
