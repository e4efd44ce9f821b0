"""Score-based black-box attacks: each sees only the model's scores (``ScoreOracle``), no gradients.

One module per attack; ``help()`` on a module shows its algorithm. The factories (``square``,
``spsa``) are re-exported by :mod:`jaxbundle.attacks`. A new query attack that reads logits or
probabilities goes here, in its own file.
"""
