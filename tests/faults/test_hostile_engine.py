"""Hostile peers against a transfer-engine target (`kvferry-testpeer engine-peer`),
over raw TCP sockets: every framing and range violation of the engine's
protocol (src/engine/tcp_proto.h), slow hellos, slow payloads and connection
floods. The target counts each reject, writes nothing outside its registered
memory, never dies, and keeps serving a legitimate peer (kvferry's
TransferEngine in this process) throughout."""

import ctypes
import os
import struct
import sys
import threading
import time

import pytest

from hostile import (ACK_MAGIC, MAX_DESC, MAX_TOKEN, PROTO_VERSION, D, chunk, closed_by_peer, connect,  # noqa: E402
                     handshake, hello, recv_exact)
from harness import ENGINE_TIMEOUT_MS, LINE_TIMEOUT_S, ROOT, SCHED_SLACK_S, Exe

sys.path.insert(0, os.path.join(ROOT, "python"))
from kvferry import KVFError, TransferEngine  # noqa: E402

PEER_BYTES = 1 << 20
TOKEN = "fault-suite-secret"

HELLO_TIMEOUT_S = 5.0           # the engine's hello deadline (TCP_HELLO_TIMEOUT_MS)
HELLO_BOUND_S = HELLO_TIMEOUT_S + SCHED_SLACK_S  # issue 13 item 3: an overall hello deadline
CHUNK_BOUND_S = ENGINE_TIMEOUT_MS / 1000 + SCHED_SLACK_S  # issue 13 item 4: an overall chunk deadline
SLOW_PEER_BOUND_S = 2.0 + SCHED_SLACK_S  # another peer's 16-byte write while one peer trickles
LEGIT_WRITE_S = 10.0            # a legitimate write on an unloaded target
FLOOD_CONNS = 300               # the flood size (above the default 256 inbound slots)
CHURN_CONNS = 500               # connect-and-close churn
TRICKLE_PERIOD_S = 1.0          # one byte this often from a trickling peer


class EnginePeer(Exe):
    def __init__(self, tmp_path, token=None, name="engine-peer"):
        args = ["engine-peer", "--bytes", str(PEER_BYTES)] + (["--token", token] if token else [])
        super().__init__(args, tmp_path, name)
        f = self.line().split()
        assert f[0] == "ready", f
        self.session, self.base, self.size = f[1], int(f[2], 16), int(f[3])
        self.host, self.port = self.session.rsplit(":", 1)[0], int(self.session.rsplit(":", 1)[1])

    def stats(self):
        rx, refused, auth = map(int, self.cmd("stats").split()[1:])
        perr, cref = map(int, self.cmd("errors").split()[1:])
        return {"received": rx, "refused": refused, "auth": auth, "protocol": perr, "conns_refused": cref}

    def untouched(self, byte):
        return self.cmd(f"untouched {byte}") == "ok"


@pytest.fixture
def peer(tmp_path):
    return EnginePeer(tmp_path)


@pytest.fixture
def legit():
    e = TransferEngine()
    e.initialize("127.0.0.1", timeout_ms=ENGINE_TIMEOUT_MS, auth_token="")  # raises KVFError on failure
    src = (ctypes.c_uint8 * PEER_BYTES)()
    e.register_memory(ctypes.addressof(src), PEER_BYTES)
    e.src = src
    yield e
    e.close()


def legit_write(e, peer, value, length=PEER_BYTES):
    """Fill the target with `value` through a real engine; True if it landed."""
    ctypes.memset(e.src, value, length)
    try:
        e.transfer_sync_write(peer.session, ctypes.addressof(e.src), peer.base, length)
    except KVFError:
        return False
    return length < PEER_BYTES or peer.untouched(value)


# Chunk-level violations: (name, bytes after a good hello, counter that must grow).
def framing_cases(base, size):
    end = base + size
    return [
        ("bad-chunk-magic", chunk([D(base, 8)], b"x" * 8, magic=0xDEADBEEF), "protocol"),
        ("zero-descriptors", chunk([], ndesc=0, total=0), "protocol"),
        ("too-many-descriptors", chunk([], ndesc=MAX_DESC + 1, total=0), "protocol"),
        ("count-zero", chunk([D(base, 8, 0)], total=0), "protocol"),
        ("len-times-count-overflows", chunk([D(base, 1 << 40, 1 << 40, 0)], total=0), "protocol"),
        ("total-mismatch", chunk([D(base, 8)], b"x" * 8, total=9), "protocol"),
        ("sum-overflows", chunk([D(base, (1 << 64) - 8), D(base, 16)], total=8), "protocol"),
    ], [
        ("below-region", chunk([D(base - 4096, 16)], b"\xee" * 16)),
        ("past-end", chunk([D(end - 8, 16)], b"\xee" * 16)),
        ("starts-at-end", chunk([D(end, 1)], b"\xee")),
        ("address-wraps", chunk([D((1 << 64) - 8, 16)], b"\xee" * 16)),
        ("stride-past-end", chunk([D(base, 16, 4, size // 2)], b"\xee" * 64)),
        ("stride-wraps", chunk([D(base, 16, 2, (1 << 64) - 8)], b"\xee" * 32)),
        ("one-bad-of-two", chunk([D(base, 16), D(end, 16)], b"\xee" * 32)),
    ]


def test_framing_and_range_violations(peer, legit):
    """Every malformed hello and chunk drops the connection and is counted;
    every out-of-range write is refused with an error ack and writes nothing;
    the target then serves a legitimate write."""
    assert peer.cmd("fill 0") == "ok"
    before = peer.stats()
    bad_hellos = [
        hello(magic=0x12345678), hello(version=PROTO_VERSION + 1), hello(token_len=MAX_TOKEN + 1),
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\0" * 16,
    ]
    for h in bad_hellos:
        s = connect(peer.host, peer.port)
        s.sendall(h)
        assert closed_by_peer(s), f"connection with hello {h[:16]!r} not dropped"
        s.close()
    framing, ranges = framing_cases(peer.base, peer.size)
    for name, data, _ in framing:
        s = connect(peer.host, peer.port)
        assert handshake(s) == 0
        s.sendall(data)
        assert closed_by_peer(s), f"{name}: connection not dropped"
        s.close()
    for name, data in ranges:
        s = connect(peer.host, peer.port)
        assert handshake(s) == 0
        s.sendall(data)
        ack = recv_exact(s, 16)
        assert len(ack) == 16, f"{name}: no ack"
        seq, status, magic = struct.unpack("<QiI", ack)
        assert magic == ACK_MAGIC and seq == 1 and status != 0, f"{name}: accepted ({status})"
        s.close()
    for name, data in [("truncated-hello", hello()[:7]), ("truncated-header", hello() + chunk([D(peer.base, 8)])[:10]),
                       ("truncated-descriptors", hello() + chunk([D(peer.base, 8)])[:30])]:
        s = connect(peer.host, peer.port)
        s.sendall(data)
        s.close()
    after = peer.stats()
    assert after["protocol"] - before["protocol"] >= len(bad_hellos) + len(framing)
    assert after["refused"] - before["refused"] == len(ranges)
    assert peer.untouched(0), "a refused write changed the target's memory"
    assert peer.alive()
    assert legit_write(legit, peer, 0x5A)


def test_wrong_and_missing_tokens(tmp_path):
    """With a secret set, a wrong or missing token is refused and counted and
    no chunk is taken on that connection; the right token is accepted."""
    peer = EnginePeer(tmp_path, token=TOKEN)
    assert peer.cmd("fill 0") == "ok"
    for tok in (b"", b"wrong", TOKEN.encode()[:-1], TOKEN.encode() + b"x", b"\0" * MAX_TOKEN):
        s = connect(peer.host, peer.port)
        assert handshake(s, tok) != 0, f"token {tok[:20]!r} accepted"
        try:
            s.sendall(chunk([D(peer.base, 16)], b"\xee" * 16))
        except OSError:
            pass
        assert closed_by_peer(s)
        s.close()
    assert peer.stats()["auth"] == 5
    s = connect(peer.host, peer.port)
    assert handshake(s, TOKEN.encode()) == 0
    s.sendall(chunk([D(peer.base, 16)], b"\x5a" * 16))
    assert struct.unpack("<QiI", recv_exact(s, 16))[1] == 0
    s.close()
    assert peer.stats()["received"] == 1 and not peer.untouched(0)


def test_connect_close_churn(peer, legit):
    """Connections opened and closed at once, with or without a partial hello,
    cost the target nothing lasting."""
    for i in range(CHURN_CONNS):
        s = connect(peer.host, peer.port)
        if i % 2:
            s.sendall(hello()[: i % 16])
        s.close()
    assert peer.alive()
    assert legit_write(legit, peer, 0x33)


def trickle(socks, stop, data):
    """Send data one byte at a time on every socket, one byte each TRICKLE_PERIOD_S."""
    i = 0
    while not stop.is_set() and i < len(data):
        for s in socks:
            try:
                s.send(data[i:i + 1])
            except OSError:
                pass
        i += 1
        stop.wait(TRICKLE_PERIOD_S)


def test_slow_hello_has_an_overall_deadline(peer):
    # issue 13 defect 3 (regression test); the defect was: the hello timeout restarts on every byte
    s = connect(peer.host, peer.port)
    stop = threading.Event()
    th = threading.Thread(target=trickle, args=([s], stop, hello(b"t" * 64)), daemon=True)
    th.start()
    try:
        t0 = time.monotonic()
        closed = closed_by_peer(s, HELLO_BOUND_S + 2 * TRICKLE_PERIOD_S)
        took = time.monotonic() - t0
    finally:
        stop.set()
        th.join()
        s.close()
    assert peer.alive()
    assert closed and took <= HELLO_BOUND_S, f"a trickling hello held its slot {took:.1f}s (bound {HELLO_BOUND_S}s)"


@pytest.mark.parametrize("kind", ["trickling-hello", "idle-after-hello"])
def test_connection_flood_leaves_room_for_legitimate_peers(peer, legit, kind):
    # issue 13 defect 3 (regression test); the defect was: trickling or idle peers hold every engine connection slot
    socks, stop = [], threading.Event()
    th = None
    try:
        for _ in range(FLOOD_CONNS):
            try:
                s = connect(peer.host, peer.port)
            except OSError:
                break
            if kind == "idle-after-hello":
                try:
                    handshake(s)
                except (OSError, AssertionError):
                    pass
            socks.append(s)
        if kind == "trickling-hello":
            th = threading.Thread(target=trickle, args=(socks, stop, hello(b"t" * 64)), daemon=True)
            th.start()
        time.sleep(TRICKLE_PERIOD_S)
        t0 = time.monotonic()
        ok = legit_write(legit, peer, 0x44, 4096)
        took = time.monotonic() - t0
    finally:
        stop.set()
        if th:
            th.join()
        for s in socks:
            s.close()
    assert peer.alive()
    assert ok and took <= LEGIT_WRITE_S, f"legitimate write {'failed' if not ok else 'took %.1fs' % took} " \
                                         f"under {len(socks)} {kind} connections"


def test_slow_payload_does_not_stall_other_peers(peer, legit):
    # issue 13 defect 4 (regression test); the defect was: one slow peer stalls the whole target engine
    s = connect(peer.host, peer.port)
    assert handshake(s) == 0
    n = 4096
    s.sendall(chunk([D(peer.base + PEER_BYTES // 2, n)]))  # header only; the payload trickles
    stop = threading.Event()
    th = threading.Thread(target=trickle, args=([s], stop, b"\x77" * n), daemon=True)
    th.start()
    result = {}

    def other():
        t0 = time.monotonic()
        result["ok"] = legit_write(legit, peer, 0x21, 16)
        result["took"] = time.monotonic() - t0

    try:
        time.sleep(2 * TRICKLE_PERIOD_S)
        w = threading.Thread(target=other, daemon=True)
        w.start()
        w.join(ENGINE_TIMEOUT_MS / 1000 + LINE_TIMEOUT_S)
        t0 = time.monotonic()
        closed = closed_by_peer(s, CHUNK_BOUND_S + 2 * TRICKLE_PERIOD_S)
        chunk_held = time.monotonic() - t0 + 2 * TRICKLE_PERIOD_S + result.get("took", 0)
    finally:
        stop.set()
        th.join()
        s.close()
    assert peer.alive()
    assert result.get("ok") and result["took"] <= SLOW_PEER_BOUND_S, \
        f"another peer's 16-byte write: {result} while one peer trickled (bound {SLOW_PEER_BOUND_S}s)"
    assert closed and chunk_held <= CHUNK_BOUND_S, f"a trickled chunk held the connection {chunk_held:.1f}s"
