"""Helpers for tests that check what a program left on disk."""

import hashlib
import os


def tree_digest(path) -> dict[str, str]:
  """Relative path -> SHA-1 of every file below `path` ("changed nothing")."""
  digest = {}
  for dirpath, _, names in os.walk(path):
    for name in names:
      full = os.path.join(dirpath, name)
      with open(full, 'rb') as f:
        digest[os.path.relpath(full, path)] = hashlib.sha1(
            f.read()).hexdigest()
  return digest
