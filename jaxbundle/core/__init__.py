"""The jit side of one batch: norms and projections, losses, goals (which candidate is
better), the sampling of a stochastic model's randomness, the judge (verdicts at a stated
arithmetic), the bundler (every candidate of every attack folded per example), the checks of
inputs and attacks. Nothing here knows a model's origin, a dataset or a report."""
