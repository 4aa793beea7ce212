"""Names and modules that moved: reading one raises an error naming its place.

Code written against an earlier layout fails with one line saying where
the name lives now, instead of a bare `AttributeError` or
`ModuleNotFoundError`. The tables below are the only record of moves; a
module that lost names ends with

  __getattr__ = moved.module_getattr(__name__)

and `install()` (called by `import tff_personal`) makes a moved module's
old path raise `MovedModuleError` (an `ImportError`) naming the new one.
Nothing is aliased: the old place never silently gives the new object.

Example:

  from tff_personal.config import experiment
  experiment.run_experiment
  # AttributeError: tff_personal.config.experiment.run_experiment moved to
  # tff_personal.run.runs.run_experiment (public: tff_personal.run_experiment)
"""

import importlib.abc
import sys
from typing import Any, Callable, NoReturn, Optional

# module -> {name: the module it moved to}.
MOVED_NAMES: dict[str, dict[str, str]] = {
    'tff_personal.config.experiment': {
        'run_experiment': 'tff_personal.run.runs',
        'EvaluationError': 'tff_personal.evaluation.run_evaluation',
        'ResumeError': 'tff_personal.records.run_records',
        'check_or_record_run_config': 'tff_personal.records.run_records',
        'curve_eval_ids': 'tff_personal.evaluation.run_evaluation',
        'eval_client_ids': 'tff_personal.evaluation.run_evaluation',
        'evaluate_experiment': 'tff_personal.evaluation.run_evaluation',
        'evaluation_path': 'tff_personal.evaluation.run_evaluation',
        'flag_differences': 'tff_personal.records.run_records',
        'load_client_states': 'tff_personal.evaluation.run_evaluation',
        'read_json_record': 'tff_personal.records.run_records',
        'released_values': 'tff_personal.records.run_privacy',
        'run_privacy_report': 'tff_personal.records.run_privacy',
    },
    'tff_personal.evaluation.run_evaluation': {
        'evaluate_new_users': 'tff_personal.evaluation.new_user_evaluation',
        'format_metrics': 'tff_personal.core.evaluation',
    },
    'tff_personal.reports.reporting': {
        'plot_seed_band': 'tff_personal.reports.curve_bands',
        'seed_band': 'tff_personal.reports.curve_bands',
        'seed_curves': 'tff_personal.reports.curve_bands',
    },
    'tff_personal.core.sharded': {
        'FlatTransport': 'tff_personal.core.flat_transport',
        'ShardedPersonalEval': 'tff_personal.core.sharded_eval',
    },
    'tff_personal.core.privacy': {
        'PreClippedGaussianSumQuery': 'tff_personal.core.sharded_privacy',
        'build_sharded_aggregator': 'tff_personal.core.sharded_privacy',
        'clip_user_update': 'tff_personal.core.sharded_privacy',
    },
    'tff_personal.algorithms.fedperc': {
        'SeededGaussianSumQuery': 'tff_personal.core.new_users',
        'build_dp_mean': 'tff_personal.core.new_users',
        'build_process': 'tff_personal.config.experiment',
        'dp_clip_report': 'tff_personal.core.new_users',
        'dp_mean_epsilon': 'tff_personal.core.new_users',
        'ROLE': 'tff_personal.models.fedperc',
        'ROLE_FINE_TUNE': 'tff_personal.models.fedperc',
        'ROLE_TEST': 'tff_personal.models.fedperc',
        'eval_batch_spec': 'tff_personal.models.fedperc',
    },
    'tff_personal.models.word_lm': {
        'pooled_perplexity': 'tff_personal.core.evaluation',
    },
    'tasks.registry': {
        'matrix': 'tff_personal.config.matrix',
        'format_matrix': 'tff_personal.config.matrix',
    },
}

# old module -> new module.
MOVED_MODULES: dict[str, str] = {
    'tff_personal.algorithms.best_scoring': 'tff_personal.core.best_scoring',
    'tff_personal.algorithms.statistics_process':
        'tff_personal.core.statistics_process',
    'tff_personal.atomic_io': 'tff_personal.core.atomic_io',
    'tff_personal.curve_bands': 'tff_personal.reports.curve_bands',
    'tff_personal.embedding_purity': 'tff_personal.reports.embedding_purity',
    'tff_personal.experiment': 'tff_personal.config.experiment',
    'tff_personal.export': 'tff_personal.run.export',
    'tff_personal.fault': 'tff_personal.core.fault',
    'tff_personal.figures': 'tff_personal.reports.figures',
    'tff_personal.matrix': 'tff_personal.config.matrix',
    'tff_personal.models.feddva_probes': 'tff_personal.reports.feddva_probes',
    'tff_personal.models.split_model': 'tff_personal.core.split_model',
    'tff_personal.new_user_evaluation':
        'tff_personal.evaluation.new_user_evaluation',
    'tff_personal.paper_results': 'tff_personal.reports.paper_results',
    'tff_personal.program': 'tff_personal.run.program',
    'tff_personal.reporting': 'tff_personal.reports.reporting',
    'tff_personal.run_analysis': 'tff_personal.run.run_analysis',
    'tff_personal.run_evaluation': 'tff_personal.evaluation.run_evaluation',
    'tff_personal.run_lock': 'tff_personal.records.run_lock',
    'tff_personal.run_privacy': 'tff_personal.records.run_privacy',
    'tff_personal.run_records': 'tff_personal.records.run_records',
    'tff_personal.run_spec': 'tff_personal.config.run_spec',
    'tff_personal.runs': 'tff_personal.run.runs',
    'tff_personal.strategies': 'tff_personal.config.strategies',
    'tff_personal.training': 'tff_personal.run.training',
}


def _public_name(module: str, name: str) -> Optional[str]:
  """`tff_personal.<name>` when that public name is `module.name`."""
  public = sys.modules.get('tff_personal')
  table = getattr(public, '_PUBLIC', {})
  for public_name, home in table.items():
    home_module, _, attribute = home.partition(':')
    if home_module == module and (attribute or public_name) == name:
      return f'tff_personal.{public_name}'
  return None


def missing_attribute(module: str, name: str) -> NoReturn:
  """Raises AttributeError for `module.name`, naming where it moved."""
  new_module = MOVED_NAMES.get(module, {}).get(name)
  if new_module is None:
    raise AttributeError(f'module {module!r} has no attribute {name!r}')
  public = _public_name(new_module, name)
  also = f' (public: {public})' if public else ''
  raise AttributeError(
      f'{module}.{name} moved to {new_module}.{name}{also}')


def module_getattr(module: str) -> Callable[[str], Any]:
  """A module `__getattr__` that names the new place of a moved name."""

  def __getattr__(name: str) -> Any:  # pylint: disable=invalid-name
    return missing_attribute(module, name)

  return __getattr__


class MovedModuleError(ImportError):
  """Importing a module by the path it had before it moved.

  An `ImportError`, not a `ModuleNotFoundError`: `from tff_personal import
  experiment` then ends with this message, where Python would replace a
  `ModuleNotFoundError` with its own "cannot import name".
  """


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
  """Consulted after every other finder: a moved module's old path raises."""

  def find_spec(self, fullname, path=None, target=None):  # pylint: disable=unused-argument
    new = MOVED_MODULES.get(fullname)
    if new is not None:
      raise MovedModuleError(f'{fullname} moved to {new}', name=fullname)
    return None


def install() -> None:
  """Makes moved modules' old paths raise (once per interpreter)."""
  if not any(isinstance(f, _MovedModuleFinder) for f in sys.meta_path):
    sys.meta_path.append(_MovedModuleFinder())
