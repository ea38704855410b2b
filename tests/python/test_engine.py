"""The transfer engine from Python: through `mooncake.engine` (python/compat,
Mooncake's return conventions: negative numbers, not exceptions) between two
Python processes and in one, memory registered from numpy arrays and from raw
ctypes addresses, the async variant; the native kvferry.TransferEngine, which
raises KVFError (code and name); and the ctypes struct layouts checked
against the C compiler."""

import ctypes
import logging
import os
import shutil
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PYDIR = os.path.join(ROOT, "python")
COMPAT = os.path.join(PYDIR, "compat")
if PYDIR not in sys.path:
    sys.path.insert(0, PYDIR)
if COMPAT not in sys.path:
    sys.path.insert(0, COMPAT)

import kvferry  # noqa: E402
from kvferry import KVFError, KVFerryError  # noqa: E402
from kvferry import _lib  # noqa: E402
from mooncake.engine import TransferEngine  # noqa: E402  (Mooncake's return codes)

from subproc import Proc, free_port  # noqa: E402  (tests/python/subproc.py)

np = pytest.importorskip("numpy")

LINE_TIMEOUT_S = 20
POLL_LIMIT_S = 10


# ---------------------------------------------------------------- helpers


@pytest.fixture
def spawn(tmp_path):
    procs = []

    def _spawn(script, *args, pythonpath, name="proc", env_set=None):
        env = dict(os.environ)
        env["PYTHONPATH"] = pythonpath
        for k, v in (env_set or {}).items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
        if env.get("KVFERRY_LIB"):  # the children run in tmp_path
            env["KVFERRY_LIB"] = os.path.abspath(env["KVFERRY_LIB"])
        p = Proc(script, args, env, tmp_path, line_timeout=LINE_TIMEOUT_S, finish_timeout=10, name=f"{name}{len(procs)}")
        procs.append(p)
        return p

    yield _spawn
    for p in procs:
        p.kill()


@pytest.fixture
def engines():
    made = []

    def _make(protocol="tcp"):
        e = TransferEngine()
        assert e.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, "") == 0
        made.append(e)
        return e

    yield _make
    for e in made:
        e.close()


def wait_status(engine, bid):
    deadline = time.monotonic() + POLL_LIMIT_S
    while time.monotonic() < deadline:
        st = engine.transfer_check_status(bid)
        if st != 0:
            return st
        time.sleep(0.001)
    raise AssertionError("batch still in progress after %ds" % POLL_LIMIT_S)


# ---------------------------------------------------------------- two processes, Mooncake API only

TARGET = r"""
import sys
import numpy as np
from mooncake.engine import TransferEngine

N = int(sys.argv[1])
e = TransferEngine()
assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0
arr = np.zeros(N, dtype=np.uint8)
assert e.register_memory(arr.ctypes.data, arr.nbytes) == 0
print("READY", e.get_session_id(), arr.ctypes.data, arr.nbytes, flush=True)
for line in sys.stdin:
    cmd = line.split()
    e.sync()  # the writer's reply told us the bytes landed; order them before reading
    if cmd[0] == "ZERO":
        print("OK" if not arr.any() else "BAD %d nonzero" % int(np.count_nonzero(arr)), flush=True)
    elif cmd[0] == "CHECK":
        want = np.random.default_rng(int(cmd[1])).integers(0, 256, size=N, dtype=np.uint8)
        diff = np.flatnonzero(arr != want)
        print("OK" if diff.size == 0 else "BAD %d differ, first at %d" % (diff.size, diff[0]), flush=True)
assert e.unregister_memory(arr.ctypes.data) == 0
"""

WRITER = r"""
import sys, time
import numpy as np
from mooncake.engine import TransferEngine

session, dst, dst_len = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
e = TransferEngine()
assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
bufs = {}

def source(seed):
    src = np.random.default_rng(seed).integers(0, 256, size=dst_len, dtype=np.uint8)
    assert e.register_memory(src.ctypes.data, src.nbytes) == 0
    bufs[seed] = src
    return src

def blocks(src, seed):
    # uneven blocks covering the whole buffer, submitted in shuffled order
    rng = np.random.default_rng(seed + 1000)
    cuts = np.unique(np.concatenate([[0, dst_len], rng.integers(1, dst_len, size=40)]))
    order = rng.permutation(len(cuts) - 1)
    base = src.ctypes.data
    return ([base + int(cuts[i]) for i in order], [dst + int(cuts[i]) for i in order],
            [int(cuts[i + 1] - cuts[i]) for i in order])

for line in sys.stdin:
    cmd = line.split()
    if cmd[0] == "BATCH":
        seed = int(cmd[1])
        s, d, n = blocks(source(seed), seed)
        print("RC", e.batch_transfer_sync_write(session, s, d, n), len(s), flush=True)
    elif cmd[0] == "OUTSIDE":
        # a batch with one block crossing the end of the target's region
        src = source(int(cmd[1]))
        rc = e.batch_transfer_sync_write(session, [src.ctypes.data, src.ctypes.data + 64],
                                         [dst, dst + dst_len - 8], [64, 16])
        print("RC", rc, flush=True)
    elif cmd[0] == "MISMATCH":
        src = source(int(cmd[1]))
        print("RC", e.batch_transfer_sync_write(session, [src.ctypes.data], [dst, dst + 8], [8]), flush=True)
    elif cmd[0] == "ASYNC":
        seed = int(cmd[1])
        src = source(seed)
        bid = e.transfer_submit_write(session, src.ctypes.data, dst, dst_len)
        st, deadline = 0, time.monotonic() + 10
        while bid > 0 and st == 0 and time.monotonic() < deadline:
            st = e.transfer_check_status(bid)
            time.sleep(0.001)
        print("RC", bid > 0, st, flush=True)
"""


def test_two_processes_through_mooncake_api(spawn):
    """Only `mooncake.engine` is imported in both processes; PYTHONPATH holds
    python/compat alone (the compat package finds kvferry next to it)."""
    n = 1 << 20
    target = spawn(TARGET, n, pythonpath=COMPAT, name="target")
    ready = target.line().split()
    assert ready[0] == "READY", ready
    session, addr, length = ready[1], int(ready[2]), int(ready[3])
    host, port = session.rsplit(":", 1)
    assert host == "127.0.0.1" and 0 < int(port) < 65536 and length == n

    writer = spawn(WRITER, session, addr, length, pythonpath=COMPAT, name="writer")
    # refused batches write nothing and return negative, as Mooncake does
    rc = writer.cmd("OUTSIDE 5").split()
    assert rc[0] == "RC" and int(rc[1]) < 0, rc
    assert target.cmd("ZERO") == "OK"
    rc = writer.cmd("MISMATCH 6").split()
    assert int(rc[1]) < 0, rc
    assert target.cmd("ZERO") == "OK"
    # a scattered batch lands byte-exact
    rc = writer.cmd("BATCH 7").split()
    assert rc[:2] == ["RC", "0"] and int(rc[2]) > 10, rc
    assert target.cmd("CHECK 7") == "OK"
    # the async variant: submit, poll to 1
    rc = writer.cmd("ASYNC 8").split()
    assert rc == ["RC", "True", "1"], rc
    assert target.cmd("CHECK 8") == "OK"
    writer.finish()
    target.finish()


def test_compat_module_is_kvferry(spawn):
    script = (
        "import mooncake.engine, kvferry\n"
        "from mooncake.engine import TransferEngine\n"
        "print(issubclass(TransferEngine, kvferry.TransferEngine), kvferry.__version__)\n"
    )
    p = spawn(script, pythonpath=os.pathsep.join([COMPAT, PYDIR]), name="compat")
    assert p.line() == f"True {kvferry.__version__}"
    p.finish()


# ---------------------------------------------------------------- in one process


def test_initialize_session_id_and_protocol_warning(engines, caplog):
    with caplog.at_level(logging.WARNING, logger="kvferry"):
        e = engines("rdma")
    assert any("tcp transport" in r.getMessage() for r in caplog.records)
    port = e.get_rpc_port()
    assert 0 < port < 65536
    assert e.get_session_id() == f"127.0.0.1:{port}"
    assert e.get_hostname() == "127.0.0.1"
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") < 0  # twice


def test_initialize_failure_is_nonzero(engines):
    busy = engines()
    e = TransferEngine()
    try:
        assert e.initialize(f"127.0.0.1:{busy.get_rpc_port()}", "P2PHANDSHAKE", "tcp", "") != 0
        with pytest.raises(RuntimeError):
            e.get_session_id()
        assert e.register_memory(12345, 10) < 0  # not initialized: negative, no crash
    finally:
        e.close()


def test_hostname_with_port(engines):
    port = free_port()
    e = TransferEngine()
    try:
        assert e.initialize(f"127.0.0.1:{port}", "P2PHANDSHAKE", "tcp", "") == 0
        assert e.get_session_id() == f"127.0.0.1:{port}"
    finally:
        e.close()
        e.close()  # idempotent


def test_raw_ctypes_addresses(engines):
    a, b = engines(), engines()
    src = ctypes.create_string_buffer(bytes(range(256)) * 16)
    dst = (ctypes.c_uint8 * 4096)()
    assert a.register_memory(ctypes.addressof(src), 4096) == 0
    assert b.register_memory(ctypes.addressof(dst), ctypes.sizeof(dst)) == 0
    assert a.transfer_sync_write(b.get_session_id(), ctypes.addressof(src) + 100, ctypes.addressof(dst) + 7,
                                 1000) == 0
    b.sync()
    assert bytes(dst[7:1007]) == src.raw[100:1100]
    assert bytes(dst[:7]) == bytes(7) and bytes(dst[1007:]) == bytes(4096 - 1007)
    assert a.unregister_memory(ctypes.addressof(src)) == 0
    assert b.unregister_memory(ctypes.addressof(dst)) == 0


def test_register_array_numpy_and_buffers(engines):
    a, b = engines(), engines()
    src = np.arange(4096, dtype=np.uint32)
    dst = np.zeros((16, 256), dtype=np.uint32)
    ptr, n = a.register_array(src)
    assert (ptr, n) == (src.ctypes.data, src.nbytes)
    dptr, dn = b.register_array(dst)
    assert (dptr, dn) == (dst.ctypes.data, dst.nbytes)
    # pages 3 and 9 of src into rows 0 and 15 of dst
    page = 256 * 4
    assert a.batch_transfer_sync_write(b.get_session_id(), [ptr + 3 * page, ptr + 9 * page],
                                       [dptr + 15 * page, dptr], [page, page]) == 0
    b.sync()
    assert (dst[15] == src[3 * 256:4 * 256]).all() and (dst[0] == src[9 * 256:10 * 256]).all()
    assert not dst[1:15].any()
    # numpy lists of addresses work as well as Python lists
    assert a.batch_transfer_sync_write(b.get_session_id(), np.array([ptr], dtype=np.uint64),
                                       np.array([dptr + page], dtype=np.uint64),
                                       np.array([page], dtype=np.uint64)) == 0
    b.sync()
    assert (dst[1] == src[:256]).all()
    # a bytearray and a ctypes array register too
    ba = bytearray(1024)
    bptr, bn = b.register_array(ba)
    assert bn == 1024
    assert a.transfer_sync_write(b.get_session_id(), ptr, bptr, 1024) == 0
    b.sync()
    assert bytes(ba) == src[:256].tobytes()
    b.unregister_array(ba)
    # after unregistering, the same address is refused
    assert a.transfer_sync_write(b.get_session_id(), ptr, bptr, 16) < 0
    # non-contiguous and read-only arrays are rejected up front
    with pytest.raises(ValueError):
        a.register_array(np.zeros((8, 8))[:, ::2])
    ro = np.zeros(64)
    ro.flags.writeable = False
    with pytest.raises(ValueError):
        a.register_array(ro)
    # overlapping registration
    with pytest.raises(KVFerryError) as ei:
        a.register_array(src)
    assert ei.value.code == _lib.KVF_EEXIST


def test_failures_are_negative_returns(engines):
    a, b = engines(), engines()
    src = np.full(4096, 7, dtype=np.uint8)
    dst = np.zeros(4096, dtype=np.uint8)
    ptr, _ = a.register_array(src)
    dptr, _ = b.register_array(dst)
    sid = b.get_session_id()
    assert a.transfer_sync_write(sid, ptr, dptr + 4090, 16) < 0  # crosses the end of the region
    assert a.transfer_sync_write(sid, ptr, dptr - 1, 2) < 0  # starts before it
    assert a.transfer_sync_write(sid, ptr + 4090, dptr, 16) < 0  # source not registered locally
    assert a.batch_transfer_sync_write(sid, [ptr, ptr], [dptr], [1, 1]) < 0  # length mismatch
    assert a.batch_transfer_sync_write(sid, [ptr], [dptr], [-1]) < 0  # not a u64
    assert a.transfer_sync_write("no-port", ptr, dptr, 16) < 0
    assert a.transfer_sync_write(f"127.0.0.1:{free_port()}", ptr, dptr, 16) < 0  # nobody listens
    b.sync()
    assert not dst.any()
    assert a.register_memory(ptr + 8, 16) < 0  # overlaps
    assert a.register_memory(ptr + 100000, 0) < 0  # empty
    assert a.unregister_memory(ptr + 8) < 0  # no region starts there
    assert a.batch_transfer_sync_write(sid, [], [], []) == 0  # nothing to move
    assert a.transfer_sync_read(sid, ptr, dptr, 16) < 0  # writes only
    stats = b.get_stats()
    assert stats["batches_refused"] >= 2 and stats["batches_received"] == 0


def test_async_submit_and_check_status(engines):
    a, b = engines(), engines()
    src = np.arange(1 << 16, dtype=np.uint8)
    dst = np.zeros(1 << 16, dtype=np.uint8)
    ptr, n = a.register_array(src)
    dptr, _ = b.register_array(dst)
    sid = b.get_session_id()
    bid = a.transfer_submit_write(sid, ptr, dptr, n)
    assert bid > 0
    assert wait_status(a, bid) == 1
    assert a.transfer_check_status(bid) < 0  # released once done
    b.sync()
    assert (dst == src).all()
    # a refused batch fails at submit or in its status
    bid = a.transfer_submit_write(sid, ptr, dptr + 1, n)
    assert bid < 0 or wait_status(a, bid) < 0
    # batch async + blocking wait on several ids
    dst[:] = 0
    ids = [a.batch_transfer_async_write(sid, [ptr + i * 4096], [dptr + i * 4096], [4096]) for i in range(16)]
    assert all(i > 0 for i in ids)
    assert a.get_batch_transfer_status(ids) == 0
    b.sync()
    assert (dst == src).all()
    assert a.get_batch_transfer_status([10 ** 9]) < 0
    assert a.transfer_check_status(10 ** 9) < 0
    # close() waits for and frees batches never checked
    a.transfer_submit_write(sid, ptr, dptr, n)


def test_native_write_raises_and_strides(engines):
    a, b = engines(), engines()
    src = np.arange(1024, dtype=np.uint8)
    dst = np.zeros(1024, dtype=np.uint8)
    ptr, _ = a.register_array(src)
    dptr, _ = b.register_array(dst)
    # 4 pieces of 8 bytes: every 64th source byte block into every 16th destination
    a.write(b.get_session_id(), [(ptr, dptr, 8, 4, 64, 16)])
    b.sync()
    for i in range(4):
        assert (dst[i * 16:i * 16 + 8] == src[i * 64:i * 64 + 8]).all()
    with pytest.raises(KVFerryError) as ei:
        a.write(b.get_session_id(), [(ptr, dptr + 1020, 8)])
    assert ei.value.code == _lib.KVF_ERANGE
    with pytest.raises(ValueError):
        a.write(b.get_session_id(), [(ptr, dptr)])


def test_context_manager_and_repr():
    with kvferry.TransferEngine() as e:
        assert "not initialized" in repr(e)
        assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") is None
        assert e.get_session_id() in repr(e)
    with pytest.raises(RuntimeError):
        e.get_rpc_port()


def test_native_engine_raises_kvferror():
    """kvferry.TransferEngine raises KVFError (code and C name) where the
    Mooncake class returns the code."""
    a, b = kvferry.TransferEngine(), kvferry.TransferEngine()
    try:
        with pytest.raises(KVFError) as ei:
            a.register_memory(12345, 10)  # not initialized
        assert ei.value.code == _lib.KVF_ESTATE and ei.value.name == "KVF_ESTATE"
        a.initialize("127.0.0.1")
        b.initialize("127.0.0.1")
        with pytest.raises(KVFError) as ei:
            a.initialize("127.0.0.1")
        assert ei.value.name == "KVF_ESTATE"
        src = (ctypes.c_uint8 * 4096)(*range(256), *range(256))
        dst = (ctypes.c_uint8 * 4096)()
        a.register_memory(ctypes.addressof(src), 4096)
        b.register_memory(ctypes.addressof(dst), 4096)
        sid = b.get_session_id()
        with pytest.raises(KVFError) as ei:
            a.transfer_sync_write(sid, ctypes.addressof(src), ctypes.addressof(dst) + 4090, 16)
        assert ei.value.code == _lib.KVF_ERANGE and "KVF_ERANGE" in str(ei.value)
        assert a.transfer_sync_write(sid, ctypes.addressof(src), ctypes.addressof(dst), 512) is None
        bid = a.transfer_submit_write(sid, ctypes.addressof(src), ctypes.addressof(dst), 4096)
        deadline = time.monotonic() + POLL_LIMIT_S
        while not a.transfer_check_status(bid):
            assert time.monotonic() < deadline
            time.sleep(0.001)
        with pytest.raises(KVFError) as ei:
            a.transfer_check_status(bid)  # released once done
        assert ei.value.code == _lib.KVF_ENOTFOUND
        b.sync()
        assert bytes(dst) == bytes(src)
        with pytest.raises(KVFError):
            a.transfer_sync_read(sid, 0, 0, 1)
        assert KVFerryError is KVFError
    finally:
        a.close()
        b.close()


# ---------------------------------------------------------------- library loading and layouts


def test_library_discovery_messages(spawn):
    script = "import kvferry\nprint(kvferry.LIB_PATH)\n"
    p = spawn(script, pythonpath=PYDIR, name="badlib", env_set={"KVFERRY_LIB": "/nonexistent/libkvferry.so"})
    with pytest.raises(AssertionError, match="KVFERRY_LIB=/nonexistent/libkvferry.so does not exist"):
        p.line()
    built = os.path.join(ROOT, "build", "libkvferry.so")
    if os.path.exists(built):  # without KVFERRY_LIB the package walks up to the checkout's build/
        p = spawn(script, pythonpath=PYDIR, name="walkup", env_set={"KVFERRY_LIB": None})
        assert p.line() == built
        p.finish()


def test_imports_and_works_without_numpy(spawn):
    script = r"""
import ctypes, sys
sys.modules["numpy"] = None  # any import of numpy now fails
import kvferry
a, b = kvferry.TransferEngine(), kvferry.TransferEngine()
a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
b.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
src = bytearray(b"kvferry!" * 64)
dst = (ctypes.c_char * 512)()
sp, n = a.register_array(src)
dp, _ = b.register_array(dst)
a.transfer_sync_write(b.get_session_id(), sp, dp, n)
b.sync()
print(dst.raw == bytes(src))
a.close(); b.close()
"""
    p = spawn(script, pythonpath=PYDIR, name="nonumpy")
    assert p.line() == "True"
    p.finish()


def test_prototype_table_is_the_whole_api():
    """_lib declares exactly the functions the library exports (nm -D)."""
    nm = shutil.which("nm")
    if not nm:
        pytest.skip("no nm")
    out = subprocess.run([nm, "-D", "--defined-only", _lib.LIB_PATH], check=True, capture_output=True, text=True,
                         timeout=30).stdout
    exported = {line.split()[2] for line in out.splitlines() if len(line.split()) >= 3}
    assert exported == set(_lib._PROTOTYPES)
    assert not _lib.lib.missing


def test_struct_layouts_match_c(tmp_path):
    """Every ctypes structure has the C header's size and field offsets."""
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        pytest.skip("no C compiler to check layouts against")
    lines = ["#include <stdio.h>", "#include <stddef.h>", '#include "kvferry.h"', "int main(void) {"]
    expect = []
    for name, cls in _lib.STRUCTS.items():
        lines.append(f'  printf("%zu\\n", sizeof({name}));')
        expect.append(ctypes.sizeof(cls))
        for field, _ in cls._fields_:
            lines.append(f'  printf("%zu\\n", offsetof({name}, {field}));')
            expect.append(getattr(cls, field).offset)
    lines += ["  return 0;", "}"]
    src = tmp_path / "layout.c"
    src.write_text("\n".join(lines) + "\n")
    exe = tmp_path / "layout"
    subprocess.run([cc, "-std=c11", "-I", os.path.join(ROOT, "include"), str(src), "-o", str(exe)], check=True,
                   timeout=60)
    out = subprocess.run([str(exe)], check=True, capture_output=True, timeout=10).stdout.split()
    assert [int(x) for x in out] == expect
