"""Errors that cross component boundaries.

Every error a user can cause carries the name of the offending parameter and a
message that states the limit, so the HTTP layer can turn it into an OpenAI-style
error body without inspecting strings.
"""

from __future__ import annotations


class PdserveError(Exception):
    """Base class of all pdserve errors."""


class InvalidRequestError(PdserveError, ValueError):
    """A request (prompt or sampling parameters) was refused before anything was allocated."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class ModelLoadError(PdserveError):
    """A model folder or file is missing, truncated, or of an unsupported kind.

    The message names the file and what is wrong with it.
    """


class EngineDeadError(PdserveError):
    """The engine (its loop thread or its process) has stopped; no request can progress."""


class EngineOverloadedError(PdserveError):
    """The engine's waiting queue is full; the request was refused (retry later)."""


class InstanceFailedError(PdserveError):
    """A request's instance or KV transfer failed in a cluster and it could not be retried
    (retries used up, or tokens were already streamed from the failed instance)."""


class RequestCancelledError(PdserveError):
    """The server ended the request itself (it is shutting down and the drain timed out)."""


class NotFoundError(PdserveError):
    """An operator's request names something that does not exist (an instance)."""


class ConflictError(PdserveError):
    """An operator's request conflicts with what the cluster is doing now (an instance that
    is flipping already, the last live instance of a role); nothing changed."""
