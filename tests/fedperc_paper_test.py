"""The FedPerC paper module: what its cells share is keyed by its flags."""

import types

from papers import fedperc as paper


def _flags(**overrides):
  values = dict(fedperc_backbone='preset', fedperc_rounds=3,
                fedperc_clients_per_round=2, fedperc_server_optimizer='sgd',
                fedperc_timing_repeats=5, data_dir=None, rounds=None,
                clients_per_round=None, num_users=None, seeds=1,
                other_flag=1)
  values.update(overrides)
  return types.SimpleNamespace(**values)


def test_trained_models_are_shared_only_under_the_same_flags(tmp_path):
  root = str(tmp_path)
  base = paper.trained_cache_dir(root, _flags())
  assert base.startswith(str(tmp_path / 'runs' / 'fedperc' / '_trained'))
  assert paper.trained_cache_dir(root, _flags()) == base
  # Flags of other papers or of the binary do not split the cache.
  assert paper.trained_cache_dir(root, _flags(other_flag=2, seeds=3)) == base
  for name, value in (('fedperc_rounds', 60), ('fedperc_backbone', 'other'),
                      ('fedperc_server_optimizer', 'adam'),
                      ('data_dir', '/elsewhere')):
    assert paper.trained_cache_dir(root, _flags(**{name: value})) != base, (
        name)
