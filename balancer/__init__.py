"""Sluice's sidecar balancer, and the transport-free routing core the client can embed."""
