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

Every process is a `core.process.StatefulClientProcess` composed by
`compose_stateful_client_process` (TFF broadcast, any `tff.aggregators`
factory, TFF's optimizer finalizer); the client work is
`models/fedperc_training.local_train`. The frozen backbone is the shared
*non-trainable* part of `ModelWeights`: it is broadcast, gets no update and
the finalizer leaves it unchanged.

Server optimizer: Algorithm 1 (lines 17-20) adds the averaged client delta,
i.e. FedAvg with server SGD lr 1, which is the default here; Appendix B says
"Adam ... for global updates (learning rate = 1)", available as
`server_optimizer='adam'`. Adam with lr 1 moves every coordinate by about 1
per round, far more than the embeddings' scale, so it is not the default.

New users (section 3.2): "we set the user's embedding to the noisy-average of
all known user embeddings". `build_dp_mean` is that noisy average as a TFF
computation over the known users' private states at CLIENTS, through
`tff.aggregators.DifferentiallyPrivateFactory.gaussian_fixed` (each user's
whole state clipped to `clip_norm` in L2, Gaussian noise of std
`noise_multiplier * clip_norm` on the sum, divided by the number of users);
`new_user_private_state` builds a new user's state from that server value
only.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Optional

import dp_accounting
import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

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


def build_server_optimizer(name: str, learning_rate: float):
  if name == 'sgd':
    return tff.learning.optimizers.build_sgdm(learning_rate)
  if name == 'adam':
    return tff.learning.optimizers.build_adam(learning_rate)
  raise ValueError(f'server optimizer must be sgd or adam, got {name!r}')


def build_process(spec: fedperc_backbone.BackboneSpec,
                  config: fedperc.FedPercConfig, *,
                  client_learning_rate: float = 1e-3,
                  server_optimizer: str = 'sgd',
                  server_learning_rate: float = 1.0,
                  proximal_mu: float = 1.0,
                  aggregator_factory=None,
                  train_metrics: bool = True,
                  seed: int = 0) -> process_lib.StatefulClientProcess:
  """The FedPerC (or baseline) training process for `config.variant`."""
  if proximal_mu < 0:
    raise ValueError(f'proximal_mu must be >= 0, got {proximal_mu}')
  if client_learning_rate <= 0 or server_learning_rate <= 0:
    raise ValueError('learning rates must be positive')
  model_fn = make_model_fn(spec, config, seed)
  weights, private = initial_weights(spec, config, seed)
  weights_type = process_lib.model_weights_type(weights)
  state_type = client_state_type(private)
  optimizer = tff.learning.optimizers.build_adam(client_learning_rate)

  @tff.tensorflow.computation(weights_type, state_type,
                              data_type(config.max_tokens))
  def client_work(weights, client_state, dataset):
    model = model_fn()
    train = tf.function(lambda w, p, d: fedperc_training.local_train(
        model, optimizer, w, p, d, proximal_mu))
    update, weight, new_private, metrics = train(
        weights, tuple(client_state[process_lib.CLIENT_STATE_PRIVATE]),
        dataset)
    return process_lib.client_step_result(
        update, weight, new_private, client_state, metrics)

  return process_lib.compose_stateful_client_process(
      initial_model_weights=weights, client_state_type=state_type,
      client_work=client_work,
      aggregator_factory=aggregator_factory or tff.aggregators.MeanFactory(),
      server_optimizer=build_server_optimizer(server_optimizer,
                                              server_learning_rate),
      train_metrics=train_metrics)


# ------------------------------------------------------------ new users


def build_dp_mean(private_type: tff.Type, *, noise_multiplier: float,
                  clip_norm: float, num_clients: int) -> tff.Computation:
  """`{private}@CLIENTS -> noisy mean@SERVER` through TFF's DP factory."""
  if noise_multiplier < 0 or clip_norm <= 0 or num_clients < 1:
    raise ValueError(
        f'DP mean needs noise_multiplier >= 0 (got {noise_multiplier}), '
        f'clip_norm > 0 (got {clip_norm}), num_clients >= 1 '
        f'(got {num_clients})')
  factory = tff.aggregators.DifferentiallyPrivateFactory.gaussian_fixed(
      noise_multiplier=noise_multiplier, clients_per_round=num_clients,
      clip=clip_norm)
  aggregation = factory.create(private_type)

  @tff.federated_computation(tff.FederatedType(private_type, tff.CLIENTS))
  def dp_mean(values):
    return aggregation.next(aggregation.initialize(), values).result

  return dp_mean


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


def dp_clip_report(values, clip_norm: float) -> dict:
  """What clipping at `clip_norm` does to the known users' states.

  Each user's state (a tuple of arrays) is clipped as one record, by its
  global L2 norm, as `build_dp_mean` clips it. A simulation diagnostic over
  the users' private states (it is not released by the DP mean and not
  covered by its epsilon).

  Returns:
    `{'clip_norm', 'num_users', 'fraction_clipped', 'median_norm',
    'median_norm_over_clip', 'max_norm'}`.
  """
  if not values:
    raise ValueError('dp_clip_report needs at least one user state')
  norms = np.asarray([
      math.sqrt(sum(float(np.sum(np.square(np.asarray(v, np.float64))))
                    for v in state)) for state in values])
  median = float(np.median(norms))
  return dict(clip_norm=float(clip_norm), num_users=len(values),
              fraction_clipped=float(np.mean(norms > clip_norm)),
              median_norm=median,
              median_norm_over_clip=median / float(clip_norm),
              max_norm=float(norms.max()))


def dp_mean_epsilon(noise_multiplier: float, delta: float) -> float:
  """Epsilon of one release of the DP mean (RDP, add-or-remove-one user)."""
  if noise_multiplier <= 0:
    return float('inf')
  accountant = dp_accounting.rdp.RdpAccountant()
  accountant.compose(dp_accounting.GaussianDpEvent(noise_multiplier))
  return float(accountant.get_epsilon(delta))


def new_user_private_state(dp_mean) -> collections.OrderedDict:
  """A new user's client state: the released DP mean, nothing else."""
  return initial_client_state(tuple(np.asarray(v) for v in dp_mean))
