"""Shared memory on the wire, as both programs answer it (each takes the regions of callers
on its host, sluice.core.shm, with --shared-memory): the region calls of sluice.v1
(RegisterRegion, RegionStatus, UnregisterRegion) and of KServe (Triton's SystemSharedMemory*,
and its CudaSharedMemory* as Triton without GPUs answers them) for one caller's tenant, and
the words that refuse shared memory where a program takes none, naming that program
(sluice-server, sluice-balancer) to start with the flag."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from google.protobuf.message import DecodeError, Message

from sluice.core.errors import InvalidInput, RegionNotFound, Unimplemented
from sluice.core.shm import Regions
from sluice.kserve import grpc_predict_v2_pb2 as kpb
from sluice.v1 import inference_pb2 as pb

M = TypeVar("M", bound=Message)

SYSTEM_SHARED_MEMORY = "system_shared_memory"  # the extension's name in ServerMetadata
# Triton's answer where it has no GPU; Sluice maps no CUDA memory of other processes.
NO_CUDA = "GPUs not supported: Sluice takes system shared memory only"


def off(program: str) -> str:
    """The region calls' refusal (UNIMPLEMENTED) where `program` takes no shared memory."""
    return f"shared memory is off; start {program} with --shared-memory (for callers on its host)"


def unserved(program: str) -> str:
    """The words after what names a region in a body (INVALID_ARGUMENT) where `program`
    takes no shared memory."""
    return (
        f"Sluice does not serve shared memory here: start {program} with --shared-memory "
        "(for callers on its host), or send the values in the request"
    )


def parse(kind: type[M], body: bytes) -> M:
    """A request body as `kind`, refused (INVALID_ARGUMENT) in the parser's words."""
    try:
        return kind.FromString(body)
    except DecodeError as exc:
        raise InvalidInput(
            f"request body is not a valid {kind.DESCRIPTOR.full_name} message: {exc}"
        ) from None


# The empty replies, serialized once.
_REGISTERED = pb.RegisterRegionResponse().SerializeToString()
_UNREGISTERED = pb.UnregisterRegionResponse().SerializeToString()
_SYSTEM_REGISTERED = kpb.SystemSharedMemoryRegisterResponse().SerializeToString()
_SYSTEM_UNREGISTERED = kpb.SystemSharedMemoryUnregisterResponse().SerializeToString()
_CUDA_STATUS = kpb.CudaSharedMemoryStatusResponse().SerializeToString()
_CUDA_UNREGISTERED = kpb.CudaSharedMemoryUnregisterResponse().SerializeToString()


class RegionCalls:
    """A program's region calls, request bytes to reply bytes for a caller whose regions are
    `tenant`'s ("" with tenants off). `regions`: the program's registry (None: shared memory
    is off, and every call but CUDA's is refused UNIMPLEMENTED, naming `program`). Each
    refusal is a SluiceError naming its status."""

    def __init__(self, regions: Regions | None, program: str) -> None:
        self.regions = regions
        self.off = off(program)

    def _on(self) -> Regions:
        if self.regions is None:
            raise Unimplemented(self.off)
        return self.regions

    # sluice.v1's.

    def register(self, tenant: str, body: bytes) -> bytes:
        """RegisterRegion: map the caller's object as its region (a name it holds already:
        ALREADY_EXISTS; past its bounds: RESOURCE_EXHAUSTED)."""
        regions = self._on()
        r = parse(pb.RegisterRegionRequest, body)
        regions.register(tenant, r.name, r.key, r.offset, r.byte_size)
        return _REGISTERED

    def status(self, tenant: str, body: bytes) -> bytes:
        """RegionStatus: the caller's region by name (NOT_FOUND: none), or all of them."""
        regions = self._on()
        found = regions.status(tenant, parse(pb.RegionStatusRequest, body).name)
        return pb.RegionStatusResponse(
            regions=[
                pb.RegisterRegionRequest(
                    name=i.name, key=i.key, offset=i.offset, byte_size=i.byte_size
                )
                for i in found
            ]
        ).SerializeToString()

    def unregister(self, tenant: str, body: bytes) -> bytes:
        """UnregisterRegion: forget the caller's region by name (one it never registered
        is no error), or all of them; a call still using one keeps it until it ends."""
        regions = self._on()
        regions.unregister(tenant, parse(pb.UnregisterRegionRequest, body).name)
        return _UNREGISTERED

    # Triton's system shared memory, the same regions.

    def system_register(self, tenant: str, body: bytes) -> bytes:
        regions = self._on()
        r = parse(kpb.SystemSharedMemoryRegisterRequest, body)
        regions.register(tenant, r.name, r.key, r.offset, r.byte_size)
        return _SYSTEM_REGISTERED

    def system_status(self, tenant: str, body: bytes) -> bytes:
        regions = self._on()
        found = regions.status(tenant, parse(kpb.SystemSharedMemoryStatusRequest, body).name)
        status = kpb.SystemSharedMemoryStatusResponse.RegionStatus
        return kpb.SystemSharedMemoryStatusResponse(
            regions={
                i.name: status(name=i.name, key=i.key, offset=i.offset, byte_size=i.byte_size)
                for i in found
            }
        ).SerializeToString()

    def system_unregister(self, tenant: str, body: bytes) -> bytes:
        regions = self._on()
        regions.unregister(tenant, parse(kpb.SystemSharedMemoryUnregisterRequest, body).name)
        return _SYSTEM_UNREGISTERED

    # CUDA shared memory, as Triton without GPUs answers it: none is ever registered.

    def cuda_status(self, tenant: str, body: bytes) -> bytes:
        name = parse(kpb.CudaSharedMemoryStatusRequest, body).name
        if name:
            raise RegionNotFound(f"Unable to find cuda shared memory region: {name!r}")
        return _CUDA_STATUS

    def cuda_register(self, tenant: str, body: bytes) -> bytes:
        name = parse(kpb.CudaSharedMemoryRegisterRequest, body).name
        raise InvalidInput(
            f"failed to register CUDA shared memory region: {name[:256]!r}, {NO_CUDA}"
        )

    def cuda_unregister(self, tenant: str, body: bytes) -> bytes:
        parse(kpb.CudaSharedMemoryUnregisterRequest, body)  # none is there to unregister
        return _CUDA_UNREGISTERED


RegionCall = Callable[[RegionCalls, str, bytes], bytes]
# Each face's region calls by method name: sluice.v1.Inference's, and
# inference.GRPCInferenceService's.
V1_CALLS: dict[str, RegionCall] = {
    "RegisterRegion": RegionCalls.register,
    "RegionStatus": RegionCalls.status,
    "UnregisterRegion": RegionCalls.unregister,
}
KSERVE_CALLS: dict[str, RegionCall] = {
    "SystemSharedMemoryStatus": RegionCalls.system_status,
    "SystemSharedMemoryRegister": RegionCalls.system_register,
    "SystemSharedMemoryUnregister": RegionCalls.system_unregister,
    "CudaSharedMemoryStatus": RegionCalls.cuda_status,
    "CudaSharedMemoryRegister": RegionCalls.cuda_register,
    "CudaSharedMemoryUnregister": RegionCalls.cuda_unregister,
}
