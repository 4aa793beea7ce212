"""What a trained FedDVA model's latents hold: probes, decoder effects, figures.

FedDVA (`models/feddva.py`) wants z to carry what clients share (the digit)
and c what is client-specific (the client, its marks). This module measures
where a trained model puts each, on held-out images:

* `representations`: the posterior means of z and c of every client's test
  images, with each image's digit, client and mark angle.
* `linear_probes`: held-out accuracy of logistic-regression probes (client
  and digit from c and from z) and the R^2 of a linear read-out of the mark
  angle (`mark_r2`).
* `decoder_effects` / `client_decoder_effects`: how far a client's decoder
  output moves when c, or z, is swapped with another image's of the client.
* `probe_feddva` runs all of them on a model; `pooled_vae_probes` trains the
  reference, a plain VAE on the clients' pooled images (`models/pooled_vae`),
  and probes its z.
* `reconstruction_grid` and `latent_figure` draw the decoders on z x c and
  the latents coloured by client.

Example:
  reps, metrics = feddva_probes.probe_feddva(
      config, encoders, decoders, task.clients, seed=0)
  metrics['client_from_c'], metrics['decoder_c_effect']
"""

from __future__ import annotations

import functools
import time
from typing import Callable, Optional, Sequence

import numpy as np

from tff_personal.models import feddva as feddva_lib
from tff_personal.models import pooled_vae
from tff_personal.reports import figures


def feddva_model(config: feddva_lib.FeddvaConfig, encoders: Sequence,
                 decoder: Optional[Sequence] = None
                 ) -> feddva_lib.FeddvaModel:
  """An eager `FeddvaModel` with the given weights.

  Args:
    config: the model's sizes.
    encoders: the shared (encoder) weights, in `shared_variables` order.
    decoder: a decoder's weights (`decoder_variables` order); None leaves
      the decoder at its initialisation.

  Returns:
    The model.

  Example:
    model = feddva_model(config, encoders, decoders[k])
    images = model.decode_mean(z, c)
  """
  model = feddva_lib.FeddvaModel(config)
  for v, w in zip(model.shared_variables, encoders):
    v.assign(w)
  if decoder is not None:
    for v, w in zip(model.decoder_variables, decoder):
      v.assign(w)
  return model


def representations(model, clients: Sequence) -> dict:
  """Posterior means of z and c of every client's test images.

  Args:
    model: anything with `encode(x) -> (mu_z, logvar_z, mu_c, logvar_c)`
      (a `FeddvaModel`).
    clients: each with `test_x` [n, 28, 28, 1], `test_y` [n] and optionally
      `test_mark` [n] (each image's mark angle; None: no marks).

  Returns:
    {'z': [N, z_dim], 'c': [N, c_dim], 'digit': [N], 'client': [N] (the
    client's index in `clients`), 'mark': [N] (NaN where unmarked)}, the
    clients' images in order.
  """
  zs, cs, digits, ids, marks = [], [], [], [], []
  for k, data in enumerate(clients):
    mu_z, _, mu_c, _ = model.encode(data.test_x)
    zs.append(mu_z.numpy())
    cs.append(mu_c.numpy())
    digits.append(data.test_y)
    ids.append(np.full(len(data.test_y), k))
    mark = getattr(data, 'test_mark', None)
    marks.append(np.full(len(data.test_y), np.nan) if mark is None
                 else mark)
  return dict(z=np.concatenate(zs), c=np.concatenate(cs),
              digit=np.concatenate(digits), client=np.concatenate(ids),
              mark=np.concatenate(marks))


def mark_r2(features: np.ndarray, angles: np.ndarray, fit: np.ndarray,
            score: np.ndarray) -> Optional[float]:
  """Held-out R^2 of a linear read-out of an angle from features.

  A least-squares linear map (with intercept) from `features` to (cos, sin)
  of `angles` is fitted on the rows `fit` and scored on the rows `score`.
  R^2 = 1 - sum of squared errors / total sum of squares about the scored
  targets' mean, over both coordinates: 1 is a perfect read-out, 0 no
  better than the mean, negative worse.

  Args:
    features: [n, d].
    angles: [n], radians (NaN where there is none).
    fit, score: index arrays into the rows.

  Returns:
    The R^2, or None where the angle does not vary over `fit` (or is NaN)
    or there are too few rows (at most d + 1 to fit, under 2 to score).

  Example:
    r2 = mark_r2(reps['c'], reps['mark'], np.arange(100), np.arange(100, 200))
  """
  target = np.stack([np.cos(angles), np.sin(angles)], axis=-1)
  if (len(fit) <= features.shape[1] + 1 or len(score) < 2
      or not np.all(np.isfinite(target[fit]))
      or np.ptp(angles[fit]) < 1e-9):
    return None
  design = lambda idx: np.concatenate(
      [features[idx], np.ones((len(idx), 1))], axis=1)
  coef, *_ = np.linalg.lstsq(design(fit), target[fit], rcond=None)
  residual = target[score] - design(score) @ coef
  total = target[score] - target[score].mean(axis=0)
  return float(1.0 - np.sum(residual ** 2) / np.sum(total ** 2))


def linear_probes(reps: dict, seed: int) -> dict:
  """What linear probes read from the latents, on held-out images.

  The images are split at random (by `seed`) into halves, one to fit and
  one to score. Multinomial logistic regression on standardised features
  (scikit-learn) predicts the client and the digit from each latent.

  Args:
    reps: `representations`' dict; without 'c' (a model with no c) the
      c-probes are left out, without 'mark' the mark probes are None.
    seed: the split's seed.

  Returns:
    `client_from_<c|z>`, `digit_from_<c|z>`: accuracy on the scored half;
    `digit_from_z_within_client`: the digit probe fitted and scored within
    each client (a private decoder may read z in its own coordinates),
    averaged over clients weighted by their scored images;
    `mark_from_<c|z>`: `mark_r2` of the mark angle fitted within each
    client, averaged likewise over the clients where it is defined (None if
    none); `chance_client`: the majority client's share of the scored half.

  Example:
    probes = linear_probes(representations(model, task.clients), seed=0)
  """
  from sklearn.linear_model import LogisticRegression  # pylint: disable=g-import-not-at-top
  from sklearn.preprocessing import StandardScaler  # pylint: disable=g-import-not-at-top
  n = len(reps['digit'])
  order = np.random.default_rng([seed, 5]).permutation(n)
  fit, score = order[:n // 2], order[n // 2:]

  def probe(features, target, fit=fit, score=score):
    scaler = StandardScaler().fit(features[fit])
    clf = LogisticRegression(max_iter=3000)
    clf.fit(scaler.transform(features[fit]), target[fit])
    return float(clf.score(scaler.transform(features[score]), target[score]))

  counts = np.bincount(reps['client'][score])
  splits = [(fit[reps['client'][fit] == k], score[reps['client'][score] == k])
            for k in np.unique(reps['client'])]

  def mean_over_clients(per_client):
    kept = [(v, len(score_k)) for v, (_, score_k) in zip(per_client, splits)
            if v is not None]
    return (float(np.average([v for v, _ in kept],
                             weights=[w for _, w in kept])) if kept
            else None)

  within = mean_over_clients([
      probe(reps['z'], reps['digit'], fit_k, score_k)
      if len(score_k) and len(np.unique(reps['digit'][fit_k])) > 1 else None
      for fit_k, score_k in splits])
  latents = [name for name in ('c', 'z') if name in reps]
  out = {f'mark_from_{name}': mean_over_clients([
      mark_r2(reps[name], reps['mark'], fit_k, score_k)
      for fit_k, score_k in splits]) if 'mark' in reps else None
         for name in latents}
  for name in latents:
    out[f'client_from_{name}'] = probe(reps[name], reps['client'])
    out[f'digit_from_{name}'] = probe(reps[name], reps['digit'])
  out['digit_from_z_within_client'] = within
  out['chance_client'] = float(counts.max() / counts.sum())
  return out


def decoder_effects(decode: Callable, z, c, seed: int,
                    max_images: int = 500) -> dict:
  """How far one decoder's output moves with c and with z.

  Each image i (of the first `max_images`) is paired with another image
  pi(i) (a seeded permutation with no fixed point); the effect of c is the
  mean absolute change of the decoded pixels when c_i is replaced by
  c_pi(i), z kept, and the effect of z likewise. A decoder that ignores c
  gives 0 for c.

  Args:
    decode: `decode(z, c)` -> pixel means in [0, 1] (e.g. a `FeddvaModel`'s
      `decode_mean`).
    z, c: [n, dim] codes of one client's images (posterior means), n >= 2.
    seed: the pairing's seed.
    max_images: rows used.

  Returns:
    {'c': effect of c, 'z': effect of z, 'images': rows used}.

  Raises:
    ValueError: `z` and `c` are not [n, dim] with one n, or n < 2.

  Example:
    effects = decoder_effects(model.decode_mean, reps['z'], reps['c'], 0)
  """
  z = np.asarray(z, np.float32)[:max_images]
  c = np.asarray(c, np.float32)[:max_images]
  if z.ndim != 2 or c.ndim != 2 or len(z) != len(c):
    raise ValueError(f'decoder_effects needs z and c of shape (n, dim) '
                     f'with the same n; got {z.shape} and {c.shape}')
  if len(z) < 2:
    raise ValueError(f'decoder_effects needs at least 2 images to swap '
                     f'codes between; got {len(z)}')
  order = np.random.default_rng([seed, 11]).permutation(len(z))
  partner = np.empty_like(order)
  partner[order] = np.roll(order, -1)  # A cycle: no image is its own.
  base = np.asarray(decode(z, c), np.float64)
  swap_c = np.asarray(decode(z, c[partner]), np.float64)
  swap_z = np.asarray(decode(z[partner], c), np.float64)
  return {'c': float(np.mean(np.abs(swap_c - base))),
          'z': float(np.mean(np.abs(swap_z - base))), 'images': len(z)}


def client_decoder_effects(config: feddva_lib.FeddvaConfig,
                           encoders: Sequence, decoders: Sequence,
                           reps: dict, seed: int,
                           reconstruction: str = 'bernoulli') -> dict:
  """`decoder_effects` of each client's decoder on its own images.

  Args:
    config, encoders: the model (`feddva_model`).
    decoders: each client's decoder weights, indexed as `reps['client']`.
    reps: `representations` of the clients' images.
    seed: the pairings' seed.
    reconstruction: the decoder's likelihood (`FeddvaModel.decode_mean`).

  Returns:
    {'c': ..., 'z': ...}: the clients' effects averaged weighted by their
    images; None where no client has 2 images.

  Example:
    effects = client_decoder_effects(config, encoders, decoders, reps, 0)
  """
  effects = []
  for k in range(len(decoders)):
    mine = reps['client'] == k
    if mine.sum() < 2:
      continue
    model = feddva_model(config, encoders, decoders[k])
    decode = functools.partial(model.decode_mean,
                               reconstruction=reconstruction)
    effects.append(decoder_effects(decode, reps['z'][mine], reps['c'][mine],
                                   seed))
  return {name: float(np.average([e[name] for e in effects],
                                 weights=[e['images'] for e in effects]))
                if effects else None for name in ('c', 'z')}


def probe_feddva(config: feddva_lib.FeddvaConfig, encoders: Sequence,
                 decoders: Sequence, clients: Sequence, seed: int,
                 reconstruction: str = 'bernoulli') -> tuple[dict, dict]:
  """A FedDVA model's probes on its clients' test images.

  Args:
    config, encoders: the model; decoders: each client's decoder weights.
    clients: as for `representations`, in the decoders' order.
    seed: the probes' and pairings' seed.
    reconstruction: the decoders' likelihood.

  Returns:
    (`representations`, metrics): `linear_probes`' and
    `decoder_c_effect` / `decoder_z_effect` (`client_decoder_effects`).

  Example:
    reps, metrics = probe_feddva(config, encoders, decoders, task.clients, 0)
  """
  reps = representations(feddva_model(config, encoders), clients)
  metrics = linear_probes(reps, seed)
  effects = client_decoder_effects(config, encoders, decoders, reps, seed,
                                   reconstruction)
  for name in ('c', 'z'):
    metrics[f'decoder_{name}_effect'] = effects[name]
  return reps, metrics


def pooled_vae_probes(config: feddva_lib.FeddvaConfig, clients: Sequence, *,
                      epochs: int, batch_size: int, learning_rate: float,
                      alpha: float, seed: int) -> tuple[dict, dict]:
  """The probes' reference: a plain VAE on every client's images pooled.

  `pooled_vae.train` on the clients' `train_x` together (not federated; no
  c), then `linear_probes` of its z on their test images.

  Args:
    config: the networks and dim(z) (FedDVA's).
    clients: each with `train_x` and what `representations` reads.
    epochs, batch_size, learning_rate, alpha, seed: `pooled_vae.train`'s.

  Returns:
    (`representations` without 'c', metrics): the z probes and `epochs`,
    `seconds_per_epoch`, `final_reconstruction`, `final_kl_z` (nats per
    image, the last epoch's).

  Example:
    reps, metrics = pooled_vae_probes(
        config, task.clients, epochs=30, batch_size=64, learning_rate=1e-3,
        alpha=1.0, seed=0)
    metrics['digit_from_z']
  """
  images = np.concatenate([c.train_x for c in clients])
  start = time.perf_counter()
  model, curve = pooled_vae.train(
      config, images, epochs=epochs, batch_size=batch_size,
      learning_rate=learning_rate, alpha=alpha, seed=seed, log_every=10)
  seconds = time.perf_counter() - start
  reps = {k: v for k, v in representations(model, clients).items()
          if k != 'c'}
  metrics = linear_probes(reps, seed)
  metrics.update(epochs=epochs, seconds_per_epoch=seconds / epochs,
                 final_reconstruction=curve[-1]['reconstruction'],
                 final_kl_z=curve[-1]['kl_z'])
  return reps, metrics


def reconstruction_grid(path: str, config: feddva_lib.FeddvaConfig,
                        encoders: Sequence, decoders: Sequence,
                        clients: Sequence, client_names: Sequence[str],
                        reconstruction: str = 'bernoulli',
                        shared_decoder: bool = False, size: int = 6) -> str:
  """Draws each client's decoder on rows of z x columns of c (a PNG).

  Rows: mu_z of `size` of the client's test images. Columns: mu_c of test
  images of every client in turn (`size // clients` each, at least 1), so
  the columns move c across the clients.

  Args:
    path: the PNG to write.
    config, encoders, decoders: the model and each client's decoder.
    clients: each with `test_x`; client_names: their names.
    reconstruction: the decoders' likelihood.
    shared_decoder: the panels' titles say 'the shared decoder'.
    size: rows per panel.

  Returns:
    `path`.

  Example:
    reconstruction_grid('out/grid.png', config, encoders, decoders,
                        task.clients, task.client_names)
  """
  n = len(clients)
  cols_per_client = max(1, size // n)
  base = feddva_model(config, encoders)
  c_columns = np.concatenate([
      base.encode(clients[j].test_x[:cols_per_client])[2].numpy()
      for j in range(n)])
  ncols = int(np.ceil(np.sqrt(n)))
  nrows = int(np.ceil(n / ncols))
  plt = figures.pyplot()
  fig, axes = plt.subplots(nrows, ncols, figsize=(4 * ncols, 4 * nrows),
                           squeeze=False)
  for k in range(n):
    model = feddva_model(config, encoders, decoders[k])
    mu_z, _, _, _ = model.encode(clients[k].test_x[:size])
    z = np.repeat(mu_z.numpy(), len(c_columns), axis=0)
    c = np.tile(c_columns, (size, 1))
    images = model.decode_mean(z, c, reconstruction).numpy()[..., 0]
    grid = images.reshape(size, len(c_columns), 28, 28).transpose(
        0, 2, 1, 3).reshape(size * 28, len(c_columns) * 28)
    ax = axes[k // ncols][k % ncols]
    ax.imshow(grid, cmap='gray', vmin=0, vmax=1)
    ax.set_title(f'client {k} ({client_names[k]}): '
                 + ('the shared decoder' if shared_decoder
                    else 'its decoder'), fontsize=9)
    ax.set_xlabel('c (from clients ' + ', '.join(
        str(j) for j in range(n) for _ in range(cols_per_client)) + ')',
                  fontsize=7)
    ax.set_ylabel('z')
    ax.set_xticks([])
    ax.set_yticks([])
  for k in range(n, nrows * ncols):
    axes[k // ncols][k % ncols].axis('off')
  fig.tight_layout()
  return figures.save(fig, path)


def latent_figure(path: str, reps: dict, client_names: Sequence[str],
                  max_points: int = 800) -> str:
  """Draws z and c coloured by client (a PNG, two panels).

  Latents of more than two dimensions are drawn as their t-SNE
  (`figures.map_2d`), of two as they are, of one as the value against the
  client (jittered).

  Args:
    path: the PNG to write.
    reps: `representations`' dict (at most `max_points` images are drawn,
      a seeded sample).
    client_names: the clients' names, by index.
    max_points: images drawn.

  Returns:
    `path`.

  Example:
    latent_figure('out/latents.png', reps, task.client_names)
  """
  idx = np.random.default_rng(0).permutation(len(reps['client']))[:max_points]
  jitter = np.random.default_rng(1).uniform(-0.3, 0.3, len(idx))
  plt = figures.pyplot()
  fig, axes = plt.subplots(1, 2, figsize=(10, 4.5))
  for ax, key in zip(axes, ('z', 'c')):
    values = reps[key][idx]
    if values.shape[1] == 1:
      emb = np.stack([values[:, 0], reps['client'][idx] + jitter], axis=1)
      title = f'{key} (posterior mean, 1 dim) by client'
    else:
      emb = figures.map_2d(values)
      title = (f'{key} (posterior means, 2 dims)' if values.shape[1] == 2
               else f't-SNE of {key} (posterior means)')
    for k, name in enumerate(client_names):
      sel = reps['client'][idx] == k
      ax.scatter(emb[sel, 0], emb[sel, 1], s=5, label=f'client {k} ({name})')
    ax.set_title(f'{title}, coloured by client')
    if values.shape[1] > 2:
      ax.set_xticks([])
      ax.set_yticks([])
  axes[1].legend(markerscale=3, fontsize=7)
  fig.tight_layout()
  return figures.save(fig, path)
