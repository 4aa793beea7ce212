"""tff_personal: personalized, private federated learning on TFF.

The public surface is this package's names (`__all__`): what a run, a task,
an evaluation, DP and production need. Everything else (the modules of the
layered packages `core`, `models`, `algorithms`, `config`, `records`,
`evaluation`, `run` and `reports`; docs/architecture.md) is the
implementation, importable but free to move; a name or module that moved
raises an error naming its new place (`tff_personal.core.moved`).
docs/usage.md says what is kept stable.

Names load on first use, so `import tff_personal` imports neither
TensorFlow nor TFF until a name is read.

Example:

  import tff_personal as tp

  task = tp.build_task('label_skew_mnist', data_dir='../shared/data/mnist')
  config = tp.ExperimentConfig(algorithm='ditto', rounds=10,
                               clients_per_round=5,
                               root_output_dir='/tmp/out',
                               experiment_name='ditto')
  with tp.local_runtime():
    run = tp.run_experiment(task, config)
    again = tp.Run.open('/tmp/out/ditto').evaluate(
        strategies={'ft': tp.FineTune(epochs=1)})
"""

import importlib
from typing import Any

from tff_personal.core import moved as _moved

_moved.install()

# Public name -> the module that defines it (under the same name unless
# given as 'module:attribute').
_PUBLIC = {
    # Runs: train one, open any, state one as a typed spec.
    'run_experiment': 'tff_personal.run.runs',
    'finished_or_trained': 'tff_personal.run.runs',
    'Run': 'tff_personal.run.runs',
    'RunError': 'tff_personal.run.runs',
    'ExperimentConfig': 'tff_personal.config.experiment',
    'ConfigurationError': 'tff_personal.config.experiment',
    'build_process': 'tff_personal.config.experiment',
    'RunSpec': 'tff_personal.config.run_spec',
    # Evaluation strategies (`Run.evaluate(strategies=...)`).
    'AsTrained': 'tff_personal.config.strategies',
    'FineTune': 'tff_personal.config.strategies',
    'Adapt': 'tff_personal.config.strategies',
    'ColdStart': 'tff_personal.config.strategies',
    'parse_strategy': 'tff_personal.config.strategies:parse',
    # Tasks and algorithms.
    'ClientDataTask': 'tasks.client_data_task',
    'keras_classifier': 'tasks.client_data_task',
    'from_client_arrays': 'tasks.client_data_task',
    'build_task': 'tasks.registry',
    'task_factory': 'tasks.registry',
    'TaskSpec': 'tasks.registry',
    'task_spec': 'tasks.registry:spec',
    'AlgorithmSpec': 'tff_personal.algorithms.registry',
    'algorithm_spec': 'tff_personal.algorithms.registry:spec',
    # Differential privacy.
    'DPConfig': 'tff_personal.core.privacy',
    'build_aggregator': 'tff_personal.core.privacy',
    'compute_epsilon': 'tff_personal.core.privacy',
    # Production: the compiled forms, and a run exported for devices.
    'ProductionForm': 'tff_personal.core.production',
    'NotProductionReadyError': 'tff_personal.core.production',
    'production_form': 'tff_personal.core.production',
    'production_forms': 'tff_personal.core.production',
    'run_map_reduce_round': 'tff_personal.core.production',
    'export_run': 'tff_personal.run.export',
    # The runtime every TFF computation runs in.
    'local_runtime': 'tff_personal.core.runtime',
}

__all__ = sorted(_PUBLIC)


def home(name: str) -> tuple[str, str]:
  """The (module, attribute) a public name is defined as."""
  module, _, attribute = _PUBLIC[name].partition(':')
  return module, attribute or name


def __getattr__(name: str) -> Any:
  if name in _PUBLIC:
    module, attribute = home(name)
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value
  return _moved.missing_attribute(__name__, name)


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(__all__))
