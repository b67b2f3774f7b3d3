"""Errors the core raises, each naming the gRPC status it maps to.

The core never imports grpc: the status is a name, turned into a grpc.StatusCode
by the service layer in one place (`server.service.status_of`).
"""

from __future__ import annotations


class SluiceError(Exception):
    """Base class: a failure a caller can act on, with its status name."""

    status = "INTERNAL"


class InvalidInput(SluiceError):
    """The request does not fit the model or the API."""

    status = "INVALID_ARGUMENT"


class ModelFailed(SluiceError):
    """ONNX Runtime failed while running valid input."""

    status = "INTERNAL"


class Overloaded(SluiceError):
    """A queue or size bound was hit; retry later or elsewhere."""

    status = "RESOURCE_EXHAUSTED"


class Unavailable(SluiceError):
    """The node cannot take the call now (starting, draining, no backend)."""

    status = "UNAVAILABLE"


class DeadlineExpired(SluiceError):
    """The caller's deadline passed before the work could run."""

    status = "DEADLINE_EXCEEDED"
