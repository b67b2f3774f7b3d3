"""The region calls both programs answer with --shared-memory: sluice.v1's RegisterRegion,
RegionStatus and UnregisterRegion, KServe's SystemSharedMemory* (and CudaSharedMemory* as
Triton without GPUs answers them), for one caller's tenant; and the words that refuse shared
memory where a program takes none, naming that program to start with the flag."""

from __future__ import annotations

import ipaddress
import urllib.parse
from collections.abc import Callable

from sluice.core.errors import (
    InvalidInput,
    PermissionDenied,
    RegionNotFound,
    Unimplemented,
)
from sluice.kserve import grpc_predict_v2_pb2 as kpb
from sluice.shm.registry import Regions
from sluice.v1 import inference_pb2 as pb
from sluice.wire.body import parse

SYSTEM_SHARED_MEMORY = "system_shared_memory"  # the extension's name in ServerMetadata
# Triton's answer where it has no GPU; Sluice maps no CUDA memory of other processes.
NO_CUDA = "GPUs not supported: Sluice takes system shared memory only"


# A registration from elsewhere is refused: a region is an object on this host, which the
# program would read inputs from and write outputs into.
LOCAL_ONLY = (
    "shared memory regions are registered by callers on this host only (this call came from {peer})"
)


def on_this_host(peer: str) -> bool:
    """Whether a call's peer, as grpc names it (`context.peer()`: "ipv4:127.0.0.1:5000",
    "ipv6:%5B::1%5D:5000", "unix:..."), is on this host: a unix socket, or a loopback
    address (an IPv4 one mapped into IPv6 too)."""
    scheme, _, rest = urllib.parse.unquote(peer).partition(":")
    if scheme in ("unix", "unix-abstract"):
        return True
    if scheme not in ("ipv4", "ipv6"):
        return False
    host = rest.rpartition(":")[0].removeprefix("[").removesuffix("]")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


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

    def call(self, fn: RegionCall, tenant: str, peer: str, body: bytes) -> bytes:
        """The region call `fn` for a caller of `tenant`'s at `peer` (grpc's name for it):
        a registration only from this host (PERMISSION_DENIED: on another, the caller
        would name this host's objects, not its own). Status and unregistering stay open to
        the region's tenant, wherever it calls from."""
        if fn in _REGISTERING:
            self._on()  # off: that first
            if not on_this_host(peer):
                raise PermissionDenied(LOCAL_ONLY.format(peer=peer))
        return fn(self, tenant, body)

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
_REGISTERING: tuple[RegionCall, ...] = (RegionCalls.register, RegionCalls.system_register)
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
