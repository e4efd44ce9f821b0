"""Your model on the CIFAR-10 test set at Linf 8/255 (RobustBench; ``--preset cifar10-l2``:
L2 0.5, ``--preset cifar10-linf-amich``: Linf 0.2).

See ``_evaluate.py`` and ``experiments/README.md`` for how to run it.
"""

import sys

from _evaluate import run

DEFAULTS = ["--data", "tfds:cifar10:test", "--preset", "cifar10-linf", "--batch-size", "500"]

if __name__ == "__main__":
    sys.exit(run(DEFAULTS))
