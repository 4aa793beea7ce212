"""`feddva`: federated dual VAE; shared encoders, client-local decoders.

FedDVA (Personalization Disentanglement for FL, Algorithm 1) as a
`StatefulClientProcess`:

    next(S@SERVER, {C}@CLIENTS, {D*}@CLIENTS) -> (S@SERVER, {C}@CLIENTS, M@SERVER)

* S holds the shared encoders f (q(z|x)) and h (q(c|x, z)) as TFF's
  `LearningAlgorithmState`; they are broadcast, updated on the client, and
  averaged weighted by client data size (TFF's `MeanFactory` on the update,
  server SGD lr 1 = FedAvg's theta <- sum_k w_k theta_k), or any
  `tff.aggregators` factory (DP included).
* C = <private=decoder weights, rounds_participated>: the client's decoder
  p_k(x|z, c) persists between rounds and never leaves the client (it is
  returned at CLIENTS; the aggregator's value type is the encoders only,
  which the tests check on the type signature).
* The client work is `models/feddva_training.client_update`: the local
  decoder first, then the shared encoders (Algorithm 1's order).

`decoder='shared'` is an ablation, not FedDVA's privacy contract: the
decoder is averaged with the encoders (one decoder for the federation; the
client state holds no weights). It is our reading of a second way to take
Algorithm 1's "phi_k <- phi ... phi <- phi_k", where phi carries no client
index: a decoder handed on from client to client, whose parallel FedAvg
analogue this is. It exists to measure what a private decoder costs the
disentanglement: with a private p_k a client's fixed mark can live in the
decoder, so nothing forces c to carry it. Measured on marked_mnist with one
fixed mark per client (docs/feddva.md): sharing the decoder takes client
information out of z but does not make c a client code either. (The
authors' public code keeps the decoder local, as the default here does.)
On marked_mnist with marks varying per image (the default task), the
mark's varying part goes to z, not c, with private decoders
(docs/feddva.md, "Marks that vary per image").

`build_feddva_classifier_process` is the personalized-classification stage:
FedAvg of the two encoders and a classification head on [mu_z; mu_c]
(`models/feddva.build_feddva_classifier`), started from the FedDVA encoders.

Not registered in `algorithms/registry.py`: its builders take a model
factory `embedding_dim -> SplitModel` from the task, which a VAE with a
private decoder and a separate loss is not; `papers/feddva.py` drives it.
"""

from __future__ import annotations

import collections
import functools
from typing import Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_personal.core import process as process_lib
from tff_personal.models import feddva as feddva_lib
from tff_personal.models import feddva_losses
from tff_personal.models import feddva_training

ModelWeights = tff.learning.models.ModelWeights
DECODERS = ('private', 'shared')


def _adam(learning_rate):
  return tff.learning.optimizers.build_adam(learning_rate=learning_rate)


def initial_weights(config: feddva_lib.FeddvaConfig, seed: Optional[int] = 0):
  """(shared encoder weights, initial decoder weights) as numpy tuples.

  Every client's decoder starts from the same seeded initialisation (the
  phi of Algorithm 1) until it first trains.
  """
  if seed is not None:
    tf.keras.utils.set_random_seed(seed)
  model = feddva_lib.FeddvaModel(config)
  return (tuple(v.numpy() for v in model.shared_variables),
          tuple(v.numpy() for v in model.decoder_variables))


def initial_client_state(decoder_weights) -> collections.OrderedDict:
  """A client's first state; `decoder_weights=()` for `decoder='shared'`."""
  return collections.OrderedDict([
      (process_lib.CLIENT_STATE_PRIVATE, tuple(decoder_weights)),
      (process_lib.CLIENT_STATE_ROUNDS, np.int32(0)),
  ])


def data_type() -> tff.Type:
  return tff.SequenceType(tff.types.tensorflow_to_type(
      feddva_lib.classification_input_spec()))


def build_feddva(config: feddva_lib.FeddvaConfig,
                 loss_config: feddva_losses.LossConfig = feddva_losses.LossConfig(),
                 *,
                 decoder_optimizer: Optional[tff.learning.optimizers.Optimizer] = None,
                 encoder_optimizer: Optional[tff.learning.optimizers.Optimizer] = None,
                 server_optimizer: Optional[tff.learning.optimizers.Optimizer] = None,
                 aggregator_factory=None,
                 train_metrics: bool = True,
                 seed: Optional[int] = 0,
                 decoder_first: bool = True,
                 decoder: str = 'private',
                 schedule: str = 'paper',
                 ) -> process_lib.StatefulClientProcess:
  """The FedDVA process (defaults: appendix H's Adam lr 1e-3 on clients).

  Client data: batches of `OrderedDict(x=float32[n, 28, 28, 1] in [0, 1],
  y=int32[n])` (y is unused by the VAE).

  `decoder`: 'private' (FedDVA: p_k is client state) or 'shared' (the
  ablation of the module docstring: the server's trainable weights are the
  encoders followed by the decoder, all averaged; client state
  `initial_client_state(())`; `split_shared_weights` separates them).
  `schedule`: 'paper' (Algorithm 1: decoder pass, then encoders pass) or
  'reference' (the authors' code's three passes; `feddva_training`).
  `seed` seeds the initial weights and the clients' reparameterisation
  noise (`feddva_training.client_seed`): equal inputs give equal rounds.
  """
  if decoder not in DECODERS:
    raise ValueError(f'decoder must be one of {DECODERS}, got {decoder!r}')
  if schedule not in feddva_training.SCHEDULES:
    raise ValueError(f'schedule must be one of {feddva_training.SCHEDULES}, '
                     f'got {schedule!r}')
  decoder_optimizer = decoder_optimizer or _adam(1e-3)
  encoder_optimizer = encoder_optimizer or _adam(1e-3)
  server_optimizer = server_optimizer or tff.learning.optimizers.build_sgdm(1.0)
  aggregator_factory = aggregator_factory or tff.aggregators.MeanFactory()
  shared, decoder0 = initial_weights(config, seed)
  noise_seed_base = 0 if seed is None else int(seed)
  is_shared = decoder == 'shared'
  num_encoders = len(shared)
  weights = ModelWeights(
      trainable=shared + decoder0 if is_shared else shared, non_trainable=())
  weights_type = process_lib.model_weights_type(weights)
  private_weights = () if is_shared else decoder0
  client_state_type = tff.types.to_type(collections.OrderedDict([
      (process_lib.CLIENT_STATE_PRIVATE,
       tuple(tff.TensorType(d.dtype, d.shape) for d in private_weights)),
      (process_lib.CLIENT_STATE_ROUNDS, np.int32)]))

  @tff.tensorflow.computation(weights_type, client_state_type, data_type())
  def client_work(weights, client_state, dataset):
    model = feddva_lib.FeddvaModel(config)
    step = tf.function(functools.partial(
        feddva_training.client_update, model, decoder_optimizer,
        encoder_optimizer, loss_config=loss_config,
        decoder_first=decoder_first, schedule=schedule))
    trainable = tuple(weights.trainable)
    noise_seed = feddva_training.client_seed(
        noise_seed_base, client_state[process_lib.CLIENT_STATE_ROUNDS],
        dataset)
    if is_shared:
      encoders, broadcast_decoder = (trainable[:num_encoders],
                                     trainable[num_encoders:])
      update, weight, new_decoder, metrics = step(
          encoders, broadcast_decoder, dataset, seed=noise_seed)
      # The decoder's update in TFF's sign convention (old - new), averaged
      # with the encoders'; a non-finite client returns the broadcast
      # decoder, hence a zero update (and weight 0).
      update = tuple(update) + tuple(
          tf.subtract(old, new)
          for old, new in zip(broadcast_decoder, new_decoder))
      return process_lib.client_step_result(update, weight, (), client_state,
                                            metrics)
    update, weight, new_decoder, metrics = step(
        trainable, tuple(client_state[process_lib.CLIENT_STATE_PRIVATE]),
        dataset, seed=noise_seed)
    return process_lib.client_step_result(
        update, weight, new_decoder, client_state, metrics)

  return process_lib.compose_stateful_client_process(
      initial_model_weights=weights, client_state_type=client_state_type,
      client_work=client_work, aggregator_factory=aggregator_factory,
      server_optimizer=server_optimizer, train_metrics=train_metrics)


def split_shared_weights(config: feddva_lib.FeddvaConfig, trainable):
  """(encoders, decoder) of a `decoder='shared'` process's trainable weights.

  For a private-decoder process the decoder part is empty.
  """
  num_encoders = len(feddva_lib.FeddvaModel(config).shared_variables)
  trainable = tuple(trainable)
  return trainable[:num_encoders], trainable[num_encoders:]


def build_feddva_classifier_process(
    config: feddva_lib.FeddvaConfig, *,
    client_optimizer: Optional[tff.learning.optimizers.Optimizer] = None,
    server_optimizer: Optional[tff.learning.optimizers.Optimizer] = None,
    aggregator_factory=None, seed: Optional[int] = 0,
) -> process_lib.StatefulClientProcess:
  """FedAvg of FedDVA's encoders plus a head; load the encoders with
  `with_encoders`."""
  return process_lib.build_split_model_process(
      functools.partial(feddva_lib.build_feddva_classifier, config),
      client_optimizer=client_optimizer or _adam(1e-3),
      server_optimizer=(server_optimizer
                        or tff.learning.optimizers.build_sgdm(1.0)),
      aggregator_factory=aggregator_factory, seed=seed)


def with_encoders(classifier_process: process_lib.StatefulClientProcess,
                  classifier_state, encoder_weights):
  """The classifier's state with its encoders set to FedDVA's.

  `encoder_weights`: the trainable shared weights of a FedDVA state
  (`feddva_state.global_model_weights.trainable`).
  """
  weights = classifier_process.get_model_weights(classifier_state)
  trainable = feddva_lib.load_encoders(list(weights.trainable),
                                       list(encoder_weights))
  return classifier_process.set_model_weights(
      classifier_state, ModelWeights(trainable=trainable,
                                     non_trainable=weights.non_trainable))
