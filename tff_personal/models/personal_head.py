"""Split models with a personal head, for FedRep and pFedMe (Keras only).

Both wrap any task model whose classification head is a Keras layer with a
known name (the task models of this project call it 'head', see
`models/fedembed_mnist.py`):

* `personal_head_model_fn` (FedRep): the head's variables become private
  (client state); everything below it stays shared. Private variables the
  task model already declares (a personal embedding) stay private.
* `personal_body_model_fn` (LG-FedAvg): the reverse split; the named top
  layers (the head) stay shared and every other trainable variable is
  private.
* `personal_copy_model_fn` (pFedMe, as FedEmbed Table 1 describes it: "a
  shared feature encoder with personal model heads regularized to minimize
  parameter difference from a global model head"): the shared model keeps its
  head (the global head w), and a second, private head theta of the same
  shape reads the same features. Predictions (evaluation) use theta. The
  loss is pFedMe's inner objective for the personal head,
  `f(theta) + lam / 2 ||theta - w||^2`, so that fine-tuning the private
  variables alone (`core.split_training.fine_tune_private`, the evaluation of
  users who never trained) computes the Moreau-envelope personal model.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import tensorflow as tf

from tff_personal.core import split_model


def named_layer(model: tf.keras.Model, name: str) -> tf.keras.layers.Layer:
  """The model's layer `name`; an error listing its layers if it has none."""
  try:
    return model.get_layer(name)
  except ValueError:
    raise ValueError(
        f'the task model has no layer named {name!r} to personalise; '
        f'its layers are {[l.name for l in model.layers]}') from None


def personal_head_model_fn(model_fn: split_model.SplitModelFn,
                           head_layer: str | None = 'head'
                           ) -> split_model.SplitModelFn:
  """The model of `model_fn` with the `head_layer` variables private.

  `head_layer=None` keeps every variable as `model_fn` declares it (FedRep
  without a personal head, which is FedAvg).
  """

  def fn():
    base = model_fn()
    if head_layer is None:
      return base
    head = named_layer(base.model, head_layer)
    private = list(base.private_variables) + [
        v for v in head.trainable_weights
        if v.ref() not in {p.ref() for p in base.private_variables}]
    # Everything else (embeddings, private_noise) as the task model has it.
    split = dataclasses.replace(base, private_variables=private)
    if not split.shared_trainable_variables:
      raise ValueError(
          f'with the {head_layer!r} layer personal, the task model has no '
          'shared trainable variable left (is its encoder frozen?): FedRep '
          'would federate nothing; use a trainable encoder or another '
          'algorithm')
    return split

  return fn


def personal_body_model_fn(model_fn: split_model.SplitModelFn,
                           shared_layers: Sequence[str] = ('head',)
                           ) -> split_model.SplitModelFn:
  """The model of `model_fn` with every trainable variable private except
  those of the `shared_layers` (LG-FedAvg: local representations, a global
  head).

  Non-trainable variables keep the task model's split (a frozen encoder
  stays shared, so it is not copied into every client's state). With
  `shared_layers` naming every layer that has trainable variables nothing
  becomes private: FedAvg.

  Example:
    model_fn = personal_body_model_fn(task.model_fn_factory(0), ['head'])
  """
  if not shared_layers:
    raise ValueError('LG-FedAvg needs at least one shared layer (the head)')

  def fn():
    base = model_fn()
    shared = {v.ref() for name in shared_layers
              for v in named_layer(base.model, name).trainable_weights}
    if not shared:
      raise ValueError(f'the shared layers {list(shared_layers)} have no '
                       'trainable variable: nothing would be federated')
    private = list(base.private_variables)
    known = {v.ref() for v in private}
    private += [v for v in base.model.trainable_variables
                if v.ref() not in shared and v.ref() not in known]
    return dataclasses.replace(base, private_variables=private)

  return fn


def personal_copy_model_fn(model_fn: split_model.SplitModelFn,
                           lam: float, head_layer: str = 'head'
                           ) -> split_model.SplitModelFn:
  """The model of `model_fn` plus a private copy of its head (pFedMe).

  The returned model's outputs are `{'logits': personal head,
  'global_logits': shared head}`; its loss is the personal objective
  `f(theta) + lam / 2 ||theta - w||^2` (module docstring), with `w` held
  constant (it is shared, trained by the pFedMe client step, not this loss).
  """
  if lam < 0:
    raise ValueError(f'pFedMe lambda must be >= 0, got {lam}')

  def fn():
    base = model_fn()
    if base.private_variables:
      raise ValueError('pFedMe personalises the head only; the task model '
                       'already has private variables '
                       f'{[v.name for v in base.private_variables]} (use '
                       'embedding_dim=0)')
    head = named_layer(base.model, head_layer)
    config = head.get_config()
    config['name'] = 'personal_head'
    personal = head.__class__.from_config(config)
    features = head.input
    model = tf.keras.Model(base.model.inputs, {
        'logits': personal(features), 'global_logits': head.output})

    def loss_fn(batch, outputs):
      reg = tf.add_n([tf.reduce_sum(tf.square(p - tf.stop_gradient(g)))
                      for p, g in zip(personal.trainable_weights,
                                      head.trainable_weights)])
      return base.loss_fn(batch, outputs['logits']) + 0.5 * lam * reg

    return split_model.SplitModel(
        model=model, private_variables=list(personal.trainable_weights),
        loss_fn=loss_fn, input_spec=base.input_spec,
        predict_fn=lambda out: out['logits'],
        private_noise=base.private_noise)

  return fn
