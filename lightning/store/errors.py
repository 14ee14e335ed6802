"""Typed store errors; the HTTP server maps each to a status code (404, 409, 422)."""


class StoreError(Exception):
    """Base class of every error the store raises on purpose."""


class NotFoundError(StoreError, ValueError):
    """An id names no rollout, attempt, resources or worker.

    A ValueError too, as agent-lightning 0.3 raised ValueError for unknown ids.
    """


class ConflictError(StoreError):
    """The request is valid but the stored state does not allow it."""


class InvalidArgumentError(StoreError, ValueError):
    """An argument is malformed; the message names the argument and what it accepts."""


class BodyTooLarge(StoreError):
    """A request body over the store server's limit."""


def http_status(exc: StoreError) -> int:
    """The HTTP status code the store server answers an error with."""
    if isinstance(exc, NotFoundError):
        return 404
    if isinstance(exc, ConflictError):
        return 409
    if isinstance(exc, InvalidArgumentError):
        return 422
    if isinstance(exc, BodyTooLarge):
        return 413
    return 503  # a StoreError the store raised on purpose: it is there but cannot serve now
