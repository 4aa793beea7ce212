"""FedPerC's timed passes: a train pass moves what the variant trains on
device and nothing else; memory is what `per_user_parameters` counts."""

import numpy as np
import pytest
import tensorflow as tf

from tests import fedperc_testdata
from tff_personal.models import fedperc
from tff_personal.models import fedperc_costs


def _batch():
  data = fedperc_testdata.arrays(0)
  return {k: tf.constant(data[k][:3]) for k in ('ids', 'mask', 'context')}


@pytest.mark.parametrize('variant,trained', [
    (fedperc.EMBEDDING, ('personal_offset', 'context_embeddings')),
    (fedperc.SPLIT, ('personal_head', 'context_heads')),
    (fedperc.META, ('head',)),
    (fedperc.GENERATED, None),  # its shared generators
])
def test_a_train_pass_moves_only_the_device_part(variant, trained):
  spec = fedperc_testdata.spec()
  model = fedperc.FedPercModel(spec, fedperc_testdata.config(variant), 0)
  model.backbone.set_weights(spec.weights)
  moved = ([getattr(model, name) for name in trained] if trained else
           list(model.shared_trainable_variables))
  every = (model.shared_trainable_variables + model.private_variables +
           model.shared_non_trainable_variables)
  train_pass, test_pass = fedperc_costs._passes(model, _batch(), 3)
  nll = float(test_pass())
  before = [v.numpy().copy() for v in every]
  train_pass()
  changed = {id(v) for v, b in zip(every, before)
             if not np.array_equal(v.numpy(), b)}
  assert changed and changed <= {id(v) for v in moved}
  if variant != fedperc.GENERATED:  # Scoring alone changes nothing.
    assert float(test_pass()) != nll


def test_costs_report_every_model_and_its_memory():
  spec = fedperc_testdata.spec()
  configs = {'a': fedperc_testdata.config(fedperc.EMBEDDING),
             'b': fedperc_testdata.config(fedperc.SPLIT)}
  costs = fedperc_costs.pass_costs(spec, configs, _batch(), repeats=2,
                                   warmup=1)
  for name, config in configs.items():
    want = fedperc.FedPercModel(spec, config, 0).per_user_parameters()
    assert costs[name]['parameters_per_user'] == want
    assert costs[name]['bytes_per_user'] == 4 * want
    assert costs[name]['train_ms'] > 0 and costs[name]['test_ms'] > 0
