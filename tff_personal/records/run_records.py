"""A run's records: its configuration as started, the checks a resume or a
re-evaluation makes against it, and the run directory's lock.

`run_config.json` holds the configuration (DP as resolved), the binary's
flags and how the task was built; `check_or_record_run_config` writes it
for a new run and refuses to resume under another configuration.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any, Optional

from tff_personal.config import experiment
from tff_personal.core import atomic_io
from tff_personal.core import client_state as client_state_lib
from tff_personal.core import privacy
from tff_personal.core import runtime
from tff_personal.core import training_loop
from tff_personal.records import run_lock


def holding_lock(create: bool):
  """Decorates `fn(task, config, ...)` to run holding the lock of
  `config.experiment_dir` (`run_lock.hold(..., create)`).

  The decorated function raises `run_lock.ExperimentLockedError`, before
  doing anything, when another process holds the lock. A run refused for
  its configuration (a `ValueError` before any work) leaves no directory it
  created behind.
  """
  def decorate(fn):
    @functools.wraps(fn)
    def holding(task, config, *args, **kwargs):
      existed = os.path.exists(config.experiment_dir)
      try:
        with run_lock.hold(config.experiment_dir, create=create):
          return fn(task, config, *args, **kwargs)
      except ValueError:
        if not existed:
          run_lock.remove_if_unused(config.experiment_dir)
        raise
    return holding
  return decorate


def finished_summary(config: experiment.ExperimentConfig) -> Optional[dict]:
  """summary.json of a resumed run that already finished `config.rounds`.

  None unless `config.resume`, the last checkpoint is of round
  `config.rounds` and summary.json records that round: then resuming has
  nothing to run, and the summary is returned as it is.
  """
  path = os.path.join(config.experiment_dir, 'summary.json')
  if not config.resume or not os.path.exists(path):
    return None
  rounds = training_loop.checkpoint_rounds(config.experiment_dir)
  if not rounds or rounds[-1] != config.rounds:
    return None
  summary = read_json_record(path, ResumeError)
  if summary.get('rounds_completed') != config.rounds:
    return None
  return summary


def check_rounds_not_below_completed(
    config: experiment.ExperimentConfig) -> None:
  """Checks a resume's records, and refuses fewer `rounds` than completed.

  Every run directory (the experiment's, each earlier stage's and each
  group's) must pass `training_loop.check_records` (the rounds-started
  record epsilon accounts; checkpoints that hold the round they are named
  for), before any client-state store is opened. The rounds that ran cannot
  be undone (their noise is spent, their client states are saved); a
  shorter resume would report fewer. Raises `training_loop.CheckpointError`
  or `ResumeError` before anything is written.
  """
  if not config.resume:
    return
  groups_dir = os.path.join(config.experiment_dir, experiment.GROUPS_DIRNAME)
  stages_dir = os.path.join(config.experiment_dir, 'stages')
  for parent in (stages_dir, groups_dir):  # Each stage's and group's run.
    for name in (sorted(os.listdir(parent)) if os.path.isdir(parent)
                 else ()):
      training_loop.check_records(os.path.join(parent, name))
  training_loop.check_records(config.experiment_dir)
  directories = [config.experiment_dir] + (
      [os.path.join(groups_dir, g) for g in sorted(os.listdir(groups_dir))]
      if os.path.isdir(groups_dir) else [])
  for directory in directories:  # A per-group stage's runs have their own.
    completed = training_loop.completed_round(directory)  # Its contents'.
    if completed is not None and completed > config.rounds:
      raise ResumeError(
          f'{directory} has completed {completed} rounds; '
          f'--rounds={config.rounds} is below that. Rounds that ran cannot be '
          f'undone: resume with --rounds >= {completed}, or re-evaluate the '
          'run with binaries.evaluate. Nothing was changed.')


def check_store_present(config: experiment.ExperimentConfig, population: int,
                        directory: Optional[str] = None) -> None:
  """Refuses to resume checkpoints whose client-state store is gone.

  `directory`: where the checkpoints and the store are (default the
  experiment's; a multi-stage algorithm's earlier stages have their own).

  Opening a missing SQLite database creates an empty one, and a store without
  states loads every client's initial state: the run would continue with
  every user reset. Raises `training_loop.CheckpointError` naming the missing
  file and the round it should hold, before anything is written.
  """
  directory = directory or config.experiment_dir
  rounds = training_loop.checkpoint_rounds(directory)
  if not config.resume or not rounds or rounds[-1] == 0:
    return
  missing = client_state_lib.missing_store(
      config.client_state_backend, os.path.join(directory, 'client_states'),
      population)
  if missing is not None:
    raise training_loop.CheckpointError(
        f'the client-state store {missing} is missing or empty, but the '
        f'server checkpoints of {directory} reach round '
        f'{rounds[-1]}: the store should hold the client states committed at '
        f'round {rounds[-1]} (or at an earlier checkpoint of {rounds}). '
        'Resuming would reset every client to its initial state. Restore the '
        'store (with the run\'s own --client_state_backend), or start a new '
        '--experiment_name. Nothing was changed.')


RUN_CONFIG_FILENAME = 'run_config.json'


# Config fields that only shape evaluation: a re-evaluation
# (`evaluate_experiment`) may change them.
EVALUATION_FIELDS = ('eval_clients', 'curve_eval_clients', 'eval_chunk',
                     'eval_fine_tune', 'test_fine_tune', 'cold_start_epochs',
                     'eval_strategies')


# What a resumed run may change: the evaluation fields, how the simulation
# runs and where the run lives (config fields and runtime flags), and
# `rounds` (to extend or shorten it; the noise multiplier is compared as
# resolved, so a DP run calibrated to a target epsilon for other rounds is
# refused, while one with a given noise multiplier may be extended and is
# accounted for all its rounds at that multiplier).
RESUMABLE_FIELDS = EVALUATION_FIELDS + (
    'simulation_shards', 'simulation_batched', 'simulation_batch_users',
    'simulation_round',
    'simulation_inprocess',  # Retired (simulation_round); in older records.
    'eval_every',
    'checkpoint_every', 'keep_checkpoints',
    'resume', 'rounds',
    'root_output_dir', 'experiment_name', 'use_gpu', 'workers',
    'intra_op_threads', 'inter_op_threads', 'verify_data_checksums')


# Config fields added after runs were recorded without them, and the value
# every such run had: a record lacking one is read with it, and a run at
# that value keeps the identity (`runs.digest`) it had before the field.
LEGACY_VALUES = {'personal_init': 'normal', 'private_optimizer': 'adam'}


def with_legacy_values(config: dict) -> dict:
  """A recorded config with the fields it predates at their legacy value."""
  return {**LEGACY_VALUES, **config}


class ResumeError(training_loop.CheckpointError):
  """A run would resume under another configuration than it started with."""


def read_json_record(path: str, error=ValueError) -> dict:
  """The JSON object in `path` (e.g. summary.json, run_config.json).

  Raises `error` naming the file when it cannot be read or does not hold a
  JSON object (e.g. it was edited by hand or cut short).
  """
  try:
    value = atomic_io.read_json(path)
  except ValueError as e:
    raise error(str(e)) from e.__cause__
  if not isinstance(value, dict):
    raise error(f'{path} is not valid JSON for this file: it holds a '
                f'{type(value).__name__}, not an object. Nothing was '
                'changed.')
  return value


def as_json(value):
  """`value` as it reads back from JSON (tuples as lists, numpy as Python)."""
  return json.loads(json.dumps(value, default=training_loop._json_default))  # pylint: disable=protected-access


def flat_flags(grouped: Optional[dict[str, Any]]) -> dict[str, Any]:
  """Flag name -> value from summary.json's grouped flags."""
  flat = {}
  for group in (grouped or {}).values():
    if isinstance(group, dict):
      flat.update(group)
  return flat


def run_record(config: experiment.ExperimentConfig, dp: privacy.DPConfig,
               flag_values: Optional[dict[str, Any]],
               task_record: Optional[dict] = None) -> dict:
  """run_config.json's content: the config with DP as resolved, the flags,
  the TensorFlow thread pools it computes with (`runtime.thread_settings`;
  not part of its identity) and how the task was built
  (`task.build_record`) where known."""
  record = dataclasses.asdict(config)
  record['dp'] = {k: v for k, v in dataclasses.asdict(dp).items()
                  if k != 'rounds'}
  out = {'config': record, 'flags': flat_flags(flag_values),
         'threads': runtime.thread_settings()}
  if task_record is not None:
    out['task'] = task_record
  return as_json(out)


def differences(old: dict, new: dict, prefix: str = '',
                ignore=RESUMABLE_FIELDS) -> list[str]:
  lines = []
  for name in sorted(set(old) & set(new)):
    if name in ignore:
      continue
    a, b = old[name], new[name]
    if isinstance(a, dict) and isinstance(b, dict):
      lines += differences(a, b, f'{prefix}{name}.', ignore)
    elif json.dumps(a, sort_keys=True, default=str) != json.dumps(
        b, sort_keys=True, default=str):
      lines.append(f'{prefix}{name}: {a!r} when the run started, {b!r} now')
  return lines


def flag_differences(recorded: dict[str, Any], current: dict[str, Any],
                     ignore) -> list[str]:
  """`--name: ...` lines for grouped flags (summary.json's) that differ,
  but those in `ignore`; flags one side lacks are not compared."""
  return differences(flat_flags(recorded), flat_flags(as_json(current)),
                     '--', ignore)


def check_or_record_run_config(config: experiment.ExperimentConfig,
                               dp: privacy.DPConfig,
                               flag_values: Optional[dict[str, Any]] = None,
                               task_record: Optional[dict] = None) -> None:
  """Records a new run's configuration; refuses to resume under another.

  A run that has no checkpoint yet writes `run_config.json` (the config, the
  resolved DP config and the flags). Resuming (`config.resume` with
  checkpoints) compares against it everything but `RESUMABLE_FIELDS`, so
  that a resumed run is the run that started: e.g. another learning rate,
  client-state backend or a DP noise multiplier re-calibrated for other
  rounds (rounds 1..r noised at one multiplier and reported at another
  would under-report epsilon) raise `ResumeError` naming each difference,
  before anything is changed. Resuming checkpoints without `run_config.json`
  raises `ResumeError` naming the file.
  """
  path = os.path.join(config.experiment_dir, RUN_CONFIG_FILENAME)
  record = run_record(config, dp, flag_values, task_record)
  stages_dir = os.path.join(config.experiment_dir, 'stages')
  started = training_loop.checkpoint_rounds(config.experiment_dir) or any(
      training_loop.checkpoint_rounds(os.path.join(stages_dir, name))
      for name in (os.listdir(stages_dir) if os.path.isdir(stages_dir)
                   else ()))
  if not started:
    os.makedirs(config.experiment_dir, exist_ok=True)
    training_loop.write_summary(path, record)
    return
  if not config.resume:
    return  # The loop refuses a rerun without resume.
  if not os.path.exists(path):
    raise ResumeError(
        f'{path} is missing: {config.experiment_dir} holds checkpoints, but '
        'without the record of the configuration it started with, a resumed '
        'run cannot be checked to be the same run (another client-state '
        'backend, learning rate or DP noise would go unnoticed). Restore the '
        'file from a backup, or start a new --experiment_name (the '
        'checkpoints can still be re-evaluated once the file is back). '
        'Nothing was changed.')
  old = read_json_record(path, ResumeError)
  lines = (differences(with_legacy_values(old.get('config', {})),
                       record['config']) +
           differences(old.get('flags', {}), record['flags'], '--') +
           differences(old.get('task', {}), record.get('task', {}),
                       'task.', ignore=('data_dir',)))
  if lines:
    raise ResumeError(
        f'{config.experiment_dir} started with another configuration ({path}):'
        '\n  ' + '\n  '.join(lines) + '\nResume with the run\'s own '
        'settings, or start a new --experiment_name. Nothing was changed.')
