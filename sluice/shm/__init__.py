"""Shared memory: the regions callers on this host register, their leases and copies
(`registry`), where a call's tensors lie in them (`slots`, `refs`, `placement`), the region
calls (`calls`), a program's registry from its settings (`setup`), and the client's and the
balancer's parts (`client`, `balancer`). The programs plug these in; none is imported here."""
