"""The per-client evaluation with users packed in shards, run in threads.

`ShardedPersonalEval` gives the outputs the one-user-per-client evaluation
(`core/evaluation.build_personal_eval`, and with fine-tuning
`build_cold_start_eval`) gives, for users packed in shards as the sharded
simulation packs them (`core/sharded.py`), each shard's loop in its own
thread (`core/shard_threads.py`).
"""

from __future__ import annotations

import collections

import tensorflow as tf

from tff_personal.core import client_data
from tff_personal.core import process as process_lib
from tff_personal.core import shard_threads
from tff_personal.core import sharded
from tff_personal.core import split_training


class ShardedPersonalEval:
  """`evaluation.build_personal_eval` (or, with a fine-tuning optimizer,
  `evaluation.build_cold_start_eval`) with users packed in shards, run in
  this process.

  Called like the TFF computation it replaces:
  `(weights, client_states, datasets) -> [OrderedDict(outputs, labels)]`,
  or with fine-tuning `(weights, client_states, train_data, datasets)`,
  one entry per user, computed with the user's private state (first
  fine-tuned on the user's training batches, shared weights frozen, exactly
  as `split_training.fine_tune_private` does for one client). The users are
  split into `num_shards` shards (`pack_datasets`); each shard is a
  `tf.function` looping over its users (`tf.while_loop`) on its own model,
  and the shards run concurrently in threads. Outputs come back padded and
  are cut to each user's example count.

  Evaluation aggregates nothing and releases nothing, so it is run here
  rather than in TFF's executor: routed through the executor, every call
  serialised all the evaluated users' examples (in TFF's Python value
  serialisation, several copies per nesting level) and that, not the
  arithmetic, was most of an evaluation (docs/performance.md). The
  per-user work is the same TF code as the per-client TFF computation's,
  which `tests/sharded_test.py` holds equal. Each shard's model is built
  once, on the first call, and every user's shared and private values are
  loaded into it before use (they cover all its variables), so calls do
  not leak state into each other.

  Args:
    model_fn: The split model builder of the evaluated process.
    num_shards: Shards run concurrently (about the number of CPU cores).
    fine_tune_optimizer: None, or the optimizer of the private-only local
      pass before testing (then calls take training data too).
    wire: The wire format of the evaluation items when they are
      `ClientBatches` in a compact form (None: model form, e.g. `tf.data`
      datasets).
    train_wire: The same for the fine-tuning items.

  Example:
    evaluate = ShardedPersonalEval(proc.model_fn, num_shards=2)
    outputs = evaluate(weights, client_states, task.eval_batches(ids))
  """

  def __init__(self, model_fn, num_shards: int = 1,
               fine_tune_optimizer=None,
               wire: client_data.WireFormat | None = None,
               train_wire: client_data.WireFormat | None = None):
    if num_shards < 1:
      raise ValueError(f'num_shards must be >= 1, got {num_shards}')
    self._model_fn = model_fn
    self._num_shards = num_shards
    self._fine_tune_optimizer = fine_tune_optimizer
    self._fine_tune = fine_tune_optimizer is not None
    self._wire, self._train_wire = wire, train_wire
    self._element_spec = process_lib.model_input_spec(model_fn)
    self._runs = []  # One shard loop per shard, built on first use.

  def _build(self, example_args):
    """A fresh model (built eagerly) and the shard loop over it, for
    arguments shaped as `example_args` with any user, batch and example
    count (traced in this thread: `shard_threads.trace_loop`)."""
    return shard_threads.trace_loop(self._shard_fn,
                                    sharded.call_signature(*example_args))

  def _shard_fn(self):
    """A fresh model and the Python function of a shard loop over it."""
    model = self._model_fn()
    element_spec, wire, train_wire = (self._element_spec, self._wire,
                                      self._train_wire)
    optimizer = self._fine_tune_optimizer
    decode = wire.decode if wire is not None else (lambda b: b)

    def run_shard(weights, states, shard, train_shard):
      num_users = tf.shape(shard[sharded.SHARD_NUM_BATCHES])[0]
      indices_shape = tf.shape(shard[sharded.SHARD_INDICES])
      capacity = indices_shape[1] * indices_shape[2]

      def user_examples(u):
        # The user's batches in order, concatenated (as the per-client
        # evaluation iterates its dataset).
        mask = tf.sequence_mask(shard[sharded.SHARD_BATCH_SIZES][u],
                                indices_shape[2])
        idx = tf.boolean_mask(shard[sharded.SHARD_INDICES][u], mask)
        return decode(tf.nest.map_structure(
            lambda t: tf.gather(t[u], idx), shard[sharded.SHARD_EXAMPLES]))

      def pad(t):
        paddings = [[0, capacity - tf.shape(t)[0]]] + [[0, 0]] * (
            t.shape.rank - 1)
        return tf.pad(t, paddings)

      def body(u, outputs, labels, counts):
        private = tuple(states[process_lib.CLIENT_STATE_PRIVATE])
        private_u = tf.nest.map_structure(lambda t: t[u], private)
        split_training.assign_weights(model, weights, private_u)
        if train_shard is not None:
          split_training.fine_tune_private(
              model, optimizer,
              sharded.PackedBatches(train_shard, u, element_spec, train_wire))
        batch = user_examples(u)
        out = model.eval_output(batch, model.forward(batch, training=False))
        n = tf.shape(batch['y'])[0]
        return (u + 1, outputs.write(u, pad(out)),
                labels.write(u, pad(batch['y'])), counts.write(u, n))

      arrays = (tf.TensorArray(tf.float32, size=num_users, infer_shape=False),
                tf.TensorArray(element_spec['y'].dtype, size=num_users,
                               infer_shape=False),
                tf.TensorArray(tf.int32, size=num_users))
      # One user at a time: every user loads its values into the same
      # model variables, so iterations must not overlap.
      _, outputs, labels, counts = tf.while_loop(
          lambda u, *_: u < num_users, body, (tf.constant(0),) + arrays,
          parallel_iterations=1)
      return collections.OrderedDict(
          outputs=outputs.stack(), labels=labels.stack(),
          counts=counts.stack())

    if self._fine_tune:
      return lambda w, s, t, d: run_shard(w, s, d, t)
    return lambda w, s, d: run_shard(w, s, d, None)

  def __call__(self, weights, client_states, *data) -> list:
    """`(weights, states, datasets)`, or `(weights, states, train, datasets)`
    when built with a fine-tuning optimizer."""
    if len(data) != (2 if self._fine_tune else 1):
      raise ValueError(
          f'expected {"(train_data, datasets)" if self._fine_tune else "(datasets)"}'
          f' after the client states, got {len(data)} arguments')
    datasets = data[-1]
    for d in data:
      if len(client_states) != len(d):
        raise ValueError(f'{len(client_states)} client states for '
                         f'{len(d)} datasets')
    if not datasets:
      return []
    to_tensors = lambda x: tf.nest.map_structure(tf.convert_to_tensor, x)
    weights = to_tensors(weights)
    ranges = sharded.shard_ranges(len(datasets), self._num_shards)

    def shard_args(r):
      states = to_tensors(sharded.stack_states([client_states[i] for i in r]))
      shard = to_tensors(sharded.pack_datasets([datasets[i] for i in r],
                                               self._element_spec, self._wire))
      if not self._fine_tune:
        return weights, states, shard
      train = to_tensors(sharded.pack_datasets(
          [data[0][i] for i in r], self._element_spec, self._train_wire))
      return weights, states, train, shard

    results = shard_threads.run_concurrently(self._runs, self._build,
                                [shard_args(r) for r in ranges])
    out = []
    for r, result in zip(ranges, results):
      counts = result['counts'].numpy()
      outputs, labels = result['outputs'].numpy(), result['labels'].numpy()
      out.extend(collections.OrderedDict(outputs=outputs[u, :counts[u]],
                                         labels=labels[u, :counts[u]])
                 for u in range(len(r)))
    return out
