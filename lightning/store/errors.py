"""Typed store errors; the HTTP server maps each to a status code (404, 409, 422), and the client maps 401 and 403
back to AuthError."""


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


class AuthError(StoreError):
    """The store server refused the client's credentials (HTTP 401 or 403). Repeating the call cannot help: the
    token is wrong or missing. Never retried; a runner stops on it."""


def http_status(exc: StoreError) -> int:
    """The HTTP status code the store server answers an error with."""
    if isinstance(exc, NotFoundError):
        return 404
    if isinstance(exc, ConflictError):
        return 409
    if isinstance(exc, InvalidArgumentError):
        return 422
    return 503  # a StoreError the store raised on purpose: it is there but cannot serve now
