"""`kvferry bench rooms --fanout-only --quick --json` (issue 22, fan-out): only
the fan-out cases run, MLA prefill TP 1 to decode TP 1 (the baseline), 2, 4
and 8, and prefill TP 4 to decode TP 1, each a bootstrap + prefill + decode
trio. Checks the JSON's shape and that every request of every case
succeeded (the bench fails otherwise), never a speed: the figures (latency,
and the CPU both processes of a case ran per request) are only required to
be there and sane."""

import json
import math
import os
import subprocess

import pytest

CLI = os.environ.get("KVFERRY_CLI", "")

pytestmark = pytest.mark.skipif(not CLI or not os.path.exists(CLI), reason="KVFERRY_CLI not set")

CASES = [("fanout_1to1_base", 1, 1), ("fanout_1to2_mla", 1, 2), ("fanout_1to4_mla", 1, 4),
         ("fanout_1to8_mla", 1, 8), ("fanout_4to1_mla", 4, 1)]
CASE_KEYS = {"name", "prefill_tp", "decode_tp", "p50_us", "p99_us", "p50_over_base", "req_p50_us",
             "req_p50_over_base", "cpu_us_per_request", "cpu_over_base"}


def run(*args, timeout=240):
    return subprocess.run([CLI, "bench", "rooms", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_fanout_only_json(transport):
    p = run("--fanout-only", "--quick", "--json", "--transport", transport)
    assert p.returncode == 0, f"stdout={p.stdout[-2000:]!r} stderr={p.stderr[-3000:]!r}"
    out = json.loads(p.stdout)
    assert out["bench"] == "rooms"
    assert out["cases"] == []  # no rooms case, and none of their baselines
    assert "trace_overhead_ratio" not in out
    fo = out["fanout"]
    assert fo["bytes_per_dest"] > 0 and fo["pages"] > fo["chunk_pages"] > 0
    assert [(c["name"], c["prefill_tp"], c["decode_tp"]) for c in fo["cases"]] == CASES
    for c in fo["cases"]:
        assert set(c) == CASE_KEYS, c
        for k in CASE_KEYS - {"name", "prefill_tp", "decode_tp"}:
            assert math.isfinite(c[k]) and c[k] > 0, (k, c)
        assert c["p99_us"] >= c["p50_us"]
    assert fo["cases"][0]["p50_over_base"] == 1.0
    assert fo["cases"][0]["cpu_over_base"] == 1.0


def test_fanout_only_text_and_usage():
    p = run("--fanout-only", "--quick", "--transport", "tcp")
    assert p.returncode == 0, p.stderr[-3000:]
    for name, _, _ in CASES:
        assert name in p.stdout
    assert "rooms_1page_inflight1" not in p.stdout
    u = subprocess.run([CLI, "bench", "--help"], capture_output=True, text=True, timeout=30)
    assert u.returncode == 0 and "--fanout-only" in u.stdout
