"""Shared memory on the wire, as both programs answer it (each takes the regions of callers
on its host, sluice.core.shm, with --shared-memory): the words that refuse shared memory
where a program takes none, naming that program (sluice-server, sluice-balancer) to start
with the flag, and Triton's."""

from __future__ import annotations

SYSTEM_SHARED_MEMORY = "system_shared_memory"  # the extension's name in ServerMetadata
# Triton's answer where it has no GPU; Sluice maps no CUDA memory of other processes.
NO_CUDA = "GPUs not supported: Sluice takes system shared memory only"


def off(program: str) -> str:
    """The region calls' refusal (UNIMPLEMENTED) where `program` takes no shared memory."""
    return f"shared memory is off; start {program} with --shared-memory (for callers on its host)"


def unserved(program: str) -> str:
    """The words after what names a region in a body (INVALID_ARGUMENT) where `program`
    takes no shared memory."""
    return (
        f"Sluice does not serve shared memory here: start {program} with --shared-memory "
        "(for callers on its host), or send the values in the request"
    )
