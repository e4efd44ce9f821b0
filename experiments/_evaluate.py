"""What the dataset scripts share: ``jaxbundle evaluate`` with a dataset's defaults in front of
the user's flags (a flag given again by the user wins).

One machine (every local GPU or TPU chip)::

    python experiments/cifar10.py --model my_model.py:model --data-dir ~/tensorflow_datasets \
        --checkpoint-dir ckpt --out report

Every worker of a TPU pod slice: the same command with ``--distributed``, and
``--checkpoint-dir`` / ``--out`` on a file system all workers share (``experiments/README.md``).
"""

from __future__ import annotations

import sys
from typing import Sequence

from jaxbundle.cli import main


def run(defaults: Sequence[str], argv: Sequence[str] | None = None) -> int:
    return main(["evaluate", *defaults, *(sys.argv[1:] if argv is None else argv)])
