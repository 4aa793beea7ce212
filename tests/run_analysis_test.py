"""Tests of `tff_personal.run.run_analysis` on a fake run (no training)."""

import json
import os
import types

import pytest

from tff_personal.config import strategies
from tff_personal.run import run_analysis
from tff_personal.run import runs


class _FakeRun:
  """A run whose client `c` scores `c + lr` under a fine-tuning at `lr`
  (`c` as trained) at round r, plus `10 * r`; it counts its calls."""

  directory = '/fake/run'

  def __init__(self, kept=(1, 2, 3), eval_rows=()):
    self.calls = []
    self._kept = list(kept)
    self._eval = list(eval_rows)

  def client_outputs(self, ids, strategy='none', round=None, stage=None):  # pylint: disable=redefined-builtin
    self.calls.append((list(ids), strategy, round, stage))
    lr = getattr(strategy, 'learning_rate', 0.0)
    return [{'value': c + lr + 10 * (round or 0)} for c in ids]

  def rounds(self, stage=None):
    del stage
    return self._kept

  def curves(self):
    return {'train': [], 'eval': self._eval}


def _value(output):
  return output['value']


def _mean(values):
  return sum(values) / len(values)


def _tune(lr):
  return strategies.FineTune(epochs=1, learning_rate=lr, optimizer='sgd')


def test_evaluate_clients_reduces_each_client_in_order():
  run = _FakeRun()
  out = run_analysis.evaluate_clients(run, [5, 2], stage='fl', round=3,
                                      reduce=_value)
  assert list(out.items()) == [(5, 35.0), (2, 32.0)]
  assert run.calls == [([5, 2], 'none', 3, 'fl')]


def test_cached_evaluation_is_read_back_without_evaluating(tmp_path):
  run, path = _FakeRun(), str(tmp_path / 'eval_fl.json')
  first = run_analysis.cached_evaluation(path, run, [1, 2], reduce=_value)
  with open(path) as f:
    assert json.load(f) == {'1': 1.0, '2': 2.0}  # Ids as text.
  again = run_analysis.cached_evaluation(path, run, [1, 2], reduce=_value)
  assert first == again == {1: 1.0, 2: 2.0} and len(run.calls) == 1


def test_tuned_evaluation_chooses_on_the_sweep_clients(tmp_path):
  run = _FakeRun()
  tuned, lr, by_lr = run_analysis.tuned_evaluation(
      str(tmp_path), 'perfl', run, [1, 2], [7], [1.0, 0.5], _tune,
      score=_mean, reduce=_value)
  # The sweep client scores 7 + lr: the lower lr wins.
  assert by_lr == {1.0: 8.0, 0.5: 7.5} and lr == 0.5
  assert tuned == {1: 1.5, 2: 2.5}
  assert sorted(os.listdir(tmp_path)) == [
      'eval_perfl.json', 'sweep_perfl_lr0.5.json', 'sweep_perfl_lr1.json']
  # Every sweep evaluation on the sweep clients only, then the evaluated
  # clients at the chosen lr.
  assert [(ids, s.learning_rate) for ids, s, _, _ in run.calls] == [
      ([7], 1.0), ([7], 0.5), ([1, 2], 0.5)]


def test_tuned_evaluation_breaks_ties_to_the_smaller_lr(tmp_path):
  run = _FakeRun()
  flat = lambda values: 0.0
  _, lr, _ = run_analysis.tuned_evaluation(
      str(tmp_path), 'm', run, [1], [2], [1.0, 0.1, 0.5], _tune, score=flat,
      reduce=_value)
  assert lr == 0.1


def test_evaluate_methods_in_order_as_trained_and_tuned(tmp_path):
  run = _FakeRun()
  results, chosen = run_analysis.evaluate_methods(
      str(tmp_path), {'fl': (run, 'fl', None), 'perfl': (run, 'fl', _tune)},
      [1], [3], [0.5, 2.0], score=_mean, reduce=_value)
  assert results == {'fl': {1: 1.0}, 'perfl': {1: 1.5}}
  assert chosen == {'perfl': (0.5, {0.5: 3.5, 2.0: 5.0})}
  assert [c[1] == 'none' for c in run.calls] == [True, False, False, False]
  assert all(c[3] == 'fl' for c in run.calls)


def test_checkpoint_curves_score_each_pool_at_each_point():
  run = _FakeRun()
  curves = run_analysis.checkpoint_curves(
      run, [1, 2, 3], {'as_is': 'none', 'tuned': _tune(1.0)},
      [{'stage': 'fl'}, {'round': 2}], {'odd': [1, 3], 'all': [1, 2, 3]},
      score=_mean, reduce=_value)
  assert curves == {'as_is': {'odd': [2.0, 22.0], 'all': [2.0, 22.0]},
                    'tuned': {'odd': [3.0, 23.0], 'all': [3.0, 23.0]}}
  assert [(c[2], c[3]) for c in run.calls] == [
      (None, 'fl'), (None, 'fl'), (2, None), (2, None)]


def test_check_checkpoints_names_the_missing_rounds():
  run_analysis.check_checkpoints(_FakeRun(kept=[2, 4]), [2, 4])
  with pytest.raises(runs.RunError, match=r'no checkpoint of rounds \[6\]'):
    run_analysis.check_checkpoints(_FakeRun(kept=[2, 4]), [2, 4, 6])


def test_plateau_round():
  curve = {10: 200.0, 20: 150.0, 30: 149.0, 40: 149.5, 50: 140.0}
  # 149 is within 1% of 150 over (20, 40]; at 30 the window (30, 50] holds
  # 140, more than 1% below.
  assert run_analysis.plateau_round(curve, 20, 0.01) == 20
  # With no tolerance 149.0 beats 150.0; later windows hold 140.
  assert run_analysis.plateau_round(curve, 20, 0.0) is None
  # A window of 30 from round 20 reaches 140.
  assert run_analysis.plateau_round(curve, 30, 0.01) is None
  # Still falling by more than the tolerance everywhere: no plateau.
  falling = {r: 100.0 * 0.9 ** (r // 10) for r in range(10, 110, 10)}
  assert run_analysis.plateau_round(falling, 20, 0.05) is None
  # Only rounds whose whole window the curve covers can be T.
  assert run_analysis.plateau_round({10: 100.0, 20: 100.0}, 20, 0.01) is None
  assert run_analysis.plateau_round({10: 100.0, 20: 100.0, 30: 100.0}, 20,
                                    0.01) == 10


def test_eval_plateau_reads_the_evaluated_rounds():
  rows = [{'round': 10, 'perplexity': 200.0}, {'round': 15, 'other': 1.0},
          {'round': 20, 'perplexity': 150.0}, {'round': 30,
                                               'perplexity': 149.0},
          {'round': 40, 'perplexity': 149.5}]
  rounds, curve = run_analysis.eval_plateau(_FakeRun(eval_rows=rows),
                                            'perplexity', 20, 0.01)
  assert curve == {10: 200.0, 20: 150.0, 30: 149.0, 40: 149.5}
  assert rounds == 20


def test_run_readings_take_the_curves_and_the_privacy_block():
  run = types.SimpleNamespace(
      summary={'privacy': {'epsilon': 3.0, 'delta': 1e-5, 'rounds_noised': 4,
                           'noise_multiplier': 1.0, 'clip_norm': 0.5,
                           'accountant': 'rdp'}},
      curves=lambda: {'eval': [{'accuracy': '0.5',
                                'accuracy_std_across_clients': '0.1'},
                               {'accuracy': '0.75',
                                'accuracy_std_across_clients': '0.2'}],
                      'train': [{'round_seconds': '1'},
                                {'round_seconds': '3'}]})
  assert run_analysis.accuracy_curve(run) == {
      'mean': [0.5, 0.75], 'std': [0.1, 0.2], 'seconds_per_round': 2.0}
  assert run_analysis.privacy_metrics(run) == {
      'epsilon': 3.0, 'delta': 1e-5, 'rounds_noised': 4,
      'noise_multiplier': 1.0, 'clip_norm': 0.5}
  assert run_analysis.privacy_metrics(types.SimpleNamespace(summary={})) == {}
