"""Hostile HTTP clients against a bootstrap server in its own process
(`kvferry bootstrap --token ...`): malformed and oversized requests, wrong
and missing tokens, request floods, connection churn and half-open
connections. The server answers each with an error, counts it on /metrics,
never dies, and keeps serving /health and /route: rooms between a prefill
registered with it and a decode still succeed."""

import http.client
import re
import socket
import threading
import time

import pytest

from hostile import connect
from harness import HEALTHY_ROOM_S, SCHED_SLACK_S, SUCCESS, Bootstrap, Decode, Prefill, Traffic, describe

TOKEN = "fault-suite-bootstrap-token"
MAX_BODY = 4096                 # --max-body of the server under test
HTTP_CLIENT_TIMEOUT_S = 5.0     # every request of the tests
FLOOD_REQUESTS = 2000           # /health and lookups, from FLOOD_THREADS threads
FLOOD_THREADS = 8
CHURN_CONNS = 500               # connections opened and closed at once
HALF_OPEN_CONNS = 300           # issue 13 item 2: request line sent, nothing more
HEALTH_BOUND_S = 1.0 + SCHED_SLACK_S  # /health under a half-open flood
HALF_OPEN_HOLD_S = 12.0         # the flood is held this long: > heartbeat interval x max failures + probe timeout
LEGIT_ROOMS = 4


@pytest.fixture
def stack(tmp_path):
    boot = Bootstrap(tmp_path, args=["--token", TOKEN, "--max-body", str(MAX_BODY)])
    pre = Prefill(tmp_path, bootstrap=boot.addr, env={"KVFERRY_BOOTSTRAP_TOKEN": TOKEN})
    dec = Decode(tmp_path, boot.addr)
    t = Traffic()
    t.attach(pre, dec)
    host, port = boot.addr.rsplit(":", 1)
    return boot, pre, dec, t, host, int(port)


def request(host, port, method, path, body=None, headers=None):
    c = http.client.HTTPConnection(host, port, timeout=HTTP_CLIENT_TIMEOUT_S)
    try:
        c.request(method, path, body=body, headers=headers or {})
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def raw(host, port, data):
    """Send raw bytes, return the status code of the reply (0: none)."""
    with connect(host, port, HTTP_CLIENT_TIMEOUT_S) as s:
        s.sendall(data)
        try:
            s.shutdown(socket.SHUT_WR)
            reply = s.recv(4096)
        except OSError:
            return 0
    m = re.match(rb"HTTP/1\.[01] (\d{3})", reply)
    return int(m.group(1)) if m else 0


def errors(host, port):
    st, body = request(host, port, "GET", "/metrics")
    assert st == 200
    return {k.decode(): int(v) for k, v in re.findall(rb'kvferry_bootstrap_errors_total\{kind="(\w+)"\} (\d+)', body)}


def legit_rooms_succeed(t):
    rooms = t.start(LEGIT_ROOMS)
    assert t.settle(rooms, HEALTHY_ROOM_S), f"rooms hung: {describe(t.open_rooms(rooms))}"
    bad = [r for r in rooms if r.dec != SUCCESS or r.pre != SUCCESS or r.bad]
    assert not bad, f"legitimate rooms failed: {describe(bad)}"


GOOD_ROUTE = b'{"role": "Prefill", "rank_ip": "127.0.0.1", "rank_port": 1, "engine_rank": 0}'


def test_malformed_oversized_and_unauthorized(stack):
    boot, pre, dec, t, host, port = stack
    legit_rooms_succeed(t)
    e0 = errors(host, port)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    cases = [  # (method, path, body, headers, expected status, counter)
        ("PUT", "/route", GOOD_ROUTE, {}, 401, "unauthorized"),
        ("PUT", "/route", GOOD_ROUTE, {"Authorization": "Bearer wrong"}, 401, "unauthorized"),
        ("PUT", "/route", GOOD_ROUTE, {"Authorization": TOKEN}, 401, "unauthorized"),
        ("PUT", "/route", GOOD_ROUTE, {"Authorization": f"Bearer {TOKEN}x"}, 401, "unauthorized"),
        ("PUT", "/route", b"x" * (MAX_BODY + 1), auth, 413, "too_large"),
        ("PUT", "/route", b"{" * 1000, auth, 400, "bad_request"),
        ("PUT", "/route", b"[]", auth, 400, "bad_request"),
        ("PUT", "/route", b'{"rank_ip": "127.0.0.1"}', auth, 400, "bad_request"),
        ("PUT", "/route", b'{"rank_ip": 5, "rank_port": "x", "engine_rank": []}', auth, 400, "bad_request"),
        ("PUT", "/route", b"\xff\xfe\x00garbage", auth, 400, "bad_request"),
        ("GET", "/route?engine_rank=&target_dp_group=", None, {}, 400, "bad_request"),
        ("GET", "/route?engine_rank=abc&target_dp_group=0", None, {}, 400, "bad_request"),
        ("GET", "/route?engine_rank=7&target_dp_group=9", None, {}, 404, "not_found"),
        ("DELETE", "/route", None, {}, 405, "method"),
        ("POST", "/health", b"x", {}, 405, "method"),
        ("GET", "/nothing-here", None, {}, 404, "not_found"),
    ]
    want = {}
    for method, path, body, headers, status, kind in cases:
        got, _ = request(host, port, method, path, body, headers)
        assert got == status, f"{method} {path} {body!r:.40}: {got}, want {status}"
        want[kind] = want.get(kind, 0) + 1
    # A declared body larger than the limit, never sent.
    assert raw(host, port, b"PUT /route HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999\r\n"
                           b"Authorization: Bearer " + TOKEN.encode() + b"\r\n\r\n") == 413
    want["too_large"] += 1
    for junk in (b"\x00\x01\x02\r\n\r\n", b"GET /health HTTP/9.9\r\n\r\n",
                 b"GET /health HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 100000 + b"\r\n\r\n"):
        assert raw(host, port, junk) in (0, 400, 413, 431, 505), junk[:30]
    e1 = errors(host, port)
    for kind, n in want.items():
        assert e1.get(kind, 0) - e0.get(kind, 0) >= n, f"{kind}: counted {e1.get(kind, 0) - e0.get(kind, 0)}, want {n}"
    assert boot.alive()
    assert request(host, port, "GET", "/health")[0] == 200
    legit_rooms_succeed(t)
    assert not t.wrong_bytes()


def test_request_flood_and_churn(stack):
    boot, pre, dec, t, host, port = stack
    failures = []

    def worker(n):
        for i in range(n):
            path = "/health" if i % 2 else "/route?engine_rank=-1&target_dp_group=-1"
            try:
                st, _ = request(host, port, "GET", path)
                if st != 200:
                    failures.append(st)
            except OSError as e:
                failures.append(repr(e))

    threads = [threading.Thread(target=worker, args=(FLOOD_REQUESTS // FLOOD_THREADS,)) for _ in range(FLOOD_THREADS)]
    for th in threads:
        th.start()
    for _ in range(CHURN_CONNS):
        try:
            connect(host, port, HTTP_CLIENT_TIMEOUT_S).close()
        except OSError:
            pass
    legit_rooms_succeed(t)
    for th in threads:
        th.join()
    assert boot.alive()
    assert not failures, f"{len(failures)} of {FLOOD_REQUESTS} requests failed under the flood: {failures[:5]}"
    legit_rooms_succeed(t)


def test_half_open_flood(stack):
    # issue 13 defect 2 (regression test); the defect was: idle connections starve the bootstrap server
    """HALF_OPEN_CONNS connections that send a request line and nothing more,
    held past the decode's heartbeat failure budget: /health keeps answering
    within its bound and rooms of the healthy prefill still succeed."""
    boot, pre, dec, t, host, port = stack
    socks = []
    try:
        for _ in range(HALF_OPEN_CONNS):
            try:
                s = connect(host, port, HTTP_CLIENT_TIMEOUT_S)
                s.sendall(b"GET /health HTTP/1.1\r\n")
                socks.append(s)
            except OSError:
                break
        worst = 0.0
        health_failed = 0
        deadline = time.monotonic() + HALF_OPEN_HOLD_S
        while time.monotonic() < deadline:
            t0 = time.monotonic()
            try:
                if request(host, port, "GET", "/health")[0] != 200:
                    health_failed += 1
            except OSError:
                health_failed += 1
            worst = max(worst, time.monotonic() - t0)
            t.keep_busy(0.5, 2)
        t.settle(list(t.rooms.values()), HEALTHY_ROOM_S)
    finally:
        for s in socks:
            s.close()
    assert boot.alive() and pre.alive() and dec.alive()
    failed = [r for r in t.rooms.values() if r.dec != SUCCESS]
    assert not t.wrong_bytes()
    assert not health_failed and worst <= HEALTH_BOUND_S, \
        f"/health under {len(socks)} half-open connections: {health_failed} failed, slowest {worst:.1f}s"
    assert not failed, f"rooms of a healthy prefill failed under the flood: {describe(failed)}"
