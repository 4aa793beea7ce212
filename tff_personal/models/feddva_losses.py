"""FedDVA's loss (Equation 4 of "Personalization Disentanglement for FL").

For a sample x on client k, with q(z|x) = N(mu_z, diag exp(logvar_z)) from
the shared encoder f, q(c|x, z) = N(mu_c, diag exp(logvar_c)) from the shared
encoder h and the client's private decoder p_k(x|z, c):

    loss = -E_q[log p_k(x|z, c)] + beta * R_c + alpha * R_z          (Eq. 4)
    R_z  = KL(q(z|x) || N(0, I))                                      (Eq. 6)
    R_c  = max(xi_k + KL(q(c|x,z) || p_bar_k(c)),
               KL(q(c|x,z) || q(c)))                                  (Eq. 7)

with q(c) = N(0, I) (the paper's assumption on the mixture of local priors)
and p_bar_k the mixture of the c-posteriors of the client's samples. The
hinge form of Eq. 7 is the constraint of Inequation 5,
KL(q||q(c)) - KL(q||p_bar_k) >= xi_k: while it holds, R_c is the slack
regularizer KL(q||q(c)) (pulling c towards the prior); while it is violated,
R_c is xi_k + KL(q||p_bar_k) (pulling the client's posteriors together).
At a tie, `tf.maximum` sends the gradient to its first argument (TF's
`x >= y` mask), i.e. to the constraint side; the test pins this down.

Readings of the paper, written down here:

* Eq. 4 is printed with R_c inside the negated expectation; the sign that
  makes it a loss to minimise is `+ beta * R_c` (the regularizer is a
  penalty), which is what we use.
* KL(q||p_bar_k) has no closed form (p_bar_k is a mixture); we use the upper
  bound of Eq. 26 (Jensen): the mean over the client's samples j of the
  closed-form KL(q_i || q_j) of Eq. 24. The mixture is taken over the
  *mini-batch* (the client's samples seen together), j = i included, as any
  mini-batch implementation must. The bound is loose in a way that shapes
  what FedDVA learns: for posteriors whose means spread Var(mu) within the
  client at precision sigma it is Var(mu) / sigma^2, while the true KL to
  the mixture stays below log(batch) and near the code's information, and
  R_z charges z only ~log(1 / sigma) for the same code; so a within-client
  factor costs c far more than z (tests/feddva_losses_test.py; its
  consequences: docs/papers/feddva_notes.md).
* `LossConfig(mixture_kl='sampled')` is our variant, not the paper's: the
  KL(q_i || p_bar_k) that Eq. 7 names, estimated without bias from the
  reparameterised sample c_i ~ q_i that the decoder reads,
  log q_i(c_i) - log (1/n) sum_j q_j(c_i) (the minibatch estimator of
  aggregate-posterior terms, e.g. Chen et al. 2018, beta-TCVAE), instead
  of Eq. 26's bound. It is at most log n per sample and charges a
  within-client code about its information, as R_z does for z; it tests
  whether the bound's price is what keeps within-client factors out of c.
* `LossConfig(mixture_kl='moment')` is a second variant of ours: the KL to
  the Gaussian moment-matched to the client's batch mixture, N(m, diag s^2)
  with m = mean_j mu_j and s^2 = mean_j (sigma_j^2 + mu_j^2) - m^2 (per
  dimension), in closed form. For posteriors coding a within-client factor
  with spread Var(mu) at precision sigma its batch mean is exactly
  0.5 log(1 + Var(mu) / sigma^2) per dimension, the information of that
  Gaussian code, where the bound charges Var(mu) / sigma^2 and the sampled
  estimate stops at log n (tests/feddva_losses_test.py). It is neither a
  bound nor unbiased: it is exact when the mixture is Gaussian (results:
  docs/papers/feddva_notes.md).
* `LossConfig(constraint_weight=rho)` with rho != 1 is a second reading of
  Eq. 7, also not the paper's printed form. Since max(a, b) = b + relu(a - b),
  Eq. 7 is KL(q||q(c)) + relu(xi + KL(q||p_bar_k) - KL(q||q(c))): the slack
  regularizer plus the constraint's hinge, both weighted 1. At weight 1 the
  two KL(q||q(c)) gradients cancel while the constraint is violated, so
  nothing moves the posteriors towards meeting it except pulling a client's
  posteriors together (docs/papers/feddva_notes.md). The section
  text ("a slack regularizer ... combining with a constraint"; "the larger
  xi_k is, the more personalized representation c is learned") reads as a
  penalty method, and the authors' public code writes it so,
  lambda_c KL(q||q(c)) + lambda_cc relu(xi + bound - KL(q||q(c))), with
  lambda_cc / lambda_c from 1 to 1000 in its configurations. We take
  R_c = KL(q||q(c)) + rho relu(xi + KL(q||p_bar_k) - KL(q||q(c))): with
  rho > 1 a violated constraint pushes KL(q||q(c)) up (c away from the
  prior) by rho - 1 while it pulls the client's posteriors together by rho.
  rho = 1 keeps `tf.maximum` (the paper's form, bit for bit); rho = 0 is a
  plain VAE prior on c (results: docs/papers/feddva_notes.md).
* The likelihood is Bernoulli on pixel intensities in [0, 1] (binary
  cross-entropy summed over pixels), the usual MNIST VAE choice; one
  reparameterised sample of z and of c per example.

The elements of the authors' released training recipe
(`models/feddva_recipes.py` says which lines of their code each follows) are
`LossConfig` fields, each off by default:

* `kl_floor`: every closed-form KL adds this floor to the prior's variance,
  0.5 sum[(mu_q - mu_p)^2 / (var_p + f) - (logvar_q - logvar_p)
  + var_q / (var_p + f) - 1] (their Eq. 24 with f = 0.01). It is no longer
  a KL for f > 0 (the log term keeps the unfloored variance), as theirs.
* `detach_reference`: in Eq. 26's bound the reference side q_j gets no
  gradient; only q_i, the posterior being regularised, moves.
* `c_prior='local'`: the slack regularizer's prior is N(m, I), m the mean of
  the batch's mu_c with no gradient, instead of q(c) = N(0, I); the hinge
  still compares against KL(q || N(0, I)). So R_c = KL(q || N(m, I))
  + rho relu(xi + KL(q || p_bar_k) - KL(q || N(0, I))).
* `reconstruction='focal'`: their criterion, a focal loss of gamma
  `focal_gamma` on a unit Gaussian likelihood of the decoder's tanh output:
  per pixel -(1 - p)^gamma log p with log p = -(x_hat - x)^2 / 2
  - log(2 pi) / 2, summed over pixels (`decoder_mean` gives x_hat).

All terms are per example, summed over dimensions; the loss is their mean
over the batch. Everything is closed form and differentiable; written by
hand because tfp is not a dependency (the formulas are three lines each).
"""

from __future__ import annotations

import collections
import dataclasses

import math

import tensorflow as tf

# How KL(q(c|x,z) || p_bar_k(c)) is computed: 'bound' (the paper's Eq. 26),
# 'sampled' or 'moment' (our variants; see the module docstring).
MIXTURE_KL = ('bound', 'sampled', 'moment')
# The likelihood: 'bernoulli' (sigmoid of the logits; the paper's MNIST
# reading) or 'focal' (the authors' code's criterion on tanh of the logits).
RECONSTRUCTIONS = ('bernoulli', 'focal')
# The slack regularizer's prior on c: 'standard' (q(c) = N(0, I), Eq. 7) or
# 'local' (N(batch mean of mu_c, I), the authors' code).
C_PRIORS = ('standard', 'local')


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """Eq. 4's weights and the readings of its terms.

  Attributes:
    alpha: the weight of R_z.
    beta: the weight of R_c.
    xi: xi_k of Eq. 7; None means the paper's default 8 x dim(c).
    mixture_kl: one of MIXTURE_KL.
    constraint_weight: the weight rho of Eq. 7's hinge against its slack
      regularizer (1 with `c_prior='standard'`: the paper's max form).
    kl_floor: added to the prior's variance in every closed-form KL (0: the
      true KL; the authors' code: 0.01).
    detach_reference: Eq. 26's reference side q_j gets no gradient.
    c_prior: one of C_PRIORS, the slack regularizer's prior.
    reconstruction: one of RECONSTRUCTIONS.
    focal_gamma: the focal loss's gamma (`reconstruction='focal'`).
  """
  alpha: float = 1.0
  beta: float = 0.75
  xi: float | None = None
  mixture_kl: str = 'bound'
  constraint_weight: float = 1.0
  kl_floor: float = 0.0
  detach_reference: bool = False
  c_prior: str = 'standard'
  reconstruction: str = 'bernoulli'
  focal_gamma: float = 5.0

  def __post_init__(self):
    for name, allowed in (('mixture_kl', MIXTURE_KL), ('c_prior', C_PRIORS),
                          ('reconstruction', RECONSTRUCTIONS)):
      if getattr(self, name) not in allowed:
        raise ValueError(f'{name} must be one of {allowed}, got '
                         f'{getattr(self, name)!r}')
    if self.alpha < 0 or self.beta < 0:
      raise ValueError(f'alpha and beta must be >= 0, got alpha={self.alpha}, '
                       f'beta={self.beta}')
    if not self.constraint_weight >= 0:  # Also refuses NaN.
      raise ValueError(f'constraint_weight must be >= 0, got '
                       f'{self.constraint_weight}')
    if self.xi is not None and self.xi < 0:
      raise ValueError(f'xi must be >= 0 (or None for 8 x dim(c)), got '
                       f'{self.xi}')
    if not self.kl_floor >= 0:
      raise ValueError(f'kl_floor must be >= 0, got {self.kl_floor}')
    if not self.focal_gamma >= 0:
      raise ValueError(f'focal_gamma must be >= 0, got {self.focal_gamma}')
    if self.mixture_kl == 'sampled' and (self.kl_floor or
                                         self.detach_reference):
      raise ValueError("kl_floor and detach_reference apply to closed-form "
                       "KLs; mixture_kl='sampled' is a log-density estimate "
                       'and takes neither')
    if self.detach_reference and self.mixture_kl != 'bound':
      raise ValueError("detach_reference is a reading of Eq. 26's bound; it "
                       f"needs mixture_kl='bound', got {self.mixture_kl!r}")

  def xi_for(self, c_dim: int) -> float:
    return 8.0 * c_dim if self.xi is None else float(self.xi)


def gaussian_kl(mu_q, logvar_q, mu_p, logvar_p, floor: float = 0.0):
  """KL(N(mu_q, diag e^logvar_q) || N(mu_p, diag e^logvar_p)), Eq. 24.

  Summed over the last axis; broadcasts over the leading ones. With
  `floor` > 0, the authors' code's form: `floor` is added to the prior's
  variance where it divides (module docstring).
  """
  if floor:
    var_p = tf.exp(logvar_p) + floor
    return 0.5 * tf.reduce_sum(
        tf.square(mu_q - mu_p) / var_p - (logvar_q - logvar_p)
        + tf.exp(logvar_q) / var_p - 1.0, axis=-1)
  return 0.5 * tf.reduce_sum(
      tf.square(mu_q - mu_p) * tf.exp(-logvar_p)
      + tf.exp(logvar_q - logvar_p) - (logvar_q - logvar_p) - 1.0, axis=-1)


def kl_to_standard_normal(mu, logvar, floor: float = 0.0):
  """KL(N(mu, diag e^logvar) || N(0, I)) per example (Eq. 6).

  `floor` as in `gaussian_kl`.
  """
  if floor:
    return gaussian_kl(mu, logvar, tf.zeros_like(mu), tf.zeros_like(logvar),
                       floor)
  return 0.5 * tf.reduce_sum(
      tf.square(mu) + tf.exp(logvar) - logvar - 1.0, axis=-1)


def mixture_kl_upper_bound(mu, logvar, floor: float = 0.0,
                           detach_reference: bool = False):
  """Eq. 26: for each i, mean_j KL(q_i || q_j) >= KL(q_i || mixture of q_j).

  Args:
    mu, logvar: [n, d] posterior parameters of the n samples of a client.
    floor: as in `gaussian_kl` (0: Eq. 24's KL).
    detach_reference: no gradient flows to the reference side q_j.

  Returns:
    [n] upper bounds of KL(q_i || (1/n) sum_j q_j).
  """
  ref_mu, ref_logvar = mu, logvar
  if detach_reference:
    ref_mu, ref_logvar = tf.stop_gradient(mu), tf.stop_gradient(logvar)
  pairwise = gaussian_kl(mu[:, None, :], logvar[:, None, :],
                         ref_mu[None, :, :], ref_logvar[None, :, :],
                         floor)  # [i, j]
  return tf.reduce_mean(pairwise, axis=1)


def _log_normal(c, mu, logvar):
  """log N(c; mu, diag e^logvar), summed over the last axis."""
  return -0.5 * tf.reduce_sum(
      tf.square(c - mu) * tf.exp(-logvar) + logvar + math.log(2 * math.pi),
      axis=-1)


def mixture_kl_sampled(c, mu, logvar):
  """One-sample estimates of KL(q_i || (1/n) sum_j q_j), one per sample.

  Args:
    c: [n, d] samples, c_i ~ q_i (reparameterised: gradients reach mu, logvar
      through c as well).
    mu, logvar: [n, d] posterior parameters of the n samples of a client.

  Returns:
    [n] values log q_i(c_i) - log (1/n) sum_j q_j(c_i); their expectation
    over c_i is the KL, and each is at most log n (j = i is in the sum).
  """
  n = tf.cast(tf.shape(mu)[0], c.dtype)
  own = _log_normal(c, mu, logvar)
  cross = _log_normal(c[:, None, :], mu[None, :, :], logvar[None, :, :])
  return own - (tf.reduce_logsumexp(cross, axis=1) - tf.math.log(n))


def mixture_kl_moment(mu, logvar, floor: float = 0.0):
  """KL(q_i || N(m, diag s^2)), the Gaussian moment-matched to the mixture.

  Args:
    mu, logvar: [n, d] posterior parameters of the n samples of a client.
    floor: as in `gaussian_kl`.

  Returns:
    [n] KLs to N(m, diag s^2), m = mean_j mu_j, s^2 = mean_j (sigma_j^2 +
    mu_j^2) - m^2 (the mixture's mean and per-dimension variance; gradients
    flow through them, as through q_j in Eq. 26's bound).
  """
  m = tf.reduce_mean(mu, axis=0, keepdims=True)
  s2 = tf.reduce_mean(tf.exp(logvar) + tf.square(mu - m), axis=0,
                      keepdims=True)
  return gaussian_kl(mu, logvar, m, tf.math.log(s2), floor)


def slack_regularizer(kl_prior, kl_mixture, xi, constraint_weight=1.0,
                      kl_slack=None):
  """Eq. 7, element-wise.

  With `constraint_weight` 1 and no `kl_slack`, the paper's
  max(xi + KL(q || p_bar_k), KL(q || q(c))); otherwise
  kl_slack + constraint_weight * relu(xi + KL(q || p_bar_k) - KL(q || q(c))),
  `kl_slack` defaulting to `kl_prior` (then it equals the max form at
  weight 1; see the module docstring for both readings).
  """
  if constraint_weight == 1.0 and kl_slack is None:
    return tf.maximum(xi + kl_mixture, kl_prior)
  slack = kl_prior if kl_slack is None else kl_slack
  return slack + constraint_weight * tf.nn.relu(xi + kl_mixture - kl_prior)


def bernoulli_nll(x, logits):
  """-log p(x | logits) per example, summed over all non-batch axes."""
  nll = tf.nn.sigmoid_cross_entropy_with_logits(labels=x, logits=logits)
  return tf.reduce_sum(tf.reshape(nll, [tf.shape(nll)[0], -1]), axis=1)


def focal_gaussian_nll(x, logits, gamma: float):
  """The authors' code's focal criterion per example (module docstring).

  Args:
    x: images in [0, 1].
    logits: the decoder's outputs; the reconstruction is tanh(logits).
    gamma: the focal exponent (0: the unit Gaussian NLL).

  Returns:
    [n] sums over the non-batch axes of -(1 - p)^gamma log p per pixel.
  """
  diff = tf.tanh(logits) - x
  log_p = -0.5 * tf.square(diff) - 0.5 * math.log(2.0 * math.pi)
  per_pixel = -tf.pow(1.0 - tf.exp(log_p), gamma) * log_p
  return tf.reduce_sum(tf.reshape(per_pixel, [tf.shape(per_pixel)[0], -1]),
                       axis=1)


def decoder_mean(logits, reconstruction: str = 'bernoulli'):
  """The decoded image under `reconstruction`: sigmoid or tanh of logits."""
  if reconstruction not in RECONSTRUCTIONS:
    raise ValueError(f'reconstruction must be one of {RECONSTRUCTIONS}, got '
                     f'{reconstruction!r}')
  return tf.tanh(logits) if reconstruction == 'focal' else tf.sigmoid(logits)


def feddva_loss(x, outputs, config: LossConfig, c_dim: int):
  """Eq. 4 on a batch; returns an OrderedDict of batch means.

  Args:
    x: [n, 28, 28, 1] images in [0, 1].
    outputs: the model's forward dict (`logits`, `mu_z`, `logvar_z`, `mu_c`,
      `logvar_c`).
    config: alpha, beta, xi, how the mixture KL is computed and the weight
      of Eq. 7's hinge.
    c_dim: dim(c), for the default xi.

  Returns:
    `loss` (the objective), `reconstruction`, `kl_z` (R_z), `r_c`,
    `kl_c_prior`, `kl_c_mixture` (the Eq. 26 bound, the sampled
    estimate with `mixture_kl='sampled'` or the moment-matched KL with
    'moment') and `constraint_met`
    (the fraction of the batch satisfying Inequation 5).
  """
  xi = config.xi_for(c_dim)
  floor = config.kl_floor
  if config.reconstruction == 'focal':
    reconstruction = focal_gaussian_nll(x, outputs['logits'],
                                        config.focal_gamma)
  else:
    reconstruction = bernoulli_nll(x, outputs['logits'])
  kl_z = kl_to_standard_normal(outputs['mu_z'], outputs['logvar_z'], floor)
  mu_c, logvar_c = outputs['mu_c'], outputs['logvar_c']
  kl_c_prior = kl_to_standard_normal(mu_c, logvar_c, floor)
  if config.mixture_kl == 'sampled':
    kl_c_mixture = mixture_kl_sampled(outputs['c'], mu_c, logvar_c)
  elif config.mixture_kl == 'moment':
    kl_c_mixture = mixture_kl_moment(mu_c, logvar_c, floor)
  else:
    kl_c_mixture = mixture_kl_upper_bound(mu_c, logvar_c, floor,
                                          config.detach_reference)
  kl_slack = None
  if config.c_prior == 'local':
    local_mean = tf.stop_gradient(tf.reduce_mean(mu_c, axis=0,
                                                 keepdims=True))
    kl_slack = gaussian_kl(mu_c, logvar_c, local_mean,
                           tf.zeros_like(local_mean), floor)
  r_c = slack_regularizer(kl_c_prior, kl_c_mixture, xi,
                          config.constraint_weight, kl_slack)
  per_example = reconstruction + config.beta * r_c + config.alpha * kl_z
  mean = tf.reduce_mean
  return collections.OrderedDict(
      loss=mean(per_example), reconstruction=mean(reconstruction),
      kl_z=mean(kl_z), r_c=mean(r_c), kl_c_prior=mean(kl_c_prior),
      kl_c_mixture=mean(kl_c_mixture),
      constraint_met=mean(tf.cast(kl_c_prior - kl_c_mixture >= xi,
                                  tf.float32)))
