"""FedDVA's training recipes: the paper's, the authors' released code's, ours.

A recipe is the set of choices that the paper's equations leave to the
implementation: the client round's passes, how each KL is computed, the
prior of c, the reconstruction criterion, the loss weights and the sizes of
z and c. `recipe(name)` gives them as one `Recipe`; `recipe(name, ablate)`
puts the paper's choice back for the named elements, one at a time or
several, so that an ablation says which element carries a result.

Recipes (`RECIPES`):

* 'paper': the paper's equations as `models/feddva_losses.py` reads them,
  Algorithm 1's two passes, alpha 1, beta 0.75, xi = 8 x dim(c), dims 8.
* 'authors': what the authors' public code (github.com/pysleepy/FedDVA)
  trains MNIST with. Read, not copied; the elements (`ELEMENTS`) and the
  lines each follows (file paths in that repository):

  - 'schedule': three passes per round (`FedClientDVAUnsupervised.py`,
    `fit`, lines 82-205): the decoder alone (lines 82-104), the z side on
    reconstruction + KL_z (lines 109-143) and the c side with the decoder
    (lines 148-205); passes 1 and 2 call the model with `on_c=False`, so c
    is a draw from N(0, I) there (`models/DualEncoderMNIST.py`, lines
    123-131). `feddva_training`'s schedule 'authors'.
  - 'c_prior': the slack term's prior on c is centred on the batch mean of
    mu_c, with no gradient through the mean (`FedClientDVAUnsupervised.py`
    lines 175 and 180, used at line 196). `LossConfig.c_prior='local'`.
  - 'kl_floor': 0.01 added to the prior's variance in every KL
    (`models/funcs.py`, `loss_dkl`, line 20, and `loss_reg_c`, lines 36 and
    40). `LossConfig.kl_floor`.
  - 'detach_reference': Eq. 26's reference side q_j is detached
    (`models/funcs.py`, `loss_reg_c`, lines 36-40).
    `LossConfig.detach_reference`.
  - 'resamples': each batch repeated `n_resamples` times (lines 93-94,
    120-121, 161-162); the MNIST notebook sets `n_resamples = 0`, which
    their guard `if n_resamples > 0` leaves as one copy, so the recipe's
    value is 1 and the element matters only when set above 1.
  - 'reconstruction': `FocalLoss(gamma=5)` (`experiments_mnist.ipynb`, the
    settings cell; `models/funcs.py`, `FocalLoss.forward`, lines 107-118)
    on the decoder's tanh output (`models/DualEncoderMNIST.py`, line 73).
    `LossConfig.reconstruction='focal'`.
  - 'weights': the MNIST notebook's loss weights, lbd_dec = lbd_z = lbd_c =
    lbd_cc = 1 and xi = 0.5; the c-side loss is lbd_c KL(q || prior) +
    lbd_cc relu(xi + Eq. 26 - KL(q || N(0, 1))) (line 196), i.e. beta 1 and
    constraint weight 1 in `LossConfig`'s penalty form.
  - 'dims': d_z = d_c = 1 (the notebook's settings cell).

  Their notebook also trains 5 local epochs per pass at batch 256 with Adam
  1e-3: those are the experiment's local epochs, batch size and client
  optimizer, set by the run (docs/papers/feddva.md gives the command). The
  networks stay ours (`models/feddva.py`): their backbones use batch norm
  and leaky ReLU at widths 64-512, and their c-encoder reads x and z as two
  28 x 28 channels. One more difference is the optimizer: their decoder
  keeps one Adam state from pass 1 into pass 3 of a round (one optimizer
  per module, made at the start of `fit`), where every pass here starts a
  fresh one (`feddva_training`).
* 'sampled_mixture_kl': the paper's recipe with Eq. 7's mixture KL
  estimated without bias instead of bounded (`LossConfig.mixture_kl=
  'sampled'`; ours, not the paper's).

Example:

    r = feddva_recipes.recipe('authors', ablate=('c_prior',))
    process = feddva.build_feddva(config_with(r.dim), r.loss,
                                  schedule=r.schedule,
                                  resamples=r.resamples)
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from tff_personal.models import feddva_losses

RECIPES = ('paper', 'authors', 'sampled_mixture_kl')
ELEMENTS = ('schedule', 'c_prior', 'kl_floor', 'detach_reference',
            'resamples', 'reconstruction', 'weights', 'dims')


@dataclasses.dataclass(frozen=True)
class Recipe:
  """A FedDVA recipe: its loss, client schedule, resamples and dims."""
  loss: feddva_losses.LossConfig
  schedule: str = 'paper'
  resamples: int = 1
  dim: int = 8


# Each element's value under the paper's recipe and under the authors'.
# Loss fields are LossConfig's; the others are Recipe's.
_PAPER = dict(schedule='paper', c_prior='standard', kl_floor=0.0,
              detach_reference=False, resamples=1, reconstruction='bernoulli',
              weights=dict(alpha=1.0, beta=0.75, xi=None,
                           constraint_weight=1.0),
              dims=8)
_AUTHORS = dict(schedule='authors', c_prior='local', kl_floor=0.01,
                detach_reference=True, resamples=1, reconstruction='focal',
                weights=dict(alpha=1.0, beta=1.0, xi=0.5,
                             constraint_weight=1.0),
                dims=1)


def recipe(name: str, ablate: Sequence[str] = ()) -> Recipe:
  """The recipe `name`, with the paper's choice for the elements `ablate`.

  Args:
    name: one of RECIPES.
    ablate: elements (ELEMENTS) to switch back to the paper's; only the
      'authors' recipe has elements to switch.

  Returns:
    A `Recipe`.

  Raises:
    ValueError: an unknown recipe or element, or an ablation of a recipe
      other than 'authors'.
  """
  if name not in RECIPES:
    raise ValueError(f'FedDVA recipe must be one of {RECIPES}, got {name!r}')
  ablate = tuple(ablate)
  unknown = [e for e in ablate if e not in ELEMENTS]
  if unknown:
    raise ValueError(f'unknown FedDVA recipe elements {unknown}; the '
                     f'elements are {ELEMENTS}')
  if ablate and name != 'authors':
    raise ValueError(f"only the 'authors' recipe has elements to ablate; "
                     f'recipe {name!r} got ablate={list(ablate)}')
  if name == 'sampled_mixture_kl':
    return Recipe(feddva_losses.LossConfig(mixture_kl='sampled'))
  if name == 'paper':
    return Recipe(feddva_losses.LossConfig())
  chosen = {e: (_PAPER if e in ablate else _AUTHORS)[e] for e in ELEMENTS}
  loss = feddva_losses.LossConfig(
      **chosen['weights'], kl_floor=chosen['kl_floor'],
      detach_reference=chosen['detach_reference'],
      c_prior=chosen['c_prior'], reconstruction=chosen['reconstruction'])
  return Recipe(loss, schedule=chosen['schedule'],
                resamples=chosen['resamples'], dim=chosen['dims'])
