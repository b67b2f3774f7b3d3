"""`sluice top`'s screen from synthetic Health answers: no terminal, no process."""

from __future__ import annotations

import pytest
from rich.console import Console, RenderableType

from sluice.client import top
from sluice.v1 import inference_pb2 as pb


def text_of(renderable: RenderableType, width: int = 140) -> str:
    console = Console(record=True, width=width, color_system=None, file=_Sink())
    console.print(renderable)
    return console.export_text()


class _Sink:
    """A file that keeps nothing: the recording is what the tests read."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


def server_health(requests: int, **changes: object) -> pb.HealthResponse:
    health = pb.HealthResponse(
        role="server",
        node_id="node-a",
        status="SERVING",
        provider="CPUExecutionProvider",
        model=pb.ModelInfo(name="digits"),
        uptime_s=125.0 + requests / 100,
        requests=requests,
        errors=3,
        errors_by_code={"RESOURCE_EXHAUSTED": 2, "INVALID_ARGUMENT": 1},
        latency=pb.LatencySummary(count=4096, p50_ms=0.42, p90_ms=0.9, p99_ms=3.25, max_ms=12.5),
        in_flight=7,
        batcher=pb.BatcherStats(
            batches=400,
            requests=1000,
            rows=1000,
            mean_batch_size=2.5,
            flush_full=100,
            flush_budget=50,
            flush_drained=250,
            queue_depth=11,
            rejected=17,
            expired=2,
            max_batch=8,
            budget_ms=5.0,
            instances=2,
            busy_instances=1,
        ),
        cache=pb.CacheStats(
            enabled=True,
            entries=321,
            bytes=3 * 1024 * 1024,
            hits=750,
            misses=250,
            hit_rate=0.75,
            max_entries=10000,
            max_bytes=64 * 1024 * 1024,
        ),
    )
    for name, value in changes.items():
        setattr(health, name, value)
    return health


def balancer_health(
    calls: tuple[int, int, int], requests: int = 0, hedges: tuple[int, int] = (0, 0)
) -> pb.HealthResponse:
    addresses = ["127.0.0.1:8001", "127.0.0.1:8002", "127.0.0.1:8003"]
    total = max(sum(calls), 1)
    return pb.HealthResponse(
        role="balancer",
        node_id="bal-1",
        status="SERVING",
        uptime_s=60.0 + requests,
        requests=requests or sum(calls),
        latency=pb.LatencySummary(count=10, p50_ms=1.5, p90_ms=2.0, p99_ms=4.75, max_ms=9.0),
        backends=[
            pb.BackendStatus(
                address=address,
                health=health,
                breaker=breaker,
                in_flight=i,
                calls=count,
                failures=i * 2,
                ewma_ms=1.25 + i,
                share=count / total,
                limit=limit,
            )
            for i, (address, health, breaker, count, limit) in enumerate(
                zip(
                    addresses,
                    ["SERVING", "SERVING", "NOT_SERVING"],
                    ["CLOSED", "HALF_OPEN", "OPEN"],
                    calls,
                    [0.0, 12.0, 0.0],
                    strict=True,
                )
            )
        ],
        balancer=pb.BalancerStats(
            calls=sum(calls),
            retries=5,
            retries_refused=1,
            unavailable=2,
            shed=3,
            hedges=hedges[0],
            hedges_won=hedges[1],
        ),
    )


def line_with(text: str, word: str) -> str:
    return next(line for line in text.splitlines() if word in line)


def test_server_snapshot_names_the_node_and_shows_its_stats() -> None:
    out = text_of(top.render(None, server_health(1000), 0.0, target="127.0.0.1:8001"))
    header = out.splitlines()[0]
    for word in ("127.0.0.1:8001", "server", "node-a", "SERVING", "CPUExecutionProvider"):
        assert word in header
    assert "model digits" in header
    assert "up 2m15s" in header
    assert "0.420 / 3.25 ms" in line_with(out, "p50 / p99")
    assert "last 4,096 calls" in out
    assert line_with(out, "calls/s").split()[1] == top.NO_VALUE  # one poll: no rate
    assert "RESOURCE_EXHAUSTED" in out and "INVALID_ARGUMENT" in out
    assert line_with(out, "queue depth").split()[2] == "11"
    assert "mean batch" in out and "2.50" in out
    assert line_with(out, "flushed full").split()[2:4] == ["100", "(25.0%)"]
    assert line_with(out, "on budget").split()[2:4] == ["50", "(12.5%)"]
    assert line_with(out, "drained").split()[1:3] == ["250", "(62.5%)"]
    assert line_with(out, "refused").split()[1] == "17"
    assert "75.0%" in out  # cache hit rate
    assert "321 of 10,000" in out and "3.0 MiB of 64.0 MiB" in out
    assert "Backends" not in out


def test_calls_per_second_come_from_the_change_between_polls() -> None:
    before = server_health(1000)
    after = server_health(1500)
    after.errors_by_code["RESOURCE_EXHAUSTED"] = 6
    after.errors = 7
    after.cache.hits, after.cache.misses = 840, 260
    after.batcher.batches, after.batcher.requests = 500, 1400
    out = text_of(top.render(before, after, 2.0))
    assert line_with(out, "calls/s").split()[1] == "250"
    assert line_with(out, "errors/s").split()[1] == "2.0"
    exhausted = line_with(out, "RESOURCE_EXHAUSTED").split()
    assert exhausted[-2:] == ["4", "6"]  # new since the last poll, then in all
    assert line_with(out, "INVALID_ARGUMENT").split()[-2:] == ["0", "1"]
    assert "90.0%" in line_with(out, "last poll")  # 90 hits of 100 lookups since then
    assert "(last poll 4.00)" in out  # 400 requests in 100 batches


def test_a_restarted_process_shows_no_rates_rather_than_negative_ones() -> None:
    before = server_health(5000)
    after = server_health(10)  # counters started again
    out = text_of(top.render(before, after, 1.0))
    assert line_with(out, "calls/s").split()[1] == top.NO_VALUE
    other = server_health(6000, node_id="node-b")  # a different process at that address
    out = text_of(top.render(before, other, 1.0))
    assert line_with(out, "calls/s").split()[1] == top.NO_VALUE


def test_balancer_shows_one_row_per_backend_with_its_state() -> None:
    before = balancer_health((100, 100, 0))
    after = balancer_health((300, 150, 0))
    out = text_of(top.render(before, after, 2.0, target="127.0.0.1:8000"))
    header = out.splitlines()[0]
    assert "balancer" in header and "bal-1" in header
    assert "Batcher" not in out and "Cache" not in out
    assert line_with(out, "calls/s").split()[1] == "125"  # 250 more calls in 2 s
    rows = {
        address: line_with(out, address).split()
        for address in ("127.0.0.1:8001", "127.0.0.1:8002", "127.0.0.1:8003")
    }
    assert rows["127.0.0.1:8001"][1:3] == ["SERVING", "CLOSED"]
    assert rows["127.0.0.1:8001"][4:6] == ["100", "66.7%"]  # calls/s, share
    assert rows["127.0.0.1:8001"][-1] == top.NO_VALUE  # no limit learned
    assert rows["127.0.0.1:8002"][1:3] == ["SERVING", "HALF_OPEN"]
    assert rows["127.0.0.1:8002"][4] == "25.0"
    assert rows["127.0.0.1:8002"][-3:] == ["2.25", "2", "12"]  # EWMA ms, failures, limit
    assert rows["127.0.0.1:8003"][1:3] == ["NOT_SERVING", "OPEN"]
    assert "retries" in out and "5  (+0)" in line_with(out, "retries")
    assert line_with(out, "shed").split()[1] == "3"
    assert line_with(out, "unavailable").split()[1] == "2"


def test_the_balancer_grid_shows_hedges_sent_and_won_with_their_growth() -> None:
    before = balancer_health((100, 100, 0), hedges=(10, 4))
    after = balancer_health((300, 150, 0), hedges=(13, 6))
    out = text_of(top.render(before, after, 2.0))
    assert line_with(out, "hedges won").split()[2:] == ["6", "(+2)"]
    hedges = next(line for line in out.splitlines() if "hedges" in line and "won" not in line)
    assert hedges.split()[1:] == ["13", "(+3)"]


def test_a_balancer_without_backends_says_so() -> None:
    health = pb.HealthResponse(role="balancer", node_id="bal-1", status="NOT_SERVING")
    out = text_of(top.render(None, health, 0.0))
    assert "NOT_SERVING" in out and "no backends" in out


def test_a_narrow_terminal_still_shows_every_backend_address() -> None:
    out = text_of(top.render(None, balancer_health((1, 2, 3)), 0.0), width=80)
    for port in (8001, 8002, 8003):
        assert f"127.0.0.1:{port}" in out


def test_unreachable_is_one_line_with_the_status() -> None:
    out = text_of(top.unreachable("127.0.0.1:1", "UNAVAILABLE: connection refused", 65.0))
    assert out.strip().splitlines() == [
        "sluice top  127.0.0.1:1  unreachable: UNAVAILABLE: connection refused"
        "  (for 1m05s; still trying)"
    ]


@pytest.mark.parametrize(
    ("value", "text"),
    [(0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"), (5 * 1024**3, "5.0 GiB")],
)
def test_bytes_are_shown_in_binary_units(value: int, text: str) -> None:
    assert top.fmt_bytes(value) == text


def test_arguments_are_checked() -> None:
    parser = top.build_parser()
    args = parser.parse_args(["--target", "h:1", "--interval", "0.5", "--iterations", "3"])
    assert (args.target, args.interval, args.iterations, args.once) == ("h:1", 0.5, 3, False)
    for bad in (["--interval", "0"], ["--iterations", "0"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)


def test_refusals_by_reason_and_the_tenants_this_key_sees() -> None:
    def health(ok: int, quota: int) -> pb.HealthResponse:
        return pb.HealthResponse(
            role="server",
            node_id="n1",
            status="SERVING",
            refusals={"quota": quota, "unauthenticated": 2},
            tenants=[
                pb.TenantStatus(
                    name="app", priority="interactive", in_flight=3, ok=ok, refused={"quota": quota}
                ),
                pb.TenantStatus(name="ops", priority="interactive", admin=True),
            ],
        )

    out = text_of(top.render(health(100, 4), health(300, 10), 2.0))
    assert line_with(out, "quota").split()[:3] == ["quota", "6", "10"]
    assert line_with(out, "unauthenticated").split()[:3] == ["unauthenticated", "0", "2"]
    app = line_with(out, " app ").split(" app ", 1)[1].split()  # beside the refusals
    assert app == ["interactive", "3", "100", "300", "quota", "10", "0"]
    assert "ops (admin)" in out
