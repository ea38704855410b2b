"""Message builders of the hostile peers: the engine's TCP frames
(src/engine/tcp_proto.h) and the ZMQ control messages (PROTOCOL.md §3)."""

import socket
import struct

from harness import SUCCESS

HELLO_MAGIC, CHUNK_MAGIC, ACK_MAGIC = 0x4B564648, 0x4B564643, 0x4B564641
PROTO_VERSION = 1
MAX_TOKEN, MAX_DESC = 1024, 16384
SOCK_TIMEOUT_S = 5.0            # every raw-socket read
# Hostile peers connect from their own loopback address, so a target may tell
# them apart from the legitimate peers on 127.0.0.1 (per-peer limits).
HOSTILE_SRC = ("127.0.0.2", 0)


def hello(token=b"", magic=HELLO_MAGIC, version=PROTO_VERSION, token_len=None):
    return struct.pack("<IHHII", magic, version, 0, len(token) if token_len is None else token_len, 0) + token


def chunk(descs, payload=b"", seq=1, total=None, magic=CHUNK_MAGIC, ndesc=None):
    head = struct.pack("<IIQQ", magic, len(descs) if ndesc is None else ndesc, seq,
                       sum(d[1] * d[2] for d in descs) if total is None else total)
    return head + b"".join(struct.pack("<QQQQ", *d) for d in descs) + payload


def D(dst, length, count=1, stride=0):
    return (dst, length, count, stride)


def i64(*v):
    return struct.pack(f"<{len(v)}q", *v)


def i32(*v):
    return struct.pack(f"<{len(v)}i", *v)


def m3(room, status=SUCCESS, rank=0, token=b"-1", cands=b""):
    return [str(room).encode(), str(status).encode(), str(rank).encode(), token, cands]


def m2(room, session=b"127.0.0.1:1", port=b"1", indices=i64(1, 2), aux=b"0", required=b"1"):
    return [str(room).encode(), b"127.0.0.1", port, session, indices, aux, required, b"0", b"0", b"", b"", b""]


def m1(session=b"127.0.0.1:1", port=b"1", ptrs=i64(0x1000, 0x2000, 0x3000, 0x4000)):
    return [b"None", b"127.0.0.1", port, session, ptrs, b"", b"", b"0"]


MALFORMED_M3 = [
    [b"room", b"5", b"0"],
    [b"1"],
    [b"1", b"5"],
    [b"1", b"five", b"0"],
    [b"1", b"5", b"x"],
    [b"1", b"5", b"0", b""],
    [b"1", b"5", b"0", b"7", b"abc"],        # candidates not a multiple of 4
    [b"", b"", b""],
    [b"99999999999999999999999", b"5", b"0"],
    [b"\xff\xfe" * 100, b"5", b"0"],
    [b"1", b"-2147483649", b"0"],
    [b"x" * 65536],
]

MALFORMED_PREFILL = [
    [b"None"],                                        # M1 with too few frames
    m1(port=b"port"),
    m1(ptrs=b"\x01" * 7),                             # not a multiple of 8
    [b"None", b"h", b"1", b"", i64(1), b""],          # empty session
    [b"None", b"h", b"1", b"s", i64(1), b"", b"", b"x"],
    [b"room"] + m2(1)[1:],
    m2(1, required=b"many"),
    m2(1, indices=b"\x01" * 9),
    m2(1, aux=b""),                                  # frame 4 set, frame 5 empty: not a dummy
    m2(1)[:5],
    m2(1)[:7] + [b""],                                # present frame 7 must be an int
    m2(1) + [b"2", b"[]"],                            # plan version not 1
    m2(1) + [b"1", b"{not json"],
    m2(1) + [b"", b"[]"],                             # exactly one of 12-13 empty
    [b""],
    [b"\x00" * 100000],
]


def connect(host, port, timeout=SOCK_TIMEOUT_S, src=HOSTILE_SRC):
    """A hostile TCP connection (from HOSTILE_SRC, or `src`: None lets the kernel choose)."""
    s = socket.create_connection((host, port), timeout=timeout, source_address=src)
    s.settimeout(timeout)
    return s


def recv_exact(s, n):
    out = b""
    while len(out) < n:
        k = s.recv(n - len(out))
        if not k:
            break
        out += k
    return out


def handshake(s, token=b""):
    s.sendall(hello(token))
    rep = recv_exact(s, 8)
    assert len(rep) == 8, "no hello reply"
    return struct.unpack("<Ii", rep)[1]


def closed_by_peer(s, limit=SOCK_TIMEOUT_S):
    """True if the target closes the connection within `limit` seconds."""
    s.settimeout(limit)
    try:
        while True:
            if not s.recv(4096):
                return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False
