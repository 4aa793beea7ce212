"""The benchmark's family rows: each algorithm family on its own task.

Each row is one run of `binaries.train` (the run path users run) in a
subprocess, once sharded (`--simulation_shards=-1`), once one user per
TFF client (`--simulation_shards=0`) and, for a family with a batched form,
once batched (`--simulation_batched`), on the same task, cohort and rounds.
Rates come from the run's `train_metrics.csv` (`round_seconds`,
`train/num_examples`) of the stage that does the family's federated
training, over its rounds 2 and later (round 1 includes tracing):

  family   task                stage timed
  ditto    label_skew_mnist    the run
  feddva   marked_mnist        'pretrain' (the dual VAE)
  fedperc  tv_shows            the run (a tiny random-weight GPT-2 written
                               by `tiny_backbone`: real data, no
                               pretrained weights are needed)
  groupfl  shakespeare_groups  'fl' (FedAvg over every client)
  furl     speaker_context     the run

Used by `binaries/benchmark.py` (`--families`).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import subprocess
import sys
from typing import Optional, Sequence

FORMS = {'sharded': -1, 'per_client': 0, 'batched': -1}


@dataclasses.dataclass(frozen=True)
class Family:
  """One family row: what `binaries.train` runs and which stage is timed."""
  algorithm: str
  task: str
  data_subdir: str  # Under the shared data directory.
  clients_per_round: int
  flags: tuple[str, ...] = ()
  stage: Optional[str] = None  # None: the run itself.
  rounds_flag: str = 'rounds'  # Or an algorithm option naming the stage's.
  batched: bool = False  # It also runs batched (`--simulation_batched`).

  def forms(self) -> tuple[str, ...]:
    return tuple(f for f in FORMS if f != 'batched' or self.batched)


FAMILIES = {
    'ditto': Family('ditto', 'label_skew_mnist', 'mnist', 10, batched=True),
    'feddva': Family('feddva', 'marked_mnist', 'mnist', 4,
                     stage='pretrain', rounds_flag='pretrain_rounds'),
    'fedperc': Family('fedperc', 'tv_shows', '', 10, batched=True),
    'groupfl': Family('groupfl', 'shakespeare_groups', '', 20,
                      flags=('--task_options=max_clients=400',),
                      stage='fl', rounds_flag='fl_rounds', batched=True),
    'furl': Family('furl', 'speaker_context', '', 20),
}

TINY_BACKBONE = dict(num_layers=2, num_heads=2, hidden_dim=32,
                     intermediate_dim=64, max_sequence_length=32, seed=0)
TINY_VOCABULARY = 600


def tiny_backbone(data_dir: str, preset_dir: str) -> str:
  """Writes (once) a random-weight GPT-2 preset whose BPE tokenizer is
  trained on the task's own utterances; returns its directory."""
  # pylint: disable=g-import-not-at-top
  from tasks import tv_shows
  from tff_personal.models import bpe_trainer
  from tff_personal.models import fedperc_backbone
  # pylint: enable=g-import-not-at-top
  if fedperc_backbone.has_random_weights(preset_dir):
    return preset_dir
  texts = [t for ts in tv_shows.load_sentences(data_dir).values() for t in ts]
  vocabulary, merges = bpe_trainer.train_bpe(texts, TINY_VOCABULARY)
  fedperc_backbone.write_random_preset(
      vocabulary, merges, preset_dir,
      note='The benchmark\'s tiny backbone: time measurements only.',
      **TINY_BACKBONE)
  return preset_dir


def train_command(family: Family, form: str, rounds: int, data_dir: str,
                  output_dir: str, backbone: Optional[str] = None,
                  python: str = sys.executable) -> list[str]:
  """The `binaries.train` command of one (family, form) run, in its own
  root (`form_root`), so that no form reuses a stage another trained."""
  name = f'{family.algorithm}_{form}'
  cmd = [python, '-m', 'binaries.train', f'--task={family.task}',
         f'--algorithm={family.algorithm}',
         f'--data_dir={os.path.join(data_dir, family.data_subdir)}'.rstrip(
             '/'),
         f'--clients_per_round={family.clients_per_round}',
         f'--simulation_shards={FORMS[form]}', '--eval_clients=1',
         '--checkpoint_every=1000000',
         f'--root_output_dir={form_root(output_dir, family, form)}',
         f'--experiment_name={name}', *family.flags]
  if form == 'batched':
    cmd.append('--simulation_batched')
  if family.rounds_flag == 'rounds':
    cmd.append(f'--rounds={rounds}')
  else:  # The timed stage's rounds; the last stage runs one round.
    cmd += ['--rounds=1', f'--algorithm_options={family.rounds_flag}={rounds}']
  if backbone:
    cmd.append(f'--task_options=backbone={backbone},'
               'allow_random_backbone=True')
  return cmd


def form_root(output_dir: str, family: Family, form: str) -> str:
  """The root output directory of one (family, form) run. Runs of one
  algorithm share a finished stage within a root (`shared_stages/`), so
  each form has its own: the timed stage is trained by the form timed."""
  return os.path.join(output_dir, family.algorithm, form)


def timed_metrics(experiment_dir: str, stage: Optional[str]) -> str:
  """The train_metrics.csv of the timed stage."""
  if stage is None:
    return os.path.join(experiment_dir, 'train_metrics.csv')
  return os.path.join(experiment_dir, 'stages', stage, 'train_metrics.csv')


def rates(metrics_csv: str) -> dict[str, float]:
  """Steady-state rates of a run from its train_metrics.csv (rounds 2+)."""
  with open(metrics_csv) as f:
    rows = sorted(csv.DictReader(f), key=lambda r: int(r['round']))
  if len(rows) < 2:
    raise ValueError(f'{metrics_csv}: fewer than 2 rounds')
  steady = rows[1:]
  seconds = sum(float(r['round_seconds']) for r in steady) / len(steady)
  clients = sum(float(r['cohort_size']) for r in steady) / len(steady)
  examples = [float(r['train/num_examples']) for r in steady
              if r.get('train/num_examples')]
  out = dict(seconds_per_round=seconds, client_updates_per_s=clients / seconds,
             first_round_s=float(rows[0]['round_seconds']),
             rounds=len(rows))
  if examples:
    out['examples_per_s'] = sum(examples) / len(examples) / seconds
  return out


def run(names: Sequence[str], rounds: int, data_dir: str, output_dir: str,
        timeout_s: float, log=print) -> list[dict]:
  """Runs every (family, form) and returns the benchmark's records."""
  records = []
  backbone = None
  if 'fedperc' in names:
    backbone = tiny_backbone(data_dir, os.path.join(output_dir,
                                                     'tiny_backbone'))
  for name in names:
    family = FAMILIES[name]
    for form in family.forms():
      cmd = train_command(family, form, rounds, data_dir, output_dir,
                          backbone if family.task == 'tv_shows' else None)
      log(f'{name} on {family.task}, {form}: {" ".join(cmd[1:])}')
      done = subprocess.run(cmd, capture_output=True, text=True,
                            timeout=timeout_s, check=False)
      exp_dir = os.path.join(form_root(output_dir, family, form),
                             f'{family.algorithm}_{form}')
      path = timed_metrics(exp_dir, family.stage)
      if done.returncode != 0 or not os.path.exists(path):
        log(f'  failed: {done.stderr[-2000:]}')
        continue
      with open(os.path.join(exp_dir, 'summary.json')) as f:
        shards = json.load(f).get('simulation_shards')
      record = dict(name=family.algorithm, workload=family.task, form=form,
                    cohort=family.clients_per_round,
                    stage=family.stage or '', simulation_shards=shards,
                    **rates(path))
      log(f"  {record['client_updates_per_s']:.2f} client updates/s, "
          f"{record['seconds_per_round']:.3f} s/round")
      records.append(record)
  return records


SCALE_COHORT = 200
SCALE_EMBEDDING = 32


def run_population_scale(populations: Sequence[int], rounds: int,
                         output_dir: str, timeout_s: float, run_sampled,
                         log=print) -> list[dict]:
  """The whole loop at each population: `binaries.train` on the generated
  task (`tasks/synthetic_task.py`), `global_plus` with a 32-float personal
  embedding per user, the SQLite store, cohort 200, sharded.
  `run_sampled(cmd, timeout_s) -> (code, peak tree RSS MiB, stderr)`.
  Records: round time over rounds 2+ and the run's peak RSS."""
  records = []
  for n in populations:
    name = f'synthetic_{n}'
    cmd = [sys.executable, '-m', 'binaries.train', '--task=synthetic',
           f'--num_users={n}', '--algorithm=global_plus',
           f'--embedding_dim={SCALE_EMBEDDING}',
           f'--clients_per_round={SCALE_COHORT}', f'--rounds={rounds}',
           '--client_state_backend=sqlite', '--eval_clients=200',
           f'--root_output_dir={output_dir}', f'--experiment_name={name}']
    log(f'population {n}: {" ".join(cmd[1:])}')
    code, peak, err = run_sampled(cmd, timeout_s)
    path = os.path.join(output_dir, name, 'train_metrics.csv')
    if code != 0 or not os.path.exists(path):
      log(f'  failed: {err}')
      continue
    record = dict(name='global_plus', workload='synthetic', population=n,
                  cohort=SCALE_COHORT, peak_rss_mib=peak, **rates(path))
    log(f"  {record['seconds_per_round']:.3f} s/round, peak RSS {peak:.0f} "
        'MiB')
    records.append(record)
  return records