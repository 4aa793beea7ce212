"""Tests for tasks.mnist_io."""

import gzip
import hashlib
import os
import struct
from unittest import mock

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

from tasks import mnist_io

# Canonical digit histograms of the MNIST splits.
TRAIN_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
TEST_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


def _idx_bytes(magic, dims, payload):
  return (struct.pack('>I', magic) + struct.pack('>' + 'I' * len(dims), *dims)
          + bytes(payload))


def _write(path, data, gz):
  if gz:
    path += '.gz'
    data = gzip.compress(data)
  with open(path, 'wb') as f:
    f.write(data)
  return path


def _tiny(num_images=3, num_labels=None, seed=0):
  rng = np.random.default_rng(seed)
  images = rng.integers(0, 256, size=(num_images, 28, 28), dtype=np.uint8)
  labels = rng.integers(0, 10, size=(
      num_images if num_labels is None else num_labels,), dtype=np.uint8)
  return images, labels


def _write_split(directory, images, labels, gz=True, split='train'):
  image_name, label_name = mnist_io.FILES[split]
  image_path = _write(
      os.path.join(directory, image_name),
      _idx_bytes(mnist_io.IMAGES_MAGIC, images.shape, images.tobytes()), gz)
  label_path = _write(
      os.path.join(directory, label_name),
      _idx_bytes(mnist_io.LABELS_MAGIC, labels.shape, labels.tobytes()), gz)
  return image_path, label_path


# Real data.


def test_real_train_split(mnist_dir):
  images, labels = mnist_io.load_mnist(mnist_dir, 'train')
  assert images.shape == (60000, 28, 28) and images.dtype == np.uint8
  assert labels.shape == (60000,) and labels.dtype == np.uint8
  assert np.bincount(labels, minlength=10).tolist() == TRAIN_COUNTS
  assert sum(TRAIN_COUNTS) == 60000
  assert images.max() == 255 and images.min() == 0


def test_real_test_split(mnist_dir):
  images, labels = mnist_io.load_mnist(mnist_dir, 'test')
  assert images.shape == (10000, 28, 28) and labels.shape == (10000,)
  assert np.bincount(labels, minlength=10).tolist() == TEST_COUNTS
  assert sum(TEST_COUNTS) == 10000


def test_real_checksums(mnist_dir):
  digests = mnist_io.verify_checksums(mnist_dir)
  names = {os.path.basename(p).removesuffix('.gz'): d
           for p, d in digests.items()}
  assert names == {
      'train-images-idx3-ubyte': '6bbc9ace898e44ae57da46a324031adb',
      'train-labels-idx1-ubyte': 'a25bea736e30d166cdddb491f175f624',
      't10k-images-idx3-ubyte': '2646ac647ad5339dbf082846283269ea',
      't10k-labels-idx1-ubyte': '27ae3e4e09519cfbb04c329615203637',
  }


# Synthetic IDX files.


@pytest.mark.parametrize('gz', [True, False])
def test_round_trip(tmp_path, gz):
  images, labels = _tiny(5)
  _write_split(str(tmp_path), images, labels, gz=gz)
  got_images, got_labels = mnist_io.load_mnist(str(tmp_path), 'train',
                                                verify=False)
  np.testing.assert_array_equal(got_images, images)
  np.testing.assert_array_equal(got_labels, labels)
  assert got_images.dtype == np.uint8 and got_labels.dtype == np.uint8


def test_round_trip_test_split(tmp_path):
  images, labels = _tiny(4, seed=1)
  _write_split(str(tmp_path), images, labels, split='test')
  got_images, got_labels = mnist_io.load_mnist(str(tmp_path), 'test',
                                                verify=False)
  np.testing.assert_array_equal(got_images, images)
  np.testing.assert_array_equal(got_labels, labels)


def test_uncompressed_file_holding_gzip_is_decompressed(tmp_path):
  images, labels = _tiny(2)
  image_path, label_path = _write_split(str(tmp_path), images, labels)
  os.rename(image_path, image_path.removesuffix('.gz'))
  os.rename(label_path, label_path.removesuffix('.gz'))
  got_images, _ = mnist_io.load_mnist(str(tmp_path), verify=False)
  np.testing.assert_array_equal(got_images, images)


@pytest.mark.parametrize('gz', [True, False])
def test_truncated_data_names_file(tmp_path, gz):
  images, labels = _tiny(3)
  _write_split(str(tmp_path), images, labels, gz=gz)
  image_path = _write(
      os.path.join(str(tmp_path), 'train-images-idx3-ubyte'),
      _idx_bytes(mnist_io.IMAGES_MAGIC, (3, 28, 28),
                 images.tobytes()[:-100]), gz)
  with pytest.raises(mnist_io.MnistDataError) as e:
    mnist_io.load_mnist(str(tmp_path))
  assert image_path in str(e.value)
  assert 'truncated' in str(e.value)
  assert str(3 * 784) in str(e.value) and str(3 * 784 - 100) in str(e.value)


def test_truncated_header_names_file(tmp_path):
  images, labels = _tiny(3)
  _write_split(str(tmp_path), images, labels)
  label_path = _write(os.path.join(str(tmp_path), 'train-labels-idx1-ubyte'),
                      struct.pack('>I', mnist_io.LABELS_MAGIC) + b'\x00', True)
  with pytest.raises(mnist_io.MnistDataError, match='truncated') as e:
    mnist_io.load_mnist(str(tmp_path))
  assert label_path in str(e.value)


def test_trailing_bytes_rejected(tmp_path):
  images, labels = _tiny(3)
  _write_split(str(tmp_path), images, labels)
  label_path = _write(
      os.path.join(str(tmp_path), 'train-labels-idx1-ubyte'),
      _idx_bytes(mnist_io.LABELS_MAGIC, (3,), labels.tobytes() + b'xx'), True)
  with pytest.raises(mnist_io.MnistDataError, match='2 unexpected') as e:
    mnist_io.load_mnist(str(tmp_path))
  assert label_path in str(e.value)


def test_bad_magic_names_file(tmp_path):
  images, labels = _tiny(3)
  _write_split(str(tmp_path), images, labels)
  # A labels file carrying the images magic number.
  label_path = _write(
      os.path.join(str(tmp_path), 'train-labels-idx1-ubyte'),
      _idx_bytes(mnist_io.IMAGES_MAGIC, (3, 1, 1), labels.tobytes()), True)
  with pytest.raises(mnist_io.MnistDataError) as e:
    mnist_io.load_mnist(str(tmp_path))
  message = str(e.value)
  assert label_path in message
  assert 'bad magic number 0x00000803' in message
  assert 'expected 0x00000801' in message


def test_missing_file_says_what_to_do(tmp_path):
  images, labels = _tiny(3)
  _, label_path = _write_split(str(tmp_path), images, labels)
  os.remove(label_path)
  with pytest.raises(mnist_io.MnistDataError) as e:
    mnist_io.load_mnist(str(tmp_path))
  message = str(e.value)
  assert label_path in message and 'not found' in message
  assert '--data_dir' in message and '../shared/data/mnist' in message
  assert 'tensorflow-datasets' in message


def test_missing_directory_says_what_to_do(tmp_path):
  missing = os.path.join(str(tmp_path), 'nope')
  with pytest.raises(mnist_io.MnistDataError) as e:
    mnist_io.load_mnist(missing)
  assert missing in str(e.value) and 'does not exist' in str(e.value)
  assert '--data_dir' in str(e.value)


def test_missing_file_error_is_value_error(tmp_path):
  with pytest.raises(ValueError):
    mnist_io.load_mnist(str(tmp_path))


@pytest.mark.parametrize('corruption', ['truncated', 'flipped', 'not_gzip'])
def test_gzip_corruption_names_file(tmp_path, corruption):
  images, labels = _tiny(40)
  image_path, _ = _write_split(str(tmp_path), images, labels)
  with open(image_path, 'rb') as f:
    raw = bytearray(f.read())
  if corruption == 'truncated':
    raw = raw[:len(raw) // 2]
  elif corruption == 'flipped':
    for i in range(20, len(raw) - 8, 7):
      raw[i] ^= 0xFF
  else:
    raw = bytearray(_idx_bytes(mnist_io.IMAGES_MAGIC, images.shape,
                               images.tobytes()))
  with open(image_path, 'wb') as f:
    f.write(raw)
  with pytest.raises(mnist_io.MnistDataError, match='gzip') as e:
    mnist_io.load_mnist(str(tmp_path))
  assert image_path in str(e.value)


def test_count_mismatch_names_both_files(tmp_path):
  images, labels = _tiny(3, num_labels=4)
  image_path, label_path = _write_split(str(tmp_path), images, labels)
  with pytest.raises(mnist_io.MnistDataError, match='mismatch') as e:
    mnist_io.load_mnist(str(tmp_path))
  message = str(e.value)
  assert image_path in message and label_path in message
  assert '3 images' in message and '4 labels' in message


def test_label_out_of_range(tmp_path):
  images, labels = _tiny(3)
  labels[1] = 12
  _, label_path = _write_split(str(tmp_path), images, labels)
  with pytest.raises(mnist_io.MnistDataError, match='label 12') as e:
    mnist_io.load_mnist(str(tmp_path))
  assert label_path in str(e.value)


def test_bad_split(tmp_path):
  with pytest.raises(ValueError, match='split'):
    mnist_io.load_mnist(str(tmp_path), 'validation')


def test_verify_checksums_detects_mismatch(tmp_path):
  images, labels = _tiny(3)
  image_path, _ = _write_split(str(tmp_path), images, labels)
  expected = hashlib.md5(
      _idx_bytes(mnist_io.IMAGES_MAGIC, images.shape,
                 images.tobytes())).hexdigest()
  with pytest.raises(mnist_io.MnistDataError, match='md5') as e:
    mnist_io.verify_checksums(str(tmp_path), splits=('train',))
  assert image_path in str(e.value) and expected in str(e.value)


def test_a_flipped_byte_fails_its_checksum_on_first_use(
    mnist_dir, tmp_path, monkeypatch):
  """A copy of the real test split verifies once, then loads from the cache
  without hashing; one pixel byte flipped in place (valid header and size)
  is refused by its md5 at the next load; skipping the check loads it."""
  monkeypatch.setenv(mnist_io.CACHE_ENV, str(tmp_path / 'cache'))
  copy = tmp_path / 'mnist'
  copy.mkdir()
  for name in mnist_io.FILES['test']:
    with open(os.path.join(mnist_dir, name + '.gz'), 'rb') as f:
      (copy / name).write_bytes(gzip.decompress(f.read()))
  want, _ = mnist_io.load_mnist(str(copy), 'test')  # Verified and cached.
  with mock.patch.object(mnist_io.hashlib, 'md5',
                         side_effect=AssertionError('hashed again')):
    mnist_io.load_mnist(str(copy), 'test')
  image_file = copy / mnist_io.FILES['test'][0]
  data = bytearray(image_file.read_bytes())
  data[16 + 28 * 14 + 14] ^= 0x01  # A pixel of the first image.
  stat = image_file.stat()
  image_file.write_bytes(bytes(data))
  os.utime(image_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
  with pytest.raises(mnist_io.MnistDataError,
                     match='t10k-images-idx3-ubyte fails its checksum'):
    mnist_io.load_mnist(str(copy), 'test')
  got, _ = mnist_io.load_mnist(str(copy), 'test', verify=False)
  assert (got != want).sum() == 1


# data_dir=None: tensorflow-datasets.


def test_tfds_failure_explains_options():
  with mock.patch.object(
      tfds, 'load', side_effect=OSError('no network')) as load:
    with pytest.raises(mnist_io.MnistDataError) as e:
      mnist_io.load_mnist(None, 'test')
  load.assert_called_once_with('mnist', split='test', batch_size=-1,
                               download=True)
  message = str(e.value)
  assert '--data_dir' in message and '../shared/data/mnist' in message
  assert 'tensorflow-datasets' in message and 'no network' in message
  assert isinstance(e.value.__cause__, OSError)


def test_tfds_success_path_converts_arrays():
  images, labels = _tiny(4)
  fake = {'image': tf.constant(images[..., np.newaxis]),
          'label': tf.constant(labels.astype(np.int64))}
  with mock.patch.object(tfds, 'load', return_value=fake):
    got_images, got_labels = mnist_io.load_mnist(None)
  assert got_images.shape == (4, 28, 28) and got_images.dtype == np.uint8
  assert got_labels.dtype == np.uint8
  np.testing.assert_array_equal(got_images, images)
  np.testing.assert_array_equal(got_labels, labels)
