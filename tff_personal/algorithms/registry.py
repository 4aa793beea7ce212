"""Algorithm names (the `--algorithm` flag values) and their builders.

Every builder takes a task's `model_fn_factory` (embedding_dim -> model_fn)
and keyword arguments `client_optimizer`, `server_optimizer`,
`aggregator_factory`, `metrics_fn`, `train_metrics`, `seed`, `embedding_dim`,
and returns a `StatefulClientProcess`.
"""

from __future__ import annotations

from tff_personal.algorithms import fedavg
from tff_personal.algorithms import furl

ALGORITHMS = {
    'global': fedavg.build_global,
    'global_plus': fedavg.build_global_plus,
    'furl': furl.build_furl,
}


def build(name: str, model_fn_factory, **kwargs):
  """Builds the named algorithm's process; a clear error for unknown names."""
  if name not in ALGORITHMS:
    raise ValueError(f'unknown algorithm {name!r}; known: {sorted(ALGORITHMS)}')
  return ALGORITHMS[name](model_fn_factory, **kwargs)
