"""sluice.v1's shared memory region calls (RegisterRegion, RegionStatus, UnregisterRegion)
for one caller: request bytes to its tenant's regions in the node's registry
(sluice.core.shm), and back to reply bytes. The registry's refusals are SluiceErrors, each
naming its status; with shared memory off (no registry) every call is UNIMPLEMENTED, as the
KServe face answers Triton's."""

from __future__ import annotations

from sluice.core.errors import Unimplemented
from sluice.core.shm import Regions
from sluice.server.settings import ServerSettings
from sluice.server.v1 import parse
from sluice.v1 import inference_pb2 as pb
from sluice.wire.regions import off

OFF = off(ServerSettings.PROG)  # both faces' region calls, refused
# The empty replies, serialized once.
REGISTERED = pb.RegisterRegionResponse().SerializeToString()
UNREGISTERED = pb.UnregisterRegionResponse().SerializeToString()


class RegionCalls:
    """The region calls of one caller, whose regions are `tenant`'s ("" with auth off)."""

    def __init__(self, regions: Regions | None, tenant: str) -> None:
        self.regions = regions  # None: shared memory is off on this node
        self.tenant = tenant

    def _on(self) -> Regions:
        if self.regions is None:
            raise Unimplemented(OFF)
        return self.regions

    def register(self, body: bytes) -> bytes:
        """RegisterRegion: map the caller's object as its region (a name it holds already:
        ALREADY_EXISTS; past its bounds: RESOURCE_EXHAUSTED)."""
        request = parse(pb.RegisterRegionRequest, body)
        self._on().register(
            self.tenant, request.name, request.key, request.offset, request.byte_size
        )
        return REGISTERED

    def status(self, body: bytes) -> bytes:
        """RegionStatus: the caller's region by name (NOT_FOUND: none), or all of them."""
        request = parse(pb.RegionStatusRequest, body)
        found = self._on().status(self.tenant, request.name)
        return pb.RegionStatusResponse(
            regions=[
                pb.RegisterRegionRequest(
                    name=r.name, key=r.key, offset=r.offset, byte_size=r.byte_size
                )
                for r in found
            ]
        ).SerializeToString()

    def unregister(self, body: bytes) -> bytes:
        """UnregisterRegion: forget the caller's region by name (one it never registered
        is no error), or all of them; a call still using one keeps it until it ends."""
        request = parse(pb.UnregisterRegionRequest, body)
        self._on().unregister(self.tenant, request.name)
        return UNREGISTERED
