"""kvferry's tokenspeed-shaped KV classes: a prefill and a decode in two Python
processes over 127.0.0.1 (BootstrapServer in the prefill process, numpy
buffers, byte-exact pages, first token and speculative ids), then in one
process: decode prefix, state buffers, raw-address buffer lists, a shared
engine, and failures carrying the C library's reason in KVTransferError."""

import os
import socket
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PYDIR = os.path.join(ROOT, "python")
if PYDIR not in sys.path:
    sys.path.insert(0, PYDIR)

import kvferry  # noqa: E402
from kvferry import (  # noqa: E402
    BootstrapServer,
    KVFerryError,
    KVManager,
    KVReceiver,
    KVSender,
    KVTransferError,
    TransferEngine,
    TransferPoll,
)

from subproc import Proc, free_port, poll_until  # noqa: E402  (tests/python/subproc.py)

np = pytest.importorskip("numpy")

LINE_TIMEOUT_S = 30
POLL_LIMIT_S = 15
FINAL = (TransferPoll.Success, TransferPoll.Failed)


# ---------------------------------------------------------------- helpers


@pytest.fixture
def spawn(tmp_path):
    procs = []

    def _spawn(script, *args, name="proc", env_set=None):
        env = dict(os.environ)
        env["PYTHONPATH"] = PYDIR
        env.update(env_set or {})
        if env.get("KVFERRY_LIB"):  # the children run in tmp_path
            env["KVFERRY_LIB"] = os.path.abspath(env["KVFERRY_LIB"])
        p = Proc(script, args, env, tmp_path, line_timeout=LINE_TIMEOUT_S, finish_timeout=15, name=f"{name}{len(procs)}")
        procs.append(p)
        return p

    yield _spawn
    for p in procs:
        p.kill()


@pytest.fixture
def closing():
    """Close what a test made, handles before managers before servers."""
    objs = []

    def _keep(obj):
        objs.append(obj)
        return obj

    yield _keep
    for o in reversed(objs):
        o.close()


def wait_final(handle, limit=POLL_LIMIT_S):
    return poll_until(handle.poll, FINAL, limit)


# ---------------------------------------------------------------- two processes

COMMON = r"""
import sys, time
import numpy as np
from kvferry import (BootstrapServer, KVManager, KVReceiver, KVSender, KVTransferError, TransferPoll)

NBUF, PAGES, ITEM = 4, 64, 256   # 2 MHA layers (K0, K1, V0, V1), 64 pages of 256 bytes
FINAL = (TransferPoll.Success, TransferPoll.Failed)

def pool(seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=(PAGES, ITEM), dtype=np.uint8) for _ in range(NBUF)]

def ints(text):
    return [int(x) for x in text.split(",")] if text != "-" else None

def wait(handle, want, limit=20):
    deadline = time.monotonic() + limit
    st = handle.poll()
    while st not in FINAL and st < want and time.monotonic() < deadline:
        time.sleep(0.002)
        st = handle.poll()
    return st
"""

PREFILL = COMMON + r"""
seed = int(sys.argv[1])
kv = pool(seed)
with BootstrapServer("127.0.0.1", 0) as srv:
    with KVManager("prefill", kv, bootstrap_addr=srv.addr, host="127.0.0.1") as mgr:
        print("READY", srv.addr, mgr.session_id, flush=True)
        for line in sys.stdin:
            room, pages, token, cands = line.split()
            pages = ints(pages)
            with KVSender(mgr, int(room)) as s:
                # two chunks: the first may arrive before the decode's transfer request
                half = len(pages) // 2
                s.send(pages[:half], is_last=False)
                s.send(pages[half:], is_last=True, aux_index=0, bootstrap_token=int(token),
                       spec_candidate_ids=ints(cands))
                st = wait(s, TransferPoll.Success)
                reason = ""
                if st == TransferPoll.Failed:
                    try:
                        s.failure_exception()
                    except KVTransferError as e:
                        reason = str(e)
                print("SENT", st.name, reason, flush=True)
"""

DECODE = COMMON + r"""
addr, room, src_pages, dst_pages, seed = sys.argv[1], int(sys.argv[2]), ints(sys.argv[3]), ints(sys.argv[4]), int(sys.argv[5])
dst = [np.zeros((PAGES, ITEM), dtype=np.uint8) for _ in range(NBUF)]
with KVManager("decode", dst, host="127.0.0.1") as mgr:
    r = KVReceiver(mgr, addr, room)
    st = wait(r, TransferPoll.Bootstrapped)
    if st == TransferPoll.Bootstrapped:
        r.prefill(np.array(dst_pages, dtype=np.int64), aux_index=7)
        st = wait(r, TransferPoll.Success)
    if st != TransferPoll.Success:
        try:
            r.failure_exception()
        except KVTransferError as e:
            print("DONE", st.name, str(e), flush=True)
        sys.exit(0)
    mgr.sync()  # the receiver said Success: order the engine's writes before reading
    src = pool(seed)
    bad = [(b, d) for b in range(NBUF) for p, d in zip(src_pages, dst_pages) if not (dst[b][d] == src[b][p]).all()]
    untouched = [d for d in range(PAGES) if d not in dst_pages]
    stray = [(b, d) for b in range(NBUF) for d in untouched if dst[b][d].any()]
    token, cands = r.pop_metadata()
    again = r.pop_metadata()
    r.clear()
    print("DONE", st.name, "bad=%d" % len(bad), "stray=%d" % len(stray), token,
          ",".join(map(str, cands)) if cands else "-", again, flush=True)
"""


def test_prefill_and_decode_in_two_processes(spawn):
    seed = 11
    prefill = spawn(PREFILL, seed, name="prefill")
    ready = prefill.line().split()
    assert ready[0] == "READY", ready
    addr = ready[1]
    src_pages = [5, 6, 7, 8, 40, 41, 2, 63, 0, 17]
    dst_pages = [0, 1, 2, 3, 10, 11, 62, 20, 30, 9]
    rooms = [(987654321, "123", "5,6,7"), (-42, "-1", "-")]  # a negative room too (floor modulo)
    for room, token, cands in rooms:
        prefill.send(f"{room} {','.join(map(str, src_pages))} {token} {cands}")
        decode = spawn(DECODE, addr, room, ",".join(map(str, src_pages)), ",".join(map(str, dst_pages)), seed,
                       name="decode")
        done = decode.line().split(maxsplit=6)
        assert done[:4] == ["DONE", "Success", "bad=0", "stray=0"], done
        assert done[4] == token and done[5] == cands, done
        assert done[6] == "(-1, None)", done
        sent = prefill.line()
        assert sent.split()[:2] == ["SENT", "Success"], sent
        decode.finish()
    prefill.finish()


def test_decode_process_against_dead_prefill(spawn):
    """Nothing listens on the bootstrap address: the receiver fails with the
    reference's reason and the endpoint in the error text."""
    port = free_port()
    decode = spawn(DECODE, f"127.0.0.1:{port}", 5, "1", "1", 0, name="decode")
    done = decode.line()
    assert done.startswith(f"DONE Failed KVTransferError(bootstrap_room=5, remote_endpoint=127.0.0.1:{port}): "), done
    assert "Could not fetch" in done
    decode.finish()


# ---------------------------------------------------------------- in one process


def test_transfer_poll_values_and_error_text():
    assert [p.value for p in TransferPoll] == [0, 1, 2, 3, 4, 5]
    assert TransferPoll.Failed < TransferPoll.Success and TransferPoll(5).name == "Success"
    e = KVTransferError(7, "boom", "10.0.0.1:8998")
    assert str(e) == "KVTransferError(bootstrap_room=7, remote_endpoint=10.0.0.1:8998): boom"
    assert str(KVTransferError(7, "boom")) == "KVTransferError(bootstrap_room=7): boom"
    assert (e.bootstrap_room, e.failure_reason, e.remote_endpoint) == (7, "boom", "10.0.0.1:8998")


def kv_arrays(seed, pages, item):
    """Two random source KV buffers and a state buffer of 4 slots x 40 bytes,
    and zeroed destinations of the same shapes."""
    rng = np.random.default_rng(seed)
    src = [rng.integers(0, 256, size=(pages, item), dtype=np.uint8) for _ in range(2)]
    src_state = rng.integers(0, 256, size=(4, 40), dtype=np.uint8)
    dst = [np.zeros((pages, item), dtype=np.uint8) for _ in range(2)]
    return src, src_state, dst, np.zeros((4, 40), dtype=np.uint8)


def test_prefix_state_raw_addresses_and_shared_engine(closing):
    """decode_prefix_len skips the prefill's leading pages; state slots move;
    buffers given as raw address lists and through a kv_args object; the
    decode manager runs on a caller's engine."""
    pages, item = 16, 96
    src, src_state, dst, dst_state = kv_arrays(3, pages, item)

    class KVArgs:  # tokenspeed's attribute names, raw addresses
        kv_data_ptrs = [a.ctypes.data for a in src]
        kv_data_lens = [a.nbytes for a in src]
        kv_item_lens = [item, item]
        state_data_ptrs = [src_state.ctypes.data]
        state_data_lens = [src_state.nbytes]
        state_item_lens = [40]

    srv = closing(BootstrapServer("127.0.0.1", 0))
    pm = closing(KVManager("prefill", kv_args=KVArgs(), layer_bufs=[[0, 1]], bootstrap_addr=srv.addr,
                           page_size=2))
    eng = closing(TransferEngine())
    eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")  # raises KVFError on failure
    dm = closing(KVManager("decode", dst, state_data_ptrs=[dst_state], layer_bufs=[[0, 1]], engine=eng,
                           page_size=2))
    assert dm.session_id == eng.get_session_id() == dm.engine.get_session_id()
    assert pm.session_id != dm.session_id

    room = 2024
    r = closing(KVReceiver(dm, srv.addr, room))
    s = closing(KVSender(pm, room))
    assert r.poll() == TransferPoll.Bootstrapped
    # 4 tokens (2 pages) already cached on the decode: prefill pages 9 and 3 are skipped
    src_pages = [9, 3, 4, 12, 0]
    dst_pages = [7, 1, 15]
    r.prefill(dst_pages, aux_index=0, decode_prefix_len=4, state_indices=[2])
    s.send(src_pages, is_last=True, aux_index=0, bootstrap_token=9, state_indices=[1])
    assert wait_final(r) == TransferPoll.Success, r.failure_reason()
    assert wait_final(s) == TransferPoll.Success
    dm.sync()
    for b in range(2):
        for p, d in zip(src_pages[2:], dst_pages):
            assert (dst[b][d] == src[b][p]).all()
        assert not np.delete(dst[b], dst_pages, axis=0).any()
    assert (dst_state[2] == src_state[1]).all() and not np.delete(dst_state, [2], axis=0).any()
    assert r.pop_metadata() == (9, None)
    stats = pm.get_stats()
    assert stats["chunks_sent"] == 1 and stats["bytes_sent"] >= 3 * 2 * item
    r.clear()
    s.clear()
    assert r.poll() == TransferPoll.Success  # concluded state survives clear()


def test_verify_mode_with_prefix_and_state(closing):
    """Verify mode on both sides (issue 16): a transfer with a decode prefix
    and a state slot succeeds, digests reached the decode (nothing counted
    unverified) and nothing failed a check."""
    src, src_state, dst, dst_state = kv_arrays(5, 16, 128)
    srv = closing(BootstrapServer("127.0.0.1", 0))
    pm = closing(KVManager("prefill", src, state_data_ptrs=[src_state], layer_bufs=[[0, 1]],
                           bootstrap_addr=srv.addr, page_size=2, verify=True))
    dm = closing(KVManager("decode", dst, state_data_ptrs=[dst_state], layer_bufs=[[0, 1]], page_size=2,
                           verify=True))
    r = closing(KVReceiver(dm, srv.addr, 77))
    s = closing(KVSender(pm, 77))
    assert r.poll() == TransferPoll.Bootstrapped
    r.prefill([5, 6, 7], aux_index=0, decode_prefix_len=2, state_indices=[3])
    s.send([1, 2, 3, 4], is_last=True, aux_index=0, bootstrap_token=3, state_indices=[0])
    assert wait_final(r) == TransferPoll.Success, r.failure_reason()
    assert wait_final(s) == TransferPoll.Success
    dm.sync()
    for b in range(2):
        for p, d in zip([2, 3, 4], [5, 6, 7]):
            assert (dst[b][d] == src[b][p]).all()
    assert (dst_state[3] == src_state[0]).all()
    ds, ps = dm.get_stats(), pm.get_stats()
    assert ds["verify_failures"] == 0 and ps["verify_failures"] == 0
    assert ds["verify_unverified"] == 0  # the prefill's digests arrived before its Success
    assert ds["rooms_fenced"] == 0


def _verify_pair(closing, room, decode_verify, prefill_verify, pages=16, item=4096):
    src, src_state, dst, dst_state = kv_arrays(room, pages, item)
    srv = closing(BootstrapServer("127.0.0.1", 0))
    pm = closing(KVManager("prefill", src, layer_bufs=[[0, 1]], bootstrap_addr=srv.addr, verify=prefill_verify))
    dm = closing(KVManager("decode", dst, layer_bufs=[[0, 1]], verify=decode_verify))
    r = closing(KVReceiver(dm, srv.addr, room))
    s = closing(KVSender(pm, room))
    return src, dst, pm, dm, r, s


def test_verify_asked_by_the_decode_only(closing):
    """Only the decode in verify mode (docs/WIRE-EXTENSIONS.md, "when only one
    side asks"): the kvferry prefill still sends the digests of what it
    wrote, so the room is verified (nothing counted unverified) and succeeds;
    the prefill took no send-time digests, so it rechecks nothing."""
    src, dst, pm, dm, r, s = _verify_pair(closing, 31, decode_verify=True, prefill_verify=False)
    assert r.poll() == TransferPoll.Bootstrapped
    r.prefill([8, 9, 10], aux_index=0)
    s.send([1, 2, 3], is_last=True, aux_index=0, bootstrap_token=5)
    assert wait_final(r) == TransferPoll.Success, r.failure_reason()
    assert wait_final(s) == TransferPoll.Success
    dm.sync()
    for b in range(2):
        assert (dst[b][[8, 9, 10]] == src[b][[1, 2, 3]]).all()
    ds, ps = dm.get_stats(), pm.get_stats()
    assert ds["verify_unverified"] == 0 and ds["verify_failures"] == 0 and ps["verify_failures"] == 0


CORRUPT = COMMON + r"""
rng = np.random.default_rng(32)
src = [rng.integers(0, 256, size=(16, 4096), dtype=np.uint8) for _ in range(2)]
dst = [np.zeros((16, 4096), dtype=np.uint8) for _ in range(2)]
srv = BootstrapServer("127.0.0.1", 0)
pm = KVManager("prefill", src, layer_bufs=[[0, 1]], bootstrap_addr=srv.addr, verify=False)
dm = KVManager("decode", dst, layer_bufs=[[0, 1]], verify=True)
r = KVReceiver(dm, srv.addr, 32)
s = KVSender(pm, 32)
assert r.poll() == TransferPoll.Bootstrapped
r.prefill([4, 5], aux_index=0)
s.send([6, 7], is_last=True, aux_index=0, bootstrap_token=5)
print("RESULT", TransferPoll(wait(r, TransferPoll.Success)).name, dm.get_stats()["verify_failures"], "|", r.failure_reason(), flush=True)
for h in (r, s, dm, pm, srv):
    h.close()
"""


def test_verify_asked_by_the_decode_only_catches_a_landed_byte(spawn):
    """Same one-sided mode: one landed byte flipped before the decode's check
    fails the room on the decode, naming the KV buffer and page, counted in
    verify_failures. The flip is the testing library's hook, which only the
    test build of the library (libkvferry-testhook.so, $KVFERRY_TESTHOOK_LIB)
    arms from $KVFERRY_TEST_CORRUPT_ROOM: the shipped libkvferry.so has no
    such hook, so this runs in a child process loading the test build."""
    lib = os.environ.get("KVFERRY_TESTHOOK_LIB")
    if not lib:
        pytest.skip("KVFERRY_TESTHOOK_LIB (the test build of the library) not set; ctest sets it")
    env = {"KVFERRY_LIB": os.path.abspath(lib), "KVFERRY_TEST_CORRUPT_ROOM": "32"}
    p = spawn(CORRUPT, name="corrupt", env_set=env)
    head, _, why = p.line().partition(" | ")
    assert head == "RESULT Failed 1", head
    assert "Integrity check failed: KV buffer " in why and " page " in why, why
    p.finish()


def test_verify_on_the_prefill_only_names_a_page_reused_too_early(closing):
    """Only the prefill in verify mode: no digests go to the decode, but the
    prefill hashed its pages at send and rechecks them after the write. A
    source page overwritten after send and before the transfer (sent before
    the decode's M2, so the write cannot have happened yet) fails the room
    on the prefill naming the page, and the decode is told (M3 Failed)."""
    src, dst, pm, dm, r, s = _verify_pair(closing, 33, decode_verify=False, prefill_verify=True)
    s.send([2, 3, 4], is_last=True, aux_index=0, bootstrap_token=5)
    src[1][3][17] ^= 0xFF  # the page went to another request at once
    r.prefill([0, 1, 2], aux_index=0)
    assert wait_final(s) == TransferPoll.Failed
    assert wait_final(r) == TransferPoll.Failed
    why = s.failure_reason()
    assert "source page 3 of KV buffer 1 changed" in why, why
    ps, ds = pm.get_stats(), dm.get_stats()
    assert ps["verify_failures"] == 1 and ds["verify_failures"] == 0


def test_verify_both_sides_a_page_reused_before_the_write_fails_the_decode(closing):
    """Both sides in verify mode: the decode checks its landed bytes against
    the digests taken at send, so a source page overwritten after send and
    before the write (sent before the decode's M2) fails the decode's room
    naming the buffer and page, and the prefill's sender ends Failed too."""
    src, dst, pm, dm, r, s = _verify_pair(closing, 34, decode_verify=True, prefill_verify=True)
    s.send([2, 3, 4], is_last=True, aux_index=0, bootstrap_token=5)
    src[0][4][100] ^= 0xFF
    r.prefill([5, 6, 7], aux_index=0)
    assert wait_final(r) == TransferPoll.Failed
    assert wait_final(s) == TransferPoll.Failed
    why = r.failure_reason()
    assert "Integrity check failed: KV buffer 0 page 7 " in why, why
    assert dm.get_stats()["verify_failures"] == 1


def test_send_layers_two_layers(closing):
    """Layerwise: layer 0 lands alone with no Success; layer 1 with is_last
    completes the room; a layer range past the model is refused."""
    rng = np.random.default_rng(5)
    pages, item = 8, 32
    src = [rng.integers(0, 256, size=(pages, item), dtype=np.uint8) for _ in range(4)]
    dst = [np.zeros((pages, item), dtype=np.uint8) for _ in range(4)]
    lay = [[0, 2], [1, 3]]  # [K0, K1, V0, V1]
    srv = closing(BootstrapServer("127.0.0.1", 0))
    pm = closing(KVManager("prefill", src, layer_bufs=lay, bootstrap_addr=srv.addr))
    dm = closing(KVManager("decode", dst, layer_bufs=lay))
    room = 4242
    r = closing(KVReceiver(dm, srv.addr, room))
    s = closing(KVSender(pm, room))
    src_pages, dst_pages = [5, 6, 1], [0, 3, 4]
    r.prefill(dst_pages, aux_index=0)
    with pytest.raises(KVFerryError):
        s.send_layers(src_pages, 0, 1, 3)
    s.send_layers(src_pages, 0, 0, 1)
    deadline = time.monotonic() + POLL_LIMIT_S
    while pm.get_stats()["chunks_sent"] < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert s.poll() != TransferPoll.Success
    s.send_layers(src_pages[1:], 1, 1, 2)
    s.send_layers(src_pages[:1], 0, 1, 2, is_last=True, aux_index=0, bootstrap_token=17)
    assert wait_final(r) == TransferPoll.Success, r.failure_reason()
    assert wait_final(s) == TransferPoll.Success
    dm.sync()
    for b in range(4):
        for p, d in zip(src_pages, dst_pages):
            assert (dst[b][d] == src[b][p]).all()
        assert not np.delete(dst[b], dst_pages, axis=0).any()
    assert r.pop_metadata() == (17, None)


def test_set_metadata_after_last_layer(closing):
    """The last layer group goes out before sampling (TOKEN_LATER): no
    Success until set_metadata publishes the token, which the decode pops."""
    pages, item = 4, 16
    src = [np.full((pages, item), b + 1, dtype=np.uint8) for b in range(2)]
    dst = [np.zeros((pages, item), dtype=np.uint8) for _ in range(2)]
    srv = closing(BootstrapServer("127.0.0.1", 0))
    pm = closing(KVManager("prefill", src, bootstrap_addr=srv.addr))
    dm = closing(KVManager("decode", dst))
    room = 5151
    r = closing(KVReceiver(dm, srv.addr, room))
    s = closing(KVSender(pm, room))
    r.prefill([2, 3], aux_index=0)
    s.send_layers([0, 1], 0, 0, 1, is_last=True, aux_index=0, bootstrap_token=kvferry.TOKEN_LATER)
    deadline = time.monotonic() + POLL_LIMIT_S
    while pm.get_stats()["chunks_sent"] < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    assert s.poll() != TransferPoll.Success and r.poll() != TransferPoll.Success
    s.set_metadata(321, [4, 5])
    with pytest.raises(KVFerryError):
        s.set_metadata(1)
    assert wait_final(s) == TransferPoll.Success
    assert wait_final(r) == TransferPoll.Success, r.failure_reason()
    assert r.pop_metadata() == (321, [4, 5])


def test_candidate_limit_and_constants_from_the_library(closing):
    """Constants come from the C library (kvf_const); more than
    KVF_MAX_CANDIDATES speculative ids are refused at once with a KVFError
    naming the code, and exactly the limit reaches the decode."""
    from kvferry import _lib
    assert _lib.KVF_MAX_CANDIDATES == kvferry.MAX_CANDIDATES == 64
    assert int(TransferPoll.Success) == _lib.KVF_POLL_SUCCESS
    pages, item = 4, 16
    src = [np.full((pages, item), b + 1, dtype=np.uint8) for b in range(2)]
    dst = [np.zeros((pages, item), dtype=np.uint8) for _ in range(2)]
    srv = closing(BootstrapServer("127.0.0.1", 0))
    pm = closing(KVManager("prefill", src, bootstrap_addr=srv.addr))
    dm = closing(KVManager("decode", dst))
    room = 6464
    r = closing(KVReceiver(dm, srv.addr, room))
    s = closing(KVSender(pm, room))
    r.prefill([2, 3], aux_index=0)
    too_many = list(range(kvferry.MAX_CANDIDATES + 1))
    with pytest.raises(kvferry.KVFError) as ei:
        s.send([0, 1], True, aux_index=0, bootstrap_token=9, spec_candidate_ids=too_many)
    assert ei.value.name == "KVF_ETOOBIG" and ei.value.code == _lib.KVF_ETOOBIG
    s.send([0, 1], True, aux_index=0, bootstrap_token=9, spec_candidate_ids=too_many[:-1])
    assert wait_final(r) == TransferPoll.Success, r.failure_reason()
    assert r.pop_metadata() == (9, too_many[:-1])


def test_receiver_against_nothing_listening(closing):
    dm = closing(KVManager("decode", [np.zeros((4, 16), np.uint8)], http_timeout_ms=2000))
    port = free_port()
    t0 = time.monotonic()
    r = KVReceiver(dm, f"127.0.0.1:{port}", 77)
    assert r.poll() == TransferPoll.Failed
    assert time.monotonic() - t0 < 10
    assert "Could not fetch" in r.failure_reason()
    r.prefill([0], aux_index=0)  # on a Failed receiver: no error, still Failed
    with pytest.raises(KVTransferError) as ei:
        r.failure_exception()
    text = str(ei.value)
    assert text.startswith(f"KVTransferError(bootstrap_room=77, remote_endpoint=127.0.0.1:{port}): Could not fetch")
    assert ei.value.bootstrap_room == 77 and ei.value.remote_endpoint == f"127.0.0.1:{port}"
    # the reason was popped: another call has the reference's default text
    with pytest.raises(KVTransferError, match="Failed due to an unknown reason from another rank"):
        r.failure_exception()
    assert r.poll() == TransferPoll.Failed


def test_event_fd_wakes_a_select_loop(closing):
    """KVManager.event_fd: a scheduler's select() wakes when its room ends,
    with the event cleared before each round of polls."""
    import select
    pages, item = 8, 64
    src, _, dst, _ = kv_arrays(5, pages, item)
    srv = closing(BootstrapServer("127.0.0.1", 0))
    pm = closing(KVManager("prefill", src, bootstrap_addr=srv.addr))
    dm = closing(KVManager("decode", dst))
    fds = {dm.event_fd(): dm, pm.event_fd(): pm}
    assert dm.event_fd() in fds  # the same fd on every call
    r = closing(KVReceiver(dm, srv.addr, 31))
    s = closing(KVSender(pm, 31))
    r.prefill([1, 2], aux_index=0)
    s.send([5, 6], is_last=True, aux_index=0, bootstrap_token=3)
    deadline = time.monotonic() + 20
    woke = True
    while True:
        for m in fds.values():
            m.event_clear()
        states = (r.poll(), s.poll())
        if all(st in (TransferPoll.Success, TransferPoll.Failed) for st in states):
            break
        left = deadline - time.monotonic()
        assert left > 0, states
        woke = bool(select.select(list(fds), [], [], left)[0])
    assert woke, "the final states were seen only when the wait ran out"
    assert states == (TransferPoll.Success, TransferPoll.Success), r.failure_reason()
    dm.sync()
    assert (dst[0][[1, 2]] == src[0][[5, 6]]).all()


def test_sender_abort_and_room_reuse(closing):
    srv = closing(BootstrapServer("127.0.0.1", 0))
    pm = closing(KVManager("prefill", [np.zeros((4, 16), np.uint8)], bootstrap_addr=srv.addr))
    s = KVSender(pm, 5)
    assert s.poll() == TransferPoll.Bootstrapping
    with pytest.raises(KVFerryError):
        KVSender(pm, 5)  # room already live
    s.abort("scheduler gave up")
    assert s.poll() == TransferPoll.Failed
    with pytest.raises(KVTransferError) as ei:
        s.failure_exception()
    assert str(ei.value) == "KVTransferError(bootstrap_room=5): scheduler gave up"
    with pytest.raises(RuntimeError):
        s.send([0])  # cleared
    s2 = closing(KVSender(pm, 5))  # cleared rooms can be reused
    assert s2.poll() == TransferPoll.Bootstrapping


def test_close_releases_live_handles_and_roles(closing):
    srv = closing(BootstrapServer("127.0.0.1", 0))
    pm = KVManager("prefill", [np.zeros((4, 16), np.uint8)], bootstrap_addr=srv.addr)
    dm = KVManager("decode", [np.zeros((4, 16), np.uint8)])
    with pytest.raises(ValueError):
        KVReceiver(pm, srv.addr, 1)
    with pytest.raises(ValueError):
        KVSender(dm, 1)
    senders = [KVSender(pm, room) for room in range(8)]
    r = KVReceiver(dm, srv.addr, 9)
    pm.close()
    dm.close()
    pm.close()  # idempotent
    with pytest.raises(RuntimeError):
        senders[0].poll()
    with pytest.raises(RuntimeError):
        r.prefill([0])
    with pytest.raises(RuntimeError):
        pm.session_id
    with pytest.raises(ValueError):
        KVManager("both", [np.zeros((4, 16), np.uint8)])
    with pytest.raises(ValueError):
        KVManager("decode", [12345])  # an address needs its lengths


def test_bootstrap_server(closing):
    with BootstrapServer("127.0.0.1", 0) as srv:
        assert srv.port > 0 and srv.addr == f"127.0.0.1:{srv.port}"
        with pytest.raises(KVFerryError):
            BootstrapServer("127.0.0.1", srv.port)  # port in use
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as c:
            c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            c.settimeout(5)
            assert c.recv(64).startswith(b"HTTP/1.1 200")
    srv.stop()  # idempotent
    assert kvferry.__version__ == kvferry.version()


def test_shared_engine_close_order():
    """Closing a shared engine closes the managers on it first; a borrowed
    engine object dies with its manager."""
    eng = TransferEngine()
    eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")  # raises KVFError on failure
    dm = KVManager("decode", [np.zeros((4, 16), np.uint8)], engine=eng)
    r = KVReceiver(dm, f"127.0.0.1:{free_port()}", 3)
    eng.close()
    with pytest.raises(RuntimeError):
        dm.session_id
    with pytest.raises(RuntimeError):
        r.prefill([0])
    dm2 = KVManager("decode", [np.zeros((4, 16), np.uint8)])
    borrowed = dm2.engine
    buf = np.zeros(64, np.uint8)
    borrowed.register_memory(buf.ctypes.data, buf.nbytes)
    dm2.engine.close()  # not the owner: the manager keeps its engine
    assert borrowed.get_session_id() == dm2.session_id
    dm2.close()
    with pytest.raises(RuntimeError):
        borrowed.get_session_id()
    with pytest.raises(kvferry.KVFError) as ei:
        borrowed.register_memory(buf.ctypes.data + 64, 8)
    assert ei.value.name == "KVF_ESTATE"
