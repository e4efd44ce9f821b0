"""Robustness of your model on the MNIST test set (10,000 images) at Linf 0.3 (Madry et al. 2018).

One machine (every local GPU or TPU chip)::

    python experiments/mnist.py --model my_model.py:model --data-dir ~/tensorflow_datasets \
        --checkpoint-dir ckpt --out report

Every worker of a TPU pod slice: the same command with ``--distributed``, and
``--checkpoint-dir`` / ``--out`` on a file system all workers share (``experiments/README.md``).
Any ``jaxbundle evaluate`` flag may follow; given again, it overrides these defaults.
"""

import sys

from _evaluate import run

DEFAULTS = ["--data", "tfds:mnist:test", "--preset", "mnist-linf", "--batch-size", "500"]

if __name__ == "__main__":
    sys.exit(run(DEFAULTS))
