"""Hostile ZMQ senders against a decode rank's and a prefill rank's control
sockets (PROTOCOL.md §3): malformed frames of every kind, floods, status
messages for rooms that do not exist, forged M3 status messages and a flood
of early transfer requests. The target counts the rejects, never dies, and
its legitimate rooms still succeed with every byte checked."""

import time

import pytest
import zmq

from hostile import HOSTILE_SRC, MALFORMED_M3, MALFORMED_PREFILL, i32, m1, m2, m3
from harness import HEALTHY_ROOM_S, PAGES_PER_ROOM, ROOM_HANG_BOUND_S, SUCCESS, Decode, Prefill, Traffic, describe

FLOOD_ROUNDS = 200           # each malformed message kind sent this many times
EARLY_M2_FLOOD = 5000        # issue 13 item 6: above the 4096 early rooms the prefill keeps
LEGIT_ROOMS = 4              # rooms that must succeed after each attack
DRAIN_S = 3.0                # for the target to consume a flood before its counters are read
SEND_TIMEOUT_MS = 5000       # every ZMQ send of the tests
FORGED_WAIT_S = 2.0          # time a forged M3 is given to (wrongly) take effect


@pytest.fixture
def pair(tmp_path):
    pre = Prefill(tmp_path)
    dec = Decode(tmp_path, pre.bootstrap_addr)
    assert pre.control_port and dec.control_port, "control ports not found in the info logs"
    t = Traffic()
    t.attach(pre, dec)
    ctx = zmq.Context()
    yield pre, dec, t, ctx
    ctx.destroy(linger=0)


def push(ctx, port):
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
    s.connect(f"tcp://{HOSTILE_SRC[0]}:0;127.0.0.1:{port}")  # from the hostile peers' own address
    return s


def legit_rooms_succeed(t, n=LEGIT_ROOMS):
    rooms = t.start(n)
    assert t.settle(rooms, HEALTHY_ROOM_S), f"rooms hung: {describe(t.open_rooms(rooms))}"
    bad = [r for r in rooms if r.dec != SUCCESS or r.pre != SUCCESS or r.bad]
    assert not bad, f"legitimate rooms failed: {describe(bad)}"


def test_malformed_and_unknown_room_floods(pair):
    """Malformed messages of every kind and well-formed ones for rooms that do
    not exist, in floods, at both ranks: counted, and legitimate rooms pass."""
    pre, dec, t, ctx = pair
    legit_rooms_succeed(t)
    d0, p0 = dec.stats(), pre.stats()
    to_dec, to_pre = push(ctx, dec.control_port), push(ctx, pre.control_port)
    for i in range(FLOOD_ROUNDS):
        for msg in MALFORMED_M3:
            to_dec.send_multipart(msg)
        for msg in MALFORMED_PREFILL:
            to_pre.send_multipart(msg)
        to_dec.send_multipart(m3(10_000_000 + i))             # Success for a room that is not live
        to_dec.send_multipart(m3(10_000_000 + i, status=0))   # Failed for one that is not live
        if i % 10 == 0:
            t.pump(0)
    time.sleep(DRAIN_S)
    legit_rooms_succeed(t)
    d1, p1 = dec.stats(), pre.stats()
    assert dec.alive() and pre.alive()
    # stats: live rooms, received, malformed, unknown room
    assert d1[2] - d0[2] >= FLOOD_ROUNDS * (len(MALFORMED_M3) - 1), (d0, d1)
    assert d1[3] - d0[3] >= FLOOD_ROUNDS, (d0, d1)
    assert p1[2] - p0[2] >= FLOOD_ROUNDS * (len(MALFORMED_PREFILL) - 2), (p0, p1)
    assert d1[0] == 0 and p1[0] == 0, "rooms left in the tables"
    assert not t.wrong_bytes()


@pytest.mark.parametrize("status", [SUCCESS, 0], ids=["forged-success", "forged-failed"])
def test_forged_status_is_ignored(pair, status):
    # issue 13 defect 5 (regression test); the defect was: the decode takes M3 from any ZMQ peer for any live room
    """A third party's M3 for a waiting room changes nothing: the room still
    succeeds, with the right bytes, once its real prefill sends."""
    pre, dec, t, ctx = pair
    legit_rooms_succeed(t, 1)
    pre_side, t.pre = t.pre, None            # the decode's request only: the room waits
    [room] = t.start(1)
    t.pre = pre_side
    time.sleep(0.5)
    forger = push(ctx, dec.control_port)
    forger.send_multipart(m3(room.id, status=status, token=str(room.token).encode(), cands=i32(room.token + 1,
                                                                                                 room.token + 2)))
    t.run_until(lambda: room.dec is not None, FORGED_WAIT_S)
    forged_effect = room.dec
    if room.dec is None:
        pre.send(f"send {room.id} {PAGES_PER_ROOM} {room.seed} {room.token} 16")
        t.run_until(lambda: room.dec is not None, HEALTHY_ROOM_S)
    assert dec.alive()
    assert forged_effect is None, f"a forged M3 ended the room: decode={room.dec} bad-pages={room.bad} ({room.reason})"
    assert room.dec == SUCCESS and not room.bad


def test_early_transfer_request_flood(pair):
    # issue 13 defect 6 (regression test); the defect was: a flood of early transfer requests makes legitimate rooms hang
    """EARLY_M2_FLOOD transfer requests for rooms no sender will ever have,
    then a legitimate room whose decode asks before its prefill sends: it
    succeeds, or fails at once with a reason, and never waits out a timeout."""
    pre, dec, t, ctx = pair
    legit_rooms_succeed(t, 1)
    flood = push(ctx, pre.control_port)
    flood.send_multipart(m1())                  # a registered (M1) decode session, as any peer can make
    for i in range(EARLY_M2_FLOOD):
        flood.send_multipart(m2(20_000_000 + i))
    time.sleep(DRAIN_S)
    pre_side, t.pre = t.pre, None
    rooms = t.start(LEGIT_ROOMS)                # decode first: early M2s of legitimate rooms
    t.pre = pre_side
    time.sleep(0.5)
    for r in rooms:
        pre.send(f"send {r.id} {PAGES_PER_ROOM} {r.seed} {r.token} 16")
    t0 = time.monotonic()
    t.settle(rooms, ROOM_HANG_BOUND_S)
    took = time.monotonic() - t0
    assert pre.alive() and dec.alive()
    assert not t.wrong_bytes()
    ok = all(r.dec == SUCCESS or (r.dec == 0 and r.reason not in ("", "-")) for r in rooms)
    assert ok and took <= HEALTHY_ROOM_S, f"after the flood: {describe(rooms)} ({took:.1f}s)"
