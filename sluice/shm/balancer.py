"""Shared memory through the balancer, a sidecar on its callers' host: a caller registers
POSIX shared memory regions with the balancer (`--shared-memory`; both faces: sluice.v1's
RegisterRegion/RegionStatus/UnregisterRegion, KServe's SystemSharedMemory*), and a Predict
or ModelInfer that names them is forwarded as an ordinary body, the region bytes copied once,
straight from the mapping into it. The servers need no shared memory (they may be on other
hosts). The answer's outputs that the call placed in regions are written there, once, from
the answer the planner returns (retries never write), and the caller is answered with
references instead of their bytes (sluice.v1's Tensor.shared_memory; in KServe, Triton's
shape: the output's raw_output_contents entry empty). Registering never reaches a server.

Regions are per tenant (the balancer's tenants, when on) and live in this process: the
balancer takes them with one process only (--workers 1)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

from sluice.core.errors import Code, InvalidInput, SluiceError
from sluice.core.tenants import Account, tenant_name
from sluice.kserve import grpc_predict_v2_pb2 as kpb
from sluice.runtime import door
from sluice.runtime.status import status_of
from sluice.shm import placement, scan
from sluice.shm.calls import KSERVE_CALLS, V1_CALLS, RegionCall, RegionCalls, unserved
from sluice.shm.registry import Lease, Regions
from sluice.shm.slots import OutputSlot
from sluice.v1 import inference_pb2 as pb
from sluice.wire import codec, facts, peek
from sluice.wire.mux import Reply

# After what names a region in a body (INVALID_ARGUMENT), the servers' words naming this
# program.
PROGRAM = "sluice-balancer"  # BalancerSettings.PROG: the program this part plugs into
NO_SHARED_MEMORY = unserved(PROGRAM)
_RAW_INPUT = peek.tag(facts.INFER_RAW_INPUTS)
# Appended to a written PredictRequest: protobuf merges a message's fields in order.
_TYPED_OUTPUTS = pb.PredictRequest(typed_outputs=True).SerializeToString()

M = TypeVar("M", bound=Message)
R = TypeVar("R", pb.PredictRequest, kpb.ModelInferRequest)
Context = grpc.aio.ServicerContext[bytes, bytes]
Gate = Callable[[Context, str], Awaitable[tuple[Account | None, dict[str, str]]]]
Handler = Callable[[bytes, Context], Awaitable[bytes]]


class Relay(ABC):
    """One call whose body names regions: `body`, the one forwarded (the regions' bytes in
    it), and `answer`, which writes the answer's placed outputs into their regions and
    gives the caller's answer. Its lease holds the regions until `release`."""

    def __init__(self, body: bytes, lease: Lease, places: dict[str, OutputSlot]) -> None:
        self.body = body
        self.lease = lease
        self.places = places  # the outputs to write, by name

    @abstractmethod
    def answer(self, body: bytes) -> bytes:
        """The caller's answer to the server's (`body`), its placed outputs written;
        SluiceError (its status) when they cannot be."""

    def finish(self, reply: Reply) -> Reply:
        """The caller's answer to the server's `reply`, its placed outputs written, and the
        regions let go: a failure in either is the call's answer (counted as it is sent),
        never an exception past the call, nor in place of the server's own failure."""
        try:
            if reply.code == 0:
                reply = Reply(0, body=self.answer(reply.body), trailers=reply.trailers)
        except SluiceError as exc:
            reply = Reply(Code[exc.status], str(exc), trailers=reply.trailers)
        try:
            self.release(ok=reply.code == 0)
        except SluiceError as exc:  # a copy that could not be written back: no answer there
            return Reply(Code[exc.status], str(exc), trailers=reply.trailers)
        return reply

    def release(self, ok: bool = True) -> None:
        """Let go of the regions (`ok`: the answer was written; a copying lease writes it
        back, else nothing); SluiceError when a copy cannot be written back."""
        self.places = {}  # its views go first, so a copying lease can reuse their buffers
        self.lease.release(ok)


def _answered(kind: type[M], body: bytes) -> M:
    try:
        return kind.FromString(body)
    except DecodeError as exc:
        raise SluiceError(
            f"the server's answer is not a valid {kind.DESCRIPTOR.full_name}: {exc}"
        ) from None


class _Predict(Relay):
    def __init__(
        self, body: bytes, lease: Lease, places: dict[str, OutputSlot], typed: bool
    ) -> None:
        super().__init__(body, lease, places)
        self.typed = typed

    def answer(self, body: bytes) -> bytes:
        if not self.places:
            return body
        response = _answered(pb.PredictResponse, body)
        try:
            outputs = codec.decode_all(response.outputs)
            # The server's own writer (the outputs a server with regions would place).
            return codec.encode_predict_response(
                response.model, response.version, outputs, self.typed, self.places
            )
        except codec.TensorError as exc:
            raise InvalidInput(str(exc)) from None


class _Infer(Relay):
    def answer(self, body: bytes) -> bytes:
        if not self.places:
            return body
        response = _answered(kpb.ModelInferResponse, body)
        raw = response.raw_output_contents
        if len(raw) != len(response.outputs):
            raise SluiceError(
                f"the server's answer carries {len(raw)} raw_output_contents for "
                f"{len(response.outputs)} outputs: the outputs placed in shared memory "
                "need their raw bytes"
            )
        at = {t.name: i for i, t in enumerate(response.outputs)}
        # The server's writer: as a server with the regions would answer.
        data = {name: raw[at[name]] for name in self.places if name in at}
        writes = placement.triton_writes(self.places, response.outputs, data)
        for name in self.places:
            raw[at[name]] = b""
        answer = response.SerializeToString()
        writes.land()
        return answer


class SharedMemory:
    """The balancer's regions (None: --shared-memory is off, and every use of them is
    refused), the region calls of both faces, and the calls that name regions.
    `gate`: the balancer's door for a control call (its tenant)."""

    def __init__(self, regions: Regions | None, gate: Gate) -> None:
        self.regions = regions
        self.calls = RegionCalls(regions, PROGRAM)
        self.gate = gate

    # The region calls.

    def v1_methods(self) -> dict[str, grpc.RpcMethodHandler[bytes, bytes]]:
        """sluice.v1.Inference's region calls by method name."""
        return self._handlers(V1_CALLS)

    def kserve_methods(self) -> dict[str, grpc.RpcMethodHandler[bytes, bytes]]:
        """inference.GRPCInferenceService's shared memory calls by method name: the system
        ones, and the CUDA ones as the server answers them (Triton's without GPUs)."""
        return self._handlers(KSERVE_CALLS)

    def _handlers(
        self, calls: Mapping[str, RegionCall]
    ) -> dict[str, grpc.RpcMethodHandler[bytes, bytes]]:
        return {
            name: grpc.unary_unary_rpc_method_handler(self._handler(fn))
            for name, fn in calls.items()
        }

    def _handler(self, fn: RegionCall) -> Handler:
        """A region call past the door, on its caller's tenant's regions ("" with tenants
        off); a SluiceError is its status."""

        async def answer(body: bytes, context: Context) -> bytes:
            account, _ = await self.gate(context, door.TENANT)
            try:
                return self.calls.call(fn, tenant_name(account), context.peer(), body)
            except SluiceError as exc:
                await context.abort(status_of(exc), str(exc))

        return answer

    # The calls that name regions.

    def prepare(self, body: bytes, kind: facts.Kind, tenant: str) -> Relay | None:
        """The call `body` (a `kind` request of `tenant`'s) makes of its caller's regions;
        None when it names none (it goes as it came). SluiceError (its status) when it may
        not: shared memory off, a region unknown to the tenant, a range outside it, a size
        that is not its tensor's, another call writing the same bytes."""
        # Each test first is the cheap one, true of every body that names a region; the
        # parse judges (a walk that gave up, the key's bytes in a value). A body no parser
        # takes names none: it goes on to be refused as any other.
        try:
            if kind is facts.PREDICT:
                if not scan.uses_regions(body):
                    return None
                request = pb.PredictRequest.FromString(body)
                if request.output_memory or any(
                    t.HasField("shared_memory") for t in request.inputs
                ):
                    return self._relay(_predict, request, tenant)
                return None
            if not scan.infer_uses_regions(body):
                return None
            infer = kpb.ModelInferRequest.FromString(body)
        except DecodeError:
            return None
        named = [t.parameters for t in infer.inputs] + [t.parameters for t in infer.outputs]
        if any(placement.REGION in p for p in named):
            return self._relay(_infer, infer, tenant)
        return None

    def _relay(self, place: Callable[[R, Lease | None], Relay], request: R, tenant: str) -> Relay:
        """`place` the request with a lease on `tenant`'s regions (none when off: refused),
        let go if it is refused."""
        lease = None if self.regions is None else self.regions.lease(tenant)
        try:
            return place(request, lease)
        except BaseException:
            if lease is not None:
                lease.release()
            raise


def _predict(request: pb.PredictRequest, lease: Lease | None) -> Relay:
    # A view of the region per input in it: written into the body once.
    inputs, places = placement.predict_tensors(request, lease, NO_SHARED_MEMORY)
    assert lease is not None  # without one a region is refused
    body = codec.encode_predict(inputs, request.outputs, request.model, request.version)
    if request.typed_outputs:
        body += _TYPED_OUTPUTS
    return _Predict(body, lease, places, request.typed_outputs)


def _infer(request: kpb.ModelInferRequest, lease: Lease | None) -> Relay:
    body, places = _infer_body(request, lease)
    assert lease is not None  # without one a region is refused
    return _Infer(body, lease, places)


def _infer_body(
    request: kpb.ModelInferRequest, lease: Lease | None
) -> tuple[bytes, dict[str, OutputSlot]]:
    """A ModelInferRequest's body with its inputs' region bytes as raw_input_contents
    (protobuf writes the rest; the entries, its last field, are framed here so that each is
    copied once, into the body), and the views its outputs are to be written into. No
    `lease`: shared memory is off, and a region named is refused."""
    refs = placement.triton_inputs(request.inputs, lease, NO_SHARED_MEMORY)
    given = list(request.raw_input_contents)
    placement.check_raw_entries(len(given), refs.count(None))
    entries: list[bytes | memoryview] = []
    rest = iter(given)
    for tensor, ref in zip(request.inputs, refs, strict=True):
        if ref is None:
            if given:
                entries.append(next(rest))
            else:  # its values typed: raw too now, as the regions' bytes go
                entries.append(codec.bytes_of(placement.triton_contents(tensor)))
                tensor.ClearField("contents")
            continue
        assert lease is not None  # triton_ref refused a region without one
        # The region's bytes, copied once: into the body.
        entries.append(placement.triton_input(tensor, request.model_name, ref, lease)[0])
        _unplaced(tensor.parameters)
    places: dict[str, OutputSlot] = {}
    for output in request.outputs:
        placed = placement.triton_output(output, lease, NO_SHARED_MEMORY)
        if placed is not None:
            _unplaced(output.parameters)
            places[output.name] = placed
    del request.raw_input_contents[:]
    parts: list[bytes | memoryview] = [request.SerializeToString(deterministic=True)]
    for entry in entries:
        parts += (_RAW_INPUT, peek.varint(len(entry)), entry)
    return b"".join(parts), places


def _unplaced(parameters: MutableMapping[str, kpb.InferParameter]) -> None:
    """A tensor's placement taken off it: the server gets (or answers) its bytes instead."""
    for key in (placement.REGION, placement.OFFSET, placement.BYTE_SIZE):
        parameters.pop(key, None)
