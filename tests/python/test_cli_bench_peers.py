"""`kvferry bench peers --quick --json` (issue 24): one prefill rank with 1 and
8 idle decode peers, and one decode rank with 1 and 8 idle prefill peers, on
every transport this build has. Checks the JSON's
shape and that every idle peer really connected (its room succeeded), never
a speed: the per-peer figures and the rates are only required to be there
and sane (non-negative, finite). With the managers' idle close of control
sockets shortened to IDLE_S (KVFERRY_CONTROL_IDLE_S), the figures after it
must show fewer descriptors per peer than while the peers were fresh."""

import json
import math
import os
import subprocess

import pytest

CLI = os.environ.get("KVFERRY_CLI", "")

pytestmark = pytest.mark.skipif(not CLI or not os.path.exists(CLI), reason="KVFERRY_CLI not set")

CASE_KEYS = {"peers", "connected", "threads", "fds", "rss_kib", "threads_per_peer", "fds_per_peer",
             "rss_kib_per_peer", "rooms_per_s", "p50_us", "p99_us", "rate_over_1peer", "idle_cpu_pct",
             "idle_wakeups_per_s", "idle_wakeups_per_s_per_peer", "idle_peers_cpu_pct", "rooms_per_s_runs", "error",
             "rss_split_kib_per_peer", "warmup_rooms_per_s", "control_rooms_per_s", "rate_over_control",
             "rate_over_1peer_controlled", "control_rooms_per_s_runs"}
SPLIT_KEYS = {"anon", "shmem", "file"}
IDLE_S = 2  # the idle close, seconds: the bench waits it out twice per view


def run(*args):
    env = dict(os.environ)
    env.pop("KVFERRY_TRANSPORT", None)  # the bench picks each transport itself
    env["KVFERRY_CONTROL_IDLE_S"] = str(IDLE_S)
    p = subprocess.run([CLI, "bench", "peers", "--quick", "--json", *args], capture_output=True, text=True,
                       timeout=240, env=env)
    assert p.returncode == 0, f"stdout={p.stdout[-2000:]!r} stderr={p.stderr[-3000:]!r}"
    return json.loads(p.stdout)


def test_quick_json_shape():
    out = run()
    assert out["bench"] == "peers"
    assert out["auto_picks"] in ("tcp", "ucx")
    assert set(out["targets"]) == {"threads_per_peer_max", "rss_kib_per_peer_max", "rate_over_1peer_min",
                                   "rate_over_1peer_controlled_min"}
    transports = ["tcp", "ucx"] if out["auto_picks"] == "ucx" else ["tcp"]
    views = ["prefill_with_idle_decodes", "decode_with_idle_prefills"]
    assert [(r["transport"], r["view"]) for r in out["runs"]] == [(t, v) for t in transports for v in views]
    for r in out["runs"]:
        assert r["engine"] == r["transport"]
        assert r["mode"] in ("tcp", "read", "write or tcp")
        for k in ("measured_start", "measured_base"):
            assert r[k]["threads"] > 0 and r[k]["fds"] > 0 and r[k]["rss_kib"] > 0
        assert r["measured_max_inbound_conns"] >= 256
        # An idle measured process sleeps: the library's threads and the
        # harness wait on their events, no tick (about 1000/s when kv-peer
        # polled stdin every millisecond).
        assert r["measured_base"]["idle_wakeups_per_s"] < 200, r["measured_base"]
        assert r["idle_instance"]["threads"] > 0
        assert [c["peers"] for c in r["cases"]] == [1, 8]
        for c in r["cases"]:
            assert set(c) == CASE_KEYS, c
            assert c["error"] is None and c["connected"] == c["peers"]
            assert len(c["rooms_per_s_runs"]) == 1 and c["rooms_per_s_runs"][0] == c["rooms_per_s"]  # --quick
            # The control pair (no idle peer) ran a round beside the measured one.
            assert c["control_rooms_per_s_runs"] == [c["control_rooms_per_s"]] and c["control_rooms_per_s"] > 0
            assert c["rate_over_control"] == pytest.approx(c["rooms_per_s"] / c["control_rooms_per_s"], rel=0.01)
            # Growth over the base (per peer) is a difference: pool workers that
            # retired, or a wake-up count, may dip below it.
            deltas = {"idle_wakeups_per_s_per_peer", "threads_per_peer", "fds_per_peer", "rss_kib_per_peer"}
            assert set(c["rss_split_kib_per_peer"]) == SPLIT_KEYS
            assert all(math.isfinite(v) for v in c["rss_split_kib_per_peer"].values()), c
            lists = {"rooms_per_s_runs", "control_rooms_per_s_runs"}
            for k in CASE_KEYS - {"error", "peers", "connected", "rss_split_kib_per_peer"} - lists - deltas:
                assert math.isfinite(c[k]) and c[k] >= 0, (k, c)
            for k in deltas & CASE_KEYS:
                assert math.isfinite(c[k]), (k, c)
            assert c["rooms_per_s"] > 0 and c["p50_us"] > 0
            assert c["threads"] > 0 and c["fds"] > 0
        assert r["cases"][0]["rate_over_1peer"] == 1.0
        assert r["cases"][0]["rate_over_1peer_controlled"] == 1.0
        # Idle past the close: each peer's ZeroMQ sockets (a connection and a
        # mailbox each way) are gone.
        after = r["after_idle_close"]
        assert after["peers"] == 8 and after["waited_s"] >= IDLE_S
        assert set(after["rss_split_kib_per_peer"]) == SPLIT_KEYS
        assert math.isfinite(after["rss_kib_per_peer"])
        assert after["fds_per_peer"] < r["cases"][-1]["fds_per_peer"], (after, r["cases"][-1])
        assert isinstance(r["thread_growth"], dict) and isinstance(r["fd_growth"], dict)


def test_one_transport_and_bad_counts():
    out = run("--transport", "tcp", "--peers", "2")
    assert [r["transport"] for r in out["runs"]] == ["tcp", "tcp"]
    for r in out["runs"]:
        assert [c["peers"] for c in r["cases"]] == [2] and r["cases"][0]["connected"] == 2
    p = subprocess.run([CLI, "bench", "peers", "--peers", "8,1"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "ascending" in p.stderr
