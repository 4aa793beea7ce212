"""FedPerC (Silva, Tambwekar & Gombolay): TFF processes and the new-user prior.

Algorithms (the `--algorithm` values of the FedPerC paper module):

* `fedperc`: Algorithm 1 with FedProx (mu = 1): the context embeddings (and
  any unfrozen shared parameter) are averaged by the server, the personal
  embedding is private client state; at test time the user fine-tunes psi and
  local copies of the context embeddings.
* `fedperc_frozen`: the same trained model, no test-time fine-tuning.
* `fedperc_generated`: Algorithm 2: the shared embedding generators (and
  context embeddings) are trained; psi is *generated* on device and kept as
  client state; at test time a user generates psi and phi from its
  fine-tuning utterances (forward passes only).
* `split_learning`, `meta_learning`: the baselines of section 4
  (`models/fedperc.py`).

Every process is a `core.process.StatefulClientProcess` (TFF broadcast, any
`tff.aggregators` factory, TFF's optimizer finalizer) whose client work is
`models/fedperc_training.local_train` as a per-user client step
(`fedperc_client_step_factory`, so it also runs sharded), built by
`build_step_process`, and which evaluates with `FedPercEvalModel`
(test-time adaptation, then per-utterance NLL sums): that is what the
registry's builders (`build_fedperc`, `build_fedperc_generated`, ...; model
kind 'fedperc') give the one run path (`binaries.train --task=tv_shows`,
and the paper module's training). The frozen backbone is the shared
*non-trainable* part of `ModelWeights`: it is broadcast, gets no update and
the finalizer leaves it unchanged.

Server optimizer: Algorithm 1 (lines 17-20) adds the averaged client delta,
i.e. FedAvg with server SGD lr 1, which is the default here; Appendix B says
"Adam ... for global updates (learning rate = 1)", available as
`server_optimizer='adam'`. Adam with lr 1 moves every coordinate by about 1
per round, far more than the embeddings' scale, so it is not the default.

New users (section 3.2): "we set the user's embedding to the noisy-average of
all known user embeddings": `core/new_users.build_dp_mean` over the known
users' private states, clipped per variant at `dp_clip_norm` (their scales
differ); `new_user_private_state` builds a new user's state from that
server value only.
"""

from __future__ import annotations

import collections
import inspect
import dataclasses
from typing import Callable, Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_personal.core import batched as batched_lib
from tff_personal.core import evaluation
from tff_personal.core import moved
from tff_personal.core import process as process_lib
from tff_personal.models import fedperc
from tff_personal.models import fedperc_backbone
from tff_personal.models import fedperc_training

ModelWeights = tff.learning.models.ModelWeights


@dataclasses.dataclass(frozen=True)
class Algorithm:
  """How an `--algorithm` trains and adapts at test time."""
  variant: str
  adapt: str  # 'fine_tune', 'none' or 'generate'


ALGORITHMS = {
    'fedperc': Algorithm(fedperc.EMBEDDING, 'fine_tune'),
    'fedperc_frozen': Algorithm(fedperc.EMBEDDING, 'none'),
    'fedperc_generated': Algorithm(fedperc.GENERATED, 'generate'),
    'split_learning': Algorithm(fedperc.SPLIT, 'fine_tune'),
    'meta_learning': Algorithm(fedperc.META, 'fine_tune'),
}


def algorithm(name: str) -> Algorithm:
  if name not in ALGORITHMS:
    raise ValueError(f'unknown FedPerC algorithm {name!r}; known: '
                     f'{sorted(ALGORITHMS)}')
  return ALGORITHMS[name]


def data_type(max_tokens: int) -> tff.SequenceType:
  """Client data: batches of padded token ids, masks and context ids."""
  return tff.SequenceType(collections.OrderedDict(
      ids=tff.TensorType(np.int32, [None, max_tokens]),
      mask=tff.TensorType(np.int32, [None, max_tokens]),
      context=tff.TensorType(np.int32, [None])))


def make_model_fn(spec: fedperc_backbone.BackboneSpec,
                  config: fedperc.FedPercConfig, seed: int = 0):
  return lambda: fedperc.FedPercModel(spec, config, seed)


def initial_weights(spec, config, seed: int = 0):
  """(shared ModelWeights, initial private state) as numpy, eagerly."""
  model = make_model_fn(spec, config, seed)()
  weights = ModelWeights(
      trainable=tuple(v.numpy() for v in model.shared_trainable_variables),
      non_trainable=tuple(np.asarray(w) for w in spec.weights))
  private = tuple(v.numpy() for v in model.private_variables)
  return weights, private


def client_state_type(private) -> tff.Type:
  return tff.types.to_type(collections.OrderedDict([
      (process_lib.CLIENT_STATE_PRIVATE,
       tuple(tff.TensorType(np.asarray(p).dtype, np.shape(p))
             for p in private)),
      (process_lib.CLIENT_STATE_ROUNDS, np.int32)]))


def initial_client_state(private) -> collections.OrderedDict:
  return collections.OrderedDict([
      (process_lib.CLIENT_STATE_PRIVATE, tuple(np.asarray(p) for p in private)),
      (process_lib.CLIENT_STATE_ROUNDS, np.int32(0))])


# ------------------------------------------------- the one run path

# The eval batches' role feature: 0 for a fine-tuning utterance (read by the
# test-time adaptation only), 1 for a test utterance (scored).
PROMPT_TOKENS = 3


# The seed of the fixed shuffle `_Minibatches` cuts its batches from.
_FINE_TUNE_SHUFFLE = (0xF17E, 0)


class _Minibatches:
  """`steps` minibatches of `batch_size` rows of `batch` (an int or a
  scalar tensor of steps), with the `reduce` a local loop reads.

  The rows are shuffled once by a fixed stateless draw, and step i takes
  the `batch_size` rows after the first i * batch_size of that order,
  cyclically: one pass after another over the user's utterances, as
  training batches them. `batch_size` 0, or at least the rows: every step
  takes all of them, as they are.
  """

  def __init__(self, batch, steps, batch_size: int = 0):
    if batch_size < 0:
      raise ValueError(f'batch_size must be >= 0, got {batch_size}')
    self._batch, self._steps, self._batch_size = batch, steps, batch_size

  def _take(self, i):
    if not self._batch_size:
      return self._batch
    n = tf.shape(self._batch['ids'])[0]
    size = tf.minimum(self._batch_size, n)

    def window():
      order = tf.argsort(tf.random.stateless_uniform(
          [n], seed=_FINE_TUNE_SHUFFLE))
      return tf.gather(order, (i * size + tf.range(size)) % n)

    # Every row fits: all of them, in their order (all at once, exactly).
    rows = tf.cond(n <= self._batch_size, lambda: tf.range(n), window)
    return {k: tf.gather(v, rows) for k, v in self._batch.items()}

  def reduce(self, initial_state, reduce_fn):
    def body(i, state):
      return i + 1, reduce_fn(state, self._take(i))

    # One step at a time (`shard_packing.PackedBatches.reduce`).
    return tf.while_loop(lambda i, _: i < self._steps, body,
                         (tf.constant(0), initial_state),
                         parallel_iterations=1)[1]


class FedPercEvalModel:
  """A `FedPercModel` as the run path's evaluation reads a split model.

  Every user's evaluation data is one set of utterances with a
  `fedperc.ROLE` feature: `forward` first adapts the model on the
  fine-tuning utterances (`fedperc.ROLE_FINE_TUNE`) as the algorithm does
  at test time ('generate': the generators' forward passes set psi and the
  context embeddings; 'fine_tune': `fine_tune_steps` Adam steps on the
  adaptable variables, each on a
  minibatch of `fine_tune_batch_size` of them, one pass after another
  (`_Minibatches`; 0: each step on all of them); 'none', or a batch without
  fine-tuning utterances: nothing), then
  scores every utterance: its outputs are
  [n, 2] float32 rows (sum of token NLLs, number of tokens) counting the
  tokens after the first `PROMPT_TOKENS`, zero for fine-tuning utterances.
  The adapted values are local: the evaluation loads the shared weights and
  the user's state into the model again before the next user.
  """

  def __init__(self, model: fedperc.FedPercModel, adapt: str,
               optimizer: tff.learning.optimizers.Optimizer | None = None,
               fine_tune_steps: int = 0, fine_tune_batch_size: int = 0):
    if adapt not in ('fine_tune', 'generate', 'none'):
      raise ValueError(f'adapt must be fine_tune, generate or none, got '
                       f'{adapt!r}')
    if adapt == 'fine_tune' and (optimizer is None or fine_tune_steps < 1):
      raise ValueError('fine_tune adaptation needs an optimizer and '
                       f'fine_tune_steps >= 1 (got {fine_tune_steps})')
    self.fedperc_model = model
    self.adapt = adapt
    self._optimizer = optimizer
    self._steps = fine_tune_steps
    if fine_tune_batch_size < 0:
      raise ValueError('fine_tune_batch_size must be >= 0 (0: all the '
                       f'fine-tuning utterances), got {fine_tune_batch_size}')
    self._batch_size = fine_tune_batch_size
    self.input_spec = fedperc.eval_batch_spec(model.config.max_tokens)
    self.shared_trainable_variables = model.shared_trainable_variables
    self.shared_non_trainable_variables = model.shared_non_trainable_variables
    self.private_variables = model.private_variables

  def _adapt(self, batch) -> None:
    model = self.fedperc_model
    tune = {k: tf.boolean_mask(batch[k], tf.equal(batch[fedperc.ROLE],
                                                  fedperc.ROLE_FINE_TUNE))
            for k in ('ids', 'mask', 'context')}
    if self.adapt == 'generate':
      offset, table = model.generate(model.personal_offset, tune)
      read = tf.shape(tune['ids'])[0] > 0  # No utterance: nothing to read.
      model.personal_offset.assign(tf.where(read, offset,
                                            model.personal_offset))
      model.context_embeddings.assign(tf.where(read, table,
                                               model.context_embeddings))
    elif self.adapt == 'fine_tune':  # No utterance: no step.
      steps = tf.where(tf.shape(tune['ids'])[0] > 0, self._steps, 0)
      fedperc_training.fine_tune(model, self._optimizer,
                                 _Minibatches(tune, steps, self._batch_size))

  # Plain TF (explicit while loops): not for autograph, whose conversion of
  # the fine-tuning loop called from here fails.
  @tf.autograph.experimental.do_not_convert
  def forward(self, batch, training: bool = False) -> tf.Tensor:
    del training
    model = self.fedperc_model
    self._adapt(batch)
    logits, targets, positions, mask = model.logits_and_targets(batch)
    weights = mask * tf.cast(positions >= PROMPT_TOKENS, tf.float32)[None, :]
    weights *= tf.cast(tf.equal(batch[fedperc.ROLE], fedperc.ROLE_TEST),
                       tf.float32)[:, None]
    losses = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=targets, logits=logits)
    return tf.stack([tf.reduce_sum(losses * weights, 1),
                     tf.reduce_sum(weights, 1)], axis=1)

  def predict(self, outputs: tf.Tensor) -> tf.Tensor:
    return outputs

  def eval_output(self, batch, outputs: tf.Tensor) -> tf.Tensor:
    """What evaluation reports per utterance (`SplitModel.eval_output`):
    the scored rows themselves."""
    del batch
    return self.predict(outputs)


# Pooled perplexity of `FedPercEvalModel` outputs (rows of NLL sum, tokens).
pooled_perplexity = evaluation.pooled_perplexity


def fedperc_client_step_factory(
    model_fn: Callable[[], fedperc.FedPercModel],
    client_optimizer: tff.learning.optimizers.Optimizer,
    proximal_mu: float, batched: bool = False
) -> process_lib.ClientStepFactory:
  """FedPerC's per-user step: `fedperc_training.local_train` (Adam local
  steps with FedProx on the shared trainable variables); the private state
  is the personal embedding offset (generated, for the generated variant)
  or the personal head delta. With `batched` (the `embedding` variant), the
  step also has a batched form (`fedperc_training.batched_local_train`),
  which `--simulation_batched` runs."""

  def make_step():
    model = model_fn()

    def step(weights, client_state, dataset):
      update, weight, new_private, metrics = fedperc_training.local_train(
          model, client_optimizer, weights,
          tuple(client_state[process_lib.CLIENT_STATE_PRIVATE]), dataset,
          proximal_mu)
      return process_lib.client_step_result(update, weight, new_private,
                                            client_state, metrics)

    return step

  def batched_trainer():
    model = model_fn()  # batched_local_train refuses another variant.

    def train(weights, private, shard, decode):
      return fedperc_training.batched_local_train(
          model, client_optimizer, weights, private, shard, proximal_mu,
          decode)

    return train

  if batched:  # `core/batched.py` runs the shard's users together with it.
    setattr(make_step, batched_lib.BATCHED_TRAINER, batched_trainer)
  return make_step


def build_step_process(model_fn: Callable[[], fedperc.FedPercModel],
                       adapt: str, *,
                       client_optimizer: tff.learning.optimizers.Optimizer,
                       server_optimizer: tff.learning.optimizers.Optimizer,
                       aggregator_factory=None, train_metrics: bool = True,
                       proximal_mu: float = 1.0,
                       fine_tune_optimizer=None, fine_tune_steps: int = 0,
                       fine_tune_batch_size: int = 0
                       ) -> process_lib.StatefulClientProcess:
  """FedPerC as a per-user client step process (runs sharded; any
  `tff.aggregators` factory, DP included, for the shared update).

  The shared weights are the model's: trainable (context embeddings,
  generators or heads) and non-trainable (the frozen backbone: broadcast,
  never updated). A new user's private state is zero (psi = 1, or no head
  delta). Evaluation (`eval_model_fn`) is `FedPercEvalModel` with `adapt`;
  `new_user_dp_clip` is the variant's clip of the new-user DP average
  (`DP_CLIP_NORMS`; None for variants without private state).
  """
  if proximal_mu < 0:
    raise ValueError(f'proximal_mu must be >= 0, got {proximal_mu}')
  model = model_fn()
  weights = ModelWeights(
      trainable=tuple(v.numpy() for v in model.shared_trainable_variables),
      non_trainable=tuple(np.asarray(w) for w in model.spec.weights))
  private = tuple(v.numpy() for v in model.private_variables)
  proc = process_lib.build_step_process(
      model_fn, fedperc_client_step_factory(
          model_fn, client_optimizer, proximal_mu,
          batched=model.config.variant == fedperc.EMBEDDING),
      initial_weights=weights, client_state_type=client_state_type(private),
      server_optimizer=server_optimizer,
      aggregator_factory=aggregator_factory, train_metrics=train_metrics,
      eval_model_fn=lambda: FedPercEvalModel(
          model_fn(), adapt, fine_tune_optimizer, fine_tune_steps,
          fine_tune_batch_size),
      initial_private=private)
  # The new-user DP average's default clip (`strategies.ColdStart`).
  proc.new_user_dp_clip = DP_CLIP_NORMS.get(model.config.variant)
  return proc


def _registered(name: str):
  """The registry's uniform builder of FedPerC algorithm `name`."""
  algo = ALGORITHMS[name]

  def build(model_factory, *, client_optimizer, server_optimizer,
            aggregator_factory, metrics_fn, train_metrics, seed,
            embedding_dim, private_optimizer, proximal_mu, fine_tune_steps,
            fine_tune_batch_size):
    del metrics_fn  # The client step reports its own loss sums.
    if embedding_dim:
      raise ValueError(
          f'{name}\'s personal embedding has the backbone\'s hidden size; '
          f'it takes no embedding_dim (got {embedding_dim})')
    if fine_tune_steps < 1:
      raise ValueError(f'fine_tune_steps must be >= 1, got {fine_tune_steps}')
    return build_step_process(
        model_factory(algo.variant, 0 if seed is None else seed), algo.adapt,
        client_optimizer=client_optimizer, server_optimizer=server_optimizer,
        aggregator_factory=aggregator_factory, train_metrics=train_metrics,
        proximal_mu=proximal_mu,
        fine_tune_optimizer=private_optimizer or client_optimizer,
        fine_tune_steps=fine_tune_steps,
        fine_tune_batch_size=fine_tune_batch_size)

  def builder(model_factory, *, client_optimizer, server_optimizer,
              aggregator_factory=None, metrics_fn=None,
              train_metrics: bool = True, seed: Optional[int] = None,
              embedding_dim: int = 0, private_optimizer=None,
              proximal_mu: float = 1.0, fine_tune_steps: int = 15,
              fine_tune_batch_size: int = 15):
    return build(model_factory, client_optimizer=client_optimizer,
                 server_optimizer=server_optimizer,
                 aggregator_factory=aggregator_factory,
                 metrics_fn=metrics_fn, train_metrics=train_metrics,
                 seed=seed, embedding_dim=embedding_dim,
                 private_optimizer=private_optimizer,
                 proximal_mu=proximal_mu,
                 fine_tune_steps=(fine_tune_steps
                                  if algo.adapt == 'fine_tune' else 1),
                 fine_tune_batch_size=(fine_tune_batch_size
                                       if algo.adapt == 'fine_tune' else 0))

  if algo.adapt != 'fine_tune':  # No test-time steps: not an option.
    signature = inspect.signature(builder)
    builder.__signature__ = signature.replace(parameters=[
        p for p in signature.parameters.values()
        if p.name not in ('fine_tune_steps', 'fine_tune_batch_size')])
  builder.__name__ = builder.__qualname__ = f'build_{name}'
  builder.__doc__ = (
      f'`{name}` on a task\'s FedPerC model (`registry`\'s uniform signature).'
      '\n\n  `model_factory` is the task\'s `fedperc_model_fn_factory` '
      '((variant, seed) -> model_fn);\n  `proximal_mu` is FedProx\'s mu on '
      'the shared trainable variables'
      + ('; `fine_tune_steps`\n  the test-time Adam steps (the private '
         'optimizer, else the client one), each on\n  '
         '`fine_tune_batch_size` of the fine-tuning utterances (the paper\'s '
         '15, as\n  its training samples; 0: all at once).'
         if algo.adapt == 'fine_tune' else '.'))
  return builder


build_fedperc = _registered('fedperc')
build_fedperc_frozen = _registered('fedperc_frozen')
build_fedperc_generated = _registered('fedperc_generated')
build_split_learning = _registered('split_learning')
build_meta_learning = _registered('meta_learning')


# ------------------------------------------------------------ new users


# Default L2 clip of one known user's private state in the new-user DP
# average, per variant: the scale of that variant's states. 'embedding'
# states are offsets of psi = 1 + offset that start at zero; 'generated'
# states are the generators' outputs, whose norms are an order of magnitude
# larger (docs/papers/fedperc.md, "The new-user DP average"). Check the
# choice against `dp_clip_report` of the trained states.
DP_CLIP_NORMS = {fedperc.EMBEDDING: 1.0, fedperc.GENERATED: 16.0}


def dp_clip_norm(variant: str, clip_norm: Optional[float] = None) -> float:
  """`clip_norm` if given, else the variant's default `DP_CLIP_NORMS`."""
  if clip_norm is not None:
    if not clip_norm > 0:
      raise ValueError(f'DP clip_norm must be > 0, got {clip_norm}')
    return float(clip_norm)
  if variant not in DP_CLIP_NORMS:
    raise ValueError(
        f'variant {variant!r} has no new-user DP average (it has no private '
        f'state to average); variants with one: {sorted(DP_CLIP_NORMS)}')
  return DP_CLIP_NORMS[variant]


def new_user_private_state(dp_mean) -> collections.OrderedDict:
  """A new user's client state: the released DP mean, nothing else."""
  return initial_client_state(tuple(np.asarray(v) for v in dp_mean))


# Names that moved away raise an error naming their new place.
__getattr__ = moved.module_getattr(__name__)
