"""A network partition: the prefill (with its bootstrap server) and the decode
in two network namespaces made for the test (harness.Hosts: each joined by a
veth pair to a bridge in the root namespace); the prefill's link
is cut while rooms are in flight, then restored. Every room open at the cut
ends within the hang bound (none reports wrong bytes), both processes
survive, nothing is left in their tables, and once the link is back the pair
transfers again. Skipped with a message where namespaces cannot be made (not
root, no `ip`); the namespaces are deleted whatever happens."""

import time

import pytest

from harness import (ROOM_HANG_BOUND_S, SCHED_SLACK_S, SUCCESS, Decode, Prefill, Traffic, assert_no_leaks, describe,
                     transfers_again)

WARMUP_S = 2.0
INFLIGHT = 6
BLIP_S = 1.0                     # a cut shorter than every timeout: TCP retransmits carry the rooms over it
CUT_TRAFFIC_S = 2.0              # rooms are started during the first seconds of a long cut
# A cut longer than every timeout: every room open in it ends while it lasts.
LONG_CUT_S = CUT_TRAFFIC_S + ROOM_HANG_BOUND_S


@pytest.mark.parametrize("cut_s", [BLIP_S, LONG_CUT_S], ids=["blip", "long-cut"])
def test_partition(tmp_path, hosts, cut_s):
    h = hosts("a", "b")  # the prefill (with its bootstrap server) on a, the decode on b

    def cut():
        h.cut("a")

    def restore():
        h.restore("a")

    pre = Prefill(tmp_path, host=h.addr["a"], prefix=h.prefix("a"))
    dec = Decode(tmp_path, pre.bootstrap_addr, host=h.addr["b"], prefix=h.prefix("b"))
    t = Traffic()
    t.attach(pre, dec)
    t.keep_busy(WARMUP_S, INFLIGHT)
    assert any(r.dec == SUCCESS for r in t.rooms.values()), f"no room across the veth: {describe(t.rooms.values())}"
    t_cut = time.monotonic()
    cut()
    # Rooms keep starting while the link is down: each must end, on both sides.
    t.keep_busy(CUT_TRAFFIC_S if cut_s >= LONG_CUT_S else cut_s, INFLIGHT)
    at_cut = t.open_rooms()
    t.run_until(lambda: not t.open_rooms(at_cut), max(0.0, t_cut + cut_s - time.monotonic()))
    hung_during_cut = t.open_rooms(at_cut) if cut_s >= LONG_CUT_S else []
    restore()
    ended = t.settle(at_cut, max(0.0, t_cut + cut_s + ROOM_HANG_BOUND_S + SCHED_SLACK_S - time.monotonic()))
    took = max([max(r.dec_t or 0, r.pre_t or 0) - t_cut for r in at_cut] or [0])
    assert pre.alive() and dec.alive()
    assert not t.wrong_bytes(), f"Success with wrong bytes: {describe(t.wrong_bytes())}"
    assert ended, f"rooms hung across the partition: {describe(t.open_rooms(at_cut))}"
    assert not hung_during_cut, f"rooms did not end during a {cut_s}s cut: {describe(hung_during_cut)}"
    for r in at_cut:
        if r.dec == 0:
            assert r.reason not in ("", "-"), f"room {r.id} failed without a reason"
    transfers_again(t)
    assert_no_leaks([pre, dec])
    c = t.counts()
    print(f"partition {cut_s}s: {len(at_cut)} rooms open in the cut, last ended {took:.1f}s after it; {c}")
