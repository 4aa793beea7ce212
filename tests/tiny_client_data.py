"""A tiny ClientData of 4-feature examples and a pooled-loss evaluator, for
tests that train and evaluate on data of one's own in seconds."""

import collections

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tasks import client_data_task
from tasks import registry as task_registry


def client_data(seed: int, num_clients: int = 8, n: int = 12):
  """Clients `c0`.. each with `n` examples: x ~ N(0, 1)^4, y = [x0 + noise
  > 0], drawn from (seed, client index)."""
  ids = [f'c{k}' for k in range(num_clients)]

  def dataset_fn(client_id):
    rng = np.random.default_rng([seed, ids.index(client_id)])
    x = rng.normal(size=(n, 4)).astype(np.float32)
    y = (x[:, 0] + rng.normal(0.5, size=n) > 0).astype(np.int32)
    return tf.data.Dataset.from_tensor_slices(collections.OrderedDict(x=x, y=y))

  return tff.simulation.datasets.ClientData.from_clients_and_tf_fn(
      ids, dataset_fn)


def mean_loss(outputs, ids):
  """Pooled cross-entropy: moves with every fine-tuning step."""
  del ids
  logits = np.concatenate([np.asarray(o['outputs']) for o in outputs])
  labels = np.concatenate([np.asarray(o['labels']) for o in outputs])
  return {'loss': float(tf.reduce_mean(
      tf.keras.losses.sparse_categorical_crossentropy(
          labels, logits, from_logits=True)))}


@task_registry.task_factory(capabilities=('batches',))
def make_task(data_dir, seed=0, num_clients=4):
  """The tiny ClientData as a task of one's own, built in Python."""
  del data_dir
  return client_data_task.ClientDataTask(
      'tiny', client_data(seed, num_clients), client_data(seed + 1,
                                                          num_clients),
      client_data_task.keras_classifier(
          lambda: tf.keras.Sequential([tf.keras.Input((4,)),
                                       tf.keras.layers.Dense(2)])),
      batch_size=4)
