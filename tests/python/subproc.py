"""Helpers shared by the Python tests: a Python subprocess driven by lines on
stdin/stdout with every read bounded, and a free TCP port."""

import os
import select
import socket
import subprocess
import sys
import time


class Proc:
    """A Python subprocess driven by lines on stdin/stdout, every read bounded."""

    def __init__(self, script, args, env, tmp_path, line_timeout, finish_timeout, name):
        self.line_timeout = line_timeout
        self.finish_timeout = finish_timeout
        self.errpath = tmp_path / f"{name}.stderr"
        self.err = open(self.errpath, "wb")
        self.p = subprocess.Popen([sys.executable, "-c", script, *map(str, args)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=self.err, env=env, cwd=str(tmp_path))
        self.buf = b""

    def line(self, timeout=None):
        timeout = self.line_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                self.fail("no line within %.0fs" % timeout)
            ready, _, _ = select.select([self.p.stdout], [], [], left)
            if not ready:
                continue
            chunk = os.read(self.p.stdout.fileno(), 65536)
            if not chunk:
                try:
                    rc = self.p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    rc = None
                self.fail("closed its stdout (rc=%s)" % rc)
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode()

    def send(self, text):
        self.p.stdin.write((text + "\n").encode())
        self.p.stdin.flush()

    def cmd(self, text, timeout=None):
        """Send a line and return the one-line answer."""
        self.send(text)
        return self.line(timeout)

    def fail(self, why):
        self.kill()
        raise AssertionError(f"subprocess {why}; stderr:\n{self.errpath.read_text(errors='replace')[-4000:]}")

    def finish(self, timeout=None):
        """Close stdin and wait for a clean exit."""
        try:
            self.p.stdin.close()
        except OSError:
            pass
        try:
            rc = self.p.wait(timeout=self.finish_timeout if timeout is None else timeout)
        except subprocess.TimeoutExpired:
            self.fail("did not exit")
        assert rc == 0, f"rc={rc}; stderr:\n{self.errpath.read_text(errors='replace')[-4000:]}"

    def kill(self):
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait(timeout=10)
        for f in (self.p.stdin, self.p.stdout):
            try:
                f.close()
            except OSError:
                pass
        self.err.close()


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def poll_until(poll, done, limit, interval=0.005):
    """Call poll() until its value is in `done` or `limit` seconds passed; the last value."""
    deadline = time.monotonic() + limit
    v = poll()
    while v not in done and time.monotonic() < deadline:
        time.sleep(interval)
        v = poll()
    return v
