"""FedEmbed (Silva et al.): personal embeddings and sub-population heads.

`fedembed_prototype`, `fedembed_type` and `fedembed_personal` (the SOM variant,
whose server also learns a map, is `fedembed_som.py`). The model, and every reading of the paper, is in
`models/fedembed.py`; the federated part is FURL-style split training
(`core/process.build_split_model_process`): the shared parameters (encoder,
all K heads, the global and type heads, the prototypes) are aggregated by the
named aggregator (weighted mean, or user-level DP over all of them, unused
heads included), and the private ones (the personal embedding, the
assignment, a personal head) stay on the client.

The server averages each head over all clients, as the paper says ("the
server is unaware of each client's identity or sub-population membership"):
a client's update is zero on the heads it does not use, so head k moves by the
mean over the cohort of the updates of its users, weighted by examples.
`head_mean='assigned'` (not the paper's; an experiment's option) averages
each head over the clients that used it instead: the model gets K shared
"share" scalars, each client sends the one-hot of its head there, and the
server optimizer (`core/share_normalized.ShareNormalized`) divides each head's mean update by its
share of the cohort, as HypCluster does per model (`hypcluster.py`).
"""

from __future__ import annotations

import inspect
from typing import Callable, Optional

import tensorflow as tf
import tensorflow_federated as tff

from tff_personal.core import batched as batched_lib
from tff_personal.core import share_normalized
from tff_personal.core import split_training

from tff_personal.core import process as process_lib
from tff_personal.core import split_model as split_model_lib
from tff_personal.models import fedembed as fedembed_model
from tff_personal.models import fedembed_batched

FedEmbedModelFactory = Callable[[fedembed_model.FedEmbedConfig],
                                split_model_lib.SplitModelFn]


def build_fedembed(model_factory: FedEmbedModelFactory, *,
                   assignment: str,
                   client_optimizer: tff.learning.optimizers.Optimizer,
                   server_optimizer: tff.learning.optimizers.Optimizer,
                   aggregator_factory=None, metrics_fn=None,
                   train_metrics: bool = True, seed: Optional[int] = None,
                   embedding_dim: int = 28,
                   num_subpopulations: Optional[int] = None,
                   private_optimizer=None, head_mean: str = 'cohort',
                   ) -> process_lib.StatefulClientProcess:
  """Builds a FedEmbed process with the given sub-population assignment.

  `head_mean`: 'cohort' (the paper: each head averaged over every client)
  or 'assigned' (over the clients that used it; module docstring).
  """
  config = fedembed_model.FedEmbedConfig(
      assignment=assignment, embedding_dim=embedding_dim,
      num_subpopulations=num_subpopulations)  # None: the task's
  if head_mean not in HEAD_MEANS:
    raise ValueError(f'head_mean must be one of {HEAD_MEANS}, got '
                     f'{head_mean!r}')
  model_fn = model_factory(config)
  if head_mean == 'cohort':
    return process_lib.build_split_step_process(
        model_fn, _client_step(model_fn, client_optimizer, metrics_fn,
                               private_optimizer),
        server_optimizer=server_optimizer,
        aggregator_factory=aggregator_factory, train_metrics=train_metrics,
        seed=seed)
  if assignment not in ('prototype', 'type'):
    raise ValueError("head_mean='assigned' needs shared sub-population "
                     f"heads ('prototype' or 'type'), not {assignment!r}")
  model_fn = with_head_shares(model_fn)
  layout, head_slot = _head_layout(model_fn)

  def make_step():
    model = model_fn()

    def step(weights, client_state, dataset):
      update, weight, new_private, metrics = split_training.local_train(
          model, client_optimizer, weights,
          tuple(client_state[process_lib.CLIENT_STATE_PRIVATE]), dataset,
          metrics_fn, private_optimizer)
      k = next(w for w, kind in zip(update, layout) if kind == 'share').shape
      onehot = tf.one_hot(new_private[head_slot], k[0]) * tf.cast(
          weight > 0, tf.float32)
      update = tuple(onehot if kind == 'share' else u
                     for u, kind in zip(update, layout))
      return process_lib.client_step_result(update, weight, new_private,
                                            client_state, metrics)

    return step

  return process_lib.build_split_step_process(
      model_fn, make_step,
      server_optimizer=share_normalized.ShareNormalized(server_optimizer,
                                                        layout),
      aggregator_factory=aggregator_factory, train_metrics=train_metrics,
      seed=seed)


HEAD_MEANS = ('cohort', 'assigned')


def _client_step(model_fn, client_optimizer, metrics_fn, private_optimizer
                 ) -> process_lib.ClientStepFactory:
  """The split model's joint local training (`process.SplitClientStep`),
  with a batched form (`models/fedembed_batched.py`, which `core/batched.py`
  runs under `--simulation_batched`) for the prototype and type
  assignments trained by one optimizer."""
  split_step = process_lib.split_client_step_factory(
      model_fn, client_optimizer, metrics_fn, private_optimizer)

  def make_step():
    return split_step()

  def batched_trainer():
    if private_optimizer is not None:
      raise ValueError('batched FedEmbed trains the shared and private '
                       'variables with one optimizer; a private optimizer '
                       'is set')
    model = model_fn()
    fedembed_batched.check_model(model)

    def train(weights, private, shard, decode):
      return fedembed_batched.batched_local_train(
          model, client_optimizer, weights, private, shard, metrics_fn,
          decode)

    return train

  setattr(make_step, batched_lib.BATCHED_TRAINER, batched_trainer)
  return make_step


def with_head_shares(model_fn: split_model_lib.SplitModelFn
                     ) -> split_model_lib.SplitModelFn:
  """`model_fn`'s FedEmbed model plus K shared scalars `head_shares` (zero;
  they carry each client's one-hot head in the update)."""

  def fn():
    model = model_fn()
    heads = _layer(model, fedembed_model.SubpopulationHeads)
    model.model.add_weight(name='head_shares', shape=(heads.num_heads,),
                           initializer='zeros', trainable=True)
    return model

  return fn


def _layer(model, kind):
  found = [l for l in model.model.layers if isinstance(l, kind)]
  if len(found) != 1:
    raise ValueError(f'the FedEmbed model has {len(found)} {kind.__name__} '
                     'layers; head_mean=assigned needs exactly one')
  return found[0]


def _head_layout(model_fn):
  """Per shared trainable weight: 'share', 'rows' (a head's kernel or bias:
  row k is head k) or 'plain'; and the private slot of the assigned head."""
  with tf.Graph().as_default():
    model = model_fn()
    heads = _layer(model, fedembed_model.SubpopulationHeads)
    rows = {heads.kernel.ref(), heads.bias.ref()}
    assigned = _layer(model, fedembed_model.ClientAssignment).head
    layout = ['share' if v.name.startswith('head_shares') else
              'rows' if v.ref() in rows else 'plain'
              for v in model.shared_trainable_variables]
    slot = [v.ref() for v in model.private_variables].index(assigned.ref())
  if layout.count('share') != 1:
    raise ValueError('head_shares not found among the shared weights')
  return layout, slot


def _variant(assignment: str):
  def builder(model_factory, **kwargs):
    return build_fedembed(model_factory, assignment=assignment, **kwargs)
  builder.__doc__ = f'FedEmbed with {assignment} sub-population assignment.'
  # What the variant accepts (read by `registry.algorithm_options`).
  signature = inspect.signature(build_fedembed)
  builder.__signature__ = signature.replace(parameters=[
      p for p in signature.parameters.values() if p.name != 'assignment'])
  return builder


build_fedembed_prototype = _variant('prototype')
build_fedembed_type = _variant('type')
build_fedembed_personal = _variant('personal')
