"""KV managers, senders and receivers shaped like tokenspeed's PD classes.

KVManager wraps one rank's kvf_manager (prefill or decode); KVSender and
KVReceiver are the per-request handles; BootstrapServer is the prefill
instance's HTTP rendezvous point. poll() returns TransferPoll values (the
spec's numbers), failure_exception() raises KVTransferError with the reason
the C library recorded.

Ownership: a handle holds its manager alive; KVManager.close() first clears
every live handle, then destroys the manager. Everything is also released by
the context managers and, as a last resort, by __del__.
"""

import ctypes
import enum
import weakref
from array import array

from ._lib import (
    KVF_ENOTFOUND,
    KVF_ESTATE,
    KVF_MAX_CANDIDATES,
    KVF_ROLE_DECODE,
    KVF_ROLE_PREFILL,
    KVF_SEND_LAST,
    KVF_SEND_LAYERS,
    KVF_SEND_TOKEN_LATER,
    TRACE_STEPS,
    Config,
    KVFError,
    _Closing,
    buffer_address,
    check,
    kvf_kv_buffers,
    kvf_manager_stats,
    kvf_room_trace,
    kvf_send_params,
    lib,
    to_bytes,
)
from . import _lib
from .engine import TransferEngine

# bootstrap_token for the last chunk: "the first token comes later, through
# KVSender.set_metadata" (C: the KVF_SEND_TOKEN_LATER flag). -1 means "no
# token".
TOKEN_LATER = -2

_REASON_CAP = 1024
UNKNOWN_REASON = "Failed due to an unknown reason from another rank"


# The spec's TransferPoll, with the values the library reports (KVF_POLL_*).
TransferPoll = enum.IntEnum("TransferPoll", [
    ("Failed", _lib.KVF_POLL_FAILED),
    ("Bootstrapping", _lib.KVF_POLL_BOOTSTRAPPING),
    ("Bootstrapped", _lib.KVF_POLL_BOOTSTRAPPED),
    ("WaitingForInput", _lib.KVF_POLL_WAITING_FOR_INPUT),
    ("Transferring", _lib.KVF_POLL_TRANSFERRING),
    ("Success", _lib.KVF_POLL_SUCCESS),
], module=__name__)


class KVTransferError(Exception):
    """A request's KV transfer failed; str() is tokenspeed's text form."""

    def __init__(self, bootstrap_room, failure_reason, remote_endpoint=None):
        super().__init__(failure_reason)
        self.bootstrap_room = bootstrap_room
        self.failure_reason = failure_reason
        self.remote_endpoint = remote_endpoint

    def __str__(self):
        if self.remote_endpoint:
            return (f"KVTransferError(bootstrap_room={self.bootstrap_room}, "
                    f"remote_endpoint={self.remote_endpoint}): {self.failure_reason}")
        return f"KVTransferError(bootstrap_room={self.bootstrap_room}): {self.failure_reason}"


def _role(role):
    if isinstance(role, int) and role in (KVF_ROLE_PREFILL, KVF_ROLE_DECODE):
        return int(role)
    for cand in (role, getattr(role, "value", None), getattr(role, "name", None)):
        if isinstance(cand, str) and cand.lower() in ("prefill", "decode"):
            return KVF_ROLE_PREFILL if cand.lower() == "prefill" else KVF_ROLE_DECODE
    raise ValueError(f"kvferry: role must be 'prefill' or 'decode', not {role!r}")


def _i64(values):
    """(array('q'), n) for a list / numpy array of indices; array kept by caller."""
    if values is None:
        return None, 0
    if hasattr(values, "tolist"):
        values = values.tolist()
    a = array("q", values)
    return a, len(a)


def _i32(values):
    """(array('i'), n) for a list / numpy array of candidate ids."""
    if values is None:
        return None, 0
    if hasattr(values, "tolist"):
        values = values.tolist()
    a = array("i", values)
    return a, len(a)


def _ptr(a, ctype):
    if a is None or len(a) == 0:
        return None
    return ctypes.cast(a.buffer_info()[0], ctypes.POINTER(ctype))


def _u64_arr(values):
    return (ctypes.c_uint64 * len(values))(*[int(v) for v in values])


def _describe(kind, ptrs, lens, item_lens, unit_lens, keep):
    """Resolve one buffer family (kv or state) into ctypes arrays. `ptrs`
    entries are ints (with `lens`) or objects with memory (numpy arrays):
    their length defaults to nbytes and their item length to nbytes/shape[0]."""
    ptrs = list(ptrs or [])
    n = len(ptrs)
    lens = list(lens) if lens is not None else [None] * n
    items = list(item_lens) if item_lens is not None else [None] * n
    if len(lens) != n or len(items) != n or (unit_lens is not None and len(unit_lens) != n):
        raise ValueError(f"kvferry: {kind} pointer, length and item-length lists differ in length")
    addrs = []
    for i, p in enumerate(ptrs):
        if isinstance(p, int):
            if lens[i] is None or items[i] is None:
                raise ValueError(f"kvferry: {kind} buffer {i} is an address: give its length and item length")
            addrs.append(p)
            continue
        addr, nbytes, k = buffer_address(p)
        keep.append(k)
        addrs.append(addr)
        if lens[i] is None:
            lens[i] = nbytes
        if items[i] is None:
            shape = getattr(p, "shape", None)
            if not shape or len(shape) < 2:
                raise ValueError(f"kvferry: {kind} buffer {i}: give its item length, or pass an array whose "
                                 "first axis is the page (or slot) index")
            items[i] = nbytes // shape[0]
    c_ptrs = (ctypes.c_void_p * max(n, 1))(*addrs)
    return (n, c_ptrs, _u64_arr(lens), _u64_arr(items),
            _u64_arr(unit_lens) if unit_lens is not None else None)


def trace_dict(t):
    """A kvf_room_trace as a dict: steps as {name: monotonic ns} (reached ones only)."""
    return {
        "room": t.room,
        "side": "prefill" if t.side == KVF_ROLE_PREFILL else "decode",
        "rank": t.rank,
        "status": t.status,
        "finished": bool(t.finished),
        "steps": {name: t.t_ns[i] for i, name in enumerate(TRACE_STEPS) if t.t_ns[i]},
        "t0_unix_ns": t.t0_unix_ns,
        "bytes": t.bytes,
        "descs": t.descs,
        "chunks": t.chunks,
        "retries": t.retries,
        "peers": [{"peer": p.peer.decode(), "transport": p.transport.decode(), "mode": p.mode.decode()}
                  for p in t.peers[:t.npeers]],
        "engine": t.engine.decode(),
        "reason": t.reason.decode(errors="replace"),
    }


class KVManager(_Closing):
    """One rank's KV manager (kvf_manager).

    Buffers: kv_data_ptrs[i] is an address (then kv_data_lens[i] and
    kv_item_lens[i] are needed) or an array whose memory is the buffer (length
    defaults to its nbytes, item length to nbytes / shape[0]: one page along
    the first axis of a 2+-dimensional array). state_data_* likewise.
    layer_bufs (a list per layer of KV buffer indices) overrides the MHA
    layout (layer l = buffers l and n/2 + l).
    A kv_args object with tokenspeed's attribute names may be given instead.
    target_layer_num: layers [0, n) are the target model's, later ones the
    draft model's (labels of heterogeneous-TP fragments); 0 = all target.
    verify: verify mode (XXH3 digests of every page, checked on landing;
    also KVFERRY_VERIFY=1); host memory only.
    Timeouts and sizes left at 0 / None take the C defaults and the
    TOKENSPEED_DISAGGREGATION_* environment overrides.
    """

    def __init__(self, role, kv_data_ptrs=None, kv_data_lens=None, kv_item_lens=None, *,
                 kv_unit_lens=None, state_data_ptrs=None, state_data_lens=None, state_item_lens=None,
                 state_unit_lens=None, layer_bufs=None, kv_args=None,
                 engine_rank=0, world_size=1, dp_size=1, page_size=1, is_mla=False,
                 bootstrap_addr=None, bootstrap_token=None, host="127.0.0.1", engine=None,
                 engine_port=0, auth_token=None, transfer_timeout_ms=0, conns_per_peer=0,
                 bootstrap_timeout_s=0, waiting_timeout_s=0, heartbeat_interval_s=0,
                 heartbeat_max_failures=0, failed_session_ttl_s=None, queue_size=0,
                 http_timeout_ms=0, max_rooms=0, target_layer_num=0, verify=False, trace_rooms=None,
                 control_idle_s=None):
        self._h = None
        self._handles = weakref.WeakSet()
        self._keep = []
        if kv_args is not None:
            get = lambda name, cur: cur if cur is not None else getattr(kv_args, name, None)  # noqa: E731
            kv_data_ptrs = get("kv_data_ptrs", kv_data_ptrs)
            kv_data_lens = get("kv_data_lens", kv_data_lens)
            kv_item_lens = get("kv_item_lens", kv_item_lens)
            kv_unit_lens = get("kv_unit_lens", kv_unit_lens)
            state_data_ptrs = get("state_data_ptrs", state_data_ptrs)
            state_data_lens = get("state_data_lens", state_data_lens)
            state_item_lens = get("state_item_lens", state_item_lens)
            state_unit_lens = get("state_unit_lens", state_unit_lens)
        self.role = _role(role)
        self.bootstrap_addr = bootstrap_addr

        kv = _describe("KV", kv_data_ptrs, kv_data_lens, kv_item_lens, kv_unit_lens, self._keep)
        st = _describe("state", state_data_ptrs, state_data_lens, state_item_lens, state_unit_lens, self._keep)
        bufs = kvf_kv_buffers()
        bufs.n_kv, bufs.kv_ptrs, bufs.kv_lens, bufs.kv_item_lens = kv[0], kv[1], kv[2], kv[3]
        if kv[4] is not None:
            bufs.kv_unit_lens = kv[4]
        bufs.n_state = st[0]
        if st[0]:
            bufs.state_ptrs, bufs.state_lens, bufs.state_item_lens = st[1], st[2], st[3]
            if st[4] is not None:
                bufs.state_unit_lens = st[4]
        if layer_bufs is not None:
            starts, flat = [0], []
            for group in layer_bufs:
                flat.extend(int(b) for b in group)
                starts.append(len(flat))
            bufs.n_layers = len(layer_bufs)
            c_starts = (ctypes.c_uint32 * len(starts))(*starts)
            c_flat = (ctypes.c_uint32 * max(len(flat), 1))(*flat)
            bufs.layer_buf_start, bufs.layer_bufs = c_starts, c_flat

        cfg = Config("manager")
        cfg.set("role", self.role)
        cfg.set("host", host)
        cfg.set("engine_rank", int(engine_rank)).set("world_size", int(world_size)).set("dp_size", int(dp_size))
        cfg.set("page_size", int(page_size)).set("is_mla", int(bool(is_mla)))
        if bootstrap_addr is not None:
            cfg.set("bootstrap_addr", bootstrap_addr)
        if bootstrap_token is not None:
            cfg.set("bootstrap_token", bootstrap_token)
        self._engine_obj = None
        if engine is not None:
            cfg.set_ptr("engine", engine.handle if isinstance(engine, TransferEngine) else int(engine))
            self._engine_obj = engine  # shared, not owned: keep it alive
        ecfg = Config("engine")
        ecfg.set("host", host).set("port", int(engine_port))
        if auth_token is not None:
            ecfg.set("auth_token", auth_token)
        if transfer_timeout_ms:
            ecfg.set("timeout_ms", int(transfer_timeout_ms))
        if conns_per_peer:
            ecfg.set("conns_per_peer", int(conns_per_peer))
        cfg.set_ptr("engine_cfg", ecfg)
        for name, v in (("bootstrap_timeout_s", bootstrap_timeout_s), ("waiting_timeout_s", waiting_timeout_s),
                        ("heartbeat_interval_s", heartbeat_interval_s)):
            if v:
                cfg.set(name, repr(float(v)))
        if heartbeat_max_failures:
            cfg.set("heartbeat_max_failures", int(heartbeat_max_failures))
        if failed_session_ttl_s is not None:
            cfg.set("failed_session_ttl_s", repr(float(failed_session_ttl_s)))
        if queue_size:
            cfg.set("queue_size", int(queue_size))
        if http_timeout_ms:
            cfg.set("http_timeout_ms", int(http_timeout_ms))
        if max_rooms:
            cfg.set("max_rooms", int(max_rooms))
        if target_layer_num:
            cfg.set("target_layer_num", int(target_layer_num))
        if verify:
            cfg.set("verify", 1)
        if trace_rooms is not None:
            cfg.set("trace_rooms", int(trace_rooms))
        if control_idle_s is not None:
            cfg.set("control_idle_s", float(control_idle_s))

        h = ctypes.c_void_p()
        check(lib.kvf_manager_create(cfg.ptr, ctypes.byref(bufs), ctypes.byref(h)),
              "kvf_manager_create")
        self._h = h.value
        if isinstance(engine, TransferEngine):
            engine._users.add(self)  # closing the engine closes this manager first

    def _require(self):
        if self._h is None:
            raise RuntimeError("kvferry: KVManager is closed")
        return self._h

    @property
    def session_id(self):
        return lib.kvf_manager_session_id(self._require()).decode()

    def get_session_id(self):
        return self.session_id

    @property
    def engine(self):
        """The manager's TransferEngine (borrowed: valid while the manager lives)."""
        return TransferEngine._wrap(lib.kvf_manager_engine(self._require()), self)

    def sync(self):
        """kvf_engine_sync on the manager's engine: call on the decode side after
        a receiver reports Success and before reading the KV bytes."""
        lib.kvf_engine_sync(lib.kvf_manager_engine(self._require()))

    def get_stats(self):
        st = kvf_manager_stats()
        lib.kvf_manager_get_stats(self._require(), ctypes.byref(st))
        return {name: getattr(st, name) for name, _ in kvf_manager_stats._fields_}

    def event_fd(self):
        """kvf_manager_event_fd: a file descriptor that becomes readable when one of
        the manager's rooms may have changed state, for select/poll or an asyncio
        reader (loop.add_reader). Clear (event_clear), poll the rooms, then wait on
        it with a timeout. Owned by the manager: do not close it."""
        fd = lib.kvf_manager_event_fd(self._require())
        check(fd if fd < 0 else 0, "kvf_manager_event_fd")
        return fd

    def event_clear(self):
        """kvf_manager_event_clear: the event fd is not readable until the next change."""
        lib.kvf_manager_event_clear(self._require())

    def metrics(self):
        """kvf_manager_metrics: the counters and room histograms as Prometheus text."""
        cap = 1 << 16
        while True:
            buf = ctypes.create_string_buffer(cap)
            n = lib.kvf_manager_metrics(self._require(), buf, cap)
            if n + 4096 < cap:  # whole lines only: a full buffer may have cut some
                return buf.raw[:n].decode()
            cap *= 4

    def trace(self, bootstrap_room):
        """The room's trace as a dict (trace_dict), or None when not traced here:
        the live room's so far, else the newest finished one in the ring."""
        t = kvf_room_trace()
        rc = lib.kvf_manager_trace_get(self._require(), int(bootstrap_room), ctypes.byref(t))
        if rc == KVF_ENOTFOUND:
            return None
        check(rc, "kvf_manager_trace_get")
        return trace_dict(t)

    def traces(self, limit=None):
        """The finished rooms kept in the ring (at most `limit`), oldest first, as dicts."""
        cap = int(limit) if limit is not None else 1 << 16
        arr = (kvf_room_trace * max(cap, 1))()
        n = lib.kvf_manager_trace_copy(self._require(), arr, cap)
        return [trace_dict(arr[i]) for i in range(n)]

    def trace_enable(self, on=True):
        """Record rooms created from now on (or not). KVFerryError without a ring."""
        check(lib.kvf_manager_trace_enable(self._require(), int(bool(on))), "kvf_manager_trace_enable")

    def close(self):
        """Clear every live sender/receiver, then destroy the manager. Idempotent."""
        if self._h is None:
            return
        for handle in list(self._handles):
            handle.clear()
        h, self._h = self._h, None
        lib.kvf_manager_destroy(h)
        self._keep = []
        self._engine_obj = None


class _Handle(_Closing):
    _destroy_fn = None
    _poll_fn = None
    _failure_fn = None

    def __init__(self, mgr, bootstrap_room, remote_endpoint):
        self._h = None
        self.mgr = mgr
        self.bootstrap_room = int(bootstrap_room)
        self.remote_endpoint = remote_endpoint
        self.conclude_state = None
        self._reason = None

    def _check_role(self, want):
        if self.mgr.role != want:
            raise ValueError(f"kvferry: {type(self).__name__} needs a "
                             f"{'prefill' if want == KVF_ROLE_PREFILL else 'decode'} manager")

    def _require(self):
        if self._h is None:
            raise RuntimeError(f"kvferry: {type(self).__name__} for room {self.bootstrap_room} was cleared")
        return self._h

    def poll(self):
        """A TransferPoll; Success and Failed are final (kept after clear())."""
        if self.conclude_state is not None:
            return self.conclude_state
        st = type(self)._poll_fn(self._require())
        if st < 0:
            raise KVFError(st, "poll")
        st = TransferPoll(st)
        if st in (TransferPoll.Success, TransferPoll.Failed):
            self.conclude_state = st
        return st

    def failure_reason(self):
        """The reason the library recorded for this room ("" if none)."""
        if self._h is None:
            return self._reason or ""
        buf = ctypes.create_string_buffer(_REASON_CAP)
        type(self)._failure_fn(self._h, buf, _REASON_CAP)
        return buf.value.decode("utf-8", "replace")

    def failure_exception(self):
        """Conclude Failed, clear the room and raise KVTransferError with the
        recorded reason (tokenspeed's default text when none)."""
        if self.conclude_state is None:
            self.conclude_state = TransferPoll.Failed
        reason = self.failure_reason()
        self.clear()
        self._reason = None  # popped: a second call gets the default text
        raise KVTransferError(self.bootstrap_room, reason or UNKNOWN_REASON, self.remote_endpoint)

    def clear(self):
        """Remove the room from the manager's tables and free the handle. Idempotent."""
        h, self._h = self._h, None
        if h is not None:
            buf = ctypes.create_string_buffer(_REASON_CAP)
            type(self)._failure_fn(h, buf, _REASON_CAP)
            self._reason = buf.value.decode("utf-8", "replace")
            type(self)._destroy_fn(h)

    close = clear


class KVSender(_Handle):
    """Prefill side of one request (kvf_sender)."""

    _destroy_fn = staticmethod(lambda h: lib.kvf_sender_destroy(h))
    _poll_fn = staticmethod(lambda h: lib.kvf_sender_poll(h))
    _failure_fn = staticmethod(lambda h, b, n: lib.kvf_sender_failure(h, b, n))

    def __init__(self, mgr, bootstrap_room, bootstrap_addr=None):
        super().__init__(mgr, bootstrap_room, bootstrap_addr)
        self._check_role(KVF_ROLE_PREFILL)
        h = ctypes.c_void_p()
        check(lib.kvf_sender_create(mgr._require(), self.bootstrap_room, ctypes.byref(h)),
              f"sender for room {self.bootstrap_room}")
        self._h = h.value
        mgr._handles.add(self)

    def _send(self, what, page_indices, is_last, aux_index, bootstrap_token, spec_candidate_ids, state_indices,
              flags=0, index_begin=0, layer_begin=0, layer_end=0):
        """One kvf_sender_send call; arrays are kept alive through it."""
        pages, npages = _i64(page_indices)
        states, nstate = _i64(state_indices)
        cands, ncand = _i32(spec_candidate_ids)
        p = kvf_send_params()
        lib.kvf_send_params_init(ctypes.byref(p))
        p.flags = flags | (KVF_SEND_LAST if is_last else 0)
        p.pages, p.npages = _ptr(pages, ctypes.c_int64), npages
        p.index_begin, p.layer_begin, p.layer_end = index_begin, layer_begin, layer_end
        p.aux_index = -1 if aux_index is None else int(aux_index)
        token = -1 if bootstrap_token is None else int(bootstrap_token)
        if token == TOKEN_LATER and is_last:
            p.flags |= KVF_SEND_TOKEN_LATER
        elif token != TOKEN_LATER:
            p.bootstrap_token = token
        p.cands, p.ncand = _ptr(cands, ctypes.c_int32), ncand
        p.state_slots, p.nstate = _ptr(states, ctypes.c_int64), nstate
        check(lib.kvf_sender_send(self._require(), ctypes.byref(p)), f"{what} for room {self.bootstrap_room}")

    def send(self, page_indices, is_last=True, *, aux_index=None, bootstrap_token=-1, spec_candidate_ids=None,
             state_indices=None):
        """Submit a chunk of prefill page indices (in order onto the decode's
        pages). On the last chunk: the first token (TOKEN_LATER: it comes
        through set_metadata), speculative ids (at most KVF_MAX_CANDIDATES),
        state slots."""
        self._send("send", page_indices, is_last, aux_index, bootstrap_token, spec_candidate_ids, state_indices)

    def send_layers(self, page_indices, index_begin, layer_begin, layer_end, is_last=False, *, aux_index=None,
                    bootstrap_token=-1, spec_candidate_ids=None, state_indices=None):
        """Layerwise chunk (kvf_sender_send with KVF_SEND_LAYERS, tokenspeed's
        send_layerwise): the KV of layers [layer_begin, layer_end) for these
        prefill pages, written onto the decode's destination pages from
        index_begin on (an index after the decode's prefix; nothing is skipped
        here). Call it as each layer group's KV is ready; an empty non-last
        chunk is skipped. The is_last chunk carries the first token,
        speculative ids and state slots, and only after it lands is the room
        Success."""
        if min(int(index_begin), int(layer_begin), int(layer_end)) < 0:
            raise ValueError("index_begin, layer_begin and layer_end must be >= 0")
        self._send("send_layers", page_indices, is_last, aux_index, bootstrap_token, spec_candidate_ids,
                   state_indices, KVF_SEND_LAYERS, int(index_begin), int(layer_begin), int(layer_end))

    def set_metadata(self, bootstrap_token, spec_candidate_ids=None):
        """Publish the first token (-1 none) and speculative ids (tokenspeed's
        set_prefill_metadata) for a last chunk sent with bootstrap_token=
        TOKEN_LATER: once its KV landed, the room becomes Success and the decode
        gets them. Unpublished, the room fails bootstrap_timeout_s after the KV
        landed. A second call raises KVFError (KVF_EEXIST; the first wins)."""
        cands, ncand = _i32(spec_candidate_ids)
        check(lib.kvf_sender_set_metadata(self._require(), -1 if bootstrap_token is None else int(bootstrap_token),
                                          _ptr(cands, ctypes.c_int32), ncand),
              f"set_metadata for room {self.bootstrap_room}")

    def dest_info(self):
        """(real, dummy, decode_prefix_len): the decode destinations whose
        transfer request (M2) arrived, and the first real one's prefix length
        in tokens (tokenspeed's transfer_infos[room])."""
        nreal, ndummy, prefix = ctypes.c_size_t(), ctypes.c_size_t(), ctypes.c_int64()
        check(lib.kvf_sender_dest_info(self._require(), ctypes.byref(nreal), ctypes.byref(ndummy), ctypes.byref(prefix)),
              f"dest_info for room {self.bootstrap_room}")
        return nreal.value, ndummy.value, prefix.value

    def abort(self, reason="Aborted"):
        """Fail the room with `reason` and tell every known decode destination."""
        lib.kvf_sender_abort(self._require(), to_bytes(reason))


class KVReceiver(_Handle):
    """Decode side of one request (kvf_receiver): bootstrap lookups and M1 on
    construction; a lookup failure leaves it Failed with its reason."""

    _destroy_fn = staticmethod(lambda h: lib.kvf_receiver_destroy(h))
    _poll_fn = staticmethod(lambda h: lib.kvf_receiver_poll(h))
    _failure_fn = staticmethod(lambda h, b, n: lib.kvf_receiver_failure(h, b, n))

    def __init__(self, mgr, bootstrap_addr, bootstrap_room):
        super().__init__(mgr, bootstrap_room, bootstrap_addr)
        self._check_role(KVF_ROLE_DECODE)
        self.bootstrap_addr = bootstrap_addr
        h = ctypes.c_void_p()
        check(lib.kvf_receiver_create(mgr._require(), to_bytes(bootstrap_addr), self.bootstrap_room,
                                      ctypes.byref(h)),
              f"receiver for room {self.bootstrap_room}")
        self._h = h.value
        mgr._handles.add(self)

    def prefill(self, kv_indices, aux_index=-1, decode_prefix_len=0, state_indices=None):
        """Send the transfer request (M2): destination pages after the decode
        prefix, request-pool slot, prefix length in tokens, state slots."""
        pages, npages = _i64(kv_indices)
        states, nstate = _i64(state_indices)
        check(lib.kvf_receiver_init(self._require(), _ptr(pages, ctypes.c_int64), npages,
                                    -1 if aux_index is None else int(aux_index), int(decode_prefix_len or 0),
                                    _ptr(states, ctypes.c_int64), nstate),
              f"prefill for room {self.bootstrap_room}")

    init = prefill

    def pop_metadata(self):
        """After Success: (first token, speculative ids or None); a second call
        returns (-1, None)."""
        tok = ctypes.c_int64(-1)
        n = ctypes.c_size_t(0)
        cands = (ctypes.c_int32 * KVF_MAX_CANDIDATES)()
        rc = lib.kvf_receiver_pop_metadata(self._require(), ctypes.byref(tok), cands, KVF_MAX_CANDIDATES,
                                           ctypes.byref(n))
        if rc in (KVF_ENOTFOUND, KVF_ESTATE):
            return -1, None
        check(rc, f"pop_metadata for room {self.bootstrap_room}")
        return int(tok.value), (list(cands[: n.value]) if n.value else None)

    @property
    def supports_spec_candidates(self):
        """tokenspeed's supports_remote_spec_candidates: False for a
        fragmented (heterogeneous-TP) plan, True otherwise (and when the
        receiver failed before it had a plan)."""
        rc = lib.kvf_receiver_supports_spec(self._require())
        return rc != 0

    def pop_bootstrap_token(self):
        return self.pop_metadata()[0]


class BootstrapServer(_Closing):
    """The prefill instance's bootstrap HTTP server (kvf_bootstrap_server).
    port=0 picks a free port (see .port)."""

    def __init__(self, host="0.0.0.0", port=8998, *, auth_token=None, max_body=0, max_conns=0, idle_timeout_s=0):
        self._h = None
        cfg = Config("bootstrap_server")
        cfg.set("host", host).set("port", int(port))
        if auth_token is not None:
            cfg.set("auth_token", auth_token)
        if max_body:
            cfg.set("max_body", int(max_body))
        if max_conns:
            cfg.set("max_conns", int(max_conns))
        if idle_timeout_s:
            cfg.set("idle_timeout_s", int(idle_timeout_s))
        h = ctypes.c_void_p()
        check(lib.kvf_bootstrap_server_create(cfg.ptr, ctypes.byref(h)), f"bootstrap server on {host}:{port}")
        self._h = h.value
        self.host = host
        self.port = int(lib.kvf_bootstrap_server_port(self._h))

    @property
    def addr(self):
        """ "host:port" for peers on this host (0.0.0.0 / :: become loopback)."""
        host = {"0.0.0.0": "127.0.0.1", "::": "[::1]"}.get(self.host, self.host)
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"{host}:{self.port}"

    def stop(self):
        h, self._h = self._h, None
        if h is not None:
            lib.kvf_bootstrap_server_destroy(h)

    close = stop


__all__ = ["TransferPoll", "KVTransferError", "KVManager", "KVSender", "KVReceiver", "BootstrapServer"]
