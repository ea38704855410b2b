"""`kvferry bench rooms` with one custom case (`--room-pages 1 --inflight 8`):
the case reports its CPU per room (`cpu_us_per_room`, both processes) and
splits it by side and thread (`cpu_by_thread`): the decode's bench loop and
the prefill's harness thread are there, every entry is a side and a thread
name, the entries come largest first and add up to the total (the printed
figures are rounded to 0.01 us). Never a speed: only that the figures are
there and add up."""

import json
import math
import os
import subprocess

import pytest

CLI = os.environ.get("KVFERRY_CLI", "")

pytestmark = pytest.mark.skipif(not CLI or not os.path.exists(CLI), reason="KVFERRY_CLI not set")


def run(*args, timeout=240):
    return subprocess.run([CLI, "bench", "rooms", *args], capture_output=True, text=True, timeout=timeout)


def test_cpu_by_thread_adds_up():
    p = run("--room-pages", "1", "--inflight", "8", "--rooms", "3000", "--json", "--transport", "tcp")
    assert p.returncode == 0, f"stdout={p.stdout[-2000:]!r} stderr={p.stderr[-3000:]!r}"
    case = json.loads(p.stdout)["cases"][0]
    total = case["cpu_us_per_room"]
    assert math.isfinite(total) and total > 0
    threads = case["cpu_by_thread"]
    assert threads, case
    for t in threads:
        assert set(t) == {"side", "thread", "us_per_room"}, t
        assert t["side"] in ("decode", "prefill") and t["thread"], t
        assert t["us_per_room"] > 0, t
    shares = [t["us_per_room"] for t in threads]
    assert shares == sorted(shares, reverse=True)
    assert abs(sum(shares) - total) <= 0.01 * len(shares) + 0.1, (sum(shares), total)
    names = {(t["side"], t["thread"]) for t in threads}
    assert ("decode", "kvferry") in names  # the bench's own loop drives the receivers
    assert any(side == "prefill" for side, _ in names)


def test_cpu_by_thread_in_text():
    p = run("--room-pages", "1", "--inflight", "8", "--rooms", "1000", "--transport", "tcp")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "cpu us/room" in p.stdout
    assert "CPU by thread, us per room (both processes):" in p.stdout
