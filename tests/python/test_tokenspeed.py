"""kvferry.tokenspeed, the drop-in for tokenspeed's Mooncake classes.

A prefill instance and a decode instance run in two Python processes, each
building KVManagerArgs / KVArgs look-alikes with exactly tokenspeed's
attribute names (as its factory.get_kv_args does: target layers, draft
layers appended, a Mamba state buffer, layer ids) and driving the classes the
way tokenspeed's DisaggPrefillExecutor / DisaggDecodeExecutor do: bootstrap,
the decode's prefill() with a prefix, sends in chunks with curr_idx, the
layerwise path with a step counter and set_prefill_metadata, first token and
speculative ids, abort_room and failures. Every byte of every page is
checked, untouched pages must stay zero. Heterogeneous TP 2->1 and 1->2 (head
slices), MLA 1->1 and 1->2 (replicated latent buffers). Then install()
against a fake `tokenspeed` package tree with the reference's module paths.
"""

import json
import time
import os
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PYDIR = os.path.join(ROOT, "python")
if PYDIR not in sys.path:
    sys.path.insert(0, PYDIR)

from subproc import Proc  # noqa: E402  (tests/python/subproc.py)

pytest.importorskip("numpy")

LINE_TIMEOUT_S = 40


@pytest.fixture
def spawn(tmp_path):
    procs = []

    def _spawn(script, *args, name="proc", extra_env=None):
        env = dict(os.environ)
        env.update(extra_env or {})
        env["PYTHONPATH"] = PYDIR
        env["KVFERRY_HOST"] = "127.0.0.1"
        env["KVFERRY_BOOTSTRAP_HOST"] = "127.0.0.1"
        if env.get("KVFERRY_LIB"):  # the children run in tmp_path
            env["KVFERRY_LIB"] = os.path.abspath(env["KVFERRY_LIB"])
        p = Proc(script, args, env, tmp_path, line_timeout=LINE_TIMEOUT_S, finish_timeout=20,
                 name=f"{name}{len(procs)}")
        procs.append(p)
        return p

    yield _spawn
    for p in procs:
        p.kill()


# Shared by both processes: the argument look-alikes, the pools, the content.
COMMON = r"""
import contextlib, dataclasses, json, sys, threading, time
import numpy as np
from kvferry.tokenspeed import (KVTransferError, MooncakeKVBootstrapServer, MooncakeKVManagerDecode,
                                MooncakeKVManagerPrefill, MooncakeKVReceiver, MooncakeKVSender, TransferPoll,
                                page_size_scope)

@dataclasses.dataclass
class KVArgs:  # tokenspeed's mooncake/entities.py field names and order
    engine_rank: int
    kv_data_ptrs: list
    kv_data_lens: list
    kv_item_lens: list
    offsets: list
    aux_data_ptrs: list
    aux_data_lens: list
    aux_item_lens: list
    ib_device: str
    gpu_id: int
    target_layer_num: int
    draft_layer_num: int
    kv_layer_ids: list = dataclasses.field(default_factory=list)
    kv_unit_lens: list = dataclasses.field(default_factory=list)
    state_data_ptrs: list = dataclasses.field(default_factory=list)
    state_data_lens: list = dataclasses.field(default_factory=list)
    state_item_lens: list = dataclasses.field(default_factory=list)
    state_unit_lens: list = dataclasses.field(default_factory=list)
    state_type: str = "none"
    state_layer_ids: list = dataclasses.field(default_factory=list)
    mamba_offsets: list = None

@dataclasses.dataclass
class KVManagerArgs:
    bootstrap_port: int
    dist_init_addr: str
    world_size: int
    dp_size: int
    attn_tp_rank: int
    attn_dp_rank: int
    is_mla_backend: bool
    draft_is_mla_backend: bool
    enable_metrics: bool
    enable_dp_attention: bool
    enable_mla_l1_5_cache: bool
    served_model_name: str
    app_key: str
    metrics_reporters: str

SPEC = json.loads(sys.argv[1])
L, D, PAGES, SLOTS = SPEC["layers"], SPEC["draft"], SPEC["pages"], 4
MLA, TP, PS = SPEC["mla"], SPEC["tp"], SPEC["page_size"]
DP, PEER_DP = SPEC["dp"], SPEC["peer_dp"]  # DP attention: TP // DP ranks per DP group
TPD = TP // DP

def executor_scope():  # what install() does around tokenspeed's PD executors, which know PS
    return page_size_scope(PS) if SPEC.get("tell_page_size", True) else contextlib.nullcontext()
UNIT, HEADS, STATE = SPEC["unit"], SPEC["heads"], SPEC["state"]   # STATE: bytes of one state slot (all ranks)
# Global layer ids: target KV layers at even ids, the state layer between,
# draft layers after them (factory.get_kv_args: draft ids follow max(kv ids)).
KV_IDS = [2 * l for l in range(L)]
STATE_IDS = [1] if STATE else []
DRAFT_IDS = list(range(max(KV_IDS) + 1, max(KV_IDS) + 1 + D))
NBUF = L + D if MLA else 2 * (L + D)
FULL = HEADS * UNIT  # one page of one buffer with every head (MLA: the latent row)

def full(b, group=0):  # the logical content of KV buffer b, every head, in a prefill DP group
    return np.random.default_rng(1000 + b + 100 * group).integers(0, 256, size=(PAGES, FULL), dtype=np.uint8)

def full_state(group=0):
    return np.random.default_rng(999 + 100 * group).integers(0, 256, size=(SLOTS, STATE), dtype=np.uint8)

def part(a, rank):  # this rank's head slice (MLA: replicated)
    if MLA:
        return a.copy()
    w = a.shape[1] // TPD
    return np.ascontiguousarray(a[:, rank * w:(rank + 1) * w])

def offsets():
    if MLA:
        return [[l] for l in range(L + D)]
    return [[l, L + l] for l in range(L)] + [[2 * L + j, 2 * L + D + j] for j in range(D)]

def make_args(rank, bufs, state, port):
    units = [] if MLA else [UNIT] * NBUF
    kv = KVArgs(engine_rank=rank, kv_data_ptrs=[b.ctypes.data for b in bufs], kv_data_lens=[b.nbytes for b in bufs],
                kv_item_lens=[b.shape[1] for b in bufs], offsets=offsets(), aux_data_ptrs=[], aux_data_lens=[],
                aux_item_lens=[], ib_device="", gpu_id=0, target_layer_num=L, draft_layer_num=D,
                kv_layer_ids=KV_IDS + DRAFT_IDS, kv_unit_lens=units)
    if state is not None:
        kv.state_data_ptrs, kv.state_data_lens = [state.ctypes.data], [state.nbytes]
        kv.state_item_lens, kv.state_unit_lens = [state.shape[1]], [1]
        kv.state_type, kv.state_layer_ids = "mamba", STATE_IDS
    args = KVManagerArgs(bootstrap_port=port, dist_init_addr="127.0.0.1", world_size=TP, dp_size=DP,
                         attn_tp_rank=rank % TPD, attn_dp_rank=rank // TPD, is_mla_backend=MLA,
                         draft_is_mla_backend=MLA, enable_metrics=False, enable_dp_attention=DP > 1,
                         enable_mla_l1_5_cache=False,
                         served_model_name="m", app_key="", metrics_reporters="")
    return args, kv

def ints(text):
    return [int(x) for x in text.split(",")] if text != "-" else None

def poll_all(handles, want, limit=20):
    # the executors' poll_and_all_reduce: the minimum over the ranks
    deadline = time.monotonic() + limit
    while True:
        st = min(int(h.poll()) for h in handles)
        if st == TransferPoll.Failed or st >= want or time.monotonic() > deadline:
            return st
        time.sleep(0.002)
"""

PREFILL = COMMON + r"""
class StepCounter:  # tokenspeed's StepCounter interface, host-side
    COUNT_NUM_MAX = 2**62
    def __init__(self):
        self.cache_step, self.aux_step, self.ready = 0, 0, 0
    def current_step(self):
        return self.cache_step, self.aux_step
    def advance_step(self, delta_cache_step, delta_aux_step):
        self.cache_step = (self.cache_step + delta_cache_step) % self.COUNT_NUM_MAX
        self.aux_step = (self.aux_step + delta_aux_step) % self.COUNT_NUM_MAX
    def record_cache(self):  # the device finished one layer
        self.ready = (self.ready + 1) % self.COUNT_NUM_MAX
    def query_ready_cache_step(self):
        return self.ready

srv = MooncakeKVBootstrapServer(0)
pools = [[part(full(b, r // TPD), r % TPD) for b in range(NBUF)] for r in range(TP)]
states = [part(full_state(r // TPD), r % TPD) if STATE else None for r in range(TP)]
with executor_scope():
    all_mgrs = [MooncakeKVManagerPrefill(*make_args(r, pools[r], states[r], srv.port)) for r in range(TP)]
all_counters = [StepCounter() for _ in range(TP)]
print("READY", f"127.0.0.1:{srv.port}", flush=True)
seen = {}  # manager -> control messages received when its last room ended

def forward(counters, layer_num):  # the device writes the layers one by one
    for _ in range(layer_num):
        time.sleep(0.003)
        for c in counters:
            c.record_cache()

for line in sys.stdin:
    room, mode, pages, nchunks, token, cands, slot = line.split()
    room, pages, nchunks, token, cands = int(room), ints(pages), int(nchunks), int(token), ints(cands)
    mamba = np.array([int(slot)], dtype=np.int64) if STATE else None
    # the ranks of the DP group that serves the room (the scheduler routes it there)
    mgrs = [m for r, m in enumerate(all_mgrs) if r // TPD == room % DP]
    counters = [c for r, c in enumerate(all_counters) if r // TPD == room % DP]
    if mode == "abort":  # EPD: the prefill gives up before registering a sender
        deadline = time.monotonic() + 10  # once the decode's request (M2) is in
        while mgrs[0].kv.get_stats()["messages_received"] <= seen.get(mgrs[0], 0) and time.monotonic() < deadline:
            time.sleep(0.002)
        mgrs[0].abort_room(room, f"EPD: prefill aborted request r{room} (embedding receive timed out)")
        seen[mgrs[0]] = mgrs[0].kv.get_stats()["messages_received"]
        print("ABORTED", flush=True)
        continue
    senders = [MooncakeKVSender(mgr=m, bootstrap_addr=f"127.0.0.1:{srv.port}", bootstrap_room=room) for m in mgrs]
    st = poll_all(senders, TransferPoll.Bootstrapped)
    if st != TransferPoll.Bootstrapped:
        print("SENT", TransferPoll(st).name, flush=True)
        continue
    notes = []
    if mode == "send":  # DisaggPrefillExecutor._decode, the page list sent in chunks
        for m, s in zip(mgrs, senders):
            info = next(t for t in m.transfer_infos[room].values() if not t.is_dummy)
            assert info.decode_prefix_len % PS == 0
            kv = np.array(pages[info.decode_prefix_len // PS:], dtype=np.int64)
            step = max(1, -(-len(kv) // nchunks))
            for i in range(0, len(kv), step):
                last = i + step >= len(kv)
                s.send(kv[i:i + step], 3, last, bootstrap_token=token if last else -1,
                       spec_candidate_ids=cands if last else None, mamba_indices=mamba if last else None)
    elif mode == "layerwise":  # prepare_prefill / store_prefill_token / _decode, one forward per chunk
        for m, c in zip(mgrs, counters):
            m.register_layerwise_step_counter(c, 2)
        sent0 = sum(m.kv.get_stats()["chunks_sent"] for m in mgrs)
        size = len(pages) * PS
        bounds = [size * k // nchunks for k in range(nchunks + 1)]
        for k in range(nchunks):
            begins = [m.reserve_layerwise_cache_steps() for m in mgrs]
            for m, s, begin in zip(mgrs, senders, begins):
                prefix = next(t for t in m.transfer_infos[room].values() if not t.is_dummy).decode_prefix_len // PS
                chunk_begin, chunk_end = bounds[k], bounds[k + 1]
                last = chunk_end >= size
                start = max(prefix + s.curr_idx, chunk_begin // PS)
                end = min(-(-chunk_end // PS) if last else chunk_end // PS, len(pages))
                start = min(start, end)
                kv = np.array(pages[start:end], dtype=np.int64)
                if len(kv) == 0 and not last:
                    continue
                s.send_layerwise(kv, slice(start - prefix, end - prefix), 3, last, begin_cache_step=begin,
                                 layerwise_interval=2, wait_for_bootstrap_token=last,
                                 mamba_indices=mamba if last else None)
            time.sleep(0.05)
            if k == 0:  # nothing may go out before the device wrote a layer
                notes.append("early=%d" % (sum(m.kv.get_stats()["chunks_sent"] for m in mgrs) - sent0))
            forward(counters, mgrs[0].layer_num)
        # the KV landed, the token is not published yet: no Success
        time.sleep(0.1)
        notes.append("before_token=%s" % ("Success" if any(s.poll() == TransferPoll.Success for s in senders)
                                          else "pending"))
        for m, s in zip(mgrs, senders):  # store_prefill_token (layerwise) / _decode
            assert s.has_layerwise_transfer()
            m.set_prefill_metadata(s.bootstrap_room, token, cands)
    st = poll_all(senders, TransferPoll.Success)
    reason = ""
    if st == TransferPoll.Failed:
        try:
            senders[0].failure_exception()
        except KVTransferError as e:
            reason = str(e)
    for m, s in zip(mgrs, senders):  # _drop_request_state
        m.discard_expired_metadata_room(s.bootstrap_room)
    for m in mgrs:  # every M1/M2 of this room is in
        seen[m] = m.kv.get_stats()["messages_received"]
    print("SENT", TransferPoll(st).name, *notes, reason, flush=True)
for m in all_mgrs:
    m.close()
srv.close()
"""

DECODE = COMMON + r"""
addr = sys.argv[2]
pools = [[np.zeros((PAGES, FULL if MLA else FULL // TP), dtype=np.uint8) for _ in range(NBUF)] for _ in range(TP)]
states = [np.zeros((SLOTS, STATE // TP), dtype=np.uint8) if STATE else None for _ in range(TP)]
with executor_scope():
    mgrs = [MooncakeKVManagerDecode(*make_args(r, pools[r], states[r], 0)) for r in range(TP)]
print("READY", flush=True)
for line in sys.stdin:
    room, src, dst, prefix, slot, src_slot = line.split()
    room, src, dst, prefix, slot, src_slot = int(room), ints(src), ints(dst), int(prefix), int(slot), int(src_slot)
    for r in range(TP):
        for b in pools[r]:
            b[:] = 0
        if STATE:
            states[r][:] = 0
    recvs = [MooncakeKVReceiver(mgr=m, bootstrap_addr=addr, bootstrap_room=room) for m in mgrs]
    st = poll_all(recvs, TransferPoll.Bootstrapped)
    if st == TransferPoll.Bootstrapped:  # DisaggDecodeExecutor._prefill
        for r in recvs:
            r.prefill(np.array(dst, dtype=np.int64), 5, prefix, None,
                      np.array([slot], dtype=np.int64) if STATE else None)
        print("PREALLOC", flush=True)
        st = poll_all(recvs, TransferPoll.Success)
    if st != TransferPoll.Success:
        if st != TransferPoll.Failed:
            print("DONE", TransferPoll(st).name, "(no final state in time)", flush=True)
            continue
        try:
            recvs[0].failure_exception()
        except KVTransferError as e:
            print("DONE Failed", str(e), flush=True)
        continue
    skip = prefix // PS
    bad = stray = 0
    for r in range(TP):
        for b in range(NBUF):
            want = part(full(b, room % PEER_DP), r)
            for p, d in zip(src[skip:], dst):
                bad += int(not (pools[r][b][d] == want[p]).all())
            stray += int(np.delete(pools[r][b], dst, axis=0).any())
        if STATE:
            bad += int(not (states[r][slot] == part(full_state(room % PEER_DP), r)[src_slot]).all())
            stray += int(np.delete(states[r], [slot], axis=0).any())
    token, cands = mgrs[0].pop_prefill_metadata(room)
    again = mgrs[0].pop_prefill_metadata(room)
    spec = recvs[0].supports_remote_spec_candidates
    print("DONE Success", "bad=%d" % bad, "stray=%d" % stray, token, ",".join(map(str, cands or [])) or "-",
          "again=%s" % (again,), "spec=%s" % spec, flush=True)
for m in mgrs:
    m.close()
"""


def spec(**kw):
    s = dict(layers=2, draft=1, pages=24, mla=False, tp=1, dp=1, peer_dp=1, page_size=1, unit=64, heads=4, state=48)
    s.update(kw)
    return s


def start_pair(spawn, prefill_spec, decode_spec, decode_env=None):
    prefill = spawn(PREFILL, json.dumps(prefill_spec), name="prefill")
    ready = prefill.line().split()
    assert ready[0] == "READY", ready
    decode = spawn(DECODE, json.dumps(decode_spec), ready[1], name="decode", extra_env=decode_env)
    assert decode.line() == "READY"
    return prefill, decode


def run_room(prefill, decode, room, mode, src, dst, prefix=0, nchunks=2, token=77, cands="5,6,7", slot=2,
             src_slot=1):
    """One request through both processes; returns (decode's DONE, prefill's SENT)."""
    decode.send(f"{room} {','.join(map(str, src))} {','.join(map(str, dst))} {prefix} {slot} {src_slot}")
    assert decode.line() == "PREALLOC"
    prefill.send(f"{room} {mode} {','.join(map(str, src))} {nchunks} {token} {cands} {src_slot}")
    return decode.line(), prefill.line()


SRC = [5, 6, 7, 8, 20, 21, 2, 23, 0, 17]
DST = [0, 1, 2, 3, 10, 11, 22, 19, 9, 4]


def test_executor_flow_same_tp(spawn):
    """TP 1 -> 1 with draft layers and a Mamba state buffer: chunked sends
    with a decode prefix, the layerwise path, abort_room, and a receiver
    whose prefill is gone."""
    # the decode's heartbeat at tokenspeed's floor (2 s, one failure) for the last step
    hb = {"TOKENSPEED_DISAGGREGATION_HEARTBEAT_INTERVAL": "2", "TOKENSPEED_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "1"}
    prefill, decode = start_pair(spawn, spec(), spec(), decode_env=hb)
    # 4 prefix pages held by the decode: the prefill skips SRC[:4]
    done, sent = run_room(prefill, decode, 987654321, "send", SRC, DST[:6], prefix=4, nchunks=3)
    assert done.split() == ["DONE", "Success", "bad=0", "stray=0", "77", "5,6,7", "again=(-1,", "None)",
                            "spec=True"], done
    assert sent.split() == ["SENT", "Success"], sent
    # layerwise: two forward chunks, the token published after the last layer
    done, sent = run_room(prefill, decode, -42, "layerwise", SRC, DST, nchunks=2, token=901, cands="-")
    assert done.split()[:6] == ["DONE", "Success", "bad=0", "stray=0", "901", "-"], done
    assert sent.split() == ["SENT", "Success", "early=0", "before_token=pending"], sent
    # layerwise with a prefix
    done, sent = run_room(prefill, decode, 31337, "layerwise", SRC, DST[:7], prefix=3, nchunks=3, token=5)
    assert done.split()[:6] == ["DONE", "Success", "bad=0", "stray=0", "5", "5,6,7"], done
    assert sent.split()[:2] == ["SENT", "Success"], sent
    # abort_room before any sender: the decode is told (M3 Failed carries no
    # reason on the wire: the decode records tokenspeed's text)
    done, sent = run_room(prefill, decode, 4040, "abort", SRC, DST)
    assert sent == "ABORTED"
    assert done.startswith("DONE Failed KVTransferError(bootstrap_room=4040, remote_endpoint=127.0.0.1:"), done
    assert done.endswith("Failed to get kvcache from prefill instance, it might be dead"), done
    prefill.finish()
    # the prefill instance is gone: a request already routed there (cached
    # route) fails through the heartbeat with tokenspeed's reason
    decode.send("77 1,2 3,4 0 0 0")
    assert decode.line() == "PREALLOC"
    done = decode.line()
    assert done.startswith("DONE Failed KVTransferError(bootstrap_room=77") and "Losing connection" in done, done
    decode.finish()


@pytest.mark.parametrize("tp_p,tp_d", [(2, 1), (1, 2)])
def test_heterogeneous_tp(spawn, tp_p, tp_d):
    """Head-sliced fragments (draft layers labelled draft_k/draft_v) and a
    sharded state buffer, chunked and layerwise; speculative ids are not
    offered to the decode scheduler (supports_remote_spec_candidates False)."""
    prefill, decode = start_pair(spawn, spec(tp=tp_p), spec(tp=tp_d))
    done, sent = run_room(prefill, decode, 11, "send", SRC, DST[:8], prefix=2)
    assert done.split()[:6] == ["DONE", "Success", "bad=0", "stray=0", "77", "5,6,7"], done
    assert done.split()[-1] == "spec=False", done
    assert sent.split() == ["SENT", "Success"], sent
    done, sent = run_room(prefill, decode, 12, "layerwise", SRC, DST, nchunks=2, token=8)
    assert done.split()[:5] == ["DONE", "Success", "bad=0", "stray=0", "8"], done
    assert sent.split()[:3] == ["SENT", "Success", "early=0"], sent
    prefill.finish()
    decode.finish()


@pytest.mark.parametrize("tp_d", [1, 2])
def test_mla(spawn, tp_d):
    """MLA: one latent buffer per layer (draft layer too), identical on every
    rank; decode TP 2 gets the same bytes on both ranks from prefill rank 0."""
    mla = dict(mla=True, unit=576, heads=1, state=0)
    prefill, decode = start_pair(spawn, spec(tp=1, **mla), spec(tp=tp_d, **mla))
    done, sent = run_room(prefill, decode, 21, "send", SRC, DST, nchunks=2, token=3, cands="9")
    assert done.split()[:7] == ["DONE", "Success", "bad=0", "stray=0", "3", "9", "again=(-1,"], done
    assert done.split()[-1] == "spec=True", done
    assert sent.split() == ["SENT", "Success"], sent
    done, sent = run_room(prefill, decode, 22, "layerwise", SRC, DST[:5], prefix=5, nchunks=1, token=4)
    assert done.split()[:5] == ["DONE", "Success", "bad=0", "stray=0", "4"], done
    prefill.finish()
    decode.finish()


def test_heterogeneous_tp_refused_when_page_size_unknown(spawn):
    """A decode whose managers were built without a page size (no install()
    around tokenspeed's executors, no KVFERRY_PAGE_SIZE) refuses a
    heterogeneous-TP room with a reason before sending the request, instead
    of landing head slices cut per page; same TP still works."""
    prefill, decode = start_pair(spawn, spec(tp=2), spec(tp=1, tell_page_size=False))
    decode.send(f"61 {','.join(map(str, SRC))} {','.join(map(str, DST))} 0 2 1")
    done = decode.line()
    assert done.startswith("DONE Failed KVTransferError(bootstrap_room=61"), done
    assert "heterogeneous-TP" in done and "page size is not known" in done and "KVFERRY_PAGE_SIZE" in done, done
    prefill.finish()
    decode.finish()
    prefill, decode = start_pair(spawn, spec(tp=1), spec(tp=1, tell_page_size=False))
    done, sent = run_room(prefill, decode, 62, "send", SRC, DST, nchunks=2)
    assert done.split()[:6] == ["DONE", "Success", "bad=0", "stray=0", "77", "5,6,7"], done
    assert sent.split() == ["SENT", "Success"], sent
    prefill.finish()
    decode.finish()


def test_page_size_sources(monkeypatch):
    """Where a manager's page size comes from: args.page_size, the PD
    executor's (page_size_scope, as install() sets it), $KVFERRY_PAGE_SIZE;
    none of them: unknown. Bad values are refused."""
    from kvferry import tokenspeed as ts

    class Args:
        pass

    monkeypatch.delenv("KVFERRY_PAGE_SIZE", raising=False)
    assert ts._page_size(Args()) is None
    monkeypatch.setenv("KVFERRY_PAGE_SIZE", "8")
    assert ts._page_size(Args()) == 8
    with ts.page_size_scope(16):
        assert ts._page_size(Args()) == 16  # the executor's, before the environment
        a = Args()
        a.page_size = 32
        assert ts._page_size(a) == 32  # the arguments', first
    assert ts._page_size(Args()) == 8  # the scope ended
    monkeypatch.setenv("KVFERRY_PAGE_SIZE", "0")
    with pytest.raises(ValueError, match="KVFERRY_PAGE_SIZE must be positive"):
        ts._page_size(Args())
    monkeypatch.setenv("KVFERRY_PAGE_SIZE", "x")
    with pytest.raises(ValueError, match="not an integer"):
        ts._page_size(Args())
    with pytest.raises(ValueError, match="positive"):
        with ts.page_size_scope(0):
            pass


def test_page_size_two(spawn):
    """Pages of 2 tokens: the executors' page arithmetic (a 4-token decode
    prefix is 2 pages; layerwise windows in tokens) with the same TP."""
    prefill, decode = start_pair(spawn, spec(page_size=2), spec(page_size=2))
    done, sent = run_room(prefill, decode, 51, "send", SRC, DST[:8], prefix=4, nchunks=2)
    assert done.split()[:6] == ["DONE", "Success", "bad=0", "stray=0", "77", "5,6,7"], done
    assert sent.split() == ["SENT", "Success"], sent
    done, sent = run_room(prefill, decode, 52, "layerwise", SRC, DST[:9], prefix=2, nchunks=3, token=6)
    assert done.split()[:5] == ["DONE", "Success", "bad=0", "stray=0", "6"], done
    prefill.finish()
    decode.finish()


def test_dp_attention(spawn):
    """A prefill instance with DP attention (world 2, dp 2: one rank per DP
    group, different content per group): room r is served by DP group
    r mod 2 (floor modulo for a negative room), chunked and layerwise."""
    prefill, decode = start_pair(spawn, spec(tp=2, dp=2), spec(peer_dp=2))
    for room, mode in ((6, "send"), (7, "send"), (-3, "layerwise")):
        done, sent = run_room(prefill, decode, room, mode, SRC, DST, token=100 + room)
        assert done.split()[:5] == ["DONE", "Success", "bad=0", "stray=0", str(100 + room)], (room, done)
        assert sent.split()[:2] == ["SENT", "Success"], sent
    prefill.finish()
    decode.finish()


# ---------------------------------------------------------------- in one process


def test_get_kv_class_and_argument_checks():
    import enum

    from kvferry import tokenspeed as ts

    class TransferBackend(enum.Enum):  # tokenspeed's enums, by value
        MOONCAKE = "mooncake"

    class KVClassType(enum.Enum):
        MANAGER_PREFILL = "manager_prefill"
        MANAGER_DECODE = "manager_decode"
        MANAGER = "manager"
        SENDER = "sender"
        RECEIVER = "receiver"
        BOOTSTRAP_SERVER = "bootstrap_server"

    want = {"MANAGER_PREFILL": ts.MooncakeKVManagerPrefill, "MANAGER_DECODE": ts.MooncakeKVManagerDecode,
            "MANAGER": None, "SENDER": ts.MooncakeKVSender, "RECEIVER": ts.MooncakeKVReceiver,
            "BOOTSTRAP_SERVER": ts.MooncakeKVBootstrapServer}
    for t in KVClassType:
        assert ts.get_kv_class(TransferBackend.MOONCAKE, t) is want[t.name]
        assert ts.get_kv_class(ts.KVClassType[t.name]) is want[t.name]
        assert ts.get_kv_class(t.value) is want[t.name]
    assert [p.value for p in ts.TransferPoll] == [0, 1, 2, 3, 4, 5]

    class Args:
        enable_dp_attention, dp_size, enable_mla_l1_5_cache = False, 2, False

    with pytest.raises(ValueError, match="dp size must be 1"):
        ts.MooncakeKVManagerDecode(Args(), None)
    Args.dp_size, Args.enable_mla_l1_5_cache = 1, True
    with pytest.raises(NotImplementedError, match="L1.5"):
        ts.MooncakeKVManagerDecode(Args(), None)


FAKE_MODULES = {
    # the reference's module paths; the classes are stand-ins that must never run
    "runtime/pd/__init__.py": "",
    "runtime/pd/base/__init__.py": "",
    "runtime/pd/base/status.py": "class TransferPoll:\n    Failed, Success = 0, 5\n",
    "runtime/pd/mooncake/entities.py": """
        class KVTransferError(Exception):
            def __init__(self, bootstrap_room, failure_reason, remote_endpoint=None):
                super().__init__(failure_reason)
                self.bootstrap_room, self.failure_reason = bootstrap_room, failure_reason
                self.remote_endpoint = remote_endpoint
        """,
    "runtime/pd/mooncake/conn.py": "class MooncakeKVBootstrapServer:\n    pass\n",
    "runtime/pd/mooncake/decode.py": "class MooncakeKVManagerDecode:\n    pass\n",
    "runtime/pd/mooncake/sender.py": "class MooncakeKVSender:\n    pass\n",
    "runtime/pd/mooncake/receiver.py": """
        from tokenspeed.runtime.pd.mooncake.decode import MooncakeKVManagerDecode
        class MooncakeKVReceiver:
            pass
        """,
    "runtime/pd/mooncake/prefill.py": """
        class MooncakeKVManagerPrefill:
            pass
        from tokenspeed.runtime.pd.mooncake.sender import MooncakeKVSender
        """,
    "runtime/pd/mooncake/__init__.py": """
        from tokenspeed.runtime.pd.mooncake.conn import MooncakeKVBootstrapServer
        from tokenspeed.runtime.pd.mooncake.decode import MooncakeKVManagerDecode
        from tokenspeed.runtime.pd.mooncake.prefill import MooncakeKVManagerPrefill
        from tokenspeed.runtime.pd.mooncake.receiver import MooncakeKVReceiver
        from tokenspeed.runtime.pd.mooncake.sender import MooncakeKVSender
        """,
    "runtime/pd/utils.py": """
        from enum import Enum
        class TransferBackend(Enum):
            MOONCAKE = "mooncake"
            MOONCAKE_ASYNC = "mooncake_async"
        class KVClassType(Enum):
            MANAGER_PREFILL = "manager_prefill"
            MANAGER_DECODE = "manager_decode"
            MANAGER = "manager"
            SENDER = "sender"
            RECEIVER = "receiver"
            BOOTSTRAP_SERVER = "bootstrap_server"
        def get_kv_class(transfer_backend, class_type):
            if transfer_backend == TransferBackend.MOONCAKE:
                from tokenspeed.runtime.pd.mooncake.conn import MooncakeKVBootstrapServer
                from tokenspeed.runtime.pd.mooncake.decode import MooncakeKVManagerDecode
                from tokenspeed.runtime.pd.mooncake.prefill import MooncakeKVManagerPrefill
                from tokenspeed.runtime.pd.mooncake.receiver import MooncakeKVReceiver
                from tokenspeed.runtime.pd.mooncake.sender import MooncakeKVSender
                return {KVClassType.MANAGER_PREFILL: MooncakeKVManagerPrefill,
                        KVClassType.MANAGER_DECODE: MooncakeKVManagerDecode,
                        KVClassType.SENDER: MooncakeKVSender, KVClassType.RECEIVER: MooncakeKVReceiver,
                        KVClassType.BOOTSTRAP_SERVER: MooncakeKVBootstrapServer}.get(class_type)
            raise ValueError(transfer_backend)
        """,
    # the executors bind the classes at import time, as the reference's do
    # and build their manager in the constructor, which takes page_size
    "runtime/pd/prefill_executor.py": """
        from tokenspeed.runtime.pd.mooncake.prefill import MooncakeKVManagerPrefill, MooncakeKVSender
        from tokenspeed.runtime.pd.utils import TransferBackend, get_kv_class
        class DisaggPrefillExecutor:
            def __init__(self, backend, args, kv_args, gloo_group, page_size: int):
                self.page_size = page_size
                self.kv_manager = MooncakeKVManagerPrefill(args, kv_args)
        """,
    "runtime/pd/decode_executor.py": """
        from tokenspeed.runtime.pd.mooncake.decode import MooncakeKVManagerDecode
        from tokenspeed.runtime.pd.mooncake.receiver import MooncakeKVReceiver
        class DisaggDecodeExecutor:
            def __init__(self, backend, args, kv_args, gloo_group, page_size: int):
                self.page_size = page_size
                self.kv_manager = MooncakeKVManagerDecode(args, kv_args)
        """,
}


def test_install_against_a_fake_tokenspeed_tree(tmp_path, spawn):
    """install() in a process whose `tokenspeed` is a package tree with the
    reference's module paths: an executor imported before install() and one
    imported after both resolve to kvferry's classes, and so does tokenspeed's
    own get_kv_class; uninstall() restores everything."""
    for rel, text in FAKE_MODULES.items():
        path = tmp_path / "tokenspeed" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    for d in ("tokenspeed", "tokenspeed/runtime"):
        (tmp_path / d / "__init__.py").write_text("")
    script = r"""
import sys
sys.path.insert(0, sys.argv[1])
import tokenspeed.runtime.pd.prefill_executor as pe      # imported before install()
orig = pe.MooncakeKVManagerPrefill
orig_init = pe.DisaggPrefillExecutor.__init__
from kvferry import tokenspeed as kt
patched = kt.install()
assert kt.install() == patched                          # idempotent
import tokenspeed.runtime.pd.decode_executor as de      # imported after
from tokenspeed.runtime.pd import mooncake, utils
from tokenspeed.runtime.pd.mooncake import entities, prefill, receiver
checks = [
    pe.MooncakeKVManagerPrefill is kt.MooncakeKVManagerPrefill,
    pe.MooncakeKVSender is kt.MooncakeKVSender,
    de.MooncakeKVManagerDecode is kt.MooncakeKVManagerDecode,
    de.MooncakeKVReceiver is kt.MooncakeKVReceiver,
    receiver.MooncakeKVManagerDecode is kt.MooncakeKVManagerDecode,
    mooncake.MooncakeKVBootstrapServer is kt.MooncakeKVBootstrapServer,
    prefill.MooncakeKVSender is kt.MooncakeKVSender,
    pe.get_kv_class is utils.get_kv_class,
]
T, K = utils.TransferBackend, utils.KVClassType
checks += [utils.get_kv_class(T.MOONCAKE, K.SENDER) is kt.MooncakeKVSender,
           utils.get_kv_class(T.MOONCAKE, K.MANAGER_PREFILL) is kt.MooncakeKVManagerPrefill,
           utils.get_kv_class(T.MOONCAKE, K.RECEIVER) is kt.MooncakeKVReceiver,
           utils.get_kv_class(T.MOONCAKE, K.BOOTSTRAP_SERVER) is kt.MooncakeKVBootstrapServer,
           kt._error_cls is entities.KVTransferError]
try:
    utils.get_kv_class(T.MOONCAKE_ASYNC, K.MANAGER)
    checks.append(False)
except ValueError as e:
    checks.append("async" in str(e))
# a decode executor learns tokenspeed's page size (positional or keyword)
import ctypes, types
kv = [ctypes.create_string_buffer(4096) for _ in range(2)]
args = types.SimpleNamespace(bootstrap_port=0, dist_init_addr="", world_size=1, dp_size=1, attn_tp_rank=0,
                             attn_dp_rank=0, is_mla_backend=False, enable_dp_attention=False,
                             enable_mla_l1_5_cache=False)
kv_args = types.SimpleNamespace(engine_rank=0, kv_data_ptrs=[ctypes.addressof(b) for b in kv],
                                kv_data_lens=[4096, 4096], kv_item_lens=[256, 256], offsets=[[0, 1]],
                                target_layer_num=1)
ex = de.DisaggDecodeExecutor(T.MOONCAKE, args, kv_args, None, 16)
ex2 = de.DisaggDecodeExecutor(backend=T.MOONCAKE, args=args, kv_args=kv_args, gloo_group=None, page_size=4)
plain = kt.MooncakeKVManagerDecode(args, kv_args)  # built outside an executor
checks += [isinstance(ex.kv_manager, kt.MooncakeKVManagerDecode), ex.kv_manager.page_size == 16,
           ex2.kv_manager.page_size == 4, plain.page_size is None]
for m in (ex.kv_manager, ex2.kv_manager, plain):
    m.close()
print("CHECKS", "".join("1" if c else "0" for c in checks), flush=True)
print("PATCHED", " ".join(sorted(patched)), flush=True)
kt.uninstall()
print("RESTORED", pe.MooncakeKVManagerPrefill is orig and utils.get_kv_class(T.MOONCAKE, K.SENDER).__module__
      == "tokenspeed.runtime.pd.mooncake.sender" and kt._error_cls is kt.KVTransferError
      and pe.DisaggPrefillExecutor.__init__ is orig_init, flush=True)
"""
    p = spawn(script, str(tmp_path), name="install")
    checks = p.line()
    assert checks == "CHECKS " + "1" * 18, checks
    patched = p.line().split()[1:]
    for name in ("tokenspeed.runtime.pd.prefill_executor.MooncakeKVManagerPrefill",
                 "tokenspeed.runtime.pd.prefill_executor.get_kv_class",
                 "tokenspeed.runtime.pd.utils.get_kv_class",
                 "tokenspeed.runtime.pd.mooncake.conn.MooncakeKVBootstrapServer",
                 "tokenspeed.runtime.pd.mooncake.receiver.MooncakeKVManagerDecode",
                 "tokenspeed.runtime.pd.prefill_executor.DisaggPrefillExecutor.__init__",
                 "tokenspeed.runtime.pd.decode_executor.DisaggDecodeExecutor.__init__"):
        assert name in patched, patched
    assert p.line() == "RESTORED True"
    p.finish()


def test_layerwise_wait_is_bounded_and_early_metadata(monkeypatch):
    """In one process: a step counter that never advances fails the room
    after the layerwise step timeout (tokenspeed would wait forever) and the
    decode is told; metadata published before the room's sender exists is
    used once the sender comes; abort_room on a room with a sender."""
    import numpy as np

    from kvferry import tokenspeed as kt

    monkeypatch.setenv("KVFERRY_HOST", "127.0.0.1")
    monkeypatch.setenv("KVFERRY_BOOTSTRAP_HOST", "127.0.0.1")
    monkeypatch.setattr(kt, "LAYERWISE_STEP_TIMEOUT_S", 0.3)

    class Args:
        dist_init_addr, world_size, dp_size, attn_tp_rank, attn_dp_rank = "127.0.0.1", 1, 1, 0, 0
        is_mla_backend = draft_is_mla_backend = enable_dp_attention = enable_mla_l1_5_cache = False

    class Counter:  # never advances
        def current_step(self):
            return 0, 0

        def advance_step(self, delta_cache_step, delta_aux_step):
            pass

        def query_ready_cache_step(self):
            return 0

    def kv_args(bufs):
        class KV:
            engine_rank, target_layer_num, draft_layer_num = 0, 1, 0
            kv_data_ptrs = [b.ctypes.data for b in bufs]
            kv_data_lens = [b.nbytes for b in bufs]
            kv_item_lens = [b.shape[1] for b in bufs]
            offsets = [[0, 1]]
        return KV()

    src = [np.full((8, 32), 7 + b, dtype=np.uint8) for b in range(2)]
    dst = [np.zeros((8, 32), dtype=np.uint8) for _ in range(2)]
    srv = kt.MooncakeKVBootstrapServer(0)
    Args.bootstrap_port = srv.port
    pm = kt.MooncakeKVManagerPrefill(Args(), kv_args(src))
    dm = kt.MooncakeKVManagerDecode(Args(), kv_args(dst))
    addr = f"127.0.0.1:{srv.port}"
    try:
        def pair(room):
            r = kt.MooncakeKVReceiver(mgr=dm, bootstrap_addr=addr, bootstrap_room=room)
            r.prefill(np.array([4, 5]), 0, 0, None, None)
            s = kt.MooncakeKVSender(mgr=pm, bootstrap_addr=addr, bootstrap_room=room)
            return r, s

        def final(h, limit=30):
            deadline = time.monotonic() + limit
            while h.poll() not in (kt.TransferPoll.Success, kt.TransferPoll.Failed) and time.monotonic() < deadline:
                time.sleep(0.005)
            return h.poll()

        # metadata first, sender later (non-layerwise TOKEN_LATER is layerwise-only: use send_layerwise)
        pm.set_prefill_metadata(1, 55, [1, 2])
        r, s = pair(1)
        s.send_layerwise(np.array([0, 1]), slice(0, 2), 0, True, begin_cache_step=0, layerwise_interval=1,
                         wait_for_bootstrap_token=True)
        assert final(s) == kt.TransferPoll.Success and final(r) == kt.TransferPoll.Success
        assert dm.pop_prefill_metadata(1) == (55, [1, 2])
        assert (dst[0][4] == 7).all() and (dst[1][5] == 8).all()

        pm.register_layerwise_step_counter(Counter(), 1)
        r, s = pair(2)
        s.send_layerwise(np.array([2]), slice(0, 1), 0, True, begin_cache_step=pm.reserve_layerwise_cache_steps(),
                         layerwise_interval=1, wait_for_bootstrap_token=True)
        assert final(s) == kt.TransferPoll.Failed  # the reason below says which timeout fired
        with pytest.raises(kt.KVTransferError, match=r"layers \[0,1\) not computed within 0.3s"):
            s.failure_exception()
        assert final(r) == kt.TransferPoll.Failed
        with pytest.raises(kt.KVTransferError, match="it might be dead"):
            r.failure_exception()

        r, s = pair(3)
        deadline = time.monotonic() + 10
        while s.poll() == kt.TransferPoll.Bootstrapping and time.monotonic() < deadline:
            time.sleep(0.005)
        assert s.poll() == kt.TransferPoll.Bootstrapped
        pm.abort_room(3, "scheduler gave up")
        assert final(s) == kt.TransferPoll.Failed and final(r) == kt.TransferPoll.Failed
        with pytest.raises(kt.KVTransferError, match="scheduler gave up"):
            s.failure_exception()
    finally:
        pm.close()
        dm.close()
        srv.close()
