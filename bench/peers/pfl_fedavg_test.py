"""Tests of the pfl peer, run in the peer environment (torch + pfl):

  bench/peers/.venv-pfl/bin/python bench/peers/pfl_fedavg_test.py

(`peer_workload_test.py`, run by the project's pytest, runs this file in that
environment too.) Under an interpreter without torch/pfl the module is skipped.
"""

import json
import os
import subprocess
import sys
import tempfile
import time
import unittest

if __package__ in (None, ''):  # Run as a file: make `bench.peers` importable.
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__)))))

try:
  # pylint: disable=g-import-not-at-top
  import torch
  import pfl
  # pylint: enable=g-import-not-at-top
except ImportError as e:  # The project's own environment has neither.
  raise unittest.SkipTest(f'needs the pfl peer environment: {e}') from e

# pylint: disable=g-import-not-at-top,g-bad-import-order
from absl.testing import absltest
import numpy as np

from bench.peers import peer_workload
from bench.peers import pfl_fedavg
# pylint: enable=g-import-not-at-top,g-bad-import-order

_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                       'pfl_fedavg.py')


def _params(module):
  return {k: v.detach().clone() for k, v in module.named_parameters()}


def _local_adam_delta(initial_state, x, y):
  """One epoch of plain-torch Adam (lr 1e-3) in batches of 10, from scratch."""
  model = pfl_fedavg.MnistPreferenceCNN()
  model.load_state_dict(initial_state)
  optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
  for start in range(0, len(x), 10):
    optimizer.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x[start:start + 10]),
                                             y[start:start + 10])
    loss.backward()
    optimizer.step()
  return {k: v.detach() - initial_state[k]
          for k, v in model.named_parameters()}


class PflFedAvgTest(absltest.TestCase):

  def test_one_pfl_round_is_the_mean_of_local_adam_deltas(self):
    population, cohort, seed = 12, 4, 3
    x, y = peer_workload.make_learnable_workload(population, 20, seed=1)
    x, y = pfl_fedavg.to_torch_layout(x, y)
    algorithm, run_kwargs, module, sampler = pfl_fedavg.build_fedavg(
        x, y, cohort, total_rounds=1, seed=seed)
    initial = {k: v.clone() for k, v in module.state_dict().items()}
    algorithm.run(**run_kwargs)

    ids = peer_workload.cohort_of(population, cohort, 1, seed)
    self.assertLen(sampler.cohorts, 1)
    np.testing.assert_array_equal(sampler.cohorts[0], ids)
    deltas = [_local_adam_delta(initial, x[u], y[u]) for u in ids]
    after = _params(module)
    moved = 0.0
    for name, value in after.items():
      expected = initial[name] + torch.stack([d[name] for d in deltas]).mean(0)
      torch.testing.assert_close(value, expected, atol=2e-6, rtol=1e-5,
                                 msg=name)
      moved = max(moved, float((value - initial[name]).abs().max()))
    self.assertGreater(moved, 1e-4)  # The comparison is not vacuous.

  def test_sampler_serves_each_round_cohort_in_turn(self):
    sampler = pfl_fedavg.CohortSampler(population=30, cohort=7, seed=5)
    served = [sampler() for _ in range(3 * 7)]
    for r in range(3):
      expected = peer_workload.cohort_of(30, 7, r + 1, 5)
      self.assertEqual(served[7 * r:7 * (r + 1)], [int(i) for i in expected])
    self.assertEqual(sampler.round_num, 3)

  def test_model_is_the_fedembed_global_cnn(self):
    module = pfl_fedavg.MnistPreferenceCNN()
    logits = module(torch.zeros(3, 1, 28, 28))
    self.assertEqual(tuple(logits.shape), (3, 2))
    norms = [m for m in module.modules()
             if isinstance(m, torch.nn.LayerNorm)]
    self.assertEqual([tuple(m.normalized_shape) for m in norms],
                     [(16, 14, 14), (32, 7, 7), (64, 1, 1)])
    for m in module.modules():
      if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear)):
        self.assertEqual(float(m.bias.detach().abs().max()), 0.0)  # Keras init.

  def test_script_record_is_consistent_and_the_model_learns(self):
    with tempfile.TemporaryDirectory() as tmp:
      data = os.path.join(tmp, 'workload.npz')
      x, y = peer_workload.make_learnable_workload(40, 20, seed=2)
      np.savez(data, x=x, y=y)
      output = os.path.join(tmp, 'sub', 'record.json')
      t0 = time.time()
      result = subprocess.run(
          [sys.executable, _SCRIPT, f'--data={data}', '--cohort=8',
           '--rounds=3', '--warmup_rounds=2', f'--output={output}',
           f'--t0={t0}', '--torch_threads=1'],
          capture_output=True, text=True, timeout=600, check=False)
      self.assertEqual(result.returncode, 0, result.stderr[-3000:])
      with open(output, encoding='utf-8') as f:
        record = json.load(f)
    self.assertEqual(record['name'], 'pfl_fedavg')
    self.assertEqual((record['cohort'], record['rounds']), (8, 3))
    self.assertLen(record['round_seconds'], 5)
    self.assertAlmostEqual(record['seconds_per_round'],
                           np.mean(record['round_seconds'][2:]))
    self.assertAlmostEqual(
        record['client_updates_per_s'] * record['seconds_per_round'], 8)
    self.assertAlmostEqual(record['examples_per_s'],
                           20 * record['client_updates_per_s'])
    self.assertEqual(record['startup_origin'], 't0')
    self.assertGreaterEqual(record['startup_s'],
                            record['startup_from_script_s'])
    self.assertGreaterEqual(record['startup_from_script_s'],
                            record['imports_s'] + record['first_round_s'])
    self.assertGreater(record['peak_rss_mib'], 50)
    self.assertGreaterEqual(record['peak_rss_mib'], record['rss_end_mib'])
    self.assertEqual(record['torch_threads'], 1)
    self.assertEqual(record['pfl_version'], pfl.__version__)
    # Learnable data: the round-mean training loss falls clearly.
    self.assertLess(record['train_loss_last_round'],
                    0.5 * record['train_loss_first_round'])

  def test_script_rejects_a_cohort_larger_than_the_population(self):
    with tempfile.TemporaryDirectory() as tmp:
      data = os.path.join(tmp, 'workload.npz')
      x, y = peer_workload.make_learnable_workload(5, 20, seed=0)
      np.savez(data, x=x, y=y)
      result = subprocess.run(
          [sys.executable, _SCRIPT, f'--data={data}', '--cohort=6',
           f'--output={os.path.join(tmp, "r.json")}'],
          capture_output=True, text=True, timeout=600, check=False)
    self.assertNotEqual(result.returncode, 0)
    self.assertIn('--cohort must be in [1, population=5]', result.stderr)


if __name__ == '__main__':
  absltest.main()
