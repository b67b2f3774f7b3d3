"""The installed commands' entry points (pyproject's [project.scripts]): each quiets
grpc-core's own log lines (`quiet_grpc_core`: GRPC_VERBOSITY=NONE unless the user set it),
then imports its program and runs it. grpc reads that variable once, as it is first
imported, and every program imports grpc at its top: so the imports wait until here. Above
the programs, not in sluice.runtime: shared layers import no program."""

from __future__ import annotations

from sluice.runtime.process import quiet_grpc_core


def server() -> int:
    """`sluice-server`."""
    quiet_grpc_core()
    try:
        from sluice.server.main import main
    except ImportError as exc:
        if exc.name != "onnxruntime":
            raise
        raise SystemExit(str(exc)) from None  # what to install, in one line: status 1
    return main()


def balancer() -> int:
    """`sluice-balancer`."""
    quiet_grpc_core()
    from sluice.balancer.main import main

    return main()


def cli() -> int:
    """`sluice`: its commands (up, top and perf among them) and what they start inherit it."""
    quiet_grpc_core()
    from sluice.client.cli import main

    return main()
