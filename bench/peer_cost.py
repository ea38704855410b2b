#!/usr/bin/env python3
"""What each idle peer costs a target engine: threads, file descriptors and
resident memory of the target's process, before and after N writer engines
(all in one other process) wrote one page to it and went idle.

    KVFERRY_LIB=build/libkvferry.so python3 bench/peer_cost.py --peers 64 --transport ucx

Prints one line per transport: the target's counts before and after, and
the difference per peer. Workers started while the peers connected retire
after a while; --settle-s waits for that before counting.
"""
import argparse
import ctypes
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import kvferry  # noqa: E402


def counts(pid):
    threads = len(os.listdir(f"/proc/{pid}/task"))
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
    return threads, fds, rss


def target(transport):
    e = kvferry.TransferEngine()
    e.initialize("127.0.0.1", protocol=transport)
    buf = e.allocate_managed_buffer(1 << 20)
    print(e.get_session_id(), buf, flush=True)
    for line in sys.stdin:
        if line.strip() == "quit":
            break
    e.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--peers", type=int, default=64)
    ap.add_argument("--transport", default="ucx", help="rdma (UCX) or tcp, as TransferEngine.initialize takes")
    ap.add_argument("--settle-s", type=float, default=3.0)
    ap.add_argument("--target", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.target:
        target(a.transport)
        return
    proto = "rdma" if a.transport == "ucx" else a.transport
    t = subprocess.Popen([sys.executable, __file__, "--target", "--transport", proto], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    session, base = t.stdout.readline().split()
    base = int(base)
    time.sleep(a.settle_s)
    before = counts(t.pid)
    page = ctypes.create_string_buffer(4096)
    writers = []
    for i in range(a.peers):
        w = kvferry.TransferEngine()
        w.initialize("127.0.0.1", protocol=proto)
        w.register_memory(ctypes.addressof(page), 4096)
        w.transfer_sync_write(session, ctypes.addressof(page), base + (i % 256) * 4096, 4096)
        writers.append(w)
    time.sleep(a.settle_s)
    after = counts(t.pid)
    n = a.peers
    print(f"{a.transport}: {n} idle peers: target threads {before[0]} -> {after[0]} "
          f"({(after[0] - before[0]) / n:.2f}/peer), fds {before[1]} -> {after[1]} "
          f"({(after[1] - before[1]) / n:.2f}/peer), RSS {before[2]} -> {after[2]} KiB "
          f"({(after[2] - before[2]) / n:.1f} KiB/peer)", flush=True)
    for w in writers:
        w.close()
    t.stdin.write("quit\n")
    t.stdin.close()
    t.wait(timeout=60)


if __name__ == "__main__":
    main()
