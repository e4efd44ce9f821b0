"""White-box attacks: each reads the model's gradients (``WhiteBoxModel``).

One module per attack; ``help()`` on a module shows its algorithm. The factories (``pgd``,
``apgd``, ...) are re-exported by :mod:`jaxbundle.attacks`, which is where users import them from.
A new gradient attack goes here, in its own file.
"""
