"""Errors a user can act on. The CLI prints their message on one line and exits 2."""


class DSparkError(Exception):
    """Base class: the message names the key, tensor or field at fault."""


class FormatError(DSparkError):
    """A draft checkpoint is malformed, contradictory or unsupported."""


class RequestError(DSparkError):
    """A generation request is invalid (bad sampling parameters, prompt too long, ...)."""


class NonFiniteError(DSparkError):
    """The target computed NaN or inf for some rows of a batch (rows: their indices): those
    requests cannot be continued; the others can."""

    def __init__(self, message: str, rows: list[int]):
        super().__init__(message)
        self.rows = rows
