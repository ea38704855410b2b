"""The platform floors of `kvferry bench` (bench/README.md, "Platform floors";
src/cli/bench_floor.c): measured in the same run as the figure each bounds,
with no kvferry code in between. Checks that they are there and sane, never a
speed:
- `bench e2e --verify`: the digest passes' cost (cold and hot), the plain
  pair's decode CPU per request, the cores, and cpu_floor_ratio >= 1;
- `bench layerwise --idle-compute`: copy_after_idle_ratio > 0 and
  hidden_ceiling in [0, 1] (-1 when --layer-ms sets the compute: no ceiling);
- `bench engine` over UCX: the private-memory cases carry cma2_gbps (two
  threads' process_vm_readv of the same blocks) and cma_ratio, the pool cases
  do not."""

import json
import math
import os
import subprocess

import pytest

CLI = os.environ.get("KVFERRY_CLI", "")

pytestmark = pytest.mark.skipif(not CLI or not os.path.exists(CLI), reason="KVFERRY_CLI not set")


def bench(*args, transport="auto", timeout=280):
    p = subprocess.run([CLI, "bench", *args, "--json", "--transport", transport], capture_output=True, text=True,
                       timeout=timeout)
    assert p.returncode == 0, f"stdout={p.stdout[-2000:]!r} stderr={p.stderr[-3000:]!r}"
    return json.loads(p.stdout)


def finite_positive(x):
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_verify_floor():
    out = bench("e2e", "--verify", "--quick", transport="tcp")
    v = out["verify"]
    for k in ("transfer_s_p50", "overhead_ratio", "hash_cold_ms", "hash_hot_ms", "plain_decode_cpu_ms"):
        assert finite_positive(v[k]), (k, v)
    assert v["cores"] >= 1 and v["cores"] == os.cpu_count(), v
    assert v["cpu_floor_ratio"] >= 1.0, v
    # The floor is what the copy and the digests need spread over every core.
    spread = (v["plain_decode_cpu_ms"] + v["hash_cold_ms"] + v["hash_hot_ms"]) / v["cores"]
    p50_ms = out["transfer_s_p50"] * 1e3
    assert abs(max(1.0, spread / p50_ms) - v["cpu_floor_ratio"]) < 0.01 + 0.01 * v["cpu_floor_ratio"], (v, p50_ms)


def test_layerwise_ceiling():
    out = bench("layerwise", "--idle-compute", "--quick", transport="tcp")
    assert finite_positive(out["copy_after_idle_ratio"]), out
    assert 0.0 <= out["hidden_ceiling"] <= 1.0, out
    r = out["copy_after_idle_ratio"]
    expect = min(1.0, max(0.0, 1 - (r - 1) - r / out["layers"]))
    assert abs(out["hidden_ceiling"] - expect) < 0.002, out
    fixed = bench("layerwise", "--idle-compute", "--quick", "--layer-ms", "0.5", transport="tcp")
    assert fixed["hidden_ceiling"] == -1.0 and fixed["copy_after_idle_ratio"] == 0.0, fixed


def test_engine_cma_floor():
    out = bench("engine", "--bytes", "64M", "--pool", "64M")
    if not any("mode" in c for c in out["cases"]):
        pytest.skip("auto is TCP here (built without UCX): no private memory over CMA")
    cases = {c["name"]: c for c in out["cases"]}
    private = [c for n, c in cases.items() if "_pool" not in n]
    pool = [c for n, c in cases.items() if "_pool" in n]
    assert private and pool, list(cases)
    for c in private:
        assert finite_positive(c["cma2_gbps"]) and finite_positive(c["cma_ratio"]), c
        assert abs(c["cma_ratio"] - c["gbps"] / c["cma2_gbps"]) < 0.01 + 0.01 * c["cma_ratio"], c
    for c in pool:
        assert "cma2_gbps" not in c, c
    assert "process_vm_readv" in out["cma2"]
