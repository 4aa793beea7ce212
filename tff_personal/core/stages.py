"""Multi-stage algorithms: processes run one after another by the one loop.

A multi-stage algorithm's builder (e.g. FedDVA: the dual VAE, then a
classifier on its encoders) returns a `Staged`: its stages in order. The run
path (`experiment.run_experiment`) drives each stage with the same loop
(`training_loop.run_training`) in its own directory (checkpoints and
client-state store under `<experiment>/stages/<name>/`), and starts each
stage from the previous stage's final server state through the stage's
`handoff`, which moves weights with `get_model_weights` /
`set_model_weights`. The last stage is the algorithm's result: the
experiment's `rounds`, evaluation and summary are its; the earlier stages'
rounds count in the privacy accounting (every stage's shared update goes
through the run's aggregator, DP included).

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
  """
  name: str
  process: Any
  rounds: int = 0
  handoff: Optional[Callable[[Any], Any]] = None


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
    for stage in self.stages[1:]:
      if stage.handoff is None:
        raise ValueError(f'stage {stage.name!r} needs a handoff from the '
                         'stage before it')

  @property
  def final(self):
    """The last stage's process: the one evaluated and reported."""
    return self.stages[-1].process

  @property
  def earlier(self) -> tuple[Stage, ...]:
    return self.stages[:-1]

  @property
  def earlier_rounds(self) -> int:
    return sum(s.rounds for s in self.earlier)


def final_process(built):
  """`built`'s evaluated process: itself, or a `Staged`'s last stage's."""
  return built.final if isinstance(built, Staged) else built
