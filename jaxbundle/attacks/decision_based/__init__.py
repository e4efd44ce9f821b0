"""Decision-based black-box attacks: each sees only the predicted label (``LabelOracle``).

One module per attack; ``help()`` on a module shows its algorithm. The factories (``rays``,
``surfree``) are re-exported by :mod:`jaxbundle.attacks`. A new hard-label attack goes here, in its
own file.
"""
