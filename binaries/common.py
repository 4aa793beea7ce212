"""Flags shared by the experiment binaries, and their translation to configs.

Flags are grouped (task, algorithm, training, privacy, output) and all their
values are written into summary.json.
"""

import errno
import json
import math
import os
import sys
from typing import Callable, Optional, Sequence

from absl import app
from absl import flags
from absl import logging
import tensorflow as tf

from tasks import mnist_io
from tasks import registry as task_registry
from tff_personal.algorithms import defaults as algorithm_defaults
from tff_personal.algorithms import registry as algorithm_registry
from tff_personal.config import experiment
from tff_personal.config import matrix
from tff_personal.config import run_spec
from tff_personal.core import atomic_io
from tff_personal.core import client_state as client_state_lib
from tff_personal.core import options as options_lib
from tff_personal.core import privacy
from tff_personal.core import runtime
from tff_personal.core import training_loop
from tff_personal.core import worker_threads
from tff_personal.evaluation import run_evaluation as run_evaluation_lib
from tff_personal.records import run_lock
from tff_personal.records import run_records
from tff_personal.run import runs

FLAG_GROUPS = {}


def _group(name, flag_names):
  FLAG_GROUPS[name] = flag_names


def define_flags():
  """Defines every flag of the experiment binaries (idempotent per process)."""
  if 'task' in flags.FLAGS:
    return
  flags.DEFINE_string(
      'spec', None,
      'A run stated as a run_spec.RunSpec JSON file (RunSpec.to_dict, e.g. '
      'runs.Run.open(directory).spec.to_dict()): it sets the task, the '
      'algorithm, their options and every run setting, so those flags may '
      'not be given beside it (--data_dir, --data_seed, --use_gpu, '
      '--workers and the thread flags may).')
  # Task.
  flags.DEFINE_string('task', 'mnist_preference',
                      f'The federated task: one of {task_registry.TASKS} '
                      '(tasks/registry.py), or your own as '
                      'package.module:factory (docs/your_own_task.md). '
                      '`binaries.train --list` shows which algorithms run '
                      'on which task.')
  flags.DEFINE_list('task_options', [],
                    'The task builder\'s own settings as key=value (Python '
                    'literals), e.g. alpha=0.1,num_clients=50 for '
                    'label_skew_mnist; an unknown name is refused and the '
                    'error lists the task\'s options (tasks/registry.py).')
  flags.DEFINE_integer('data_seed', None,
                       'Seed of the task\'s data (which examples each user '
                       'holds, and their shuffling); default: --seed. Vary '
                       '--seed with --data_seed fixed to vary training only.')
  flags.DEFINE_string('data_dir', None,
                      'Directory of the task data files (e.g. '
                      '../shared/data/mnist). None: download with '
                      'tensorflow-datasets where a network is available.')
  flags.DEFINE_integer('num_users', 9000, 'Population size.')
  flags.DEFINE_enum('population', 'balanced', ['balanced', 'imbalanced'],
                    'Sub-population proportions.')
  flags.DEFINE_integer('batch_size', 10, 'Local batch size.')
  flags.DEFINE_integer('local_epochs', 1, 'Local epochs per round.')
  flags.DEFINE_integer('max_chars', 100,
                       'speaker_context: characters kept per document.')
  flags.DEFINE_integer('lstm_units', 32,
                       'speaker_context: BLSTM units per direction.')
  flags.DEFINE_float('cold_fraction', 0.1,
                     'speaker_context: users held out of training and '
                     'evaluated with cold start.')
  flags.DEFINE_string('encoder_weights', None,
                      'speech_preference: an encoder pre-trained on public '
                      'speakers (binaries.pretrain_speech_encoder) that the '
                      'shared encoder starts from (None: random, the paper).')
  flags.DEFINE_bool('freeze_encoder', False,
                    'speech_preference: keep the encoder at '
                    '--encoder_weights; only heads, prototypes and private '
                    'state train (and only they are noised under DP).')
  flags.DEFINE_enum('speech_encoder', 'b2', ['b2', 'spectral', 'spectrum'],
                    'speech_preference: b2, the Appendix B.2 convolutions (the '
                    'paper); ours: spectral, each utterance\'s mean '
                    'log-spectrum over its louder frames (no weights) and one '
                    'Dense layer of 64 (5% of B.2\'s encoder weights); '
                    'spectrum, that spectrum standardised, no weights at all '
                    '(models/fedembed_speech.build_spectral_encoder).')
  flags.DEFINE_bool('verify_data_checksums', True,
                    'Check MNIST files against their canonical md5 the first '
                    'time a file is read (remembered per file in '
                    '~/.cache/tff_personal; tasks/mnist_io.py). '
                    '--noverify_data_checksums uses a modified copy on '
                    'purpose.')
  _group('task', ['task', 'task_options', 'data_seed', 'data_dir',
                  'verify_data_checksums', 'num_users', 'population',
                  'batch_size', 'local_epochs', 'max_chars', 'lstm_units',
                  'cold_fraction', 'encoder_weights', 'freeze_encoder',
                  'speech_encoder'])
  # Algorithm.
  flags.DEFINE_string('algorithm', 'global_plus',
                      f'One of {sorted(algorithm_registry.ALGORITHMS)}, or '
                      'your own AlgorithmSpec as package.module:attribute.')
  flags.DEFINE_integer('embedding_dim', None,
                       'Personal (private) embedding size; default: the '
                       "algorithm's (global_plus 28, furl 32).")
  flags.DEFINE_enum('personal_init', 'model', ['model', 'normal'],
                    'How a never-trained client\'s private state starts: '
                    'model, each private variable from the model\'s own Keras '
                    'initializer seeded by (seed, client id); normal, '
                    'N(0, --personal_init_stddev^2) whatever the layer. An '
                    'algorithm that sets its own (Ditto, APFL: the initial '
                    'global model) keeps it.')
  flags.DEFINE_float('personal_init_stddev', 0.1,
                     'The stddev of --personal_init=normal.')
  flags.DEFINE_float('client_learning_rate', 1e-3, 'Local learning rate.')
  flags.DEFINE_enum('client_optimizer', 'adam', ['adam', 'sgd'],
                    'Local optimizer of the shared (and, without '
                    '--private_learning_rate, the private) parameters.')
  flags.DEFINE_float('private_learning_rate', None,
                     'Local learning rate of the private parameters, with '
                     '--private_optimizer (default: the client optimizer '
                     'at --client_learning_rate).')
  flags.DEFINE_enum('private_optimizer', 'adam', ['adam', 'sgd'],
                    'The private parameters\' local optimizer at '
                    '--private_learning_rate (and of fine-tuning at '
                    'evaluation).')
  flags.DEFINE_enum('server_optimizer', 'sgd', ['adam', 'sgd'],
                    'Server optimizer. sgd with lr 1 is FedAvg. FedEmbed '
                    'Appendix B.1 uses Adam with lr 1 on averaged gradients; '
                    'on averaged model deltas that diverges '
                    '(docs/papers/fedembed.md).')
  flags.DEFINE_float('server_learning_rate', 1.0, 'Server learning rate.')
  flags.DEFINE_float('server_momentum', 0.0,
                     'Heavy-ball momentum of --server_optimizer=sgd, in '
                     '[0, 1) (0: plain FedAvg server step).')
  flags.DEFINE_list('algorithm_options', [],
                    'The algorithm builder\'s own options as key=value '
                    '(Python literals), e.g. lam=15,inner_steps=5 for pfedme, '
                    'head_epochs=5 for fedrep; an unknown name is refused and '
                    'the error lists the algorithm\'s options '
                    '(tff_personal/algorithms/registry.py).')
  _group('algorithm', ['algorithm', 'embedding_dim', 'personal_init',
                       'personal_init_stddev',
                       'client_learning_rate', 'client_optimizer',
                       'private_learning_rate', 'private_optimizer',
                       'server_optimizer',
                       'server_learning_rate', 'server_momentum',
                       'algorithm_options'])
  # Training.
  flags.DEFINE_integer('rounds', 5, 'Training rounds.')
  flags.DEFINE_integer('clients_per_round', 20, 'Cohort size.')
  flags.DEFINE_enum('sampling', 'fixed_size', list(training_loop.SAMPLING_SCHEMES),
                    'Cohort sampling scheme (also what DP accounting assumes).')
  flags.DEFINE_integer('seed', 0,
                       'Seed of sampling, initialisation and the evaluated '
                       'users (and of the data, unless --data_seed).')
  flags.DEFINE_integer('eval_every', 0, 'Evaluate every N rounds (0: at end).')
  flags.DEFINE_integer('eval_clients', 0,
                       'Clients evaluated (0: the whole population).')
  flags.DEFINE_integer('curve_eval_clients', 0,
                       'Clients tested at the evaluations before the last '
                       'round (a seeded subset of the evaluated clients; '
                       '0: all of them). The last evaluation tests all.')
  flags.DEFINE_integer('checkpoint_every', 1, 'Checkpoint every N rounds.')
  flags.DEFINE_integer('keep_checkpoints', 3,
                       'Newest checkpoints kept in each run directory.')
  flags.DEFINE_bool('eval_fine_tune', False,
                    'Before testing, each evaluated client trains only its '
                    'private variables for one local pass on its own '
                    'training data (test-time personalization).')
  flags.DEFINE_multi_string(
      'eval_strategies', [],
      'A named personalization strategy evaluated next to the run\'s own '
      'evaluation, [name=]kind[(field=value,...)] (repeat the flag for '
      'more): none; fine_tune(epochs=,learning_rate=,optimizer=sgd|adam); '
      'adapt(samples=k): the algorithm\'s own adaptation on k samples (0: '
      'none); '
      'cold_start(start=initial|dp_average,samples=1/5/all,'
      'noise_multiplier=,clip_norm=,delta=): the withheld users as new '
      'users. See tff_personal/config/strategies.py.')
  flags.DEFINE_integer('cold_start_epochs', 5,
                       'Local epochs of private-state fine-tuning for users '
                       'who never trained (tasks with cold-start users).')
  flags.DEFINE_bool('resume', False, 'Resume from the last checkpoint.')
  flags.DEFINE_enum('client_state_backend', 'auto', ['auto', 'memory', 'sqlite'],
                    'Client-state store (auto: sqlite above 100,000 clients).')
  flags.DEFINE_bool('train_metrics', True,
                    'Release training-metric sums (loss, accuracy: not '
                    'noised, so not covered by DP; under --dp only with '
                    '--release_unnoised_metrics).')
  flags.DEFINE_integer(
      'simulation_shards', -1,
      'Training simulation: 0 runs one user per TFF client (as deployed); '
      'n > 0 runs each round\'s users in n shards inside n TFF client '
      'computations (same results, much faster; core/sharded.py); -1 (auto): '
      'the CPUs this process may use ($TFF_PERSONAL_AUTO_SHARDS if set) when '
      'the algorithm supports sharding, else 0.')
  flags.DEFINE_bool(
      'simulation_batched', False,
      'Train each shard\'s users together, weights stacked along a user '
      'axis (core/batched.py; the same results up to float rounding). '
      'Covers global, fedavg_ft, knn_per, fedper, lg_fedavg and ditto on '
      'chains of dense, convolution, LayerNorm, embedding and LSTM layers '
      '(so groupfl\'s FedAvg stages), fedembed_prototype and fedembed_type, '
      'and fedperc and fedperc_frozen; anything else is refused saying '
      'why.')
  flags.DEFINE_integer(
      'simulation_batch_users', 25,
      'With --simulation_batched: the most users trained together; each '
      'shard runs its users in groups of this size, one after another, so '
      'that a group\'s per-user weights and optimizer slots stay in the '
      'CPU\'s cache (docs/performance.md). 0: all of a shard\'s users at '
      'once.')
  flags.DEFINE_enum(
      'simulation_round', 'auto', list(experiment.ROUND_FORMS),
      'Where a training round runs. inprocess: its compiled production '
      'pieces (MapReduceForm) as TensorFlow functions in this process, '
      'without TFF\'s runtime (core/inprocess.py): sharded, the shards\' '
      'work in the driver and the aggregation, DP noise and server step '
      'from the compiled pieces; with --simulation_shards=0, each user\'s '
      'device program too. tff: on TFF\'s runtime (the reference form). '
      'auto: inprocess for the algorithms --list says it covers when the '
      'run is sharded, else tff. The same results up to float rounding.')
  flags.DEFINE_bool('use_gpu', False,
                    'Allow TF to place client computations on a GPU. Off by '
                    'default; CPU is what the tests and CI use.')
  flags.DEFINE_list('workers', [],
                    'host:port,... of running TFF executor services '
                    '(python -m binaries.worker --port=N); each round\'s '
                    'clients are split across them. Empty: a local worker.')
  flags.DEFINE_integer(
      'intra_op_threads', worker_threads.DEFAULT_INTRA_OP_THREADS,
      'TensorFlow threads per op in the local worker_binary; -1: '
      'TensorFlow\'s default (every core for each op). 1 suits concurrent '
      'client computations (core/worker_threads.py).')
  flags.DEFINE_integer(
      'inter_op_threads', worker_threads.DEFAULT_INTER_OP_THREADS,
      'Ops run at once in the local worker_binary; 0: the CPU count; -1: '
      'TensorFlow\'s default.')
  _group('training', ['rounds', 'clients_per_round', 'sampling', 'seed',
                      'eval_every', 'eval_clients', 'curve_eval_clients',
                      'checkpoint_every', 'keep_checkpoints',
                      'eval_fine_tune', 'eval_strategies',
                      'cold_start_epochs', 'resume', 'client_state_backend',
                      'train_metrics',
                      'use_gpu', 'workers', 'simulation_shards',
                      'simulation_batched', 'simulation_batch_users',
                      'simulation_round', 'intra_op_threads',
                      'inter_op_threads'])
  # Privacy.
  flags.DEFINE_enum('dp', 'none', list(privacy.MECHANISMS),
                    'User-level DP of the shared update: gaussian_fixed and '
                    'gaussian_adaptive noise it centrally (a trusted '
                    'aggregator); distributed_dgauss and '
                    'distributed_skellam noise it on the devices and sum it '
                    'by secure aggregation (the distributed discrete '
                    'Gaussian, Skellam; --sampling=fixed_size).')
  flags.DEFINE_float('noise_multiplier', None,
                     'Noise std / clip norm (or give --target_epsilon).')
  flags.DEFINE_float('clip_norm', 1.0, 'L2 clip of a client\'s whole update.')
  flags.DEFINE_float('target_delta', None, 'Delta (default < 1/population).')
  flags.DEFINE_float('target_epsilon', None,
                     'Calibrate the noise multiplier to this epsilon.')
  flags.DEFINE_enum(
      'dp_personal_heads', 'exempt', list(experiment.DP_PERSONAL_HEADS),
      'exempt: private state is never noised (it never leaves the device). '
      'noised: FedEmbed\'s Algorithm 1 as we read it: each local pass\'s '
      'change of a personal head (FedRep, pFedMe, FedEmbed-Personal; not a '
      'personal embedding) is clipped to --clip_norm and noised at the '
      'shared noise multiplier; its epsilon is reported. Needs '
      '--dp=gaussian_fixed (tff_personal/core/private_noise.py).')
  flags.DEFINE_bool(
      'release_unnoised_metrics', False,
      'Under --dp, also release values epsilon does not cover, without '
      'noise, as simulation diagnostics: the training-metric sums and, '
      'under --sampling=poisson, each round\'s cohort size. Off, a DP run '
      'releases only what epsilon covers, public values, timings and the '
      'held-out evaluation, each labelled in summary.json\'s '
      'privacy.released. No effect without --dp.')
  _group('privacy', ['dp', 'noise_multiplier', 'clip_norm', 'target_delta',
                     'target_epsilon', 'dp_personal_heads',
                     'release_unnoised_metrics'])
  # Output.
  flags.DEFINE_string('root_output_dir', '/tmp/tff_personal',
                      'Root of experiment directories.')
  flags.DEFINE_string('experiment_name', 'experiment', 'Experiment name.')
  _group('output', ['root_output_dir', 'experiment_name'])


def flag_values(flag_values_obj) -> dict:
  """Grouped flag values for summary.json."""
  return {group: {name: flag_values_obj[name].value for name in names}
          for group, names in FLAG_GROUPS.items()}


def _check_finite(f) -> None:
  """Refuses a NaN or infinite value of any numeric flag and an integer
  flag outside 32 bits (`options.INT_LIMIT`), naming it."""
  for names in FLAG_GROUPS.values():
    for name in names:
      value = f[name].value
      if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f'--{name} must be a finite number, got {value}')
      options_lib.check_int_range(f'--{name}', value)


# A run spec's settings -> the flags that give them (binaries.train's),
# beside `run_spec.CONFIG_FIELDS` whose config fields are flags of the same
# name where a flag exists.
_SPEC_FLAGS = {('privacy', 'mechanism'): 'dp',
               **{('privacy', f): f for f in (
                   'noise_multiplier', 'target_epsilon', 'clip_norm',
                   'target_delta')}}


def _flags_from_spec(f) -> None:
  """Sets the run's flags from `--spec` (a `run_spec.RunSpec` JSON file).

  Raises:
    ValueError: the file is unreadable or not a valid spec (naming it), a
      run flag is given beside it, or the spec sets what no flag can give.
  """
  values = atomic_io.read_json(f.spec)  # Names the file when unreadable.
  try:
    spec = run_spec.RunSpec.from_dict(values)
  except ValueError as e:
    raise ValueError(f'--spec={f.spec}: {e}') from e
  values = {'task': spec.task, 'algorithm': spec.algorithm}
  for (section, field), config_field in {
      **run_spec.CONFIG_FIELDS, **_SPEC_FLAGS}.items():
    value = getattr(getattr(spec, section), field)
    if config_field in f:
      values[config_field] = (list(value) if isinstance(value, tuple)
                              else value)
    elif value != getattr(run_spec.SECTIONS[section](), field):
      raise ValueError(
          f'--spec={f.spec}: {section}.{field}={value!r} has no flag of '
          'binaries.train; run the spec from Python: '
          'runs.run_experiment(task, spec.resolve(task))')
  extra = run_spec.Privacy().target_unclipped_quantile
  if spec.privacy.target_unclipped_quantile != extra:
    raise ValueError(f'--spec={f.spec}: privacy.target_unclipped_quantile '
                     'has no flag of binaries.train')
  task_options = dict(spec.task_options)
  for name in _TASK_FLAGS:  # The task settings that are flags of their own.
    if name in task_options:
      values[name] = task_options.pop(name)
  for key, options in (('task_options', task_options),
                       ('algorithm_options', spec.algorithm_options)):
    for name, value in options.items():
      if ',' in str(value):
        raise ValueError(f'--spec={f.spec}: {key}.{name}={value!r} holds a '
                         'comma, which a list flag cannot carry')
    values[key] = [f'{k}={v!r}' for k, v in options.items()]
  given = sorted(name for name in values if not f[name].using_default_value)
  if given:
    raise ValueError(f'--spec={f.spec} states the run; ' + ', '.join(
        f'--{n}' for n in given) + ' given beside it: change them in the '
        'spec, or give the run as flags alone')
  for name, value in values.items():
    try:
      setattr(f, name, value)
    except flags.Error as e:  # An enum flag's value, say.
      raise ValueError(f'--spec={f.spec}: {name}={value!r}: '
                       f'{" ".join(str(e).split())}') from e


def configs_from_flags(f):
  """Builds the experiment config and task arguments; validates early.

  Flags not given take the (task, algorithm) reproduction defaults of
  `tff_personal/algorithms/defaults.py` first, so that
  `--task=mnist_preference --algorithm=fedembed_prototype` alone runs the
  paper's cell. `--spec` sets the flags from a run spec first.
  """
  if f['spec'].value:
    _flags_from_spec(f)
  for flag, registry in (('algorithm', algorithm_registry),
                         ('task', task_registry)):
    try:  # An unknown name, or an outside one that does not load.
      registry.spec(f[flag].value)
    except ValueError as e:
      message = str(e)  # Named once: by its flag.
      named = f'{flag} {f[flag].value!r}: '
      if message.startswith(named):
        message = message[len(named):]
      raise ValueError(f'--{flag}={f[flag].value!r}: {message}') from e
  missing = algorithm_registry.missing_for(
      f.algorithm, task_registry.spec(f.task).capabilities,
      algorithm_registry.parse_algorithm_options(f.algorithm,
                                                 f.algorithm_options))
  if missing:
    raise ValueError(f'--algorithm={f.algorithm} cannot run on '
                     f'--task={f.task}: it needs ' + '; '.join(missing) +
                     ' (binaries.train --list shows every pair)')
  algorithm_defaults.apply_defaults(f, f.task, f.algorithm)
  if f.workers:
    runtime.parse_workers(f.workers)  # A bad address fails before any work.
  _check_finite(f)
  population_from_flags = f.task in ('mnist_preference', 'speech_preference')
  if population_from_flags and f.num_users < 1:
    raise ValueError(f'--num_users must be positive, got {f.num_users}')
  if population_from_flags and f.clients_per_round > f.num_users:
    raise ValueError(f'--clients_per_round={f.clients_per_round} is larger '
                     f'than the population --num_users={f.num_users}')
  if f.noise_multiplier is not None and f.noise_multiplier < 0:
    raise ValueError(f'--noise_multiplier must be >= 0, got '
                     f'{f.noise_multiplier}')
  if f.dp != 'none' and f.noise_multiplier is None and f.target_epsilon is None:
    raise ValueError(f'--dp={f.dp} needs --noise_multiplier or '
                     '--target_epsilon')
  if f.dp == 'none' and (f.noise_multiplier is not None or
                         f.target_epsilon is not None):
    raise ValueError('--noise_multiplier/--target_epsilon given with --dp=none;'
                     ' choose --dp=' + ' or '.join(privacy.MECHANISMS[1:]))
  # The flags are one typed run spec; its config is what the run records.
  spec = run_spec.RunSpec(
      task=f.task, algorithm=f.algorithm,
      algorithm_options=algorithm_registry.parse_algorithm_options(
          f.algorithm, f.algorithm_options),
      loop=run_spec.Loop(
          rounds=f.rounds, clients_per_round=f.clients_per_round,
          sampling=f.sampling, seed=f.seed, embedding_dim=f.embedding_dim,
          personal_init=f.personal_init,
          personal_init_stddev=f.personal_init_stddev,
          checkpoint_every=f.checkpoint_every,
          keep_checkpoints=f.keep_checkpoints, resume=f.resume,
          client_state_backend=f.client_state_backend,
          train_metrics=f.train_metrics),
      optimizers=run_spec.Optimizers(
          client=f.client_optimizer,
          client_learning_rate=f.client_learning_rate,
          private_learning_rate=f.private_learning_rate,
          private=f.private_optimizer,
          server=f.server_optimizer,
          server_learning_rate=f.server_learning_rate,
          server_momentum=f.server_momentum),
      privacy=run_spec.Privacy(
          mechanism=f.dp, noise_multiplier=f.noise_multiplier,
          target_epsilon=f.target_epsilon, clip_norm=f.clip_norm,
          target_delta=f.target_delta, personal_heads=f.dp_personal_heads,
          release_unnoised_metrics=f.release_unnoised_metrics),
      evaluation=run_spec.Evaluation(
          every=f.eval_every, clients=f.eval_clients,
          curve_clients=f.curve_eval_clients, fine_tune=f.eval_fine_tune,
          cold_start_epochs=f.cold_start_epochs,
          strategies=tuple(f.eval_strategies)),
      simulation=run_spec.Simulation(
          shards=f.simulation_shards, batched=f.simulation_batched,
          batch_users=f.simulation_batch_users,
          round=f.simulation_round),
      output=run_spec.Output(f.root_output_dir, f.experiment_name))
  config = spec.config()
  if population_from_flags:  # else validated once the task is loaded
    experiment.validate(config, f.num_users)
  task_kwargs = _task_kwargs(f)
  if (f.encoder_weights or f.freeze_encoder) and f.task != 'speech_preference':
    raise ValueError('--encoder_weights/--freeze_encoder apply to '
                     f'--task=speech_preference only, not {f.task!r}')
  if f.speech_encoder != 'b2' and f.task != 'speech_preference':
    raise ValueError('--speech_encoder applies to --task=speech_preference '
                     f'only, not {f.task!r}')
  if f.speech_encoder != 'b2' and f.encoder_weights:
    raise ValueError('--encoder_weights are Appendix B.2 convolutions; '
                     f'--speech_encoder={f.speech_encoder} has none to load')
  if f.freeze_encoder and not f.encoder_weights:
    raise ValueError('--freeze_encoder needs --encoder_weights (for an '
                     'encoder frozen at random initialisation, write one '
                     'with `pretrain_speech_encoder --epochs=0`)')
  if f.task == 'speech_preference':
    task_kwargs.update(encoder_weights=f.encoder_weights,
                       freeze_encoder=f.freeze_encoder,
                       encoder=f.speech_encoder)
  return config, task_kwargs


# Shared task flags, passed to a task builder that takes them (always for the
# tasks that list them in `TaskSpec.flags`, else only when given).
_TASK_FLAGS = ('num_users', 'population', 'batch_size', 'local_epochs',
               'max_chars', 'lstm_units', 'cold_fraction')


def _task_kwargs(f) -> dict:
  """The task builder's arguments: the data directory, the data seed, the
  shared task flags it takes and `--task_options` (checked)."""
  task_spec = task_registry.spec(f.task)
  kwargs = dict(data_dir=f.data_dir,
                seed=f.seed if f.data_seed is None else f.data_seed)
  given = set()
  for name in _TASK_FLAGS:
    explicit = not f[name].using_default_value
    if name in task_spec.flags or (
        explicit and task_registry.accepts(f.task, name)):
      kwargs[name] = f[name].value
      if explicit:
        given.add(name)
  options = task_registry.parse_task_options(f.task, f.task_options)
  both = sorted(given & set(options))
  if both:
    raise ValueError(f'{both} given both as flags and in --task_options; '
                     'give each once')
  kwargs.update(options)
  return kwargs


def listing(tasks: Sequence[str] = (), algorithms: Sequence[str] = ()
            ) -> str:
  """The algorithm x task matrix, then each algorithm's and task's options.

  `tasks`, `algorithms`: outside ones (`package.module:attribute`) to list
  with the registered ones.
  """
  lines = ['Algorithms x tasks (yes: runs; no: what the task lacks):', '',
           matrix.format_matrix(tasks=tasks), '', 'Algorithms:']
  outside = [n for n in algorithms if n not in algorithm_registry.SPECS]
  for name in list(algorithm_registry.SPECS) + outside:
    spec = algorithm_registry.spec(name)
    missing = {t: algorithm_registry.missing_for(
        name, task_registry.spec(t).capabilities)
               for t in task_registry.TASKS + list(tasks)} if (
                   name in outside) else {}
    runs = (f'; runs on: {", ".join(t for t, m in missing.items() if not m)}'
            if name in outside else '')
    batched = '; runs batched (--simulation_batched)' if spec.batched else ''
    batched += ('; rounds run in process (--simulation_round)'
                if not spec.inprocess else '')
    evaluated = (f'; evaluates with {spec.evaluation}' if spec.evaluation
                 else '')
    lines.append(f'  {name} ({spec.family}): {spec.summary}{batched}'
                 f'{evaluated}; options: '
                 + options_lib.describe(algorithm_registry._option_specs(name))  # pylint: disable=protected-access
                 + runs)
  lines += ['', 'Private state, for every algorithm with private variables:',
            '  --personal_init=model|normal: a never-trained client\'s start '
            '(model: the model\'s own initializers, seeded per client; '
            'normal: N(0, --personal_init_stddev^2)); an algorithm that sets '
            'its own (Ditto, APFL) keeps it',
            '  --private_optimizer=adam|sgd at --private_learning_rate: the '
            'personal optimizer (default: the client optimizer)']
  lines += ['', 'Privacy (--dp):',
            '  gaussian_fixed, gaussian_adaptive: central DP, noise added by '
            'a trusted aggregator that sees each clipped update',
            '  distributed_dgauss, distributed_skellam: distributed DP with '
            'secure aggregation (the distributed discrete Gaussian, Kairouz '
            'et al. 2021; Skellam, Agarwal et al. 2021): each device '
            'rotates, clips, rounds and noises its update, the server sees '
            'only the sum; --sampling=fixed_size; runs with one user per '
            'client (not sharded)']
  lines += [f'    {name} does not run them: {spec.distributed_dp}'
            for name, spec in algorithm_registry.SPECS.items()
            if spec.distributed_dp]
  not_inprocess = [f'    {name} does not run in process: {spec.inprocess}'
                   for name, spec in algorithm_registry.SPECS.items()
                   if spec.inprocess]
  lines += ['', 'In-process rounds (--simulation_round=auto|inprocess|tff): '
            'the round\'s compiled production form run in the driver '
            '(core/inprocess.py), the default (auto) for a sharded run; '
            + ('the algorithms below do not run it:' if not_inprocess else
               'every algorithm above, every stage')] + not_inprocess
  lines += ['', 'Tasks:']
  for name in list(task_registry.SPECS) + [
      t for t in tasks if t not in task_registry.SPECS]:
    spec = task_registry.spec(name)
    lines.append(f'  {name}: {spec.summary}; capabilities: '
                 f'{", ".join(spec.capabilities)}; options: '
                 + options_lib.describe(task_registry._option_specs(name)))  # pylint: disable=protected-access
  return '\n'.join(lines)


def main(argv, f, run_fn) -> int:
  """A binary's main: flags -> configs (exit 2 on bad flags), then
  `run_fn(config, task_kwargs)`; unreachable --workers exit 4."""
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  try:
    config, task_kwargs = configs_from_flags(f)
  except ValueError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  try:
    return run_fn(config, task_kwargs)
  except ConnectionError as e:  # --workers unreachable; nothing ran.
    print(f'error: {e}', file=sys.stderr)
    return 4


# What the disk can do to a run, by errno, with what removes the cause; and
# TensorFlow's file errors say the same causes in their messages (the
# strerror text).
_DISK_ERRNOS = {
    errno.ENOSPC: 'free space on its device',
    errno.EDQUOT: 'raise the disk quota',
    errno.EFBIG: 'raise the file-size limit, ulimit -f',
    errno.EROFS: 'make its file system writable',
    errno.EACCES: 'give this user permission to write there',
    errno.EPERM: 'give this user permission to write there',
    errno.EIO: 'check the device',
}
_DISK_MESSAGES = {os.strerror(n): why for n, why in _DISK_ERRNOS.items()}


def disk_error(e: BaseException) -> Optional[str]:
  """One line naming the path and the cause, if the disk caused `e`.

  Looks through `e`'s chain of causes for an `OSError` with one of the
  `_DISK_ERRNOS` or a TensorFlow error whose message holds one's text
  (a checkpoint write); None for anything else.
  """
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    if isinstance(e, OSError) and e.errno in _DISK_ERRNOS:
      path = e.filename or '(path not given)'
      return f'{path}: {e.strerror} ({_DISK_ERRNOS[e.errno]})'
    if isinstance(e, tf.errors.OpError):
      text = ' '.join(str(e.message).split())
      for strerror, why in _DISK_MESSAGES.items():
        if strerror in text:
          return f'{text[:400]} ({why})'
    e = e.__cause__ or e.__context__
  return None


_RESUMABLE_AFTER = ('the state on disk is consistent: remove the cause and '
                    'rerun with --resume')
# Failures of a run's directory or state that end a binary with exit 3.
STATE_ERRORS = (training_loop.CheckpointError,
                client_state_lib.ClientStateStoreError,
                run_lock.ExperimentLockedError, OSError, tf.errors.OpError)


def state_failure(e: BaseException, resumable: bool = False) -> bool:
  """Prints the one `error:` line of a `STATE_ERRORS` failure and returns
  True (the binary exits 3); False for an OS or TensorFlow error the disk
  did not cause (the caller re-raises it). `resumable`: a training run,
  whose state a full disk or a store error leaves consistent; the line
  says so."""
  line = disk_error(e)
  if isinstance(e, (OSError, tf.errors.OpError)) and line is None:
    return False
  hint = resumable and not isinstance(e, (
      training_loop.CheckpointError, run_lock.ExperimentLockedError,
      client_state_lib.CorruptStateError))
  print(f'error: {line or e}' + (f'; {_RESUMABLE_AFTER}' if hint else ''),
        file=sys.stderr)
  return True


def run(config, task_kwargs, f) -> int:
  """Loads the task, runs the experiment in a runtime that always shuts down.

  Returns the exit code: 0 done; 1 training diverged; 2 bad flags or data,
  nothing ran; 3 the run's directory or state cannot be used (a resume
  refused, a damaged or locked store, or the disk: full, read-only, a
  file-size limit, no permission), one line naming the path.
  """
  if not f.use_gpu:
    tf.config.set_visible_devices([], 'GPU')
  if not f['verbosity'].present:  # TFF's checkpoint INFO lines drown progress.
    logging.set_verbosity(logging.WARNING)
  try:
    worker_threads.resolve(f.intra_op_threads, '--intra_op_threads')
    worker_threads.resolve(f.inter_op_threads, '--inter_op_threads')
    if not f.workers:  # Before the task's data start TensorFlow.
      runtime.configure_driver_threads(f.intra_op_threads,
                                       f.inter_op_threads)
    mnist_io.set_verify_checksums(f.verify_data_checksums)
    task = task_registry.build_task(f.task, **task_kwargs)
    resolved = experiment.resolve(task, config)  # Checked once, here.
  except ValueError as e:  # Data errors name the file and what is wrong.
    print(f'error: {e}', file=sys.stderr)
    return 2
  existed = os.path.exists(config.experiment_dir)
  try:
    with run_lock.hold(config.experiment_dir), runtime.local_runtime(
        log_path=os.path.join(config.experiment_dir, 'worker_binary.log'),
        workers=f.workers, intra_op_threads=f.intra_op_threads,
        inter_op_threads=f.inter_op_threads):
      summary = runs.run_experiment(
          task, resolved, log_fn=lambda s: print(s, flush=True),
          flag_values=flag_values(f))
  except training_loop.NonFiniteRoundError as e:
    print(f'error: {e}', file=sys.stderr)
    return 1
  except experiment.ConfigurationError as e:  # Nothing ran.
    if not existed:
      run_lock.remove_if_unused(config.experiment_dir)
    print(f'error: {e}', file=sys.stderr)
    return 2
  except STATE_ERRORS as e:  # One line naming the path.
    if not state_failure(e, resumable=True):
      raise
    return 3
  print(json.dumps({k: summary[k] for k in (
      'task', 'algorithm', 'rounds_completed', 'seconds_per_round', 'eval',
      'privacy')}, indent=1, default=str))
  return 0


# Flags a re-evaluation (binaries.evaluate) may change: those a resumed run
# may change, but the rounds (the run's). Every other flag must be the run's.
EVALUATION_FLAGS = tuple(name for name in run_records.RESUMABLE_FIELDS
                         if name != 'rounds')


def run_evaluation(config, task_kwargs, f, eval_name: str,
                   overwrite: bool = False) -> int:
  """Re-evaluates the finished run of `f`'s flags (binaries.evaluate)."""
  if not f.use_gpu:
    tf.config.set_visible_devices([], 'GPU')
  if not f['verbosity'].present:
    logging.set_verbosity(logging.WARNING)
  summary_path = os.path.join(config.experiment_dir, 'summary.json')
  if os.path.exists(summary_path):
    try:
      recorded = run_records.read_json_record(summary_path).get('flags') or {}
    except ValueError as e:
      print(f'error: {e}', file=sys.stderr)
      return 2
    differences = run_records.flag_differences(
        recorded, flag_values(f), ignore=EVALUATION_FLAGS)
    if differences:
      print(f'error: {summary_path} was trained with other flags:\n  ' +
            '\n  '.join(differences) + '\nPass the run\'s flags; only the '
            'evaluation flags (--eval_fine_tune, --eval_strategies, '
            '--eval_clients, --cold_start_epochs) and the runtime ones may '
            'differ.',
            file=sys.stderr)
      return 2
  try:
    worker_threads.resolve(f.intra_op_threads, '--intra_op_threads')
    worker_threads.resolve(f.inter_op_threads, '--inter_op_threads')
    if not f.workers:  # Before the task's data start TensorFlow.
      runtime.configure_driver_threads(f.intra_op_threads,
                                       f.inter_op_threads)
    mnist_io.set_verify_checksums(f.verify_data_checksums)
    task = task_registry.build_task(f.task, **task_kwargs)
    experiment.validate(config, task.population)
  except ValueError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  def evaluate():
    with run_lock.hold(config.experiment_dir, create=False), (
        runtime.local_runtime(workers=f.workers,
                              intra_op_threads=f.intra_op_threads,
                              inter_op_threads=f.inter_op_threads)):
      return run_evaluation_lib.evaluate_experiment(
          task, config, eval_name, log_fn=lambda s: print(s, flush=True),
          overwrite=overwrite, flag_values=flag_values(f))

  return _report_evaluation(
      evaluate, run_evaluation_lib.evaluation_path(config, eval_name))


def _report_evaluation(evaluate: Callable[[], dict], path: str) -> int:
  """Runs a re-evaluation; prints its record and `path`, or one error line.
  Returns the exit code (0, 2 refused, 3 the run's state)."""
  try:
    record = evaluate()
  except run_evaluation_lib.EvaluationError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  except STATE_ERRORS as e:
    if not state_failure(e):
      raise
    return 3
  print(json.dumps({k: record[k] for k in (
      'eval_name', 'round', 'eval', 'test', 'test_fine_tuned', 'cold_start',
      run_evaluation_lib.STRATEGIES) if k in record}, indent=1, default=str))
  print(f'written: {path}')
  return 0


def evaluate_run_dir(run_dir: str, f, eval_name: str,
                     overwrite: bool = False) -> int:
  """Re-evaluates the finished run in `run_dir` from its own record
  (`runs.Run.open`; binaries.evaluate --run_dir): its task and
  configuration are the run's; the evaluation flags given on the command
  line (`run_records.EVALUATION_FIELDS`) change its evaluation. Exit codes
  as `run_evaluation`."""
  if not f.use_gpu:
    tf.config.set_visible_devices([], 'GPU')
  if not f['verbosity'].present:
    logging.set_verbosity(logging.WARNING)
  changes = {name: f[name].value for name in run_records.EVALUATION_FIELDS
             if name in f and not f[name].using_default_value}
  try:
    worker_threads.resolve(f.intra_op_threads, '--intra_op_threads')
    worker_threads.resolve(f.inter_op_threads, '--inter_op_threads')
    if not f.workers:
      runtime.configure_driver_threads(f.intra_op_threads,
                                       f.inter_op_threads)
    mnist_io.set_verify_checksums(f.verify_data_checksums)
    run = runs.Run.open(run_dir)
    run.task  # pylint: disable=pointless-statement  # Built here: exit 2.
  except runs.DamagedRunError as e:  # The run's record: exit 3.
    print(f'error: {e}', file=sys.stderr)
    return 3
  except ValueError as e:  # RunError, or the task's data.
    print(f'error: {e}', file=sys.stderr)
    return 2
  def evaluate():
    with runtime.local_runtime(workers=f.workers,
                               intra_op_threads=f.intra_op_threads,
                               inter_op_threads=f.inter_op_threads):
      return run.evaluate(eval_name, overwrite=overwrite,
                          log_fn=lambda s: print(s, flush=True), **changes)

  return _report_evaluation(
      evaluate, run_evaluation_lib.evaluation_path(run.config, eval_name))
