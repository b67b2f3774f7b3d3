"""Sluice's sidecar balancer, and the transport-free routing core the client can embed."""

from sluice.core.paths import sole_name

sole_name(__name__, "sluice.balancer")
