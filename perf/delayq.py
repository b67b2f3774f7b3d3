"""`python -m perf.delayq QUEUE SECONDS`: holds every packet netfilter queues to QUEUE for
SECONDS, then lets it go, in the order they came: an added delay where the kernel has no
netem. Run it in the namespace whose iptables rule queues the packets (a netlink socket
belongs to its namespace). It speaks nfnetlink_queue itself (a bind, copy of the metadata
only, one verdict per packet), so it needs nothing beyond Python. Prints `bound` once the
queue is its own."""

from __future__ import annotations

import select
import socket
import struct
import sys
import time
from collections import deque

NETLINK_NETFILTER = 12
QUEUE_SUBSYS = 3 << 8  # NFNL_SUBSYS_QUEUE, in a message's type
MSG_PACKET, MSG_VERDICT, MSG_CONFIG = 0, 1, 2
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NLMSG_ERROR = 2
CFG_CMD, CFG_PARAMS = 1, 2
CMD_BIND = 1
COPY_META = 1
PACKET_HDR, VERDICT_HDR = 1, 2
NF_ACCEPT = 1


def attr(kind: int, payload: bytes) -> bytes:
    size = 4 + len(payload)
    return struct.pack("=HH", size, kind) + payload + b"\0" * (-size % 4)


def message(kind: int, queue: int, attrs: bytes, flags: int, seq: int) -> bytes:
    body = struct.pack("!BBH", socket.AF_UNSPEC, 0, queue) + attrs
    return struct.pack("=IHHII", 16 + len(body), QUEUE_SUBSYS | kind, flags, seq, 0) + body


def messages(data: bytes) -> list[tuple[int, bytes]]:
    """(type, payload) of each netlink message in one read."""
    found = []
    at = 0
    while at + 16 <= len(data):
        size, kind = struct.unpack_from("=IH", data, at)
        found.append((kind, data[at + 16 : at + size]))
        at += (size + 3) & ~3
    return found


def packet_id(payload: bytes) -> int | None:
    at = 4  # past the nfgenmsg header
    while at + 4 <= len(payload):
        size, kind = struct.unpack_from("=HH", payload, at)
        if kind & 0x3FFF == PACKET_HDR:
            return int(struct.unpack_from("!I", payload, at + 4)[0])
        at += (size + 3) & ~3
    return None


def bind(sock: socket.socket, queue: int, timeout_s: float = 5.0) -> None:
    """Take `queue`, each step acknowledged within `timeout_s` (TimeoutError if not)."""
    config = [
        attr(CFG_CMD, struct.pack("!BBH", CMD_BIND, 0, socket.AF_INET)),
        attr(CFG_PARAMS, struct.pack("!IB", 0, COPY_META)),
    ]
    sock.settimeout(timeout_s)
    try:
        for seq, attrs in enumerate(config, 1):
            sock.send(message(MSG_CONFIG, queue, attrs, NLM_F_REQUEST | NLM_F_ACK, seq))
            for kind, payload in messages(sock.recv(65536)):
                error = struct.unpack_from("=i", payload)[0] if kind == NLMSG_ERROR else 0
                if error:
                    raise OSError(-error, f"nfnetlink_queue config step {seq} refused")
    finally:
        sock.settimeout(None)  # the packet loop waits in select


def main(argv: list[str]) -> int:
    queue, hold = int(argv[0]), float(argv[1])
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    sock.bind((0, 0))
    bind(sock, queue)
    print("bound", flush=True)
    held: deque[tuple[float, int]] = deque()
    while True:
        wait = max(0.0, held[0][0] - time.monotonic()) if held else None
        if select.select([sock], [], [], wait)[0]:
            for kind, payload in messages(sock.recv(65536)):
                if kind == QUEUE_SUBSYS | MSG_PACKET and (pid := packet_id(payload)) is not None:
                    held.append((time.monotonic() + hold, pid))
        now = time.monotonic()
        while held and held[0][0] <= now:
            verdict = attr(VERDICT_HDR, struct.pack("!II", NF_ACCEPT, held.popleft()[1]))
            sock.send(message(MSG_VERDICT, queue, verdict, NLM_F_REQUEST, 0))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
