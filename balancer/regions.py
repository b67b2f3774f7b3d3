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

import asyncio
import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping
from typing import TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

from sluice.balancer.settings import BalancerSettings
from sluice.core.datatypes import DATATYPES
from sluice.core.errors import InvalidInput, SluiceError
from sluice.core.shm import Lease, Regions
from sluice.core.tenants import Account
from sluice.kserve import grpc_predict_v2_pb2 as kpb
from sluice.runtime import door
from sluice.runtime.settings import ProgramSettings
from sluice.runtime.status import status_of
from sluice.v1 import inference_pb2 as pb
from sluice.wire import codec, facts, peek
from sluice.wire.regions import KSERVE_CALLS, V1_CALLS, RegionCall, RegionCalls, unserved

log = logging.getLogger("sluice.balancer")

# After what names a region in a body (INVALID_ARGUMENT), the servers' words naming this
# program.
NO_SHARED_MEMORY = unserved(BalancerSettings.PROG)
SWEEP_S = 2.0  # how often regions whose object its caller unlinked are let go
# Triton's parameters of a tensor in shared memory (an input's bytes, an output's place).
REGION = "shared_memory_region"
OFFSET = "shared_memory_offset"
BYTE_SIZE = "shared_memory_byte_size"
_RAW_INPUT = peek.tag(facts.INFER_RAW_INPUTS)
# Appended to a written PredictRequest: protobuf merges a message's fields in order.
_TYPED_OUTPUTS = pb.PredictRequest(typed_outputs=True).SerializeToString()

M = TypeVar("M", bound=Message)
R = TypeVar("R", pb.PredictRequest, kpb.ModelInferRequest)
Context = grpc.aio.ServicerContext[bytes, bytes]
Gate = Callable[[Context, str], Awaitable[tuple[Account | None, dict[str, str]]]]
Handler = Callable[[bytes, Context], Awaitable[bytes]]


class Placing(ABC):
    """One call whose body names regions: `body`, the one forwarded (the regions' bytes in
    it), and `answer`, which writes the answer's placed outputs into their regions and
    gives the caller's answer. Its lease holds the regions until `release`."""

    def __init__(self, body: bytes, lease: Lease, places: dict[str, codec.Placed]) -> None:
        self.body = body
        self.lease = lease
        self.places = places  # the outputs to write, by name

    @abstractmethod
    def answer(self, body: bytes) -> bytes:
        """The caller's answer to the server's (`body`), its placed outputs written;
        SluiceError (its status) when they cannot be."""

    def release(self) -> None:
        self.lease.release()


def _answered(kind: type[M], body: bytes) -> M:
    try:
        return kind.FromString(body)
    except DecodeError as exc:
        raise SluiceError(
            f"the server's answer is not a valid {kind.DESCRIPTOR.full_name}: {exc}"
        ) from None


class _Predict(Placing):
    def __init__(
        self, body: bytes, lease: Lease, places: dict[str, codec.Placed], typed: bool
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


class _Infer(Placing):
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
        for name, (_, view) in self.places.items():  # all checked before any is written
            if name not in at:
                raise SluiceError(f"the server's answer lacks output {name!r}")
            if len(raw[at[name]]) > len(view):
                raise InvalidInput(
                    f"shared memory size specified with the request for output '{name}' "
                    f"({len(view)} bytes) should be at least {len(raw[at[name]])} bytes to "
                    "hold the results"
                )
        for name, (ref, view) in self.places.items():
            i = at[name]
            size = len(raw[i])
            view[:size] = raw[i]
            # The server's answer for an output in a region (Triton's empty entry; where
            # it went and the bytes it took in its parameters).
            params = response.outputs[i].parameters
            params[REGION].string_param = ref.region
            params[BYTE_SIZE].int64_param = size
            if ref.offset:
                params[OFFSET].int64_param = ref.offset
            raw[i] = b""
        return response.SerializeToString()


_Tensor = kpb.ModelInferRequest.InferInputTensor | kpb.ModelInferRequest.InferRequestedOutputTensor


def _triton_ref(tensor: _Tensor, label: str, on: bool) -> codec.Ref | None:
    """The region a KServe tensor's parameters place it in (None: none), read, checked and
    refused as the server reads them (Triton's words), and those parameters taken off it:
    the server gets its bytes instead. `on`: the balancer takes shared memory."""
    params = tensor.parameters
    if not params:
        return None
    region = params.get(REGION)
    if region is not None:
        if not on:
            raise InvalidInput(f"{label} names a shared memory region; {NO_SHARED_MEMORY}")
        if region.WhichOneof("parameter_choice") != "string_param":
            raise InvalidInput(
                f"invalid value type for '{REGION}' parameter for {label}, expected string_param"
            )
    values: dict[str, int] = {}
    for key in (OFFSET, BYTE_SIZE):
        value = params.get(key)
        if value is None:
            continue
        if region is None:
            raise InvalidInput(
                f"'{key}' can not be specified without '{REGION}' parameter for {label}"
            )
        if value.WhichOneof("parameter_choice") != "int64_param":
            raise InvalidInput(
                f"invalid value type for '{key}' parameter for {label}, expected int64_param"
            )
        values[key] = value.int64_param
    if region is None:
        return None
    if BYTE_SIZE not in values:
        raise InvalidInput(
            f"'{BYTE_SIZE}' must be specified along with '{REGION}' parameter for {label}"
        )
    for key in (REGION, OFFSET, BYTE_SIZE):
        params.pop(key, None)
    return codec.Ref(region.string_param, values.get(OFFSET, 0), values[BYTE_SIZE])


class SharedMemory:
    """The balancer's regions (None: --shared-memory is off, and every use of them is
    refused), the region calls of both faces, and the calls that name regions.
    `gate`: the balancer's door for a control call (its tenant)."""

    def __init__(self, regions: Regions | None, gate: Gate) -> None:
        self.regions = regions
        self.calls = RegionCalls(regions, BalancerSettings.PROG)
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
                return fn(self.calls, account.tenant.name if account is not None else "", body)
            except SluiceError as exc:
                await context.abort(status_of(exc), str(exc))

        return answer

    # The calls that name regions.

    def prepare(self, body: bytes, kind: facts.Kind, tenant: str) -> Placing | None:
        """The call `body` (a `kind` request of `tenant`'s) makes of its caller's regions;
        None when it names none (it goes as it came). SluiceError (its status) when it may
        not: shared memory off, a region unknown to the tenant, a range outside it, a size
        that is not its tensor's, another call writing the same bytes."""
        # Each test first is the cheap one, true of every body that names a region; the
        # parse judges (a walk that gave up, the key's bytes in a value). A body no parser
        # takes names none: it goes on to be refused as any other.
        try:
            if kind is facts.PREDICT:
                if not facts.uses_regions(body):
                    return None
                request = pb.PredictRequest.FromString(body)
                if request.output_memory or any(
                    t.HasField("shared_memory") for t in request.inputs
                ):
                    return self._placing(_predict, request, tenant)
                return None
            if not facts.infer_uses_regions(body):
                return None
            infer = kpb.ModelInferRequest.FromString(body)
        except DecodeError:
            return None
        named = [t.parameters for t in infer.inputs] + [t.parameters for t in infer.outputs]
        if any(REGION in p for p in named):
            return self._placing(_infer, infer, tenant)
        return None

    def _placing(
        self, place: Callable[[R, Lease | None], Placing], request: R, tenant: str
    ) -> Placing:
        """`place` the request with a lease on `tenant`'s regions (none when off: refused),
        let go if it is refused."""
        lease = None if self.regions is None else self.regions.lease(tenant)
        try:
            return place(request, lease)
        except BaseException:
            if lease is not None:
                lease.release()
            raise


def _predict(request: pb.PredictRequest, lease: Lease | None) -> Placing:
    try:
        # A view of the region per input in it: written into the body once.
        inputs = codec.decode_all(request.inputs, lease)
        refs = {n: codec.ref_of(r) for n, r in request.output_memory.items()}
        places = codec.placed(lease, refs)
    except codec.Unshared as exc:
        raise InvalidInput(f"{exc}; {NO_SHARED_MEMORY}") from None
    except codec.TensorError as exc:
        raise InvalidInput(str(exc)) from None
    assert lease is not None  # without one a region is Unshared
    body = codec.encode_predict(inputs, request.outputs, request.model, request.version)
    if request.typed_outputs:
        body += _TYPED_OUTPUTS
    return _Predict(body, lease, places, request.typed_outputs)


def _infer(request: kpb.ModelInferRequest, lease: Lease | None) -> Placing:
    body, places = _infer_body(request, lease)
    assert lease is not None  # without one a region is refused
    return _Infer(body, lease, places)


def _infer_body(
    request: kpb.ModelInferRequest, lease: Lease | None
) -> tuple[bytes, dict[str, codec.Placed]]:
    """A ModelInferRequest's body with its inputs' region bytes as raw_input_contents
    (protobuf writes the rest; the entries, its last field, are framed here so that each is
    copied once, into the body), and the views its outputs are to be written into. No
    `lease`: shared memory is off, and a region named is refused."""
    model = f" for model '{request.model_name}'" if request.model_name else ""
    labels = [f"input {t.name!r}" if t.name else "an input with no name" for t in request.inputs]
    refs = [
        _triton_ref(t, label, lease is not None)
        for t, label in zip(request.inputs, labels, strict=True)
    ]
    given = list(request.raw_input_contents)
    plain = refs.count(None)
    if len(given) != plain:
        # Sent with raw entries, as the regions' bytes go, the others' must be raw too.
        raise InvalidInput(
            f"raw_input_contents has {len(given)} entries but the request has {plain} inputs "
            "not in shared memory; with inputs in shared memory, send one entry per other "
            "input, in order"
        )
    entries: list[bytes | memoryview] = []
    rest = iter(given)
    for tensor, label, ref in zip(request.inputs, labels, refs, strict=True):
        if ref is None:
            entries.append(next(rest))
            continue
        assert lease is not None  # _triton_ref refused a region without one
        if tensor.HasField("contents"):
            raise InvalidInput(
                f"unexpected 'content' provided when using shared memory for {label}{model}"
            )
        dt = DATATYPES.get(tensor.datatype)
        if dt is None:
            raise InvalidInput(
                f"{label} has unknown datatype {tensor.datatype!r}; "
                f"expected one of {', '.join(DATATYPES)}"
            )
        shape = tuple(tensor.shape)
        if any(d < 0 for d in shape):
            raise InvalidInput(f"{label} has a negative dimension in shape {list(shape)}")
        view = lease.input(*ref)  # the region's bytes, copied once: into the body
        count = math.prod(shape)
        expected = count * dt.dtype.itemsize
        if ref.byte_size != expected:
            raise InvalidInput(
                f"input byte size mismatch for {label}{model}. Expected {expected}, got "
                f"{ref.byte_size} ('{BYTE_SIZE}'; {dt.name} shape {list(shape)} is {count} x "
                f"{dt.dtype.itemsize} bytes)"
            )
        entries.append(view)
    places: dict[str, codec.Placed] = {}
    for output in request.outputs:
        ref = _triton_ref(output, f"output {output.name!r}", lease is not None)
        if ref is not None:
            assert lease is not None
            # Taken now: an unknown region, a range past its end or one another call writes
            # into is refused before any server is asked.
            places[output.name] = codec.Placed(ref, lease.output(*ref))
    del request.raw_input_contents[:]
    parts: list[bytes | memoryview] = [request.SerializeToString(deterministic=True)]
    for entry in entries:
        parts += (_RAW_INPUT, peek.varint(len(entry)), entry)
    return b"".join(parts), places


def regions_of(settings: ProgramSettings) -> Regions | None:
    """The regions --shared-memory and its bounds ask for (None: off)."""
    if not settings.shared_memory:
        return None
    return Regions(
        max_regions=settings.shared_memory_regions, max_bytes=settings.shared_memory_bytes
    )


async def sweep(regions: Regions, every_s: float = SWEEP_S) -> None:
    """Let go of the regions whose object its caller unlinked (done with it, or gone),
    every `every_s`, until cancelled."""
    while True:
        await asyncio.sleep(every_s)
        for name in regions.sweep():
            log.info("shared memory region %r let go: its object was unlinked", name)
