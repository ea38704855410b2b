"""`kvferry bootstrap` as a tokenspeed peer sees it: the CLI runs as a
subprocess on 127.0.0.1 with port 0, and `requests` talks to it the way the
Python prefill and decode managers do (json= bodies with Python's default
separators, a persistent session for heartbeats). Checks the wire contract of
PROTOCOL §4 and kvferry's error codes (400/401/404/405/413)."""

import os
import re
import select
import signal
import subprocess
import time

import pytest
import requests

CLI = os.environ.get("KVFERRY_CLI", "")
START_TIMEOUT_S = 10
HTTP_TIMEOUT_S = 5

pytestmark = pytest.mark.skipif(not CLI or not os.path.exists(CLI), reason="KVFERRY_CLI not set")


def start_bootstrap(*extra):
    """Start the server and read the port from its one stdout line."""
    proc = subprocess.Popen(
        [CLI, "bootstrap", "--port", "0", "--host", "127.0.0.1", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={k: v for k, v in os.environ.items() if k != "KVFERRY_BOOTSTRAP_TOKEN"},
    )
    deadline = time.monotonic() + START_TIMEOUT_S
    line = b""
    while not line.endswith(b"\n") and time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        chunk = os.read(proc.stdout.fileno(), 256)
        if not chunk:
            break
        line += chunk
    m = re.search(rb"listening on 127\.0\.0\.1:(\d+)", line)
    if not m:
        stop(proc)
        raise AssertionError(f"bootstrap did not start: stdout={line!r} stderr={proc.stderr.read()!r}")
    return proc, f"http://127.0.0.1:{int(m.group(1))}"


def stop(proc):
    """SIGTERM, then SIGKILL if it does not exit promptly; returns the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
    for f in (proc.stdout, proc.stderr):
        if f:
            f.close()
    return proc.returncode


def session():
    s = requests.Session()
    s.trust_env = False  # no proxy between two local processes
    return s


@pytest.fixture
def server():
    proc, url = start_bootstrap()
    try:
        yield url
    finally:
        assert stop(proc) == 0


@pytest.fixture
def token_server():
    proc, url = start_bootstrap("--token", "tok-123")
    try:
        yield url
    finally:
        assert stop(proc) == 0


def registration(rank, world=8, dp=2, **extra):
    body = {
        "role": "Prefill",
        "world_size": world,
        "dp_size": dp,
        "rank_ip": f"10.0.0.{rank + 1}",
        "rank_port": 39000 + rank,
        "engine_rank": rank,
        "enable_mla_l1_5_cache": False,
        "kv_item_lens": [8192, 8192, 8192, 8192],
        "kv_unit_lens": [256, 256, 256, 256],
        "state_item_lens": [],
        "state_unit_lens": [],
    }
    body.update(extra)
    return body


def test_tokenspeed_prefill_and_decode_flow(server):
    s = session()
    # Before any PUT the sizes are null, as the reference answers.
    r = s.get(f"{server}/route", params={"engine_rank": -1, "target_dp_group": -1}, timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 200
    assert r.json()["prefill_tp_size"] is None
    assert r.json()["prefill_dp_size"] is None

    for rank in range(8):
        r = s.put(f"{server}/route", json=registration(rank), timeout=HTTP_TIMEOUT_S)
        assert r.status_code == 200, r.text
        assert r.text == "OK"

    r = s.get(f"{server}/route?engine_rank=-1&target_dp_group=-1", timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 200
    assert r.headers["Content-Type"].startswith("application/json")
    # The reply uses Python's default separators, like aiohttp's json_response.
    assert r.text.startswith('{"prefill_tp_size": 8, "prefill_dp_size": 2, ')
    assert r.json() == {
        "prefill_tp_size": 8,
        "prefill_dp_size": 2,
        "enable_mla_l1_5_cache": False,
        "kv_item_lens": [8192, 8192, 8192, 8192],
        "kv_unit_lens": [256, 256, 256, 256],
        "state_item_lens": [],
        "state_unit_lens": [],
    }
    info = r.json()
    tp_per_dp = info["prefill_tp_size"] // info["prefill_dp_size"]
    room = 7215963401
    group = room % info["prefill_dp_size"]
    for tp in range(tp_per_dp):
        r = s.get(
            f"{server}/route?engine_rank={tp}&target_dp_group={group}", timeout=HTTP_TIMEOUT_S
        )
        assert r.status_code == 200
        assert r.headers["Content-Type"].startswith("application/json")
        rank = group * tp_per_dp + tp
        assert r.json() == {"rank_ip": f"10.0.0.{rank + 1}", "rank_port": 39000 + rank}


def test_health_get_and_head(server):
    s = session()
    for _ in range(5):  # the decode heartbeat reuses one keep-alive session
        r = s.get(f"{server}/health", timeout=(2, 3), headers={"Connection": "keep-alive"})
        assert r.status_code == 200
        assert r.text == "OK"
    r = s.head(f"{server}/health", timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 200
    assert r.content == b""
    assert s.post(f"{server}/health", timeout=HTTP_TIMEOUT_S).status_code == 405


def test_error_codes(server):
    s = session()
    assert s.put(f"{server}/route", json=registration(0), timeout=HTTP_TIMEOUT_S).status_code == 200
    # Unknown rank or group: 404 (the reference answers 500).
    r = s.get(f"{server}/route?engine_rank=3&target_dp_group=1", timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 404
    assert s.get(f"{server}/route?engine_rank=0&target_dp_group=9", timeout=HTTP_TIMEOUT_S).status_code == 404
    # Missing or non-integer parameters: 400.
    r = s.get(f"{server}/route?engine_rank=0", timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 400
    assert r.text == "Missing inputs for bootstrap server."
    assert s.get(f"{server}/route?engine_rank=x&target_dp_group=0", timeout=HTTP_TIMEOUT_S).status_code == 400
    # Bad bodies: 400 with a reason.
    r = s.put(f"{server}/route", data=b"{not json", timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 400 and r.text
    body = registration(1)
    del body["rank_ip"]
    r = s.put(f"{server}/route", json=body, timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 400 and "rank_ip" in r.text
    r = s.put(f"{server}/route", json=registration(1, world=1 << 20), timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 400
    r = s.put(f"{server}/route", json=registration(1, dp=0), timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 400
    # Sizes differ from the first registration: refused, not mis-filed.
    assert s.put(f"{server}/route", json=registration(1, world=4), timeout=HTTP_TIMEOUT_S).status_code == 409
    # Other methods: 405.
    assert s.delete(f"{server}/route", timeout=HTTP_TIMEOUT_S).status_code == 405
    assert s.post(f"{server}/route", json=registration(1), timeout=HTTP_TIMEOUT_S).status_code == 405
    # Oversized body: 413, and the server keeps serving.
    r = s.put(f"{server}/route", data=b" " * (200 * 1024), timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 413
    assert session().get(f"{server}/health", timeout=HTTP_TIMEOUT_S).status_code == 200
    # Nothing above changed the table.
    r = s.get(f"{server}/route?engine_rank=1&target_dp_group=0", timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 404

    m = session().get(f"{server}/metrics", timeout=HTTP_TIMEOUT_S)
    assert m.status_code == 200
    assert m.headers["Content-Type"].startswith("text/plain")
    values = dict(
        line.rsplit(" ", 1) for line in m.text.splitlines() if line and not line.startswith("#")
    )
    assert values["kvferry_bootstrap_registrations_total"] == "1"
    assert values['kvferry_bootstrap_errors_total{kind="not_found"}'] == "3"
    assert values['kvferry_bootstrap_errors_total{kind="bad_request"}'] == "6"
    assert values['kvferry_bootstrap_errors_total{kind="method"}'] == "2"
    assert values['kvferry_bootstrap_errors_total{kind="too_large"}'] == "1"
    assert values['kvferry_bootstrap_errors_total{kind="conflict"}'] == "1"
    assert values["kvferry_bootstrap_registered_ranks"] == "1"


def test_token_guards_put_only(token_server):
    s = session()
    r = s.put(f"{token_server}/route", json=registration(0), timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 401
    assert r.headers.get("WWW-Authenticate", "").startswith("Bearer")
    r = s.put(
        f"{token_server}/route",
        json=registration(0),
        headers={"Authorization": "Bearer wrong"},
        timeout=HTTP_TIMEOUT_S,
    )
    assert r.status_code == 401
    r = s.put(
        f"{token_server}/route",
        json=registration(0),
        headers={"Authorization": "Bearer tok-123"},
        timeout=HTTP_TIMEOUT_S,
    )
    assert r.status_code == 200
    # GETs need no token.
    r = s.get(f"{token_server}/route?engine_rank=0&target_dp_group=0", timeout=HTTP_TIMEOUT_S)
    assert r.json() == {"rank_ip": "10.0.0.1", "rank_port": 39000}
    assert s.get(f"{token_server}/health", timeout=HTTP_TIMEOUT_S).status_code == 200


def test_cli_rejects_bad_options_and_busy_port():
    r = subprocess.run([CLI, "bootstrap", "--port", "x"], capture_output=True, timeout=10)
    assert r.returncode == 2
    r = subprocess.run([CLI, "bootstrap", "--bogus", "1"], capture_output=True, timeout=10)
    assert r.returncode == 2
    proc, url = start_bootstrap()
    try:
        port = url.rsplit(":", 1)[1]
        r = subprocess.run(
            [CLI, "bootstrap", "--port", port, "--host", "127.0.0.1"], capture_output=True, timeout=10
        )
        assert r.returncode == 1
        assert b"cannot start" in r.stderr
    finally:
        assert stop(proc) == 0
