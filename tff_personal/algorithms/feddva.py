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
decoder, so nothing forces c to carry it (results: docs/papers/feddva_notes.md).
(The authors' public code keeps the decoder local, as the default here
does.)

`build_feddva_classifier_process` is the personalized-classification stage:
FedAvg of the two encoders and a classification head on [mu_z; mu_c]
(`models/feddva.build_feddva_classifier`), started from the FedDVA encoders.

`build_feddva_algorithm` is the registered algorithm `feddva`: both stages
in order (`core/stages.py`), run by the one loop on any task of MNIST-shaped
digit images (`binaries.train --task=marked_mnist --algorithm=feddva`).
`pretrained_model` reads the dual VAE a run of it pre-trained;
`save_pretrained` / `load_pretrained` keep it beside the run.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
from typing import Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_personal.core import atomic_io
from tff_personal.core import process as process_lib
from tff_personal.core import stages
from tff_personal.models import feddva as feddva_lib
from tff_personal.models import feddva_losses
from tff_personal.models import feddva_recipes
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
                 resamples: int = 1,
                 ) -> process_lib.StatefulClientProcess:
  """The FedDVA process (defaults: appendix H's Adam lr 1e-3 on clients).

  Client data: batches of `OrderedDict(x=float32[n, 28, 28, 1] in [0, 1],
  y=int32[n])` (y is unused by the VAE).

  `decoder`: 'private' (FedDVA: p_k is client state) or 'shared' (the
  ablation of the module docstring: the server's trainable weights are the
  encoders followed by the decoder, all averaged; client state
  `initial_client_state(())`; `split_shared_weights` separates them).
  `schedule`: 'paper' (Algorithm 1: decoder pass, then encoders pass),
  'reference' or 'authors' (the authors' code's three passes;
  `feddva_training`). `resamples`: copies of each batch per local step
  (`feddva_training`; `models/feddva_recipes.py` has whole recipes).
  `seed` seeds the initial weights and the clients' reparameterisation
  noise (`feddva_training.client_seed`): equal inputs give equal rounds.
  """
  if decoder not in DECODERS:
    raise ValueError(f'decoder must be one of {DECODERS}, got {decoder!r}')
  if schedule not in feddva_training.SCHEDULES:
    raise ValueError(f'schedule must be one of {feddva_training.SCHEDULES}, '
                     f'got {schedule!r}')
  if resamples < 1:
    raise ValueError(f'resamples must be >= 1, got {resamples}')
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

  def make_step():
    model = feddva_lib.FeddvaModel(config)

    def step(weights, client_state, dataset):
      trainable = tuple(weights.trainable)
      noise_seed = feddva_training.client_seed(
          noise_seed_base, client_state[process_lib.CLIENT_STATE_ROUNDS],
          dataset)
      update_fn = functools.partial(
          feddva_training.client_update, model, decoder_optimizer,
          encoder_optimizer, loss_config=loss_config,
          decoder_first=decoder_first, schedule=schedule, seed=noise_seed,
          resamples=resamples)
      if is_shared:
        encoders, broadcast_decoder = (trainable[:num_encoders],
                                       trainable[num_encoders:])
        update, weight, new_decoder, metrics = update_fn(
            encoders, broadcast_decoder, dataset)
        # The decoder's update in TFF's sign convention (old - new),
        # averaged with the encoders'; a non-finite client returns the
        # broadcast decoder, hence a zero update (and weight 0).
        update = tuple(update) + tuple(
            tf.subtract(old, new)
            for old, new in zip(broadcast_decoder, new_decoder))
        return process_lib.client_step_result(update, weight, (),
                                              client_state, metrics)
      update, weight, new_decoder, metrics = update_fn(
          trainable, tuple(client_state[process_lib.CLIENT_STATE_PRIVATE]),
          dataset)
      return process_lib.client_step_result(
          update, weight, new_decoder, client_state, metrics)

    return step

  return process_lib.compose_stateful_client_process(
      initial_model_weights=weights, client_state_type=client_state_type,
      client_work=process_lib.client_work_from_step(
          make_step, weights_type, client_state_type, data_type()),
      aggregator_factory=aggregator_factory,
      server_optimizer=server_optimizer, train_metrics=train_metrics,
      client_step=make_step, initial_private=private_weights)


def split_shared_weights(config: feddva_lib.FeddvaConfig, trainable):
  """(encoders, decoder) of a `decoder='shared'` process's trainable weights.

  For a private-decoder process the decoder part is empty.
  """
  num_encoders = len(feddva_lib.FeddvaModel(config).shared_variables)
  trainable = tuple(trainable)
  return trainable[:num_encoders], trainable[num_encoders:]


# The pre-trained model of a `feddva` run, kept in the run's directory.
PRETRAINED_WEIGHTS = 'pretrained.npz'
PRETRAINED_META = 'pretrained.json'


def pretrained_model(run, config: feddva_lib.FeddvaConfig,
                     decoder: str = 'private'):
  """The model a run of the registered `feddva` pre-trained.

  Reads its 'pretrain' stage's last checkpoint and, for private decoders,
  every client's committed state. Call inside a TFF runtime.

  Args:
    run: a `runs.Run` of `feddva` (its task given or rebuildable).
    config: the run's model sizes (its `dim`, `channels`, `hidden`).
    decoder: the run's decoder mode (`DECODERS`).

  Returns:
    (encoders, decoders): tuples of arrays, and one decoder per client of
    the run's task (the one shared decoder repeated for 'shared').

  Example:
    encoders, decoders = pretrained_model(run, config)
  """
  population = run.task.population
  encoders, shared_decoder = split_shared_weights(
      config, [np.asarray(w) for w in run.weights(stage='pretrain').trainable])
  if decoder == 'private':
    decoders = [tuple(np.asarray(w) for w in s[
        process_lib.CLIENT_STATE_PRIVATE])
                for s in run.client_states(range(population),
                                           stage='pretrain')]
  else:  # One decoder for every client.
    decoders = [shared_decoder] * population
  return encoders, decoders


def save_pretrained(run, config: feddva_lib.FeddvaConfig,
                    decoder: str = 'private', **meta) -> None:
  """Keeps `pretrained_model` of `run` beside it, for reads without TFF.

  Writes `PRETRAINED_WEIGHTS` (the arrays) and `PRETRAINED_META` (`curve`:
  the 'pretrain' stage's per-round training metrics, without their
  'train/' prefix; `seconds_per_round`: its mean round time; and `meta`) in
  the run's directory. Call inside a TFF runtime.

  Args:
    run, config, decoder: as for `pretrained_model`.
    **meta: JSON-able values kept with it (e.g. the clients' names).

  Example:
    save_pretrained(run, config, 'private', dim=8)
    pre = load_pretrained(run.directory, num_clients=4)
  """
  encoders, decoders = pretrained_model(run, config, decoder)
  rows = run.curves(stage='pretrain')['train']
  curve = [{k[len('train/'):]: float(v) for k, v in row.items()
            if k.startswith('train/')} for row in rows]
  seconds = float(np.mean([float(r['round_seconds']) for r in rows]))
  arrays = {f'e{i}': w for i, w in enumerate(encoders)}
  for k, dec in enumerate(decoders):
    arrays.update({f'd{k}_{i}': w for i, w in enumerate(dec)})
  with atomic_io.atomic_write(
      os.path.join(run.directory, PRETRAINED_WEIGHTS), 'wb') as fh:
    np.savez(fh, num_encoders=len(encoders), num_decoder=len(decoders[0]),
             **arrays)
  atomic_io.write_json(os.path.join(run.directory, PRETRAINED_META),
                       {'curve': curve, 'seconds_per_round': seconds, **meta})


def load_pretrained(directory: str, num_clients: int) -> Optional[dict]:
  """What `save_pretrained` kept in a run's `directory`, or None.

  Args:
    directory: the run's directory.
    num_clients: how many clients' decoders to read.

  Returns:
    {'encoders': tuple of arrays, 'decoders': [a tuple per client, the
    first `num_clients`], 'curve', 'seconds_per_round' and the saved
    `meta`}; None when nothing was saved.

  Example:
    pre = load_pretrained(run.directory, num_clients=4)
    model = feddva_probes.feddva_model(config, pre['encoders'],
                                       pre['decoders'][0])
  """
  meta_path = os.path.join(directory, PRETRAINED_META)
  if not os.path.exists(meta_path):
    return None
  with np.load(os.path.join(directory, PRETRAINED_WEIGHTS)) as data:
    n_enc, n_dec = int(data['num_encoders']), int(data['num_decoder'])
    encoders = tuple(data[f'e{i}'] for i in range(n_enc))
    decoders = [tuple(data[f'd{k}_{i}'] for i in range(n_dec))
                for k in range(num_clients)]
  return dict(encoders=encoders, decoders=decoders,
              **atomic_io.read_json(meta_path))


def build_feddva_classifier_process(
    config: feddva_lib.FeddvaConfig, *,
    client_optimizer: Optional[tff.learning.optimizers.Optimizer] = None,
    server_optimizer: Optional[tff.learning.optimizers.Optimizer] = None,
    aggregator_factory=None, seed: Optional[int] = 0, metrics_fn=None,
    train_metrics: bool = True,
) -> process_lib.StatefulClientProcess:
  """FedAvg of FedDVA's encoders plus a head; load the encoders with
  `with_encoders`."""
  return process_lib.build_split_model_process(
      functools.partial(feddva_lib.build_feddva_classifier, config),
      client_optimizer=client_optimizer or _adam(1e-3),
      server_optimizer=(server_optimizer
                        or tff.learning.optimizers.build_sgdm(1.0)),
      aggregator_factory=aggregator_factory, seed=seed,
      metrics_fn=metrics_fn, train_metrics=train_metrics)


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


def build_feddva_algorithm(model_fn_factory, *,
                           client_optimizer: tff.learning.optimizers.Optimizer,
                           server_optimizer: tff.learning.optimizers.Optimizer,
                           aggregator_factory=None, metrics_fn=None,
                           train_metrics: bool = True,
                           seed: Optional[int] = None, embedding_dim: int = 0,
                           private_optimizer=None,
                           pretrain_rounds: int = 30,
                           recipe: str = 'paper', ablate: str = '',
                           dim: Optional[int] = None,
                           channels: str = '16,16,32,32', hidden: int = 128,
                           alpha: Optional[float] = None,
                           beta: Optional[float] = None,
                           xi: Optional[float] = None,
                           mixture_kl: Optional[str] = None,
                           constraint_weight: Optional[float] = None,
                           schedule: Optional[str] = None,
                           c_prior: Optional[str] = None,
                           kl_floor: Optional[float] = None,
                           detach_reference: Optional[bool] = None,
                           reconstruction: Optional[str] = None,
                           resamples: Optional[int] = None,
                           decoder: str = 'private'
                           ) -> stages.Staged:
  """FedDVA as the one run path runs it: two stages, one loop.

  Stage 'pretrain': `build_feddva` for `pretrain_rounds` rounds (shared
  encoders, each client's decoder its private state). Stage 'classifier':
  `build_feddva_classifier_process`, started from the pre-trained encoders
  (`with_encoders`), for the experiment's rounds; it is evaluated. Both
  stages' shared updates go through `aggregator_factory` (DP included).

  The pre-training follows a recipe (`models/feddva_recipes.py`): 'paper',
  'authors' (the authors' released code) or 'sampled_mixture_kl' (ours);
  `ablate` switches named elements of the authors' recipe back to the
  paper's, and every element option below left at None takes the recipe's
  value. For example `--algorithm_options=recipe=authors,ablate=c_prior`.

  Args:
    model_fn_factory: unused: FedDVA builds its own models on the task's
      28 x 28 x 1 images (the registry's `digit_images` need).
    client_optimizer: the encoders' and the classifier's local optimizer.
    server_optimizer, aggregator_factory, train_metrics, seed: as for
      every registered algorithm.
    metrics_fn: the classifier's training-metric sums.
    embedding_dim: must be 0 (FedDVA's personal part is its decoder).
    private_optimizer: the decoders' (default `client_optimizer`).
    pretrain_rounds: rounds of the dual-VAE stage.
    recipe: one of `feddva_recipes.RECIPES`.
    ablate: '+'-separated elements (`feddva_recipes.ELEMENTS`) of the
      authors' recipe to switch back to the paper's.
    dim: the sizes of z and of c.
    channels: the four convolutions' channels, comma-separated.
    hidden: the fully connected width.
    alpha, beta, xi, mixture_kl, constraint_weight, c_prior, kl_floor,
      detach_reference, reconstruction: the loss
      (`feddva_losses.LossConfig`).
    schedule: `feddva_training.SCHEDULES`.
    resamples: copies of each batch per local step.
    decoder: 'private' (FedDVA) or 'shared' (the ablation).

  Returns:
    A `core/stages.Staged` of the two stages.
  """
  del model_fn_factory
  if embedding_dim:
    raise ValueError('feddva\'s personal part is its decoder; it takes no '
                     f'personal embedding (got {embedding_dim})')
  try:
    widths = tuple(int(c) for c in channels.split(','))
  except ValueError:
    raise ValueError('feddva channels must be comma-separated integers, got '
                     f'{channels!r}') from None
  base = feddva_recipes.recipe(
      recipe, tuple(e for e in ablate.split('+') if e))
  overrides = dict(alpha=alpha, beta=beta, xi=xi, mixture_kl=mixture_kl,
                   constraint_weight=constraint_weight, c_prior=c_prior,
                   kl_floor=kl_floor, detach_reference=detach_reference,
                   reconstruction=reconstruction)
  loss_config = dataclasses.replace(
      base.loss, **{k: v for k, v in overrides.items() if v is not None})
  size = base.dim if dim is None else dim
  config = feddva_lib.FeddvaConfig(z_dim=size, c_dim=size, channels=widths,
                                   hidden=hidden)
  pretrain = build_feddva(
      config, loss_config,
      decoder_optimizer=private_optimizer or client_optimizer,
      encoder_optimizer=client_optimizer, server_optimizer=server_optimizer,
      aggregator_factory=aggregator_factory, train_metrics=train_metrics,
      seed=seed, decoder=decoder,
      schedule=base.schedule if schedule is None else schedule,
      resamples=base.resamples if resamples is None else resamples)
  classifier = build_feddva_classifier_process(
      config, client_optimizer=client_optimizer,
      server_optimizer=server_optimizer,
      aggregator_factory=aggregator_factory, seed=seed,
      metrics_fn=metrics_fn, train_metrics=train_metrics)

  def handoff(pretrain_state):
    encoders, _ = split_shared_weights(
        config, pretrain.get_model_weights(pretrain_state).trainable)
    return with_encoders(classifier, classifier.initialize(), encoders)

  return stages.Staged((
      stages.Stage('pretrain', pretrain, rounds=pretrain_rounds),
      stages.Stage('classifier', classifier, handoff=handoff)))
