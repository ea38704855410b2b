"""Room traces and the /metrics histograms from Python (issue 25): a prefill
and a decode KVManager in this process over 127.0.0.1; each side's trace of a
room that succeeds and of one the prefill aborts, the ring walk, and the
managers' /metrics text (also as the bootstrap server's GET /metrics page)
parsed by the real Prometheus client parser."""

import os
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PYDIR = os.path.join(ROOT, "python")
if PYDIR not in sys.path:
    sys.path.insert(0, PYDIR)

from kvferry import BootstrapServer, KVManager, KVReceiver, KVSender, TransferPoll  # noqa: E402

from subproc import poll_until  # noqa: E402  (tests/python/subproc.py)

np = pytest.importorskip("numpy")
parser = pytest.importorskip("prometheus_client.parser")

FINAL = (TransferPoll.Success, TransferPoll.Failed)
PAGES, ITEM = 32, 512


def wait_final(handle, limit=15):
    return poll_until(handle.poll, FINAL, limit, 0.002)


@pytest.fixture
def pair():
    srv = BootstrapServer("127.0.0.1", 0)
    src = [np.full((PAGES, ITEM), b, np.uint8) for b in range(4)]
    dst = [np.zeros((PAGES, ITEM), np.uint8) for _ in range(4)]
    pm = KVManager("prefill", src, bootstrap_addr=srv.addr, trace_rooms=16)
    dm = KVManager("decode", dst)
    yield srv, pm, dm, dst
    dm.close()
    pm.close()
    srv.close()


def run_room(srv, pm, dm, room, abort=False):
    rx = KVReceiver(dm, srv.addr, room)
    rx.prefill(list(range(4)))
    tx = KVSender(pm, room)
    if abort:
        deadline = time.monotonic() + 10
        while tx.dest_info()[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.002)
        tx.abort("the scheduler gave up")
    else:
        tx.send([4, 5, 6, 7], is_last=True, bootstrap_token=9)
    d, p = wait_final(rx), wait_final(tx)
    rx.clear()
    tx.clear()
    return d, p


def finished(mgr, room, limit=5):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        t = mgr.trace(room)
        if t and t["finished"]:
            return t
        time.sleep(0.002)
    raise AssertionError(f"room {room}: no finished trace")


def in_order(steps, names):
    got = [steps[n] for n in names]
    assert got == sorted(got), (names, got)


def test_success_and_failure_traces_on_both_sides(pair):
    srv, pm, dm, _ = pair
    assert run_room(srv, pm, dm, 1) == (TransferPoll.Success, TransferPoll.Success)
    d, p = finished(dm, 1), finished(pm, 1)
    assert d["side"] == "decode" and p["side"] == "prefill"
    assert d["status"] == int(TransferPoll.Success)
    in_order(d["steps"], ["created", "discovery_done", "m1_sent", "m2_sent", "completion_seen", "final"])
    in_order(p["steps"], ["sender_created", "first_chunk_submitted", "first_byte_sent", "last_byte_done",
                          "completion_sent"])
    assert p["steps"]["m2_received"] <= p["steps"]["first_byte_sent"]
    assert p["bytes"] == 4 * 4 * ITEM and p["chunks"] == 1
    assert p["peers"][0]["peer"] == dm.session_id

    assert run_room(srv, pm, dm, 2, abort=True) == (TransferPoll.Failed, TransferPoll.Failed)
    d, p = finished(dm, 2), finished(pm, 2)
    assert d["status"] == int(TransferPoll.Failed) and p["status"] == int(TransferPoll.Failed)
    assert "the scheduler gave up" in p["reason"]
    assert "first_byte_sent" not in p["steps"] and "first_byte" not in d["steps"]
    in_order(d["steps"], ["created", "m2_sent", "completion_seen", "final"])

    rooms = [t["room"] for t in pm.traces()]
    assert rooms == [1, 2]  # the ring, oldest first
    assert [t["room"] for t in dm.traces(limit=1)] == [2]


def histograms(text):
    fams = {f.name: f for f in parser.text_string_to_metric_families(text)}
    return fams


def test_metrics_parse_with_the_prometheus_client(pair):
    srv, pm, dm, _ = pair
    for room in range(10, 13):
        assert run_room(srv, pm, dm, room) == (TransferPoll.Success, TransferPoll.Success)
    for mgr, role in ((dm, "decode"), (pm, "prefill")):
        fams = histograms(mgr.metrics())
        h = fams["kvferry_room_m2_to_success_seconds"]
        assert h.type == "histogram"
        buckets = [s for s in h.samples if s.name.endswith("_bucket")]
        assert all(s.labels["role"] == role for s in h.samples)
        les = [float(s.labels["le"]) for s in buckets]
        assert les == sorted(les) and les[-1] == float("inf")
        counts = [s.value for s in buckets]
        assert counts == sorted(counts)  # cumulative
        count = next(s.value for s in h.samples if s.name.endswith("_count"))
        total = next(s.value for s in h.samples if s.name.endswith("_sum"))
        assert count == 3 and counts[-1] == 3 and 0 < total < 30
        b = fams["kvferry_room_bytes"]
        assert next(s.value for s in b.samples if s.name.endswith("_sum")) == 3 * 4 * 4 * ITEM
        assert "kvferry_room_bandwidth_bytes_per_second" in fams
        assert ("kvferry_room_queue_wait_seconds" in fams) == (role == "prefill")
        # the counters are still there, untyped
        assert "kvferry_manager_rooms_created" in fams


def test_tracing_off():
    pm = KVManager("prefill", [np.zeros((4, 16), np.uint8)], trace_rooms=0)
    try:
        assert pm.trace(1) is None and pm.traces() == []
        assert "kvferry_room_" not in pm.metrics()
        with pytest.raises(Exception):
            pm.trace_enable(True)
    finally:
        pm.close()
