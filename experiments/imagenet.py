"""Your model on the ImageNet validation set, resized and centre-cropped to 224, at Linf 4/255
(RobustBench; ``--preset imagenet-linf-amich``: 8/255).

See ``_evaluate.py`` and ``experiments/README.md`` for how to run it.
"""

import sys

from _evaluate import run

DEFAULTS = ["--data", "tfds:imagenet2012:validation", "--image-size", "224", "--preset",
    "imagenet-linf", "--batch-size", "256"]

if __name__ == "__main__":
    sys.exit(run(DEFAULTS))
