#!/usr/bin/env python3
"""KV transfers whose KV buffers live in GPU memory (or host memory, to test the script).

One process holds a prefill and a decode KVManager (2 x --layers MHA buffers each,
--page-bytes per page) and a BootstrapServer on a free 127.0.0.1 port. Each of
--requests requests moves --pages scattered prefill pages onto scattered decode pages
(KVReceiver.prefill + KVSender.send, both polled to Success); the decode pages are then
compared byte-exactly with the prefill pages (torch.equal on the GPU when both sides are
CUDA), the first token is checked, and at the end no decode page outside the requests'
destinations may be non-zero. Pools: torch.zeros(..., device="cuda") passed by
data_ptr() with explicit lengths, or ctypes host memory for --device cpu (no numpy or
torch needed). The prefill pattern is made on the pool's device.

Run (from the repository root):
  PYTHONPATH=python KVFERRY_LIB=build/libkvferry.so python3 scripts/gpu/kv_device_memory.py
  ... --device cpu                      # host memory on both sides (no GPU needed)
  ... --prefill-device cpu --decode-device cuda --transport ucx

Prints one JSON line; exit 0 when every request arrived byte-exact, 1 on any failure
or mismatch, 77 when a CUDA side is asked for but torch or a CUDA device is missing.
The whole run is bounded by --timeout-s (a watchdog kills it 30 s after that).
"""

import argparse
import ctypes
import faulthandler
import json
import os
import random
import select
import sys
import time


class HostPool:
    """pages_total x page_bytes per buffer in ctypes host memory (zeroed)."""

    def __init__(self, nbuf, pages_total, page_bytes):
        self.pb, self.n = page_bytes, pages_total
        self.raw = [bytearray(pages_total * page_bytes) for _ in range(nbuf)]
        self.ptrs = [ctypes.addressof((ctypes.c_uint8 * len(a)).from_buffer(a)) for a in self.raw]
        self.mv = [memoryview(a) for a in self.raw]

    def fill(self, owner):
        """byte i of page p of buffer b: (i*m + (i>>8)*n + c) & 255 with (m, n, c) from
        (b, p, owning request), after a header of p (4 bytes LE), b, request."""
        add = [bytes((x + a) & 255 for x in range(256)) for a in range(256)]
        nblk = (self.pb + 255) // 256
        for b, mv in enumerate(self.mv):
            for p in range(self.n):
                k = p * 2654435761 + b * 40503 + (owner[p] + 1) * 9973 + 12345  # as CudaPool.fill
                m, n, c = ((k >> 3) & 127) * 2 + 1, ((k >> 11) & 255) | 1, (k >> 19) & 255
                t = bytes((x * m) & 255 for x in range(256))
                page = b"".join(t.translate(add[(j * n + c) & 255]) for j in range(nblk))[:self.pb]
                hdr = p.to_bytes(4, "little") + bytes([b & 255, owner[p] & 255])
                mv[p * self.pb:(p + 1) * self.pb] = hdr + page[len(hdr):]

    def gather(self, b, pages):
        return b"".join(self.mv[b][p * self.pb:(p + 1) * self.pb] for p in pages)

    def nonzero_pages(self, b):
        zero = bytes(self.pb)
        return {p for p in range(self.n) if self.mv[b][p * self.pb:(p + 1) * self.pb] != zero}

    def synchronize(self):
        pass


class CudaPool:
    """pages_total x page_bytes per buffer: a uint8 torch tensor on the GPU (zeroed)."""

    def __init__(self, torch, nbuf, pages_total, page_bytes):
        self.torch, self.pb, self.n = torch, page_bytes, pages_total
        self.t = [torch.zeros((pages_total, page_bytes), dtype=torch.uint8, device="cuda") for _ in range(nbuf)]
        self.ptrs = [t.data_ptr() for t in self.t]

    def fill(self, owner):
        torch = self.torch
        i = torch.arange(self.pb, dtype=torch.int64, device="cuda")
        own = torch.tensor(owner, dtype=torch.int64, device="cuda")
        pg = torch.arange(self.n, dtype=torch.int64, device="cuda")
        for b, t in enumerate(self.t):
            k = pg * 2654435761 + b * 40503 + (own + 1) * 9973 + 12345
            m, n, c = ((k >> 3) & 127) * 2 + 1, ((k >> 11) & 255) | 1, (k >> 19) & 255
            for lo in range(0, self.n, 64):  # 64 pages at a time bounds the int64 temporary
                s = slice(lo, min(lo + 64, self.n))
                v = i[None] * m[s, None] + (i >> 8)[None] * n[s, None] + c[s, None]
                t[s] = (v & 255).to(torch.uint8)
            for j in range(4):
                t[:, j] = ((pg >> (8 * j)) & 255).to(torch.uint8)
            t[:, 4], t[:, 5] = b & 255, (own & 255).to(torch.uint8)
        torch.cuda.synchronize()

    def index(self, pages):
        return self.torch.tensor(pages, dtype=self.torch.int64, device="cuda")

    def gather(self, b, pages):
        host = self.t[b].index_select(0, self.index(pages)).cpu().contiguous()
        return ctypes.string_at(host.data_ptr(), host.numel())

    def nonzero_pages(self, b):
        return set((self.t[b] != 0).any(dim=1).nonzero().flatten().tolist())

    def synchronize(self):
        self.torch.cuda.synchronize()


def same_pages(src, sp, dst, dp, b):
    """True, or (page index in the request, byte offset) of the first difference."""
    if isinstance(src, CudaPool) and isinstance(dst, CudaPool):
        if src.torch.equal(src.t[b].index_select(0, src.index(sp)), dst.t[b].index_select(0, dst.index(dp))):
            return True
    a, d = src.gather(b, sp), dst.gather(b, dp)
    if a == d:
        return True
    off = next(i for i in range(len(a)) if a[i] != d[i])
    return off // src.pb, off % src.pb


def transfer(args, kvferry, src, dst, plan, out):
    """Every request in turn; returns (failures, mismatches, ok_rooms, bytes moved, seconds)."""
    from kvferry import BootstrapServer, KVManager, KVReceiver, KVSender, TransferPoll as TP
    from kvferry._lib import lib
    src_of, dst_of, deadline = plan
    nbuf, pb, n = len(src.ptrs), args.page_bytes, src.n
    failures, mismatches, ok_rooms, moved, busy = [], [], [], 0, 0.0
    ms = int(args.timeout_s * 1000)
    common = dict(host="127.0.0.1", page_size=16, transfer_timeout_ms=ms, http_timeout_ms=min(ms, 10000))
    with BootstrapServer("127.0.0.1", 0) as srv, \
            KVManager("prefill", src.ptrs, [n * pb] * nbuf, [pb] * nbuf, bootstrap_addr=srv.addr, **common) as pm, \
            KVManager("decode", dst.ptrs, [n * pb] * nbuf, [pb] * nbuf, **common) as dm:

        def wait(handles, want):
            """Poll until every handle is at `want` or Failed; once one failed, the others get 2 s to end too."""
            fds, end = [dm.event_fd(), pm.event_fd()], deadline
            while True:
                dm.event_clear(), pm.event_clear()
                sts = [h.poll() for h in handles]
                if TP.Failed in sts:
                    end = min(end, time.monotonic() + 2)
                left = end - time.monotonic()
                if all(s >= want or s == TP.Failed for s in sts) or left <= 0:
                    return sts
                select.select(fds, [], [], min(left, 0.05))

        room0 = random.Random(args.seed).randrange(1 << 40)
        for r, (sp, dp) in enumerate(zip(src_of, dst_of)):
            room, rcv, snd, stage, token = room0 + r, None, None, "bootstrap", 1000 + r
            if time.monotonic() >= deadline:
                failures.append({"request": r, "room": room, "stage": "not run", "reason": "out of time"})
                continue
            try:
                rcv, snd = KVReceiver(dm, srv.addr, room), KVSender(pm, room)
                sts = wait([rcv], TP.Bootstrapped)
                if sts[0] >= TP.Bootstrapped:
                    stage, t0 = "transfer", time.monotonic()
                    rcv.prefill(dp, aux_index=0)
                    snd.send(sp, is_last=True, aux_index=0, bootstrap_token=token)
                    sts = wait([rcv, snd], TP.Success)
                    busy += time.monotonic() - t0
                if sts != [TP.Success] * 2:
                    f = {"request": r, "room": room, "stage": stage}
                    for side, h in (("decode", rcv), ("prefill", snd)):
                        st = h.poll()
                        f[side] = (h.failure_reason() or "Failed, no reason recorded") if st == TP.Failed \
                            else f"{st.name} when the wait ended"
                    failures.append(f)
                    if snd.poll() not in (TP.Success, TP.Failed):
                        snd.abort("kv_device_memory: timed out")
                    continue
                dm.sync()  # Success: order the engine's writes before reading the pages
                dst.synchronize()
                moved += len(sp) * nbuf * pb
                ok_rooms.append(room)
                for b in range(nbuf):
                    same = same_pages(src, sp, dst, dp, b)
                    if same is not True:
                        mismatches.append({"request": r, "buffer": b, "src_page": sp[same[0]], "dst_page": dp[same[0]],
                                           "byte": same[1]})
                        break
                got = rcv.pop_metadata()[0]
                if got != token:
                    mismatches.append({"request": r, "first_token": got, "want": token})
            except (kvferry.KVFError, kvferry.KVTransferError, RuntimeError) as e:
                failures.append({"request": r, "room": room, "stage": stage, "reason": str(e)})
            finally:
                for h in (rcv, snd):
                    if h is not None:
                        h.clear()

        # which transport moved the bytes, as far as the library tells
        pe, de, tr = pm.engine, dm.engine, out["transport"]
        tr["prefill_engine"] = lib.kvf_engine_transport(pe.handle).decode()
        tr["decode_engine"] = lib.kvf_engine_transport(de.handle).decode()
        tr["route"] = pe.peer_transport(dm.session_id) or de.peer_transport(pm.session_id)
        st_p, st_d = pe.get_stats(), de.get_stats()
        tr["peers_ucx"], tr["peers_tcp"] = st_p["peers_ucx"] + st_d["peers_ucx"], st_p["peers_tcp"] + st_d["peers_tcp"]
        for side, m in (("prefill", pm), ("decode", dm)):  # the first good room's trace
            t = m.trace(ok_rooms[0]) if ok_rooms else None
            tr[f"{side}_room_peers"] = t["peers"] if t else None
        out["engine"] = {"decode_batches_refused": st_d["batches_refused"],
                         "prefill_batches_failed": st_p["batches_failed"]}
    return failures, mismatches, ok_rooms, moved, busy


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--prefill-device", choices=("cuda", "cpu"), help="default: --device")
    ap.add_argument("--decode-device", choices=("cuda", "cpu"), help="default: --device")
    ap.add_argument("--transport", choices=("tcp", "ucx", "auto"), help="default: $KVFERRY_TRANSPORT, else auto")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--pages", type=int, default=64, help="pages per request")
    ap.add_argument("--layers", type=int, default=4, help="MHA layers (2 buffers each, K and V)")
    ap.add_argument("--page-bytes", type=int, default=16 * 8 * 128 * 2, help="16 tokens x 8 heads x 128 dims bf16")
    ap.add_argument("--timeout-s", type=float, default=30.0, help="bound of the whole run")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if min(args.requests, args.pages, args.layers) < 1 or args.page_bytes < 8:
        ap.error("--requests, --pages and --layers must be >= 1, --page-bytes >= 8")
    t_start = time.monotonic()
    deadline = t_start + args.timeout_s
    faulthandler.dump_traceback_later(args.timeout_s + 30, exit=True)  # a C call that never returns
    pdev, ddev = args.prefill_device or args.device, args.decode_device or args.device
    out = {"ok": False, "prefill_device": pdev, "decode_device": ddev}

    torch, why = None, None
    if "cuda" in (pdev, ddev):
        try:
            import torch
            why = None if torch.cuda.is_available() else \
                f"torch {torch.__version__} sees no CUDA device (torch.version.cuda={torch.version.cuda})"
        except ImportError as e:
            why = f"PyTorch is not installed ({e})"
    if why:
        print(f"kv_device_memory: SKIP: a cuda side was asked for but {why}", file=sys.stderr)
        print(json.dumps(dict(out, ok=None, skipped=why)), flush=True)
        return 77
    if torch is not None:
        out["gpu"] = torch.cuda.get_device_name(0)

    if args.transport:
        os.environ["KVFERRY_TRANSPORT"] = args.transport  # read by kvf_engine_create (config transport NULL)
    import kvferry
    from kvferry._lib import lib

    nbuf, P, R = 2 * args.layers, args.pages, args.requests
    total = (R + 1) * P  # one request's worth of pages stays unused on each side
    rng = random.Random(args.seed)
    src_perm, dst_perm = rng.sample(range(total), total), rng.sample(range(total), total)
    src_of = [src_perm[r * P:(r + 1) * P] for r in range(R)]
    dst_of = [dst_perm[r * P:(r + 1) * P] for r in range(R)]
    own = {p: r for r, pages in enumerate(src_of) for p in pages}
    owner = [own.get(p, -1) for p in range(total)]  # the request whose source a page is (-1: none)
    pools = [CudaPool(torch, nbuf, total, args.page_bytes) if dev == "cuda" else HostPool(nbuf, total, args.page_bytes)
             for dev in (pdev, ddev)]
    src, dst = pools
    src.fill(owner)
    out.update(lib=kvferry.LIB_PATH, version=kvferry.version(), requests=R, pages_per_request=P, buffers=nbuf,
               page_bytes=args.page_bytes, transport={"asked": os.environ.get("KVFERRY_TRANSPORT") or "auto (default)",
                                                      "built": lib.kvf_engine_transports().decode()})
    try:
        failures, mismatches, ok_rooms, moved, busy = transfer(args, kvferry, src, dst, (src_of, dst_of, deadline), out)
    except kvferry.KVFError as e:  # the server or a manager could not be made
        failures, mismatches, ok_rooms, moved, busy = [{"stage": "setup", "reason": str(e)}], [], [], 0, 0.0

    # every decode page outside the requests' destinations must still be zero
    want = {p for pages in dst_of for p in pages}
    stray = sorted((b, p) for b in range(nbuf) for p in dst.nonzero_pages(b) - want)
    bad = {m["request"] for m in mismatches}
    out.update(ok=not failures and not mismatches and not stray, requests_ok=len(ok_rooms) - len(bad), bytes=moved,
               seconds=round(busy, 6), gbps=round(moved / busy / 1e9, 3) if busy else None,
               wall_s=round(time.monotonic() - t_start, 3), failures=failures, mismatches=mismatches,
               stray_count=len(stray), stray_pages=[list(x) for x in stray[:10]])
    print(json.dumps(out), flush=True)
    if not out["ok"]:
        first = (failures or mismatches or [{"stray_pages": out["stray_pages"][:3]}])[0]
        print(f"kv_device_memory: FAILED: {json.dumps(first)}", file=sys.stderr)
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
