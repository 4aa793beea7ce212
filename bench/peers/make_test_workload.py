r"""Writes a small learnable workload in the benchmark's .npz layout.

For trying the peers without binaries.benchmark (which writes its own):

  python bench/peers/make_test_workload.py --output=/tmp/workload.npz \
      [--population=1000] [--examples_per_client=20] [--seed=0]

Needs only numpy (runs under the project's or the peer's Python).
"""

import argparse
import os
import sys

import numpy as np

if __package__ in (None, ''):  # Run as a file: make `bench.peers` importable.
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__)))))

from bench.peers import peer_workload  # pylint: disable=g-import-not-at-top


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--output', required=True, help='.npz path to write.')
  parser.add_argument('--population', type=int, default=1000)
  parser.add_argument('--examples_per_client', type=int, default=20)
  parser.add_argument('--seed', type=int, default=0)
  args = parser.parse_args(argv)
  if args.population < 1 or args.examples_per_client < 1:
    parser.error('--population and --examples_per_client must be positive')
  x, y = peer_workload.make_learnable_workload(
      args.population, args.examples_per_client, args.seed)
  np.savez(args.output, x=x, y=y)
  print(f'wrote {args.output}: x {x.shape} float32, y {y.shape} int32')
  return 0


if __name__ == '__main__':
  sys.exit(main())
