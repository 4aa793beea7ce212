"""Algorithm names (the `--algorithm` flag values) and their builders.

Every builder takes a model factory from the task and keyword arguments
`client_optimizer`, `server_optimizer`, `aggregator_factory`, `metrics_fn`,
`train_metrics`, `seed`, `embedding_dim`, and returns a
`StatefulClientProcess`. Which factory: `model_factory(name, task)`: the
task's `model_fn_factory` (embedding_dim -> model_fn) for split models, its
`fedembed_model_fn_factory` (FedEmbedConfig -> model_fn) for FedEmbed.
"""

from __future__ import annotations

from tff_personal.algorithms import fedavg
from tff_personal.algorithms import fedembed
from tff_personal.algorithms import fedembed_som
from tff_personal.algorithms import fedrep
from tff_personal.algorithms import furl
from tff_personal.algorithms import pfedkm
from tff_personal.algorithms import pfedme

ALGORITHMS = {
    'global': fedavg.build_global,
    'global_plus': fedavg.build_global_plus,
    'furl': furl.build_furl,
    'fedembed_prototype': fedembed.build_fedembed_prototype,
    'fedembed_type': fedembed.build_fedembed_type,
    'fedembed_personal': fedembed.build_fedembed_personal,
    'fedembed_som': fedembed_som.build_fedembed_som,
    'fedrep': fedrep.build_fedrep,
    'pfedme': pfedme.build_pfedme,
    'pfedme_restart': pfedme.build_pfedme_restart,
    'pfedkm': pfedkm.build_pfedkm,
}

# Algorithms built on a task's FedEmbed model (K sub-population heads).
_FEDEMBED_MODEL = ('pfedkm',)


def build(name: str, model_fn_factory, **kwargs):
  """Builds the named algorithm's process; a clear error for unknown names."""
  if name not in ALGORITHMS:
    raise ValueError(f'unknown algorithm {name!r}; known: {sorted(ALGORITHMS)}')
  return ALGORITHMS[name](model_fn_factory, **kwargs)


def model_factory(name: str, task):
  """The task's model factory that the named algorithm builds on."""
  if name.startswith('fedembed_') or name in _FEDEMBED_MODEL:
    if not hasattr(task, 'fedembed_model_fn_factory'):
      raise ValueError(f'task {getattr(task, "name", task)!r} has no FedEmbed '
                       f'model; {name} needs one')
    return task.fedembed_model_fn_factory
  return task.model_fn_factory
