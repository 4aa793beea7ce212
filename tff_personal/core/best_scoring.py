"""The "best-scoring client" aggregation of FedEmbed-SOM, as a TFF aggregator.

FedEmbed section 3.3.1: "A SOM-weight update and similarity score for the
client are sent back to the server, and the update from the best-scoring
client is applied to each node in the SOM". `BestScoringFactory` is that
selection as a `tff.aggregators.UnweightedAggregationFactory`: each client
contributes `<score=float32, value=V>` and the server receives the `value` of
the client with the highest score (the first one met on ties) and that score.
It is one `tff.federated_aggregate` whose accumulator keeps the better of
two candidates, so it runs in any TFF runtime, hierarchically too.

The rule is `better`: a candidate replaces the accumulator only if its score
is strictly higher, so on ties the candidate met first is kept (and a score
of -inf or NaN is never taken over the -inf start). TFF's runtime visits
clients in order (tested), so the result is the first best client.
`core/sharded.py` applies the same `better` over the users of a shard in
user order, then this factory over the shards in shard order: the first
best user of the first shard holding a best user, which is the first best
user of the cohort, ties included.

What it reveals. Unlike a sum, an arg-max releases one client's value
exactly: for the SOM update `h(bmu, i) (e_u - w_i)` of `models/som.py`, the
server can solve for that client's personal embedding e_u, and learns that
this client's score (its distance to the map) is the cohort's best. The
paper's claim that "personal embeddings are not aggregated on the server" is
therefore true only in the letter: one client's embedding per round is
released. No DP mechanism of `core/privacy.py` applies to an arg-max (its
sensitivity is unbounded: changing one client changes the output entirely);
a private variant would need a report-noisy-max selection plus noise on the
selected, clipped value, accounted separately. `algorithms/fedembed_som.py`
therefore uses this aggregation only without DP and refuses it with a DP
aggregator, where it learns the map from the DP mean of the clients' updates
instead (covered by the same clip, noise and epsilon as the model).
"""

from __future__ import annotations

import collections

import numpy as np

import tensorflow as tf
import tensorflow_federated as tff


def no_candidate(value_spec) -> collections.OrderedDict:
  """The selection before any client: score -inf, a zero value."""
  return collections.OrderedDict(
      score=tf.constant(float('-inf'), tf.float32),
      value=tf.nest.map_structure(lambda s: tf.zeros(s.shape, s.dtype),
                                  value_spec))


def better(a, b) -> collections.OrderedDict:
  """`b` if its score is strictly higher than `a`'s, else `a` (ties: `a`).

  `a` and `b` are `<score, value>` structures; pure TF, so that a shard of
  users (`core/sharded.py`) selects with exactly the rule of the aggregator.
  """
  take_b = b['score'] > a['score']
  return collections.OrderedDict(
      score=tf.where(take_b, b['score'], a['score']),
      value=tf.nest.map_structure(
          lambda x, y: tf.where(take_b, y, x), a['value'], b['value']))


class BestScoringFactory(tff.aggregators.UnweightedAggregationFactory):
  """Selects the value of the highest-scoring client.

  The value type must be a struct `<score=float32 scalar, value=...>`; the
  result is `<score, value>` of the best client (score -inf and zeros when no
  client took part). Stateless; its measurements are empty.
  """

  def create(self, value_type: tff.Type) -> tff.templates.AggregationProcess:
    if (not isinstance(value_type, tff.StructType) or
        'score' not in dir(value_type) or 'value' not in dir(value_type)):
      raise TypeError('BestScoringFactory needs a value type '
                      f'<score=float32, value=...>, got {value_type}')
    if value_type.score != tff.TensorType(np.float32):
      raise TypeError(f'score must be a float32 scalar, got {value_type.score}')

    @tff.tensorflow.computation
    def zero():
      return no_candidate(tff.types.type_to_tf_tensor_specs(value_type.value))

    acc_type = zero.type_signature.result

    @tff.tensorflow.computation(acc_type, acc_type)
    def accumulate(a, b):
      return better(a, b)

    @tff.tensorflow.computation(acc_type)
    def report(a):
      return a

    @tff.federated_computation
    def init_fn():
      return tff.federated_value((), tff.SERVER)

    @tff.federated_computation(init_fn.type_signature.result,
                               tff.FederatedType(value_type, tff.CLIENTS))
    def next_fn(state, value):
      best = tff.federated_aggregate(value, zero(), accumulate, accumulate,
                                    report)
      return tff.templates.MeasuredProcessOutput(
          state=state, result=best,
          measurements=tff.federated_value((), tff.SERVER))

    return tff.templates.AggregationProcess(init_fn, next_fn)
