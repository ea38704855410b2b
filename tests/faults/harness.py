"""The fault suite's processes and bounds: a bootstrap server, a prefill
(`kvferry-testpeer kv-peer`) and a decode (`kvferry-testpeer kv-decode`) as real processes over
127.0.0.1 with kernel-chosen ports, each in its own process group so a test
can SIGKILL/SIGSTOP it and the fixtures can always reap it; and a Traffic
driver that keeps rooms in flight between them and records how each ends.

Every bound of the suite is a named constant here, derived from the
configuration the processes are given (ENV below)."""

import json
import os
import random
import re
import select
import shutil
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
from subproc import Proc  # noqa: E402  (tests/python/subproc.py)

CLI = os.path.abspath(os.environ.get("KVFERRY_CLI") or os.path.join(ROOT, "build", "kvferry"))
# The fixtures (kv-peer, kv-decode, engine-peer) are the test peer's, built next to kvferry.
TESTPEER = os.path.abspath(os.environ.get("KVFERRY_TESTPEER") or os.path.join(os.path.dirname(CLI), "kvferry-testpeer"))
TESTPEER_COMMANDS = ("kv-peer", "kv-decode", "engine-peer")

# ---------------------------------------------------------------- configuration and bounds

HEARTBEAT_INTERVAL_S = 2          # decode heartbeat interval (the library's minimum)
HEARTBEAT_MAX_FAILURES = 2        # failed probes before a prefill is declared dead
WAITING_TIMEOUT_S = 12            # decode: receiver waiting for its transfer after init
BOOTSTRAP_TIMEOUT_S = 12          # prefill: sender waiting for the decode's transfer request
ENGINE_TIMEOUT_MS = 8000          # engine batch deadline (KVFERRY_TIMEOUT_MS)
FAILED_SESSION_TTL_S = 5          # prefill: a decode session whose write failed is refused this long
HTTP_TIMEOUT_S = 5                # the manager's bootstrap HTTP timeout (kvf_manager_config default)
SCHED_SLACK_S = 3.0               # 2 cores shared with other jobs: scheduling margin on every bound

# Issue 13 item 1: the rooms of a dead prefill rank fail within
# interval x max_failures + 2 s, whether or not its bootstrap server lives.
DEAD_PREFILL_BOUND_S = HEARTBEAT_INTERVAL_S * HEARTBEAT_MAX_FAILURES + 2
# A room the peer stopped serving ends at the latest when its own timeout
# fires (waiting or bootstrap timeout) or a write in flight hits the engine
# deadline; past this it has hung.
ROOM_HANG_BOUND_S = max(WAITING_TIMEOUT_S, BOOTSTRAP_TIMEOUT_S) + ENGINE_TIMEOUT_MS / 1000 + SCHED_SLACK_S
# From restart/SIGCONT/reconnection to the first successful room: a write cut
# by the fault marks the decode session failed on the prefill for the
# failed-session TTL.
RECOVERY_BOUND_S = ROOM_HANG_BOUND_S + FAILED_SESSION_TTL_S
AFTER_ROOMS = 4                   # rooms that must all succeed once the system has recovered
LEAK_SETTLE_S = 5.0               # a live-room count reaches 0 this long after the last room ended
# A room on a healthy pair: well under the hang bound, generous for 2 loaded cores.
HEALTHY_ROOM_S = 10.0
LINE_TIMEOUT_S = 60               # a process's answer to one command (ready line, stats): a harness deadline

ENV = {
    "TOKENSPEED_DISAGGREGATION_HEARTBEAT_INTERVAL": str(HEARTBEAT_INTERVAL_S),
    "TOKENSPEED_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": str(HEARTBEAT_MAX_FAILURES),
    "TOKENSPEED_DISAGGREGATION_WAITING_TIMEOUT": str(WAITING_TIMEOUT_S),
    "TOKENSPEED_DISAGGREGATION_BOOTSTRAP_TIMEOUT": str(BOOTSTRAP_TIMEOUT_S),
    "TOKENSPEED_DISAGGREGATION_FAILED_SESSION_TTL": str(FAILED_SESSION_TTL_S),
    "KVFERRY_TIMEOUT_MS": str(ENGINE_TIMEOUT_MS),
    "KVFERRY_LOG_LEVEL": "info",  # the decode's control port is read from its log
}

# Room shape: 2 layers (K and V: 4 buffers) of 16 KiB pages; a room of
# PAGES_PER_ROOM pages moves 4 x 16 KiB x pages bytes.
ITEM = "16K"
POOL_PAGES = 2048
PAGES_PER_ROOM = 48
SUCCESS, FAILED = 5, 0


LIVE = []  # every process started, for the fixtures to reap


def reap_all():
    while LIVE:
        LIVE.pop().kill()


class Exe(Proc):
    """A kvferry (or kvferry-testpeer) subcommand driven by lines on stdin/stdout (subproc.Proc),
    in its own process group, with an optional `prefix` (ip netns exec ...)."""

    def __init__(self, args, tmp_path, name, env=None, prefix=()):
        self.line_timeout = LINE_TIMEOUT_S
        self.finish_timeout = 10
        self.name = name
        self.errpath = tmp_path / f"{name}.stderr"
        self.err = open(self.errpath, "wb")
        full_env = dict(os.environ)
        full_env.update(ENV)
        full_env.update(env or {})
        exe = TESTPEER if args and args[0] in TESTPEER_COMMANDS else CLI
        self.p = subprocess.Popen([*prefix, exe, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=self.err, env=full_env, cwd=str(tmp_path), start_new_session=True)
        LIVE.append(self)  # reaped after every test (conftest.py), even if this constructor fails
        self.trace = open(tmp_path / f"{name}.trace", "w")  # every line in and out, for post-mortems
        self.buf = b""
        self.stopped = False

    def alive(self):
        return self.p.poll() is None

    def sigkill(self):
        """SIGKILL the process group, reap it, close its pipes and files."""
        self.signal(signal.SIGKILL)
        self.p.wait(timeout=10)
        self.kill()

    def signal(self, sig):
        self.signal_trace(signal.Signals(sig).name)
        os.killpg(self.p.pid, sig)
        if sig == signal.SIGSTOP:
            self.stopped = True
        elif sig == signal.SIGCONT:
            self.stopped = False

    def kill(self):
        self.trace.close()
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        super().kill()

    def ready_lines(self, timeout):
        """The complete lines available within `timeout` seconds (maybe none)."""
        out = []
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf and self.p.stdout is not None and not self.p.stdout.closed:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            ready, _, _ = select.select([self.p.stdout], [], [], left)
            if not ready:
                break
            chunk = os.read(self.p.stdout.fileno(), 65536)
            if not chunk:
                break
            self.buf += chunk
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            out.append(line.decode())
            self.trace.write(f"{time.monotonic():.3f} < {out[-1]}\n")
        return out

    def send(self, text):
        self.trace.write(f"{time.monotonic():.3f} > {text}\n")
        super().send(text)

    def signal_trace(self, what):
        self.trace.write(f"{time.monotonic():.3f} ! {what}\n")
        self.trace.flush()

    def stderr_text(self):
        self.err.flush()
        return self.errpath.read_text(errors="replace")

    def ask(self, command, prefix):
        """Send a command and return the first answer line starting with
        `prefix`; lines of other kinds that arrive first go to self.others."""
        self.send(command)
        deadline = time.monotonic() + self.line_timeout
        while time.monotonic() < deadline:
            for ln in self.ready_lines(0.2):
                if ln.startswith(prefix):
                    return ln
                self.others.append(ln)
        self.fail(f"no answer to {command!r} within {self.line_timeout}s")

    others = None


class Bootstrap(Exe):
    def __init__(self, tmp_path, name="bootstrap", args=(), prefix=(), host="127.0.0.1", port=0, env=None):
        super().__init__(["bootstrap", "--host", host, "--port", str(port), *args], tmp_path, name, prefix=prefix,
                         env=env)
        m = re.match(r"kvferry bootstrap listening on (\S+)$", self.line())
        assert m, f"bad bootstrap ready line; stderr:\n{self.stderr_text()}"
        self.addr = m.group(1)


class KvProc(Exe):
    """kv-peer or kv-decode: the first line is "ready <addr>"; the rank's ZMQ
    control port comes from its info log; `stats` sums its managers' counters."""

    def __init__(self, args, tmp_path, name, role, prefix=(), env=None):
        super().__init__(args, tmp_path, name, prefix=prefix, env=env)
        self.others = []
        self.host = args[args.index("--host") + 1] if "--host" in args else "127.0.0.1"
        ln = self.line()
        assert ln.startswith("ready "), ln
        self.ready_addr = ln.split()[1]
        self.control_port = None
        for _ in range(50):
            m = re.search(role + r" manager rank 0: .* control port (\d+)", self.stderr_text())
            if m:
                self.control_port = int(m.group(1))
                break
            time.sleep(0.05)

    def stats(self):
        """[live rooms, messages received, malformed, unknown room]"""
        return [int(x) for x in self.ask("stats", "stats ").split()[1:]]


class Prefill(KvProc):
    """kv-peer; bootstrap=None starts a bootstrap server inside it."""

    def __init__(self, tmp_path, name="prefill", bootstrap=None, host="127.0.0.1", prefix=(), args=(), env=None):
        extra = ["--bootstrap", bootstrap] if bootstrap else []
        super().__init__(["kv-peer", "--item", ITEM, "--pages", str(POOL_PAGES), "--host", host, *extra, *args],
                         tmp_path, name, "prefill", prefix=prefix, env=env)
        self.bootstrap_addr = self.ready_addr


class Decode(KvProc):
    def __init__(self, tmp_path, bootstrap, name="decode", host="127.0.0.1", prefix=(), args=(), env=None):
        super().__init__(["kv-decode", "--item", ITEM, "--pages", str(POOL_PAGES), "--host", host,
                          "--bootstrap", bootstrap, *args], tmp_path, name, "decode", prefix=prefix, env=env)
        self.session = self.ready_addr
        self.host, self.engine_port = self.session.rsplit(":", 1)[0], int(self.session.rsplit(":", 1)[1])

    def quarantine(self):
        """The late-write check (--quarantine-ms): [pages held, pages checked, pages changed]."""
        return [int(x) for x in self.ask("quarantine", "quarantine ").split()[1:]]


class Room:
    __slots__ = ("id", "seed", "token", "t0", "dec", "pre", "dec_t", "pre_t", "bad", "reason", "pre_reason")

    def __init__(self, rid, seed, token):
        self.id, self.seed, self.token = rid, seed, token
        self.t0 = time.monotonic()
        self.dec = self.pre = None
        self.dec_t = self.pre_t = None
        self.bad = 0
        self.reason = self.pre_reason = ""


class Traffic:
    """Rooms between one prefill and one decode: each room is a `send` to the
    prefill and a `recv` to the decode (which checks every byte); pump()
    collects the `done` lines. A room whose process was killed is closed on
    that side by forget()."""

    def __init__(self, rng=None):
        self.rng = rng or random.Random(1)
        self.rooms = {}
        self.next_id = 1000
        self.pre = self.dec = None
        self.closed = {"rooms": 0, "success": 0, "failed": 0, "lost": 0}  # rooms dropped by compact()
        self.closed_wrong = []
        self.late = []  # the decode's "late-write" lines (pages of a Failed room written after its failure)

    def attach(self, pre, dec):
        self.pre, self.dec = pre, dec

    def start(self, n=1, pages=PAGES_PER_ROOM):
        made = []
        for _ in range(n):
            r = Room(self.next_id, self.rng.randrange(1, 1 << 40), self.rng.randrange(1, 1 << 20))
            self.next_id += 1
            self.rooms[r.id] = r
            # The decode's request first, as a scheduler usually does; the
            # prefill's senders wait for it within the bootstrap timeout.
            if self.dec and self.dec.alive() and not self.dec.stopped:
                self.dec.send(f"recv {r.id} {pages} {r.seed} {r.token}")
            else:
                r.dec, r.dec_t, r.reason = -1, r.t0, "decode-down"
            if self.pre and self.pre.alive() and not self.pre.stopped:
                self.pre.send(f"send {r.id} {pages} {r.seed} {r.token} 16")
            else:
                r.pre, r.pre_t, r.pre_reason = -1, r.t0, "prefill-down"
            made.append(r)
        return made

    def pump(self, timeout=0.05):
        now = time.monotonic
        for proc, is_dec in ((self.dec, True), (self.pre, False)):
            if not proc or proc.stopped or not proc.alive():
                continue
            lines = list(proc.others)
            proc.others.clear()
            lines += proc.ready_lines(timeout)
            for ln in lines:
                f = ln.split()
                if len(f) >= 3 and f[0] == "late-write":
                    self.late.append(ln)
                if len(f) < 2 or f[0] != "done":
                    continue
                r = self.rooms.get(int(f[1]))
                if r is None:
                    continue
                if is_dec:  # the decode's own CLOCK_MONOTONIC stamp of the end (Python's monotonic clock)
                    t_final = int(f[5]) / 1e9 if len(f) > 5 and int(f[5]) > 0 else now()
                    r.dec, r.dec_t, r.bad, r.reason = int(f[2]), t_final, int(f[3]), f[6] if len(f) > 6 else ""
                else:
                    r.pre, r.pre_t, r.pre_reason = int(f[2]), now(), " ".join(f[4:])

    def forget(self, proc):
        """`proc` was killed: its side of every open room is gone."""
        for r in self.rooms.values():
            if proc is self.dec and r.dec is None:
                r.dec, r.dec_t, r.reason = -1, time.monotonic(), "decode-killed"
            if proc is self.pre and r.pre is None:
                r.pre, r.pre_t, r.pre_reason = -1, time.monotonic(), "prefill-killed"

    def open_rooms(self, rooms=None):
        return [r for r in (rooms if rooms is not None else self.rooms.values()) if r.dec is None or r.pre is None]

    def run_until(self, cond, limit):
        """Pump until cond() or `limit` seconds; returns whether cond() held."""
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            self.pump(0.05)
            if cond():
                return True
        return cond()

    def settle(self, rooms, limit):
        """Wait up to `limit` s for every room of `rooms` to end on both live sides."""
        return self.run_until(lambda: not self.open_rooms(rooms), limit)

    def keep_busy(self, seconds, inflight=6):
        """Keep about `inflight` rooms open for `seconds`."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.pump(0.02)
            live = len(self.open_rooms())
            if live < inflight:
                self.start(inflight - live)

    @staticmethod
    def _wrong(r):
        return r.dec == SUCCESS and (r.bad or r.reason not in ("", "-"))

    def wrong_bytes(self):
        """Rooms the decode reported Success whose bytes or metadata were wrong."""
        return self.closed_wrong + [r for r in self.rooms.values() if self._wrong(r)]

    @staticmethod
    def _tally(c, rooms):
        for r in rooms:
            c["rooms"] += 1
            if r.dec == SUCCESS:
                c["success"] += 1
            elif r.dec == FAILED:
                c["failed"] += 1
            else:
                c["lost"] += 1  # the decode was killed or down: nobody to report it
        return c

    def counts(self):
        return self._tally(dict(self.closed), self.rooms.values())

    def compact(self):
        """Fold the rooms ended on both sides into the counts and forget them."""
        done = [r for r in self.rooms.values() if r.dec is not None and r.pre is not None]
        self._tally(self.closed, done)
        for r in done:
            if self._wrong(r):
                self.closed_wrong.append(r)
            del self.rooms[r.id]


class Cluster:
    """A bootstrap server (mode "separate") or none ("inproc": the prefill's),
    a prefill, a decode and the traffic between them. With `hosts` (a Hosts
    with roles "prefill", "decode" and maybe "bootstrap") each runs in its
    role's namespace (the bootstrap server in the prefill's without one);
    `env` goes to every process, `decode_args` to every decode."""

    def __init__(self, tmp_path, mode, rng=None, hosts=None, env=None, decode_args=()):
        self.tmp, self.mode = tmp_path, mode
        self.hosts, self.env, self.decode_args = hosts, dict(env or {}), tuple(decode_args)
        self.boot = self._bootstrap("bootstrap", 0) if mode == "separate" else None
        self.pre = self._prefill("prefill", bootstrap=self.boot.addr if self.boot else None)
        self.addr = self.pre.bootstrap_addr
        self.dec = self._decode("decode")
        self.t = Traffic(rng)
        self.t.attach(self.pre, self.dec)
        self.gen = 0

    def place(self, role):
        """Where `role` runs: {"prefix": ..., "host": ...} (127.0.0.1 without hosts)."""
        if not self.hosts:
            return {}
        if role == "bootstrap" and role not in self.hosts.addr:
            role = "prefill"
        return {"prefix": self.hosts.prefix(role), "host": self.hosts.addr[role]}

    def _bootstrap(self, name, port):
        return Bootstrap(self.tmp, name=name, port=port, env=self.env, **self.place("bootstrap"))

    def _prefill(self, name, bootstrap=None, args=()):
        return Prefill(self.tmp, name=name, bootstrap=bootstrap, args=args, env=self.env, **self.place("prefill"))

    def _decode(self, name):
        return Decode(self.tmp, self.addr, name=name, args=self.decode_args, env=self.env, **self.place("decode"))

    def target(self, name):
        return {"prefill": self.pre, "decode": self.dec, "bootstrap": self.boot}[name]

    def restart(self, name):
        """Start a fresh `name` on the address the others know."""
        self.gen += 1
        port = self.addr.rsplit(":", 1)[1]
        if name == "decode":
            self.dec = self._decode(f"decode{self.gen}")
        elif name == "prefill" and self.mode == "inproc":
            self.pre = self._prefill(f"prefill{self.gen}", args=["--bootstrap-port", port])
        elif name == "prefill":
            self.pre = self._prefill(f"prefill{self.gen}", bootstrap=self.addr)
        else:  # a new bootstrap server knows no ranks: the prefill registers again by restarting
            self.boot = self._bootstrap(f"bootstrap{self.gen}", int(port))
            self.pre.finish()
            self.pre.kill()  # closes its pipes and files (long runs restart hundreds of processes)
            self.t.forget(self.pre)
            self.pre = self._prefill(f"prefill{self.gen}", bootstrap=self.addr)
        self.t.attach(self.pre, self.dec)

    def survivors(self):
        return [p for p in (self.boot, self.pre, self.dec) if p is not None]


# ---------------------------------------------------------------- simulated hosts

IP = shutil.which("ip") or "/usr/sbin/ip"
NET = "10.214.{}.{}"             # addresses only on the bridge and in the namespaces Hosts makes
IP_TIMEOUT_S = 60                # one `ip` command (the kernel frees a deleted namespace lazily; a new one waits)


def ip(*args, check=True):
    return subprocess.run([IP, *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=check)


class HostsUnavailable(Exception):
    """This machine cannot make network namespaces (no root, no iproute2, no netns or veth)."""


class Hosts:
    """Simulated hosts: a network namespace per name, each joined by a veth
    pair to a bridge in the root namespace, which holds address .254 on it
    (hostile peers in the root namespace reach every host as another machine
    would). cut(name) takes the host's end of its link down: it is cut off
    from every other host and from the root namespace until restore(name).
    close() removes the namespaces and the bridge; no process may be left in
    them (the caller reaps first)."""

    _made = [0]

    def __init__(self, names):
        if os.geteuid() != 0 or not os.path.exists(IP):
            raise HostsUnavailable("needs root and iproute2 (`ip`) to make network namespaces")
        Hosts._made[0] += 1
        tag = f"{os.getpid() % 10000}{Hosts._made[0]}"
        used = ip("-4", "addr", "show", check=False).stdout
        subnet = next((n for n in ((os.getpid() + Hosts._made[0] + k) % 250 + 1 for k in range(250))
                       if NET.format(n, "") not in used), None)
        if subnet is None:
            raise HostsUnavailable("no free 10.214.x.0/24 subnet")
        self.names, self.ns, self.dev, self.addr, self.made = list(names), {}, {}, {}, []
        self.bridge = f"kvfbr{tag}"
        try:
            r = ip("link", "add", self.bridge, "type", "bridge", check=False)
            if r.returncode:
                raise HostsUnavailable(f"cannot make a bridge: {r.stderr.strip()}")
            self.made.append(("bridge", self.bridge))
            ip("addr", "add", NET.format(subnet, 254) + "/24", "dev", self.bridge)
            ip("link", "set", self.bridge, "up")
            for i, name in enumerate(self.names):
                ns, dev, peer = f"kvf{name[:3]}{tag}", f"kvf{i}{tag}v", f"kvf{i}{tag}r"
                r = ip("netns", "add", ns, check=False)
                if r.returncode:
                    raise HostsUnavailable(f"cannot make a network namespace: {r.stderr.strip()}")
                self.made.append(("netns", ns))
                ip("link", "add", dev, "type", "veth", "peer", "name", peer)
                # Gone with the namespace once dev is in it; else (a step below
                # failed) the pair stays in the root namespace unless deleted.
                self.made.append(("link", peer))
                ip("link", "set", dev, "netns", ns)
                ip("link", "set", peer, "master", self.bridge)
                ip("link", "set", peer, "up")
                self.ns[name], self.dev[name], self.addr[name] = ns, dev, NET.format(subnet, i + 1)
                ip("-n", ns, "addr", "add", f"{self.addr[name]}/24", "dev", dev)
                ip("-n", ns, "link", "set", "lo", "up")
                ip("-n", ns, "link", "set", dev, "up")
        except BaseException:
            self.close()
            raise

    def prefix(self, name):
        return ("ip", "netns", "exec", self.ns[name])

    def cut(self, name):
        ip("-n", self.ns[name], "link", "set", self.dev[name], "down")

    def restore(self, name):
        ip("-n", self.ns[name], "link", "set", self.dev[name], "up")

    def close(self):
        """Remove what was made; returns the namespaces that are still listed."""
        for kind, what in reversed(self.made):
            if kind == "netns":
                ip("netns", "del", what, check=False)
            else:
                ip("link", "del", what, check=False)
        listed = ip("netns", "list", check=False).stdout
        left = [ns for kind, ns in self.made if kind == "netns" and ns in listed]
        self.made = []
        return left


def describe(rooms, limit=8):
    return "; ".join(f"room {r.id}: decode={r.dec} ({r.reason}) prefill={r.pre} ({r.pre_reason})"
                     for r in list(rooms)[:limit])


def transfers_again(t):
    """Rooms started one by one until one succeeds (the decode may first have to
    notice the restarted peer), then AFTER_ROOMS rooms that must all succeed."""
    deadline = time.monotonic() + RECOVERY_BOUND_S
    ok = False
    while not ok and time.monotonic() < deadline:
        [r] = t.start(1)
        t.settle([r], min(HEALTHY_ROOM_S, max(0.5, deadline - time.monotonic())))
        ok = r.dec == SUCCESS and r.pre == SUCCESS
        if not ok:
            time.sleep(0.5)
    assert ok, f"no room succeeded within {RECOVERY_BOUND_S}s of recovery: {describe(list(t.rooms.values())[-4:])}"
    batch = t.start(AFTER_ROOMS)
    assert t.settle(batch, HEALTHY_ROOM_S), f"rooms hung after recovery: {describe(t.open_rooms(batch))}"
    bad = [r for r in batch if r.dec != SUCCESS or r.pre != SUCCESS]
    assert not bad, f"rooms failed after recovery: {describe(bad)}"


def assert_no_leaks(procs):
    for p in procs:
        if not hasattr(p, "stats"):
            continue
        deadline = time.monotonic() + LEAK_SETTLE_S
        live = p.stats()[0]
        while live and time.monotonic() < deadline:
            time.sleep(0.2)
            live = p.stats()[0]
        assert live == 0, f"{p.name}: {live} rooms left in its tables"


def end_of_run(run, hung_after_s):
    """The end of a random fault run (test_random.py's Run and its subclasses):
    every room settles or counts as hung, the processes that must survive are
    checked, transfers work again and neither side keeps a room in its tables.
    Returns (all settled, names of dead processes, rooms left in the tables)."""
    t = run.c.t
    settled = t.settle(list(t.rooms.values()), hung_after_s)
    run.check_hung()
    dead = [p.name for p in run.c.survivors() if not p.alive()]
    transfers_again(t)
    assert_no_leaks([run.c.pre, run.c.dec])
    leaked = sum(p.stats()[0] for p in (run.c.pre, run.c.dec))
    return settled, dead, leaked


def write_report(report, suffix=""):
    """A fault run's figures, as JSON, to $KVFERRY_FAULTS_REPORT (+ suffix) when that is set."""
    path = os.environ.get("KVFERRY_FAULTS_REPORT")
    if path:
        with open(path + suffix, "w") as f:
            json.dump(report, f, indent=1)


def report_run(what, report, suffix=""):
    """The end of a random fault run: its figures printed as `<what>: <json>` and written (write_report)."""
    print(f"{what}: {json.dumps(report)}", flush=True)
    write_report(report, suffix)
