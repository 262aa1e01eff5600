"""Errors of the training pipeline: bad data files, mismatched caches, impossible settings."""

from dspark.errors import DSparkError


class TrainError(DSparkError):
    """A training input or setting is invalid; the message names the file, field or flag."""
