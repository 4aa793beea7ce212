"""How a never-trained client's private state starts (`personal_init`).

* `model` (the default): each private variable from the model's own Keras
  initializer (a Dense head's Glorot-uniform kernel and zero bias, an
  embedding layer's initializer), drawn with a seed of its own for every
  (run seed, client, variable): what a client that builds the model itself
  would start from, as PFLlib and most papers' code do.
* `normal`: every floating-point private value from N(0, stddev^2), seeded
  per client (`state_codec.SeededInitialState`), whatever the layer; the
  recorded runs of the papers in this repository started so.

A variable created from a value rather than from an initializer (e.g.
`tf.Variable(tf.zeros(...))`) starts from that value, the same for every
client. The initializers are read from the model as it is built (TF's
variable-creator scope sees each Keras initializer); written here because
neither TFF nor Keras gives a model's initial values per client.

Example:

  initial = personal_init.model_initial_state_fn(proc.model_fn, template,
                                                 seed=0)
  state = initial(17)   # client 17's first private state
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import numpy as np
import tensorflow as tf

from tff_personal.core import state_codec

PERSONAL_INITS = ('model', 'normal')


def _initial_values(model_fn: Callable[[], Any]) -> list:
  """For each private variable of `model_fn()`'s model, in order: the Keras
  initializer it was created with, or its initial value (numpy)."""
  created = {}

  def creator(next_creator, **kwargs):
    variable = next_creator(**kwargs)
    created[variable.ref()] = kwargs.get('initial_value')
    return variable

  # Built eagerly, as the processes build their models: a Keras model
  # made in a `tf.compat.v1` graph would invalidate the models made
  # outside it.
  with tf.init_scope(), tf.variable_creator_scope(creator):
    model = model_fn()
  out = []
  for variable in model.private_variables:
    initial = created.get(variable.ref())
    func = getattr(initial, 'func', None)
    if isinstance(initial, functools.partial) and isinstance(
        func, tf.keras.initializers.Initializer):
      out.append((func, tuple(variable.shape), variable.dtype))
    else:
      out.append(np.asarray(variable.numpy()))
  return out


def _seeded(initializer: tf.keras.initializers.Initializer, seed: int):
  config = initializer.get_config()
  if 'seed' not in config:
    return initializer  # Deterministic (zeros, ones, constant).
  return type(initializer).from_config(dict(config, seed=seed))


class ModelInitialState:
  """`client_id -> state`: the private part from the model's initializers,
  seeded per (seed, client, variable); every other leaf (e.g.
  `rounds_participated`) 0. Exposes `.template`, like the stores' other
  initial-state functions."""

  def __init__(self, model_fn: Callable[[], Any], template, seed: int):
    if int(seed) < 0:
      raise ValueError(f'seed must be non-negative, got {seed}.')
    self.template = template
    self.seed = int(seed)
    self._codec = state_codec.StateCodec(template)
    self._recipes = _initial_values(model_fn)
    private = template['private']
    shapes = [tuple(p.shape) for p in private]
    if len(shapes) != len(self._recipes) or any(
        tuple(np.shape(r) if not isinstance(r, tuple) else r[1]) != s
        for r, s in zip(self._recipes, shapes)):
      raise ValueError(
          'personal_init=model: the client state\'s private part '
          f'{shapes} is not the model\'s private variables; use '
          'personal_init=normal')

  def __call__(self, client_id: int):
    client_id = int(client_id)
    if client_id < 0:
      raise ValueError(f'client ids must be non-negative, got {client_id}.')
    private = []
    for i, recipe in enumerate(self._recipes):
      if not isinstance(recipe, tuple):
        private.append(np.array(recipe))
        continue
      initializer, shape, dtype = recipe
      seed = int(np.random.default_rng([self.seed, client_id, i]).integers(
          2**31 - 1))
      private.append(np.asarray(_seeded(initializer, seed)(shape, dtype=dtype)))
    zeros = self._codec.pack([np.zeros(shape, dtype) for dtype, shape in
                              zip(self._codec.dtypes, self._codec.shapes)])
    zeros['private'] = tuple(
        p.astype(np.asarray(z).dtype)
        for p, z in zip(private, zeros['private']))
    return zeros


def model_initial_state_fn(model_fn: Callable[[], Any], template,
                           seed: int) -> ModelInitialState:
  """The initial-state function of `personal_init=model` (module docstring).

  Args:
    model_fn: the process's split-model builder; its `private_variables`
      are the client state's private part, in order.
    template: the client-state structure (a dict holding 'private').
    seed: the run's seed.
  """
  return ModelInitialState(model_fn, template, seed)
