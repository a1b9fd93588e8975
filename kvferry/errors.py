"""Typed errors. User input errors carry an OpenAI error type and an HTTP status."""


class KVFerryError(Exception):
    """Base class of every error kvferry raises on purpose."""


class InvalidRequestError(KVFerryError, ValueError):
    """A request (prompt, sampling parameters, body) the engine cannot serve: HTTP 400."""

    status_code = 400
    error_type = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class ModelNotFoundError(InvalidRequestError):
    """The request names a model this server does not serve: HTTP 404 in OpenAI's API."""

    status_code = 404
    error_type = "NotFoundError"


class UnknownRequestError(InvalidRequestError):
    """The request names something (e.g. a request id) this server does not know: HTTP 404."""

    status_code = 404
    error_type = "NotFoundError"


class ConfigError(KVFerryError, ValueError):
    """A bad engine configuration, reported at start-up."""


class ModelLoadError(KVFerryError, RuntimeError):
    """The model could not be found or read."""
