"""Tests for jaxbundle.data: embedded MNIST sample, batching, validation, tfds."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxbundle import data
from jaxbundle.data import (
    Batch,
    Dataset,
    batches,
    load_mnist_sample,
    load_tfds,
    num_batches,
    validate_images,
)

# Class counts of the first 2,000 test / 10,000 train MNIST examples.
TEST_COUNTS = [175, 234, 219, 207, 217, 179, 178, 205, 192, 194]
TRAIN_COUNTS = [1001, 1127, 991, 1032, 980, 863, 1014, 1070, 944, 978]


# --- Embedded MNIST sample ---------------------------------------------------


@pytest.mark.parametrize("split,size", [("test", 2000), ("train", 10000)])
def test_sample_shapes_dtypes_range(split, size):
    ds = load_mnist_sample(split)
    assert isinstance(ds, Dataset)
    assert ds.x.shape == (size, 28, 28, 1)
    assert ds.x.dtype == np.float32
    assert ds.y.shape == (size,)
    assert ds.y.dtype == np.int32
    assert ds.num_classes == 10
    assert ds.name == f"mnist_sample/{split}"
    assert ds.x.min() == 0.0 and ds.x.max() == 1.0
    # Real digits: mostly background, mean intensity near MNIST's 0.13.
    assert 0.1 < ds.x.mean() < 0.16


def test_sample_canonical_labels_and_counts():
    test = load_mnist_sample("test")
    train = load_mnist_sample("train")
    assert test.y[:10].tolist() == [7, 2, 1, 0, 4, 1, 4, 9, 5, 9]
    assert train.y[:10].tolist() == [5, 0, 4, 1, 9, 2, 1, 3, 1, 4]
    assert np.bincount(test.y, minlength=10).tolist() == TEST_COUNTS
    assert np.bincount(train.y, minlength=10).tolist() == TRAIN_COUNTS
    # Pixel sum of the first training image (a "5"), a well-known checksum.
    assert int(round(float(train.x[0].sum()) * 255)) == 27525


def test_sample_first_n_is_prefix():
    full = load_mnist_sample("test")
    part = load_mnist_sample("test", n=37)
    assert part.x.shape == (37, 28, 28, 1)
    np.testing.assert_array_equal(part.x, full.x[:37])
    np.testing.assert_array_equal(part.y, full.y[:37])


def test_sample_returns_fresh_arrays():
    a = load_mnist_sample("test", n=5)
    a.x[:] = 0.5
    a.y[:] = 3
    b = load_mnist_sample("test", n=5)
    assert b.y.tolist() == [7, 2, 1, 0, 4]
    assert not np.all(b.x == 0.5)


def test_sample_bad_split():
    with pytest.raises(ValueError, match="split"):
        load_mnist_sample("validation")


@pytest.mark.parametrize("n", [0, -3])
def test_sample_nonpositive_n(n):
    with pytest.raises(ValueError, match="positive"):
        load_mnist_sample("test", n=n)


def test_sample_n_too_large_names_available():
    with pytest.raises(ValueError, match="2000"):
        load_mnist_sample("test", n=2001)
    with pytest.raises(ValueError, match="10000"):
        load_mnist_sample("train", n=10001)


# --- batches ----------------------------------------------------------------


def _toy(n, shape=(2, 2, 1)):
    x = np.arange(n * int(np.prod(shape)), dtype=np.float32).reshape((n, *shape))
    y = np.arange(n, dtype=np.int32) % 10
    return x, y


def test_num_batches():
    assert num_batches(0, 4) == 0
    assert num_batches(1, 4) == 1
    assert num_batches(8, 4) == 2
    assert num_batches(9, 4) == 3
    with pytest.raises(ValueError, match="batch_size"):
        num_batches(5, 0)
    with pytest.raises(ValueError, match="n must be"):
        num_batches(-1, 4)


def test_batches_padding_mask_ids_shapes():
    x, y = _toy(10)
    out = list(batches(x, y, batch_size=4))
    assert len(out) == 3
    for b in out:
        assert isinstance(b, Batch)
        assert b.x.shape == (4, 2, 2, 1) and b.x.dtype == np.float32
        assert b.y.shape == (4,)
        assert b.mask.shape == (4,) and b.mask.dtype == np.bool_
        assert b.example_id.shape == (4,) and b.example_id.dtype == np.int32
    assert out[0].mask.all() and out[1].mask.all()
    assert out[2].mask.tolist() == [True, True, False, False]
    assert out[0].example_id.tolist() == [0, 1, 2, 3]
    # Padding repeats the last real example, id included.
    assert out[2].example_id.tolist() == [8, 9, 9, 9]
    np.testing.assert_array_equal(out[2].x[2], x[9])
    np.testing.assert_array_equal(out[2].x[3], x[9])
    assert out[2].y[3] == y[9]


def test_batches_real_rows_reproduce_dataset():
    ds = load_mnist_sample("test", n=1000)
    out = list(batches(ds, batch_size=256))
    assert len(out) == 4
    assert all(b.x.shape == (256, 28, 28, 1) for b in out)
    np.testing.assert_array_equal(np.concatenate([b.x[b.mask] for b in out]), ds.x)
    np.testing.assert_array_equal(np.concatenate([b.y[b.mask] for b in out]), ds.y)
    ids = np.concatenate([b.example_id[b.mask] for b in out])
    np.testing.assert_array_equal(ids, np.arange(1000))


def test_batches_exact_multiple_has_no_padding():
    x, y = _toy(8)
    out = list(batches(x, y, batch_size=4))
    assert len(out) == 2 and all(b.mask.all() for b in out)


def test_batches_start_resumes():
    x, y = _toy(10)
    full = list(batches(x, y, batch_size=3))
    resumed = list(batches(x, y, batch_size=3, start=2))
    assert len(resumed) == len(full) - 2
    for a, b in zip(full[2:], resumed):
        for fa, fb in zip(a, b):
            np.testing.assert_array_equal(fa, fb)
    assert list(batches(x, y, batch_size=3, start=len(full))) == []


def test_batches_returns_copies():
    x, y = _toy(5)
    b = next(batches(x, y, batch_size=2))
    b.x[:] = -1
    assert x.min() >= 0


def test_batches_bad_arguments():
    x, y = _toy(10)
    with pytest.raises(ValueError, match="start"):
        batches(x, y, batch_size=4, start=4)
    with pytest.raises(ValueError, match="start"):
        batches(x, y, batch_size=4, start=-1)
    with pytest.raises(ValueError, match="batch_size"):
        batches(x, y, batch_size=0)
    with pytest.raises(ValueError, match="y is required"):
        batches(x)
    with pytest.raises(ValueError, match="length mismatch"):
        batches(x, y[:9])
    with pytest.raises(ValueError, match="Dataset"):
        batches(Dataset(x, y, 10, "toy"), y)


def test_batches_empty_yields_nothing():
    x, y = _toy(0)
    assert list(batches(x, y, batch_size=4)) == []


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 300), batch_size=st.integers(1, 64), data_=st.data())
def test_batches_property(n, batch_size, data_):
    x, y = _toy(n, shape=(1, 1, 1))
    total = num_batches(n, batch_size)
    assert total == -(-n // batch_size)
    start = data_.draw(st.integers(0, total))
    out = list(batches(x, y, batch_size=batch_size, start=start))
    assert len(out) == total - start
    for b in out:
        assert b.x.shape == (batch_size, 1, 1, 1)
        assert b.mask.shape == b.example_id.shape == b.y.shape == (batch_size,)
        assert b.example_id.min() >= 0 and b.example_id.max() < n
        np.testing.assert_array_equal(b.x[:, 0, 0, 0], x[b.example_id, 0, 0, 0])
    if start == 0:
        assert sum(int(b.mask.sum()) for b in out) == n
        ids = [int(i) for b in out for i in b.example_id[b.mask]]
        assert ids == list(range(n))
    else:
        ids = [int(i) for b in out for i in b.example_id[b.mask]]
        assert ids == list(range(start * batch_size, n))


# --- validate_images -------------------------------------------------------


def _good():
    return np.full((3, 2, 2, 1), 0.5, np.float32), np.array([0, 1, 2], np.int32)


def test_validate_accepts_good_input():
    x, y = _good()
    assert validate_images(x, y, 3) is None


def test_validate_not_4d():
    x, y = _good()
    with pytest.raises(ValueError, match="4-D"):
        validate_images(x[..., 0], y, 3)


def test_validate_not_float():
    x, y = _good()
    with pytest.raises(ValueError, match="floating dtype"):
        validate_images((x * 255).astype(np.uint8), y, 3)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_validate_non_finite(bad):
    x, y = _good()
    x[1, 0, 0, 0] = bad
    with pytest.raises(ValueError, match="non-finite"):
        validate_images(x, y, 3)


def test_validate_out_of_range_pixels_reports_min_max():
    x, y = _good()
    x[0, 0, 0, 0] = -0.25
    x[2, 1, 1, 0] = 2.0
    with pytest.raises(ValueError, match=r"\[0, 1\].*min -0\.25.*max 2\.0"):
        validate_images(x, y, 3)


def test_validate_labels_not_1d_integer():
    x, y = _good()
    with pytest.raises(ValueError, match="1-D integer"):
        validate_images(x, y.astype(np.float32), 3)
    with pytest.raises(ValueError, match="1-D integer"):
        validate_images(x, y[:, None], 3)


def test_validate_length_mismatch():
    x, y = _good()
    with pytest.raises(ValueError, match="length mismatch: 3 images but 2 labels"):
        validate_images(x, y[:2], 3)


def test_validate_labels_out_of_range_reports_values():
    x, y = _good()
    with pytest.raises(ValueError, match=r"out-of-range values \[-1, 7\]"):
        validate_images(x, np.array([7, -1, 0], np.int32), 3)


def test_validate_empty():
    with pytest.raises(ValueError, match="empty"):
        validate_images(np.zeros((0, 2, 2, 1), np.float32), np.zeros((0,), np.int32), 3)


# --- sources ---------------------------------------------------------------


def test_sample_source_streams_the_same_images_as_the_in_memory_sample():
    source = data.open_source("mnist-sample")
    assert len(source) == 2000 and source.dtype == np.uint8 and source.shape == (28, 28, 1)
    assert (source.num_classes == 10
            and source.describe() == data.open_source("mnist-sample").describe())
    x, y = source.read(10, 20)
    ds = load_mnist_sample("test", n=20)
    np.testing.assert_array_equal(data.to_unit_float(x), ds.x[10:20])
    np.testing.assert_array_equal(y, ds.y[10:20])
    assert len(data.open_source("mnist-sample:train")) == 10000


@pytest.mark.parametrize("n,batch_size,processes", [(10, 4, 1), (10, 4, 2), (7, 8, 4), (8, 8, 2)])
def test_local_batches_of_all_processes_make_the_single_process_batch(n, batch_size, processes):
    rng = np.random.default_rng(n)
    source = data.ArraySource(rng.integers(0, 256, (n, 3, 3, 1), dtype=np.uint8), np.arange(n))
    whole = list(batches(source.x, source.y, batch_size))
    for index, expected in enumerate(whole):
        parts = [data.local_batch(source, index, batch_size, p, processes)
                 for p in range(processes)]
        for field in Batch._fields:
            np.testing.assert_array_equal(
                np.concatenate([getattr(b, field) for b in parts]), getattr(expected, field)
            )


def test_local_batch_reads_only_its_own_rows():
    reads = []

    class Counting(data.ArraySource):
        def read(self, start, stop):
            reads.append((start, stop))
            return super().read(start, stop)

    source = Counting(np.zeros((100, 2, 2, 1), np.uint8), np.zeros(100, np.int32))
    data.local_batch(source, 1, 40, 1, 4)
    assert reads == [(50, 60)]
    data.local_batch(source, 2, 40, 3, 4)  # rows 110..119: all padding, one row read
    assert reads[-1] == (99, 100)


def test_head_and_bad_specs():
    source = data.head(data.open_source("mnist-sample"), 5)
    assert len(source) == 5 and source.read(0, 10)[0].shape[0] == 5
    assert source.describe()["n"] == 5
    with pytest.raises(ValueError, match="2000 examples available"):
        data.head(data.open_source("mnist-sample"), 2001)
    for spec in ("mnist", "npz:", "tfds:", "csv:/x"):
        with pytest.raises(ValueError, match="npz:PATH"):
            data.open_source(spec)
    with pytest.raises(ValueError, match="split"):
        data.open_source("mnist-sample:validation")


@pytest.mark.parametrize("compressed", [False, True])
@pytest.mark.parametrize("dtype", [np.uint8, np.float32])
def test_npz_source(tmp_path, compressed, dtype):
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, (12, 5, 5, 3)).astype(dtype)
    if dtype == np.float32:
        x = x / 255
    y = rng.integers(0, 10, 12)
    path = tmp_path / "d.npz"
    (np.savez_compressed if compressed else np.savez)(path, x=x, y=y)
    source = data.open_source(f"npz:{path}")
    assert isinstance(source.x, np.memmap) != compressed  # uncompressed files are mapped
    assert len(source) == 12 and source.shape == (5, 5, 3) and source.dtype == x.dtype
    xs, ys = source.read(3, 9)
    np.testing.assert_array_equal(xs, x[3:9])
    np.testing.assert_array_equal(ys, y[3:9])
    assert source.describe()["path"] == str(path)


def test_npz_grayscale_without_channel_axis(tmp_path):
    np.savez(tmp_path / "g.npz", x=np.zeros((4, 6, 6), np.uint8), y=np.zeros(4, np.int64))
    assert data.open_source(f"npz:{tmp_path / 'g.npz'}").shape == (6, 6, 1)


def test_npz_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        data.open_source(f"npz:{tmp_path / 'missing.npz'}")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="not a readable .npz"):
        data.open_source(f"npz:{tmp_path / 'junk.npz'}")
    cases = {
        "keys": (dict(images=np.zeros((2, 3, 3, 1)), y=np.zeros(2, int)), "'x' .images"),
        "shape": (dict(x=np.zeros((2, 3)), y=np.zeros(2, int)), "x must be"),
        "dtype": (dict(x=np.zeros((2, 3, 3, 1), np.int32), y=np.zeros(2, int)), "uint8 or floats"),
        "labels": (dict(x=np.zeros((2, 3, 3, 1)), y=np.zeros(3, int)), "y must be"),
    }
    for name, (arrays, message) in cases.items():
        np.savez(tmp_path / f"{name}.npz", **arrays)
        with pytest.raises(ValueError, match=message):
            data.open_source(f"npz:{tmp_path / name}.npz")


# --- tfds (real tensorflow-datasets, array_record, no TensorFlow) -----------


@pytest.fixture(scope="module")
def tfds_dir(tmp_path_factory):
    pytest.importorskip("tensorflow_datasets")
    import tfds_datasets

    directory = str(tmp_path_factory.mktemp("tfds"))
    tfds_datasets.prepare(directory)
    return directory


def test_tfds_source_reads_the_prepared_dataset_without_tensorflow(tfds_dir):
    source = data.open_source("tfds:tiny_digits:test", data_dir=tfds_dir)
    assert len(source) == 96 and source.shape == (28, 28, 1) and source.dtype == np.uint8
    assert source.num_classes == 10 and source.name == "tfds:tiny_digits/test"
    x, y = source.read(0, 96)
    # The builder shuffles the order; the multiset of (image, label) pairs is the sample's.
    sample = load_mnist_sample("test", n=96)
    ours = sorted((int(label), (im.astype(np.float32) / 255).tobytes()) for im, label in zip(x, y))
    theirs = sorted((int(label), im.tobytes()) for im, label in zip(sample.x, sample.y))
    assert ours == theirs
    np.testing.assert_array_equal(source.read(5, 9)[0], x[5:9])
    assert "tensorflow" not in sys.modules
    colour = data.open_source("tfds:tiny_colour", data_dir=tfds_dir)
    assert colour.shape == (32, 32, 3) and len(colour) == 96


def test_tfds_errors(tfds_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="not prepared.*--download"):
        data.open_source("tfds:tiny_digits", data_dir=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="'no_such_dataset' is neither prepared"):
        data.open_source("tfds:no_such_dataset", data_dir=str(tmp_path))
    with pytest.raises(ValueError, match="no split 'validation'"):
        data.open_source("tfds:tiny_digits:validation", data_dir=tfds_dir)


def test_tfds_download_prepares_in_array_record(tmp_path):
    pytest.importorskip("tensorflow_datasets")
    import tfds_datasets  # noqa: F401  (registers the builders)

    source = data.open_source("tfds:tiny_digits:train", data_dir=str(tmp_path), download=True)
    assert len(source) == 64
    assert any(p.name.endswith("array_record-00000-of-00001") for p in tmp_path.rglob("*"))


def test_tfds_resize_and_centre_crop(tfds_dir):
    source = data.open_source("tfds:tiny_colour", data_dir=tfds_dir, image_size=24)
    x, _ = source.read(0, 4)
    assert x.shape == (4, 24, 24, 3) and x.dtype == np.uint8 and source.shape == (24, 24, 3)
    from jaxbundle.data.tfds import center_crop

    image = np.arange(40 * 60 * 3, dtype=np.uint8).reshape(40, 60, 3)
    assert center_crop(image, 35).shape == (35, 35, 3)  # shorter side 40 -> 40, centre kept


def test_load_tfds_in_memory(tfds_dir):
    ds = load_tfds("tiny_digits", n=10, data_dir=tfds_dir)
    assert ds.x.shape == (10, 28, 28, 1) and ds.x.dtype == np.float32 and ds.num_classes == 10
    with pytest.raises(ValueError, match="positive"):
        load_tfds("tiny_digits", n=0, data_dir=tfds_dir)


def test_tfds_missing_package(monkeypatch):
    # A None entry in sys.modules makes `import tensorflow_datasets` fail.
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)
    with pytest.raises(ImportError, match=r"jaxbundle\[tfds\]"):
        data.open_source("tfds:mnist")


def test_public_api():
    assert {"Source", "ArraySource", "open_source", "local_batch", "head", "batches",
            "load_mnist_sample", "load_tfds", "translate", "validate_images"} <= set(data.__all__)


def test_translate_moves_images_off_the_grid_by_sub_pixel_offsets():
    x = data.load_mnist_sample("test", n=8).x
    np.testing.assert_array_equal(data.translate(x, 0.0, 0.0), x)
    np.testing.assert_array_equal(data.translate(x, 1.0, 0.0)[:, 1:], x[:, :-1])  # one row down
    half = data.translate(x, 0.5, 0.0)
    np.testing.assert_allclose(half[:, 1:], 0.5 * (x[:, 1:] + x[:, :-1]), atol=1e-7)
    moved = data.translate(x, 0.37, 0.41)
    assert moved.dtype == np.float32 and moved.min() >= 0 and moved.max() <= 1
    levels = moved * 255
    assert np.all(np.abs(levels - np.round(levels)).reshape(8, -1).max(axis=1) > 0.01)
    with pytest.raises(ValueError, match="images"):
        data.translate(x[0], 0.5, 0.5)
