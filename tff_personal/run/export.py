"""Exports a finished run for devices: TF SavedModels a TF-only program loads.

`export_run(task, config, export_dir, client_ids)` reads the run in
`config.experiment_dir` (its record, its last server checkpoint and the
clients' private states committed with it) and writes:

* `device/`: the device program of a round (`production.
  export_device_program`): the serving signature `local_update`, which
  takes the server's broadcast, the client state and the client's
  examples by name, trains once, and returns the upload (`upload_<i>`: the
  round's `MapReduceForm.work` output, clipped under DP; all that may
  leave the device) and the new client state (`state_<i>`: kept on the
  device); `device/broadcast.npz` holds the broadcast of the round after
  the exported one (`broadcast_<i>`: the global model and what the
  aggregator sends, e.g. the DP clip);
* `personalized/<client id>/`: each client's personalized model, the shared
  weights with that client's private state as evaluation uses it
  (`production.export_personalized_model`): the serving signature
  `predict` (`x` -> `prediction`);
* `export.json`: the run (its digest, rounds, whether it finished), its
  privacy (epsilon, delta, noise multiplier, clip, how accounted and what
  epsilon covers), the clients and the signatures (every input and output
  name, with what it is, its dtype and shape).

Every training setting is the run's record's: `config` only says where the
run is, and a training setting of it that differs from the record is
refused (`ExportError`). An unfinished run (killed, or resumed and not yet
done) is refused unless `allow_unfinished`, which export.json records.
`binaries.export` runs it from a run directory. Example:

  record = export.export_run(task, config, '/tmp/export', [0, 1, 2])
  model = tf.saved_model.load('/tmp/export/personalized/0')
  predictions = model.signatures['predict'](x=images)['prediction']
"""

from __future__ import annotations

import os
from typing import Callable, Optional, Sequence

import numpy as np

from tff_personal.config import experiment
from tff_personal.core import process as process_lib
from tff_personal.core import production
from tff_personal.core import stages as stages_lib
from tff_personal.core import training_loop
from tff_personal.evaluation import run_evaluation
from tff_personal.records import run_records
from tff_personal.run import runs

EXPORT_RECORD = 'export.json'
# The server's broadcast of the round after the exported one, in device/.
BROADCAST_FILE = 'broadcast.npz'


class ExportError(ValueError):
  """An export refused as asked: the run has not finished, or a training
  setting given differs from the run's record (the message names it)."""


def export_run(task, config: experiment.ExperimentConfig, export_dir: str,
               client_ids: Sequence[int], batch_size: Optional[int] = None,
               log_fn: Callable[[str], None] = print,
               allow_unfinished: bool = False) -> dict:
  """Writes the run's device program and the clients' personalized models.

  Args:
    task: the run's task.
    config: where the run is (`config.experiment_dir`); its training
      settings must be the run's recorded ones.
    export_dir: where to write (created; existing exports are refused).
    client_ids: the clients whose personalized models to write.
    batch_size: the local batch size the device program batches examples by
      (default: the task's, else the run's recorded --batch_size).
    log_fn: progress lines.
    allow_unfinished: export an unfinished run's newest checkpoint
      (recorded in export.json) instead of refusing it.

  Returns:
    The record written to `export_dir/export.json`.

  Raises:
    ExportError: a training setting of `config` differs from the run's
      record, or the run has not finished (and not `allow_unfinished`).
    runs.RunError: `config.experiment_dir` holds no run record.
    training_loop.CheckpointError: the run has no trained checkpoint, or
      its record of rounds started is missing or inconsistent.
    client_state_lib.ClientStateStoreError: its store is not at that round.
    ValueError: a client id outside the population, or `export_dir` exists.
  """
  if os.path.exists(export_dir):
    raise ValueError(f'{export_dir} exists; export to a new directory')
  run = runs.Run.open(config.experiment_dir, task=task)
  check_config(run, config, task.population)
  config = run.config
  rounds = training_loop.completed_round(config.experiment_dir)
  if not rounds:
    raise training_loop.CheckpointError(
        f'{config.experiment_dir} has no checkpoint of a trained round')
  finished = (run.summary or {}).get('rounds_completed') == rounds
  if not finished and not allow_unfinished:
    raise ExportError(
        f'{config.experiment_dir} has not finished: its newest checkpoint is '
        f'of round {rounds} (of {config.rounds}), and its summary.json '
        f'{"records no such round" if run.summary else "does not exist"}. '
        'Resume it first, or export that round on purpose with '
        '--allow_unfinished (export.json records it).')
  if not finished:
    log_fn(f'exporting the unfinished run {config.experiment_dir} at round '
           f'{rounds} (allow_unfinished)')
  batch_size = batch_size or recorded_batch_size(run, task)
  privacy_record = export_privacy(run.privacy_report(), config)
  proc, rounds, state, states = final_state_and_client_states(
      task, config, client_ids, rounds)
  weights = proc.get_model_weights(state)
  form = production.production_form(proc)
  device_dir = os.path.join(export_dir, 'device')
  signature = production.export_device_program(form, device_dir, batch_size)
  np.savez(os.path.join(device_dir, BROADCAST_FILE),
           **production.broadcast_inputs(
               form, form.map_reduce_form().prepare(state)))
  log_fn(f'device program: {device_dir}')
  model_fn = proc.eval_model_fn or proc.model_fn
  eval_states = process_lib.eval_client_states(proc, weights, states)
  for cid, client_state in zip(client_ids, eval_states):
    path = os.path.join(export_dir, 'personalized', str(cid))
    production.export_personalized_model(
        model_fn, weights, client_state[process_lib.CLIENT_STATE_PRIVATE],
        path)
    log_fn(f'client {cid}: {path}')
  record = {
      'experiment_dir': config.experiment_dir,
      'digest': run.digest,
      'algorithm': config.algorithm,
      'task': getattr(task, 'name', type(task).__name__),
      'round': rounds,
      'rounds_planned': config.rounds,
      'finished': finished,
      'allow_unfinished': bool(allow_unfinished),
      'privacy': privacy_record,
      'clients': list(client_ids),
      'batch_size': batch_size,
      'device': {
          'path': 'device',
          'signature': production.DEVICE_SIGNATURE,
          'broadcast': f'device/{BROADCAST_FILE}',
          'inputs': signature['inputs'],
          'outputs': signature['outputs'],
          'uploads': 'upload_<i> only; state_<i> stays on the device'},
      'personalized': {
          'path': 'personalized/<client id>',
          'signature': production.PREDICT_SIGNATURE,
          'inputs': {'x': 'the examples\' x, batched'},
          'outputs': {'prediction': 'what evaluation reports per example'}},
  }
  training_loop.write_summary(os.path.join(export_dir, EXPORT_RECORD), record)
  return record


def check_config(run: runs.Run, config: experiment.ExperimentConfig,
                 population: int) -> None:
  """Refuses a `config` whose training settings differ from `run`'s record
  (what a resume may change, `run_records.RESUMABLE_FIELDS`, is not
  compared), naming each difference."""
  dp = experiment.validate(config, population)
  lines = run_records.differences(
      run.record.get('config', {}),
      run_records.run_record(config, dp, None)['config'])
  if lines:
    raise ExportError(
        f'{run.directory} was trained with other settings '
        f'({run_records.RUN_CONFIG_FILENAME}): ' + '; '.join(lines) +
        '. An export takes every training setting from the run.')


def recorded_batch_size(run: runs.Run, task) -> int:
  """The local batch size of `run`: its task's, else its recorded
  --batch_size."""
  size = getattr(task, 'batch_size', None) or (
      run.record.get('task') or {}).get('arguments', {}).get('batch_size') or (
          run.record.get('flags') or {}).get('batch_size')
  if not size:
    raise ExportError(f'{run.directory}: neither the task nor the run\'s '
                      'record gives a local batch size; pass batch_size')
  return int(size)


def export_privacy(report: Optional[dict],
                   config: experiment.ExperimentConfig) -> dict:
  """export.json's `privacy`: the run's (epsilon, delta) for the rounds it
  noised (replays included), the noise multiplier and clip, how it was
  accounted, and what epsilon covers in the export."""
  if report is None:
    return {'mechanism': 'none', 'epsilon': None, 'delta': None,
            'noise_multiplier': None, 'clip_norm': None,
            'covers': 'nothing: the run trained without differential '
                      'privacy'}
  out = {k: report.get(k) for k in (
      'mechanism', 'epsilon', 'delta', 'noise_multiplier', 'clip_norm',
      'accountant', 'neighboring_relation', 'sampling', 'clients_per_round',
      'population', 'rounds_noised', 'rounds_completed')}
  out['covers'] = (
      'the shared weights in device/ and personalized/: trained from the '
      'noised aggregates of rounds_noised rounds (replays after a kill '
      'included), accounted by the accountant for one user\'s whole data')
  heads = report.get('personal_heads')
  out['not_covered'] = (
      'each personalized/<client id> model holds that client\'s private '
      'state, which is never noised' + (
          '' if config.dp_personal_heads != 'noised' else
          ' but for its personal head, bounded by personal_heads.epsilon') +
      ': exporting it releases the state to whoever receives the model')
  if heads is not None:
    out['personal_heads'] = {k: heads.get(k) for k in ('epsilon', 'delta',
                                                       'passes')}
  return out


def final_weights_and_states(task, config: experiment.ExperimentConfig,
                             client_ids: Sequence[int],
                             rounds: Optional[int] = None):
  """A run's last-stage process, round `rounds` (default: its newest
  checkpoint's), shared weights and the states of `client_ids` committed
  with them (read only).

  Returns:
    `(process, round, ModelWeights, [client state])`.
  """
  proc, rounds, state, states = final_state_and_client_states(
      task, config, client_ids, rounds)
  return proc, rounds, proc.get_model_weights(state), states


def final_state_and_client_states(task, config: experiment.ExperimentConfig,
                                  client_ids: Sequence[int],
                                  rounds: Optional[int] = None):
  """As `final_weights_and_states`, with the whole server state.

  Returns:
    `(process, round, server state, [client state])`.
  """
  population = task.population
  bad = [c for c in client_ids if not 0 <= c < population]
  if bad or not client_ids:
    raise ValueError(f'client ids must be in [0, population={population}) '
                     f'and at least one; got {list(client_ids)}')
  proc = stages_lib.final_process(experiment.build_process(task, config))
  rounds = rounds or training_loop.completed_round(config.experiment_dir)
  if not rounds:
    raise training_loop.CheckpointError(
        f'{config.experiment_dir} has no checkpoint of a trained round')
  state = training_loop.load_checkpoint(proc, config.experiment_dir, rounds)
  store = run_evaluation.open_committed_store(proc, config, population,
                                              config.experiment_dir, rounds)
  try:
    states = store.load(list(client_ids))
  finally:
    store.close()
  return proc, rounds, state, states
