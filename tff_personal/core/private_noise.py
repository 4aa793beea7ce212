"""Gaussian noise on the private state's local change: the paper's DP reading.

Our privacy contract noises what leaves the device: the shared update, through
`tff.aggregators.DifferentiallyPrivateFactory` (`core/privacy.py`). Private
state (personal embeddings, personal heads) never leaves the device and is not
noised. FedEmbed's Algorithm 1 reads otherwise: "Optionally, add differential
privacy to the computed gradients" at the client (line 22), "for all
parameters" (section 3.1), personal embeddings excepted ("because the
personal embeddings stay on-device, applying privacy-preserving noise to their
gradient updates is unnecessary", section 3.2); and its section 4.2.1 says the
methods with personal model heads (FedRep, pFedMe, FedEmbed-Personal)
"severely deteriorate when differential privacy is added due to insufficient
gradient information to overcome the privacy-preserving noise", which
describes noise on a head that hears one user, not on an aggregate.

`SplitModel.private_noise` (a `split_model.PrivateNoise`) turns that reading
on for a model: at the end of every local pass (a training round's client
step, and the evaluation's fine-tuning pass), the change of the noised private
variables (the trainable private variables other than the declared personal
embeddings) is clipped jointly to `clip_norm` and gets Gaussian noise of
standard deviation `noise_multiplier * clip_norm` per coordinate: the Gaussian
mechanism of a one-user aggregate, with the shared aggregate's multiplier.
Noise per pass rather than per gradient step is our choice (the least noise
that protects what a pass produces); the paper does not say. The noise comes
from TensorFlow's op-level generator, not from a per-client seed: like the DP
aggregate's noise, it is not reproduced bit for bit by a second run.

What it buys: the personal head itself becomes differentially private with
respect to its user's data, so it could be released (published, or read off a
lost device) at the cost `personal_epsilon` reports. What it costs: a head of
d coordinates gets noise of norm about `noise_multiplier * clip_norm *
sqrt(d)` per pass against a change of norm at most `clip_norm`.

Only TensorFlow here (and the accounting); `experiment.build_process` wires it.
`dp_accounting` has the Gaussian mechanism's RDP; the clipping and noising of a
client's own state is written here because tensorflow-privacy's queries
aggregate over records (a one-record "aggregate" of the private state would be
the same arithmetic with more machinery).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import dp_accounting
import tensorflow as tf

from tff_personal.core import split_model as split_model_lib

PrivateNoise = split_model_lib.PrivateNoise


def clip_and_noise(start: Sequence[tf.Tensor], end: Sequence[tf.Tensor],
                   noise: PrivateNoise) -> tuple[tf.Tensor, ...]:
  """`start + clip(end - start) + N(0, (z * clip)^2)`, the change clipped
  jointly over all tensors to L2 norm `noise.clip_norm`."""
  if not start:
    return ()
  change = [tf.cast(e, tf.float32) - tf.cast(s, tf.float32)
            for s, e in zip(start, end)]
  clipped, _ = tf.clip_by_global_norm(change, noise.clip_norm)
  std = noise.noise_multiplier * noise.clip_norm
  return tuple(
      tf.cast(tf.cast(s, tf.float32) + c +
              tf.random.normal(tf.shape(c), stddev=std), s.dtype)
      for s, c in zip(start, clipped))


def start_values(model: split_model_lib.SplitModel) -> list[tf.Tensor]:
  """The noised private variables' values before a local pass."""
  return [tf.identity(v.read_value())
          for v in model.noised_private_variables]


def finish_pass(model: split_model_lib.SplitModel,
                start: Sequence[tf.Tensor]) -> None:
  """Replaces the noised private variables by their start values plus the
  clipped, noised change of the pass (nothing when the model has none)."""
  variables = model.noised_private_variables
  if not variables:
    return
  ends = [v.read_value() for v in variables]
  for var, value in zip(variables,
                        clip_and_noise(start, ends, model.private_noise)):
    var.assign(value)


def with_private_noise(model_fn_factory: Callable[..., Callable],
                       noise: PrivateNoise) -> Callable[..., Callable]:
  """A task's model factory (`embedding_dim -> model_fn`, or FedEmbed's
  `config -> model_fn`) whose models carry `noise`.

  Wrappers that add private variables (`models/personal_head.py`) keep the
  setting, so the heads they add are noised; personal embeddings are not.
  """

  def factory(arg):
    model_fn = model_fn_factory(arg)

    def fn():
      return dataclasses.replace(model_fn(), private_noise=noise)

    return fn

  return factory


def personal_epsilon(noise_multiplier: float, passes: int, delta: float,
                     relation: str = 'add_or_remove_one') -> float:
  """Epsilon of a personal head after `passes` noised passes, at `delta`.

  Each pass is the Gaussian mechanism on its user's data with no subsampling
  (the user's own data is always in); under 'add_or_remove_one' (the user's
  data present or not) the clipped change moves by at most `clip_norm`, under
  'replace_one' (`core/privacy.py`'s relation for fixed-size sampling) by
  twice that, so the event is `GaussianDpEvent(z)` or `(z / 2)`; `passes` of
  them compose (RDP accountant of `dp_accounting`). Infinite for a zero
  multiplier.
  """
  if passes < 0:
    raise ValueError(f'passes must be >= 0, got {passes}')
  if relation not in ('add_or_remove_one', 'replace_one'):
    raise ValueError(f'unknown neighbouring relation {relation!r}')
  if passes == 0:
    return 0.0
  if noise_multiplier <= 0:
    return float('inf')
  z = noise_multiplier / (2.0 if relation == 'replace_one' else 1.0)
  accountant = dp_accounting.rdp.RdpAccountant()
  accountant.compose(dp_accounting.GaussianDpEvent(z), passes)
  return float(accountant.get_epsilon(delta))


def personal_report(noise: PrivateNoise, passes: int, delta: float,
                    relation: str) -> dict:
  """The personal heads' privacy, for summaries (`personal_epsilon`)."""
  return {
      'epsilon': personal_epsilon(noise.noise_multiplier, passes, delta,
                                  relation),
      'delta': delta,
      'passes': passes,
      'noise_multiplier': noise.noise_multiplier,
      'clip_norm': noise.clip_norm,
      'neighboring_relation': relation,
      'accountant': 'rdp',
      'notes': (f'A personal head after at most {passes} noised local passes '
                '(one per round it could take part in, plus each evaluation\'s '
                'fine-tuning pass), each the Gaussian mechanism on its user\'s '
                'data without subsampling, composed; personal embeddings are '
                'not noised and not covered.'),
  }
