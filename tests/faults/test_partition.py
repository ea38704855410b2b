"""A network partition: the prefill (with its bootstrap server) and the decode
in two network namespaces made for the test, joined by a veth pair; the link
is cut while rooms are in flight, then restored. Every room open at the cut
ends within the hang bound (none reports wrong bytes), both processes
survive, nothing is left in their tables, and once the link is back the pair
transfers again. Skipped with a message where namespaces cannot be made (not
root, no `ip`); the namespaces are deleted whatever happens."""

import os
import shutil
import subprocess
import time

import pytest

from harness import (ROOM_HANG_BOUND_S, SCHED_SLACK_S, SUCCESS, Decode, Prefill, Traffic, assert_no_leaks, describe,
                     reap_all, transfers_again)

IP = shutil.which("ip") or "/usr/sbin/ip"
NET = "10.213.{}.{}"             # addresses only inside the namespaces this test makes
WARMUP_S = 2.0
INFLIGHT = 6
IP_TIMEOUT_S = 60                # one `ip` command (the kernel frees a deleted namespace lazily; a new one waits)
BLIP_S = 1.0                     # a cut shorter than every timeout: TCP retransmits carry the rooms over it
CUT_TRAFFIC_S = 2.0              # rooms are started during the first seconds of a long cut
# A cut longer than every timeout: every room open in it ends while it lasts.
LONG_CUT_S = CUT_TRAFFIC_S + ROOM_HANG_BOUND_S


def ip(*args, check=True):
    return subprocess.run([IP, *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=check)


_made = [0]  # namespaces made by this process, for unique names


@pytest.fixture
def netns():
    """Two namespaces joined by a veth pair: (prefix A, addr A, prefix B, addr B, cut, restore)."""
    if os.geteuid() != 0 or not os.path.exists(IP):
        pytest.skip("network partition: needs root and iproute2 (`ip`) to make network namespaces")
    _made[0] += 1
    tag = f"{os.getpid() % 10000}{_made[0]}"
    a, b = f"kvfa{tag}", f"kvfb{tag}"
    va, vb = f"kvfa{tag}v", f"kvfb{tag}v"
    subnet = (os.getpid() + _made[0]) % 250 + 1
    addr_a, addr_b = NET.format(subnet, 1), NET.format(subnet, 2)
    made = []
    try:
        for ns in (a, b):
            r = ip("netns", "add", ns, check=False)
            if r.returncode:
                pytest.skip(f"network partition: cannot make a network namespace: {r.stderr.strip()}")
            made.append(ns)
        ip("link", "add", va, "type", "veth", "peer", "name", vb)
        ip("link", "set", va, "netns", a)
        ip("link", "set", vb, "netns", b)
        for ns, dev, addr in ((a, va, addr_a), (b, vb, addr_b)):
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", ns, "link", "set", dev, "up")

        def cut():
            ip("-n", a, "link", "set", va, "down")

        def restore():
            ip("-n", a, "link", "set", va, "up")

        yield ("ip", "netns", "exec", a), addr_a, ("ip", "netns", "exec", b), addr_b, cut, restore
    finally:
        reap_all()  # no process may keep a namespace alive
        for ns in made:
            ip("netns", "del", ns, check=False)
        leftover = [ns for ns in made if ns in ip("netns", "list", check=False).stdout]
        assert not leftover, f"namespaces left behind: {leftover}"


@pytest.mark.parametrize("cut_s", [BLIP_S, LONG_CUT_S], ids=["blip", "long-cut"])
def test_partition(tmp_path, netns, cut_s):
    pa, addr_a, pb, addr_b, cut, restore = netns
    pre = Prefill(tmp_path, host=addr_a, prefix=pa)
    dec = Decode(tmp_path, pre.bootstrap_addr, host=addr_b, prefix=pb)
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
