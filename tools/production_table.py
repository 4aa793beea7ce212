"""Generates docs/production.md's table: each algorithm's production forms
and what its device keeps and sends per client.

Whether a pair compiles is `production.NOT_COMPILED`'s to say (and
`tests/production_test.py` holds every other pair to compile); the sizes
are read from each process's types (the secure-sum uploads from the
update's size, `production.update_secure_sum_bits`, which
`tests/production_test.py` holds to the compiled forms) on the paper task the algorithm runs on
here (MNIST from `--data_dir`; FedPerC on the tests' tiny backbone, so its
sizes scale with the backbone's hidden size, stated as such).

Usage (from the repository root):

  .venv/bin/python tools/production_table.py --data_dir=../shared/data/mnist
"""

from __future__ import annotations

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, 'docs', 'production.md')
BLOCK = re.compile(
    r'(<!-- production:begin -->\n)(.*?)(<!-- production:end -->)', re.S)


def _bytes(tff_type) -> int:
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top
  specs = tf.nest.flatten(tff.types.type_to_tf_tensor_specs(tff_type))
  return sum(int(np.prod(s.shape)) * s.dtype.size for s in specs)


# The cohort the secure-sum columns are given for (SecAgg's modulus holds
# the sum of this many summands).
CLIENTS = 100


def _coordinates(tff_type) -> int:
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top
  specs = tf.nest.flatten(tff.types.type_to_tf_tensor_specs(tff_type))
  return sum(int(np.prod(s.shape)) for s in specs)


def _bits(bits: dict) -> str:
  """`production.update_secure_sum_bits`'s two sizes (the update's
  coordinates; a few scalars come beside them)."""
  return f'{_size(bits["tff"] // 8)} / {_size(bits["secagg"] // 8)}'


def _size(n: int) -> str:
  if n < 1024:
    return f'{n} B'
  return f'{n / 1024:.1f} KiB' if n < 1 << 20 else f'{n / (1 << 20):.2f} MiB'


def table(data_dir: str) -> str:
  """The Markdown table."""
  if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
  # pylint: disable=g-import-not-at-top
  import tensorflow_federated as tff
  from tasks import registry as task_registry
  from tests import fedperc_testdata
  from tff_personal.algorithms import registry
  from tff_personal.config import experiment
  from tff_personal.core import production
  # pylint: enable=g-import-not-at-top
  tasks = {
      'mnist_preference': dict(num_users=20, population='balanced'),
      'label_skew_mnist': dict(num_clients=20)}
  built_tasks = {}
  from tff_personal.core import privacy
  rows = ['| algorithm | task | stage | forms it compiles to, no DP / '
          'gaussian_fixed | client state kept on the device | shared model '
          'received | update sent | secure_aggregator upload: TFF int64 / '
          f'SecAgg, {CLIENTS} clients | distributed_dgauss upload: TFF int32 '
          f'/ SecAgg, {CLIENTS} clients |', '|---' * 9 + '|']
  for name in sorted(registry.SPECS):
    compiled = ' / '.join(
        'MapReduceForm only' if (name, dp) in production.NOT_COMPILED
        else 'both' for dp in ('none', 'gaussian_fixed'))
    if registry.spec(name).model == 'fedperc':
      task_name = 'tiny tv_shows (tests)'
      built = registry.build_for_task(
          name, fedperc_testdata.TASK,
          client_optimizer=tff.learning.optimizers.build_sgdm(0.1),
          server_optimizer=tff.learning.optimizers.build_sgdm(1.0))
    else:
      task_name = next(t for t in tasks if not registry.missing_for(
          name, task_registry.spec(t).capabilities, {}))
      if task_name not in built_tasks:
        built_tasks[task_name] = task_registry.build_task(
            task_name, data_dir=data_dir, seed=0, **tasks[task_name])
      options = ({'allow_unprotected_best_client': True}
                 if name == 'fedembed_som' else {})
      config = experiment.ExperimentConfig(
          algorithm=name, rounds=1, clients_per_round=2,
          root_output_dir='/tmp', experiment_name='table',
          algorithm_options=options,
          embedding_dim=28 if name in ('global_plus', 'furl') else None)
      built = experiment.build_process(built_tasks[task_name], config)
    for stage, form in production.production_forms(built):
      proc = form.process
      private = _bytes(proc.client_state_type)
      coordinates = _coordinates(proc.aggregation_value_type)
      secure = _bits(production.update_secure_sum_bits(
          coordinates, CLIENTS, 'secure_aggregator'))
      ddp = ('refused' if registry.spec(name).distributed_dp else
             _bits(production.update_secure_sum_bits(
                 privacy.ddp_padded_dimension(coordinates), CLIENTS,
                 'distributed_dgauss')))
      rows.append(f'| {name} | {task_name} | {stage} | {compiled} | '
                  f'{_size(private)} | '
                  f'{_size(_bytes(proc.model_weights_type))} | '
                  f'{_size(_bytes(proc.aggregation_value_type))} | '
                  f'{secure} | {ddp} |')
  return '\n'.join(rows) + '\n'


def main(argv: list[str]) -> int:
  data_dir = next((a.split('=', 1)[1] for a in argv[1:]
                   if a.startswith('--data_dir=')),
                  os.path.join(ROOT, '..', 'shared', 'data', 'mnist'))
  with open(DOC, encoding='utf-8') as f:
    text = f.read()
  if not BLOCK.search(text):
    raise ValueError(f'{DOC} has no <!-- production:begin/end --> markers')
  text = BLOCK.sub(lambda m: m.group(1) + table(data_dir) + m.group(3), text)
  with open(DOC, 'w', encoding='utf-8') as f:
    f.write(text)
  print(f'written: {DOC}')
  return 0


if __name__ == '__main__':
  sys.exit(main(sys.argv))
