"""A training program built from `tff.program` pieces over a production form.

`train(...)` is program logic as TFF's programs are written: it runs in the
local execution context (`runtime.local_runtime()`), keeps the server state
in a program-state manager (`tff.program.FileProgramStateManager`, or
`core/program_state.FileProgramStateManager`, which stores the same), and
releases each round's metrics through a `tff.program.ReleaseManager`
(`CSVFileReleaseManager`, `LoggingReleaseManager`, ...). Each round runs
the production form's `MapReduceForm` piece by piece, each sampled device's
program once (`ProductionForm.run_map_reduce_round`): the upload goes to the
aggregation, and the device's new client state is written back to a
client-state store (`core/client_state.make_store`), which stands for the
devices' own storage.

A round `r`, in order (the store's crash-consistency protocol,
`core/client_state.py`):

1. the cohort `training_loop.sample_clients(population, clients_per_round,
   r, seed)`, a function of (seed, r), and its states from the store;
2. the round; the new client states saved in the store tagged `r`
   (fault point 'mid_round' after it);
3. the metrics released with key `r` (a release manager replaces what was
   released with keys >= r, so a rerun round releases it again);
4. `{'server_state', 'round_num'}` saved as version `r`
   (fault point 'after_checkpoint' after it);
5. the store commits `r`.

Version 0 (the initial state) is saved before round 1. A program started
again on the same directories resumes: it loads the newest version `v`,
rolls the store back to `v` (forgetting saves of later rounds), and runs
rounds `v + 1` onwards, which gives what the uninterrupted program gives
(tests/program_test.py). Written by hand: TFF's `train_model` cannot keep
client state (docs/production.md).

Example:

  with runtime.local_runtime():
    form = production.production_form(process)
    store = client_state.make_store('sqlite', initial_state_fn,
                                    population=100, directory=store_dir)
    program.run(form=form, client_data=lambda cid: datasets[cid],
                population=100, clients_per_round=10, total_rounds=20,
                seed=0, store=store,
                state_manager=tff.program.FileProgramStateManager(ckpt_dir),
                metrics_manager=tff.program.CSVFileReleaseManager(
                    csv_path, key_fieldname='round'))
"""

from __future__ import annotations

from typing import Any, Callable

from absl import logging
import tensorflow as tf
import tensorflow_federated as tff

from tff_personal.core import coroutines
from tff_personal.core import fault
from tff_personal.core import production
from tff_personal.core import training_loop

ClientDataFn = Callable[[int], tf.data.Dataset]


def native_federated_context(rt) -> tff.program.NativeFederatedContext:
  """TFF's program context (`tff.program.NativeFederatedContext`) over the
  execution of `rt`, a `runtime.local_runtime()`: the same worker and
  compiler. `tff.learning.programs.train_model` needs one installed
  (`tff.framework.get_context_stack().install(...)`)."""
  # TFF's sync context runs its own async context, which TFF's program
  # context takes; TFF gives no public handle on it.
  return tff.program.NativeFederatedContext(
      getattr(rt.context, '_async_context', rt.context))


async def train(*, form: production.ProductionForm, client_data: ClientDataFn,
                population: int, clients_per_round: int, total_rounds: int,
                seed: int, store, state_manager, metrics_manager) -> Any:
  """Trains `form` for `total_rounds` rounds, resuming where a previous run
  on the same state manager and store stopped (module docstring).

  Args:
    form: a `production.ProductionForm` (one stage).
    client_data: `client id -> tf.data.Dataset` of the client's batches
      (the same for every round the client is sampled in).
    population: client ids are `0 .. population - 1`.
    clients_per_round: the cohort's size.
    total_rounds: the round to train to.
    seed: the cohorts' seed.
    store: a `client_state.ClientStateStore`: the devices' client states.
    state_manager: a `tff.program.ProgramStateManager` for the server
      state (saved every round).
    metrics_manager: a `tff.program.ReleaseManager` keyed by round.

  Returns:
    The server state after `total_rounds`.
  """
  template = {'server_state': form.initialize(), 'round_num': 0}
  program_state, version = await state_manager.load_latest(template)
  if program_state is None:
    state, start = template['server_state'], 1
    store.rollback(0)
    await state_manager.save(template, 0)
    store.commit(0)
  else:
    state, start = program_state['server_state'], version + 1
    if int(program_state['round_num']) != version:
      raise ValueError(f'program state version {version} holds round '
                       f'{program_state["round_num"]}')
    store.rollback(version)
    logging.info('resuming after round %d', version)
  for round_num in range(start, total_rounds + 1):
    ids = [int(i) for i in training_loop.sample_clients(
        population, clients_per_round, round_num, seed)]
    state, metrics, new_states = form.run_map_reduce_round(
        state, store.load(ids), [client_data(i) for i in ids])
    store.save(ids, [_numpy(s) for s in new_states], round_num)
    fault.point('mid_round')
    await metrics_manager.release(_numpy(metrics), key=round_num)
    await state_manager.save(
        {'server_state': state, 'round_num': round_num}, round_num)
    fault.point('after_checkpoint')
    store.commit(round_num)
  return state


def run(**kwargs) -> Any:
  """`train(**kwargs)` run to completion from synchronous code."""
  return coroutines.run_sync(train(**kwargs))


def _numpy(value):
  """A TFF result (a `Struct` or Python containers) as Python containers
  of NumPy values."""
  if isinstance(value, tff.structure.Struct):
    value = tff.structure.to_odict_or_tuple(value, recursive=True)
  return tf.nest.map_structure(
      lambda v: v.numpy() if isinstance(v, tf.Tensor) else v, value)
