"""`kvferry trace FILE` on trace files written here by hand (the schema the
library writes under KVFERRY_TRACE=FILE): the summary's numbers, the clock
rule (durations only inside one record), bad lines counted by line number
and never fatal, and the --svg timeline as well-formed XML."""

import json
import os
import random
import subprocess
import xml.etree.ElementTree as ET

import pytest

CLI = os.environ.get("KVFERRY_CLI", "")
SVG = "{http://www.w3.org/2000/svg}"
TIMEOUT_S = 60

pytestmark = pytest.mark.skipif(not CLI or not os.path.exists(CLI), reason="KVFERRY_CLI not set")

DECODE_STEPS = ["created", "discovery_done", "m1_sent", "m2_sent", "first_byte", "last_byte", "completion_seen",
                "final"]
PREFILL_STEPS = ["m2_received", "sender_created", "first_chunk_submitted", "last_chunk_submitted",
                 "first_byte_sent", "last_byte_done", "completion_sent", "final"]


def record(side, room, steps, status="Success", reason=None, nbytes=1 << 20, t0=1_700_000_000_000_000_000):
    """One trace line; steps: [(name, t_ns)] in the order given."""
    return json.dumps({"v": 1, "side": side, "room": room, "engine": "127.0.0.1:17000", "rank": 0,
                       "status": status, "reason": reason, "t0_unix_ns": t0,
                       "steps": [{"name": n, "t_ns": t} for n, t in steps], "bytes": nbytes, "descs": 64,
                       "chunks": 1, "retries": 0,
                       "peers": [{"peer": "127.0.0.1:17001", "transport": "tcp", "mode": "tcp"}]})


def run_trace(path, *args):
    p = subprocess.run([CLI, "trace", str(path), *args], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert p.returncode == 0, f"rc={p.returncode} stdout={p.stdout!r} stderr={p.stderr!r}"
    return p


def summary(path, *args):
    return json.loads(run_trace(path, "--json", *args).stdout)


def step(side, name):
    found = [s for s in side["steps"] if s["name"] == name]
    assert len(found) == 1, (name, side["steps"])
    return found[0]


@pytest.fixture
def two_sides(tmp_path):
    """Rooms 1..10 on decode (room r: 1 ms x r between consecutive steps;
    room 3 failed), rooms 1..8 and 50 on prefill (0.5 ms between steps; its
    t0 is hours away from the decode's, which must not matter)."""
    lines = []
    for room in range(1, 11):
        failed = room == 3
        lines.append(record("decode", room, [(n, i * 1_000_000 * room) for i, n in enumerate(DECODE_STEPS)],
                            status="Failed" if failed else "Success",
                            reason="prefill rank dead <after 3 heartbeats> & gone" if failed else None))
    for room in list(range(1, 9)) + [50]:
        lines.append(record("prefill", room, [(n, i * 500_000) for i, n in enumerate(PREFILL_STEPS)],
                            t0=1_699_990_000_000_000_000))
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_counts_steps_and_totals(two_sides):
    s = summary(two_sides)
    assert (s["lines"], s["records"], s["bad_lines"]) == (19, 19, 0)
    d, p = s["sides"]["decode"], s["sides"]["prefill"]
    assert d["records"] == 10 and p["records"] == 9
    assert d["status"] == {"Success": 9, "Failed": 1} and p["status"] == {"Success": 9}
    # Steps in time order, whatever their names.
    assert [x["name"] for x in d["steps"]] == DECODE_STEPS
    assert [x["name"] for x in p["steps"]] == PREFILL_STEPS
    # Decode room r: r ms between steps; nearest-rank p50 of 1..10 is 5, p99 is 10.
    m1 = step(d, "m1_sent")
    assert m1["n"] == 10
    assert (m1["from_prev_p50_ms"], m1["from_prev_p99_ms"]) == (5.0, 10.0)
    assert (m1["from_first_p50_ms"], m1["from_first_p99_ms"]) == (10.0, 20.0)
    assert step(d, "created")["from_first_p99_ms"] == 0.0
    assert (d["total_p50_ms"], d["total_p99_ms"]) == (35.0, 70.0)
    assert (p["total_p50_ms"], p["total_p99_ms"]) == (3.5, 3.5)
    assert step(p, "last_byte_done")["from_prev_p50_ms"] == 0.5
    assert d["bytes_p50"] == 1 << 20
    # Honest bandwidth: bytes / (last byte - first byte) inside one record.
    # Prefill: 1 MiB in 0.5 ms; decode: the median room's (room 6) 1 MiB in 6 ms.
    assert p["bandwidth_p50_gbps"] == pytest.approx((1 << 20) / 0.5e6, rel=1e-4)
    assert d["bandwidth_p50_gbps"] == pytest.approx((1 << 20) / 6e6, rel=1e-4)
    assert d["bandwidth_records"] == 10 and not d["sampled"]


def test_failures_and_join_without_cross_host_subtraction(two_sides):
    s = summary(two_sides)
    assert s["failure_reasons"] == [{"side": "decode", "reason": "prefill rank dead <after 3 heartbeats> & gone",
                                     "count": 1}]
    j = s["joined"]
    assert (j["rooms"], j["decode_only"], j["prefill_only"]) == (8, 2, 1)
    rooms = {r["room"]: r for r in j["list"]}
    assert sorted(rooms) == list(range(1, 9))
    # Each side's own total, side by side: never one side's clock minus the other's.
    for room, r in rooms.items():
        assert r["decode_total_ms"] == pytest.approx(7.0 * room)
        assert r["prefill_total_ms"] == pytest.approx(3.5)


def test_text_summary(two_sides):
    out = run_trace(two_sides).stdout
    assert "19 records (decode 10, prefill 9), 0 bad lines" in out
    assert "decode   Success 9, Failed 1" in out
    assert "1  decode   prefill rank dead <after 3 heartbeats> & gone" in out
    assert "joined by room id: 8 rooms on both sides, 2 decode only, 1 prefill only" in out
    total = [ln.split() for ln in out.splitlines() if ln.strip().startswith("total, first to last step")]
    assert [t[-2:] for t in total] == [["35.000", "70.000"], ["3.500", "3.500"]]


def test_unknown_steps_out_of_order_and_top_reasons(tmp_path):
    """Unknown names are summarised too; steps are ordered by time, not by
    their place in the array; --top cuts the failure reasons, most first."""
    lines = []
    for room in range(4):
        steps = [("zz_last", 9_000_000), ("created", 0), ("warmup_custom", 2_000_000), ("final", 10_000_000)]
        status, reason = ("Failed", "timeout" if room else "refused") if room < 3 else ("Success", None)
        lines.append(record("decode", room, steps, status=status, reason=reason))
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    s = summary(path, "--top", "1")
    d = s["sides"]["decode"]
    assert [x["name"] for x in d["steps"]] == ["created", "warmup_custom", "zz_last", "final"]
    assert step(d, "zz_last")["from_prev_p50_ms"] == 7.0
    assert d["total_p50_ms"] == 10.0
    assert d["bandwidth_records"] == 0 and d["bandwidth_p50_gbps"] is None  # no first/last byte steps
    assert s["failure_reasons"] == [{"side": "decode", "reason": "timeout", "count": 2}]
    assert s["distinct_failure_reasons"] == 2


def test_bad_lines_counted_by_number_never_fatal(tmp_path):
    """Truncated records, random bytes, wrong types and a huge line among
    good records: each bad line counted and (the first 20) listed with its
    number; every good record still summarised."""
    rng = random.Random(25)
    good = record("decode", 7, [(n, i * 1000) for i, n in enumerate(DECODE_STEPS)])
    lines, bad_at = [], []
    wrong = ['{"v":2,"side":"decode","room":1,"status":"Success","steps":[]}',
             '{"v":1,"side":"both","room":1,"status":"Success","steps":[]}',
             '{"v":1,"side":"decode","room":-4,"status":"Success","steps":[]}',
             '{"v":1,"side":"decode","room":1,"status":"Success","steps":[{"name":"x","t_ns":"5"}]}',
             '{"v":1,"side":"decode","room":1,"status":"Success","steps":{}}',
             '{"v":1,"side":"decode","room":1,"status":"Success","steps":[{"name":"x","t_ns":-9000000000000000000},'
             '{"name":"y","t_ns":9000000000000000000}]}',
             '{"v":1,"side":"decode","room":1,"status":7,"steps":[]}',
             '[1,2,3]', '"just a string"', "x" * 100_000]
    for i in range(300):
        kind = rng.randrange(4)
        if kind == 0:
            lines.append(good)
            continue
        if kind == 1:
            line = good[:rng.randrange(1, len(good) - 1)]
        elif kind == 2:
            line = "#" + "".join(chr(rng.choice([c for c in range(1, 256) if c != 10])) for _ in range(rng.randrange(60)))
        else:
            line = rng.choice(wrong)
        lines.append(line)
        bad_at.append(len(lines))
    path = tmp_path / "bad.jsonl"
    # The last line is truncated with no newline, as a crash mid-write leaves it.
    path.write_bytes(("\n".join(lines) + "\n" + good[:40]).encode("utf-8", "surrogateescape"))
    bad_at.append(len(lines) + 1)
    s = summary(path)
    assert s["bad_lines"] == len(bad_at)
    assert s["records"] == len(lines) + 1 - len(bad_at)
    assert [b["line"] for b in s["bad"]] == bad_at[:20]
    assert all(b["error"] for b in s["bad"])
    assert s["sides"]["decode"]["records"] == s["records"]
    out = run_trace(path).stdout
    assert f"line {bad_at[0]}: " in out and f"({len(bad_at) - 20} more bad lines not listed)" in out


def test_empty_and_missing_files(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    s = summary(empty)
    assert (s["records"], s["bad_lines"], s["sides"]["decode"]["total_p50_ms"]) == (0, 0, None)
    p = subprocess.run([CLI, "trace", str(tmp_path / "missing.jsonl")], capture_output=True, text=True,
                       timeout=TIMEOUT_S)
    assert p.returncode == 1 and "cannot open" in p.stderr
    p = subprocess.run([CLI, "trace"], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert p.returncode == 2 and "usage: kvferry trace" in p.stderr


def svg_root(path):
    root = ET.parse(path).getroot()  # raises on anything that is not well-formed XML
    assert root.tag == SVG + "svg"
    return root


def test_svg_timeline(two_sides, tmp_path):
    out = tmp_path / "timeline & <rows>.svg"
    p = run_trace(two_sides, "--svg", str(out))
    assert f"timeline written to {out}" in p.stdout
    root = svg_root(out)
    texts = [t.text for t in root.iter(SVG + "text")]
    labels = [t for t in texts if t and (t.startswith("decode room") or t.startswith("prefill room"))]
    assert len(labels) == 19 and "decode room 1 rank 0" in labels
    assert "all 19 records" in texts
    legend = {t[len("until "):] for t in texts if t and t.startswith("until ")}
    assert legend == set(DECODE_STEPS) | set(PREFILL_STEPS)
    # One segment per step after the first, each titled with its step name.
    segs = [r for r in root.iter(SVG + "rect") if r.find(SVG + "title") is not None]
    assert len(segs) == 19 * 7
    assert any(r.find(SVG + "title").text.startswith("m1_sent: +3.000 ms") for r in segs)


def test_svg_timeline_is_bounded(tmp_path):
    path = tmp_path / "many.jsonl"
    path.write_text("".join(record("prefill", r, [(n, i * 1000) for i, n in enumerate(PREFILL_STEPS)]) + "\n"
                            for r in range(450)))
    out = tmp_path / "many.svg"
    run_trace(path, "--svg", str(out), "--json")
    texts = [t.text for t in svg_root(out).iter(SVG + "text")]
    assert sum(1 for t in texts if t and t.startswith("prefill room")) == 200
    assert "showing the first 200 of 450 records (truncated at 200 rows)" in texts


def test_odd_names_and_bytes_stay_printable(tmp_path):
    """Control characters, names cut inside a multibyte character by the
    kept length, and raw bytes that are not UTF-8: the JSON summary still
    has every entry (jansson refuses invalid UTF-8) and the text has no
    control characters."""
    long_name = "é" * 40  # 80 bytes: cut inside a character
    lines = [record("decode", 1, [("créé\tlà", 0), (long_name, 1000), ("fin\u0007al", 2000)], status="Failed\n",
                    reason="line one\nline two \u0001 " + "ü" * 150).encode(),
             b'{"v":1,"side":"decode","room":2,"status":"\xff\xfe","steps":[]}',
             b"\xff\xfe\xc3 not json at all",
             b'{"v":1,"side":"decode","room":3,"status":"Success","steps":[{"name":"\xc3\x28","t_ns":0}]}']
    path = tmp_path / "odd.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    s = summary(path)
    assert (s["records"], s["bad_lines"]) == (1, 3)
    assert len(s["bad"]) == 3 and all(b["error"] for b in s["bad"])
    d = s["sides"]["decode"]
    assert [x["name"] for x in d["steps"]] == ["créé?là", "é" * 23 + "?", "fin?al"]
    assert d["status"] == {"Failed?": 1}
    assert len(s["failure_reasons"]) == 1 and s["failure_reasons"][0]["reason"].startswith("line one?line two ? üü")
    out = run_trace(path).stdout
    assert not any(ord(c) < 0x20 and c not in "\n\t" for c in out)
