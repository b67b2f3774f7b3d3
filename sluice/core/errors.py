"""The one error table: the errors the core raises, each naming the gRPC status it maps to,
and the status codes by number.

The core never imports grpc: a status is a name or a number here, turned into a
grpc.StatusCode in one place (`sluice.runtime.status`).
"""

from __future__ import annotations

from enum import IntEnum


class SluiceError(Exception):
    """Base class: a failure a caller can act on, with its status name. A refusal at the
    door (before any work) also names its reason, as its message begins and the metrics
    count it (`sluice_refusals_total{reason}`); other failures have none."""

    status = "INTERNAL"
    reason = ""


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
    """A model file or its config could not be loaded, or failed its check run: the
    request to load it was fine, the repository's content is not."""

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
    """The caller's tenant is over its rate quota (retry after `retry_after_s`) or its
    share of concurrent calls. Not the server's limit: another server would refuse it too."""

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
    """Another call is writing the same bytes of a shared memory region: retry when it ends,
    or give each call its own range."""

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
    """The refusal reason a status and message name ("" when it is no refusal): for a
    process that forwards another's answers (a balancer), which counts them as its own."""
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
