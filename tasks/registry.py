"""Task names (the `--task` flag values) and how to build them."""

from __future__ import annotations

from tasks import preference_task
from tasks import speaker_task
from tasks import speech_task

TASKS = ['mnist_preference', 'speaker_context', 'speech_preference']


def build_task(name: str, **kwargs):
  """Builds the named task; a clear error for unknown names."""
  if name == 'mnist_preference':
    return preference_task.mnist_preference_task(
        kwargs.pop('data_dir'), **kwargs)
  if name == 'speaker_context':
    return speaker_task.speaker_context_task(kwargs.pop('data_dir'), **kwargs)
  if name == 'speech_preference':
    return speech_task.speech_preference_task(kwargs.pop('data_dir'), **kwargs)
  raise ValueError(f'unknown task {name!r}; known: {TASKS}')
