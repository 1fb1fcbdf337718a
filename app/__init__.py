"""gpulane: one GPU, scheduled by score."""

__version__ = "0.1.0"
