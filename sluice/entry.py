"""The installed commands' entry points: each quiets grpc-core before importing its program,
since grpc reads GRPC_VERBOSITY once, as it loads. Here, as shared layers import no program."""

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
        raise SystemExit(str(exc)) from None  # what to install, in one line
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
