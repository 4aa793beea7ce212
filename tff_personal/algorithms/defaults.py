"""Per-(task, algorithm) default settings: the paper reproductions' settings.

One table, read by `binaries/train.py` (through `binaries/common.py`) and by
the paper modules (`papers/fedembed.py`), so that

  python -m binaries.train --task=mnist_preference \
    --algorithm=fedembed_prototype --data_dir=...

alone runs the cell the reproduction runs (balanced population, no DP, one
seed). Keys are flag names of `binaries/common.py`; a flag given on the
command line always wins.

Every method gets the same budget and the same learning rates (local Adam
3e-3 for shared parameters, 0.1 for private ones: a personal embedding or
head sees only a few local steps per participation, and Adam moves a
parameter by about the learning rate per step). The budget (100 rounds of 50
users, 2 local epochs; with DP 40 rounds of 200 users, 1 local epoch) is
sized so that a cell fits well under 10 minutes on an idle 2-core machine;
how it was chosen is in docs/papers/fedembed_notes.md.

The paper (FedEmbed, Appendix B.1) uses local Adam with PyTorch's defaults
(lr 1e-3) and central Adam with lr 1 on averaged gradients. Here the update a
client sends is its model delta after several local steps (TFF's convention),
for which the server optimizer is SGD with lr 1 (FedAvg) for every method
(why not Adam with lr 1: docs/papers/fedembed_notes.md).
"""

from __future__ import annotations

import types
from typing import Any, Mapping

# Shared by every MNIST-preference method: the budget of one cell.
_MNIST_COMMON = types.MappingProxyType({
    'num_users': 9000,
    'rounds': 100,
    'clients_per_round': 50,
    'local_epochs': 2,
    'batch_size': 10,
    'client_learning_rate': 3e-3,
    'server_optimizer': 'sgd',
    'server_learning_rate': 1.0,
    'eval_every': 50,
    'eval_clients': 500,
    'eval_fine_tune': True,
})

# With `--dp=gaussian_fixed` (every method alike): user-level DP on the whole
# shared update with a larger cohort, since the noise on the mean update is
# noise_multiplier * clip / cohort, and fewer rounds, since every round spends
# privacy budget (at epsilon 10, 40 rounds of 200 of 9,000 users need noise
# multiplier 0.99; 100 rounds would need more noise on every round).
# delta is the library's `privacy.default_target_delta(population)`,
# min(1e-5, population ** -1.1), unless given.
# The binary still needs the privacy budget itself (`--target_epsilon=10` or
# `--noise_multiplier`); the paper module gives `TARGET_EPSILON`.
DP_SETTINGS = types.MappingProxyType({
    'rounds': 40,
    'eval_every': 20,
    'clients_per_round': 200,
    'local_epochs': 1,
    'clip_norm': 1.0,
})
TARGET_EPSILON = 10.0

# Method-specific settings on top of the common ones.
_MNIST_METHODS: dict[str, dict[str, Any]] = {
    'global': {'private_learning_rate': None},
    'global_plus': {'private_learning_rate': 0.1},
    'fedembed_prototype': {'private_learning_rate': 0.1},
    'fedembed_type': {'private_learning_rate': 0.1},
    'fedembed_personal': {'private_learning_rate': 0.1},
    'fedembed_som': {'private_learning_rate': 0.1},
    # FedRep's head at 0.01 (tuning: docs/papers/fedembed_notes.md); pFedMe's
    # inner solver is SGD 0.05 when no private rate is given (a rate
    # switches it to Adam).
    'fedrep': {'private_learning_rate': 0.01},
    'pfedme': {'private_learning_rate': None},
    'pfedme_restart': {'private_learning_rate': None},
    'pfedkm': {'private_learning_rate': None},
}

# Speech preferences (FedEmbed section 4.3: 900 users, 20 voices): the MNIST
# settings on the paper's population, every user evaluated, with a budget
# of 50 rounds of 30 (a speech step processes a 200 x 375 spectrogram, a far
# heavier round than MNIST's; docs/papers/fedembed.md). Not tuned.
_SPEECH_COMMON = types.MappingProxyType({
    **_MNIST_COMMON, 'num_users': 900, 'eval_clients': 900, 'rounds': 50,
    'clients_per_round': 30, 'eval_every': 25})

# The speech model's personal embedding is the diagonal of its 200 x 375
# input channel (Appendix B.2): size 200 for the methods that have one.
_SPEECH_EMBEDDING = {
    m: {'embedding_dim': 200}
    for m in ('global_plus', 'fedembed_prototype', 'fedembed_type',
              'fedembed_personal', 'fedembed_som')}

# DP on speech: 900 users, so a cohort of 200 would need noise multiplier 2.9
# at epsilon 10 over 40 rounds (and a speech round of 200 users is slow);
# 30 rounds of 100 need 1.45: noise on the mean update of 1.45 / 100 = 0.0145
# per unit of clip, as 2.9 / 200 would give (MNIST's 0.99 / 200 = 0.005 is
# lower because MNIST has 10 times the users).
SPEECH_DP_SETTINGS = types.MappingProxyType({
    **DP_SETTINGS, 'rounds': 30, 'eval_every': 15, 'clients_per_round': 100})
_DP_SETTINGS = {'speech_preference': SPEECH_DP_SETTINGS}

_DEFAULTS: dict[str, Mapping[str, Mapping[str, Any]]] = {
    'mnist_preference': {
        m: types.MappingProxyType({**_MNIST_COMMON, **v})
        for m, v in _MNIST_METHODS.items()},
    'speech_preference': {
        m: types.MappingProxyType({
            **_SPEECH_COMMON, **v, **_SPEECH_EMBEDDING.get(m, {})})
        for m, v in _MNIST_METHODS.items()},
}


def defaults_for(task: str, algorithm: str, dp: str = 'none'
                 ) -> dict[str, Any]:
  """The reproduction's flag values for `algorithm` on `task` ({} if none).

  With `dp` other than 'none', `DP_SETTINGS` (`SPEECH_DP_SETTINGS` on speech)
  replace the rounds, the cohort and the local work and give the clip.
  """
  out = dict(_DEFAULTS.get(task, {}).get(algorithm, {}))
  if out and dp != 'none':
    out.update(_DP_SETTINGS.get(task, DP_SETTINGS))
  return out


def apply_defaults(flag_values, task: str, algorithm: str) -> dict[str, Any]:
  """Sets every default whose flag was not given; returns what was set.

  Args:
    flag_values: absl `FlagValues`; a flag counts as given when it is not
      `using_default_value` (set on the command line or by `flagsaver`).
    task: the task name.
    algorithm: the algorithm name.
  """
  applied = {}
  dp = flag_values['dp'].value if 'dp' in flag_values else 'none'
  for name, value in defaults_for(task, algorithm, dp).items():
    if name not in flag_values:
      raise KeyError(f'default for unknown flag --{name} ({task}, {algorithm})')
    if flag_values[name].using_default_value:  # not given by the user
      flag_values[name].value = value
      applied[name] = value
  # A smaller population given by the user is evaluated whole.
  if ('eval_clients' in applied and
      flag_values['eval_clients'].value > flag_values['num_users'].value):
    flag_values['eval_clients'].value = applied['eval_clients'] = 0
  # delta: left to core/privacy.py's default_target_delta(population).
  return applied
