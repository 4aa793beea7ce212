"""FedDVA's losses: closed-form KLs against Monte Carlo, the Eq. 26 bound,
the hinge of Eq. 7 at the constraint boundary, and the xi = beta = 0 case."""

import numpy as np
import pytest
import tensorflow as tf

from tff_personal.models import feddva as feddva_lib
from tff_personal.models import feddva_losses as losses


def _log_normal(x, mu, logvar):
  return -0.5 * np.sum(np.log(2 * np.pi) + logvar
                       + (x - mu) ** 2 / np.exp(logvar), axis=-1)


def test_gaussian_kl_matches_monte_carlo():
  rng = np.random.default_rng(0)
  d, n = 3, 400_000
  mu_q, mu_p = rng.normal(size=d), rng.normal(size=d)
  logvar_q, logvar_p = rng.normal(scale=0.5, size=d), rng.normal(
      scale=0.5, size=d)
  x = mu_q + np.exp(0.5 * logvar_q) * rng.normal(size=(n, d))
  samples = _log_normal(x, mu_q, logvar_q) - _log_normal(x, mu_p, logvar_p)
  mc, se = samples.mean(), samples.std() / np.sqrt(n)
  closed = float(losses.gaussian_kl(
      *(tf.constant(a, tf.float32) for a in (mu_q, logvar_q, mu_p, logvar_p))))
  assert abs(closed - mc) < 4 * se + 1e-3, (closed, mc, se)
  to_prior = float(losses.kl_to_standard_normal(
      tf.constant(mu_q, tf.float32), tf.constant(logvar_q, tf.float32)))
  prior_samples = _log_normal(x, mu_q, logvar_q) - _log_normal(
      x, np.zeros(d), np.zeros(d))
  assert abs(to_prior - prior_samples.mean()) < 4 * (
      prior_samples.std() / np.sqrt(n)) + 1e-3


def test_mixture_bound_is_an_upper_bound_of_monte_carlo_kl():
  rng = np.random.default_rng(1)
  k, d, n = 5, 2, 200_000
  mu = rng.normal(size=(k, d))
  logvar = rng.normal(scale=0.3, size=(k, d))
  bound = losses.mixture_kl_upper_bound(
      tf.constant(mu, tf.float32), tf.constant(logvar, tf.float32)).numpy()
  for i in range(k):
    x = mu[i] + np.exp(0.5 * logvar[i]) * rng.normal(size=(n, d))
    log_mix = np.logaddexp.reduce(
        np.stack([_log_normal(x, mu[j], logvar[j]) for j in range(k)]),
        axis=0) - np.log(k)
    samples = _log_normal(x, mu[i], logvar[i]) - log_mix
    mc, se = samples.mean(), samples.std() / np.sqrt(n)
    assert mc - 4 * se <= bound[i] + 1e-4, (i, mc, bound[i])
    # Jensen's gap is strict here (distinct components) and the bound is the
    # mean of the closed-form pairwise KLs.
    assert bound[i] > mc
    pairwise = [float(losses.gaussian_kl(
        *(tf.constant(a, tf.float32)
          for a in (mu[i], logvar[i], mu[j], logvar[j])))) for j in range(k)]
    np.testing.assert_allclose(bound[i], np.mean(pairwise), rtol=1e-5)


def test_mixture_bound_is_zero_for_identical_posteriors():
  mu = tf.constant([[0.3, -1.0]] * 4)
  logvar = tf.constant([[-0.5, 0.2]] * 4)
  np.testing.assert_allclose(
      losses.mixture_kl_upper_bound(mu, logvar).numpy(), 0.0, atol=1e-6)


@pytest.mark.parametrize('kl_prior,kl_mix,xi,expect_prior,expect_mix', [
    # Constraint KL_prior - KL_mix >= xi holds: R_c is the slack regularizer.
    (5.0, 1.0, 2.0, 1.0, 0.0),
    # Violated: R_c = xi + KL_mix; no gradient to KL_prior.
    (2.5, 1.0, 2.0, 0.0, 1.0),
    # Exactly on the boundary: tf.maximum's gradient goes to its first
    # argument, the constraint side (documented in feddva_losses).
    (3.0, 1.0, 2.0, 0.0, 1.0),
])
def test_hinge_gradient_at_the_constraint_boundary(kl_prior, kl_mix, xi,
                                                   expect_prior, expect_mix):
  p, m = tf.Variable(kl_prior), tf.Variable(kl_mix)
  with tf.GradientTape() as tape:
    r = losses.slack_regularizer(p, m, xi)
  g_p, g_m = tape.gradient(r, [p, m])
  assert float(r) == pytest.approx(max(xi + kl_mix, kl_prior))
  assert float(g_p if g_p is not None else 0.0) == expect_prior
  assert float(g_m if g_m is not None else 0.0) == expect_mix


def test_hinge_switches_just_across_the_boundary():
  xi, mix = 2.0, 1.0
  for delta, expect in ((-1e-3, (0.0, 1.0)), (1e-3, (1.0, 0.0))):
    p, m = tf.Variable(xi + mix + delta), tf.Variable(mix)
    with tf.GradientTape() as tape:
      r = losses.slack_regularizer(p, m, xi)
    grads = [0.0 if g is None else float(g) for g in tape.gradient(r, [p, m])]
    assert tuple(grads) == expect, delta


@pytest.mark.parametrize('kl_prior', [2.5, 3.0, 5.0])
def test_constraint_weight_one_is_the_papers_max_form(kl_prior):
  # max(a, b) = b + relu(a - b): the penalty reading at rho = 1 is Eq. 7.
  xi, mix = 2.0, 1.0
  value = float(losses.slack_regularizer(kl_prior, mix, xi))
  assert value == max(xi + mix, kl_prior)
  p, m = tf.constant(kl_prior), tf.constant(mix)
  assert float(p + tf.nn.relu(xi + m - p)) == pytest.approx(value)
  assert float(losses.slack_regularizer(p, m, xi, 1.0)) == value


@pytest.mark.parametrize('rho', [0.0, 0.5, 2.0, 10.0])
def test_constraint_weight_pushes_the_prior_kl_up_while_violated(rho):
  xi = 2.0
  # Violated (2.5 < xi + 1): d/dP = 1 - rho, d/dKL_mix = rho.
  p, m = tf.Variable(2.5), tf.Variable(1.0)
  with tf.GradientTape() as tape:
    r = losses.slack_regularizer(p, m, xi, rho)
  g_p, g_m = tape.gradient(r, [p, m])
  assert float(r) == pytest.approx(2.5 + rho * (xi + 1.0 - 2.5))
  assert float(g_p) == pytest.approx(1.0 - rho)
  assert float(g_m) == pytest.approx(rho)
  # Met (5 > xi + 1): only the slack regularizer, whatever rho.
  p, m = tf.Variable(5.0), tf.Variable(1.0)
  with tf.GradientTape() as tape:
    r = losses.slack_regularizer(p, m, xi, rho)
  g_p, g_m = tape.gradient(r, [p, m])
  assert float(r) == 5.0
  assert float(g_p) == 1.0
  assert float(0.0 if g_m is None else g_m) == 0.0


def test_constraint_weight_reaches_the_loss_and_bad_weights_are_refused():
  config = feddva_lib.FeddvaConfig(z_dim=2, c_dim=3, channels=(2, 2, 2, 2),
                                   hidden=8)
  model, x, eps_z, eps_c = _model_and_noise(config)
  out = model.forward(x, eps_z, eps_c)
  parts = {rho: losses.feddva_loss(
      x, out, losses.LossConfig(constraint_weight=rho), config.c_dim)
           for rho in (1.0, 3.0)}
  # xi = 24 nats against a fresh encoder's posteriors: violated everywhere,
  # so R_c grows by (rho - 1) x the mean hinge.
  assert float(parts[1.0]['constraint_met']) == 0.0
  hinge = (24.0 + parts[1.0]['kl_c_mixture'] - parts[1.0]['kl_c_prior'])
  np.testing.assert_allclose(
      float(parts[3.0]['r_c'] - parts[1.0]['r_c']), 2.0 * float(hinge),
      rtol=1e-5)
  for bad in (-1.0, float('nan')):
    with pytest.raises(ValueError, match='constraint_weight'):
      losses.LossConfig(constraint_weight=bad)


def _model_and_noise(config):
  tf.keras.utils.set_random_seed(3)
  model = feddva_lib.FeddvaModel(config)
  x = tf.random.uniform([6, 28, 28, 1])
  eps_z = tf.random.normal([6, config.z_dim])
  eps_c = tf.random.normal([6, config.c_dim])
  return model, x, eps_z, eps_c


def _grads(model, x, eps_z, eps_c, fn):
  variables = model.encoder_c.trainable_variables
  with tf.GradientTape() as tape:
    out = model.forward(x, eps_z, eps_c)
    value = fn(out)
  return [tf.zeros_like(v) if g is None else g
          for g, v in zip(tape.gradient(value, variables), variables)]


def test_xi_zero_beta_zero_gives_the_c_encoder_no_regularizer_gradient():
  config = feddva_lib.FeddvaConfig(z_dim=2, c_dim=3, channels=(2, 2, 2, 2),
                                   hidden=8)
  model, x, eps_z, eps_c = _model_and_noise(config)
  c_dim = config.c_dim

  def total(beta):
    cfg = losses.LossConfig(alpha=1.0, beta=beta, xi=0.0)
    return lambda out: losses.feddva_loss(x, out, cfg, c_dim)['loss']

  def without_regularizer(out):
    return tf.reduce_mean(
        losses.bernoulli_nll(x, out['logits'])
        + losses.kl_to_standard_normal(out['mu_z'], out['logvar_z']))

  def regularizer_only(beta):
    cfg = losses.LossConfig(alpha=0.0, beta=beta, xi=0.0)
    def fn(out):
      parts = losses.feddva_loss(x, out, cfg, c_dim)
      return parts['loss'] - parts['reconstruction']
    return fn

  zero_reg = _grads(model, x, eps_z, eps_c, regularizer_only(0.0))
  for g in zero_reg:
    np.testing.assert_array_equal(g.numpy(), 0.0)
  # The c-encoder still learns from reconstruction, and exactly from it.
  with_beta0 = _grads(model, x, eps_z, eps_c, total(0.0))
  reference = _grads(model, x, eps_z, eps_c, without_regularizer)
  assert any(float(tf.reduce_max(tf.abs(g))) > 0 for g in reference)
  for a, b in zip(with_beta0, reference):
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-7)
  # Counter-check: with beta > 0 the regularizer does reach the c-encoder.
  reg = _grads(model, x, eps_z, eps_c, regularizer_only(0.75))
  assert any(float(tf.reduce_max(tf.abs(g))) > 0 for g in reg)


def test_default_xi_is_eight_times_dim_c_and_bad_weights_are_rejected():
  assert losses.LossConfig().xi_for(4) == 32.0
  assert losses.LossConfig(xi=1.5).xi_for(4) == 1.5
  with pytest.raises(ValueError, match='alpha and beta'):
    losses.LossConfig(beta=-1.0)
  with pytest.raises(ValueError, match='xi'):
    losses.LossConfig(xi=-1.0)


def test_eq26_bound_charges_precise_codes_far_more_than_the_prior_kl():
  """Why FedDVA's c collapses and z takes the client's varying marks.

  n posteriors of one client code a within-client factor (means spread
  uniformly on [-1, 1], one dimension) with precision sigma. The Eq. 26
  bound, which R_c charges c for this code while Inequation 5 is violated,
  is the mean pairwise KL, Var(mu) / sigma^2: it grows like 1 / sigma^2.
  R_z charges z the KL to N(0, 1), which grows like log(1 / sigma). The true
  KL to the client's mixture (Monte-Carlo) stays near the code's
  information, below log n. So per nat of within-client information, c pays
  many times what z pays once the code is precise, and minimising Eq. 4 puts
  that information in z (docs/feddva.md, varied marks).
  """
  rng = np.random.default_rng(4)
  n, draws = 64, 20_000
  mu = np.linspace(-1.0, 1.0, n)[:, None]
  bounds, priors, mixtures = [], [], []
  for sigma in (0.3, 0.1, 0.03):
    logvar = np.full_like(mu, 2 * np.log(sigma))
    bounds.append(float(tf.reduce_mean(losses.mixture_kl_upper_bound(
        tf.constant(mu, tf.float32), tf.constant(logvar, tf.float32)))))
    priors.append(float(tf.reduce_mean(losses.kl_to_standard_normal(
        tf.constant(mu, tf.float32), tf.constant(logvar, tf.float32)))))
    mc = []
    for i in range(0, n, 8):
      x = mu[i] + sigma * rng.normal(size=(draws, 1))
      log_mix = np.logaddexp.reduce(
          np.stack([_log_normal(x, mu[j], logvar[j]) for j in range(n)]),
          axis=0) - np.log(n)
      mc.append(np.mean(_log_normal(x, mu[i], logvar[i]) - log_mix))
    mixtures.append(float(np.mean(mc)))
  var = float(np.var(mu))
  for sigma, bound in zip((0.3, 0.1, 0.03), bounds):
    # The bound is Var(mu) / sigma^2 exactly (equal variances).
    np.testing.assert_allclose(bound, var / sigma ** 2, rtol=1e-4)
  # 1 / sigma^2 against log(1 / sigma): 3.3 times the precision costs c 11
  # times as much, and z log(3.3) = 1.2 nats more.
  assert bounds[2] / bounds[1] == pytest.approx((0.1 / 0.03) ** 2, rel=1e-3)
  assert priors[2] - priors[1] == pytest.approx(np.log(0.1 / 0.03), rel=0.05)
  # The true mixture KL is bounded by log n and close to the prior KL ...
  assert all(m < np.log(n) for m in mixtures)
  assert mixtures[1] < priors[1] + 0.5
  # ... while the bound charged for c is an order of magnitude above both.
  assert bounds[1] > 10 * max(priors[1], mixtures[1])
  print('sigma 0.3 / 0.1 / 0.03: Eq. 26 bound', np.round(bounds, 2),
        'prior KL', np.round(priors, 2), 'mixture KL (MC)',
        np.round(mixtures, 2))


def test_sampled_mixture_kl_averages_to_the_monte_carlo_kl_and_is_bounded():
  rng = np.random.default_rng(5)
  k, d, draws = 6, 3, 20_000
  mu = rng.normal(size=(k, d)).astype(np.float32)
  logvar = rng.normal(scale=0.3, size=(k, d)).astype(np.float32)
  # Each draw: one c_i ~ q_i per sample; average the estimates over draws.
  eps = rng.normal(size=(draws, k, d)).astype(np.float32)
  c = mu + np.exp(0.5 * logvar) * eps
  est = np.stack([losses.mixture_kl_sampled(
      tf.constant(c[t]), tf.constant(mu), tf.constant(logvar)).numpy()
                  for t in range(0, draws, 100)])
  assert np.all(est <= np.log(k) + 1e-5)
  bound = losses.mixture_kl_upper_bound(tf.constant(mu),
                                        tf.constant(logvar)).numpy()
  for i in range(k):
    x = c[:, i, :].astype(np.float64)
    log_mix = np.logaddexp.reduce(
        np.stack([_log_normal(x, mu[j], logvar[j]) for j in range(k)]),
        axis=0) - np.log(k)
    mc = np.mean(_log_normal(x, mu[i], logvar[i]) - log_mix)
    se = est[:, i].std() / np.sqrt(len(est))
    assert abs(est[:, i].mean() - mc) < 4 * se + 1e-3, (i, est[:, i].mean(),
                                                       mc)
    assert mc < bound[i]  # The bound sits above what is estimated.
  # Identical posteriors: the mixture is each of them, the estimate is 0.
  same = losses.mixture_kl_sampled(
      tf.constant(c[0]), tf.constant(np.repeat(mu[:1], k, 0)),
      tf.constant(np.repeat(logvar[:1], k, 0))).numpy()
  np.testing.assert_allclose(same, 0.0, atol=1e-5)


def test_moment_mixture_kl_prices_a_within_client_code_at_its_information():
  """The moment-matched KL's batch mean is 0.5 log(1 + Var(mu) / sigma^2)
  for a Gaussian code, close to the Monte-Carlo KL to the mixture where the
  bound charges Var / sigma^2 (the case of the test above)."""
  n = 64
  mu = np.linspace(-1.0, 1.0, n)[:, None]
  var = float(np.var(mu))
  for sigma in (0.3, 0.1, 0.03):
    logvar = np.full_like(mu, 2 * np.log(sigma))
    moment = losses.mixture_kl_moment(tf.constant(mu, tf.float32),
                                      tf.constant(logvar, tf.float32)).numpy()
    assert np.all(moment >= 0)
    np.testing.assert_allclose(moment.mean(),
                               0.5 * np.log1p(var / sigma ** 2), rtol=1e-4)
  # Against the Monte-Carlo KL to the mixture (1.7 nats at sigma 0.1, 1.77
  # here; the bound is 34.4) for a posterior drawn at random.
  rng = np.random.default_rng(7)
  k, d, draws = 48, 2, 20_000
  mu = rng.normal(size=(k, d))
  logvar = np.full((k, d), 2 * np.log(0.5))
  moment = losses.mixture_kl_moment(tf.constant(mu, tf.float32),
                                    tf.constant(logvar, tf.float32)).numpy()
  mc = []
  for i in range(0, k, 6):
    x = mu[i] + 0.5 * rng.normal(size=(draws, d))
    log_mix = np.logaddexp.reduce(
        np.stack([_log_normal(x, mu[j], logvar[j]) for j in range(k)]),
        axis=0) - np.log(k)
    mc.append(np.mean(_log_normal(x, mu[i], logvar[i]) - log_mix))
  assert abs(np.mean(moment[::6]) - np.mean(mc)) < 0.1 * np.mean(mc), (
      np.mean(moment[::6]), np.mean(mc))
  # Identical posteriors: the mixture is each of them, the KL is 0.
  same = losses.mixture_kl_moment(
      tf.constant(np.repeat(mu[:1], k, 0), tf.float32),
      tf.constant(logvar, tf.float32)).numpy()
  np.testing.assert_allclose(same, 0.0, atol=1e-5)


def test_sampled_mixture_kl_loss_reaches_the_c_encoder_and_names_bad_modes():
  model = feddva_lib.FeddvaModel(feddva_lib.FeddvaConfig(
      z_dim=2, c_dim=2, channels=(2, 2, 2, 2), hidden=8))
  x = tf.constant(np.random.default_rng(6).uniform(size=(8, 28, 28, 1)),
                  tf.float32)
  seed = tf.constant([1, 2])
  values = {}
  for mode in losses.MIXTURE_KL:
    config = losses.LossConfig(mixture_kl=mode)
    with tf.GradientTape() as tape:
      out = model.loss(x, config, seed=seed)
    grads = tape.gradient(out['loss'], model.encoder_c.trainable_variables)
    assert all(g is not None for g in grads)
    values[mode] = float(out['kl_c_mixture'])
  # Same draw, other estimate of the same KL: the bound is the larger.
  assert values['bound'] > values['sampled']
  assert values['bound'] > values['moment'] > 0
  assert values['sampled'] <= np.log(8) + 1e-5
  with pytest.raises(ValueError, match="mixture_kl must be one of .*'exact'"):
    losses.LossConfig(mixture_kl='exact')
