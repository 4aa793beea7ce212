"""Exports a finished run for devices: TF SavedModels a TF-only program loads.

`export_run(task, config, export_dir, client_ids)` reads the run's last
server checkpoint and the clients' private states committed with it, and
writes:

* `device/`: the device's part of a round (`production.
  export_device_update`): `local_update(trainable, non_trainable, private,
  rounds_participated, examples)`, the process's own client step;
* `personalized/<client id>/`: each client's personalized model, the shared
  weights with that client's private state as evaluation uses it
  (`production.export_personalized_model`): `predict(x)`;
* `export.json`: the run, the round, the clients and the signatures.

`binaries.export` runs it from the run's flags. Example:

  record = export.export_run(task, config, '/tmp/export', [0, 1, 2])
  model = tf.saved_model.load('/tmp/export/personalized/0')
  predictions = model.predict(images)
"""

from __future__ import annotations

import os
from typing import Callable, Sequence

from tff_personal import experiment
from tff_personal import run_evaluation
from tff_personal.core import process as process_lib
from tff_personal.core import production
from tff_personal.core import stages as stages_lib
from tff_personal.core import training_loop

EXPORT_RECORD = 'export.json'


def export_run(task, config: experiment.ExperimentConfig, export_dir: str,
               client_ids: Sequence[int], batch_size: int,
               log_fn: Callable[[str], None] = print) -> dict:
  """Writes the run's device part and the clients' personalized models.

  Args:
    task: the run's task.
    config: the run's configuration (its recorded settings).
    export_dir: where to write (created; existing exports are refused).
    client_ids: the clients whose personalized models to write.
    batch_size: the local batch size the device part batches examples by.
    log_fn: progress lines.

  Returns:
    The record written to `export_dir/export.json`.

  Raises:
    training_loop.CheckpointError: the run has no trained checkpoint.
    client_state_lib.ClientStateStoreError: its store is not at that round.
    ValueError: a client id outside the population, or `export_dir` exists.
  """
  if os.path.exists(export_dir):
    raise ValueError(f'{export_dir} exists; export to a new directory')
  proc, rounds, weights, states = final_weights_and_states(
      task, config, client_ids)
  form = production.production_form(proc)
  production.export_device_update(form, os.path.join(export_dir, 'device'),
                                  batch_size)
  log_fn(f'device part: {os.path.join(export_dir, "device")}')
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
      'algorithm': config.algorithm,
      'task': getattr(task, 'name', type(task).__name__),
      'round': rounds,
      'clients': list(client_ids),
      'batch_size': batch_size,
      'device': {
          'path': 'device',
          'signature': 'local_update(trainable, non_trainable, private, '
                       'rounds_participated, examples) -> {update, '
                       'update_weight, private, rounds_participated, '
                       'metrics}'},
      'personalized': {
          'path': 'personalized/<client id>',
          'signature': 'predict(x) -> the prediction evaluation reports'},
  }
  training_loop.write_summary(os.path.join(export_dir, EXPORT_RECORD), record)
  return record


def final_weights_and_states(task, config: experiment.ExperimentConfig,
                             client_ids: Sequence[int]):
  """A finished run's last-stage process, last round, shared weights and
  the states of `client_ids` committed with them (read only).

  Returns:
    `(process, round, ModelWeights, [client state])`.
  """
  population = task.population
  bad = [c for c in client_ids if not 0 <= c < population]
  if bad or not client_ids:
    raise ValueError(f'client ids must be in [0, population={population}) '
                     f'and at least one; got {list(client_ids)}')
  proc = stages_lib.final_process(experiment.build_process(task, config))
  rounds = training_loop.completed_round(config.experiment_dir)
  if not rounds:
    raise training_loop.CheckpointError(
        f'{config.experiment_dir} has no checkpoint of a trained round')
  state = training_loop.load_checkpoint(proc, config.experiment_dir, rounds)
  weights = proc.get_model_weights(state)
  store = run_evaluation.open_committed_store(proc, config, population,
                                              config.experiment_dir, rounds)
  try:
    states = store.load(list(client_ids))
  finally:
    store.close()
  return proc, rounds, weights, states
