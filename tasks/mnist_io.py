"""Loads MNIST from the canonical IDX files, with validation.

MNIST is distributed as four IDX files (LeCun et al.):

  train-images-idx3-ubyte   magic 0x00000803, dims (60000, 28, 28), uint8
  train-labels-idx1-ubyte   magic 0x00000801, dims (60000,), uint8
  t10k-images-idx3-ubyte    magic 0x00000803, dims (10000, 28, 28), uint8
  t10k-labels-idx1-ubyte    magic 0x00000801, dims (10000,), uint8

An IDX file is a big-endian header (a 4-byte magic number whose third byte is
the element type, 0x08 = unsigned byte, and whose fourth byte is the number of
dimensions, followed by one uint32 per dimension) and then the row-major data.

`load_mnist(data_dir, split)` reads `name.gz` or the uncompressed `name` from
`data_dir`, checks every header against the file's actual size and raises
`MnistDataError` (a `ValueError`) naming the file and the problem for anything
malformed. The first time it reads a file it also checks the md5 of the
uncompressed contents against the canonical one (`MD5`), so that a file with
flipped bytes and a valid header is refused; a verified file is remembered
by its path, size, modification time and inode in a small cache file
(`verified_cache_path()`), so that later loads of the unchanged file pay
nothing. `set_verify_checksums(False)` (the binaries'
`--noverify_data_checksums`) or `load_mnist(..., verify=False)` skips the
check, for a deliberately modified copy. With `data_dir=None` it falls back to `tensorflow_datasets`,
which needs network access for its first download (and checks its own).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import struct
import zlib

from tff_personal.core import atomic_io

import numpy as np

IMAGES_MAGIC = 0x00000803
LABELS_MAGIC = 0x00000801
IMAGE_SHAPE = (28, 28)
NUM_CLASSES = 10

# split -> (images file, labels file), names without the `.gz` suffix.
FILES = {
    'train': ('train-images-idx3-ubyte', 'train-labels-idx1-ubyte'),
    'test': ('t10k-images-idx3-ubyte', 't10k-labels-idx1-ubyte'),
}

# md5 of the *uncompressed* canonical files.
MD5 = {
    'train-images-idx3-ubyte': '6bbc9ace898e44ae57da46a324031adb',
    'train-labels-idx1-ubyte': 'a25bea736e30d166cdddb491f175f624',
    't10k-images-idx3-ubyte': '2646ac647ad5339dbf082846283269ea',
    't10k-labels-idx1-ubyte': '27ae3e4e09519cfbb04c329615203637',
}

_GZIP_MAGIC = b'\x1f\x8b'

_HOW_TO_FIX = (
    'Pass --data_dir pointing at a directory holding the four MNIST IDX files '
    '(train-images-idx3-ubyte[.gz], train-labels-idx1-ubyte[.gz], '
    't10k-images-idx3-ubyte[.gz], t10k-labels-idx1-ubyte[.gz]), e.g. '
    '--data_dir=../shared/data/mnist, or run with network access and no '
    '--data_dir so that tensorflow-datasets can download MNIST.')


class MnistDataError(ValueError):
  """MNIST data is missing, unreadable or malformed."""


def _check_split(split: str) -> None:
  if split not in FILES:
    raise ValueError(f'split must be one of {sorted(FILES)}, got {split!r}.')


def _find_file(data_dir: str, name: str) -> str:
  """Returns the path of `name` (uncompressed preferred) or `name.gz`."""
  for candidate in (name, name + '.gz'):
    path = os.path.join(data_dir, candidate)
    if os.path.isfile(path):
      return path
  raise MnistDataError(
      f'MNIST file not found: neither {os.path.join(data_dir, name)} nor '
      f'{os.path.join(data_dir, name + ".gz")} exists. {_HOW_TO_FIX}')


def _read_bytes(path: str) -> bytes:
  """Returns the (decompressed) contents of an IDX file.

  A `.gz` file must be a gzip stream. A file without the suffix is read as is,
  unless it starts with the gzip magic bytes (IDX files start with two zero
  bytes, so the two cannot be confused), in which case it is decompressed.

  Args:
    path: The file to read.

  Raises:
    MnistDataError: The file cannot be read or its gzip stream is corrupt.
  """
  try:
    with open(path, 'rb') as f:
      raw = f.read()
  except OSError as e:
    raise MnistDataError(f'Cannot read MNIST file {path}: {e}') from e
  is_gz_name = path.endswith('.gz')
  if not is_gz_name and not raw.startswith(_GZIP_MAGIC):
    return raw
  if not raw.startswith(_GZIP_MAGIC):
    raise MnistDataError(
        f'MNIST file {path} is not a gzip stream (it does not start with the '
        'gzip magic bytes 1f 8b; first bytes: '
        f'{raw[:4].hex(" ")}). Re-download it or store it uncompressed '
        'without the .gz suffix.')
  try:
    return gzip.decompress(raw)
  except (OSError, EOFError, zlib.error) as e:
    raise MnistDataError(
        f'MNIST file {path} has a corrupt or truncated gzip stream '
        f'({type(e).__name__}: {e}). Re-download it.') from e


def _parse_idx(data: bytes, path: str, magic: int) -> np.ndarray:
  """Parses and validates an unsigned-byte IDX file.

  Args:
    data: The decompressed file contents.
    path: The file's path, for error messages.
    magic: The expected magic number (`IMAGES_MAGIC` or `LABELS_MAGIC`).

  Returns:
    A uint8 array with the dimensions declared in the header.

  Raises:
    MnistDataError: Bad magic number, truncated file or trailing bytes.
  """
  ndim = magic & 0xFF
  header_len = 4 + 4 * ndim
  if len(data) < 4:
    raise MnistDataError(
        f'MNIST file {path} is truncated: it has {len(data)} bytes, fewer '
        'than the 4-byte IDX magic number.')
  (got_magic,) = struct.unpack('>I', data[:4])
  if got_magic != magic:
    raise MnistDataError(
        f'MNIST file {path} has bad magic number 0x{got_magic:08x}; expected '
        f'0x{magic:08x} (unsigned-byte IDX with {ndim} dimension(s)). Is it '
        'the right file, and not corrupted?')
  if len(data) < header_len:
    raise MnistDataError(
        f'MNIST file {path} is truncated: it has {len(data)} bytes, fewer '
        f'than its {header_len}-byte IDX header.')
  dims = struct.unpack('>' + 'I' * ndim, data[4:header_len])
  expected = int(np.prod(dims, dtype=np.int64))
  actual = len(data) - header_len
  if actual < expected:
    raise MnistDataError(
        f'MNIST file {path} is truncated: its header declares dimensions '
        f'{dims}, i.e. {expected} data bytes, but it holds only {actual}.')
  if actual > expected:
    raise MnistDataError(
        f'MNIST file {path} is malformed: its header declares dimensions '
        f'{dims}, i.e. {expected} data bytes, but it holds {actual} '
        f'({actual - expected} unexpected trailing bytes).')
  return np.frombuffer(data, np.uint8, count=expected,
                       offset=header_len).reshape(dims).copy()


def _read_idx(path: str, magic: int) -> tuple[np.ndarray, bytes]:
  """The parsed array and the uncompressed bytes of an IDX file."""
  data = _read_bytes(path)
  return _parse_idx(data, path, magic), data


_verify = True
CACHE_ENV = 'TFF_PERSONAL_CACHE_DIR'


def set_verify_checksums(enabled: bool) -> None:
  """Whether `load_mnist` checks md5 sums when not told (default True)."""
  global _verify
  _verify = bool(enabled)


def verified_cache_path() -> str:
  """The file that remembers verified data files: `$TFF_PERSONAL_CACHE_DIR`
  or `$XDG_CACHE_HOME/tff_personal` or `~/.cache/tff_personal`, then
  `verified_data.json`."""
  root = os.environ.get(CACHE_ENV) or os.path.join(
      os.environ.get('XDG_CACHE_HOME') or os.path.expanduser('~/.cache'),
      'tff_personal')
  return os.path.join(root, 'verified_data.json')


def _file_key(path: str) -> tuple[str, list[int]]:
  st = os.stat(path)
  return os.path.realpath(path), [st.st_size, st.st_mtime_ns, st.st_ino]


def _read_cache() -> dict:
  try:
    with open(verified_cache_path(), encoding='utf-8') as f:
      cache = json.load(f)
    return cache if isinstance(cache, dict) else {}
  except (OSError, ValueError):  # None yet, or unreadable: verify again.
    return {}


def _verify_once(path: str, data: bytes) -> None:
  """Checks `data` (the uncompressed contents of `path`) against its
  canonical md5, unless the cache holds `path` unchanged since verified.
  A cache that cannot be written only means verifying again next time."""
  name = os.path.basename(path).removesuffix('.gz')
  if name not in MD5:
    return
  real, stat = _file_key(path)
  cache = _read_cache()
  if cache.get(real) == [MD5[name], *stat]:
    return
  digest = hashlib.md5(data).hexdigest()
  if digest != MD5[name]:
    raise MnistDataError(
        f'MNIST file {path} fails its checksum: md5 {digest} (of its '
        f'uncompressed contents), but the canonical {name} has md5 '
        f'{MD5[name]}; its bytes were changed or damaged. Re-download it, or '
        'pass --noverify_data_checksums to use a modified copy on purpose.')
  cache[real] = [MD5[name], *stat]
  try:
    with atomic_io.atomic_write(verified_cache_path()) as f:
      json.dump(cache, f, indent=1, sort_keys=True)
  except OSError:
    pass


def _load_from_tfds(split: str) -> tuple[np.ndarray, np.ndarray]:
  """Loads MNIST through tensorflow-datasets (downloads it if needed)."""
  try:
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
    data = tfds.as_numpy(
        tfds.load('mnist', split=split, batch_size=-1, download=True))
    images = np.asarray(data['image'], dtype=np.uint8).reshape(
        (-1,) + IMAGE_SHAPE)
    labels = np.asarray(data['label']).astype(np.uint8)
  except Exception as e:  # pylint: disable=broad-except
    raise MnistDataError(
        'No --data_dir was given and tensorflow-datasets could not load '
        f'MNIST split {split!r} ({type(e).__name__}: {e}). {_HOW_TO_FIX}'
    ) from e
  if images.shape[0] != labels.shape[0]:
    raise MnistDataError(
        f'tensorflow-datasets returned {images.shape[0]} MNIST images but '
        f'{labels.shape[0]} labels for split {split!r}.')
  return images, labels


def load_mnist(data_dir: str | None, split: str = 'train',
               verify: bool | None = None) -> tuple[np.ndarray, np.ndarray]:
  """Loads one MNIST split.

  Args:
    data_dir: Directory holding the IDX files (gzipped or not), or None to
      load through `tensorflow_datasets` (needs network access the first time).
    split: 'train' (60,000 examples) or 'test' (the 10,000 t10k examples).
    verify: check each file's md5 against the canonical one the first time
      it is read (cached); None: as `set_verify_checksums` says (default on).

  Returns:
    `(images, labels)`: uint8 arrays of shapes (N, 28, 28) and (N,), labels
    in 0..9.

  Raises:
    MnistDataError: The data is missing, unreadable, malformed or fails its
      checksum; the message names the file and says what is wrong.
    ValueError: `split` is not 'train' or 'test'.
  """
  _check_split(split)
  if data_dir is None:
    return _load_from_tfds(split)
  data_dir = os.path.expanduser(data_dir)
  if not os.path.isdir(data_dir):
    raise MnistDataError(
        f'MNIST data directory {data_dir} does not exist or is not a '
        f'directory. {_HOW_TO_FIX}')
  images_name, labels_name = FILES[split]
  images_path = _find_file(data_dir, images_name)
  labels_path = _find_file(data_dir, labels_name)
  images, images_data = _read_idx(images_path, IMAGES_MAGIC)
  labels, labels_data = _read_idx(labels_path, LABELS_MAGIC)
  if images.shape[1:] != IMAGE_SHAPE:
    raise MnistDataError(
        f'MNIST file {images_path} holds images of shape {images.shape[1:]}; '
        f'expected {IMAGE_SHAPE}.')
  if images.shape[0] != labels.shape[0]:
    raise MnistDataError(
        f'MNIST image/label count mismatch: {images_path} holds '
        f'{images.shape[0]} images but {labels_path} holds '
        f'{labels.shape[0]} labels.')
  if labels.size and int(labels.max()) >= NUM_CLASSES:
    raise MnistDataError(
        f'MNIST file {labels_path} holds label {int(labels.max())}; labels '
        f'must be in 0..{NUM_CLASSES - 1}.')
  if _verify if verify is None else verify:  # After what says more.
    _verify_once(images_path, images_data)
    _verify_once(labels_path, labels_data)
  return images, labels


def verify_checksums(data_dir: str,
                     splits: tuple[str, ...] = ('train', 'test')
                     ) -> dict[str, str]:
  """Checks the md5 of the uncompressed MNIST files against the canonical ones.

  Always reads and hashes every file (no cache); `load_mnist` verifies each
  file the first time it reads it.

  Args:
    data_dir: Directory holding the IDX files (gzipped or not).
    splits: Which splits' files to check.

  Returns:
    A dict mapping each checked file's path to its (matching) md5 hex digest.

  Raises:
    MnistDataError: A file is missing, unreadable, or its md5 differs.
  """
  data_dir = os.path.expanduser(data_dir)
  if not os.path.isdir(data_dir):
    raise MnistDataError(
        f'MNIST data directory {data_dir} does not exist or is not a '
        f'directory. {_HOW_TO_FIX}')
  digests = {}
  for split in splits:
    _check_split(split)
    for name in FILES[split]:
      path = _find_file(data_dir, name)
      digest = hashlib.md5(_read_bytes(path)).hexdigest()
      if digest != MD5[name]:
        raise MnistDataError(
            f'MNIST file {path} has md5 {digest} (of its uncompressed '
            f'contents); the canonical {name} has md5 {MD5[name]}.')
      digests[path] = digest
  return digests
