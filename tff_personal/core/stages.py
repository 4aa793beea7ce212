"""Multi-stage algorithms: processes run one after another by the one loop.

A multi-stage algorithm's builder (e.g. FedDVA: the dual VAE, then a
classifier on its encoders) returns a `Staged`: its stages in order. The run
path (`runs.run_experiment`) drives each stage with the same loop
(`training_loop.run_training`) in its own directory (checkpoints and
client-state store under `<experiment>/stages/<name>/`), and starts each
stage from the previous stage's final server state through the stage's
`handoff`, which moves weights with `get_model_weights` /
`set_model_weights`. The last stage is the algorithm's result: the
experiment's `rounds`, evaluation and summary are its; the earlier stages'
rounds count in the privacy accounting (every stage's shared update goes
through the run's aggregator, DP included).

A stage may run *per group* (`per_group=True`, the last stage only; the
task needs the `groups` capability): then it is one independent run of its
process per group of the task, each from the previous stage's state (through
the handoff), sampling its cohorts among the group's clients only, in
`<experiment>/groups/<group>/` (checkpoints, store, metrics, resumed on its
own). Evaluation tests each client with its own group's model. This is
Group Personalized FL's Algorithm 2: a group's run is a plain FL run, so its
DP accounting is that of a run over the group's clients (a user belongs to
one group and so to one run of the stage).

Example:

  staged = stages.Staged((
      stages.Stage('pretrain', vae_process, rounds=30),
      stages.Stage('classifier', classifier_process,
                   handoff=lambda vae_state: with_encoders(...))))
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional


@dataclasses.dataclass(frozen=True)
class Stage:
  """One stage of a multi-stage algorithm.

  Attributes:
    name: a directory name (`stages/<name>/`) and log prefix.
    process: the stage's `StatefulClientProcess`.
    rounds: rounds of an earlier stage (the last stage runs the
      experiment's rounds; its `rounds` is ignored).
    handoff: `previous stage's final server state -> this stage's initial
      server state`; None for the first stage (its `initialize()`).
    per_group: run the stage once per group of the task, each run among
      the group's clients only (module docstring); the last stage only.
    clients_per_round: the stage's cohort (0: the experiment's). Under DP
      every stage takes the experiment's (one aggregator, one accounting).
    grouping: the groups of a per-group stage: 'task' (the task's
      `groups`), 'shuffled' (groups of the same sizes with members drawn
      at random by the run's seed: a control) or 'one' (a single group of
      every client: FL continued, a control).
    shared_as: for an earlier stage whose run is fully determined by the
      experiment's training settings (task, optimizers, aggregator and DP,
      seed, sampling), its cohort, its rounds and this name of its process
      (e.g. 'fedavg_global'): runs under the same root that agree on all
      of them share one run of the stage (`<root>/shared_stages/`), so
      GroupFL, GroupPerFL and their controls train their FL stage once.
      Empty: the stage is the experiment's own.
  """
  name: str
  process: Any
  rounds: int = 0
  handoff: Optional[Callable[[Any], Any]] = None
  per_group: bool = False
  clients_per_round: int = 0
  grouping: str = 'task'
  shared_as: str = ''

  def __post_init__(self):
    if self.grouping not in GROUPINGS:
      raise ValueError(f'stage {self.name!r}: grouping must be one of '
                       f'{GROUPINGS}, got {self.grouping!r}')
    if self.clients_per_round < 0:
      raise ValueError(f'stage {self.name!r}: clients_per_round must be >= 0'
                       f', got {self.clients_per_round}')


GROUPINGS = ('task', 'shuffled', 'one')


@dataclasses.dataclass(frozen=True)
class Staged:
  """The stages of a multi-stage algorithm, in order (at least two)."""
  stages: tuple[Stage, ...]

  def __post_init__(self):
    if len(self.stages) < 2:
      raise ValueError('a multi-stage algorithm has at least two stages')
    names = [s.name for s in self.stages]
    if len(set(names)) != len(names):
      raise ValueError(f'stage names must be distinct, got {names}')
    for stage in self.stages[:-1]:
      if stage.rounds < 1:
        raise ValueError(f'stage {stage.name!r} needs rounds >= 1, got '
                         f'{stage.rounds}')
    if self.stages[-1].shared_as:
      raise ValueError(f'stage {self.stages[-1].name!r}: only an earlier '
                       'stage can be shared')
    for stage in self.stages[:-1]:
      if stage.per_group:
        raise ValueError(f'stage {stage.name!r}: only the last stage can run '
                         'per group')
    for stage in self.stages[1:]:
      if stage.handoff is None:
        raise ValueError(f'stage {stage.name!r} needs a handoff from the '
                         'stage before it')

  @property
  def final(self):
    """The last stage's process: the one evaluated and reported."""
    return self.stages[-1].process

  @property
  def per_group(self) -> bool:
    """Whether the last stage runs once per group of the task."""
    return self.stages[-1].per_group

  @property
  def earlier(self) -> tuple[Stage, ...]:
    return self.stages[:-1]

  @property
  def earlier_rounds(self) -> int:
    return sum(s.rounds for s in self.earlier)


def final_process(built):
  """`built`'s evaluated process: itself, or a `Staged`'s last stage's."""
  return built.final if isinstance(built, Staged) else built
