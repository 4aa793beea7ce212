"""Child processes that the kernel kills when their parent dies.

`popen(argv, **popen_kwargs)` is `subprocess.Popen(argv, ...)` whose child
gets `PR_SET_PDEATHSIG=SIGKILL` (Linux), so it never outlives the Python
process that started it, `kill -9` of that process included.

Why not `Popen(preexec_fn=...)`: a `preexec_fn` makes `subprocess` fork the
whole process and run Python in the child before `exec`. With gRPC's threads
running (any program that has talked to a TFF worker, e.g. one restarting a
dead worker), that fork can abort the child or crash the parent in gRPC. Here
the child is started without a `preexec_fn`, so `subprocess` uses `vfork`
and runs no Python and no fork handler in between; a tiny `python -S` program
sets the death signal in the child and `exec`s the real command (the pid
stays the same). Written by hand: neither `subprocess` nor TFF offers it.

Example:

  proc = parent_death.popen([binary, '--port=8000'],
                            stdin=subprocess.DEVNULL)
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Sequence

# Runs in the child: set the death signal, check that the parent did not die
# before it was set (then the child's parent is no longer the caller), exec.
_SET_AND_EXEC = (
    'import ctypes, os, signal, sys\n'
    'ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)\n'
    'os.getppid() == int(sys.argv[1]) or os._exit(1)\n'
    'os.execv(sys.argv[2], sys.argv[2:])\n')


def command(argv: Sequence[str]) -> list[str]:
  """`argv` wrapped so that the command dies with this process."""
  if not sys.platform.startswith('linux') or not sys.executable:
    raise OSError('a child that dies with its parent needs Linux '
                  '(PR_SET_PDEATHSIG) and a Python executable')
  return [sys.executable, '-S', '-c', _SET_AND_EXEC, str(os.getpid()),
          *[str(a) for a in argv]]


def popen(argv: Sequence[str], **popen_kwargs) -> subprocess.Popen:
  """`subprocess.Popen(argv, **popen_kwargs)`, the child killed (SIGKILL)
  when this process dies; its pid is the command's own.

  Raises:
    ValueError: `popen_kwargs` has a `preexec_fn` (the fork this avoids).
    OSError: not on Linux, or no Python executable to set the signal with.
  """
  if popen_kwargs.get('preexec_fn') is not None:
    raise ValueError('parent_death.popen runs no preexec_fn')
  return subprocess.Popen(command(argv), **popen_kwargs)
