"""scripts/gpu/kv_device_memory.py, the KV check run on GPU machines
(scripts/gpu/README.md), kept working where there is no GPU: with host
memory on both sides it moves whole rooms byte-exact over kvferry's TCP and
over the default transport, and asked for CUDA without torch or a device it
says so and exits 77 (skipped), not 1."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "gpu", "kv_device_memory.py")


def run(*args, transport=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(ROOT, "python")
    env.pop("KVFERRY_TRANSPORT", None)
    cmd = [sys.executable, SCRIPT, "--requests", "3", "--pages", "16", "--timeout-s", "30", *args]
    if transport:
        cmd += ["--transport", transport]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=90)


@pytest.mark.parametrize("transport", ["tcp", None])
def test_host_memory_rooms_land_exact(transport):
    p = run("--device", "cpu", transport=transport)
    assert p.returncode == 0, p.stdout + p.stderr
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("{")][-1]
    out = json.loads(line)
    assert out["ok"] is True and out["requests_ok"] == 3, out


def test_cuda_without_a_gpu_is_a_skip():
    p = run("--device", "cuda")
    if p.returncode == 0:
        pytest.skip("this machine has torch and a CUDA device: the script ran for real")
    assert p.returncode == 77, p.stdout + p.stderr
    assert "SKIP" in p.stdout + p.stderr
