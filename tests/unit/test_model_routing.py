"""Routing by model: only the backends that serve a call's model (and version) take it, one
ring per model, the default model resolved across backends, NOT_FOUND when none serves it,
and the balancer's side (the model read off the body, Health's model lists)."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from typing import Any

import pytest

from sluice.balancer.service import INFER, KINDS, BalancerService, served
from sluice.balancer.settings import BalancerSettings
from sluice.core.errors import Code
from sluice.kserve import grpc_predict_v2_pb2 as kpb
from sluice.routing.breaker import BreakerSettings
from sluice.routing.budget import RetryBudget
from sluice.routing.planner import Planner
from sluice.routing.pool import Backend, Choice, Health, Pool, Want
from sluice.routing.ring import MaglevRing
from sluice.v1 import inference_pb2 as pb
from sluice.wire import facts, peek
from sluice.wire.mux import Reply

TABLE = 1_009  # prime; small keeps the rings quick to build


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def keys(count: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.getrandbits(64) for _ in range(count)]


Served = dict[str, tuple[str, ...]]


def pool_of(fleet: dict[str, tuple[Served | None, str]], clock: FakeClock | None = None) -> Pool:
    """A pool of the backends `fleet` names, each with (models, default) learned."""
    pool = Pool(
        breaker=BreakerSettings(failures_to_open=2, jitter=0.0),
        clock=clock or FakeClock(),
        rng=random.Random(3),
        table_size=TABLE,
    )
    pool.set_addresses(fleet)
    for address, (models, default) in fleet.items():
        pool.learn(pool.backends[address], models, default)
    return pool


DIGITS_ALPHA: Served = {"digits": ("1",), "alpha": ("2", "1")}
DIGITS_BETA: Served = {"digits": ("1",), "beta": ("1",)}


def fleet() -> Pool:
    return pool_of(
        {
            "a:1": (DIGITS_ALPHA, "digits"),
            "b:1": ({"digits": ("1",), "alpha": ("1",)}, "digits"),
            "c:1": (DIGITS_BETA, "digits"),
            "d:1": (DIGITS_BETA, "digits"),
        }
    )


def reached(pool: Pool, want: Want, count: int = 400) -> set[str]:
    """Where calls for `want` go: by affinity and by load."""
    found = set()
    for k in keys(count):
        for key in (k, None):
            backend = pool.choose(key, want=want).backend
            assert backend is not None
            found.add(backend.address)
    return found


def test_calls_go_only_to_the_backends_that_serve_their_model_and_version() -> None:
    pool = fleet()
    assert reached(pool, Want("alpha")) == {"a:1", "b:1"}
    assert reached(pool, Want("beta")) == {"c:1", "d:1"}
    assert reached(pool, Want("digits")) == {"a:1", "b:1", "c:1", "d:1"}
    assert reached(pool, Want("alpha", "2")) == {"a:1"}
    assert reached(pool, Want("alpha", "1")) == {"a:1", "b:1"}


def test_each_model_has_its_own_ring_and_keys_stick_within_it() -> None:
    pool = fleet()
    alpha = pool.route(Want("alpha")).ring
    assert alpha.nodes == ["a:1", "b:1"]
    assert pool.route(Want("beta")).ring.nodes == ["c:1", "d:1"]
    assert pool.route(Want("alpha", "2")).ring is alpha  # the model's ring, any version
    owners = {k: pool.choose(k, want=Want("alpha")).backend for k in keys(200)}
    assert {b.address for b in owners.values() if b} == {"a:1", "b:1"}  # both share keys
    for k, owner in owners.items():
        assert pool.choose(k, want=Want("alpha")).backend is owner
        assert owner is not None and owner.address == alpha.owner(k)
    # A backend that joins with other models moves none of alpha's keys.
    pool.set_addresses(["a:1", "b:1", "c:1", "d:1", "e:1"])
    pool.learn(pool.backends["e:1"], {"beta": ("1",)}, "beta")
    assert all(pool.choose(k, want=Want("alpha")).backend is owners[k] for k in owners)


def test_rings_are_built_once_per_set_of_backends() -> None:
    pool = fleet()
    ring = pool.route(Want("alpha")).ring
    assert not pool.learn(pool.backends["a:1"], dict(DIGITS_ALPHA), "digits")  # no change
    assert pool.route(Want("alpha")).ring is ring
    assert pool.learn(pool.backends["c:1"], {"digits": ("1",), "beta": ("2", "1")}, "digits")
    assert pool.route(Want("alpha")).ring is ring  # kept across a change that spared it
    # Models served by the same backends share one ring.
    pool.learn(pool.backends["a:1"], {**DIGITS_ALPHA, "gamma": ("1",)}, "digits")
    pool.learn(pool.backends["b:1"], {"digits": ("1",), "alpha": ("1",), "gamma": ("1",)}, "")
    assert pool.route(Want("gamma")).ring is pool.route(Want("alpha")).ring


def test_a_backend_not_learned_yet_may_take_any_call() -> None:
    pool = fleet()
    pool.set_addresses(["a:1", "b:1", "c:1", "d:1", "new:1"])
    assert pool.backends["new:1"].models is None
    assert reached(pool, Want("alpha")) == {"a:1", "b:1", "new:1"}
    assert reached(pool, Want("alpha", "7")) == {"new:1"}
    assert reached(pool, Want("nobody-has-this")) == {"new:1"}
    assert "new:1" in reached(pool, Want())  # its default is not known: it may be digits


def test_with_nothing_learned_the_pool_routes_as_before() -> None:
    pool = pool_of({f"h{i}:1": (None, "") for i in range(4)})
    for k in keys(300):
        for want in (Want(), Want("anything"), Want("x", "3")):
            backend = pool.choose(k, want=want).backend
            assert backend is not None and backend.address == pool.ring.owner(k)


def test_a_call_naming_no_model_goes_where_the_agreed_default_is_the_default() -> None:
    pool = pool_of(
        {
            "a:1": (DIGITS_ALPHA, "digits"),
            "b:1": (DIGITS_BETA, "digits"),
            "c:1": ({"digits": ("1",), "alpha": ("1",)}, ""),  # several, none the default
            "d:1": (None, ""),
        }
    )
    assert pool.default_model() == "digits"
    assert reached(pool, Want()) == {"a:1", "b:1", "d:1"}
    assert reached(pool, Want("digits")) == {"a:1", "b:1", "c:1", "d:1"}
    assert reached(pool, Want("", "1")) == {"a:1", "b:1", "d:1"}
    choice = pool.choose(1, want=Want("", "9"))
    assert choice.backend is None or choice.backend.address == "d:1"


def test_servers_that_disagree_on_the_default_refuse_calls_naming_no_model() -> None:
    pool = pool_of(
        {"a:1": (DIGITS_ALPHA, "alpha"), "b:1": (DIGITS_BETA, "beta"), "c:1": (DIGITS_BETA, "beta")}
    )
    choice = pool.choose(5, want=Want())
    assert choice.backend is None and choice.code == Code.INVALID_ARGUMENT
    assert "different default models" in choice.why
    assert "'alpha' on a:1" in choice.why and "'beta' on b:1, c:1" in choice.why
    assert "name a model" in choice.why
    assert reached(pool, Want("digits")) == {"a:1", "b:1", "c:1"}  # named calls still go


def test_when_no_backend_serves_the_model_the_answer_is_not_found() -> None:
    pool = fleet()
    for want, says in [
        (Want("gamma"), "model 'gamma'"),
        (Want("alpha", "3"), "model 'alpha' version '3'"),
    ]:
        choice = pool.choose(1, want=want)
        assert choice.backend is None and choice.code == Code.NOT_FOUND
        assert choice.why.startswith(f"no server behind this balancer serves {says}")
        assert "'alpha', 'beta', 'digits'" in choice.why
    lonely = pool_of({"a:1": ({"x": ("1",), "y": ("1",)}, "")})
    choice = lonely.choose(1, want=Want())
    assert choice.code == Code.NOT_FOUND and "a default model" in choice.why


def test_when_the_backends_that_serve_it_are_out_the_answer_is_unavailable() -> None:
    pool = fleet()
    for address in ("a:1", "b:1"):
        pool.backends[address].health = Health.NOT_SERVING
    choice = pool.choose(1, want=Want("alpha"))
    assert choice.backend is None and choice.code == Code.UNAVAILABLE
    assert "a:1 not_serving" in choice.why and "c:1" not in choice.why


def test_the_route_cache_is_bounded_against_callers_naming_many_models() -> None:
    pool = fleet()
    for i in range(5000):
        pool.choose(None, want=Want(f"m{i}"))
    assert len(pool._routes) <= 1024


class Script:
    """Each backend's replies in turn (the last one repeats); records who was called."""

    def __init__(self, replies: dict[str, list[Reply]]) -> None:
        self.replies = replies
        self.sent: list[str] = []

    async def __call__(self, backend: Backend, timeout: float | None) -> Reply:
        self.sent.append(backend.address)
        steps = self.replies[backend.address]
        return steps.pop(0) if len(steps) > 1 else steps[0]


def planner_of(pool: Pool) -> Planner[Reply]:
    return Planner(pool, RetryBudget(clock=pool.clock), Reply, clock=pool.clock)


def test_a_not_found_is_retried_on_another_that_serves_it_and_is_no_fault() -> None:
    pool = fleet()
    p = planner_of(pool)
    gone = Reply(Code.NOT_FOUND, "unknown model 'alpha'; this node serves 'digits'")
    script = Script({"a:1": [gone], "b:1": [gone]})
    owner = pool.route(Want("alpha")).ring.owner(7)
    script.replies[owner] = [Reply(0, body=b"ok")] if owner == "b:1" else [gone]
    reply = asyncio.run(p.run(7, None, script, Want("alpha")))
    assert script.sent[0] == owner and set(script.sent) <= {"a:1", "b:1"}
    assert reply.code == (0 if owner == "b:1" else Code.NOT_FOUND)
    if reply.code:  # no other that serves it was left: the server's own word
        assert reply is gone and script.sent == ["a:1", "b:1"]
    for backend in pool.backends.values():
        assert backend.failures == 0 and backend.in_flight == 0


def test_a_not_found_from_a_server_whose_models_are_unknown_is_the_answer() -> None:
    # Nothing learned (a client balancing itself, or servers not heard from yet): asking
    # every server in turn would spend the retry budget on a misspelt name.
    pool = pool_of({"a:1": (None, ""), "b:1": (None, ""), "c:1": (None, "")})
    p = planner_of(pool)
    gone = Reply(Code.NOT_FOUND, "unknown model 'alhpa'")
    script = Script({a: [gone] for a in pool.backends})
    reply = asyncio.run(p.run(7, None, script, Want("alhpa")))
    assert reply is gone and len(script.sent) == 1 and p.budget.retries == 0


def test_invented_names_cost_no_memory() -> None:
    pool = fleet()
    for i in range(50):
        assert pool.route(Want(f"nobody-{i}")).refusal is not None
    assert pool.route(Want("x" * 300)).refusal.code == Code.INVALID_ARGUMENT  # type: ignore[union-attr]
    assert len(pool._routes) == 0  # refusals are not kept
    pool.route(Want("alpha"))
    assert len(pool._routes) == 1


def test_the_pools_refusals_answer_at_once() -> None:
    pool = fleet()
    p = planner_of(pool)
    script = Script({a: [Reply(0)] for a in pool.backends})
    reply = asyncio.run(p.run(1, None, script, Want("gamma")))
    assert reply.code == Code.NOT_FOUND and script.sent == [] and p.unavailable == 0
    pool.learn(pool.backends["c:1"], DIGITS_BETA, "beta")
    reply = asyncio.run(p.run(1, None, script, Want()))
    assert reply.code == Code.INVALID_ARGUMENT and script.sent == []


def wanted(body: bytes, kind: facts.Kind) -> tuple[Want, bytes]:
    """What the balancer routes a body by: the model and version it names, and the bytes of
    its affinity key (BalancerService._forward)."""
    read = facts.read(body, kind)
    return Want(read.model, read.version), read.keyed(body)


def test_a_body_names_its_model_and_version_on_the_wire() -> None:
    body = pb.PredictRequest(model="alpha", version="2", typed_outputs=True).SerializeToString()
    assert wanted(body, KINDS[""]) == (Want("alpha", "2"), body)
    assert wanted(pb.PredictRequest().SerializeToString(), KINDS[""])[0] == Want()
    infer = kpb.ModelInferRequest(model_name="beta", model_version="1", id="x")
    want, keyed = wanted(infer.SerializeToString(), KINDS[INFER])
    assert want == Want("beta", "1")
    # The affinity key leaves the call's id out: the same inputs meet on one server.
    other = kpb.ModelInferRequest(model_name="beta", model_version="1", id="another")
    assert wanted(other.SerializeToString(), KINDS[INFER])[1] == keyed
    assert keyed == kpb.ModelInferRequest(model_name="beta", model_version="1").SerializeToString()
    with pytest.raises(peek.Malformed, match=r"not a valid inference\.ModelInferRequest"):
        wanted(b"\xff\xff\xff", KINDS[INFER])


def test_health_lists_the_models_with_their_versions_merged_newest_first() -> None:
    pool = pool_of(
        {
            "a:1": ({"digits": ("10", "2"), "alpha": ("1",)}, "digits"),
            "b:1": ({"digits": ("9", "2", "1")}, "digits"),
            "c:1": (None, ""),
        }
    )
    listed = served(pool.backends.values(), "digits")
    assert [(m.name, list(m.versions), m.default) for m in listed] == [
        ("alpha", ["1"], False),
        ("digits", ["10", "9", "2", "1"], True),
    ]
    assert served([pool.backends["c:1"]], "") == []


class Upstream:
    def __init__(self) -> None:
        self.methods: list[str] = []

    async def predict(
        self, body: bytes, metadata: dict[str, str], timeout: float | None, method: str = ""
    ) -> Reply:
        self.methods.append(method)
        return Reply(0, body=b"answer", trailers={"x-node-id": "n"})


def test_the_balancer_forwards_by_model_and_modelinfer_with_its_method() -> None:
    pool = fleet()
    upstreams = {a: Upstream() for a in pool.backends}
    for address, backend in pool.backends.items():
        backend.transport = upstreams[address]
    service = BalancerService(pool, RetryBudget(), node_id="b")

    async def calls() -> list[Reply]:
        beta = kpb.ModelInferRequest(model_name="beta").SerializeToString()
        return [
            await service.forward(pb.PredictRequest(model="alpha").SerializeToString(), {}, None),
            await service.forward(beta, {}, None, method=INFER),
            await service.forward(pb.PredictRequest(model="nope").SerializeToString(), {}, None),
            await service.forward(b"\xff", {}, None),
        ]

    alpha, beta, nope, garbage = asyncio.run(calls())
    assert alpha.code == 0 and beta.code == 0
    used = {a: u.methods for a, u in upstreams.items() if u.methods}
    assert Counter(m for ms in used.values() for m in ms) == {"": 1, INFER: 1}
    assert set(used) <= {"a:1", "b:1", "c:1", "d:1"}
    assert any(INFER in upstreams[a].methods for a in ("c:1", "d:1"))
    assert any("" in upstreams[a].methods for a in ("a:1", "b:1"))
    assert nope.code == Code.NOT_FOUND and "model 'nope'" in nope.message
    assert garbage.code == Code.INVALID_ARGUMENT
    assert service.stats.requests == 4


def test_the_balancer_keys_a_modelinfer_by_its_inputs_not_its_id() -> None:
    """The affinity key the pool is asked with, through BalancerService itself: two calls
    that differ only in id meet on one server (its cache leaves the id out too)."""
    pool = fleet()
    for backend in pool.backends.values():
        backend.transport = Upstream()
    service = BalancerService(pool, RetryBudget(), node_id="b")
    asked: list[int | None] = []
    choose = pool.choose

    def recorded(key: int | None, *args: Any, **kwargs: Any) -> Choice:
        asked.append(key)
        return choose(key, *args, **kwargs)

    pool.choose = recorded  # type: ignore[method-assign]

    def key_of(call_id: str, value: int) -> int | None:
        tensor = kpb.ModelInferRequest.InferInputTensor(name="x", datatype="INT64", shape=[1])
        tensor.contents.int64_contents.append(value)
        infer = kpb.ModelInferRequest(model_name="beta", id=call_id, inputs=[tensor])
        asked.clear()
        reply = asyncio.run(service.forward(infer.SerializeToString(), {}, None, method=INFER))
        assert reply.code == 0 and len(set(asked)) == 1  # the one key of all its asks
        return asked[0]

    key = key_of("one", 7)
    assert key is not None and key_of("two", 7) == key
    assert key_of("one", 8) != key


def test_models_refresh_setting_is_checked() -> None:
    assert BalancerSettings(backend=["h:1"]).models_refresh_s == 1.0
    with pytest.raises(ValueError, match="--models-refresh-s"):
        BalancerSettings(backend=["h:1"], models_refresh_s=0)


def test_a_ring_of_the_same_backends_is_the_same_ring() -> None:
    # What lets models share rings, and the pool's all-backends ring stand in when nothing
    # is learned: a ring depends only on its backends.
    assert MaglevRing(["b", "a"], TABLE).table == MaglevRing(["a", "b"], TABLE).table


def test_a_body_no_parser_takes_is_refused_before_it_is_forwarded() -> None:
    pool = fleet()
    upstreams = {a: Upstream() for a in pool.backends}
    for address, backend in pool.backends.items():
        backend.transport = upstreams[address]
    service = BalancerService(pool, RetryBudget(), node_id="b")
    bad_id = kpb.ModelInferRequest(model_name="beta").SerializeToString() + b"\x1a\x01\xff"
    for body, method, message in [
        (b"\xff\xff\xff", INFER, "inference.ModelInferRequest: truncated varint"),
        (bad_id, INFER, "inference.ModelInferRequest: a string field is not UTF-8"),
        (b"\x22\x05ab", "", "sluice.v1.PredictRequest: a field runs past the end"),
    ]:
        reply = asyncio.run(service.forward(body, {}, None, method=method))
        assert (reply.code, reply.message) == (
            Code.INVALID_ARGUMENT,
            f"request body is not a valid {message}",
        )
    assert not any(u.methods for u in upstreams.values())
