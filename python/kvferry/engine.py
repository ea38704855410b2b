"""kvferry's transfer engine, with the method names of
mooncake.engine.TransferEngine.

Every method raises KVFError (with .code, the negative KVF_E* value, and
.name, e.g. "KVF_ERANGE") when the C call fails; a method that succeeds
returns None, or its value (a batch id, a status). Code written against
Mooncake's return conventions (0 / negative numbers, never an exception)
imports `mooncake.engine` from python/compat instead, whose TransferEngine
maps these exceptions back to return codes.

Memory registered through the Mooncake methods is named by raw addresses,
which the caller keeps alive; register_array also keeps the Python object
alive until it is unregistered or the engine is closed.
"""

import ctypes
import logging
import re
import threading
import weakref
from array import array

from ._lib import (
    KVF_EINVAL,
    KVF_EAGAIN,
    KVF_ENOTFOUND,
    KVF_ESTATE,
    Config,
    KVFError,
    _Closing,
    buffer_address,
    check,
    kvf_engine_stats,
    lib,
    to_bytes,
)

log = logging.getLogger("kvferry")

_WRITE_WORDS = 6  # u64 fields of struct kvf_write


def _pack_writes(srcs, dsts, lens):
    """A contiguous kvf_write[] for the three lists, as an array('Q') (its
    buffer is passed to C). None when the lengths differ; raises
    OverflowError/TypeError for values that are not u64."""
    if hasattr(srcs, "tolist"):
        srcs = srcs.tolist()
    if hasattr(dsts, "tolist"):
        dsts = dsts.tolist()
    if hasattr(lens, "tolist"):
        lens = lens.tolist()
    n = len(srcs)
    if len(dsts) != n or len(lens) != n:
        return None
    buf = array("Q", bytes(8 * _WRITE_WORDS * n))
    if n:
        buf[0::_WRITE_WORDS] = array("Q", srcs)
        buf[1::_WRITE_WORDS] = array("Q", dsts)
        buf[2::_WRITE_WORDS] = array("Q", lens)
    return buf


def _split_hostname(hostname):
    """Mooncake accepts "host" or "host:port" ("[v6]:port"); kvferry's engine
    wants the host and the port apart."""
    h = hostname.strip()
    m = re.fullmatch(r"\[([^\]]+)\](?::(\d+))?", h)
    if m:
        return m.group(1), int(m.group(2) or 0)
    m = re.fullmatch(r"([^:]+):(\d+)", h)
    if m:
        return m.group(1), int(m.group(2))
    return h, 0


class TransferEngine(_Closing):
    """A kvferry engine with the methods tokenspeed calls on Mooncake's."""

    def __init__(self):
        self._h = None
        self._lock = threading.Lock()
        self._arrays = {}  # addr -> keep-alive of register_array
        self._batches = {}  # batch id -> kvf_batch handle
        self._next_batch = 1
        self._hostname = None
        self._owner = None  # the KVManager whose engine this is (borrowed handle)
        self._users = weakref.WeakSet()  # KVManagers sharing this engine

    # ---- lifecycle -------------------------------------------------------------

    def initialize(self, local_hostname, metadata_server="P2PHANDSHAKE", protocol="tcp", device_name="",
                   *, port=None, auth_token=None, timeout_ms=0, conns_per_peer=0, max_inbound_conns=0):
        """Start listening on local_hostname (optionally "host:port"). Raises
        KVFError (KVF_ESTATE when called twice, KVF_EIO when the port is
        taken, ...).

        metadata_server: only Mooncake's "P2PHANDSHAKE" mode exists here (peers
        are named by "host:port"); anything else is warned about and ignored.
        protocol: every protocol ("rdma", "tcp", ...) is served by kvferry's tcp
        transport; a warning says so when it is not "tcp". device_name (the
        RDMA NIC filter) has no meaning for tcp and is ignored.
        """
        if self._h is not None or self._owner is not None:
            raise KVFError(KVF_ESTATE, "TransferEngine.initialize called twice")
        host, hport = _split_hostname(str(local_hostname or "127.0.0.1"))
        if port is not None:
            hport = int(port)
        if metadata_server not in (None, "", "P2PHANDSHAKE"):
            log.warning("kvferry: metadata server %r ignored; kvferry uses P2P handshakes (session = host:port)",
                        metadata_server)
        proto = str(protocol or "tcp").lower()
        if proto != "tcp":
            log.warning("kvferry: protocol %r is served by kvferry's tcp transport", protocol)
        if device_name:
            log.info("kvferry: device_name %r ignored by the tcp transport", device_name)
        cfg = Config("engine")
        cfg.set("host", host).set("port", hport)
        if auth_token is not None:
            cfg.set("auth_token", auth_token)
        if timeout_ms:
            cfg.set("timeout_ms", int(timeout_ms))
        if conns_per_peer:
            cfg.set("conns_per_peer", int(conns_per_peer))
        if max_inbound_conns:
            cfg.set("max_inbound_conns", int(max_inbound_conns))
        h = ctypes.c_void_p()
        check(lib.kvf_engine_create(cfg.ptr, ctypes.byref(h)), f"engine on {local_hostname}")
        self._h = h.value
        self._hostname = host

    @classmethod
    def _wrap(cls, handle, owner):
        """An engine object over the engine of KVManager `owner` (borrowed:
        usable while the manager is open; close() does not destroy it)."""
        e = cls()
        e._h = handle
        e._owner = owner
        sid = lib.kvf_engine_session_id(handle).decode()
        e._hostname = _split_hostname(sid)[0]
        return e

    def _live(self):
        """The handle, or None when closed (or when the owning manager is)."""
        if self._owner is not None and self._owner._h is None:
            return None
        return self._h

    def close(self):
        """Close the KVManagers sharing this engine, wait for and free
        outstanding batches, then destroy the engine (its registrations go
        with it). Idempotent. No other call may be in progress."""
        for user in list(self._users):
            user.close()
        h, self._h = self._h, None
        with self._lock:
            batches, self._batches = self._batches, {}
            self._arrays.clear()
        for b in batches.values():
            lib.kvf_batch_destroy(b)
        if h is not None and self._owner is None:
            lib.kvf_engine_destroy(h)

    @property
    def handle(self):
        """The kvf_engine pointer (an int), e.g. to share with a KVManager."""
        return self._require()

    def _require(self):
        h = self._live()
        if h is None:
            raise RuntimeError("kvferry: TransferEngine is not initialized (or was closed)")
        return h

    # ---- identity --------------------------------------------------------------

    def get_rpc_port(self):
        return int(lib.kvf_engine_port(self._require()))

    def get_session_id(self):
        """ "host:port", the name peers use to write into this engine."""
        return lib.kvf_engine_session_id(self._require()).decode()

    def get_hostname(self):
        self._require()
        return self._hostname

    # ---- registration -----------------------------------------------------------

    def _handle(self):
        """The handle for a Mooncake-named call: KVFError(KVF_ESTATE) when
        not initialized or closed."""
        h = self._live()
        if h is None:
            raise KVFError(KVF_ESTATE, "TransferEngine is not initialized (or was closed)")
        return h

    # The public methods call these, never each other: a subclass (the
    # Mooncake compat class) may change what the public ones return.

    def _register(self, buffer_addr, capacity):
        check(lib.kvf_engine_register(self._handle(), int(buffer_addr), int(capacity)),
              f"register {int(capacity)} bytes at {int(buffer_addr):#x}")

    def _unregister(self, buffer_addr):
        addr = int(buffer_addr)
        check(lib.kvf_engine_unregister(self._handle(), addr), f"unregister {addr:#x}")
        with self._lock:
            self._arrays.pop(addr, None)

    def register_memory(self, buffer_addr, capacity):
        """Register [buffer_addr, buffer_addr+capacity) for peers' writes and
        as a source of local writes. Raises KVFError (overlap, zero length)."""
        self._register(buffer_addr, capacity)

    def unregister_memory(self, buffer_addr):
        self._unregister(buffer_addr)

    def batch_register_memory(self, buffer_addrs, capacities):
        """All or nothing: on a failure the ones registered are unregistered."""
        if len(buffer_addrs) != len(capacities):
            raise KVFError(KVF_EINVAL, "batch_register_memory: lists differ in length")
        done = []
        try:
            for a, n in zip(buffer_addrs, capacities):
                self._register(a, n)
                done.append(a)
        except KVFError:
            for d in done:
                self._unregister(d)
            raise

    def batch_unregister_memory(self, buffer_addrs):
        """Unregister every address; raises the first failure after trying all."""
        first = None
        for a in buffer_addrs:
            try:
                self._unregister(a)
            except KVFError as e:
                first = first or e
        if first is not None:
            raise first

    # ---- transfers ----------------------------------------------------------------

    def _packed(self, srcs, dsts, lens):
        self._handle()
        try:
            buf = _pack_writes(srcs, dsts, lens)
        except (OverflowError, TypeError, ValueError) as e:
            raise KVFError(KVF_EINVAL, f"bad transfer list: {e}") from None
        if buf is None:
            raise KVFError(KVF_EINVAL, f"batch lists differ in length ({len(srcs)} sources, {len(dsts)} "
                                       f"destinations, {len(lens)} lengths)")
        return buf

    def transfer_sync_write(self, target_hostname, buffer, peer_buffer_address, length):
        """Write `length` bytes from local `buffer` to `peer_buffer_address` in
        the engine `target_hostname` ("host:port") and wait until they landed.
        Raises KVFError (refused range, unknown peer, timeout)."""
        self._write(target_hostname, [buffer], [peer_buffer_address], [length])

    def batch_transfer_sync_write(self, target_hostname, buffers, peer_buffer_addresses, lengths):
        """All blocks as one batch; returns when every byte landed, raises
        KVFError otherwise (including lists of different lengths)."""
        self._write(target_hostname, buffers, peer_buffer_addresses, lengths)

    def _write(self, target_hostname, buffers, peer_buffer_addresses, lengths):
        buf = self._packed(buffers, peer_buffer_addresses, lengths)
        n = len(buf) // _WRITE_WORDS
        check(lib.kvf_engine_write(self._h, to_bytes(target_hostname), buf.buffer_info()[0] if n else None, n),
              f"write to {target_hostname}")

    def _submit(self, target_hostname, buffers, peer_buffer_addresses, lengths):
        buf = self._packed(buffers, peer_buffer_addresses, lengths)
        n = len(buf) // _WRITE_WORDS
        b = ctypes.c_void_p()
        check(lib.kvf_engine_submit(self._h, to_bytes(target_hostname), buf.buffer_info()[0] if n else None, n,
                                    ctypes.byref(b)), f"submit to {target_hostname}")
        with self._lock:
            bid = self._next_batch
            self._next_batch += 1
            self._batches[bid] = b.value
        return bid

    def transfer_submit_write(self, target_hostname, buffer, peer_buffer_address, length):
        """Start one write; returns a batch id (> 0) for transfer_check_status.
        Raises KVFError if it could not start. The source must stay valid
        until the batch is done."""
        return self._submit(target_hostname, [buffer], [peer_buffer_address], [length])

    def batch_transfer_async_write(self, target_hostname, buffers, peer_buffer_addresses, lengths):
        return self._submit(target_hostname, buffers, peer_buffer_addresses, lengths)

    def transfer_check_status(self, batch_id):
        """True = done, False = in progress; raises KVFError when the batch
        failed (or the id is unknown). A finished batch is released; its id is
        then unknown."""
        with self._lock:
            b = self._batches.get(batch_id)
        if b is None:
            raise KVFError(KVF_ENOTFOUND, f"batch {batch_id}")
        st = lib.kvf_batch_poll(b)
        if st == KVF_EAGAIN:
            return False
        with self._lock:
            b = self._batches.pop(batch_id, None)
        if b is not None:
            lib.kvf_batch_destroy(b)
        check(st, f"batch {batch_id}")
        return True

    def get_batch_transfer_status(self, batch_ids):
        """Wait for every batch in batch_ids and release them; raises the
        first failure (KVFError) after all are done."""
        first = None
        for bid in batch_ids:
            with self._lock:
                b = self._batches.pop(bid, None)
            if b is None:
                rc = KVF_ENOTFOUND
            else:
                rc = lib.kvf_batch_wait(b, -1)
                lib.kvf_batch_destroy(b)
            if rc < 0 and first is None:
                first = KVFError(rc, f"batch {bid}")
        if first is not None:
            raise first

    def transfer_sync_read(self, target_hostname, buffer, peer_buffer_address, length):
        """Not supported: kvferry's engine only writes (as tokenspeed does)."""
        raise KVFError(KVF_EINVAL, "transfer_sync_read is not supported (one-sided writes only)")

    # ---- kvferry's own ------------------------------------------------------------

    def register_array(self, arr):
        """Register the memory of a numpy array (or ctypes buffer, bytearray,
        mmap, CPU tensor). Returns (ptr, nbytes); the object is kept alive
        until unregister_array/unregister_memory(ptr) or close(). Raises
        KVFError on failure."""
        self._require()
        addr, n, keep = buffer_address(arr)
        self._register(addr, n)
        with self._lock:
            self._arrays[addr] = keep
        return addr, n

    def unregister_array(self, arr):
        addr, _, _ = buffer_address(arr)
        self._unregister(addr)

    def write(self, target_hostname, writes):
        """Write blocks [(src, dst, len) or (src, dst, len, count, src_stride,
        dst_stride)] as one batch; raises KVFError on failure."""
        h = self._require()
        n = len(writes)
        arr = (ctypes.c_uint64 * (_WRITE_WORDS * n))()
        for i, w in enumerate(writes):
            if len(w) not in (3, 6):
                raise ValueError("kvferry: a write is (src, dst, len) or (src, dst, len, count, src_stride, dst_stride)")
            arr[i * _WRITE_WORDS:i * _WRITE_WORDS + len(w)] = [int(x) for x in w]
        check(lib.kvf_engine_write(h, to_bytes(target_hostname), arr if n else None, n),
              f"write to {target_hostname}")

    def sync(self):
        """Memory ordering point (kvf_engine_sync): call after learning that a
        peer's bytes landed and before reading them."""
        lib.kvf_engine_sync(self._require())

    def get_stats(self):
        st = kvf_engine_stats()
        lib.kvf_engine_get_stats(self._require(), ctypes.byref(st))
        return {name: getattr(st, name) for name, _ in kvf_engine_stats._fields_}

    def __repr__(self):
        if self._live() is None:
            return "<kvferry.TransferEngine (not initialized)>"
        return f"<kvferry.TransferEngine {self.get_session_id()}>"


__all__ = ["TransferEngine", "KVFError"]
