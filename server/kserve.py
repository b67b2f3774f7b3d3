"""The KServe v2 / Open Inference Protocol over gRPC (Triton's and MLServer's API), served
beside sluice.v1 so their clients work unchanged: ModelInfer as a dataplane protocol, taking
Predict's path, and a thin servicer for the protocol's other calls (with --shared-memory,
Triton's system shared memory extension too)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

import grpc
from google.protobuf.message import DecodeError

from sluice.core.errors import InvalidInput, ModelNotFound, Unimplemented
from sluice.kserve import grpc_predict_v2_pb2 as kpb
from sluice.runtime.door import ADMIN, OPEN, TENANT
from sluice.runtime.process import package_version
from sluice.server.dataplane.batcher import Arrays
from sluice.server.dataplane.engine import TensorSpec
from sluice.server.dataplane.models import Model
from sluice.server.dataplane.plane import Asked, Request
from sluice.server.dataplane.repository import LoadReport
from sluice.server.service import Call, InferenceService, Method
from sluice.server.v1 import NO_SHARED_MEMORY
from sluice.shm import placement, scan
from sluice.shm.calls import KSERVE_CALLS, SYSTEM_SHARED_MEMORY
from sluice.shm.registry import Lease
from sluice.shm.slots import OutputSlot
from sluice.wire import facts, peek
from sluice.wire.body import parse

SERVICE = kpb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
INFER = "ModelInfer"  # also a PredictStream message's `method`
# Triton's name: clients and dashboards match on it.
PLATFORM = "onnxruntime_onnx"
REPOSITORY = "model_repository"  # the extension's name in ServerMetadata
# With auth on (others: any tenant).
ACCESS = {
    "ServerLive": OPEN,
    "ServerReady": OPEN,
    "ModelReady": OPEN,
    "RepositoryIndex": ADMIN,
    "RepositoryModelLoad": ADMIN,
    "RepositoryModelUnload": ADMIN,
}
REPOSITORY_OFF = (
    "the repository API is off; start sluice-server with --model-repository DIR --repository-api"
)
READY = "READY"
# RepositoryModelLoad's answer has no fields: trailers say what serves and what was refused.
LOADED_TRAILER = "x-loaded-versions"
REFUSED_TRAILER = "x-refused-versions"

_RAW_INPUT = facts.INFER_RAW_INPUTS
# Below this, framing by hand costs more than protobuf's copies save (measured).
FRAMED_FROM = 4 << 10
_RAW_OUTPUT_TAG = peek.tag(facts.INFER_RESPONSE_RAW_OUTPUTS)


# None: no output in shared memory.
OutputSlots = Mapping[str, OutputSlot] | None


class KServeV2:
    """ModelInfer's bodies. The request's `id` is left out of the cache key and put in front
    of the answer by the dataplane (ModelInferResponse's `id` has the same field number), so
    requests that differ only in id share one cached answer."""

    name = "kserve.v2"

    def __init__(self, shared_memory: bool = False) -> None:
        self.shared_memory = shared_memory

    def route(self, body: bytes) -> Asked:
        try:
            read = facts.read(body, facts.MODEL_INFER)
        except peek.Malformed as exc:
            raise InvalidInput(str(exc)) from None
        # Off, a region is refused by `decode`.
        shared = self.shared_memory and scan.infer_uses_regions(body)
        return Asked(read.model, read.version, read.id_span, shared)

    def decode(self, body: bytes, lease: Lease | None = None) -> Request[OutputSlots]:
        request, raw = read_infer(body)
        inputs, placements = placement.infer_tensors(request, raw, lease, NO_SHARED_MEMORY)
        return Request(inputs, [output.name for output in request.outputs], placements or None)

    def encode(self, model: Model, request: Request[OutputSlots], outputs: Arrays) -> bytes:
        tensors, arrays, writes = placement.infer_outputs(outputs, request.options or {})
        if sum(a.nbytes for a in arrays) < FRAMED_FROM:
            raw = [a.tobytes() for a in arrays]
            answer = kpb.ModelInferResponse(
                model_name=model.name,
                model_version=model.version,
                outputs=tensors,
                raw_output_contents=raw,
            ).SerializeToString()
        else:
            # The raw entries framed here are copied once (through protobuf, three times).
            head = kpb.ModelInferResponse(
                model_name=model.name, model_version=model.version, outputs=tensors
            ).SerializeToString()
            parts: list[bytes | memoryview] = [head]
            for array in arrays:
                parts += (_RAW_OUTPUT_TAG, peek.varint(array.nbytes), array.data)
            answer = b"".join(parts)
        if writes is not None:
            writes.land()
        return answer


def read_infer(body: bytes) -> tuple[kpb.ModelInferRequest, Sequence[bytes | memoryview]]:
    """The request and its raw_input_contents: for large bodies, views of `body` found by a
    walk, protobuf parsing only the rest (a body the walk refuses is parsed whole, so that
    the parser's words refuse it)."""
    if len(body) < peek.WIRE_READ_FROM:
        request = parse(kpb.ModelInferRequest, body)
        return request, request.raw_input_contents
    view = memoryview(body)
    raw: list[memoryview] = []
    rest: list[memoryview] = []
    at = 0
    try:
        for tag, number, wire, a, b in peek.walk(body, 0, len(body), peek.MAX_FIELDS):
            # A raw entry of another wire type is an unknown field to the parser: left in.
            if number == _RAW_INPUT and wire == 2:
                raw.append(view[a:b])
                rest.append(view[at:tag])
                at = b
        if raw:
            rest.append(view[at:])
            return kpb.ModelInferRequest.FromString(b"".join(rest)), raw
    except (peek.Malformed, DecodeError):
        pass
    request = parse(kpb.ModelInferRequest, body)
    return request, request.raw_input_contents


class IndexEntry(Protocol):
    """One row of a repository's index (version "": the whole model)."""

    @property
    def name(self) -> str: ...
    @property
    def version(self) -> str: ...
    @property
    def state(self) -> str: ...
    @property
    def reason(self) -> str: ...


class Repository(Protocol):
    """The model repository, as far as the repository API reaches into it."""

    def index(self) -> Sequence[IndexEntry]: ...

    async def load(self, name: str) -> LoadReport: ...

    async def unload(self, name: str) -> None: ...


class KServeService:
    """`inference.GRPCInferenceService` over an InferenceService (the same ids, trailers,
    stats, tracing and errors). ModelInfer is a PredictStream method too, so a balancer can
    carry it on its streams."""

    def __init__(self, service: InferenceService, repository: Repository | None = None) -> None:
        self.service = service
        self.repository = repository
        self.version = package_version()
        self.protocol = KServeV2(shared_memory=service.regions is not None)
        service.stream_methods[INFER] = self.model_infer

    def handler(self) -> grpc.GenericRpcHandler[bytes, bytes]:
        return grpc.method_handlers_generic_handler(SERVICE, self.methods())

    def methods(self) -> dict[str, grpc.RpcMethodHandler[bytes, bytes]]:
        methods: dict[str, Method] = {
            "ServerLive": self.server_live,
            "ServerReady": self.server_ready,
            "ModelReady": self.model_ready,
            "ServerMetadata": self.server_metadata,
            "ModelMetadata": self.model_metadata,
            INFER: self.model_infer,
            "RepositoryIndex": self.repository_index,
            "RepositoryModelLoad": self.repository_load,
            "RepositoryModelUnload": self.repository_unload,
            **{name: self.service.region_call(fn) for name, fn in KSERVE_CALLS.items()},
        }
        return {
            name: grpc.unary_unary_rpc_method_handler(
                self.service.wrap(
                    fn,
                    counted=name == INFER,
                    method=name,
                    access=ACCESS.get(name, TENANT),
                    peer=name in KSERVE_CALLS,
                )
            )
            for name, fn in methods.items()
        }

    async def model_infer(self, body: bytes, call: Call) -> bytes:
        return await self.service.infer(body, call, self.protocol)

    async def server_live(self, body: bytes, call: Call) -> bytes:
        parse(kpb.ServerLiveRequest, body)
        return kpb.ServerLiveResponse(live=True).SerializeToString()

    async def server_ready(self, body: bytes, call: Call) -> bytes:
        parse(kpb.ServerReadyRequest, body)
        ready = self.service.serving and len(self.service.plane.models) > 0
        return kpb.ServerReadyResponse(ready=ready).SerializeToString()

    async def model_ready(self, body: bytes, call: Call) -> bytes:
        request = parse(kpb.ModelReadyRequest, body)
        try:
            self.service.plane.models.get(request.name, request.version)
        except ModelNotFound:  # Triton answers "not ready" for a model it does not know
            ready = False
        else:
            ready = self.service.serving
        return kpb.ModelReadyResponse(ready=ready).SerializeToString()

    async def server_metadata(self, body: bytes, call: Call) -> bytes:
        parse(kpb.ServerMetadataRequest, body)
        extensions = [REPOSITORY] if self.repository is not None else []
        if self.service.regions is not None:
            extensions.append(SYSTEM_SHARED_MEMORY)
        response = kpb.ServerMetadataResponse(
            name="sluice", version=self.version, extensions=extensions
        )
        return response.SerializeToString()

    async def model_metadata(self, body: bytes, call: Call) -> bytes:
        request = parse(kpb.ModelMetadataRequest, body)
        models = self.service.plane.models
        model = models.get(request.name, request.version)
        response = kpb.ModelMetadataResponse(
            name=model.name,
            versions=[m.version for m in models.versions(model.name)],
            platform=PLATFORM,
            inputs=_metadata(model.inputs),
            outputs=_metadata(model.outputs),
        )
        return response.SerializeToString()

    def _repository(self) -> Repository:
        if self.repository is None:
            raise Unimplemented(REPOSITORY_OFF)
        return self.repository

    # One repository: its name in a request (`repository_name`) is not checked.

    async def repository_index(self, body: bytes, call: Call) -> bytes:
        repository = self._repository()
        request = parse(kpb.RepositoryIndexRequest, body)
        rows = [
            kpb.RepositoryIndexResponse.ModelIndex(
                name=e.name, version=e.version, state=e.state, reason=e.reason
            )
            for e in repository.index()
            if not request.ready or e.state == READY
        ]
        return kpb.RepositoryIndexResponse(models=rows).SerializeToString()

    async def repository_load(self, body: bytes, call: Call) -> bytes:
        repository = self._repository()
        request = parse(kpb.RepositoryModelLoadRequest, body)
        _no_parameters("RepositoryModelLoad", request.parameters)
        report = await repository.load(request.model_name)
        call.trailers.append((LOADED_TRAILER, ",".join(map(str, report.serving))))
        if report.refused:
            call.trailers.append((REFUSED_TRAILER, ",".join(map(str, report.refused))))
        return kpb.RepositoryModelLoadResponse().SerializeToString()

    async def repository_unload(self, body: bytes, call: Call) -> bytes:
        repository = self._repository()
        request = parse(kpb.RepositoryModelUnloadRequest, body)
        # Triton's client always sends unload_dependents; Sluice serves no ensembles.
        asked = [name for name in request.parameters if name != "unload_dependents"]
        _no_parameters("RepositoryModelUnload", asked)
        await repository.unload(request.model_name)
        return kpb.RepositoryModelUnloadResponse().SerializeToString()


def _no_parameters(method: str, parameters: Iterable[str]) -> None:
    """Refuse Triton's load parameters, which would load other than the repository holds."""
    names = sorted(parameters)
    if names:
        raise InvalidInput(
            f"{method} takes no parameters ({', '.join(names)} given); Sluice loads "
            "what the repository holds"
        )


def _metadata(specs: list[TensorSpec]) -> list[kpb.ModelMetadataResponse.TensorMetadata]:
    return [
        kpb.ModelMetadataResponse.TensorMetadata(
            name=s.name, datatype=s.datatype, shape=[-1 if d is None else d for d in s.shape]
        )
        for s in specs
    ]
