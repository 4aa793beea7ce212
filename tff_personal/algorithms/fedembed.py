"""FedEmbed (Silva et al.): personal embeddings and sub-population heads.

`fedembed_prototype`, `fedembed_type` and `fedembed_personal` (the SOM variant,
whose server also learns a map, is `fedembed_som.py`). The model, and every reading of the paper, is in
`models/fedembed.py`; the federated part is FURL-style split training
(`core/process.build_split_model_process`): the shared parameters (encoder,
all K heads, the global and type heads, the prototypes) are aggregated by the
named aggregator (weighted mean, or user-level DP over all of them, unused
heads included), and the private ones (the personal embedding, the
assignment, a personal head) stay on the client.

The server averages each head over all clients, as the paper says ("the
server is unaware of each client's identity or sub-population membership"):
a client's update is zero on the heads it does not use, so head k moves by the
mean over the cohort of the updates of its users, weighted by examples.
"""

from __future__ import annotations

import inspect
from typing import Callable, Optional

import tensorflow_federated as tff

from tff_personal.core import process as process_lib
from tff_personal.models import fedembed as fedembed_model
from tff_personal.models import split_model as split_model_lib

FedEmbedModelFactory = Callable[[fedembed_model.FedEmbedConfig],
                                split_model_lib.SplitModelFn]


def build_fedembed(model_factory: FedEmbedModelFactory, *,
                   assignment: str,
                   client_optimizer: tff.learning.optimizers.Optimizer,
                   server_optimizer: tff.learning.optimizers.Optimizer,
                   aggregator_factory=None, metrics_fn=None,
                   train_metrics: bool = True, seed: Optional[int] = None,
                   embedding_dim: int = 28,
                   num_subpopulations: Optional[int] = None,
                   private_optimizer=None,
                   ) -> process_lib.StatefulClientProcess:
  """Builds a FedEmbed process with the given sub-population assignment."""
  config = fedembed_model.FedEmbedConfig(
      assignment=assignment, embedding_dim=embedding_dim,
      num_subpopulations=num_subpopulations)  # None: the task's
  return process_lib.build_split_model_process(
      model_factory(config), client_optimizer=client_optimizer,
      server_optimizer=server_optimizer, aggregator_factory=aggregator_factory,
      metrics_fn=metrics_fn, train_metrics=train_metrics, seed=seed,
      private_optimizer=private_optimizer)


def _variant(assignment: str):
  def builder(model_factory, **kwargs):
    return build_fedembed(model_factory, assignment=assignment, **kwargs)
  builder.__doc__ = f'FedEmbed with {assignment} sub-population assignment.'
  # What the variant accepts (read by `registry.algorithm_options`).
  signature = inspect.signature(build_fedembed)
  builder.__signature__ = signature.replace(parameters=[
      p for p in signature.parameters.values() if p.name != 'assignment'])
  return builder


build_fedembed_prototype = _variant('prototype')
build_fedembed_type = _variant('type')
build_fedembed_personal = _variant('personal')
