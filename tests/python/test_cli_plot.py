"""`kvferry bench --plot FILE.svg --quick` on a machine with nothing but
kvferry: the plot is an SVG kvferry writes itself (no gnuplot), well-formed
XML holding the engine and end-to-end series against the same-run TCP
baseline. Asserts what is drawn, never how fast anything ran."""

import os
import re
import subprocess
import xml.etree.ElementTree as ET

import pytest

CLI = os.environ.get("KVFERRY_CLI", "")
SVG = "{http://www.w3.org/2000/svg}"

pytestmark = pytest.mark.skipif(not CLI or not os.path.exists(CLI), reason="KVFERRY_CLI not set")


def points(polyline):
    return [tuple(map(float, p.split(","))) for p in polyline.get("points").split()]


def test_plot_quick_writes_svg_without_gnuplot(tmp_path):
    out = tmp_path / "out.svg"
    # PATH without gnuplot (or anything else): the plot must not need it.
    env = dict(os.environ, PATH="/nonexistent")
    p = subprocess.run([CLI, "bench", "--plot", str(out), "--quick"], capture_output=True, text=True, timeout=240,
                       env=env, cwd=tmp_path)
    assert p.returncode == 0, f"stdout={p.stdout!r} stderr={p.stderr[-3000:]!r}"
    assert f"plot written to {out}" in p.stdout
    root = ET.parse(out).getroot()
    assert root.tag == SVG + "svg"
    lines = {pl.find(SVG + "title").text: pl for pl in root.iter(SVG + "polyline")}
    assert sorted(lines) == ["kvferry end to end (M2 -> Success)", "kvferry engine", "plain TCP stream (same run)"]
    series = [pl.find(SVG + "title").text for pl in root.iter(SVG + "polyline")]
    assert series.count("plain TCP stream (same run)") == 2  # one baseline per chart
    # Engine: blocks 4 KiB .. 1 MiB (x4); end to end (--quick): 256 .. 1024 tokens.
    assert len(points(lines["kvferry engine"])) == 5
    assert len(points(lines["kvferry end to end (M2 -> Success)"])) == 3
    texts = [t.text for t in root.iter(SVG + "text")]
    for tick in ("4 KiB", "64 KiB", "1 MiB", "256", "512", "1024", "GB/s"):
        assert tick in texts, tick
    # The progress lines name each measured point with a throughput.
    assert len(re.findall(r"engine +\d+ B blocks: [0-9.]+ GB/s", p.stderr)) == 5
    assert len(re.findall(r"e2e +\d+ tokens: [0-9.]+ GB/s", p.stderr)) == 3


def test_plot_refuses_other_formats_before_running(tmp_path):
    out = tmp_path / "out.png"
    p = subprocess.run([CLI, "bench", "--plot", str(out), "--quick"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 2
    assert "SVG" in p.stderr and ".svg" in p.stderr
    assert not out.exists()
