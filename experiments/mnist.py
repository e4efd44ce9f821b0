"""Your model on the MNIST test set at Linf 0.3 (Madry et al. 2018).

See ``_evaluate.py`` and ``experiments/README.md`` for how to run it.
"""

import sys

from _evaluate import run

DEFAULTS = ["--data", "tfds:mnist:test", "--preset", "mnist-linf", "--batch-size", "500"]

if __name__ == "__main__":
    sys.exit(run(DEFAULTS))
