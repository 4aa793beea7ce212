"""FedDVA (Personalization Disentanglement for FL): probes, classification.

`python -m binaries.reproduce --paper=feddva --table=classification ...` runs

* `probe` (setting task=marked_mnist, rounds=the FedDVA rounds): FedDVA
  (`algorithms/feddva.py`) trained on `marked_mnist`; on held-out images
  (the clients' test images, half to fit, half to score) multinomial
  logistic-regression probes (scikit-learn) predict the client from the
  posterior mean of c and of z, and the digit from z and from c.
  `chance_client` is the majority-client fraction of the scored half;
  `digit_from_z_within_client` fits the digit probe within each client
  (private decoders may each read z in their own coordinates).
  `mark_from_c` / `mark_from_z` (with `--feddva_marks=varied`, the default):
  how much of each image's mark parameter (the sinusoid's phase, the
  ellipse's rotation) a linear map reads from c / from z, as the R^2 of a
  least-squares fit of (cos, sin) of the parameter, fitted within each
  marked client (the parameter means another thing per mark type) and
  averaged over them; the paper's Figure 3b claims the marks vary with c and
  not with z.
* `fedavg`, `fedavg_ft`, `ditto`, `feddva` on `marked_mnist` and
  `label_skew_mnist` (setting task, rounds = classification rounds):
  accuracy of each client's model on its own test images after every round;
  `final_accuracy` is the mean over clients after the last round,
  `accuracy_std_across_clients` their standard deviation (ddof 0),
  `rounds_to_reach_fedavg_final` the first round whose mean reaches FedAvg's
  final mean (same task and seed; None if never, or if FedAvg has not run).
  `feddva` is the classifier on FedDVA's representations: the two encoders,
  pre-trained by FedDVA for `feddva_vae_rounds` rounds (reported as
  `pretrain_rounds`; they are extra communication rounds the baselines do not
  get), and a 2-FC head on [mu_z; mu_c], tuned together by FedAvg.

Every method trains on the one run path (`runs.run_experiment`): the
baselines are the registered `global` (FedAvg), `fedavg_ft` (its evaluation
fine-tunes one local pass, the task's local epochs) and `ditto`, each run in
its cell's directory; FedDVA is one run of the registered `feddva`
algorithm per task, dims, variant and seed (`feddva_config`, under
<root>/runs/_feddva/), whose 'pretrain' stage the probe cell reads and
whose 'classifier' stage is the `feddva` classification cell, so a probe
and a classification cell of the same dims share it. Every run is
evaluated after every round (its eval_metrics.csv is the curve), resumes
after a kill, and takes the run path's DP, store and sharding.

All clients take part in every round (`--feddva_clients_per_round` samples a
cohort instead). Local training is Adam (lr 1e-3, appendix H) for
`feddva_local_epochs` epochs; server SGD lr 1 (FedAvg). Sizes, rounds and
batch size are flags; the paper's are larger (200 rounds of 5 epochs, batch
256); docs/papers/feddva.md states what was run. `--feddva_recipe` picks the
FedDVA training recipe (`models/feddva_recipes.py`: the paper's, the
authors' released code's, or our sampled mixture KL) and `--feddva_ablate`
switches elements of the authors' back to the paper's.

Figures (rebuilt after every cell into <root_output_dir>/figures/):
`feddva_reconstructions.png` (per client: rows vary z, columns vary c, the
client's own decoder; Figure 3b / 10), `feddva_tsne.png` (t-SNE of z and of
c coloured by client; Figure 5), `feddva_accuracy_curves.png` (mean and
spread across clients vs round, both tasks; Figures 6, 7). With
`--feddva_decoder=shared` the two latent figures are
`*_shared_decoder.png` (one decoder for every client); with
`--feddva_schedule=reference` (the authors' code's three-pass round,
`models/feddva_training.py`) they get `_reference_schedule`; with
`--feddva_mixture_kl=sampled` (Eq. 7's mixture KL estimated from the
sample instead of Eq. 26's bound; ours) `_sampled_mixture_kl`, with
`--feddva_mixture_kl=moment` (the KL to the moment-matched Gaussian; ours)
`_moment_mixture_kl`; with
`--feddva_constraint_weight=rho` (Eq. 7 read as a penalty, rho != 1;
`models/feddva_losses.py`) `_constraint_weight<rho>`; with
`--feddva_marks=fixed` `_fixed_marks`.
"""

from __future__ import annotations

import functools
import os
import time

from absl import flags
import numpy as np

from tasks import client_data_task
from tasks import feddva_tasks
from tff_personal import curve_bands
from tff_personal import atomic_io
from tff_personal import experiment
from tff_personal import reporting
from tff_personal import run_spec
from tff_personal import runs
from tff_personal.algorithms import feddva
from tff_personal.core import process as process_lib
from tff_personal.core import runtime
from tff_personal.models import feddva as feddva_lib
from tff_personal.models import feddva_losses
from tff_personal.models import feddva_recipes
from tff_personal.models import feddva_training
from tff_personal.models import pooled_vae

PAPER = 'feddva'
TASK_NAMES = ('marked_mnist', 'label_skew_mnist')
# Flags that the cells' settings carry (reporting.run_config leaves them out).
SETTING_FLAGS = ('rounds', 'feddva_decoder', 'feddva_schedule',
                 'feddva_marks', 'feddva_mixture_kl',
                 'feddva_constraint_weight', 'feddva_recipe',
                 'feddva_ablate', 'feddva_dp_noise_multiplier',
                 'feddva_dp_clip')
# Flags that change how a run is carried out, not what it computes
# (reporting.run_config leaves them out, so changing one is not a conflict).
OPERATIONAL_FLAGS = ('feddva_checkpoint_every',)
METHODS = ('fedavg', 'fedavg_ft', 'ditto', 'feddva')
# The probes of FedDVA's latents, and of a plain VAE's z trained on the
# pooled images (`models/pooled_vae`: the reference that gives the probes a
# scale; not federated).
PROBE_METHODS = ('probe', 'probe_vae')
DEFAULT_CLASS_ROUNDS = 20
DEFAULT_VAE_ROUNDS = 30
_FEDDVA_DIRNAME = '_feddva'


# A FedDVA variant's setting keys, in order, with how each value is named in
# table columns, figure file names and the pre-training cache directory
# (the last two must not change: existing roots are found by them).
_VARIANT_NAMES = (
    # key, column label, figure suffix, cache suffix
    ('decoder', '{} decoder', '_{}_decoder', '_{}dec'),
    ('schedule', '{} schedule', '_{}_schedule', '_{}sched'),
    ('mixture_kl', '{} mixture KL', '_{}_mixture_kl', '_{}mix'),
    ('constraint_weight', 'constraint weight {:g}', '_constraint_weight{:g}',
     '_cw{:g}'),
    ('recipe', '{} recipe', '_{}_recipe', '_{}rec'),
    ('ablate', 'without {}', '_without_{}', '_no{}'),
)
_LABEL, _FIGURE, _CACHE = 1, 2, 3


def _variant_names(variant: dict, which: int) -> list[str]:
  """The names of `variant`'s values in `_VARIANT_NAMES` column `which`."""
  return [names[which].format(variant[names[0]])
          for names in _VARIANT_NAMES if names[0] in variant]


def variant_label(variant: dict) -> str:
  """' (shared decoder, reference schedule)' for a variant setting; '' for
  the paper's FedDVA."""
  parts = _variant_names(variant, _LABEL)
  return f" ({', '.join(parts)})" if parts else ''


def _task_label(task: str, marks: str) -> str:
  if task != 'marked_mnist' or marks == 'varied':
    return task
  return f'{task} ({"no" if marks == "none" else marks} marks)'


def _class_columns(rounds: int, variant: dict, marks: str, dp: dict):
  label = lambda t: _task_label(t, marks) + _dp_label(dp)
  columns = [reporting.Column(label(t),
                              {**task_setting(t, marks), 'rounds': rounds,
                               **dp})
             for t in TASK_NAMES]
  if variant:  # Only feddva's row fills these.
    columns += [reporting.Column(
        f'{label(t)}{variant_label(variant)}',
        {**task_setting(t, marks), 'rounds': rounds, **variant, **dp})
                for t in TASK_NAMES]
  return columns


def _dp_label(dp: dict) -> str:
  return (f', DP z={dp["noise_multiplier"]:g} C={dp["clip_norm"]:g}'
          if dp else '')


def task_setting(task: str, marks: str) -> dict:
  """{'task': task}, plus {'marks': 'varied'} for marked_mnist with marks
  varied per image, or {'marks': 'none'} for its unmarked control (cells
  run with one fixed mark per client, before the flag existed, carry no
  'marks' key and keep their identity)."""
  setting = {'task': task}
  if task == 'marked_mnist' and marks != 'fixed':
    setting['marks'] = marks
  return setting


def _tables(class_rounds: int, vae_rounds: int,
            variant: dict | None = None, marks: str = 'varied',
            dp: dict | None = None) -> dict:
  """The tables; `variant` (e.g. {'decoder': 'shared'}) adds its columns;
  `dp` (`_dp_setting`) is in every column of a DP run."""
  variant = dict(variant or {'decoder': 'shared'})
  dp = dict(dp or {})
  columns = _class_columns(class_rounds, variant, marks, dp)
  marked = _task_label('marked_mnist', marks) + _dp_label(dp)
  probe_columns = [
      reporting.Column(marked, {
          **task_setting('marked_mnist', marks), 'rounds': vae_rounds,
          **dp}),
      reporting.Column(
          f'{marked}{variant_label(variant)}', {
              **task_setting('marked_mnist', marks), 'rounds': vae_rounds,
              **variant, **dp})]
  common = dict(paper=PAPER, methods=METHODS, columns=columns)
  note = ('The paper reports these as curves only (Figures 6, 7), so there '
          'are no paper numbers. feddva also ran pretrain_rounds rounds of '
          'FedDVA (results.jsonl).')
  return {
      'classification': reporting.Table(
          name='classification', metric='final_accuracy', scale=100.0,
          title='Personalized classification: final accuracy (%, mean over '
                'clients)', notes=note, **common),
      'spread': reporting.Table(
          name='spread', metric='accuracy_std_across_clients', scale=100.0,
          title='Accuracy spread across clients (std, %)', notes=note,
          **common),
      'speed': reporting.Table(
          name='speed', metric='rounds_to_reach_fedavg_final', digits=0,
          title="Rounds to reach FedAvg's final mean accuracy", notes=note,
          **common),
      'probes': reporting.Table(
          name='probes', paper=PAPER, metric='client_from_c',
          methods=('probe',), columns=probe_columns,
          title='Linear probe: client from c (accuracy); the other probes '
                '(client_from_z, digit_from_z, digit_from_c, chance_client, '
                'mark_from_c, mark_from_z, decoder_c_effect, decoder_z_effect) '
                'are in results.jsonl and docs',
          scale=1.0),
      'probes_z': reporting.Table(
          name='probes_z', paper=PAPER, metric='digit_from_z',
          methods=PROBE_METHODS, columns=probe_columns,
          title='Linear probe: digit from z (accuracy), FedDVA (probe) '
                'against a plain VAE trained on the pooled images '
                '(probe_vae, the reference; not federated, no c); '
                'client_from_z and mark_from_z are in results.jsonl',
          scale=1.0),
  }


TABLES = _tables(DEFAULT_CLASS_ROUNDS, DEFAULT_VAE_ROUNDS,
                 {'decoder': 'shared'})

# The report's run of the authors' recipe with every row at dims 8
# (`--feddva_recipe=authors --feddva_ablate=dims`, 60 FedDVA rounds): its
# tables over seeds, in the report's own columns (`tools/paper_tables.py`).
AUTHORS_RECIPE_VAE_ROUNDS = 60
_AUTHORS_RECIPE = _tables(DEFAULT_CLASS_ROUNDS, AUTHORS_RECIPE_VAE_ROUNDS,
                          {'recipe': 'authors', 'ablate': 'dims'})
EXTRA_TABLES = {
    f'{name}_authors_recipe': (
        lambda records, table=_AUTHORS_RECIPE[name]: reporting.render_markdown(
            records, table))
    for name in ('classification', 'spread', 'probes', 'probes_z')}


def define_flags():
  def define(kind, name, default, help_text):
    if name not in flags.FLAGS:
      getattr(flags, f'DEFINE_{kind}')(name, default, help_text)

  def define_enum(name, default, values, help_text):
    if name not in flags.FLAGS:
      flags.DEFINE_enum(name, default, list(values), help_text)

  define('integer', 'feddva_vae_rounds', DEFAULT_VAE_ROUNDS,
         'FedDVA: rounds of FedDVA (dual-VAE) training.')
  define('integer', 'feddva_local_epochs', 1, 'FedDVA: local epochs.')
  define('integer', 'feddva_batch_size', 64, 'FedDVA: batch size (paper 256).')
  define('list', 'feddva_channels', ['16', '16', '32', '32'],
         'FedDVA: channels of the 4-layer CNN backbones.')
  define('integer', 'feddva_hidden', 128, 'FedDVA: FC width.')
  define('integer', 'feddva_probe_dim', 4,
         'FedDVA: dim of z and of c for the probes and figures (paper: 4).')
  define('integer', 'feddva_class_dim', 8,
         'FedDVA: dim of z and of c for classification (paper: 8).')
  define('float', 'feddva_xi', None, 'FedDVA: xi_k (default 8 x dim(c)).')
  define('float', 'feddva_alpha', 1.0, 'FedDVA: alpha (weight of R_z).')
  define('float', 'feddva_beta', 0.75, 'FedDVA: beta (weight of R_c).')
  define('float', 'feddva_learning_rate', 1e-3, 'FedDVA: local Adam lr.')
  define('float', 'feddva_ditto_lambda', 0.1, 'FedDVA: Ditto lambda.')
  define_enum(
      'feddva_decoder', 'private', feddva.DECODERS,
      "FedDVA: 'private' (the paper's p_k, client state) or 'shared' "
      '(ablation: the decoder is averaged with the encoders; cells get '
      'setting decoder=shared).')
  define_enum(
      'feddva_schedule', 'paper', feddva_training.SCHEDULES,
      "FedDVA's client round: 'paper' (Algorithm 1: decoder pass, then "
      "encoders pass) or 'reference' (the authors' public code: decoder; "
      'z-encoder with c drawn from the prior; c-encoder and decoder with z '
      'fixed; cells get setting schedule=reference).')
  define_enum(
      'feddva_mixture_kl', 'bound', feddva_losses.MIXTURE_KL,
      "FedDVA: KL(q(c|x,z) || p_bar_k) in Eq. 7 as the paper's Eq. 26 "
      "bound ('bound'), our unbiased one-sample estimate ('sampled') or "
      "the KL to the Gaussian moment-matched to the client's batch mixture "
      "('moment', ours); cells get setting mixture_kl=<mode>.")
  define('float', 'feddva_constraint_weight', 1.0,
         "FedDVA: weight rho of Eq. 7's hinge against its slack regularizer, "
         'R_c = KL(q||q(c)) + rho relu(xi + KL(q||p_bar_k) - KL(q||q(c))); '
         "1 is the paper's max form; rho > 1 enforces Inequation 5 as the "
         "authors' code does (cells get setting constraint_weight=rho).")
  define_enum(
      'feddva_recipe', 'paper', feddva_recipes.RECIPES,
      "FedDVA's training recipe (models/feddva_recipes.py): 'paper', "
      "'authors' (the authors' released code: three passes, local c prior, "
      'KL floor, detached Eq. 26 reference, focal criterion, their weights; '
      'cells get setting recipe=authors; their dims are 1: pass '
      "--feddva_probe_dim=1) or 'sampled_mixture_kl' (the same cells as "
      '--feddva_mixture_kl=sampled). It sets the loss and the schedule, so '
      'the loss and schedule flags must keep their defaults.')
  define('list', 'feddva_ablate', [],
         "FedDVA: elements of the 'authors' recipe switched back to the "
         "paper's (feddva_recipes.ELEMENTS; cells get setting ablate=a+b).")
  define('integer', 'feddva_checkpoint_every', 10,
         'FedDVA: checkpoint the FedDVA pre-training every this many rounds '
         '(0: never), so that a killed run resumes from its last checkpoint; '
         'a resumed run computes what an uninterrupted one does.')
  define('float', 'feddva_dp_noise_multiplier', None,
         'FedDVA: user-level DP of every run\'s shared update (FedDVA\'s '
         'encoders in both stages, the baselines\' models) with this noise '
         'multiplier (None: no DP; cells get setting dp=gaussian_fixed, '
         'noise_multiplier, clip_norm; epsilon is in results.jsonl).')
  define('float', 'feddva_dp_clip', 1.0,
         'FedDVA: L2 clip of a client\'s update under DP.')
  define('integer', 'feddva_clients_per_round', 0,
         'FedDVA: cohort size (0: every client every round).')
  define_enum(
      'feddva_marks', 'varied', feddva_tasks.MARK_MODES,
      "marked_mnist: 'varied' (each image's mark drawn with its own phase "
      "or rotation, as the authors' code does; cells get setting "
      "marks=varied), 'fixed' (one identical mark per client) or 'none' "
      "(the same digits unmarked: the "
      'control for the probes; cells get setting marks=none).')
  define('integer', 'feddva_marked_clients', 4, 'marked_mnist: clients.')
  define('integer', 'feddva_marked_train', 500,
         'marked_mnist: training images per client.')
  define('integer', 'feddva_marked_test', 200,
         'marked_mnist: test images per client.')
  define('integer', 'feddva_skew_clients', 20, 'label_skew_mnist: clients.')
  define('integer', 'feddva_skew_train', 200,
         'label_skew_mnist: training images per client.')
  define('integer', 'feddva_skew_test', 100,
         'label_skew_mnist: test images per client.')
  define('float', 'feddva_dirichlet_alpha', 0.5,
         'label_skew_mnist: Dirichlet concentration.')


def _class_rounds(f) -> int:
  return f.rounds or DEFAULT_CLASS_ROUNDS


def cells(table: str, f) -> list[reporting.Cell]:
  """Every table runs the same cells: probe and probe_vae first, then
  methods x tasks."""
  del table
  for name in ('feddva_vae_rounds', 'feddva_local_epochs', 'feddva_batch_size',
               'feddva_probe_dim', 'feddva_class_dim', 'feddva_hidden'):
    if getattr(f, name) < 1:
      raise ValueError(f'--{name} must be >= 1, got {getattr(f, name)}')
  if f.rounds is not None and f.rounds < 1:
    raise ValueError(f'--rounds must be >= 1, got {f.rounds}')
  if f.feddva_clients_per_round < 0:
    raise ValueError('--feddva_clients_per_round must be >= 0')
  if not _constraint_weight(f) >= 0:
    raise ValueError('--feddva_constraint_weight must be >= 0, got '
                     f'{_constraint_weight(f)}')
  _check_recipe(f)
  if getattr(f, 'feddva_checkpoint_every', 0) < 0:
    raise ValueError('--feddva_checkpoint_every must be >= 0, got '
                     f'{f.feddva_checkpoint_every}')
  if len(f.feddva_channels) != 4:
    raise ValueError(f'--feddva_channels needs 4 values, got '
                     f'{f.feddva_channels}')
  # The tables' columns carry the rounds run.
  z = getattr(f, 'feddva_dp_noise_multiplier', None)
  clip = getattr(f, 'feddva_dp_clip', 1.0)
  if (z is not None and not z >= 0) or not clip > 0:
    raise ValueError('--feddva_dp_noise_multiplier must be >= 0 and '
                     f'--feddva_dp_clip > 0, got {z}, {clip}')
  TABLES.update(_tables(_class_rounds(f), f.feddva_vae_rounds,
                        _variant_setting(f), _marks(f), _dp_setting(f)))
  out = [reporting.Cell(PAPER, 'probe', probe_setting(f), s)
         for s in range(f.seeds)]
  if not _dp_setting(f):  # The pooled VAE is not federated: no DP version.
    out += [reporting.Cell(PAPER, 'probe_vae', vae_probe_setting(f), s)
            for s in range(f.seeds)]
  for method in METHODS:
    for task in TASK_NAMES:
      for s in range(f.seeds):
        out.append(reporting.Cell(
            PAPER, method, _class_setting(method, task, f), s))
  return out


def _decoder(f) -> str:
  """--feddva_decoder ('private' where the flags predate it)."""
  return getattr(f, 'feddva_decoder', 'private')


def _schedule(f) -> str:
  """--feddva_schedule ('paper' where the flags predate it)."""
  return getattr(f, 'feddva_schedule', 'paper')


def _mixture_kl(f) -> str:
  """--feddva_mixture_kl ('bound' where the flags predate it), or 'sampled'
  under --feddva_recipe=sampled_mixture_kl (the same training)."""
  if _recipe(f) == 'sampled_mixture_kl':
    return 'sampled'
  return getattr(f, 'feddva_mixture_kl', 'bound')


def _constraint_weight(f) -> float:
  """--feddva_constraint_weight (1, the paper's Eq. 7, where the flags
  predate it)."""
  return float(getattr(f, 'feddva_constraint_weight', 1.0))


def _recipe(f) -> str:
  """--feddva_recipe ('paper' where the flags predate it)."""
  return getattr(f, 'feddva_recipe', 'paper')


def _ablate(f) -> tuple[str, ...]:
  """--feddva_ablate, sorted (() where the flags predate it)."""
  return tuple(sorted(getattr(f, 'feddva_ablate', None) or ()))


# The flags a recipe other than the paper's sets itself, with their defaults.
_RECIPE_SETS = (('feddva_schedule', 'paper'), ('feddva_mixture_kl', 'bound'),
                ('feddva_constraint_weight', 1.0), ('feddva_alpha', 1.0),
                ('feddva_beta', 0.75), ('feddva_xi', None))


def _check_recipe(f) -> None:
  """Refuses a recipe beside the flags it sets, or a bad ablation."""
  feddva_recipes.recipe(_recipe(f), _ablate(f))  # Names the bad input.
  if _recipe(f) == 'paper':
    return
  clash = [name for name, default in _RECIPE_SETS
           if getattr(f, name, default) != default]
  if clash:
    raise ValueError(
        f'--feddva_recipe={_recipe(f)} sets the loss and the schedule; '
        f'{", ".join("--" + c for c in clash)} must keep their defaults '
        '(switch an element of the authors\' recipe off with '
        '--feddva_ablate)')


def _reconstruction(f) -> str:
  """The decoder's likelihood of the recipe ('bernoulli' or 'focal')."""
  if _recipe(f) != 'authors':
    return 'bernoulli'
  return feddva_recipes.recipe('authors', _ablate(f)).loss.reconstruction


def _marks(f) -> str:
  """--feddva_marks ('fixed' where the flags predate it)."""
  return getattr(f, 'feddva_marks', 'fixed')


def _variant_setting(f) -> dict:
  """The setting keys of a FedDVA variant: any of {'decoder': 'shared'},
  {'schedule': 'reference'}, {'mixture_kl': 'sampled' or 'moment'},
  {'constraint_weight': rho}, {'recipe': 'authors'} and its
  {'ablate': 'a+b'}; {} for the paper's
  FedDVA (so that cells run before these flags existed keep their
  identity)."""
  variant = {}
  if _decoder(f) != 'private':
    variant['decoder'] = _decoder(f)
  if _schedule(f) != 'paper':
    variant['schedule'] = _schedule(f)
  if _mixture_kl(f) != 'bound':
    variant['mixture_kl'] = _mixture_kl(f)
  if _constraint_weight(f) != 1.0:
    variant['constraint_weight'] = _constraint_weight(f)
  if _recipe(f) == 'authors':
    variant['recipe'] = 'authors'
    if _ablate(f):
      variant['ablate'] = '+'.join(_ablate(f))
  return variant


def vae_probe_setting(f) -> dict:
  """The plain VAE's cell: the data and the rounds, none of FedDVA's
  variant keys (it has no c, no decoder split and no schedule)."""
  return {**task_setting('marked_mnist', _marks(f)),
          'rounds': f.feddva_vae_rounds}


def probe_setting(f) -> dict:
  """FedDVA's probe cell: the plain VAE's setting and the variant's and
  DP's keys."""
  return {**vae_probe_setting(f), **_variant_setting(f), **_dp_setting(f)}


def _dp_setting(f) -> dict:
  """{} without DP, else {'dp': 'gaussian_fixed', 'noise_multiplier': z,
  'clip_norm': C}: every cell of a DP run carries them."""
  z = getattr(f, 'feddva_dp_noise_multiplier', None)
  if z is None:
    return {}
  return {'dp': 'gaussian_fixed', 'noise_multiplier': float(z),
          'clip_norm': float(getattr(f, 'feddva_dp_clip', 1.0))}


def _class_setting(method: str, task: str, f) -> dict:
  setting = {**task_setting(task, _marks(f)), 'rounds': _class_rounds(f),
             **_dp_setting(f)}
  if method == 'feddva':  # Only FedDVA's classifier depends on the decoder.
    setting.update(_variant_setting(f))
  return setting


# ------------------------------------------------------------------ helpers


def _data_dir(f) -> str:
  d = reporting.data_dir(f)
  return d if os.path.basename(os.path.normpath(d)) == 'mnist' else (
      os.path.join(d, 'mnist'))


_TASK_CACHE: dict[tuple, feddva_tasks.FeddvaTask] = {}


def _task(name: str, f, seed: int) -> feddva_tasks.FeddvaTask:
  seed = reporting.data_seed(f, seed)  # Which images each client holds.
  if name == 'marked_mnist':
    kwargs = dict(num_clients=f.feddva_marked_clients,
                  train_per_client=f.feddva_marked_train,
                  test_per_client=f.feddva_marked_test, seed=seed,
                  marks=_marks(f))
  elif name == 'label_skew_mnist':
    kwargs = dict(num_clients=f.feddva_skew_clients,
                  train_per_client=f.feddva_skew_train,
                  test_per_client=f.feddva_skew_test,
                  alpha=f.feddva_dirichlet_alpha, seed=seed)
  else:
    raise ValueError(f'unknown FedDVA task {name!r}')
  key = (name, _data_dir(f), tuple(sorted(kwargs.items())))
  if key not in _TASK_CACHE:
    _TASK_CACHE[key] = feddva_tasks.build_task(name, _data_dir(f), **kwargs)
  return _TASK_CACHE[key]


def _config(f, dim: int) -> feddva_lib.FeddvaConfig:
  return feddva_lib.FeddvaConfig(
      z_dim=dim, c_dim=dim, channels=tuple(int(c) for c in f.feddva_channels),
      hidden=f.feddva_hidden)


def _cohort(f, num_clients: int) -> int:
  """Clients per round: --feddva_clients_per_round, or every client."""
  n = f.feddva_clients_per_round
  return num_clients if n <= 0 or n >= num_clients else n


def run_task(task: feddva_tasks.FeddvaTask, f, seed: int
             ) -> client_data_task.ClientDataTask:
  """`task`'s clients as the run path's Task (the same images), batched and
  repeated by the FedDVA flags, classified by Appendix G's CNN."""
  return client_data_task.from_feddva_task(
      task.name, task, batch_size=f.feddva_batch_size,
      local_epochs=f.feddva_local_epochs, seed=seed,
      channels=tuple(int(c) for c in f.feddva_channels),
      hidden=f.feddva_hidden)


def _base_config(algorithm: str, task, f, seed: int, root_output_dir: str,
                 experiment_name: str, options: dict
                 ) -> experiment.ExperimentConfig:
  """The classification rounds of `algorithm` on the one path: Adam on the
  clients, FedAvg's server (SGD lr 1), evaluated after every round."""
  dp = _dp_setting(f)
  return run_spec.RunSpec(
      task=task.name, algorithm=algorithm, algorithm_options=options,
      loop=run_spec.Loop(
          rounds=_class_rounds(f),
          clients_per_round=_cohort(f, task.num_clients), seed=seed,
          checkpoint_every=max(1, int(
              getattr(f, 'feddva_checkpoint_every', 0)
              or _class_rounds(f) + f.feddva_vae_rounds)),
          resume=True),
      optimizers=run_spec.Optimizers(
          client='adam', client_learning_rate=f.feddva_learning_rate),
      privacy=run_spec.Privacy(
          mechanism=dp['dp'], noise_multiplier=dp['noise_multiplier'],
          clip_norm=dp['clip_norm']) if dp else run_spec.Privacy(),
      evaluation=run_spec.Evaluation(every=1),
      output=run_spec.Output(root_output_dir, experiment_name)).config()


def _feddva_options(f, dim: int) -> dict:
  """The registered `feddva` algorithm's options under the paper's flags."""
  options = dict(pretrain_rounds=f.feddva_vae_rounds, dim=dim,
                 channels=','.join(str(c) for c in f.feddva_channels),
                 hidden=f.feddva_hidden, decoder=_decoder(f))
  if _recipe(f) != 'authors':  # The paper's, or its sampled mixture KL.
    options.update(recipe='paper',
                   alpha=float(f.feddva_alpha), beta=float(f.feddva_beta),
                   xi=None if f.feddva_xi is None else float(f.feddva_xi),
                   mixture_kl=_mixture_kl(f),
                   constraint_weight=_constraint_weight(f),
                   schedule=_schedule(f))
  else:
    options['recipe'] = 'authors'
    if _ablate(f):
      options['ablate'] = '+'.join(_ablate(f))
  return options


def feddva_config(task, f, dim: int, seed: int, root: str
                  ) -> experiment.ExperimentConfig:
  """The one-path run of FedDVA on `task`: the `feddva` algorithm's
  'pretrain' stage (`--feddva_vae_rounds` rounds of the dual VAE) and its
  'classifier' stage (the classification rounds), in
  <root>/runs/_feddva/<pretrain_key>_c<rounds>."""
  name = (pretrain_key(task.name, task.num_clients, f, dim, seed)
          + f'_c{_class_rounds(f)}')
  return _base_config('feddva', task, f, seed,
                      os.path.join(root, reporting.RUNS_DIRNAME,
                                   _FEDDVA_DIRNAME),
                      name, _feddva_options(f, dim))


def privacy_metrics(run: runs.Run) -> dict:
  """epsilon, delta and rounds_noised of a DP run (its summary), or {}:
  epsilon covers every round the run noised, both stages for FedDVA."""
  report = run.summary.get('privacy')
  if not report:
    return {}
  return {k: report[k] for k in ('epsilon', 'delta', 'rounds_noised',
                                 'noise_multiplier', 'clip_norm')}


def _train(task, config, log_fn) -> runs.Run:
  """The run of `config`, trained unless it finished (a killed run resumes
  from its checkpoints). Call inside a runtime this program owns."""
  return runs.finished_or_trained(task, config, log_fn=log_fn)


def pretrain_key(task_name: str, num_clients: int, f, dim: int,
                 seed: int) -> str:
  """The name of a FedDVA run (`feddva_config` adds the classification
  rounds): everything its pre-training depends on (task and its training
  data, sizes, loss weights, optimizer, cohort, decoder mode, schedule,
  recipe, DP, seed, data seed if set)."""
  train = (f'{f.feddva_marked_train}'
           + ('' if _marks(f) == 'fixed' else f'_{_marks(f)}marks')
           if task_name == 'marked_mnist'
           else f'{f.feddva_skew_train}_da{f.feddva_dirichlet_alpha}')
  data = ('' if getattr(f, 'data_seed', None) is None
          else f'_data{f.data_seed}')
  return (f'{task_name}_dim{dim}_r{f.feddva_vae_rounds}'
          f'_e{f.feddva_local_epochs}_b{f.feddva_batch_size}'
          f'_ch{"-".join(map(str, f.feddva_channels))}_h{f.feddva_hidden}'
          f'_xi{f.feddva_xi}_a{f.feddva_alpha}_b{f.feddva_beta}'
          f'_n{num_clients}_seed{seed}{data}_tr{train}'
          f'_lr{f.feddva_learning_rate}_cpr{f.feddva_clients_per_round}'
          + ''.join(_variant_names(_variant_setting(f), _CACHE))
          + ''.join(f'_dp{v["noise_multiplier"]:g}c{v["clip_norm"]:g}'
                    for v in [_dp_setting(f)] if v))


def pretrain_feddva(task, f, dim: int, seed: int, root: str) -> dict:
  """FedDVA on `task` on the one path (`feddva_config`), run or read back.

  A killed run resumes from its last checkpoint (`--feddva_checkpoint_every`
  rounds). The pre-trained model is read from the 'pretrain' stage's final
  checkpoint and client-state store once, and kept beside the run
  (`pretrained.npz`, `pretrained.json`), so later reads need no TFF. Call
  inside a runtime this program owns.

  Returns {'encoders': tuple of arrays, 'decoders': [tuple per client],
  'curve': per-round training metrics of the pre-training,
  'seconds_per_round' (of the pre-training), 'config': the run's
  `ExperimentConfig`}.
  """
  config = feddva_config(task, f, dim, seed, root)
  weights_path = os.path.join(config.experiment_dir, 'pretrained.npz')
  meta_path = os.path.join(config.experiment_dir, 'pretrained.json')
  if not os.path.exists(meta_path):
    task_run = run_task(task, f, seed)
    run = _train(task_run, config, lambda s: print(
        f'feddva {task.name} dim {dim} seed {seed}: {s}', flush=True))
    encoders, shared_decoder = feddva.split_shared_weights(
        _config(f, dim), [np.asarray(w) for w in
                          run.weights(stage='pretrain').trainable])
    if _decoder(f) == 'private':
      decoders = [tuple(np.asarray(w) for w in s[
          process_lib.CLIENT_STATE_PRIVATE])
                  for s in run.client_states(range(task_run.population),
                                             stage='pretrain')]
    else:  # One decoder for every client.
      decoders = [shared_decoder] * task_run.population
    rows = run.curves(stage='pretrain')['train']
    curve = [{k[len('train/'):]: float(v) for k, v in row.items()
              if k.startswith('train/')} for row in rows]
    seconds = float(np.mean([float(r['round_seconds']) for r in rows]))
    arrays = {f'e{i}': w for i, w in enumerate(encoders)}
    for k, dec in enumerate(decoders):
      arrays.update({f'd{k}_{i}': w for i, w in enumerate(dec)})
    with atomic_io.atomic_write(weights_path, 'wb') as fh:
      np.savez(fh, num_encoders=len(encoders), num_decoder=len(decoders[0]),
               **arrays)
    atomic_io.write_json(meta_path, {'curve': curve, 'seconds_per_round': seconds,
                            'dim': dim, 'client_names': task.client_names})
  with np.load(weights_path) as data:
    n_enc, n_dec = int(data['num_encoders']), int(data['num_decoder'])
    encoders = tuple(data[f'e{i}'] for i in range(n_enc))
    decoders = [tuple(data[f'd{k}_{i}'] for i in range(n_dec))
                for k in range(task.num_clients)]
  meta = atomic_io.read_json(meta_path)
  return dict(encoders=encoders, decoders=decoders, config=config, **meta)


def feddva_model(config, encoders, decoder=None) -> feddva_lib.FeddvaModel:
  """An eager FedDVA model with the given encoders (and decoder)."""
  model = feddva_lib.FeddvaModel(config)
  for v, w in zip(model.shared_variables, encoders):
    v.assign(w)
  if decoder is not None:
    for v, w in zip(model.decoder_variables, decoder):
      v.assign(w)
  return model


def representations(model, task) -> dict:
  """Posterior means of z and c of every client's test images."""
  zs, cs, digits, clients, marks = [], [], [], [], []
  for k, data in enumerate(task.clients):
    mu_z, _, mu_c, _ = model.encode(data.test_x)
    zs.append(mu_z.numpy())
    cs.append(mu_c.numpy())
    digits.append(data.test_y)
    clients.append(np.full(len(data.test_y), k))
    marks.append(np.full(len(data.test_y), np.nan)
                 if data.test_mark is None else data.test_mark)
  return dict(z=np.concatenate(zs), c=np.concatenate(cs),
              digit=np.concatenate(digits), client=np.concatenate(clients),
              mark=np.concatenate(marks))


def mark_r2(features, angles, fit, score) -> float | None:
  """Held-out R^2 of a least-squares linear map (with intercept) from
  `features` to (cos, sin) of `angles`, fitted on `fit`, scored on `score`
  (both index arrays of images of one client). None where the angle does
  not vary (fixed marks, plain digits) or there are too few images.

  R^2 = 1 - sum of squared errors / total sum of squares about the scored
  targets' mean, over both coordinates: 1 is a perfect read-out, 0 is no
  better than the mean, and it is negative when worse.
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


def decoder_effects(decode, z, c, seed: int,
                    max_images: int = 500) -> dict:
  """How far a client's decoder output moves with c and with z: Figure 3b's
  claim (c varies the client's marks, z the digit) as two numbers. Ours,
  not the paper's.

  `decode(z, c)` gives pixel means in [0, 1] (one client's decoder); `z`,
  `c` are the posterior means of that client's images, one row each. Each
  image i is paired with another image pi(i) of the same client (a seeded
  permutation with no fixed point, over the first `max_images` rows), and
  the result is the mean absolute change of the decoded pixels when c_i is
  replaced by c_pi(i) (`c`) and when z_i is replaced by z_pi(i) (`z`),
  the other code kept, and `images`, the number of images used. A decoder
  that ignores c gives `c` = 0; in the paper's Figure 3b both are visibly
  above 0 (columns change the mark, rows the digit).
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


def linear_probes(reps: dict, seed: int) -> dict:
  """Held-out accuracy of logistic-regression probes (half fit, half score).

  Without `reps['c']` (a model with no c) the c-probes are left out.
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
  # Each client's own fit and score images, for the within-client probes.
  splits = [(fit[reps['client'][fit] == k], score[reps['client'][score] == k])
            for k in np.unique(reps['client'])]

  def mean_over_clients(per_client):
    """Mean of the clients' values weighted by their scored images; None if
    no client has one (a value of None leaves the client out)."""
    kept = [(v, len(score_k)) for v, (_, score_k) in zip(per_client, splits)
            if v is not None]
    return (float(np.average([v for v, _ in kept],
                             weights=[w for _, w in kept])) if kept
            else None)

  # The digit from z by a probe fitted within each client: private decoders
  # may each read z in their own coordinates, which one map for all clients
  # cannot follow.
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


def _run_probe(cell, f, out_dir) -> dict:
  task = _task(cell.setting['task'], f, cell.seed)
  root = reporting.root_of(out_dir)
  pre = pretrain_feddva(task, f, f.feddva_probe_dim, cell.seed, root)
  config = _config(f, f.feddva_probe_dim)
  model = feddva_model(config, pre['encoders'])
  reps = representations(model, task)
  np.savez(os.path.join(out_dir, 'representations.npz'), **reps)
  metrics = linear_probes(reps, cell.seed)
  # Each client's decoder on its own held-out images, weighted by them.
  effects = []
  for k in range(task.num_clients):
    mine = reps['client'] == k
    if mine.sum() < 2:
      continue
    decoder_k = feddva_model(config, pre['encoders'], pre['decoders'][k])
    decode = functools.partial(decoder_k.decode_mean,
                               reconstruction=_reconstruction(f))
    effects.append(decoder_effects(decode, reps['z'][mine],
                                   reps['c'][mine], cell.seed))
  for name in ('c', 'z'):
    metrics[f'decoder_{name}_effect'] = (
        float(np.average([e[name] for e in effects],
                         weights=[e['images'] for e in effects]))
        if effects else None)
  metrics['seconds_per_round'] = pre['seconds_per_round']
  metrics.update(privacy_metrics(
      runs.Run.open(pre['config'].experiment_dir)))
  last = pre['curve'][-1] if pre['curve'] else {}
  for k in ('reconstruction', 'kl_z', 'kl_c_prior', 'kl_c_mixture',
            'constraint_met'):
    if k in last:
      metrics[f'final_{k}'] = last[k]
  return metrics


def _run_vae_probe(cell, f, out_dir) -> dict:
  """The reference for the probes: a plain VAE (`models/pooled_vae`) on the
  training images of every client pooled, for as many epochs as FedDVA's
  encoders make when every client takes part (rounds x local epochs), at
  FedDVA's batch size, learning rate, alpha, networks and dim(z); then the
  probes of z. The c-probes are left out: this model has no c."""
  task = _task(cell.setting['task'], f, cell.seed)
  images = np.concatenate([c.train_x for c in task.clients])
  epochs = f.feddva_vae_rounds * f.feddva_local_epochs
  start = time.perf_counter()
  model, curve = pooled_vae.train(
      _config(f, f.feddva_probe_dim), images, epochs=epochs,
      batch_size=f.feddva_batch_size, learning_rate=f.feddva_learning_rate,
      alpha=f.feddva_alpha, seed=cell.seed, log_every=10)
  seconds = time.perf_counter() - start
  reps = {k: v for k, v in representations(model, task).items() if k != 'c'}
  np.savez(os.path.join(out_dir, 'representations.npz'), **reps)
  metrics = linear_probes(reps, cell.seed)
  metrics.update(epochs=epochs, seconds_per_epoch=seconds / epochs,
                 final_reconstruction=curve[-1]['reconstruction'],
                 final_kl_z=curve[-1]['kl_z'])
  return metrics


# --------------------------------------------------------- classification


# The baselines' registered algorithms (FedAvg is 'global': the task's
# model, all of it shared).
_BASELINES = {'fedavg': 'global', 'fedavg_ft': 'fedavg_ft', 'ditto': 'ditto'}


def _classification_run(method, task, f, seed, root, out_dir):
  """Trains `method` on the one path; returns (per-round mean and spread of
  the clients' test accuracy, extra metrics).

  The baselines run in the cell's directory; `feddva` is the classifier
  stage of FedDVA's run (`pretrain_feddva`), which the probe cell of the
  same dims shares.
  """
  extra = {}
  if method == 'feddva':
    config = pretrain_feddva(task, f, f.feddva_class_dim, seed,
                             root)['config']
    run = runs.Run.open(config.experiment_dir)
    extra['pretrain_rounds'] = f.feddva_vae_rounds
  elif method in _BASELINES:
    options = {'lam': f.feddva_ditto_lambda} if method == 'ditto' else {}
    config = _base_config(_BASELINES[method], task, f, seed, out_dir, 'run',
                          options)
    run = _train(run_task(task, f, seed), config, lambda s: print(
        f'feddva {method} {task.name} seed {seed}: {s}', flush=True))
  else:
    raise ValueError(f'unknown method {method!r}')
  curves = run.curves()
  extra.update(privacy_metrics(run))
  extra['seconds_per_round'] = float(np.mean(
      [float(r['round_seconds']) for r in curves['train']]))
  return ([float(r['accuracy']) for r in curves['eval']],
          [float(r['accuracy_std_across_clients']) for r in curves['eval']]
          ), extra


def _curve_path(root, method, setting, seed) -> str:
  cell = reporting.Cell(PAPER, method, setting, seed)
  return os.path.join(cell.out_dir(root), 'curve.json')


def rounds_to_reach(means, target) -> int | None:
  """First round (1-based) whose mean accuracy is >= target, else None."""
  for r, m in enumerate(means, 1):
    if m >= target - 1e-12:
      return r
  return None


def _run_classification(cell, f, out_dir) -> dict:
  task = _task(cell.setting['task'], f, cell.seed)
  root = reporting.root_of(out_dir)
  (means, stds), extra = _classification_run(cell.method, task, f,
                                             cell.seed, root, out_dir)
  atomic_io.write_json(os.path.join(out_dir, 'curve.json'), {
      'round': list(range(1, len(means) + 1)), 'mean': means, 'std': stds,
      'client_names': task.client_names})
  fedavg_path = _curve_path(root, 'fedavg',
                            _class_setting('fedavg', cell.setting['task'], f),
                            cell.seed)
  target = None
  if os.path.exists(fedavg_path):
    target = atomic_io.read_json(fedavg_path)['mean'][-1]
  metrics = {'final_accuracy': means[-1],
             'accuracy_std_across_clients': stds[-1],
             'rounds_to_reach_fedavg_final': (
                 rounds_to_reach(means, target) if target is not None
                 else None),
             'fedavg_final_accuracy': target}
  metrics.update(extra)
  return metrics


def run_cell(cell: reporting.Cell, f, out_dir: str) -> dict:
  if cell.method == 'probe_vae':  # Plain TensorFlow; no TFF runtime.
    return _run_vae_probe(cell, f, out_dir)
  with runtime.local_runtime(
      log_path=os.path.join(out_dir, 'worker_binary.log')):
    if cell.method == 'probe':
      metrics = _run_probe(cell, f, out_dir)
    else:
      metrics = _run_classification(cell, f, out_dir)
  try:  # t-SNE is slow: latent figures only after the probe cell.
    make_figures(reporting.root_of(out_dir), f,
                 latent=cell.method == 'probe', curves=cell.method != 'probe')
  except Exception as e:  # pylint: disable=broad-except
    print(f'feddva: figures not rebuilt: {e!r}')
  return metrics


# ----------------------------------------------------------------- figures


def make_figures(root: str, f, latent: bool = True,
                 curves: bool = True) -> list[str]:
  """Rebuilds the figures from what the runs saved; returns their paths.

  `latent`: the reconstruction grid and the t-SNE (from the probe's FedDVA);
  `curves`: the accuracy curves.
  """
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  fig_dir = os.path.join(root, 'figures')
  os.makedirs(fig_dir, exist_ok=True)
  written = []
  # Accuracy curves: every method, FedDVA with either decoder if run; one
  # panel per task that has curves; the mean over seeds, band ± 1 std.
  lines_to_draw = [(m, {}, m) for m in METHODS]
  for variant in ({'decoder': 'shared'}, _variant_setting(f)):
    if variant and ('feddva', variant) not in [l[:2] for l in lines_to_draw]:
      lines_to_draw.append(('feddva', variant,
                            f'feddva{variant_label(variant)}'))
  loaded = {}
  for t in TASK_NAMES if curves else ():
    for m, extra, label in lines_to_draw:
      setting = {**task_setting(t, _marks(f)), 'rounds': _class_rounds(f),
                 **extra}
      curves = curve_bands.seed_curves(os.path.dirname(
          os.path.dirname(_curve_path(root, m, setting, 0))))
      if curves:
        loaded.setdefault(t, []).append((label, curves))
  if loaded:
    tasks = [t for t in TASK_NAMES if t in loaded]
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4),
                             squeeze=False)
    for ax, t in zip(axes[0], tasks):
      seeds = sorted({len(curves) for _, curves in loaded[t]})
      for label, curves in loaded[t]:
        curve_bands.plot_seed_band(ax, curves, 'round', 'mean', label=label)
      ax.set_title(f'{t}: mean over clients; mean ± 1 std over '
                   f'{", ".join(map(str, seeds))} seed(s)', fontsize=9)
      ax.set_xlabel('round')
      ax.set_ylabel('test accuracy')
      ax.grid(alpha=0.3)
      ax.legend()
    fig.tight_layout()
    path = os.path.join(fig_dir, 'feddva_accuracy_curves.png')
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
  # Reconstructions and t-SNE from the probe's FedDVA (seed 0).
  probe_cell = reporting.Cell(PAPER, 'probe', probe_setting(f), 0)
  reps_path = os.path.join(probe_cell.out_dir(root), 'representations.npz')
  if latent and os.path.exists(reps_path):
    task = _task('marked_mnist', f, 0)
    pre = pretrain_feddva(task, f, f.feddva_probe_dim, 0, root)
    suffix = _figure_suffix(f)
    written.append(_reconstruction_grid(plt, task, f, pre, fig_dir))
    written.append(_tsne(plt, reps_path, task, fig_dir, suffix))
  return written


def _figure_suffix(f) -> str:
  """'' for the paper's FedDVA; '_shared_decoder', '_reference_schedule',
  '_sampled_mixture_kl' (or '_moment_mixture_kl'), '_constraint_weight<rho>'
  and / or '_fixed_marks' for the variants."""
  return (''.join(_variant_names(_variant_setting(f), _FIGURE))
          + ('' if _marks(f) == 'varied' else f'_{_marks(f)}_marks'))


def _reconstruction_grid(plt, task, f, pre, fig_dir, size=6) -> str:
  """Per client, its decoder on rows of z (its images) x columns of c.

  Rows: mu_z of `size` of the client's test images. Columns: mu_c of one
  test image from each client (then more of the client's own), so the
  columns move c across the clients' clusters.
  """
  config = _config(f, f.feddva_probe_dim)
  n = task.num_clients
  cols_per_client = max(1, size // n)
  base = feddva_model(config, pre['encoders'])
  c_columns = []
  for j in range(n):
    _, _, mu_c, _ = base.encode(task.clients[j].test_x[:cols_per_client])
    c_columns.append(mu_c.numpy())
  c_columns = np.concatenate(c_columns)
  ncols = int(np.ceil(np.sqrt(n)))
  nrows = int(np.ceil(n / ncols))
  fig, axes = plt.subplots(nrows, ncols, figsize=(4 * ncols, 4 * nrows),
                           squeeze=False)
  for k in range(n):
    model = feddva_model(config, pre['encoders'], pre['decoders'][k])
    mu_z, _, _, _ = model.encode(task.clients[k].test_x[:size])
    z = np.repeat(mu_z.numpy(), len(c_columns), axis=0)
    c = np.tile(c_columns, (size, 1))
    images = model.decode_mean(z, c, _reconstruction(f)).numpy()[..., 0]
    grid = images.reshape(size, len(c_columns), 28, 28).transpose(
        0, 2, 1, 3).reshape(size * 28, len(c_columns) * 28)
    ax = axes[k // ncols][k % ncols]
    ax.imshow(grid, cmap='gray', vmin=0, vmax=1)
    ax.set_title(f'client {k} ({task.client_names[k]}): '
                 + ('its decoder' if _decoder(f) == 'private'
                    else 'the shared decoder'),
                 fontsize=9)
    ax.set_xlabel('c (from clients ' + ', '.join(
        str(j) for j in range(n) for _ in range(cols_per_client)) + ')',
                  fontsize=7)
    ax.set_ylabel('z')
    ax.set_xticks([])
    ax.set_yticks([])
  for k in range(n, nrows * ncols):
    axes[k // ncols][k % ncols].axis('off')
  fig.tight_layout()
  path = os.path.join(fig_dir,
                      f'feddva_reconstructions{_figure_suffix(f)}.png')
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def _tsne(plt, reps_path, task, fig_dir, suffix='', max_points=800) -> str:
  """t-SNE of z and of c, coloured by client; a latent of one or two
  dimensions is drawn as it is (one: its value against the client)."""
  from sklearn.manifold import TSNE  # pylint: disable=g-import-not-at-top
  with np.load(reps_path) as data:
    reps = {k: data[k] for k in data.files}
  idx = np.random.default_rng(0).permutation(len(reps['client']))[:max_points]
  jitter = np.random.default_rng(1).uniform(-0.3, 0.3, len(idx))
  fig, axes = plt.subplots(1, 2, figsize=(10, 4.5))
  for ax, key in zip(axes, ('z', 'c')):
    values = reps[key][idx]
    if values.shape[1] == 1:
      emb = np.stack([values[:, 0], reps['client'][idx] + jitter], axis=1)
      title = f'{key} (posterior mean, 1 dim) by client'
    elif values.shape[1] == 2:
      emb, title = values, f'{key} (posterior means, 2 dims)'
    else:
      emb = TSNE(n_components=2, random_state=0, init='pca',
                 perplexity=30).fit_transform(values)
      title = f't-SNE of {key} (posterior means)'
    for k in range(task.num_clients):
      sel = reps['client'][idx] == k
      ax.scatter(emb[sel, 0], emb[sel, 1], s=5,
                 label=f'client {k} ({task.client_names[k]})')
    ax.set_title(f'{title}, coloured by client')
    if values.shape[1] > 2:
      ax.set_xticks([])
      ax.set_yticks([])
  axes[1].legend(markerscale=3, fontsize=7)
  fig.tight_layout()
  path = os.path.join(fig_dir, f'feddva_tsne{suffix}.png')
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path
