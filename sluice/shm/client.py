"""A client's shared memory (`shared_memory=True`): its inputs written into POSIX shm objects
it creates, registered on the server as regions, so a Predict carries only where each tensor
lies and the server reads it in place; outputs come back the same way (output_memory).

Each call holds an `Arena` of its own (one object under one name) from the client's pool,
so calls on several threads never share bytes; one too small is replaced (re-registered),
none shrinks, and every object is unlinked on close() or at exit.

A model's output sizes are known only once it answered: a call of input shapes this client
has not sent that model before gets its outputs as bytes, the calls after it in the arena,
sized from that answer (`Learned`). An answer that outgrows them is refused
(refs.TOO_SMALL) and the call sent again, its outputs as bytes.

A call's steps are the client core's (sluice.client.core): `SharedMemory.call` yields the
Predict and the region calls it is given, for the client's driver to perform."""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import mmap
import os
import secrets
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np

from sluice.shm import refs
from sluice.v1 import inference_pb2 as pb
from sluice.wire import codec
from sluice.wire.mux import Reply

ROOT = Path("/dev/shm")  # where Linux keeps POSIX shared memory objects
PREFIX = "sluice-client-"  # this module's objects' names begin so (and end in random hex)
LEARNED = 256  # the input signatures whose output sizes a client keeps, newest first
T = TypeVar("T")
Steps = Generator[Any, Any, T]  # a client call's steps: what it yields, its driver performs
# A call's Predict of a body: its OK reply (a failed one raised, as grpc raises it).
Predict = Callable[[bytes], Steps[Reply]]
# One call to the target's stub: the method's name and its request.
Stub = Callable[[str, Any], Steps[Any]]
# A shared memory call's answer: the reply, the response it holds, and its outputs.
Answer = tuple[Reply, pb.PredictResponse, dict[str, np.ndarray]]
# The local addresses a target may name: grpc's unix sockets, loopback IPs and localhost.
UNIX = ("unix", "unix-abstract")
LOCAL_NAMES = ("localhost",)
NOT_LOCAL = (
    "shared memory needs a target on this host (127.0.0.1, localhost, [::1] or a unix: "
    "socket): {target} is not one"
)
ONE_TARGET = "shared memory needs one target, a server or balancer on this host: {count} were given"
# A registration's refusal where the server cannot open the object (sluice.shm.registry's words).
UNOPENED = "Unable to open shared memory region"
# A target that takes no regions (a server or balancer without --shared-memory, an older
# Sluice): what to do, by audience.
NO_REGIONS = {
    "python": "{target} takes no shared memory regions: start it (sluice-server or "
    "sluice-balancer) with --shared-memory, or drop shared_memory=True",
    "commands": "{target} takes no shared memory regions: start it (sluice-server or "
    "sluice-balancer) with --shared-memory, or drop this command's --shared-memory",
}


def check_target(targets: Sequence[str]) -> None:
    """ValueError unless `targets` is one, on this host: what shared memory needs."""
    if len(targets) != 1:
        raise ValueError(ONE_TARGET.format(count=len(targets)))
    if not on_this_host(targets[0]):
        raise ValueError(NOT_LOCAL.format(target=targets[0]))


def registration_error(
    error: grpc.RpcError, name: str, target: str, audience: Enum
) -> grpc.aio.AioRpcError:
    """A failed region call as grpc raises it, its code kept, its message saying what the
    call was for (and, where the server has no such call, what to do)."""
    code = error.code()
    details = error.details() or ""
    if code == grpc.StatusCode.UNIMPLEMENTED:
        details = f"{NO_REGIONS[audience.value].format(target=target)} (it said: {details})"
    return grpc.aio.AioRpcError(
        code,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(),
        f"could not register shared memory region {name!r} on {target}: {details}",
        None,
    )


def on_this_host(target: str) -> bool:
    """Whether grpc dials `target` on this host: a unix socket, or every address it names
    a loopback IP or localhost (ipv4:/ipv6: list several; dns:///HOST:PORT names one)."""
    scheme, colon, rest = target.partition(":")
    if colon and scheme in UNIX:
        return True
    if colon and scheme in ("ipv4", "ipv6"):
        return all(_local(host) for host in rest.split(","))
    if colon and scheme == "dns":
        rest = rest.removeprefix("//")
        target = rest.split("/", 1)[1] if "/" in rest else rest
    return _local(target)


def _local(address: str) -> bool:
    host, colon, port = address.rpartition(":")
    if not colon or not port.isdigit():
        host = address  # no port (ipv4: lists may omit it)
    host = host.removeprefix("[").removesuffix("]")
    if host.lower() in LOCAL_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


class Segment:
    """One POSIX shared memory object of `size` bytes, created under a fresh name (O_EXCL,
    mode 0600: this user's alone) and mapped; unlinked by close(), or when collected, or
    at the interpreter's exit, whichever comes first."""

    def __init__(self, size: int, root: Path = ROOT) -> None:
        name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        self.path = root / name
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        except BaseException:
            _unlink(self.path)
            raise
        finally:
            os.close(fd)
        self._unlink = weakref.finalize(self, _unlink, self.path)
        self.key = f"/{name}"  # as shm_open names it: what RegisterRegion takes
        self.size = size
        self.view = memoryview(self._map)

    def close(self) -> None:
        self._unlink()
        self.view.release()
        # An array still viewing it keeps the mapping (never the name) until it goes.
        with contextlib.suppress(BufferError):
            self._map.close()


def _pages(size: int) -> int:
    """`size` rounded up to whole pages (at least one): what an object is made to hold."""
    return max(-(-size // mmap.PAGESIZE), 1) * mmap.PAGESIZE


class Arena:
    """A region of this client's: the name the server knows it by, and the object under
    it. A `Memory` for the replies that name it."""

    def __init__(self, name: str, root: Path = ROOT) -> None:
        self.name = name
        self.root = root
        self.segment: Segment | None = None
        self.registered = False  # whether the server holds it under `name` now
        self.previous: Segment | None = None  # replaced; unlinked once unregistered
        # A call's inputs, written once the server holds the object (`registered_now`).
        self.pending: list[tuple[refs.Ref, np.ndarray]] = []

    def fit(self, size: int) -> bool:
        """Make the arena hold `size` bytes; whether its object was replaced by a larger
        one, which the server must then be told of (`registration`)."""
        if self.segment is not None and self.segment.size >= size:
            return False
        if self.previous is None:
            self.previous = self.segment
        elif self.segment is not None:  # made and never registered: nobody maps it
            self.segment.close()
        self.segment = Segment(_pages(size), self.root)
        self.registered = False
        return True

    def registration(self) -> pb.RegisterRegionRequest:
        assert self.segment is not None
        return pb.RegisterRegionRequest(
            name=self.name, key=self.segment.key, offset=0, byte_size=self.segment.size
        )

    def registered_now(self) -> None:
        """The server took the registration: the object it replaced can go, and the call's
        inputs go in (never before: a local caller of another tenant could register the
        object first, and read them)."""
        self.registered = True
        if self.previous is not None:
            self.previous.close()
            self.previous = None
        pending, self.pending = self.pending, []
        for ref, array in pending:
            codec.write(self.output(*ref), array)

    def renew(self) -> None:
        """Drop the object (unlinked), so that the next call makes one under a fresh name:
        the server would not open this one (another tenant registered it first)."""
        for segment in (self.segment, self.previous):
            if segment is not None:
                segment.close()
        self.segment = self.previous = None
        self.registered = False

    def input(self, region: str, offset: int, byte_size: int) -> memoryview:
        if self.segment is None or region != self.name:
            raise codec.TensorError(
                f"the answer names shared memory region {region!r}; this call placed its "
                f"outputs in {self.name!r}"
            )
        if offset + byte_size > self.segment.size:
            raise codec.TensorError(
                f"the answer names bytes [{offset}, {offset + byte_size}) of shared memory "
                f"region {region!r}, which holds {self.segment.size}"
            )
        return self.segment.view[offset : offset + byte_size]

    output = input  # this client writes what it reads: one view for both

    def wrote(self, view: memoryview, nbytes: int) -> None:
        """Nothing to do: a view is the object itself."""

    def close(self) -> None:
        for segment in (self.segment, self.previous):
            if segment is not None:
                segment.close()
        self.segment = self.previous = None
        self.registered = False


class Learned:
    """Output sizes (bytes, by output name) from answers, by what decides them: the model
    and version asked, the outputs asked, and the inputs' names, datatypes and shapes."""

    def __init__(self, most: int = LEARNED) -> None:
        self._most = most
        self._sizes: OrderedDict[tuple[object, ...], dict[str, int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[object, ...]) -> dict[str, int] | None:
        with self._lock:
            sizes = self._sizes.get(key)
            if sizes is not None:
                self._sizes.move_to_end(key)
            return sizes

    def put(self, key: tuple[object, ...], sizes: dict[str, int]) -> None:
        with self._lock:
            self._sizes[key] = sizes
            self._sizes.move_to_end(key)
            while len(self._sizes) > self._most:
                self._sizes.popitem(last=False)

    def forget(self, key: tuple[object, ...]) -> None:
        with self._lock:
            self._sizes.pop(key, None)


@dataclass(frozen=True)
class Layout:
    """One call's placement: its arena, where its outputs go in it (those of known size),
    and the body that names them and its inputs."""

    arena: Arena
    key: tuple[object, ...]  # `signature`: what the outputs' sizes depend on
    outputs: dict[str, refs.Ref]
    fresh: bool  # the arena is not registered as it is now: register it before the call
    body: bytes


def signature(
    arrays: Mapping[str, np.ndarray], outputs: Sequence[str], model: str, version: str
) -> tuple[object, ...]:
    """What an answer's output sizes depend on (`Learned`'s key)."""
    shapes = tuple((n, a.dtype.str, a.shape) for n, a in arrays.items())
    return model, version, tuple(outputs), shapes


def _spans(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Where each of `sizes` bytes start, one after another, each at a multiple of
    codec.ALIGN (an input the server reads in place is then aligned for every datatype);
    and the bytes they take."""
    starts, total = [], 0
    for n in sizes:
        starts.append(total)
        total += -(-n // codec.ALIGN) * codec.ALIGN
    return starts, total


class SharedMemory:
    """A client's arenas and what it learned of outputs' sizes: what a shared memory call
    decides (`plan`, `answer`, `failed`, `done`); the client makes the calls."""

    def __init__(self, root: Path = ROOT) -> None:
        self.root = root
        self._prefix = f"sluice-{os.getpid()}-{secrets.token_hex(6)}-"
        self._names = itertools.count()
        self._free: list[Arena] = []
        self._all: list[Arena] = []
        self._retired: list[str] = []  # arenas dropped while registered: close() unregisters
        self._lock = threading.Lock()
        self.learned = Learned()

    @contextlib.contextmanager
    def planned(
        self, arrays: Mapping[str, np.ndarray], outputs: Sequence[str], model: str, version: str
    ) -> Iterator[Layout]:
        """`plan`, its arena handed back when the call is done; retired instead when the
        call was given up before its answer (`abandoned`)."""
        plan = self.plan(arrays, outputs, model, version)
        try:
            yield plan
        except BaseException as exc:
            if abandoned(exc):
                self.retire(plan.arena)
            else:
                self.done(plan.arena)
            raise
        self.done(plan.arena)

    def plan(
        self, arrays: Mapping[str, np.ndarray], outputs: Sequence[str], model: str, version: str
    ) -> Layout:
        """An arena holding the call's inputs and room for its outputs where their sizes are
        known, and the body naming them. The inputs are written now, or, when the arena is
        to be registered (`fresh`), once it is (Arena.registered_now). Hand it back with
        `done`."""
        key = signature(arrays, outputs, model, version)
        sizes = self.learned.get(key) or {}
        needs = [a.nbytes for a in arrays.values()] + list(sizes.values())
        starts, total = _spans(needs)
        arena = self._take()
        try:
            fresh = arena.fit(total) or not arena.registered
            spans = [refs.Ref(arena.name, at, n) for at, n in zip(starts, needs, strict=True)]
            inputs = dict(zip(arrays, spans[: len(arrays)], strict=True))
            placed = dict(zip(sizes, spans[len(arrays) :], strict=True))
            arena.pending = [(ref, arrays[name]) for name, ref in inputs.items()]
            if not fresh:
                arena.registered_now()
        except BaseException:
            self.done(arena)
            raise
        request = pb.PredictRequest(
            inputs=[refs.shared_tensor(n, arrays[n], ref) for n, ref in inputs.items()],
            outputs=outputs,
            model=model,
            version=version,
            output_memory={
                n: pb.SharedMemoryRef(region=r.region, offset=r.offset, byte_size=r.byte_size)
                for n, r in placed.items()
            },
        )
        return Layout(arena, key, placed, fresh, request.SerializeToString())

    def answer(self, plan: Layout, body: bytes) -> tuple[pb.PredictResponse, dict[str, np.ndarray]]:
        """A PredictResponse and its outputs: those in the arena copied out of it (it is the
        next call's), the others views of the message's bytes, as without shared memory.
        Their sizes are learned for the next call of the same shapes."""
        response = pb.PredictResponse.FromString(body)
        outputs = codec.decode_all(response.outputs, plan.arena)
        for tensor in response.outputs:
            if tensor.HasField("shared_memory"):
                outputs[tensor.name] = outputs[tensor.name].copy()
        sizes = {name: array.nbytes for name, array in outputs.items()}
        if sizes != {n: r.byte_size for n, r in plan.outputs.items()}:
            self.learned.put(plan.key, sizes)
        return response, outputs

    def failed(self, plan: Layout, error: grpc.RpcError) -> bool:
        """After a failed call: whether sending it again may succeed. A refusal naming the
        call's region has it registered afresh (a restarted server) or its output sizes
        relearned (outgrown); one as if its object were not there gives it a fresh object."""
        details = error.details() or ""
        arena = plan.arena
        ours = repr(arena.name) in details
        if error.code() != grpc.StatusCode.INVALID_ARGUMENT or not ours:
            return False
        if refs.TOO_SMALL in details:
            self.learned.forget(plan.key)
        elif arena.segment is not None and f"{UNOPENED}: '{arena.segment.key}'" in details:
            arena.renew()
        else:
            arena.registered = False
        return True

    def call(
        self,
        arrays: Mapping[str, np.ndarray],
        outputs: Sequence[str],
        model: str,
        version: str,
        predict: Predict,
        stub: Stub,
        where: tuple[str, Enum],
    ) -> Steps[Answer]:
        """One call with its tensors in an arena (`planned`), sent once more when the
        refusal says the next try may not be (`failed`). `where`: the target and the
        audience a failed registration names."""
        with self.planned(arrays, outputs, model, version) as plan:
            try:
                return (yield from self._send(plan, predict, stub, where))
            except grpc.RpcError as exc:
                if not self.failed(plan, exc):
                    raise
        with self.planned(arrays, outputs, model, version) as plan:
            return (yield from self._send(plan, predict, stub, where))

    def _send(
        self, plan: Layout, predict: Predict, stub: Stub, where: tuple[str, Enum]
    ) -> Steps[Answer]:
        if plan.fresh:
            yield from _register(plan.arena, stub, where)
        reply = yield from predict(plan.body)
        response, outputs = self.answer(plan, reply.body)
        return reply, response, outputs

    def unregister_all(self, stub: Stub) -> Steps[None]:
        """Unregister this client's regions and unlink their objects."""
        for name in self.registered():
            with contextlib.suppress(grpc.RpcError):  # a server gone forgot it anyway
                yield from stub("UnregisterRegion", pb.UnregisterRegionRequest(name=name))
        self.close()

    def _take(self) -> Arena:
        with self._lock:
            if self._free:
                return self._free.pop()
            arena = Arena(f"{self._prefix}{next(self._names)}", self.root)
            self._all.append(arena)
            return arena

    def done(self, arena: Arena) -> None:
        with self._lock:
            self._free.append(arena)

    def retire(self, arena: Arena) -> None:
        """Drop an arena a call gave up on: the server may still hold the call, and write
        its outputs late, or refuse the next call on those bytes (RegionBusy). Its object is
        unlinked (the server sweeps it) and the next call takes another."""
        with self._lock:
            self._all.remove(arena)
            if arena.registered:
                self._retired.append(arena.name)
        arena.close()

    def registered(self) -> list[str]:
        """The names of the arenas the server holds (for close() to unregister)."""
        with self._lock:
            return [*self._retired, *(a.name for a in self._all if a.registered)]

    def close(self) -> None:
        """Unlink every object (the server's mappings of them stay until it unregisters
        them, or sweeps them as unlinked)."""
        with self._lock:
            arenas, self._all, self._free, self._retired = self._all, [], [], []
        for arena in arenas:
            arena.close()


def _register(arena: Arena, stub: Stub, where: tuple[str, Enum]) -> Steps[None]:
    """Register `arena` as it is now (what the server held under its name dropped first)."""
    try:
        yield from stub("UnregisterRegion", pb.UnregisterRegionRequest(name=arena.name))
        yield from stub("RegisterRegion", arena.registration())
    except grpc.RpcError as exc:
        raise registration_error(exc, arena.name, *where) from exc
    arena.registered_now()


# The ends of a call that leave it running on the server, or unknown there.
_UNFINISHED = (
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNAVAILABLE,
)


def abandoned(error: BaseException) -> bool:
    """Whether a call ended so that the server may still be at it: cancelled (by grpc or
    the caller's task), out of time, or cut off."""
    if not isinstance(error, Exception):  # the task cancelled, the program interrupted
        return True
    code = getattr(error, "code", None)
    return isinstance(error, grpc.RpcError) and callable(code) and code() in _UNFINISHED
