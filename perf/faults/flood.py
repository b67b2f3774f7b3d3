"""bad-flood: hostile calls (bad shapes, types, names, garbage bytes) mixed into valid ones
through the balancer."""

from __future__ import annotations

from collections import Counter

import numpy as np

from perf.bench import Bench
from perf.drive import collect, digits_bodies
from perf.faults.results import Outcome, summarize
from sluice.client import SluiceClient
from sluice.v1 import inference_pb2 as pb
from sluice.wire import codec


def hostile_bodies() -> tuple[tuple[str, bytes], ...]:
    def request(*tensors: pb.Tensor) -> bytes:
        return pb.PredictRequest(inputs=list(tensors)).SerializeToString()

    garbage = np.random.default_rng(7).bytes(512)
    return (
        (
            "rank 65",
            request(pb.Tensor(name="input", datatype="FP32", shape=[1] * 65, raw_data=bytes(4))),
        ),
        (
            "wrong dtype",
            request(pb.Tensor(name="input", datatype="INT64", shape=[1, 64], raw_data=bytes(512))),
        ),
        ("garbage bytes", garbage),
        (
            "absurd shape",
            request(
                pb.Tensor(name="input", datatype="FP32", shape=[0, 2**62, 2**62], raw_data=bytes(4))
            ),
        ),
        ("wrong name", request(codec.encode("nope", np.zeros((1, 64), np.float32)))),
    )


def bad_flood(bench: Bench) -> Outcome:
    outcome = Outcome("bad-flood", "10% hostile calls mixed into valid ones, via the balancer")
    count = 2 if bench.quick else 3
    servers = bench.servers("flood", count)
    balancer = bench.balancer([s.address for s in servers])
    length = bench.seconds(8.0, 3.0)
    futures = bench.load(
        balancer.address,
        concurrency=8,
        duration=length,
        bodies=digits_bodies(),
        hostile=hostile_bodies(),
        hostile_share=0.1,
    )
    records = collect(futures)
    valid = [r for r in records if not r.kind]
    rows = [summarize("valid calls", valid)]
    for kind, _ in hostile_bodies():
        rows.append(summarize(f"hostile: {kind}", [r for r in records if r.kind == kind]))
    outcome.rows = rows
    refused = sum(r.status != "OK" for r in valid)
    hostile = [r for r in records if r.kind]
    with SluiceClient(balancer.address) as client:
        health = client.health(timeout=5)
    internal_seen = dict(health.errors_by_code).get("INTERNAL", 0)
    for s in servers:
        with SluiceClient(s.address) as client:
            internal_seen += dict(client.health(timeout=5).errors_by_code).get("INTERNAL", 0)
    breakers = [f"{b.breaker}/{b.failures}" for b in health.backends]
    outcome.facts["valid calls refused"] = refused
    if refused:
        first = records[0].start
        outcome.facts["valid calls refused (s from start, latency s, status)"] = [
            (round(r.start - first, 3), round(r.latency, 3), r.status)
            for r in valid
            if r.status != "OK"
        ][:10]
    outcome.facts["hostile calls by status"] = dict(Counter(r.status for r in hostile))
    outcome.facts["breakers (state/failures)"] = ", ".join(breakers)
    outcome.facts["INTERNAL counted by the nodes"] = internal_seen
    outcome.rss_mb = bench.rss()
    outcome.goals = {
        "valid calls refused: 0": refused == 0,
        "every hostile call INVALID_ARGUMENT": all(r.status == "INVALID_ARGUMENT" for r in hostile),
        "no breaker opened, no failure counted": all(
            b.breaker == "CLOSED" and b.failures == 0 for b in health.backends
        ),
        "no INTERNAL anywhere": internal_seen == 0,
    }
    outcome.headline = (
        f"valid refused {refused}; hostile {dict(Counter(r.status for r in hostile))}"
    )
    return outcome
