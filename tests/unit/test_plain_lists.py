"""Plain Python values as tensors: nested lists, tuples and scalars are converted to the
input's declared datatype (or a stated default without one); what cannot be converted is a
TypeError naming the input and the datatype wanted; numpy arrays pass untouched. The clients
ask the datatypes (Metadata) within the call's one deadline, routed as calls are: here on
faked transport steps and an injected clock, no socket (the e2e tier has the real server)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

import grpc
import numpy as np
import pytest

from sluice.client import AsyncSluiceClient, SluiceClient
from sluice.client.core import rpc_error
from sluice.core.datatypes import DATATYPES
from sluice.v1 import inference_pb2 as pb
from sluice.wire import codec
from sluice.wire.mux import Reply

Client = TypeVar("Client", SluiceClient, AsyncSluiceClient)
Outputs = dict[str, np.ndarray]


def sent(value: object, datatype: str = "") -> np.ndarray:
    """What the other side decodes from `value` encoded as input `x`."""
    message = codec.encode("x", value, datatype=datatype)
    return codec.decode(pb.Tensor.FromString(message.SerializeToString()))


@pytest.mark.parametrize(
    ("value", "datatype", "want"),
    [
        ([[0, 1, 2], [3, 4, 5]], "FP32", np.array([[0, 1, 2], [3, 4, 5]], np.float32)),
        (((1.5, 2.0), (3.0, 4.0)), "FP64", np.array([[1.5, 2], [3, 4]], np.float64)),
        ([[1, 2]], "INT64", np.array([[1, 2]], np.int64)),
        ([255, 0], "UINT8", np.array([255, 0], np.uint8)),
        ([-128, 127], "INT8", np.array([-128, 127], np.int8)),
        ([2.0, -3.0], "INT32", np.array([2, -3], np.int32)),  # whole numbers as floats
        ([True, False], "BOOL", np.array([True, False])),
        ([1, 0], "BOOL", np.array([True, False])),
        ([0.5, 1], "FP16", np.array([0.5, 1], np.float16)),
        ([True, 2], "FP32", np.array([1, 2], np.float32)),
        (3, "FP32", np.array(3, np.float32)),
        (np.int64(7), "FP32", np.array(7, np.float32)),  # a numpy scalar: the declared type
        ([np.float64(0.25)], "FP32", np.array([0.25], np.float32)),
        ([], "FP32", np.zeros(0, np.float32)),
    ],
)
def test_plain_values_take_the_declared_datatype(
    value: object, datatype: str, want: np.ndarray
) -> None:
    got = sent(value, datatype)
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    ("value", "want"),
    [
        ([[0.5, 1.0]], np.array([[0.5, 1.0]], np.float32)),  # most models take FP32
        ([[0.5, 1]], np.array([[0.5, 1.0]], np.float32)),
        ([[1, 2]], np.array([[1, 2]], np.int64)),
        ([True, False], np.array([True, False])),
        (2.5, np.array(2.5, np.float32)),
        (np.float64(2.5), np.array(2.5, np.float64)),  # a numpy scalar keeps its own type
        (np.uint16(9), np.array(9, np.uint16)),
    ],
)
def test_without_a_declared_datatype_the_default_rule(value: object, want: np.ndarray) -> None:
    got = sent(value)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    ("value", "datatype", "reason"),
    [
        ([[1, 2], [3]], "FP32", "differ in length"),
        ([["a", "b"]], "FP32", "strings"),
        (["1.5"], "FP64", "strings"),  # numpy would parse it: a string is still not a number
        (None, "FP32", "None"),
        ([1, None], "INT64", "None"),
        ([1 + 2j], "FP64", "complex"),
        ({"a": 1}, "FP32", "not numbers"),
        ([1.5], "INT64", "not whole numbers"),
        ([float("nan")], "INT32", "not whole numbers"),
        ([300], "UINT8", "outside the range of UINT8"),
        ([-1], "UINT32", "outside the range of UINT32"),
        ([2**70], "INT64", "beyond 64 bits"),
        ([2**63], "INT64", "outside the range of INT64"),
        ([1e300], "FP32", "outside the range of FP32"),
        ([70000], "FP16", "outside the range of FP16"),
        ([2], "BOOL", "only true, false, 0 and 1"),
        ([[1, 2], [3]], "", "differ in length"),
        (["a"], "", "strings"),
    ],
)
def test_what_cannot_be_converted_is_a_type_error_naming_input_and_datatype(
    value: object, datatype: str, reason: str
) -> None:
    with pytest.raises(TypeError) as caught:
        codec.array_of("pixels", value, datatype)
    message = str(caught.value)
    assert "input 'pixels'" in message
    assert (datatype or "a numeric datatype") in message
    assert reason in message


def test_a_datatype_the_codec_cannot_make_is_named() -> None:
    with pytest.raises(TypeError, match=r"input 'x'.*BYTES"):
        codec.array_of("x", [b"a"], "BYTES")


@pytest.mark.parametrize("datatype", ["", "FP32", "FP64", "INT8"])
def test_numpy_arrays_pass_untouched(datatype: str) -> None:
    # The hot path: no conversion and no copy, whatever is declared (the server judges a
    # mismatch and says so).
    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert codec.array_of("x", array, datatype) is array
    message = codec.encode("x", array, datatype=datatype)
    assert message.datatype == "FP32"
    assert message.raw_data == array.tobytes()


@pytest.mark.parametrize("typed", [False, True])
def test_every_datatype_from_plain_lists(typed: bool) -> None:
    for name, dt in DATATYPES.items():
        message = codec.encode("x", [[1, 0]], typed=typed, datatype=name)
        back = codec.decode(pb.Tensor.FromString(message.SerializeToString()))
        assert message.datatype == name
        assert back.dtype == dt.dtype.newbyteorder("=")
        np.testing.assert_array_equal(back, np.array([[1, 0]]))


def test_encode_all_takes_each_inputs_declared_datatype() -> None:
    tensors = codec.encode_all(
        {"a": [[1, 2]], "b": [3], "c": np.zeros(2, np.int8)},
        datatypes={"a": "FP32", "b": "UINT8", "c": "FP32"},
    )
    assert [(t.name, t.datatype) for t in tensors] == [("a", "FP32"), ("b", "UINT8"), ("c", "INT8")]


def test_the_request_body_sends_plain_values_in_their_declared_datatypes() -> None:
    request = pb.PredictRequest.FromString(
        codec.encode_predict(
            {"a": [[0, 1]], "b": 3, "c": np.ones(2, np.int8)},
            datatypes={"a": "FP32", "b": "UINT8", "c": "FP32"},
        )
    )
    a, b, c = request.inputs
    assert (a.datatype, list(a.shape), a.raw_data) == (
        "FP32", [1, 2], np.array([[0, 1]], np.float32).tobytes()
    )  # fmt: skip
    assert (b.datatype, list(b.shape), b.raw_data) == ("UINT8", [], b"\x03")
    assert (c.datatype, c.raw_data) == ("INT8", b"\x01\x01")  # an array as it is


class Servers:
    """Stands in for the clients' transport steps (`_ask`: Metadata, `_send`: Predict), on an
    injected clock: no socket. Each Metadata takes `asking_s` of the clock; `down` targets
    answer UNAVAILABLE."""

    def __init__(self) -> None:
        self.now = 0.0
        self.asking_s = 0.0
        self.down: set[str] = set()
        self.calls: list[tuple[str, str, float | None]] = []  # (method, target, timeout)
        self.reads = 0  # of the clock

    def clock(self) -> float:
        self.reads += 1
        return self.now

    def ask(self, target: str, body: bytes, metadata: object, timeout: float | None) -> Reply:
        self.calls.append(("Metadata", target, timeout))
        self.now += self.asking_s
        if target in self.down:
            raise rpc_error(Reply(grpc.StatusCode.UNAVAILABLE.value[0], f"{target} is down"))
        spec = pb.TensorSpec(name="input", datatype="FP32", shape=[-1, 2])
        meta = pb.MetadataResponse(model=pb.ModelInfo(name="m", inputs=[spec]))
        return Reply(0, "", meta.SerializeToString(), {})

    def send(self, target: str, body: bytes, metadata: object, timeout: float | None) -> Reply:
        self.calls.append(("Predict", target, timeout))
        if target in self.down:
            raise rpc_error(Reply(grpc.StatusCode.UNAVAILABLE.value[0], f"{target} is down"))
        request = pb.PredictRequest.FromString(body)
        response = pb.PredictResponse(outputs=request.inputs)  # the inputs, as they came
        return Reply(0, "", response.SerializeToString(), {})


@pytest.fixture
def servers(monkeypatch: pytest.MonkeyPatch) -> Servers:
    fake = Servers()

    async def ask_async(client: AsyncSluiceClient, *args: Any) -> Reply:
        return fake.ask(*args)

    async def send_async(client: AsyncSluiceClient, *args: Any) -> Reply:
        return fake.send(*args)

    monkeypatch.setattr(SluiceClient, "_ask", lambda client, *args: fake.ask(*args))
    monkeypatch.setattr(SluiceClient, "_send", lambda client, *args: fake.send(*args))
    monkeypatch.setattr(AsyncSluiceClient, "_ask", ask_async)
    monkeypatch.setattr(AsyncSluiceClient, "_send", send_async)
    return fake


def on_clock(client: Client, servers: Servers) -> Client:
    client._clock = servers.clock
    if client._router is not None:
        client._router.clock = servers.clock
    return client


def each(targets: list[str], servers: Servers, **call: Any) -> list[Callable[[], Outputs]]:
    """`predict(**call)` by the blocking client and by the asyncio one, each on a new one."""

    async def with_async() -> Outputs:
        async with AsyncSluiceClient(targets, timeout=10.0) as client:
            return await on_clock(client, servers).predict(**call)

    def blocking() -> Outputs:
        with SluiceClient(targets, timeout=10.0) as client:
            return on_clock(client, servers).predict(**call)

    return [blocking, lambda: asyncio.run(with_async())]


def both(targets: list[str], servers: Servers, **call: Any) -> list[Outputs]:
    return [predict() for predict in each(targets, servers, **call)]


def test_a_ragged_list_is_refused_before_its_predict(servers: Servers) -> None:
    # The datatypes known: the encoder refuses it naming the model's datatype. Unknown, and
    # the model not asked for want of a server: refused all the same, for want of any.
    for down, wanted in ((set(), "FP32"), ({"127.0.0.1:1"}, "a numeric datatype")):
        servers.down = down
        for predict in each(["127.0.0.1:1"], servers, inputs={"input": [[1.0, 2.0], [3.0]]}):
            with pytest.raises(TypeError, match=rf"input 'input'.*{wanted}.*differ in length"):
                predict()
    assert [method for method, _, _ in servers.calls] == ["Metadata"] * 4


def test_a_plain_call_and_its_metadata_share_one_deadline(servers: Servers) -> None:
    servers.asking_s = 3.0
    answers = both(["127.0.0.1:1"], servers, inputs={"input": [[1, 2]]})
    for answer in answers:
        assert answer["input"].dtype == np.float32  # the declared datatype
    assert servers.calls == [("Metadata", "127.0.0.1:1", 10.0), ("Predict", "127.0.0.1:1", 7.0)] * 2


def test_an_array_asks_nothing_and_gets_the_whole_timeout(servers: Servers) -> None:
    both(["127.0.0.1:1"], servers, inputs={"input": np.zeros((1, 2), np.float32)})
    assert servers.calls == [("Predict", "127.0.0.1:1", 10.0)] * 2


def test_one_target_sends_an_array_on_the_timeout_as_given(servers: Servers) -> None:
    # Nothing went first, so nothing is left to share: no clock read (the per-call path).
    body = codec.encode_predict({"input": np.zeros((1, 2), np.float32)})

    async def raw() -> Reply:
        async with AsyncSluiceClient("127.0.0.1:1", timeout=10.0) as client:
            return await on_clock(client, servers).call_raw(body)

    both(["127.0.0.1:1"], servers, inputs={"input": np.zeros((1, 2), np.float32)})
    assert asyncio.run(raw()).code == 0
    assert servers.calls == [("Predict", "127.0.0.1:1", 10.0)] * 3
    assert servers.reads == 0


class Looked(dict[str, Any]):
    """Inputs that count how often their values are looked over."""

    looks = 0

    def values(self) -> Any:
        self.looks += 1
        return super().values()


def test_a_call_looks_for_plain_values_once(servers: Servers) -> None:
    inputs = Looked(input=[[1, 2]])
    both(["127.0.0.1:1"], servers, inputs=inputs)
    assert inputs.looks == 2  # one call by each client, its Metadata and Predict


def test_with_several_targets_the_metadata_passes_over_one_that_is_down(
    servers: Servers,
) -> None:
    servers.down = {"127.0.0.1:1"}
    for answer in both(["127.0.0.1:1", "127.0.0.1:2"], servers, inputs={"input": [[1, 2]]}):
        assert answer["input"].dtype == np.float32
    asked = [target for method, target, _ in servers.calls if method == "Metadata"]
    assert asked[-1] == "127.0.0.1:2"  # answered by the live one, whichever was asked first
