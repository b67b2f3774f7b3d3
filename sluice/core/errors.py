"""The one error table: the core's errors, each naming its gRPC status, and the status
numbers. No grpc here: `sluice.runtime.status` makes them grpc.StatusCode."""

from __future__ import annotations

from enum import IntEnum


class SluiceError(Exception):
    """A failure a caller can act on, with its status name; a refusal before any work also
    names its `reason` (its message's start, and the metrics' label)."""

    status = "INTERNAL"
    reason = ""


class TensorError(ValueError):
    """A tensor message that cannot be decoded; the message says why (each face answers it
    as InvalidInput)."""


class InvalidInput(SluiceError):
    """The request does not fit the model or the API."""

    status = "INVALID_ARGUMENT"


class ModelNotFound(SluiceError):
    """The node (or no node behind a balancer) serves no such model or version."""

    status = "NOT_FOUND"


class Unimplemented(SluiceError):
    """The call is one this node does not serve (as configured)."""

    status = "UNIMPLEMENTED"


class LoadFailed(SluiceError):
    """A model or its config did not load or failed its check run: the repository's fault."""

    status = "FAILED_PRECONDITION"


class ModelFailed(SluiceError):
    """ONNX Runtime failed while running valid input."""

    status = "INTERNAL"


class Overloaded(SluiceError):
    """A queue or size bound was hit; retry later or elsewhere."""

    status = "RESOURCE_EXHAUSTED"
    reason = "overload"


class Unauthenticated(SluiceError):
    """Auth is on and the call carries no API key, or one no tenant holds."""

    status = "UNAUTHENTICATED"
    reason = "unauthenticated"


class QuotaExceeded(SluiceError):
    """The tenant is over its rate quota (retry after `retry_after_s`) or concurrency share:
    another server would refuse it too."""

    status = "RESOURCE_EXHAUSTED"
    reason = "quota"

    def __init__(self, message: str, retry_after_s: float = 0.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class PermissionDenied(SluiceError):
    """The caller's tenant may not make this call (an admin's)."""

    status = "PERMISSION_DENIED"
    reason = "permission"


class Unavailable(SluiceError):
    """The node cannot take the call now (starting, draining, no backend)."""

    status = "UNAVAILABLE"


class DeadlineExpired(SluiceError):
    """The caller's deadline passed before the work could run."""

    status = "DEADLINE_EXCEEDED"


class AlreadyExists(SluiceError):
    """The name is taken: a shared memory region the caller's tenant already registered."""

    status = "ALREADY_EXISTS"


class RegionNotFound(SluiceError):
    """The caller's tenant registered no shared memory region of that name."""

    status = "NOT_FOUND"


class RegionBusy(SluiceError):
    """Another call is writing the same bytes of a shared memory region."""

    status = "FAILED_PRECONDITION"


class Code(IntEnum):
    """gRPC status codes by number, for the layers that never import grpc."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


REASONS = ("unauthenticated", "quota", "overload", "permission")


def reason_of(code: int, message: str) -> str:
    """The refusal reason a forwarded status and message name ("": no refusal)."""
    if code not in (Code.UNAUTHENTICATED, Code.RESOURCE_EXHAUSTED, Code.PERMISSION_DENIED):
        return ""
    head = message.partition(":")[0]
    head = "overload" if head == "overloaded" else head
    return head if head in REASONS else ""


def status_name(code: int) -> str:
    try:
        return Code(code).name
    except ValueError:
        return f"status {code}"
