"""A seeded random fault run: N faults of the suite's kinds (SIGKILL and
SIGSTOP/SIGCONT of the prefill, the decode and the bootstrap server; hostile
ZMQ, HTTP and engine peers) interleaved with real transfers, rooms always in
flight. It reports faults injected, rooms Success / Failed, rooms hung (must
be 0), rooms reported Success with wrong bytes (must be 0: the decode checks
every byte of every room) and rooms left in the tables at the end (must be 0).

    make faults                                          # CI: N = FAULTS_N_CI
    KVFERRY_FAULTS_N=1000 python3 -m pytest -s tests/faults/test_random.py
    python3 -m pytest -s tests/faults/test_random.py --n 1000 --seed 7

Hostile peers connect from 127.0.0.2 (hostile.HOSTILE_SRC), as peers on
another host would."""

import json
import os
import random
import signal
import socket
import time

import zmq

from harness import ROOM_HANG_BOUND_S, SUCCESS, Cluster, describe, end_of_run, reap_all, report_run
from hostile import (HOSTILE_SRC, MALFORMED_M3, MALFORMED_PREFILL, D, chunk, closed_by_peer, connect, handshake, hello, i32, m1,
                     m2, m3)

FAULTS_N_CI = 12                 # faults in CI (the whole suite stays within a few minutes)
SEED_DEFAULT = 13
STOP_MIN_S, STOP_MAX_S = 0.2, 3.0  # how long a SIGSTOP lasts
GAP_MIN_S, GAP_MAX_S = 0.1, 0.6    # transfers between two faults
INFLIGHT = 4                     # rooms kept open
# A room not ended on its live sides this long after it started has hung: its
# own timeout, plus the longest stop that can delay it.
HUNG_AFTER_S = ROOM_HANG_BOUND_S + STOP_MAX_S
BURST = 50                       # messages or requests of one hostile burst
HTTP_TIMEOUT_S = 1.0             # each hostile HTTP exchange (the harness must keep reading its processes)
ZMQ_SEND_TIMEOUT_MS = 5000
PROGRESS_EVERY = 100             # a progress line every this many faults


def knob(config, opt, env, default):
    v = config.getoption(opt)
    if v is None:
        v = int(os.environ.get(env, default))
    return v


class Run:
    """The random run on a cluster (by default all on 127.0.0.1); hostile peers
    connect from `src` (None: the address the kernel picks)."""

    def __init__(self, tmp_path, rng, cluster=None, src=HOSTILE_SRC):
        self.tmp, self.rng, self.src = tmp_path, rng, src
        self.c = cluster or Cluster(tmp_path, "separate", rng)
        self.ctx = zmq.Context()
        self.faults = {}
        self.hung = set()
        self.t0 = time.monotonic()
        self.log = []  # (seconds since start, fault kind), for the report of a hung room

    def close(self):
        self.ctx.destroy(linger=0)

    # ---------------------------------------------------------------- process faults

    def kill(self, target):
        c = self.c
        p = c.target(target)
        p.sigkill()
        c.t.forget(p)
        if target == "bootstrap":
            # Let the decode's rooms of the unreachable server end before the prefill is replaced.
            c.t.settle(list(c.t.rooms.values()), HUNG_AFTER_S)
        c.restart(target)

    def stop(self, target):
        p = self.c.target(target)
        p.signal(signal.SIGSTOP)
        self.c.t.keep_busy(self.rng.uniform(STOP_MIN_S, STOP_MAX_S), INFLIGHT)
        p.signal(signal.SIGCONT)

    # ---------------------------------------------------------------- hostile peers

    def zmq_burst(self, proc, msgs):
        s = self.ctx.socket(zmq.PUSH)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDTIMEO, ZMQ_SEND_TIMEOUT_MS)
        src = f"{self.src[0]}:0;" if self.src else ""  # from the hostile peers' own address
        s.connect(f"tcp://{src}{proc.host}:{proc.control_port}")
        try:
            for _ in range(BURST):
                s.send_multipart(self.rng.choice(msgs))
                self.c.t.pump(0)
        except zmq.Again:
            pass
        s.close()

    def http_burst(self):
        host, port = self.c.addr.rsplit(":", 1)
        junk = [b"PUT /route HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n{{{{{",
                b"PUT /route HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999\r\n\r\n",
                b"GET /route?engine_rank=x&target_dp_group=0 HTTP/1.1\r\nHost: x\r\n\r\n",
                b"DELETE /route HTTP/1.1\r\nHost: x\r\n\r\n", b"\x00\x01garbage\r\n\r\n",
                b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"]
        for _ in range(BURST):
            self.c.t.pump(0)
            try:
                with connect(host, int(port), HTTP_TIMEOUT_S, src=self.src) as s:
                    s.sendall(self.rng.choice(junk))
                    s.shutdown(socket.SHUT_WR)
                    s.recv(4096)
            except OSError:
                pass

    def engine_attack(self):
        """Bad frames and out-of-range writes against the decode's engine, which
        holds the rooms' pages: a refused write must leave every room's bytes intact."""
        d = self.c.dec
        top = 1 << 63
        bad = [chunk([D(0x1000, 64)], b"\xee" * 64), chunk([D(top, 64)], b"\xee" * 64),
               chunk([D(0x1000, 8, 0)], total=0), chunk([], ndesc=0, total=0), b"\xde\xad" * 20]
        for _ in range(self.rng.randrange(1, 6)):
            self.c.t.pump(0)
            try:
                s = connect(d.host, d.engine_port, src=self.src)
                if handshake(s) == 0:
                    s.sendall(self.rng.choice(bad))
                    closed_by_peer(s, 0.2)
                s.close()
            except (OSError, AssertionError):
                pass
        for _ in range(20):
            try:
                s = connect(d.host, d.engine_port, src=self.src)
                s.sendall(hello()[: self.rng.randrange(16)])
                s.close()
            except OSError:
                pass

    def forged_m3(self):
        """Success for every open room, from a third party (issue 13 item 5)."""
        c = self.c
        forged = [m3(r.id, token=str(r.token).encode(), cands=i32(r.token + 1, r.token + 2))
                  for r in c.t.open_rooms()]
        if forged:
            self.zmq_burst(c.dec, forged)

    def early_m2(self):
        """Transfer requests for rooms no sender will have (issue 13 item 6)."""
        self.zmq_burst(self.c.pre, [m1()] + [m2(30_000_000 + self.rng.randrange(1 << 30))
                                                          for _ in range(BURST)])

    # ---------------------------------------------------------------- the run

    KINDS = ["kill-prefill", "kill-decode", "kill-bootstrap", "stop-prefill", "stop-decode", "stop-bootstrap",
             "zmq-decode", "zmq-prefill", "zmq-unknown-room", "zmq-forged-m3", "zmq-early-m2", "http", "engine"]

    def kinds(self):
        return self.KINDS

    def other_fault(self, action, target):
        """A fault kind a subclass adds; returns whether it was one."""
        return False

    def inject(self):
        c = self.c
        kind = self.rng.choice(self.kinds())
        at = round(time.monotonic() - self.t0, 1)
        action, _, target = kind.partition("-")
        if self.other_fault(action, target):
            pass
        elif action == "kill":
            self.kill(target)
        elif action == "stop":
            self.stop(target)
        elif kind == "zmq-decode":
            self.zmq_burst(c.dec, MALFORMED_M3)
        elif kind == "zmq-prefill":
            self.zmq_burst(c.pre, MALFORMED_PREFILL)
        elif kind == "zmq-unknown-room":
            self.zmq_burst(c.dec, [m3(40_000_000 + self.rng.randrange(1 << 20), status=s)
                                                for s in (0, SUCCESS)])
        elif kind == "http":
            self.http_burst()
        elif kind == "zmq-forged-m3":
            self.forged_m3()
        elif kind == "zmq-early-m2":
            self.early_m2()
        else:
            self.engine_attack()
        self.faults[kind] = self.faults.get(kind, 0) + 1
        self.log.append((at, kind))

    def check_hung(self):
        """A room is hung if it is still open HUNG_AFTER_S after it started, or if
        the decode's own stamp of its end is later than that."""
        self.c.t.pump(0.01)
        now = time.monotonic()
        for r in self.c.t.rooms.values():
            late = r.dec_t is not None and r.dec in (0, SUCCESS) and r.dec_t - r.t0 > HUNG_AFTER_S
            still_open = (r.dec is None or r.pre is None) and now - r.t0 > HUNG_AFTER_S
            if (late or still_open) and r.id not in self.hung:
                self.hung.add(r.id)
                at = r.t0 - self.t0
                near = [f for f in self.log if at - HUNG_AFTER_S <= f[0] <= at + HUNG_AFTER_S]
                print(f"hung: {describe([r])}, started at {at:.1f}s; faults around it: {near}")


def figures(run, seed, t0, leaked=None, dead=None):
    t = run.c.t
    c = t.counts()
    return {"seed": seed, "faults": sum(run.faults.values()), "by_kind": run.faults, "rooms": c["rooms"],
            "success": c["success"], "failed": c["failed"], "ended_with_a_killed_decode": c["lost"],
            "still_open": len(t.open_rooms()), "hung": len(run.hung), "wrong_bytes": len(t.wrong_bytes()),
            "leaked_rooms": leaked, "dead_processes": dead, "seconds": round(time.monotonic() - t0, 1)}


def test_random_faults(tmp_path, request):
    n = knob(request.config, "--n", "KVFERRY_FAULTS_N", FAULTS_N_CI)
    seed = knob(request.config, "--seed", "KVFERRY_FAULTS_SEED", SEED_DEFAULT)
    rng = random.Random(seed)
    run = Run(tmp_path, rng)
    t0 = time.monotonic()
    report = None
    try:
        for i in range(n):
            run.c.t.keep_busy(rng.uniform(GAP_MIN_S, GAP_MAX_S), INFLIGHT)
            run.inject()
            run.check_hung()
            run.c.t.compact()  # keep the bookkeeping small on long runs
            if (i + 1) % PROGRESS_EVERY == 0:
                print(f"random fault run, progress: {json.dumps(figures(run, seed, t0))}", flush=True)
        t = run.c.t
        settled, dead, leaked = end_of_run(run, HUNG_AFTER_S)
        report = figures(run, seed, t0, leaked, dead)
        assert settled and not run.hung, f"rooms hung: {sorted(run.hung)[:20]}"
        assert not t.wrong_bytes(), f"Success with wrong bytes: {describe(t.wrong_bytes())}"
        assert not dead, f"processes died: {dead}"
        assert leaked == 0
        assert t.counts()["success"] > 0
    finally:
        report = report or dict(figures(run, seed, t0), aborted=True)
        report_run("random fault run", report)
        run.close()
        reap_all()
