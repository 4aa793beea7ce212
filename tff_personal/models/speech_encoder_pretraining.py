"""Pre-training the Appendix B.2 speech encoder on public speakers (Keras).

Why: under user-level DP at epsilon 10, the 900-user speech population gives
noise on the mean update that swamps a 270k-parameter model trained from
scratch (docs/papers/fedembed.md). The usual remedy
in private learning is to start from a model pre-trained on public data and
train privately only what must be personal (e.g. Tramer & Boneh 2021, Li et
al. 2022 on DP fine-tuning). The paper does not do this; it is our addition,
run as a separate, labelled variant.

Public data: `speech_data.GenerationConfig(voice_set='public')`, utterances
of public sentences spoken by espeak-ng voices that are none of the users'
voices nor their 8 base voices (`speech_voices.PUBLIC_RECIPES`). No user's
data or preference is used. The pretext task is speaker identification (a
softmax over the public voices), the standard way to train a speaker
encoder: it asks the encoder to tell voices apart, which is what a preference
for a voice needs.

The encoder is the 2-channel FedEmbed encoder; in pre-training its second
(personal-embedding) channel is zero, so that channel's first-layer kernel
stays at its initialisation. Written by hand: Keras' `fit` on numpy batches;
nothing in TFF or tfds does this.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import numpy as np
import tensorflow as tf

from tff_personal.models import fedembed_speech


@dataclasses.dataclass(frozen=True)
class PretrainConfig:
  epochs: int = 6
  batch_size: int = 32
  learning_rate: float = 1e-3
  validation_fraction: float = 0.1
  seed: int = 0

  def validate(self):
    if self.epochs < 0 or self.batch_size < 1:
      raise ValueError(f'epochs must be >= 0 and batch_size >= 1, got '
                       f'{self.epochs}, {self.batch_size}')
    if self.learning_rate <= 0:
      raise ValueError(f'learning_rate must be > 0, got {self.learning_rate}')
    if not 0.0 < self.validation_fraction < 1.0:
      raise ValueError('validation_fraction must be in (0, 1), got '
                       f'{self.validation_fraction}')


def build_classifier(num_voices: int, seed: int = 0
                     ) -> tuple[tf.keras.Model, tf.keras.Model]:
  """(speaker classifier, its encoder): uint8 spectrogram -> voice logits."""
  tf.keras.utils.set_random_seed(seed)
  x = tf.keras.Input(shape=fedembed_speech.INPUT_SHAPE[:2], dtype=tf.uint8,
                     name='x')
  unit = tf.cast(x, tf.float32)[..., tf.newaxis] / 255.0
  two = tf.concat([unit, tf.zeros_like(unit)], axis=-1)  # no embedding
  encoder = fedembed_speech.build_encoder('relu', channels=2)
  logits = tf.keras.layers.Dense(num_voices, name='speaker')(encoder(two))
  return tf.keras.Model(x, logits), encoder


def split(num: int, fraction: float, seed: int
          ) -> tuple[np.ndarray, np.ndarray]:
  """Seeded (train, validation) utterance indices."""
  order = np.random.default_rng(seed).permutation(num)
  n_val = max(1, int(round(fraction * num)))
  return np.sort(order[n_val:]), np.sort(order[:n_val])


def pretrain(spectrograms: np.ndarray, voices: np.ndarray, num_voices: int,
             config: PretrainConfig = PretrainConfig(),
             log_fn: Callable[[str], None] = print
             ) -> tuple[tf.keras.Model, dict]:
  """Trains a speaker classifier; returns (its encoder, metrics).

  Args:
    spectrograms: uint8 [N, 200, 375] (a public set, `speech_data.load`).
    voices: int [N] the voice of each utterance, in [0, num_voices).
    num_voices: Classes of the pretext task.
    config: The training settings. `epochs=0` trains nothing: the encoder
      is the seeded initialisation, a control that separates what the
      pre-trained features give from what freezing (fewer noised
      parameters under DP) gives; its accuracy lists are empty.
    log_fn: Receives a line per epoch.

  Returns:
    The encoder and a dict: train and held-out accuracy per epoch, chance,
    seconds, sizes, `untrained` (epochs == 0).
  """
  config.validate()
  voices = np.asarray(voices, np.int32)
  if spectrograms.shape[1:] != fedembed_speech.INPUT_SHAPE[:2]:
    raise ValueError(f'spectrograms must be [N, 200, 375], got '
                     f'{spectrograms.shape}')
  if len(voices) != len(spectrograms) or voices.min() < 0 or (
      voices.max() >= num_voices):
    raise ValueError('voices must give each spectrogram a voice in '
                     f'[0, {num_voices})')
  train_idx, val_idx = split(len(voices), config.validation_fraction,
                             config.seed)
  model, encoder = build_classifier(num_voices, config.seed)
  model.compile(
      optimizer=tf.keras.optimizers.Adam(config.learning_rate),
      loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
      metrics=['accuracy'])
  x_train = np.asarray(spectrograms[train_idx])
  x_val = np.asarray(spectrograms[val_idx])
  start = time.time()
  history = {'train_accuracy': [], 'val_accuracy': []}
  for epoch in range(config.epochs):
    fit = model.fit(x_train, voices[train_idx], batch_size=config.batch_size,
                    epochs=1, shuffle=True, verbose=0)
    _, val_acc = model.evaluate(x_val, voices[val_idx],
                                batch_size=config.batch_size, verbose=0)
    history['train_accuracy'].append(float(fit.history['accuracy'][-1]))
    history['val_accuracy'].append(float(val_acc))
    log_fn(f'epoch {epoch + 1}/{config.epochs}: train accuracy '
           f'{history["train_accuracy"][-1]:.3f}, held-out accuracy '
           f'{val_acc:.3f} (chance {1 / num_voices:.3f}), '
           f'{time.time() - start:.0f} s')
  return encoder, dict(
      history, chance=1.0 / num_voices, num_voices=num_voices,
      train_utterances=len(train_idx), val_utterances=len(val_idx),
      untrained=config.epochs == 0, seconds=time.time() - start,
      config=dataclasses.asdict(config))
