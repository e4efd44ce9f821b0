"""What a report adds beside the attacks: natural shifts, RoBIC's best-effort distortions and
the transfer from surrogate models."""
