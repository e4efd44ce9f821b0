"""Robustness of your model on the ImageNet validation set (50,000 images, resized and centre-cropped
to 224) at Linf 4/255 (RobustBench); ``--preset imagenet-linf-amich`` gives 8/255.

One machine (every local GPU or TPU chip)::

    python experiments/imagenet.py --model my_model.py:model --data-dir ~/tensorflow_datasets \
        --checkpoint-dir ckpt --out report

Every worker of a TPU pod slice: the same command with ``--distributed``, and
``--checkpoint-dir`` / ``--out`` on a file system all workers share (``experiments/README.md``).
Any ``jaxbundle evaluate`` flag may follow; given again, it overrides these defaults.
"""

import sys

from _evaluate import run

DEFAULTS = ["--data", "tfds:imagenet2012:validation", "--image-size", "224", "--preset",
    "imagenet-linf", "--batch-size", "256"]

if __name__ == "__main__":
    sys.exit(run(DEFAULTS))
