"""FedEmbed (Silva et al.): Tables 2 to 5 and Figures 3 to 5, on this project.

`python -m binaries.reproduce --paper=fedembed --table=2` runs a table's
cells (method x setting x seed) and writes it next to the paper's numbers
(`TABLES`). Every federated cell is one run of a registered algorithm under
its (task, method) defaults (`tff_personal/algorithms/defaults.py`, which
`binaries.train` uses too) and the paper's flags; the `local` rows are
every user's own logistic regression (`_run_local`). docs/papers/fedembed.md
says what each table, setting and metric is, how users are evaluated and
which DP is run.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
import time
from typing import Any, Optional

import numpy as np

from tasks import registry as task_registry
from tasks import speech_spectrogram
from tff_personal.algorithms import defaults as algorithm_defaults
from tff_personal.algorithms import registry as algorithm_registry
from tff_personal.config import experiment
from tff_personal.config import run_spec
from tff_personal.core import atomic_io
from tff_personal.core import runtime
from tff_personal.evaluation import run_evaluation
from tff_personal.models import fedembed as fedembed_model
from tff_personal.models import fedembed_speech
from tff_personal.models import local_head
from tff_personal.reports import curve_bands
from tff_personal.reports import embedding_purity
from tff_personal.reports import figures
from tff_personal.reports import reporting
from tff_personal.run import runs

PAPER = 'fedembed'
MNIST = 'mnist_preference'
SPEECH = 'speech_preference'
# The `encoder` setting of speech cells: absent (the paper's B.2 encoder,
# trained), 'public' (B.2 pre-trained on public speakers and frozen: table
# 3_public), 'spectral' (the spectral encoder, trained: table 3_spectral) or
# 'spectrum' (the standardised spectrum, no encoder weights: 3_spectrum).
PUBLIC = 'public'
SPECTRAL = 'spectral'
SPECTRUM = 'spectrum'

# The rows of the paper's Tables 2 and 3, in its order (--algorithm values).
METHODS = ('fedrep', 'pfedme', 'pfedkm', 'global', 'global_plus',
           'fedembed_personal', 'fedembed_som', 'fedembed_prototype',
           'fedembed_type')
# Table 3_public freezes the encoder, FedRep's whole shared part (its head is
# personal), so FedRep would federate nothing there (`personal_head` refuses).
# Rows that are no federated method (models/local_head.py): every user's own
# logistic regression on fixed features of its samples alone, the reference a
# federated method must beat. `local`: the frozen public encoder's features
# (table 3_public); `local_spectrum`: each utterance's mean log-spectrum over
# its louder frames, no learned features at all (table 3).
LOCAL = 'local'
LOCAL_SPECTRUM = 'local_spectrum'
LOCAL_METHODS = (LOCAL, LOCAL_SPECTRUM)
# An extra row of the speech tables (ours): pFedMe as its authors' code runs
# it, the personal head restarting from the global head every round (our
# `pfedme` keeps it; algorithms/pfedme.py). FedEmbed does not say which.
PFEDME_RESTART = 'pfedme_restart'
PUBLIC_ENCODER_METHODS = (tuple(m for m in METHODS if m != 'fedrep')
                          + (PFEDME_RESTART, LOCAL))
# Likewise with the weightless spectrum encoder (nothing shared for FedRep).
SPECTRUM_ENCODER_METHODS = (tuple(m for m in METHODS if m != 'fedrep')
                            + (PFEDME_RESTART, LOCAL_SPECTRUM))

# Sub-population -> prevalence (percent) of the imbalanced populations.
MNIST_PREVALENCE = (25, 15, 10, 10, 10, 10, 5, 5, 5, 5)
SPEECH_PREVALENCE = (20, 4, 4, 4, 4, 8) + (4,) * 14

_DP_NAMES = {'none': 'None', 'gaussian_fixed': 'Gaussian'}
# The `dp` setting of the tables `2_heads`, `3_heads`: 'gaussian_fixed' on the
# shared update plus noise on each local pass's change of a personal head
# (`experiment.ExperimentConfig.dp_personal_heads='noised'`,
# core/private_noise.py): FedEmbed's Algorithm 1 as we read it. Only the
# methods with a personal head change under it (`HEAD_METHODS`); the others'
# cells would compute what their 'gaussian_fixed' cells do (tested).
GAUSSIAN_HEADS = 'gaussian_heads'
HEAD_METHODS = ('fedrep', 'pfedme', 'fedembed_personal')


def _columns(task: Optional[str]) -> list[reporting.Column]:
  extra = {} if task is None else {'task': task}
  return [reporting.Column(f'{pop} {_DP_NAMES[dp]}',
                           {**extra, 'population': pop, 'dp': dp})
          for pop in ('balanced', 'imbalanced') for dp in _DP_NAMES]


def _encoder_columns(encoder: str) -> list[reporting.Column]:
  return [reporting.Column(c.name, {**c.setting, 'encoder': encoder})
          for c in _columns(SPEECH)]


def _imbalanced_columns(task: Optional[str]) -> list[reporting.Column]:
  return [c for c in _columns(task) if c.setting['population'] == 'imbalanced']


def _paper(rows: dict[str, tuple[str, ...]], columns) -> dict:
  return {(m, c.name): v for m, values in rows.items()
          for c, v in zip(columns, values)}


# FedEmbed Table 2 (MNIST): balanced None, Gaussian; imbalanced None, Gaussian.
_TABLE2 = reporting.paper_rows('''
    fedrep             | 0.78 ± 0.02 | 0.51 ± 0.02 | 0.78 ± 0.02 | 0.53 ± 0.01
    pfedme             | 0.76 ± 0.04 | 0.50 ± 0.02 | 0.76 ± 0.05 | 0.50 ± 0.04
    pfedkm             | 0.48 ± 0.00 | 0.49 ± 0.00 | 0.55 ± 0.02 | 0.48 ± 0.03
    global             | 0.40 ± 0.02 | 0.38 ± 0.06 | 0.55 ± 0.06 | 0.38 ± 0.06
    global_plus        | 0.39 ± 0.06 | 0.36 ± 0.04 | 0.54 ± 0.08 | 0.34 ± 0.00
    fedembed_personal  | 0.76 ± 0.01 | 0.52 ± 0.01 | 0.73 ± 0.02 | 0.52 ± 0.02
    fedembed_som       | 0.60 ± 0.05 | 0.47 ± 0.07 | 0.69 ± 0.02 | 0.53 ± 0.02
    fedembed_prototype | 0.88 ± 0.02 | 0.69 ± 0.04 | 0.87 ± 0.02 | 0.69 ± 0.05
    fedembed_type      | 0.88 ± 0.01 | 0.72 ± 0.05 | 0.88 ± 0.03 | 0.77 ± 0.05
''')
# FedEmbed Table 3 (speech), same layout.
_TABLE3 = reporting.paper_rows('''
    fedrep             | 0.52 ± 0.09 | 0.49 ± 0.00 | 0.65 ± 0.10 | 0.49 ± 0.00
    pfedme             | 0.57 ± 0.05 | 0.49 ± 0.01 | 0.57 ± 0.05 | 0.49 ± 0.03
    pfedkm             | 0.49 ± 0.02 | 0.49 ± 0.01 | 0.49 ± 0.01 | 0.49 ± 0.00
    global             | 0.34 ± 0.01 | 0.38 ± 0.06 | 0.44 ± 0.05 | 0.34 ± 0.02
    global_plus        | 0.35 ± 0.01 | 0.33 ± 0.00 | 0.42 ± 0.12 | 0.33 ± 0.00
    fedembed_personal  | 0.63 ± 0.02 | 0.44 ± 0.05 | 0.68 ± 0.01 | 0.49 ± 0.00
    fedembed_som       | 0.51 ± 0.02 | 0.47 ± 0.07 | 0.54 ± 0.03 | 0.47 ± 0.02
    fedembed_prototype | 0.78 ± 0.01 | 0.61 ± 0.06 | 0.63 ± 0.07 | 0.53 ± 0.06
    fedembed_type      | 0.78 ± 0.05 | 0.60 ± 0.08 | 0.76 ± 0.00 | 0.56 ± 0.08
''')
# FedEmbed Table 4 (imbalanced MNIST), by prevalence 25, 15, 10, 5 (%), for
# no privacy then Gaussian privacy.
_TABLE4 = (
    reporting.paper_rows('''
    pfedme             | 0.77 ± 0.19 | 0.79 ± 0.17 | 0.74 ± 0.14 | 0.76 ± 0.15
    pfedkm             | 0.66 ± 0.04 | 0.57 ± 0.04 | 0.49 ± 0.03 | 0.43 ± 0.03
    fedrep             | 0.80 ± 0.18 | 0.79 ± 0.15 | 0.75 ± 0.14 | 0.77 ± 0.15
    global             | 0.82 ± 0.10 | 0.43 ± 0.09 | 0.38 ± 0.03 | 0.36 ± 0.02
    global_plus        | 0.83 ± 0.10 | 0.40 ± 0.16 | 0.41 ± 0.08 | 0.36 ± 0.10
    fedembed_personal  | 0.72 ± 0.16 | 0.75 ± 0.13 | 0.74 ± 0.12 | 0.74 ± 0.15
    fedembed_som       | 0.91 ± 0.14 | 0.69 ± 0.08 | 0.61 ± 0.13 | 0.45 ± 0.14
    fedembed_prototype | 0.82 ± 0.16 | 0.86 ± 0.06 | 0.85 ± 0.07 | 0.89 ± 0.05
    fedembed_type      | 0.92 ± 0.27 | 0.91 ± 0.26 | 0.84 ± 0.23 | 0.83 ± 0.24
'''),
    reporting.paper_rows('''
    pfedme             | 0.49 ± 0.06 | 0.50 ± 0.07 | 0.49 ± 0.05 | 0.48 ± 0.05
    pfedkm             | 0.49 ± 0.02 | 0.47 ± 0.03 | 0.48 ± 0.02 | 0.48 ± 0.02
    fedrep             | 0.55 ± 0.05 | 0.49 ± 0.05 | 0.51 ± 0.03 | 0.50 ± 0.03
    global             | 0.39 ± 0.10 | 0.37 ± 0.10 | 0.38 ± 0.09 | 0.37 ± 0.08
    global_plus        | 0.33 ± 0.10 | 0.34 ± 0.08 | 0.34 ± 0.07 | 0.34 ± 0.07
    fedembed_personal  | 0.51 ± 0.06 | 0.49 ± 0.05 | 0.50 ± 0.03 | 0.50 ± 0.04
    fedembed_som       | 0.65 ± 0.13 | 0.49 ± 0.13 | 0.49 ± 0.08 | 0.45 ± 0.07
    fedembed_prototype | 0.85 ± 0.13 | 0.59 ± 0.14 | 0.69 ± 0.18 | 0.69 ± 0.16
    fedembed_type      | 0.79 ± 0.20 | 0.90 ± 0.22 | 0.72 ± 0.19 | 0.67 ± 0.19
'''))
# FedEmbed Table 5 (imbalanced speech), by prevalence 20, 8, 4 (%).
_TABLE5 = (
    reporting.paper_rows('''
    pfedme             | 0.66 ± 0.11 | 0.62 ± 0.10 | 0.54 ± 0.06
    pfedkm             | 0.49 ± 0.01 | 0.49 ± 0.02 | 0.48 ± 0.02
    fedrep             | 0.65 ± 0.15 | 0.52 ± 0.08 | 0.55 ± 0.09
    global             | 0.57 ± 0.24 | 0.49 ± 0.16 | 0.38 ± 0.11
    global_plus        | 0.51 ± 0.22 | 0.53 ± 0.20 | 0.38 ± 0.12
    fedembed_personal  | 0.78 ± 0.01 | 0.68 ± 0.08 | 0.65 ± 0.07
    fedembed_som       | 0.65 ± 0.13 | 0.60 ± 0.09 | 0.50 ± 0.08
    fedembed_prototype | 0.79 ± 0.09 | 0.71 ± 0.20 | 0.54 ± 0.18
    fedembed_type      | 0.73 ± 0.05 | 0.92 ± 0.04 | 0.73 ± 0.13
'''),
    reporting.paper_rows('''
    pfedme             | 0.49 ± 0.01 | 0.49 ± 0.02 | 0.49 ± 0.01
    pfedkm             | 0.50 ± 0.02 | 0.50 ± 0.02 | 0.48 ± 0.02
    fedrep             | 0.47 ± 0.03 | 0.50 ± 0.01 | 0.49 ± 0.01
    global             | 0.34 ± 0.01 | 0.34 ± 0.01 | 0.35 ± 0.03
    global_plus        | 0.33 ± 0.00 | 0.33 ± 0.00 | 0.33 ± 0.00
    fedembed_personal  | 0.49 ± 0.01 | 0.50 ± 0.02 | 0.49 ± 0.01
    fedembed_som       | 0.50 ± 0.07 | 0.49 ± 0.05 | 0.45 ± 0.05
    fedembed_prototype | 0.52 ± 0.21 | 0.55 ± 0.27 | 0.48 ± 0.13
    fedembed_type      | 0.54 ± 0.20 | 0.60 ± 0.14 | 0.48 ± 0.18
'''))

_NOTES = ('F1: mean over sub-populations of the mean per-user F1, on '
          '`eval_clients` users after one local pass of their private state '
          '(see docs/papers/fedembed.md). Gaussian: user-level DP on the whole '
          'shared update, noise calibrated to epsilon 10 at delta = '
          'min(1e-5, population^-1.1) for the cell\'s rounds (a cell '
          'resumed after a kill also accounts the rounds it replayed, so '
          'its epsilon is higher); the exact epsilon of each cell is in '
          'results.jsonl and the epsilon table.')


_RESTART_NOTE = (' pfedme_restart (ours; no paper column): pFedMe with the '
                 'personal head restarting from the global head every round '
                 'and at evaluation, as its authors\' code runs it; pfedme '
                 'keeps each user\'s head between rounds (FedEmbed does not '
                 'say which it ran).')


def _prevalence_tables(prefix: str, task: Optional[str], prevalences,
                       paper_rows, label: str, main: int):
  tables = {}
  for i, p in enumerate(prevalences):
    name = prefix if p == main else f'{prefix}_{p}'
    columns = _imbalanced_columns(task)
    values = {}
    none, gauss = paper_rows
    for m in none:
      values[(m, columns[0].name)] = none[m][i]
      values[(m, columns[1].name)] = gauss[m][i]
    tables[name] = reporting.Table(
        name=name, paper=PAPER, metric=f'f1_prev_{p}', methods=METHODS,
        columns=columns, paper_values=values,
        title=f'FedEmbed Table {prefix} ({label}, imbalanced): mean F1 of '
              f'the {p}% sub-populations',
        notes=_NOTES)
  return tables


def _encoder_table(encoder: str, methods: tuple[str, ...], variant: str,
                   notes: str) -> dict[str, reporting.Table]:
  """Table `3_<encoder>`: Table 3's cells with the speech `encoder` setting
  (our variants), next to the paper's Table 3 numbers of `methods`."""
  name = f'3_{encoder}'
  return {name: reporting.Table(
      name=name, paper=PAPER, metric='f1', methods=methods,
      columns=_encoder_columns(encoder),
      paper_values=_paper({m: v for m, v in _TABLE3.items() if m in methods},
                          _columns(SPEECH)),
      title=f'FedEmbed Table 3 (speaker preferences) {variant}: mean F1',
      notes=_NOTES + _RESTART_NOTE + notes)}


TABLES: dict[str, reporting.Table] = {
    '2': reporting.Table(
        name='2', paper=PAPER, metric='f1', methods=METHODS,
        columns=_columns(None), paper_values=_paper(_TABLE2, _columns(None)),
        title='FedEmbed Table 2 (MNIST preferences): mean F1', notes=_NOTES),
    '3': reporting.Table(
        name='3', paper=PAPER, metric='f1',
        methods=METHODS + (PFEDME_RESTART, LOCAL_SPECTRUM),
        columns=_columns(SPEECH),
        paper_values=_paper(_TABLE3, _columns(SPEECH)),
        title='FedEmbed Table 3 (speaker preferences): mean F1',
        notes=_NOTES + _RESTART_NOTE + ' local_spectrum (ours, not '
              'federated): every user\'s own logistic regression on its 20 '
              'training utterances\' mean log-spectra over their louder '
              'frames (nothing shared: no privacy spent, its Gaussian '
              'columns equal its None ones).'),
    **_encoder_table(
        PUBLIC, PUBLIC_ENCODER_METHODS,
        'with the encoder pre-trained on public speakers and frozen (our '
        'variant; the paper column is its Table 3, trained from scratch)',
        ' local: no federation; every user\'s own logistic regression on the '
        'frozen features of its 20 training samples (nothing shared: no '
        'privacy spent, its Gaussian columns equal its None ones). The '
        'encoder is the --fedembed_speech_encoder file; each cell records it '
        'and its public held-out accuracy (None: an untrained encoder, '
        '`pretrain_speech_encoder --epochs=0`, a control).'),
    **_encoder_table(
        SPECTRAL, METHODS + (PFEDME_RESTART, LOCAL_SPECTRUM),
        'with the spectral encoder, trained from scratch (our variant: a '
        'fixed mean-spectrum front end and one Dense layer instead of the '
        'Appendix B.2 convolutions; the paper column is its Table 3)',
        ' Spectral encoder: `fedembed_speech.build_spectral_encoder` (12,992 '
        'weights against B.2\'s 243,344); no public data. local_spectrum: as '
        'in table 3 (the same front end, fitted by each user alone).'),
    **_encoder_table(
        SPECTRUM, SPECTRUM_ENCODER_METHODS,
        'on the standardised mean spectrum, no encoder weights (our variant; '
        'the paper column is its Table 3)',
        ' Spectrum encoder: `fedembed_speech.build_spectral_encoder('
        'features=None)`, each utterance\'s mean log-spectrum over its louder '
        'frames, standardised; only heads, prototypes and the k-way '
        'classifier are shared; no public data. FedRep is left out (its '
        'shared part would be empty). local_spectrum: as in table 3.'),
    **_prevalence_tables('4', None, (25, 15, 10, 5), _TABLE4, 'MNIST', 5),
    **_prevalence_tables('5', SPEECH, (20, 8, 4), _TABLE5, 'speech', 4),
    'fig4': reporting.Table(
        name='fig4', paper=PAPER, metric='f1', methods=('fedembed_type',),
        columns=[reporting.Column('with k-way head',
                                  {'population': 'balanced', 'dp': 'none'}),
                 reporting.Column('without k-way head',
                                  {'population': 'balanced', 'dp': 'none',
                                   'type_head': False})],
        title='FedEmbed Figure 4: FedEmbed-Type with and without the k-way '
              'head (balanced MNIST, no DP): mean F1', notes=_NOTES),
}


def _heads_table(name: str, task: Optional[str], methods: tuple[str, ...],
                 paper_rows: dict, label: str) -> reporting.Table:
  """Table `<name>`: the methods with a personal head under
  `GAUSSIAN_HEADS`, next to the paper's Gaussian columns."""
  columns = [reporting.Column(f'{pop} Gaussian, heads noised',
                              {**({} if task is None else {'task': task}),
                               'population': pop, 'dp': GAUSSIAN_HEADS})
             for pop in ('balanced', 'imbalanced')]
  paper_columns = [c for c in _columns(task)
                   if c.setting['dp'] == 'gaussian_fixed']
  paper = _paper(paper_rows, _columns(task))
  values = {(m, col.name): paper[(m, paper_col.name)]
            for m in methods if m in paper_rows
            for col, paper_col in zip(columns, paper_columns)}
  return reporting.Table(
      name=name, paper=PAPER, metric='f1', methods=methods, columns=columns,
      paper_values=values,
      title=f'FedEmbed {label} with DP as we read Algorithm 1: personal '
            'heads noised too: mean F1',
      notes=_NOTES + ' Heads noised (the paper\'s DP as we read its '
            'Algorithm 1, line 22, and section 4.2.1; ours otherwise leaves '
            'private state un-noised): each local pass\'s change of a '
            'personal head is clipped to the clip norm and gets Gaussian '
            'noise at the shared noise multiplier '
            '(tff_personal/core/private_noise.py); personal embeddings are '
            'not noised (section 3.2), so the methods without a personal '
            'head are as in the Gaussian columns of the main table. Each '
            'cell\'s personal-head epsilon is in its summary.json.')


TABLES['2_heads'] = _heads_table('2_heads', None, HEAD_METHODS, _TABLE2,
                                 'Table 2 (MNIST preferences)')
TABLES['3_heads'] = _heads_table('3_heads', SPEECH,
                                 HEAD_METHODS + (PFEDME_RESTART,), _TABLE3,
                                 'Table 3 (speaker preferences)')

# The same cells with each user's F1 averaged over "like" and "dislike"
# (`evaluation.macro_f1`). The paper's F1 is not defined in its text; its
# tables read as this one: Global+ with DP is 0.33 +- 0.00 over five seeds
# (speech, both populations), which is what a constant answer scores here and
# which no constant answer scores by the F1 of "like" (0 or 0.67) (README,
# "Which F1 the paper reports").
_MACRO_NOTES = (
    ' F1 (macro): each user\'s F1 averaged over both labels ("like", '
    '"dislike"): a constant answer scores 0.33 and guessing about 0.5; the '
    'paper column is the paper\'s table, which we read as this F1.')
for _name in ('2', '3', '3_public', '3_spectral', '3_spectrum', '2_heads',
              '3_heads'):
  TABLES[f'{_name}_macro'] = dataclasses.replace(
      TABLES[_name], name=f'{_name}_macro', metric='f1_macro',
      title=TABLES[_name].title.replace(': mean F1',
                                        ': mean F1 averaged over both labels'),
      notes=TABLES[_name].notes + _MACRO_NOTES)
del _name



# Which prevalence tables make one side-by-side file, and the prevalences.
_BY_PREVALENCE = {'4': (MNIST, (25, 15, 10, 5)), '5': (SPEECH, (20, 8, 4))}


# How often a cell is evaluated (its learning curve) and checkpointed, not
# what it computes: evaluation reads the stored states and never writes them
# (tests/fedembed_paper_test.py runs a cell both ways), so these flags are
# left out of a record's config.
OPERATIONAL_FLAGS = ('fedembed_eval_every', 'fedembed_curve_points',
                     'fedembed_curve_eval_clients')


def define_flags():
  reporting.define_flags(
      ('float', 'fedembed_target_epsilon', algorithm_defaults.TARGET_EPSILON,
       'FedEmbed: epsilon of the DP cells (delta: min(1e-5, n^-1.1)).'),
      ('float', 'fedembed_clip_norm', None,
       "FedEmbed: L2 clip of a client's shared update (None: the default)."),
      ('integer', 'fedembed_local_epochs', None,
       'FedEmbed: local epochs (None: the per-algorithm default).'),
      ('integer', 'fedembed_eval_clients', None,
       'FedEmbed: users evaluated (None: the per-algorithm default).'),
      ('string', 'fedembed_speech_encoder', None,
       'FedEmbed: the pre-trained speech encoder (.npz of '
       'binaries.pretrain_speech_encoder) of the encoder=public cells.'),
      ('integer', 'fedembed_eval_every', None,
       'FedEmbed: rounds between evaluations (None: --fedembed_curve_points).'),
      ('integer', 'fedembed_curve_eval_clients', None,
       'FedEmbed: users tested at the evaluations before the last (a seeded '
       'subset; None: all).'),
      ('integer', 'fedembed_curve_points', 10,
       'FedEmbed: evaluations per run when --fedembed_eval_every is unset '
       '(0: the per-algorithm default).'))


def _flag(flag_values, name, default=None):
  value = getattr(flag_values, name, None)
  return default if value is None else value


def _task_name(setting) -> str:
  return setting.get('task', MNIST)


def cells(table: str, flag_values) -> list[reporting.Cell]:
  """The table's cells whose method is registered; says which are skipped."""
  out = TABLES[table].cells(flag_values.seeds)
  known = set(algorithm_registry.ALGORITHMS) | set(LOCAL_METHODS)
  missing = sorted({c.method for c in out} - known, key=METHODS.index)
  if missing:
    message = (f'fedembed table {table}: skipping {", ".join(missing)}: not '
               'registered in tff_personal/algorithms/registry.py yet (their '
               'rows stay empty).')
    logging.warning(message)
    print(message, flush=True)
  return [c for c in out if c.method in known]


def cell_settings(cell: reporting.Cell, flag_values) -> dict[str, Any]:
  """The flag-style settings of a cell: defaults, then the paper's flags."""
  task = _task_name(cell.setting)
  settings = algorithm_defaults.defaults_for(task, cell.method,
                                             cell.setting['dp'])
  if not settings:
    raise ValueError(f'no defaults for {cell.method!r} on task {task!r} in '
                     'tff_personal/algorithms/defaults.py')
  for flag_name, key in (('rounds', 'rounds'),
                         ('clients_per_round', 'clients_per_round'),
                         ('num_users', 'num_users'),
                         ('fedembed_local_epochs', 'local_epochs'),
                         ('fedembed_eval_clients', 'eval_clients'),
                         ('fedembed_eval_every', 'eval_every')):
    value = getattr(flag_values, flag_name, None)
    if value is not None:
      settings[key] = value
  settings['eval_clients'] = min(settings['eval_clients'],
                                 settings['num_users'])
  points = getattr(flag_values, 'fedembed_curve_points', None)
  if getattr(flag_values, 'fedembed_eval_every', None) is None and points:
    if points < 0:
      raise ValueError(f'--fedembed_curve_points must be >= 0, got {points}')
    settings['eval_every'] = max(1, settings['rounds'] // points)
  return settings


class _WithoutTypeHead:
  """A task whose FedEmbed model has no k-way type head (Figure 4 ablation)."""

  def __init__(self, task):
    self._task = task

  def __getattr__(self, name):
    return getattr(self._task, name)

  def fedembed_model_fn_factory(self, config):
    return self._task.fedembed_model_fn_factory(
        dataclasses.replace(config, use_type_head=False))


_TASKS: dict[tuple, Any] = {}


def _build_task(name: str, data_dir: Optional[str], s: dict, population: str,
                seed: int, encoder_weights: Optional[str] = None,
                encoder: Optional[str] = None):
  """The cell's task (cached); `encoder_weights`: a frozen public encoder;
  `encoder`: the speech encoder kind (None: the task's default, B.2)."""
  if name not in task_registry.TASKS:
    raise ValueError(
        f'task {name!r} is not registered in tasks/registry.py yet; the '
        f'FedEmbed tables that need it (3 and 5) cannot run. Registered: '
        f'{task_registry.TASKS}')
  key = (name, data_dir, s['num_users'], population, seed, s['batch_size'],
         s['local_epochs'], encoder_weights, encoder)
  extra = ({} if encoder_weights is None else
           dict(encoder_weights=encoder_weights, freeze_encoder=True))
  if encoder is not None:
    extra['encoder'] = encoder
  if key not in _TASKS:
    _TASKS.clear()  # one task in memory at a time
    _TASKS[key] = task_registry.build_task(
        name, data_dir=data_dir, num_users=s['num_users'],
        population=population, seed=seed, batch_size=s['batch_size'],
        local_epochs=s['local_epochs'], **extra)
  return _TASKS[key]


def _encoder_kind(cell: reporting.Cell) -> Optional[str]:
  """The task's `encoder` for a cell: 'spectral' / 'spectrum' for those
  `encoder` settings, None (the task's B.2 default) otherwise."""
  encoder = cell.setting.get('encoder')
  if encoder is None:
    return None
  if (encoder not in (PUBLIC, SPECTRAL, SPECTRUM)
      or _task_name(cell.setting) != SPEECH):
    raise ValueError(f'unknown encoder setting {encoder!r} for task '
                     f'{_task_name(cell.setting)!r}')
  return {SPECTRAL: fedembed_speech.SPECTRAL,
          SPECTRUM: fedembed_speech.SPECTRUM}.get(encoder)


def _encoder_weights(cell: reporting.Cell, flag_values) -> Optional[str]:
  """The public encoder of an `encoder='public'` cell (None otherwise)."""
  _encoder_kind(cell)  # a bad setting is named
  if cell.setting.get('encoder') != PUBLIC:
    return None
  path = getattr(flag_values, 'fedembed_speech_encoder', None)
  if not path:
    raise ValueError(
        'the encoder=public cells (table 3_public) need '
        '--fedembed_speech_encoder=<.npz>: make it with `python -m '
        'binaries.make_speech_data --voice_set=public ...` and `python -m '
        'binaries.pretrain_speech_encoder ...` (README)')
  return path


def _data_dir(flag_values, task: str) -> Optional[str]:
  if getattr(flag_values, 'data_dir', None):
    return flag_values.data_dir
  return os.path.join(reporting.DEFAULT_DATA_DIR,
                      'mnist' if task == MNIST else 'speech')


def privacy_of(cell: reporting.Cell, flag_values) -> run_spec.Privacy:
  """No DP, or the one DP setting every method shares, calibrated to
  `--fedembed_target_epsilon` at delta `default_target_delta(population)`
  (`gaussian_heads`: the same, plus noised personal heads)."""
  if cell.setting['dp'] == 'none':
    return run_spec.Privacy()
  if cell.setting['dp'] not in ('gaussian_fixed', GAUSSIAN_HEADS):
    raise ValueError(f'unknown dp setting {cell.setting["dp"]!r}')
  return run_spec.Privacy(
      mechanism='gaussian_fixed',
      target_epsilon=_flag(flag_values, 'fedembed_target_epsilon',
                           algorithm_defaults.TARGET_EPSILON),
      clip_norm=_flag(flag_values, 'fedembed_clip_norm',
                      algorithm_defaults.DP_SETTINGS['clip_norm']),
      personal_heads=('noised' if cell.setting['dp'] == GAUSSIAN_HEADS
                      else 'exempt'))


def cell_spec(cell: reporting.Cell, flag_values, out_dir: str,
              population: int) -> run_spec.RunSpec:
  """A federated cell's run: the method on the cell's task under its
  (task, method) defaults and the paper's flags (`cell_settings`)."""
  s = cell_settings(cell, flag_values)
  return run_spec.RunSpec(
      task=_task_name(cell.setting), algorithm=cell.method,
      # The paper's SOM (best-scoring update, no DP) hands one client's
      # embedding-derived update to the server: opted into explicitly.
      algorithm_options=({'allow_unprotected_best_client': True}
                         if cell.method == 'fedembed_som' and
                         cell.setting['dp'] == 'none' else {}),
      loop=run_spec.Loop(
          rounds=s['rounds'], clients_per_round=s['clients_per_round'],
          seed=cell.seed, embedding_dim=s.get('embedding_dim'),
          checkpoint_every=max(1, s['eval_every']), resume=True,
          personal_init='normal'),  # as the recorded cells started
      optimizers=run_spec.Optimizers(
          client_learning_rate=s['client_learning_rate'],
          private_learning_rate=s.get('private_learning_rate'),
          server=s['server_optimizer'],
          server_learning_rate=s['server_learning_rate']),
      privacy=privacy_of(cell, flag_values),
      evaluation=run_spec.Evaluation(
          every=s['eval_every'], clients=s['eval_clients'],
          curve_clients=min(
              _flag(flag_values, 'fedembed_curve_eval_clients', 0),
              s['eval_clients'] or population),
          fine_tune=s['eval_fine_tune']),
      output=run_spec.Output(out_dir, 'run'))


def experiment_config(cell: reporting.Cell, flag_values, out_dir: str,
                      population: int) -> experiment.ExperimentConfig:
  """`cell_spec`'s recorded configuration."""
  return cell_spec(cell, flag_values, out_dir, population).config()


def prevalence_f1(f1_per_group: dict, prevalence,
                  prefix: str = 'f1') -> dict[str, float]:
  """Mean F1 of the sub-populations of each prevalence (percent), as
  `<prefix>_prev_<percent>`."""
  out = {}
  for p in sorted(set(prevalence), reverse=True):
    values = [f1_per_group[str(k)] for k, q in enumerate(prevalence)
              if q == p and str(k) in f1_per_group]
    if values:
      out[f'{prefix}_prev_{p}'] = float(np.mean(values))
  return out


def cell_metrics(summary: dict, prevalence) -> dict:
  """A cell's metrics from the experiment's summary.json."""
  ev = summary['eval']
  per_group = {str(k): float(v) for k, v in ev['f1_per_group'].items()}
  metrics = {'f1': ev['f1'], 'accuracy': ev['accuracy'], 'auc': ev['auc'],
             'f1_user_mean': ev['f1_user_mean'],
             'eval_clients': ev['num_clients'],
             'rounds': summary['rounds_completed'],
             'seconds_per_round': summary['seconds_per_round'],
             'population': summary['population']}
  for k, v in sorted(per_group.items(), key=lambda kv: int(kv[0])):
    metrics[f'f1_group_{k}'] = v
  metrics.update(prevalence_f1(per_group, prevalence))
  if 'f1_macro' in ev:  # summaries written before the metric existed lack it
    metrics['f1_macro'] = ev['f1_macro']
    metrics.update(prevalence_f1(
        {str(k): float(v) for k, v in ev['f1_macro_per_group'].items()},
        prevalence, prefix='f1_macro'))
  if summary.get('privacy'):
    for k in ('epsilon', 'delta', 'noise_multiplier', 'clip_norm'):
      metrics[k] = summary['privacy'][k]
  return metrics


def run_cell(cell: reporting.Cell, flag_values, out_dir: str) -> dict:
  if cell.method in LOCAL_METHODS:
    return _run_local(cell, flag_values, out_dir)
  task_name = _task_name(cell.setting)
  if cell.method not in algorithm_registry.ALGORITHMS:
    raise ValueError(f'{cell.method!r} is not registered in '
                     'tff_personal/algorithms/registry.py yet')
  s = cell_settings(cell, flag_values)
  encoder_weights = _encoder_weights(cell, flag_values)
  data_seed = reporting.data_seed(flag_values, cell.seed)
  task = _build_task(task_name, _data_dir(flag_values, task_name), s,
                     cell.setting['population'], data_seed, encoder_weights,
                     _encoder_kind(cell))
  if cell.setting.get('type_head') is False:
    task = _WithoutTypeHead(task)
  config = experiment_config(cell, flag_values, out_dir, task.population)
  with runtime.local_runtime(
      log_path=os.path.join(out_dir, 'worker_binary.log')):
    run = runs.run_experiment(
        task, config, export_private_states=True,
        # The evaluated users are data: drawn by the data seed.
        eval_ids=(None if data_seed == cell.seed else
                  run_evaluation.eval_client_ids(
                      task.population, config.eval_clients, data_seed)),
        log_fn=lambda line: print(f'  {cell.method}: {line}', flush=True))
  metrics = cell_metrics(
      run, _prevalence(task_name, cell.setting['population']))
  if encoder_weights:  # which encoder, and how well it told public voices
    meta = fedembed_speech.load_encoder_weights(encoder_weights)[1]
    metrics['encoder_weights'] = os.path.abspath(encoder_weights)
    metrics['encoder_public_accuracy'] = (
        meta.get('val_accuracy') or [None])[-1]
  _save_analysis(task, cell, config.experiment_dir, out_dir,
                 config.embedding_dim)
  # Every method's F1 curve (the figures draw them all).
  curve = [r for r in run.curves()['eval'] if 'f1' in r]
  atomic_io.write_json(os.path.join(out_dir, 'curve.json'),
                       {'round': [int(r['round']) for r in curve],
                        'f1': [float(r['f1']) for r in curve]})
  root = reporting.root_of(out_dir, required=False)
  if root:
    make_figures(root)
  return metrics


# Inverse L2 strengths of the local heads recorded besides the headline
# `local_head.DEFAULT_C` (how much the choice matters; never picked from).
LOCAL_C_SWEEP = (0.01, 0.1, 10.0)


def _run_local(cell: reporting.Cell, flag_values, out_dir: str) -> dict:
  """A `LOCAL_METHODS` row: each user's own logistic regression on fixed
  features of its samples, fitted and tested on them alone (`local_head`):
  the frozen public encoder's 256 features (`local`, encoder=public cells)
  or each utterance's mean log-spectrum over its louder frames
  (`local_spectrum`, `speech_spectrogram.mean_loud_spectrum`; tables 3,
  3_spectral and 3_spectrum, whose encoders start from the same feature).

  The users, their samples and the evaluated users are those of the
  table's federated cells with the same setting and seed; no TFF runtime is
  started. DP does not apply (nothing leaves a device): the DP columns
  compute the same as the no-DP ones, and the cell records
  `shared_parameters` 0 and no epsilon.
  """
  start = time.perf_counter()
  task_name = _task_name(cell.setting)
  if task_name != SPEECH:
    raise ValueError(f'{cell.method} is defined for {SPEECH} only, got '
                     f'{task_name!r}')
  encoder_path = _encoder_weights(cell, flag_values)
  if (cell.method == LOCAL) != (encoder_path is not None):
    raise ValueError(
        f'{LOCAL} needs the frozen public encoder (setting encoder=public, '
        f'table 3_public) and {LOCAL_SPECTRUM} runs without one (table 3); '
        f'got {cell.method} with setting {dict(cell.setting)}')
  # Every method shares the population settings; 'global' has defaults.
  s = cell_settings(dataclasses.replace(cell, method='global'), flag_values)
  data_seed = reporting.data_seed(flag_values, cell.seed)
  task = _build_task(task_name, _data_dir(flag_values, task_name), s,
                     cell.setting['population'], data_seed, encoder_path,
                     _encoder_kind(cell))
  if encoder_path:
    weights, meta = fedembed_speech.load_encoder_weights(encoder_path)
    encoder = fedembed_speech.build_encoder(channels=1, weights=weights,
                                            trainable=False)
    features = lambda q: local_head.encode(
        encoder, speech_spectrogram.to_unit(q)[..., np.newaxis])
  else:
    features = speech_spectrogram.mean_loud_spectrum
  ids = run_evaluation.eval_client_ids(task.population, s['eval_clients'],
                                       data_seed)
  train, test = local_head.user_features(
      lambda user, split: task.data.user_spectrograms(user, split)[:2], ids,
      features, log_fn=lambda s: print(f'  {cell.method}: {s}', flush=True))
  by_c = local_head.evaluate(
      train, test, [int(task.data.subpopulation[u]) for u in ids],
      (local_head.DEFAULT_C,) + LOCAL_C_SWEEP, seed=cell.seed)
  metrics = cell_metrics(
      {'eval': by_c[local_head.DEFAULT_C], 'rounds_completed': 0,
       'seconds_per_round': 0.0, 'population': task.population},
      _prevalence(task_name, cell.setting['population']))
  for c in LOCAL_C_SWEEP:
    metrics[f'f1_c_{c:g}'] = by_c[c]['f1']
    metrics[f'accuracy_c_{c:g}'] = by_c[c]['accuracy']
  metrics.update(c=local_head.DEFAULT_C, shared_parameters=0,
                 seconds=time.perf_counter() - start)
  if encoder_path:
    metrics.update(
        encoder_weights=os.path.abspath(encoder_path),
        encoder_public_accuracy=(meta.get('val_accuracy') or [None])[-1])
  return metrics


def _prevalence(task_name: str, population: str) -> tuple[int, ...]:
  """Each sub-population's share (percent) of the population."""
  prevalence = (MNIST_PREVALENCE if task_name == MNIST else SPEECH_PREVALENCE)
  if population == 'balanced':
    prevalence = (100 // len(prevalence),) * len(prevalence)
  return prevalence


def _private_names(task, method: str,
                   embedding_dim: Optional[int] = None) -> Optional[list[str]]:
  """Names of the private variables of a FedEmbed method's model, in order.

  `embedding_dim` is the cell's (None: the model's default); the speech model
  accepts only its own size.
  """
  if not method.startswith('fedembed_'):
    return None
  assignment = method[len('fedembed_'):]
  if assignment not in fedembed_model.ASSIGNMENTS:
    return None
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  config = fedembed_model.FedEmbedConfig(
      assignment=assignment,
      **({} if embedding_dim is None else {'embedding_dim': embedding_dim}))
  with tf.Graph().as_default():
    model = task.fedembed_model_fn_factory(config)()
    return [v.name.split('/')[-1].split(':')[0]
            for v in model.private_variables]


def _save_analysis(task, cell, exp_dir: str, out_dir: str,
                   embedding_dim: Optional[int] = None) -> None:
  """analysis.npz: users' ground truth, embeddings, trained flag and heads."""
  path = os.path.join(exp_dir, 'private_states.npz')
  names = _private_names(task, cell.method, embedding_dim)
  if not os.path.exists(path) or names is None:
    return
  with np.load(path) as z:
    arrays = {n: z[f'private_{i}'] for i, n in enumerate(names)}
    ids = z['ids']
    participated = (z['rounds_participated'] if 'rounds_participated' in z
                    else None)
  out = {'ids': ids, 'subpopulation': np.asarray(task.groups(ids))}
  if 'personal_embedding' in arrays:
    out['embedding'] = arrays['personal_embedding']
  if participated is not None:  # users who took part in training
    out['trained'] = participated > 0
  if 'head' in arrays:
    out['head'] = arrays['head']
  np.savez(os.path.join(out_dir, 'analysis.npz'), **out)


# ------------------------------------------------------------------ tables


def render_by_prevalence(results: reporting.Results, prefix: str) -> str:
  """Table 4 (or 5) with every prevalence side by side: ours (paper)."""
  task, prevalences = _BY_PREVALENCE[prefix]
  records = reporting.latest_records(results)
  columns = _imbalanced_columns(None if task == MNIST else task)
  header = ['method'] + [f'{_DP_NAMES[c.setting["dp"]]} {p}%'
                         for c in columns for p in prevalences]
  lines = [f'### FedEmbed Table {prefix}: imbalanced, F1 by prevalence, ours '
           '(paper)', '', '| ' + ' | '.join(header) + ' |',
           '|' + '|'.join(['---'] + ['---:'] * (len(header) - 1)) + '|']
  for method in METHODS:
    row = [method]
    for c in columns:
      for p in prevalences:
        table = TABLES[prefix if p == prevalences[-1] else f'{prefix}_{p}']
        values = [m[table.metric] for m in reporting.metrics_for(
            records, PAPER, method, c.setting) if table.metric in m]
        s = reporting.summarize(values)
        ours = (reporting.MISSING if s is None else
                f'{s.mean:.2f} ± {s.std:.2f} ({s.n})')
        row.append(f'{ours} ({table.paper_values.get((method, c.name), "—")})')
    lines.append('| ' + ' | '.join(row) + ' |')
  return '\n'.join(lines) + '\n'


# This paper's own layouts (`reporting.write_extra_tables` writes them after
# every cell; `tools/paper_tables.py` renders them into the report).
EXTRA_TABLES = {
    **{f'{prefix}_by_prevalence':
       (lambda records, prefix=prefix: render_by_prevalence(records, prefix))
       for prefix in _BY_PREVALENCE},
    'epsilon': lambda records: reporting.render_epsilons(records, PAPER),
}


# ----------------------------------------------------------------- figures


# Run-directory pattern and label of each task's cells (speech cells have
# `task=speech_preference` in their setting).
_FIGURE_TASKS = (('', 'MNIST preferences', 'digit'),
                 (f'_task={SPEECH}', 'speaker preferences', 'voice'))
_DP_STYLES = (('none', '-'), ('gaussian_fixed', '--'))


def make_figures(root_output_dir: str) -> list[str]:
  """Figures 3, 4 and 5 and F1-vs-round curves from the saved runs (PNG);
  speech figures end in `_speech` (Figure 5 is
  `fedembed_confusion_speech.png`)."""
  out = os.path.join(root_output_dir, reporting.TABLES_DIRNAME, PAPER)
  written = []
  for task_key, label, group_noun in _FIGURE_TASKS:
    suffix = '_speech' if task_key else ''
    written += [_curve_figure(root_output_dir, out, task_key, label, suffix),
                _confusion_figure(root_output_dir, out, task_key, label,
                                  group_noun, suffix)]
  written.append(_tsne_figure(root_output_dir, out))
  return [path for path in written if path]


def _cells_dir(root, method, pattern) -> str:
  return os.path.join(root, reporting.RUNS_DIRNAME, PAPER, method, pattern)


def _curve_figure(root, out, task_key, label, suffix) -> Optional[str]:
  """F1 vs round per population: per method (a colour) and DP setting (a
  line style) the mean over seeds, a band of one std; one legend."""
  panels, shown, all_curves = [], set(), []
  for pop in ('balanced', 'imbalanced'):
    lines = []
    for i, method in enumerate(METHODS):
      for dp, style in _DP_STYLES:
        curves = curve_bands.seed_curves(_cells_dir(
            root, method, f'dp={dp}_population={pop}{task_key}-*'))
        if curve_bands.seed_band(curves, 'round', 'f1')[0]:
          lines.append(dict(curves=curves, y='f1', color=f'C{i}',
                            linestyle=style))
          shown.update((method, dp))
          all_curves.append(curves)
    panels.append(dict(title=f'{label}, {pop}', lines=lines))
  handles = ([dict(color=f'C{i}', marker='.', label=m)
              for i, m in enumerate(METHODS) if m in shown]
             + [dict(color='gray', linestyle=style,
                     label=f'DP: {_DP_NAMES[dp]}')
                for dp, style in _DP_STYLES if dp in shown])
  return figures.band_figure(
      os.path.join(out, f'fedembed_f1_curves{suffix}.png'), panels,
      ylabel='mean F1 (eval users)', suptitle=figures.seed_spread(all_curves),
      legend='figure', handles=handles, panel_size=(6, 4.5), sharey=True)


def _analyses(root, method, pattern):
  """The `analysis.npz` of seed 0 of each cell matching `pattern` in which
  some users trained."""
  for d in sorted(glob.glob(os.path.join(_cells_dir(root, method, pattern),
                                         'seed_0'))):
    path = os.path.join(d, 'analysis.npz')
    if os.path.exists(path):
      with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
      if 'trained' in arrays and arrays['trained'].any():
        yield arrays


def _confusion_figure(root, out, task_key, label, group_noun,
                      suffix) -> Optional[str]:
  """Figure 3 (MNIST) / Figure 5 (speech): each user's group against its
  head (SOM, Prototype) or its embedding's k-means cluster."""
  panels = []
  for method in (('fedembed_som', 'fedembed_prototype') if not task_key else
                 ('fedembed_som', 'fedembed_personal', 'fedembed_type',
                  'fedembed_prototype')):
    for z in _analyses(root, method,
                       f'dp=none_population=balanced{task_key}-*'):
      t = z['trained']
      truth = z['subpopulation'][t]
      if 'head' in z and method in ('fedembed_som', 'fedembed_prototype'):
        panels.append((method, 'head at the last training participation',
                       truth, z['head'][t], method == 'fedembed_som'))
      elif 'embedding' in z:
        k = int(truth.max()) + 1
        panels.append((method, 'k-means of personal embeddings', truth,
                       embedding_purity.embedding_assignment(
                           z['embedding'][t], k), True))
  if not panels:
    return None
  fig, axes = figures.pyplot().subplots(
      1, len(panels), figsize=(5 * len(panels), 4.8), squeeze=False)
  for ax, (method, how, truth, assigned, relabel) in zip(axes[0], panels):
    k = int(max(truth.max(), assigned.max())) + 1
    shown = (embedding_purity.matched(truth, assigned, k) if relabel
             else assigned)
    ax.imshow(figures.confusion(truth, shown, k), cmap='Blues', vmin=0,
              vmax=1)
    own = '' if method == 'fedembed_personal' or 'k-means' in how else (
        f'own group {np.mean(truth == assigned):.2f}, ')
    score = embedding_purity.assignment_accuracy(truth, assigned, k)
    ax.set_title(f'{method}: {how}{" (matched)" if relabel else ""}\n'
                 f'({own}best one-to-one relabelling {score:.2f}; '
                 f'{len(truth)} users who trained)', fontsize=8)
    ax.set_xlabel(f'assigned {group_noun} group')
    ax.set_ylabel(f'ground-truth {group_noun} group')
    ax.set_xticks(range(k))
    ax.set_yticks(range(k))
    ax.tick_params(labelsize=6 if k > 10 else 8)
  fig.suptitle(f'FedEmbed, {label}, balanced, no DP', fontsize=9)
  fig.tight_layout()
  return figures.save(fig, os.path.join(out, f'fedembed_confusion{suffix}.png'))


def _tsne_figure(root, out) -> Optional[str]:
  """Figure 4: t-SNE of personal embeddings, with and without the k-way
  head (balanced MNIST, no DP)."""
  panels = [(title, z['embedding'][z['trained']][:2000],
             z['subpopulation'][z['trained']][:2000])
            for title, pattern in (
                ('with k-way head', 'dp=none_population=balanced-*'),
                ('without k-way head',
                 'dp=none_population=balanced_type_head=False-*'))
            for z in _analyses(root, 'fedembed_type', pattern)
            if 'embedding' in z]
  if len(panels) != 2:
    return None
  fig, axes = figures.pyplot().subplots(1, 2, figsize=(11, 5))
  for ax, (title, emb, labels) in zip(axes, panels):
    xy = figures.map_2d(emb)
    sc = ax.scatter(xy[:, 0], xy[:, 1], c=labels, cmap='tab10', s=5)
    ax.set_title(f'FedEmbed-Type {title}\n(5-NN purity '
                 f'{embedding_purity.knn_purity(emb, labels):.2f}, '
                 f'{len(emb)} users)')
  fig.colorbar(sc, ax=axes, label='sub-population (digit)')
  return figures.save(fig, os.path.join(out, 'fedembed_embeddings_tsne.png'))
