"""Any `tff.simulation.datasets.ClientData` as a task of the one run path.

`ClientDataTask` takes TFF's own federated-data format (a ClientData of
training examples, one of test examples with the same client ids) plus a
model builder, and gives everything `core/task.py` asks of a task: client
batches for the sharded simulation, `tf.data` datasets, metrics and, where a
model encoder is given, FedEmbed's model. Nothing else is needed to run any
compatible algorithm on your data:

  import tensorflow_federated as tff
  from tasks import client_data_task
  from tff_personal.config import experiment
  from tff_personal.run import runs

  train = tff.simulation.datasets.ClientData.from_clients_and_tf_fn(
      ids, lambda cid: my_dataset(cid, 'train'))   # elements OrderedDict(x, y)
  test = tff.simulation.datasets.ClientData.from_clients_and_tf_fn(
      ids, lambda cid: my_dataset(cid, 'test'))
  task = client_data_task.ClientDataTask(
      'mine', train, test, model_builder=client_data_task.keras_classifier(
          lambda: tf.keras.Sequential([...])))
  runs.run_experiment(task, experiment.ExperimentConfig(
      algorithm='ditto', rounds=10, clients_per_round=5,
      root_output_dir='/tmp/out', experiment_name='mine'))

TFF's on-disk formats load into a ClientData with TFF's own readers
(`tff.simulation.datasets.load_and_parse_sql_client_data`, or
`FilePerUserClientData`). Elements are unbatched dicts with at least `x` and
`y`; a `type` feature (an int per example, e.g. the sub-population an example
belongs to) enables FedEmbed's model. Client `i` of the task is
`train_data.client_ids[i]`. Each client's examples are read once into numpy
(kept in a bounded cache), so a round's local epochs are fresh permutations
drawn from (seed, round, client): a resumed run trains on exactly what the
uninterrupted run did.

`label_skew_mnist` and `marked_mnist` (FedDVA's tasks) and
`mnist_client_data` (FedEmbed's MNIST users through TFF's ClientData) are
built here from the MNIST files.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tasks import preference_task
from tff_personal.core import client_data as client_data_lib
from tff_personal.core import split_model
from tff_personal.core import task as task_lib
from tff_personal.core import worker_threads
from tff_personal.models import fedembed

# This process's TensorFlow gets the binaries' thread pools unless set,
# before a task's data start TensorFlow (`worker_threads`).
worker_threads.set_process_defaults()

# (embedding_dim, input_spec) -> SplitModel.
ModelBuilder = Callable[[int, Any], split_model.SplitModel]
# (channels) -> Keras encoder of one example (FedEmbed's feature extractor).
EncoderFn = Callable[[int], tf.keras.Model]


def sparse_ce(batch, logits):
  """Mean sparse softmax cross-entropy of integer labels `batch['y']`."""
  return tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
      batch['y'], logits, from_logits=True))


def keras_classifier(keras_model_fn: Callable[[], tf.keras.Model],
                     loss_fn=sparse_ce) -> ModelBuilder:
  """A `ModelBuilder` from a Keras classifier (x -> logits), all shared.

  The model has no private variables: algorithms that keep their own
  personal copy (Ditto, FedAvg+FT, pFedMe, FedRep) or none (FedAvg) run on
  it; asking it for a personal embedding is refused.
  """

  def build(embedding_dim: int, input_spec) -> split_model.SplitModel:
    if embedding_dim:
      raise ValueError('this task\'s model (a Keras classifier) has no '
                       f'personal embedding; embedding_dim={embedding_dim}')
    return split_model.SplitModel(
        model=keras_model_fn(), private_variables=[], loss_fn=loss_fn,
        input_spec=input_spec)

  return build


def accuracy_sums(batch, logits):
  """Training-metric sums of a classifier (`accuracy_sum`)."""
  correct = tf.equal(tf.argmax(logits, axis=-1, output_type=tf.int32),
                     tf.cast(batch['y'], tf.int32))
  return collections.OrderedDict(
      accuracy_sum=tf.reduce_sum(tf.cast(correct, tf.float32)))


def classification_metrics(per_client_outputs, client_ids) -> dict:
  """Per-client accuracy: its mean over clients (`accuracy_client_mean`;
  `accuracy` is the same value, the name the recorded tables use), spread
  and minimum, and the pooled accuracy over every test example
  (`accuracy_pooled`, what PFLlib and most papers report)."""
  del client_ids
  accs, correct, total = [], 0, 0
  for out in per_client_outputs:
    labels = np.asarray(out['labels'])
    hits = np.asarray(out['outputs']).argmax(-1) == labels
    if len(labels):
      accs.append(float(np.mean(hits)))
    correct, total = correct + int(hits.sum()), total + len(labels)
  accs = np.asarray(accs)
  return collections.OrderedDict(
      accuracy=float(accs.mean()) if accs.size else float('nan'),
      accuracy_std_across_clients=float(accs.std()) if accs.size else
      float('nan'),
      accuracy_min=float(accs.min()) if accs.size else float('nan'),
      accuracy_pooled=correct / total if total else float('nan'),
      accuracy_client_mean=float(accs.mean()) if accs.size else float('nan'),
      clients=int(accs.size))


def _batched_spec(element_spec):
  return tf.nest.map_structure(
      lambda s: tf.TensorSpec([None, *s.shape], s.dtype), element_spec)


@dataclasses.dataclass
class ClientDataTask:
  """A task over a `tff.simulation.datasets.ClientData` (module docstring).

  Attributes:
    name: the task's name (written to summaries).
    train_data: each client's training examples (unbatched dicts of `x`,
      `y`, optionally `type`).
    test_data: each client's test examples, the same client ids.
    model_builder: `(embedding_dim, input_spec) -> SplitModel`, e.g.
      `keras_classifier(...)`.
    batch_size, local_epochs: local training; seed: the shuffling seed.
    metrics_fn: training-metric sums `(batch, outputs) -> OrderedDict`.
    evaluate_fn: `(per_client_outputs, client_ids) -> metrics`.
    fedembed_encoder_fn: with `num_types`, enables FedEmbed's model (one
      head per type; examples need a `type` feature): the encoder of
      `models/fedembed.build_fedembed_model`.
    num_types: the number of example types (FedEmbed's sub-populations).
    supports_personal_embedding: whether `model_builder` takes d > 0.
    has_named_head: whether the model's output layer is named 'head'
      (FedRep's and pFedMe's personal head).
    has_digit_images: whether examples are 28 x 28 x 1 images in [0, 1]
      with a label in 0..9 (what FedDVA's models take).
    cache_clients: how many clients' numpy examples are kept in memory.
    client_groups: each client's group (sub-population), a mapping from
      ClientData client id to group name; gives the `groups` capability
      (GroupFL, GroupPerFL). The groups are named in order of first
      appearance over the client ids.
    withheld_clients: clients kept out of training, evaluated as new users
      (`cold_start`; the `withheld` capability): a count (>= 1) or a
      fraction of the clients (in (0, 1)), drawn by `seed`; 0: none. They
      are not in `population`, and no round or evaluation of the trained
      clients reads them.
  """
  name: str
  train_data: tff.simulation.datasets.ClientData
  test_data: tff.simulation.datasets.ClientData
  model_builder: ModelBuilder
  batch_size: int = 32
  local_epochs: int = 1
  seed: int = 0
  metrics_fn: Callable[..., Any] = accuracy_sums
  evaluate_fn: Callable[..., dict] = classification_metrics
  fedembed_encoder_fn: Optional[EncoderFn] = None
  num_types: Optional[int] = None
  supports_personal_embedding: bool = False
  has_named_head: bool = False
  has_digit_images: bool = False
  cache_clients: int = 4096
  client_groups: Optional[Mapping[str, str]] = None
  withheld_clients: float = 0

  def __post_init__(self):
    if self.batch_size < 1:
      raise ValueError(f'batch_size must be >= 1, got {self.batch_size}')
    if self.local_epochs < 1:
      raise ValueError(f'local_epochs must be >= 1, got {self.local_epochs}')
    self._ids = list(self.train_data.client_ids)
    if not self._ids:
      raise ValueError(f'{self.name}: the training ClientData has no clients')
    self._withheld = _withheld(self._ids, self.withheld_clients, self.seed,
                               self.name)
    if self._withheld:
      held = set(self._withheld)
      self._ids = [c for c in self._ids if c not in held]
    missing = sorted(set(self._ids) - set(self.test_data.client_ids))
    if missing:
      raise ValueError(f'{self.name}: {len(missing)} training clients have no '
                       f'test data, e.g. {missing[:3]}')
    spec = self.train_data.element_type_structure
    for key in ('x', 'y'):
      if not isinstance(spec, dict) or key not in spec:
        raise ValueError(f'{self.name}: examples must be dicts with x and y '
                         f'(and optionally type); got {spec}')
    if (self.fedembed_encoder_fn is not None) != (self.num_types is not None):
      raise ValueError('fedembed_encoder_fn and num_types go together (both '
                       'or neither)')
    if self.num_types is not None and 'type' not in spec:
      raise ValueError(f'{self.name}: FedEmbed\'s model (num_types) needs a '
                       "'type' feature in every example")
    if self.client_groups is not None:
      ungrouped = [c for c in self._ids if c not in self.client_groups]
      if ungrouped:
        raise ValueError(f'{self.name}: {len(ungrouped)} clients have no '
                         f'group in client_groups, e.g. {ungrouped[:3]}')
      self._group_of = [str(self.client_groups[c]) for c in self._ids]
    self._spec = _batched_spec(collections.OrderedDict(
        (k, spec[k]) for k in spec))
    self._named_arrays = functools.lru_cache(maxsize=self.cache_clients)(
        self._read_arrays)

  # How each optional capability is given (named when a pair is refused).
  capability_hints = {
      'named_head': "has_named_head=True, with the model's output layer "
                    "named 'head'",
      'personal_embedding': 'supports_personal_embedding=True, with a '
                            'model_builder that takes embedding_dim > 0',
      'fedembed_model': "fedembed_encoder_fn and num_types (examples with a "
                        "'type' feature)",
      'groups': 'client_groups={client id: group}',
      'digit_images': 'has_digit_images=True (28 x 28 x 1 images in [0, 1], '
                      'labels 0..9)',
  }

  @property
  def population(self) -> int:
    return len(self._ids)

  @property
  def groups(self) -> Optional[Callable[[Sequence[int]], np.ndarray]]:
    """`groups(client_indices) -> their group names` (the `groups`
    capability), or None without `client_groups`."""
    if self.client_groups is None:
      return None
    def groups_of(client_ids: Sequence[int]) -> np.ndarray:
      self._check_ids(client_ids)
      return np.asarray([self._group_of[int(c)] for c in client_ids])
    return groups_of

  @property
  def group_names(self) -> list[str]:
    """The groups in order of first appearance ([] without groups)."""
    if self.client_groups is None:
      return []
    return list(dict.fromkeys(self._group_of))

  @property
  def client_names(self) -> list:
    """The ClientData id of each client index."""
    return list(self._ids)

  @property
  def withheld_names(self) -> Optional[list]:
    """The ClientData ids of the withheld clients (`withheld_clients`), in
    the order `withheld_eval_datasets` indexes them; None (no `withheld`
    capability) when none are withheld."""
    return list(self._withheld) if self._withheld else None

  def _withheld_name(self, i) -> str:
    if not 0 <= int(i) < len(self._withheld):
      raise ValueError(f'{self.name}: withheld client index {i} is not in '
                       f'[0, {len(self._withheld)})')
    return self._withheld[int(i)]

  def withheld_adaptation_datasets(self, ids: Sequence[int],
                                   samples: Optional[int] = None
                                   ) -> list[tf.data.Dataset]:
    """Withheld clients `ids` (indices of `withheld_names`): the first
    `samples` of each one's training examples (None: all), in the task's
    batches, the data a new user adapts on."""
    if samples is not None and samples < 0:
      raise ValueError(f'samples must be >= 0 or None (all), got {samples}')
    out = []
    for i in ids:
      examples = self._named_arrays(self._withheld_name(i), 'train')
      n = len(examples['y']) if samples is None else min(
          samples, len(examples['y']))
      out.append(client_data_lib.ClientBatches.from_arrays(
          examples, self.batch_size, [np.arange(n)], self._spec
      ).to_dataset())
    return out

  def withheld_eval_datasets(self, ids: Sequence[int],
                             samples: Optional[int] = None
                             ) -> list[tf.data.Dataset]:
    """Withheld clients `ids`: each one's test examples (adaptation reads
    `withheld_adaptation_datasets`; `samples` is checked only)."""
    if samples is not None and samples < 0:
      raise ValueError(f'samples must be >= 0 or None (all), got {samples}')
    out = []
    for i in ids:
      examples = self._named_arrays(self._withheld_name(i), 'test')
      out.append(client_data_lib.ClientBatches.from_arrays(
          examples, self.batch_size, [np.arange(len(examples['y']))],
          self._spec).to_dataset())
    return out

  @property
  def element_spec(self):
    return self._spec

  def model_fn_factory(self, embedding_dim: int) -> split_model.SplitModelFn:
    spec = self.element_spec
    return lambda: self.model_builder(embedding_dim, spec)

  @property
  def fedembed_model_fn_factory(self):
    """FedEmbed's model on this task (None without an encoder)."""
    if self.fedembed_encoder_fn is None:
      return None
    spec = self.element_spec
    shape = tuple(spec['x'].shape[1:])

    def factory(config: fedembed.FedEmbedConfig) -> split_model.SplitModelFn:
      config = fedembed.with_task_subpopulations(config, self.num_types)
      return lambda: fedembed.build_fedembed_model(
          config, encoder_fn=self.fedembed_encoder_fn, input_shape=shape,
          input_spec=spec)

    return factory

  def _arrays(self, client: int, split: str):
    """Client index `client`'s examples of `split` (numpy, cached)."""
    return self._named_arrays(self._ids[client], split)

  def _read_arrays(self, cid: str, split: str):
    data = self.train_data if split == 'train' else self.test_data
    ds = data.create_tf_dataset_for_client(cid)
    spec = self._spec
    batch = ds.batch(1 << 30).get_single_element() if (
        ds.cardinality() != 0) else None
    if batch is None:
      return collections.OrderedDict(
          (k, np.zeros([0, *s.shape[1:]], s.dtype.as_numpy_dtype))
          for k, s in spec.items())
    return collections.OrderedDict(
        (k, np.asarray(batch[k], spec[k].dtype.as_numpy_dtype))
        for k in spec)

  def _check_ids(self, client_ids):
    for c in client_ids:
      if not 0 <= int(c) < len(self._ids):
        raise ValueError(f'{self.name}: client index {c} is not in '
                         f'[0, {len(self._ids)})')

  def train_batches(self, client_ids: Sequence[int], round_num: int
                    ) -> list[client_data_lib.ClientBatches]:
    """Each client's local epochs of a round, fresh permutations seeded by
    (seed, round, client) as the preference tasks draw them (so the same
    users give the same batches through either task)."""
    self._check_ids(client_ids)
    out = []
    for c in client_ids:
      examples = self._arrays(int(c), 'train')
      n = len(examples['y'])
      rng = np.random.default_rng(
          preference_task.shuffle_seed(self.seed, round_num, int(c)))
      orders = [rng.permutation(n) for _ in range(self.local_epochs)]
      out.append(client_data_lib.ClientBatches.from_arrays(
          examples, self.batch_size, orders, self._spec))
    return out

  def train_datasets(self, client_ids: Sequence[int], round_num: int
                     ) -> list[tf.data.Dataset]:
    return [b.to_dataset() for b in self.train_batches(client_ids, round_num)]

  def eval_batches(self, client_ids: Sequence[int]
                   ) -> list[client_data_lib.ClientBatches]:
    self._check_ids(client_ids)
    out = []
    for c in client_ids:
      examples = self._arrays(int(c), 'test')
      out.append(client_data_lib.ClientBatches.from_arrays(
          examples, self.batch_size, [np.arange(len(examples['y']))],
          self._spec))
    return out

  def eval_datasets(self, client_ids: Sequence[int]) -> list[tf.data.Dataset]:
    return [b.to_dataset() for b in self.eval_batches(client_ids)]

  def evaluate(self, per_client_outputs, client_ids) -> dict:
    return self.evaluate_fn(per_client_outputs, client_ids)


def _withheld(ids: Sequence[str], withheld: float, seed: int,
              name: str) -> list[str]:
  """The client ids `withheld_clients` keeps out of training: a seeded
  draw of a count or a fraction of `ids` (`task.choose_withheld`), in
  their order."""
  return [ids[k] for k in task_lib.choose_withheld(len(ids), withheld, seed,
                                                    name)]


def from_client_arrays(train: Sequence[dict], test: Sequence[dict],
                       names: Optional[Sequence[str]] = None
                       ) -> tuple[tff.simulation.datasets.ClientData,
                                  tff.simulation.datasets.ClientData]:
  """Training and test `ClientData` from per-client dicts of numpy arrays."""
  names = list(names) if names is not None else [
      f'client_{k}' for k in range(len(train))]
  if not len(names) == len(train) == len(test):
    raise ValueError(f'{len(names)} names for {len(train)} training and '
                     f'{len(test)} test clients')
  index = {n: k for k, n in enumerate(names)}
  if len(index) != len(names):
    raise ValueError('client names must be distinct')

  def make(arrays):
    def dataset_fn(cid):
      return tf.data.Dataset.from_tensor_slices(
          collections.OrderedDict(arrays[index[cid]]))
    return tff.simulation.datasets.ClientData.from_clients_and_tf_fn(
        names, dataset_fn)

  return make(train), make(test)


def _feddva_cnn(channels: Sequence[int], hidden: int) -> ModelBuilder:
  # Lazy: FedDVA's models module is only needed by these two tasks.
  from tff_personal.models import feddva  # pylint: disable=g-import-not-at-top
  config = feddva.FeddvaConfig(channels=tuple(channels), hidden=hidden)

  def build(embedding_dim: int, input_spec) -> split_model.SplitModel:
    if embedding_dim:
      raise ValueError('the CNN classifier has no personal embedding; '
                       f'embedding_dim={embedding_dim}')
    model = feddva.build_cnn_classifier(config, output_name='head')
    return dataclasses.replace(model, input_spec=input_spec)

  return build


def from_feddva_task(name: str, feddva_task, *, batch_size: int,
                     local_epochs: int, seed: int, channels, hidden: int,
                     withheld_clients: float = 0) -> ClientDataTask:
  """A `tasks/feddva_tasks` task's clients as a `ClientDataTask` (the same
  images and labels), classified by Appendix G's CNN with `channels` (four
  ints) and `hidden`."""
  train, test = from_client_arrays(
      [dict(x=c.train_x, y=c.train_y) for c in feddva_task.clients],
      [dict(x=c.test_x, y=c.test_y) for c in feddva_task.clients],
      feddva_task.client_names)
  return ClientDataTask(name, train, test,
                        model_builder=_feddva_cnn(channels, hidden),
                        batch_size=batch_size, local_epochs=local_epochs,
                        seed=seed, has_named_head=True,
                        has_digit_images=True,
                        withheld_clients=withheld_clients)


def label_skew_mnist_task(data_dir: Optional[str], *, num_clients: int = 20,
                          train_per_client: int = 200,
                          test_per_client: int = 100, alpha: float = 0.5,
                          seed: int = 0, batch_size: int = 64,
                          local_epochs: int = 1,
                          channels: str = '16,16,32,32', hidden: int = 128,
                          withheld_clients: float = 0) -> ClientDataTask:
  """FedDVA's classification task: MNIST with Dirichlet(alpha) label skew,
  classified by Appendix G's CNN (`channels` of its four convolutions);
  `withheld_clients` as `ClientDataTask`'s."""
  from tasks import feddva_tasks  # pylint: disable=g-import-not-at-top
  return from_feddva_task('label_skew_mnist', feddva_tasks.label_skew_mnist(
      data_dir, num_clients=num_clients, train_per_client=train_per_client,
      test_per_client=test_per_client, alpha=alpha, seed=seed),
                      batch_size=batch_size, local_epochs=local_epochs,
                      seed=seed, channels=_ints(channels, 'channels'),
                      hidden=hidden, withheld_clients=withheld_clients)


def marked_mnist_task(data_dir: Optional[str], *, num_clients: int = 4,
                      train_per_client: int = 500, test_per_client: int = 200,
                      marks: str = 'varied', seed: int = 0,
                      batch_size: int = 64, local_epochs: int = 1,
                      channels: str = '16,16,32,32', hidden: int = 128,
                      withheld_clients: float = 0) -> ClientDataTask:
  """FedDVA's marked MNIST (each client's images carry its own kind of
  mark), classified by Appendix G's CNN; `withheld_clients` as
  `ClientDataTask`'s."""
  from tasks import feddva_tasks  # pylint: disable=g-import-not-at-top
  return from_feddva_task('marked_mnist', feddva_tasks.marked_mnist(
      data_dir, num_clients=num_clients, train_per_client=train_per_client,
      test_per_client=test_per_client, seed=seed, marks=marks),
                      batch_size=batch_size, local_epochs=local_epochs,
                      seed=seed, channels=_ints(channels, 'channels'),
                      hidden=hidden, withheld_clients=withheld_clients)


def mnist_client_data_task(data_dir: Optional[str], *, num_users: int = 1000,
                           population: str = 'balanced', seed: int = 0,
                           batch_size: int = 10, local_epochs: int = 1,
                           withheld_clients: float = 0) -> ClientDataTask:
  """FedEmbed's MNIST preference users, handed over as TFF ClientData.

  The same users as `mnist_preference` (each likes one digit; `type` is the
  digit), but through the generic task: what a researcher with data in
  TFF's format gets. Evaluated by per-client accuracy. `withheld_clients`
  as `ClientDataTask`'s.
  """
  from tasks import mnist_preference  # pylint: disable=g-import-not-at-top
  from tff_personal.models import fedembed_mnist  # pylint: disable=g-import-not-at-top
  data = mnist_preference.load_task_data(
      data_dir, num_users=num_users, population=population, seed=seed)
  arrays = {split: [dict(zip(('x', 'y', 'type'), data.user_arrays(u, split)))
                    for u in range(data.num_users)]
            for split in ('train', 'test')}
  train, test = from_client_arrays(arrays['train'], arrays['test'],
                                   [f'user_{u}' for u in range(num_users)])
  return ClientDataTask(
      'mnist_client_data', train, test,
      model_builder=lambda dim, spec: fedembed_mnist.build_preference_model(
          dim, input_spec=spec),
      batch_size=batch_size, local_epochs=local_epochs, seed=seed,
      fedembed_encoder_fn=lambda channels: fedembed_mnist.build_encoder(
          channels=channels),
      num_types=data.num_subpopulations, supports_personal_embedding=True,
      has_named_head=True, withheld_clients=withheld_clients)


def _ints(text: str, name: str) -> tuple[int, ...]:
  try:
    values = tuple(int(v) for v in str(text).split(','))
  except ValueError:
    raise ValueError(f'{name} must be comma-separated integers, got '
                     f'{text!r}') from None
  return values
