"""`sluice top`: a live terminal view of a server's or a balancer's Health.

It polls Health every `--interval` seconds and redraws one screen: node, role, status,
provider, calls/s (the request counter's change between polls), latency percentiles, errors
by status; a server's batcher and cache; a balancer's backends, retries and sheds. `render`
turns two Health answers into a rich renderable and touches no terminal, so it is tested
alone. An unanswering target shows "unreachable: <status>" and is polled again; `--once`
prints one snapshot without rates (exit 1 if unanswered). Ctrl-C is a flag (`CtrlC`), not an
exception: a KeyboardInterrupt inside grpc's blocking call or rich's redraw could leave their
state half-changed; the loop checks the flag between polls, at most `--timeout` late.
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from types import FrameType, TracebackType
from typing import Self

import grpc
from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from sluice.client import connect
from sluice.client.blocking import SluiceClient
from sluice.routing.hedge import report
from sluice.v1 import inference_pb2 as pb

NO_VALUE = "-"
# Reconnect soon after the target comes back, rather than after grpc's backoff of up to 2 min.
CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
)
PIPE_WIDTH = 120  # columns for output that goes to a file or pipe (rich assumes 80)

STATE_STYLES = {
    "SERVING": "green",
    "CLOSED": "green",
    "HALF_OPEN": "yellow",
    "UNKNOWN": "yellow",
    "NOT_SERVING": "red",
    "OPEN": "red",
}


# -- formatting ---------------------------------------------------------------------------


def state(value: str) -> Text:
    """A status word, coloured by what it means for traffic."""
    return Text(value or "?", style=STATE_STYLES.get(value, ""))


def fmt_count(value: float) -> str:
    return f"{int(value):,}"


def fmt_rate(value: float | None) -> str:
    if value is None:
        return NO_VALUE
    return f"{value:,.0f}" if value >= 100 else f"{value:,.1f}"


def fmt_ms(value: float) -> str:
    return f"{value:.3f}" if value < 1 else f"{value:.2f}" if value < 100 else f"{value:,.0f}"


def fmt_bytes(value: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return NO_VALUE  # not reached


def fmt_duration(seconds: float) -> str:
    whole = int(seconds)
    days, rest = divmod(whole, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def fmt_pct(fraction: float | None) -> str:
    return NO_VALUE if fraction is None else f"{fraction * 100:.1f}%"


# -- differences between two polls ---------------------------------------------------------


def comparable(previous: pb.HealthResponse | None, current: pb.HealthResponse) -> bool:
    """Whether `previous` is an earlier answer of the same process: same node and role, and its
    counters and uptime have not gone back (a restart starts them again)."""
    return (
        previous is not None
        and previous.node_id == current.node_id
        and previous.role == current.role
        and previous.requests <= current.requests
        and previous.uptime_s <= current.uptime_s
    )


def delta(before: int | None, after: int) -> int | None:
    """How much a counter grew; None without an earlier value, or when it went back."""
    if before is None or before > after:
        return None
    return after - before


def per_second(before: int | None, after: int, dt: float) -> float | None:
    grown = delta(before, after)
    return None if grown is None or dt <= 0 else grown / dt


def fraction(part: float, whole: float) -> float | None:
    return part / whole if whole > 0 else None


# -- the screen ----------------------------------------------------------------------------


def grid(title: str, rows: Iterable[tuple[str, RenderableType]]) -> Table:
    """A titled two-column block of name / value rows."""
    table = Table.grid(padding=(0, 2))
    table.title = title
    table.title_justify = "left"
    table.title_style = "bold"
    rows = list(rows)
    table.add_column(style="dim", no_wrap=True, min_width=max(len(name) for name, _ in rows))
    table.add_column(no_wrap=True)
    for name, value in rows:
        table.add_row(name, value)
    return table


def header(current: pb.HealthResponse, target: str) -> Text:
    text = Text()
    text.append("sluice top", style="bold")
    if target:
        text.append(f"  {target}")
    text.append(f"  {current.role or 'unknown role'} ", style="bold cyan")
    text.append(current.node_id or "?", style="bold")
    text.append("  ")
    text.append_text(state(current.status))
    if current.provider:
        text.append(f"  {current.provider}")
    if current.HasField("model") and current.model.name:
        text.append(f"  model {current.model.name}")
    text.append(f"  up {fmt_duration(current.uptime_s)}")
    return text


def traffic(previous: pb.HealthResponse | None, current: pb.HealthResponse, dt: float) -> Table:
    before = previous.requests if previous is not None else None
    errors_before = previous.errors if previous is not None else None
    latency = current.latency
    return grid(
        "Traffic",
        [
            ("calls/s", Text(fmt_rate(per_second(before, current.requests, dt)), style="bold")),
            ("calls", fmt_count(current.requests)),
            ("errors/s", fmt_rate(per_second(errors_before, current.errors, dt))),
            ("errors", fmt_count(current.errors)),
            ("in flight", fmt_count(current.in_flight)),
            ("p50 / p99", f"{fmt_ms(latency.p50_ms)} / {fmt_ms(latency.p99_ms)} ms"),
            ("p90 / max", f"{fmt_ms(latency.p90_ms)} / {fmt_ms(latency.max_ms)} ms"),
            ("window", f"last {fmt_count(latency.count)} calls"),
        ],
    )


def counts_table(
    title: str,
    column: str,
    current: Mapping[str, int],
    previous: Mapping[str, int] | None,
    style: str,
) -> Table:
    """Counts by name (status, reason), most first: how many since the last poll, and in all."""
    table = Table(
        title=title, title_justify="left", title_style="bold", box=box.SIMPLE_HEAD, show_edge=False
    )
    table.add_column(column, no_wrap=True)
    table.add_column("new", justify="right")
    table.add_column("total", justify="right")
    for name in sorted(current, key=lambda n: (-current[n], n)):
        grown = delta(previous.get(name, 0) if previous is not None else None, current[name])
        table.add_row(
            Text(name, style=style),
            NO_VALUE if grown is None else fmt_count(grown),
            fmt_count(current[name]),
        )
    return table


def errors_table(previous: pb.HealthResponse | None, current: pb.HealthResponse) -> Table:
    before = previous.errors_by_code if previous is not None else None
    table = counts_table("Errors by status", "status", current.errors_by_code, before, "red")
    if not current.errors_by_code:
        table.add_row(Text("none", style="green"), NO_VALUE, "0")
    return table


def refusals_table(previous: pb.HealthResponse | None, current: pb.HealthResponse) -> Table:
    """Calls refused at the door, by reason (unauthenticated, quota, overload, ...)."""
    before = previous.refusals if previous is not None else None
    return counts_table("Refused at the door", "reason", current.refusals, before, "yellow")


def tenants_table(
    previous: pb.HealthResponse | None, current: pb.HealthResponse, dt: float
) -> Table:
    """The tenants this key may see (its own; all for an admin)."""
    table = Table(title="Tenants", title_justify="left", title_style="bold", box=box.SIMPLE_HEAD)
    for name, justify in (
        ("tenant", "left"),
        ("class", "left"),
        ("in flight", "right"),
        ("ok/s", "right"),
        ("ok", "right"),
        ("refused", "left"),
        ("failed", "right"),
    ):
        table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    before = {t.name: t for t in previous.tenants} if previous is not None else {}
    for t in current.tenants:
        old = before.get(t.name)
        refused = ", ".join(f"{r} {fmt_count(n)}" for r, n in sorted(t.refused.items()))
        table.add_row(
            t.name + (" (admin)" if t.admin else ""),
            t.priority,
            fmt_count(t.in_flight),
            fmt_rate(per_second(old.ok if old is not None else None, t.ok, dt)),
            fmt_count(t.ok),
            refused or "0",
            fmt_count(sum(t.failed.values())),
        )
    return table


def batcher_block(previous: pb.HealthResponse | None, current: pb.HealthResponse) -> Table:
    b = current.batcher
    old = previous.batcher if previous is not None else None
    batches = delta(old.batches if old is not None else None, b.batches)
    requests = delta(old.requests if old is not None else None, b.requests)
    recent = f"  (last poll {requests / batches:.2f})" if batches and requests is not None else ""
    flushes = b.flush_full + b.flush_budget + b.flush_drained

    def share(count: int) -> str:
        return f"{fmt_count(count)} ({fmt_pct(fraction(count, flushes))})"

    return grid(
        "Batcher",
        [
            ("queue depth", Text(fmt_count(b.queue_depth), style="bold")),
            ("instances", f"{b.busy_instances} busy of {b.instances}"),
            ("mean batch", f"{b.mean_batch_size:.2f}{recent}"),
            ("max batch", f"{b.max_batch} rows, budget {fmt_ms(b.budget_ms)} ms"),
            ("batches", fmt_count(b.batches)),
            ("flushed full", share(b.flush_full)),
            ("  on budget", share(b.flush_budget)),
            ("  drained", share(b.flush_drained)),
            ("refused", Text(fmt_count(b.rejected), style="red" if b.rejected else "")),
            ("expired", fmt_count(b.expired)),
        ],
    )


def cache_block(previous: pb.HealthResponse | None, current: pb.HealthResponse) -> Table:
    c = current.cache
    if not c.enabled:
        return grid("Cache", [("cache", "off")])
    old = previous.cache if previous is not None else None
    hits = delta(old.hits if old is not None else None, c.hits)
    misses = delta(old.misses if old is not None else None, c.misses)
    recent = fraction(hits, hits + misses) if hits is not None and misses is not None else None
    return grid(
        "Cache",
        [
            ("hit rate", Text(fmt_pct(c.hit_rate), style="bold")),
            ("last poll", fmt_pct(recent)),
            ("hits", f"{fmt_count(c.hits)}  misses {fmt_count(c.misses)}"),
            ("shared", fmt_count(c.shared)),
            ("entries", f"{fmt_count(c.entries)} of {fmt_count(c.max_entries)}"),
            ("bytes", f"{fmt_bytes(c.bytes)} of {fmt_bytes(c.max_bytes)}"),
            ("evictions", fmt_count(c.evictions)),
        ],
    )


def backends_table(
    previous: pb.HealthResponse | None, current: pb.HealthResponse, dt: float
) -> Table:
    table = Table(
        title="Backends",
        title_justify="left",
        title_style="bold",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        collapse_padding=True,
        pad_edge=False,
    )
    backends = current.backends
    for name, values in (
        ("address", [b.address for b in backends]),
        ("health", [b.health for b in backends]),
        ("breaker", [b.breaker for b in backends]),
    ):  # never cut: these say which server and what state
        table.add_column(name, no_wrap=True, min_width=max(map(len, [name, *values])))
    for name in ("in fl", "calls/s", "share", "ewma ms", "fails", "limit"):
        table.add_column(name, justify="right")
    before = {b.address: b for b in previous.backends} if previous is not None else {}
    for b in current.backends:
        old = before.get(b.address)
        table.add_row(
            b.address,
            state(b.health),
            state(b.breaker),
            fmt_count(b.in_flight),
            fmt_rate(per_second(old.calls if old is not None else None, b.calls, dt)),
            fmt_pct(b.share),
            fmt_ms(b.ewma_ms),
            Text(fmt_count(b.failures), style="red" if b.failures else ""),
            f"{b.limit:.0f}" if b.limit > 0 else NO_VALUE,
        )
    if not current.backends:
        # With auth on, a balancer lists its backends to admin keys only.
        table.add_row(Text("no backends (or not shown to this key)", style="red"), *([""] * 8))
    # Why a backend is out, as the balancer found (a TLS mismatch names the flag that fixes
    # it): under the table, as one line each, too long for a column.
    out = [f"{b.address}: {b.reason}" for b in current.backends if b.reason]
    if out:
        table.caption = Text("\n".join(out), style="red")
        table.caption_justify = "left"
    return table


def balancer_block(previous: pb.HealthResponse | None, current: pb.HealthResponse) -> Table:
    s = current.balancer
    old = previous.balancer if previous is not None else None

    def counter(name: str) -> str:
        total: int = getattr(s, name)
        grown = delta(getattr(old, name) if old is not None else None, total)
        return fmt_count(total) + ("" if grown is None else f"  (+{fmt_count(grown)})")

    return grid(
        "Balancer",
        [
            ("calls sent", counter("calls")),
            ("retries", counter("retries")),
            ("retries refused", counter("retries_refused")),
            *((label, counter(name)) for label, name in report.SHOWN),
            ("shed", counter("shed")),
            ("unavailable", counter("unavailable")),
        ],
    )


def render(
    previous: pb.HealthResponse | None,
    current: pb.HealthResponse,
    dt: float,
    *,
    target: str = "",
) -> RenderableType:
    """One screen from the latest Health answer and the one before it, `dt` seconds earlier
    (None, or another process's answer: no rates)."""
    if not comparable(previous, current):
        previous = None
    parts: list[RenderableType] = [header(current, target), Text()]
    overview = Table.grid(padding=(0, 4))
    overview.add_row(traffic(previous, current, dt), errors_table(previous, current))
    parts.append(overview)
    if current.refusals or current.tenants:
        door = Table.grid(padding=(0, 4))
        door.add_row(refusals_table(previous, current), tenants_table(previous, current, dt))
        parts += [Text(), door]
    if current.HasField("batcher") or current.HasField("cache"):
        server = Table.grid(padding=(0, 4))
        server.add_row(batcher_block(previous, current), cache_block(previous, current))
        parts += [Text(), server]
    if current.role == "balancer" or current.backends:
        parts += [
            Text(),
            backends_table(previous, current, dt),
            Text(),
            balancer_block(previous, current),
        ]
    return Group(*parts)


def unreachable(target: str, error: str, since: float | None = None) -> RenderableType:
    """The screen while the target does not answer."""
    text = Text()
    text.append("sluice top", style="bold")
    text.append(f"  {target}  ")
    text.append(f"unreachable: {error}", style="bold red")
    if since is not None:
        text.append(f"  (for {fmt_duration(since)}; still trying)")
    else:
        text.append("  (still trying)")
    return text


# -- polling -------------------------------------------------------------------------------


def describe(exc: grpc.RpcError) -> str:
    """`CODE: the first line of its details`."""
    code = exc.code()
    name = code.name if code is not None else "UNKNOWN"
    lines = (exc.details() or "").splitlines()
    return f"{name}: {lines[0]}" if lines else name


def poll(client: SluiceClient, timeout: float) -> pb.HealthResponse | str:
    """The target's Health, or why there is none (a gRPC status, in words)."""
    try:
        return client.health(timeout=timeout)
    except grpc.RpcError as exc:
        return describe(exc)


class CtrlC:
    """SIGINT as a flag, while in its `with` block (on the main thread): the handler only sets
    `pressed`, and the signal's byte on a wakeup socket ends `wait` at once. The previous
    handler and wakeup fd come back on exit."""

    def __init__(self) -> None:
        self.pressed = False
        self._wakeup: tuple[socket.socket, socket.socket] | None = None
        self._old_handler: object = None
        self._old_fd = -1

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.pressed = True

    def __enter__(self) -> Self:
        if threading.current_thread() is not threading.main_thread():
            return self  # only the main thread may take signals: Ctrl-C stays an exception
        reader, writer = socket.socketpair()
        reader.setblocking(False)
        writer.setblocking(False)
        self._wakeup = (reader, writer)
        self._old_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        self._old_handler = signal.signal(signal.SIGINT, self._on_signal)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._wakeup is None:
            return
        signal.signal(signal.SIGINT, self._old_handler)  # type: ignore[arg-type]
        signal.set_wakeup_fd(self._old_fd)
        for sock in self._wakeup:
            sock.close()
        self._wakeup = None

    def wait(self, seconds: float) -> bool:
        """Sleep up to `seconds`, less when Ctrl-C comes; whether it has come."""
        if self._wakeup is None:  # not entered: a plain sleep
            time.sleep(max(0.0, seconds))
            return self.pressed
        reader = self._wakeup[0]
        deadline = time.monotonic() + seconds
        while not self.pressed and (left := deadline - time.monotonic()) > 0:
            # A signal's byte arrives before its Python handler runs: drain it, then look again.
            if select.select([reader], [], [], left)[0]:
                try:
                    while reader.recv(512):
                        pass
                except BlockingIOError:
                    pass
        return self.pressed


def watch(
    client: SluiceClient,
    console: Console,
    target: str,
    interval: float,
    timeout: float,
    iterations: int | None,
    ctrl_c: CtrlC | None = None,
) -> int:
    """Redraw until Ctrl-C (exit 0) or `iterations` polls (exit 0 if the last one answered,
    else 1). With `ctrl_c` entered, Ctrl-C is checked between steps (never raised inside
    them); without, it ends the loop as a KeyboardInterrupt."""
    ctrl_c = ctrl_c if ctrl_c is not None else CtrlC()
    previous: pb.HealthResponse | None = None
    previous_at = 0.0
    down_since: float | None = None
    answered = False
    polls = 0
    with Live(console=console, auto_refresh=False, transient=False) as live:
        while True:
            started = time.monotonic()
            result = poll(client, timeout)
            now = time.monotonic()
            if ctrl_c.pressed:
                return 0
            if isinstance(result, str):
                answered = False
                down_since = now if down_since is None else down_since
                live.update(unreachable(target, result, now - down_since), refresh=True)
                previous = None
            else:
                answered = True
                down_since = None
                screen = render(previous, result, now - previous_at, target=target)
                live.update(screen, refresh=True)
                previous, previous_at = result, now
            polls += 1
            if iterations is not None and polls >= iterations:
                return 0 if answered else 1
            if ctrl_c.wait(started + interval - time.monotonic()):
                return 0


def positive(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not above 0")
    return value


def at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not 1 or more")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sluice top",
        description="Live view of a server's or a balancer's Health, refreshed every interval.",
        epilog="Ctrl-C quits (exit 0). With --once, or after --iterations, an unreachable "
        "target exits 1.",
    )
    connect.add_target(parser)
    parser.add_argument("--interval", type=positive, default=1.0, help="seconds between polls [1]")
    parser.add_argument(
        "--timeout",
        type=positive,
        default=None,
        help="seconds each Health call may take [the interval, at most 2]",
    )
    parser.add_argument(
        "--once", action="store_true", help="print one snapshot (no live screen) and exit"
    )
    parser.add_argument("--iterations", type=at_least_one, metavar="N", help="exit after N polls")
    connect.add_options(parser)
    return parser


def console_for() -> Console:
    """A console for stdout: rich's own size on a terminal, PIPE_WIDTH columns otherwise (unless
    COLUMNS says)."""
    console = Console()
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(width=PIPE_WIDTH)
    return console


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    timeout: float = args.timeout if args.timeout is not None else min(args.interval, 2.0)
    console = console_for()
    try:
        connection = connect.from_args(args)
        with (
            CtrlC() as ctrl_c,
            SluiceClient(
                args.target,
                timeout=timeout,
                options=CHANNEL_OPTIONS,
                **connection.client_kwargs(),
            ) as client,
        ):
            if args.once:
                result = poll(client, timeout)
                if ctrl_c.pressed:
                    return 0
                if isinstance(result, str):
                    print(f"sluice top: {args.target} unreachable: {result}", file=sys.stderr)
                    return 1
                console.print(render(None, result, 0.0, target=args.target))
                return 0
            return watch(
                client, console, args.target, args.interval, timeout, args.iterations, ctrl_c
            )
    except KeyboardInterrupt:  # Ctrl-C before CtrlC took SIGINT over
        return 0
    except (OSError, ValueError) as exc:
        print(f"sluice top: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
