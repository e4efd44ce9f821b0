"""The host side of one evaluation: the runners (``full`` and ``cascade``), the cascade's
schedule, checkpoints, the report's checks, memory fitting, model adapters (linen, NNX,
Equinox), declared defences and atomic files."""
