"""The elements of the authors' FedDVA recipe (`models/feddva_recipes.py`).

Each element is checked against what the authors' code computes, written
here from its formulas: the KL with the 0.01 floor on the prior's variance,
the detached reference side of Eq. 26, the local prior of c, the focal
criterion, the tiled resamples, and the three passes (each pass moves only
its own variables, and the decoder's pass reads c from the prior). Then the
recipe table itself: which elements the authors' recipe switches and what
an ablation puts back.
"""

import collections
import dataclasses
import math

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tff_personal.algorithms import registry
from tff_personal.models import feddva as feddva_lib
from tff_personal.models import feddva_losses as losses
from tff_personal.models import feddva_recipes as recipes
from tff_personal.models import feddva_training

CONFIG = feddva_lib.FeddvaConfig(z_dim=2, c_dim=3, channels=(2, 2, 2, 3),
                                 hidden=5)
AUTHORS = recipes.recipe('authors')


def _gaussians(n=5, d=3, seed=0):
  rng = np.random.default_rng(seed)
  return (rng.normal(size=(n, d)).astype(np.float32),
          rng.normal(scale=0.7, size=(n, d)).astype(np.float32))


def _their_kl(mu, logvar, mu_p, logvar_p, floor):
  """`loss_dkl` of the authors' models/funcs.py, in numpy."""
  var_p, var = np.exp(logvar_p), np.exp(logvar)
  return 0.5 * np.sum((mu - mu_p) ** 2 / (var_p + floor)
                      - (logvar - logvar_p) + var / (var_p + floor) - 1.0,
                      axis=-1)


def test_floored_kl_is_their_formula_and_zero_floor_is_the_true_kl():
  mu, logvar = _gaussians()
  mu_p, logvar_p = _gaussians(seed=1)
  for floor in (0.0, 0.01, 0.5):
    got = losses.gaussian_kl(mu, logvar, mu_p, logvar_p, floor).numpy()
    np.testing.assert_allclose(got, _their_kl(mu, logvar, mu_p, logvar_p,
                                              floor), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        losses.kl_to_standard_normal(mu, logvar, floor).numpy(),
        _their_kl(mu, logvar, 0.0 * mu, 0.0 * logvar, floor), rtol=1e-5,
        atol=1e-6)
  # Floor 0 is the KL: KL(N(1, 1) || N(0, 1)) = 1/2 per dimension.
  one = np.ones((1, 3), np.float32)
  assert float(losses.kl_to_standard_normal(one, 0 * one)[0]) == (
      pytest.approx(1.5))
  # With a floor it is not a KL: N(0, 1) against itself is below 0.
  zero = np.zeros((1, 1), np.float32)
  assert float(losses.kl_to_standard_normal(zero, zero, 0.01)[0]) == (
      pytest.approx(0.5 * (1 / 1.01 - 1)))


def test_detached_reference_gives_the_same_bound_and_no_gradient_to_q_j():
  mu0, logvar0 = _gaussians(n=4)
  for detach in (False, True):
    mu, logvar = tf.Variable(mu0), tf.Variable(logvar0)
    with tf.GradientTape(persistent=True) as tape:
      bound = losses.mixture_kl_upper_bound(mu, logvar, 0.01, detach)
      first = bound[0]  # Row i = 0: KL(q_0 || q_j), averaged over j.
    expected = np.mean([_their_kl(mu0[0], logvar0[0], mu0[j], logvar0[j],
                                  0.01) for j in range(4)])
    assert float(first) == pytest.approx(expected, rel=1e-5)
    g_mu, g_logvar = tape.gradient(first, [mu, logvar])
    others = np.abs(np.concatenate([g_mu.numpy()[1:], g_logvar.numpy()[1:]]))
    if detach:  # Only q_0, the regularised posterior, gets a gradient.
      assert others.max() == 0.0
    else:
      assert others.max() > 1e-3
    assert np.abs(g_mu.numpy()[0]).max() > 1e-3


def test_local_c_prior_is_centred_on_the_batch_mean():
  mu_c, logvar_c = _gaussians(n=6)
  outputs = collections.OrderedDict(
      logits=tf.zeros([6, 28, 28, 1]), z=tf.zeros([6, 2]),
      c=tf.constant(mu_c), mu_z=tf.zeros([6, 2]), logvar_z=tf.zeros([6, 2]),
      mu_c=tf.constant(mu_c), logvar_c=tf.constant(logvar_c))
  x = tf.fill([6, 28, 28, 1], 0.5)
  config = losses.LossConfig(c_prior='local', xi=0.0, beta=1.0,
                             kl_floor=0.01, detach_reference=True)
  got = losses.feddva_loss(x, outputs, config, c_dim=3)
  local = _their_kl(mu_c, logvar_c, mu_c.mean(axis=0, keepdims=True),
                    0.0 * mu_c, 0.01)
  prior = _their_kl(mu_c, logvar_c, 0.0 * mu_c, 0.0 * mu_c, 0.01)
  bound = np.array([np.mean([_their_kl(mu_c[i], logvar_c[i], mu_c[j],
                                       logvar_c[j], 0.01) for j in range(6)])
                    for i in range(6)])
  # The authors' c-side regulariser: KL to the local prior plus the hinge
  # against the standard one (their line 196, lbd_c = lbd_cc = 1).
  expected = np.mean(local + np.maximum(0.0, bound - prior))
  assert float(got['r_c']) == pytest.approx(expected, rel=1e-5)
  standard = losses.feddva_loss(
      x, outputs, dataclasses.replace(config, c_prior='standard'), c_dim=3)
  assert float(standard['r_c']) == pytest.approx(
      np.mean(np.maximum(bound, prior)), rel=1e-5)


def test_focal_criterion_is_theirs_on_the_tanh_output():
  rng = np.random.default_rng(2)
  x = rng.uniform(size=(3, 28, 28, 1)).astype(np.float32)
  logits = rng.normal(size=(3, 28, 28, 1)).astype(np.float32)
  diff = np.tanh(logits) - x
  logpt = -0.5 * diff ** 2 - 0.5 * math.log(2 * math.pi)
  for gamma in (0.0, 5.0):
    want = (-(1 - np.exp(logpt)) ** gamma * logpt).reshape(3, -1).sum(1)
    np.testing.assert_allclose(
        losses.focal_gaussian_nll(x, logits, gamma).numpy(), want, rtol=1e-5)
  np.testing.assert_allclose(
      losses.decoder_mean(logits, 'focal').numpy(), np.tanh(logits),
      rtol=1e-6)
  with pytest.raises(ValueError, match='reconstruction must be one of'):
    losses.decoder_mean(logits, 'gaussian')


def test_incompatible_readings_are_refused_by_name():
  with pytest.raises(ValueError, match="needs mixture_kl='bound'"):
    losses.LossConfig(mixture_kl='moment', detach_reference=True)
  with pytest.raises(ValueError, match='log-density estimate'):
    losses.LossConfig(mixture_kl='sampled', kl_floor=0.01)
  with pytest.raises(ValueError, match='c_prior must be one of'):
    losses.LossConfig(c_prior='global')
  with pytest.raises(ValueError, match='kl_floor must be >= 0'):
    losses.LossConfig(kl_floor=-0.1)


def _x(seed=3, n=8):
  return tf.constant(np.random.default_rng(seed).uniform(
      size=(n, 28, 28, 1)).astype(np.float32))


def _data(x, batch=4):
  return tf.data.Dataset.from_tensor_slices(collections.OrderedDict(
      x=x, y=tf.zeros([x.shape[0]], tf.int32))).batch(batch)


def _model(seed=0):
  tf.keras.utils.set_random_seed(seed)
  return feddva_lib.FeddvaModel(CONFIG)


def _snapshot(model):
  return {v.name: v.numpy() for v in model.encoder_z.trainable_variables
          + model.encoder_c.trainable_variables
          + model.decoder.trainable_variables}


def _part(model, name):
  return {'decoder': model.decoder, 'encoder_z': model.encoder_z,
          'encoder_c': model.encoder_c}[name].trainable_variables


def test_authors_phases_run_in_order_and_each_moves_only_its_variables(
    monkeypatch):
  model = _model()
  encoders = tuple(v.numpy() for v in model.shared_variables)
  decoder = tuple(v.numpy() for v in model.decoder_variables)
  phases = []
  real = feddva_training._optimise

  def recording(loss_fn, variables, *args, **kwargs):
    before = _snapshot(model)
    out = real(loss_fn, variables, *args, **kwargs)
    after = _snapshot(model)
    moved = {k for k in before if not np.array_equal(before[k], after[k])}
    phases.append((moved, {v.name for v in variables},
                   dict(getattr(loss_fn, 'keywords', {}))))
    return out

  monkeypatch.setattr(feddva_training, '_optimise', recording)
  sgd = tff.learning.optimizers.build_sgdm(0.05)
  feddva_training.client_update(
      model, sgd, sgd, encoders, decoder, _data(_x()), AUTHORS.loss,
      schedule='authors', seed=tf.constant([1, 2], tf.int64))
  names = lambda part: {v.name for v in _part(model, part)}
  expected = [names('decoder'), names('encoder_z'),
              names('encoder_c') | names('decoder')]
  assert [p[1] for p in phases] == expected
  for moved, allowed, _ in phases:
    assert moved and moved <= allowed
  # Passes 1 and 2 read c from the prior (their model(x, on_c=False)),
  # pass 3 holds z fixed.
  assert [p[2].get('c_from_prior', False) for p in phases] == [
      True, True, False]
  assert phases[2][2].get('stop_z') is True


def _round_decoder(schedule, c_encoder_scale, encoder_lr=0.0):
  """The decoder after a round in which only the decoder's pass learns."""
  model = _model()
  for v in model.encoder_c.trainable_variables:
    v.assign(v * c_encoder_scale)
  encoders = tuple(v.numpy() for v in model.shared_variables)
  decoder = tuple(v.numpy() for v in model.decoder_variables)
  sgd = tff.learning.optimizers.build_sgdm
  _, _, new_decoder, _ = feddva_training.client_update(
      model, sgd(0.05), sgd(encoder_lr), encoders, decoder, _data(_x()),
      AUTHORS.loss, schedule=schedule, seed=tf.constant([1, 2], tf.int64))
  return [np.asarray(d) for d in new_decoder]


def test_the_authors_decoder_pass_does_not_read_the_c_encoder():
  # Under 'authors' the decoder's pass draws c from the prior, so the
  # c-encoder's weights cannot change what it learns; under 'reference'
  # (our earlier reading) they do.
  for schedule, same in (('authors', True), ('reference', False)):
    a = _round_decoder(schedule, 1.0)
    b = _round_decoder(schedule, 3.0)
    equal = all(np.array_equal(x, y) for x, y in zip(a, b))
    assert equal is same, schedule


def test_resamples_tile_each_batch_and_count_each_image_once():
  x = _x(n=4)
  seed = tf.constant([5, 6], tf.int64)
  sgd = tff.learning.optimizers.build_sgdm(0.05)

  def run(data, resamples):
    model = _model()
    encoders = tuple(v.numpy() for v in model.shared_variables)
    decoder = tuple(v.numpy() for v in model.decoder_variables)
    return feddva_training.client_update(
        model, sgd, sgd, encoders, decoder, data, AUTHORS.loss,
        schedule='authors', seed=seed, resamples=resamples)

  tiled = run(_data(x, 4), 3)
  by_hand = run(_data(tf.tile(x, [3, 1, 1, 1]), 12), 1)
  for a, b in zip(tf.nest.flatten(tiled[0]) + tf.nest.flatten(tiled[2]),
                  tf.nest.flatten(by_hand[0]) + tf.nest.flatten(by_hand[2])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
  assert float(tiled[1]) == 4.0 and float(by_hand[1]) == 12.0
  plain = run(_data(x, 4), 1)
  leaves = lambda out: np.concatenate([np.ravel(np.asarray(a))
                                       for a in tf.nest.flatten(out[0])])
  assert not np.allclose(leaves(plain), leaves(tiled), rtol=1e-4, atol=0)
  with pytest.raises(ValueError, match='resamples must be >= 1'):
    run(_data(x, 4), 0)


def test_authors_recipe_switches_every_element_and_ablation_puts_one_back():
  paper = recipes.recipe('paper')
  loss = AUTHORS.loss
  assert (AUTHORS.schedule, AUTHORS.resamples, AUTHORS.dim) == (
      'authors', 1, 1)
  assert (loss.kl_floor, loss.detach_reference, loss.c_prior,
          loss.reconstruction, loss.xi, loss.beta, loss.alpha,
          loss.constraint_weight) == (0.01, True, 'local', 'focal', 0.5, 1.0,
                                      1.0, 1.0)
  fields = {'schedule': lambda r: r.schedule,
            'c_prior': lambda r: r.loss.c_prior,
            'kl_floor': lambda r: r.loss.kl_floor,
            'detach_reference': lambda r: r.loss.detach_reference,
            'reconstruction': lambda r: r.loss.reconstruction,
            'weights': lambda r: (r.loss.xi, r.loss.beta),
            'dims': lambda r: r.dim,
            'resamples': lambda r: r.resamples}
  assert set(fields) == set(recipes.ELEMENTS)
  for element, get in fields.items():
    ablated = recipes.recipe('authors', (element,))
    assert get(ablated) == get(paper), element
    for other, get_other in fields.items():
      if other != element:
        assert get_other(ablated) == get_other(AUTHORS), (element, other)
  assert recipes.recipe('sampled_mixture_kl').loss == losses.LossConfig(
      mixture_kl='sampled')
  with pytest.raises(ValueError, match='unknown FedDVA recipe elements'):
    recipes.recipe('authors', ('floor',))
  with pytest.raises(ValueError, match="only the 'authors' recipe"):
    recipes.recipe('paper', ('c_prior',))
  with pytest.raises(ValueError, match='recipe must be one of'):
    recipes.recipe('theirs')


def test_registered_feddva_takes_the_recipe_options():
  parsed = registry.parse_algorithm_options(
      'feddva', ['recipe=authors', 'ablate=c_prior+kl_floor', 'resamples=2',
                 'kl_floor=0.1', 'detach_reference=False'])
  assert parsed == dict(recipe='authors', ablate='c_prior+kl_floor',
                        resamples=2, kl_floor=0.1, detach_reference=False)
