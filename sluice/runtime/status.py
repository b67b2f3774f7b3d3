"""The gRPC side of the error table: status numbers and core errors as grpc.StatusCode."""

from __future__ import annotations

import grpc

from sluice.core.errors import SluiceError

CODES: dict[int, grpc.StatusCode] = {code.value[0]: code for code in grpc.StatusCode}


def grpc_code(code: int) -> grpc.StatusCode:
    """The StatusCode of a status number (UNKNOWN for a number gRPC does not define)."""
    return CODES.get(code, grpc.StatusCode.UNKNOWN)


def status_of(error: SluiceError) -> grpc.StatusCode:
    """Each core error names its status."""
    return grpc.StatusCode[error.status]
