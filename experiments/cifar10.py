"""Robustness of your model on the CIFAR-10 test set (10,000 images) at Linf 8/255 (RobustBench);
``--preset cifar10-l2`` gives L2 0.5, ``--preset cifar10-linf-amich`` Linf 0.2.

One machine (every local GPU or TPU chip)::

    python experiments/cifar10.py --model my_model.py:model --data-dir ~/tensorflow_datasets \
        --checkpoint-dir ckpt --out report

Every worker of a TPU pod slice: the same command with ``--distributed``, and
``--checkpoint-dir`` / ``--out`` on a file system all workers share (``experiments/README.md``).
Any ``jaxbundle evaluate`` flag may follow; given again, it overrides these defaults.
"""

import sys

from _evaluate import run

DEFAULTS = ["--data", "tfds:cifar10:test", "--preset", "cifar10-linf", "--batch-size", "500"]

if __name__ == "__main__":
    sys.exit(run(DEFAULTS))
