"""Loading libkvferry.so and declaring its C API for ctypes.

Everything comes from the library itself where it can:
- every C function is declared once, in _PROTOTYPES below;
- the constants (error codes, KVF_POLL_*, KVF_ROLE_*, KVF_SEND_*,
  KVF_MAX_CANDIDATES, ...) are read with kvf_const_at when the module loads,
  and exported here under their C names;
- the config structs (engine, manager, bootstrap server) are not mirrored:
  Config allocates the library's size, fills it with kvf_*_config_init and
  sets fields by name through kvf_*_config_set, so a field added in C needs
  no change here.
Only the plain data structs the calls exchange (kvf_write, kvf_kv_buffers,
kvf_send_params, the stats) are declared with ctypes; tests/python checks
their layout against the C compiler.
"""

import ctypes
import ctypes.util
import os

c_u8p = ctypes.POINTER(ctypes.c_uint8)
c_u64p = ctypes.POINTER(ctypes.c_uint64)
c_i64p = ctypes.POINTER(ctypes.c_int64)
c_i32p = ctypes.POINTER(ctypes.c_int32)
c_u32p = ctypes.POINTER(ctypes.c_uint32)


class kvf_write(ctypes.Structure):
    _fields_ = [
        ("src", ctypes.c_uint64),
        ("dst", ctypes.c_uint64),
        ("len", ctypes.c_uint64),
        ("count", ctypes.c_uint64),
        ("src_stride", ctypes.c_uint64),
        ("dst_stride", ctypes.c_uint64),
    ]


class kvf_engine_stats(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_uint64)
        for name in (
            "batches_sent",
            "bytes_sent",
            "batches_failed",
            "batches_received",
            "bytes_received",
            "batches_refused",
            "auth_refused",
            "protocol_errors",
            "conns_refused",
            "conns_timed_out",
            "conns_evicted",
            "peers_ucx",
            "peers_tcp",
            "chunks_fenced",
            "peers_read",
            "reads_refused",
            "reads_late",
            "bytes_read_direct",
            "bytes_mapped_ahead",
        )
    ]


class kvf_kv_buffers(ctypes.Structure):
    _fields_ = [
        ("n_kv", ctypes.c_size_t),
        ("kv_ptrs", ctypes.POINTER(ctypes.c_void_p)),
        ("kv_lens", c_u64p),
        ("kv_item_lens", c_u64p),
        ("kv_unit_lens", c_u64p),
        ("n_layers", ctypes.c_size_t),
        ("layer_buf_start", c_u32p),
        ("layer_bufs", c_u32p),
        ("n_state", ctypes.c_size_t),
        ("state_ptrs", ctypes.POINTER(ctypes.c_void_p)),
        ("state_lens", c_u64p),
        ("state_item_lens", c_u64p),
        ("state_unit_lens", c_u64p),
    ]


class kvf_manager_stats(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_uint64)
        for name in (
            "messages_received",
            "messages_malformed",
            "messages_unknown_room",
            "live_rooms",
            "chunks_sent",
            "bytes_sent",
            "heartbeat_failures",
            "node_failures",
            "messages_forged",
            "verify_failures",
            "verify_unverified",
            "rooms_fenced",
            "rooms_created",
            "rooms_cleared",
            "rooms_early",
            "rooms_early_dropped",
            "rooms_rejected_full",
            "rooms_dropped_unknown",
            "rooms_rejected_invalid",
            "rooms_duplicate_responses",
        )
    ]


class kvf_send_params(ctypes.Structure):
    """One chunk for kvf_sender_send; `size` is set by kvf_send_params_init."""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("flags", ctypes.c_uint32),
        ("pages", c_i64p),
        ("npages", ctypes.c_size_t),
        ("index_begin", ctypes.c_size_t),
        ("layer_begin", ctypes.c_size_t),
        ("layer_end", ctypes.c_size_t),
        ("aux_index", ctypes.c_int64),
        ("bootstrap_token", ctypes.c_int64),
        ("cands", c_i32p),
        ("ncand", ctypes.c_size_t),
        ("state_slots", c_i64p),
        ("nstate", ctypes.c_size_t),
    ]


KVF_TRACE_NSTEPS = 15
_ADDR_LEN = 264  # KVF_ADDR_MAX + 1, the trace records' address fields (checked against the library below)
KVF_TRACE_MAX_PEERS = 4
KVF_TRACE_REASON_MAX = 160
# kvf_trace_step values, in enum order (include/kvferry/trace.h).
TRACE_STEPS = (
    "created", "discovery_done", "m1_sent", "m2_sent", "first_byte", "last_byte", "completion_seen",
    "m2_received", "sender_created", "first_chunk_submitted", "last_chunk_submitted", "first_byte_sent",
    "last_byte_done", "completion_sent", "final",
)


class kvf_trace_peer(ctypes.Structure):
    _fields_ = [("peer", ctypes.c_char * _ADDR_LEN), ("transport", ctypes.c_char * 8), ("mode", ctypes.c_char * 8)]


class kvf_room_trace(ctypes.Structure):
    """One room as one side saw it (kvf_manager_trace_get / _copy)."""

    _fields_ = [
        ("room", ctypes.c_int64),
        ("side", ctypes.c_int),
        ("rank", ctypes.c_int),
        ("status", ctypes.c_int),
        ("finished", ctypes.c_int),
        ("t_ns", ctypes.c_int64 * KVF_TRACE_NSTEPS),
        ("t0_unix_ns", ctypes.c_int64),
        ("bytes", ctypes.c_uint64),
        ("descs", ctypes.c_uint64),
        ("chunks", ctypes.c_uint64),
        ("retries", ctypes.c_uint64),
        ("npeers", ctypes.c_uint32),
        ("peers", kvf_trace_peer * KVF_TRACE_MAX_PEERS),
        ("engine", ctypes.c_char * _ADDR_LEN),
        ("reason", ctypes.c_char * KVF_TRACE_REASON_MAX),
    ]


# Every struct the binding declares, for the layout test.
STRUCTS = {
    "kvf_trace_peer": kvf_trace_peer,
    "kvf_room_trace": kvf_room_trace,
    "kvf_write": kvf_write,
    "kvf_engine_stats": kvf_engine_stats,
    "kvf_kv_buffers": kvf_kv_buffers,
    "kvf_manager_stats": kvf_manager_stats,
    "kvf_send_params": kvf_send_params,
}

_vp = ctypes.c_void_p
_int = ctypes.c_int
_cp = ctypes.c_char_p
_sz = ctypes.c_size_t
_i64 = ctypes.c_int64
_P = ctypes.POINTER

# name: (restype, argtypes): the whole C API, in header order. Handles and
# configs are opaque void pointers.
_PROTOTYPES = {
    # common.h
    "kvf_strerror": (_cp, [_int]),
    "kvf_err_name": (_cp, [_int]),
    "kvf_const": (_int, [_cp, c_i64p]),
    "kvf_const_at": (_cp, [_sz, c_i64p]),
    "kvf_set_log_level": (None, [_int]),
    "kvf_version": (_cp, []),
    "kvf_version_compatible": (_int, [_int, _int]),
    "kvf_wakeups": (ctypes.c_uint64, []),
    # bootstrap.h
    "kvf_bootstrap_server_config_init": (None, [_vp]),
    "kvf_bootstrap_server_config_set": (_int, [_vp, _cp, _cp]),
    "kvf_bootstrap_server_create": (_int, [_vp, _P(_vp)]),
    "kvf_bootstrap_server_port": (ctypes.c_uint16, [_vp]),
    "kvf_bootstrap_server_add_engine": (_int, [_vp, _vp]),
    "kvf_bootstrap_server_add_metrics": (_int, [_vp, _vp, _vp]),
    "kvf_bootstrap_server_destroy": (None, [_vp]),
    # engine.h
    "kvf_engine_config_init": (None, [_vp]),
    "kvf_engine_config_set": (_int, [_vp, _cp, _cp]),
    "kvf_engine_create": (_int, [_vp, _P(_vp)]),
    "kvf_engine_destroy": (None, [_vp]),
    "kvf_engine_session_id": (_cp, [_vp]),
    "kvf_engine_port": (ctypes.c_uint16, [_vp]),
    "kvf_engine_register": (_int, [_vp, _vp, _sz]),
    "kvf_engine_unregister": (_int, [_vp, _vp]),
    "kvf_engine_write": (_int, [_vp, _cp, _vp, _sz]),
    "kvf_engine_submit": (_int, [_vp, _cp, _vp, _sz, _P(_vp)]),
    "kvf_batch_opts_init": (None, [_vp]),
    "kvf_engine_submit_ex": (_int, [_vp, _cp, _vp, _sz, _vp, _P(_vp)]),
    "kvf_engine_write_ex": (_int, [_vp, _cp, _vp, _sz, _vp]),
    "kvf_engine_fence_open": (_int, [_vp, ctypes.c_uint64, c_u64p]),
    "kvf_engine_fence_close": (_int, [_vp, ctypes.c_uint64, ctypes.c_uint64, _int]),
    "kvf_batch_poll": (_int, [_vp]),
    "kvf_batch_wait": (_int, [_vp, _int]),
    "kvf_batch_destroy": (None, [_vp]),
    "kvf_engine_sync": (None, [_vp]),
    "kvf_engine_get_stats": (None, [_vp, _P(kvf_engine_stats)]),
    # kv.h
    "kvf_manager_config_init": (None, [_vp]),
    "kvf_manager_config_set": (_int, [_vp, _cp, _cp]),
    "kvf_manager_config_set_ptr": (_int, [_vp, _cp, _vp]),
    "kvf_manager_create": (_int, [_vp, _P(kvf_kv_buffers), _P(_vp)]),
    "kvf_manager_destroy": (None, [_vp]),
    "kvf_manager_session_id": (_cp, [_vp]),
    "kvf_manager_engine": (_vp, [_vp]),
    "kvf_manager_get_stats": (None, [_vp, _P(kvf_manager_stats)]),
    "kvf_manager_metrics": (_sz, [_vp, _cp, _sz]),
    "kvf_manager_event_fd": (_int, [_vp]),
    "kvf_manager_event_clear": (None, [_vp]),
    "kvf_receiver_create": (_int, [_vp, _cp, _i64, _P(_vp)]),
    "kvf_receiver_init": (_int, [_vp, c_i64p, _sz, _i64, _i64, c_i64p, _sz]),
    "kvf_receiver_poll": (_int, [_vp]),
    "kvf_receiver_failure": (None, [_vp, _cp, _sz]),
    "kvf_receiver_pop_metadata": (_int, [_vp, c_i64p, c_i32p, _sz, _P(_sz)]),
    "kvf_receiver_supports_spec": (_int, [_vp]),
    "kvf_receiver_destroy": (None, [_vp]),
    "kvf_sender_create": (_int, [_vp, _i64, _P(_vp)]),
    "kvf_send_params_init": (None, [_P(kvf_send_params)]),
    "kvf_sender_send": (_int, [_vp, _P(kvf_send_params)]),
    "kvf_sender_set_metadata": (_int, [_vp, _i64, c_i32p, _sz]),
    "kvf_sender_dest_info": (_int, [_vp, _P(_sz), _P(_sz), c_i64p]),
    "kvf_sender_poll": (_int, [_vp]),
    "kvf_sender_failure": (None, [_vp, _cp, _sz]),
    "kvf_sender_abort": (None, [_vp, _cp]),
    "kvf_sender_destroy": (None, [_vp]),
}

# Room traces (issue 25, trace.h).
_PROTOTYPES.update({
    "kvf_trace_step_name": (_cp, [_int]),
    "kvf_manager_trace_get": (_int, [_vp, _i64, _P(kvf_room_trace)]),
    "kvf_manager_trace_copy": (_sz, [_vp, _P(kvf_room_trace), _sz]),
    "kvf_manager_trace_enable": (_int, [_vp, _int]),
    "kvf_trace_format_json": (_sz, [_P(kvf_room_trace), ctypes.c_char_p, _sz]),
    "kvf_trace_parse_json": (_int, [_cp, _P(kvf_room_trace)]),
})

# Transports (issue 10): capabilities, per-peer route, engine-allocated pools.
_PROTOTYPES.update({
    "kvf_engine_transports": (_cp, []),
    "kvf_engine_transport": (_cp, [_vp]),
    "kvf_engine_peer_transport": (_int, [_vp, _cp, ctypes.c_char_p, _sz]),
    "kvf_engine_peer_routes": (_int, [_vp, ctypes.c_char_p, _sz]),
    "kvf_engine_alloc_pool": (_int, [_vp, _sz, ctypes.POINTER(_vp)]),
    "kvf_engine_free_pool": (_int, [_vp, _vp]),
})


def _candidates():
    """Where to look for the library, in order (see README, "Python")."""
    env = os.environ.get("KVFERRY_LIB")
    if env:
        return [env], True
    here = os.path.dirname(os.path.abspath(__file__))
    found = []
    for name in ("libkvferry.so", "libkvferry.so.0"):
        found.append(os.path.join(here, name))
    d = here
    for _ in range(6):  # python/kvferry -> python -> repo root, and a little beyond
        d = os.path.dirname(d)
        found.append(os.path.join(d, "build", "libkvferry.so"))
    return found, False


def _load():
    paths, from_env = _candidates()
    tried = []
    for p in paths:
        if not os.path.exists(p):
            tried.append(p)
            continue
        try:
            return ctypes.CDLL(p), p
        except OSError as e:
            if from_env:
                raise ImportError(f"kvferry: KVFERRY_LIB={p} could not be loaded: {e}") from e
            tried.append(f"{p} ({e})")
    if from_env:
        raise ImportError(f"kvferry: KVFERRY_LIB={paths[0]} does not exist")
    name = ctypes.util.find_library("kvferry")
    if name:
        try:
            return ctypes.CDLL(name), name
        except OSError as e:
            tried.append(f"{name} ({e})")
    else:
        tried.append('ctypes.util.find_library("kvferry"): not found')
    raise ImportError(
        "kvferry: libkvferry.so not found. Build it (`make` in the kvferry repository, "
        "which writes build/libkvferry.so), `make install` it, or point KVFERRY_LIB at it. "
        "Tried: " + "; ".join(tried)
    )


class _Missing:
    """Stands in for a symbol the loaded library lacks (an older or partial
    build), so the rest of the API stays usable; calling it explains."""

    def __init__(self, name, path):
        self.name, self.path = name, path

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"kvferry: {self.path} has no symbol {self.name}; rebuild the library")


class _Api:
    pass


def _bind(cdll, path):
    api = _Api()
    missing = []
    for name, (restype, argtypes) in _PROTOTYPES.items():
        try:
            fn = getattr(cdll, name)
        except AttributeError:
            setattr(api, name, _Missing(name, path))
            missing.append(name)
            continue
        fn.restype = restype
        fn.argtypes = argtypes
        setattr(api, name, fn)
    api.missing = tuple(missing)
    return api


_cdll, LIB_PATH = _load()
lib = _bind(_cdll, LIB_PATH)


def _constants(api):
    """{name: value} of every constant the library lists (kvf_const_at)."""
    out = {}
    value = ctypes.c_int64()
    i = 0
    while True:
        name = api.kvf_const_at(i, ctypes.byref(value))
        if not name:
            return out
        out[name.decode()] = int(value.value)
        i += 1


CONSTS = _constants(lib)
globals().update(CONSTS)  # KVF_EINVAL, KVF_POLL_SUCCESS, KVF_MAX_CANDIDATES, ... as module attributes
if CONSTS.get("KVF_ADDR_MAX", _ADDR_LEN - 1) != _ADDR_LEN - 1:
    raise ImportError(f"{LIB_PATH}: KVF_ADDR_MAX {CONSTS['KVF_ADDR_MAX']} != {_ADDR_LEN - 1}: a binding of another version")


def strerror(code):
    return lib.kvf_strerror(int(code)).decode("utf-8", "replace")


def err_name(code):
    """"KVF_EINVAL" for KVF_EINVAL (kvf_err_name)."""
    return lib.kvf_err_name(int(code)).decode()


class KVFError(Exception):
    """A kvferry C call failed: `code` is the negative KVF_E* value, `name`
    its C name ("KVF_ERANGE"), `what` the operation."""

    def __init__(self, code, what=""):
        self.code = int(code)
        self.name = err_name(code)
        self.what = what
        text = f"{strerror(code)} ({self.name})"
        super().__init__(f"{what}: {text}" if what else text)


KVFerryError = KVFError  # the name used before API v1


class _Closing:
    """A context manager around self.close(), which __del__ also calls as a
    last resort (its errors ignored)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def check(rc, what=""):
    if rc < 0:
        raise KVFError(rc, what)
    return rc


class Config:
    """A C config struct (kind "engine", "manager" or "bootstrap_server") of
    the library's own size, initialised by kvf_<kind>_config_init; fields are
    set by their C names with set() (values are passed as text, strings kept
    alive by this object). Pass .ptr to the create call."""

    def __init__(self, kind):
        self.kind = kind
        size = CONSTS[f"KVF_SIZEOF_{kind.upper()}_CONFIG"]
        self._buf = (ctypes.c_uint64 * ((size + 7) // 8))()  # 8-byte aligned
        self._keep = []
        self.ptr = ctypes.cast(self._buf, ctypes.c_void_p)
        getattr(lib, f"kvf_{kind}_config_init")(self.ptr)

    def set(self, name, value):
        if isinstance(value, bool):
            value = int(value)
        b = to_bytes(value)
        self._keep.append(b)
        check(getattr(lib, f"kvf_{self.kind}_config_set")(self.ptr, to_bytes(name), b),
              f"{self.kind} config {name}={value!r}")
        return self

    def set_ptr(self, name, value):
        """A pointer field (manager: "engine", "engine_cfg"); value an int
        address, a Config or None. The object is kept alive."""
        if isinstance(value, Config):
            self._keep.append(value)
            value = value.ptr
        check(lib.kvf_manager_config_set_ptr(self.ptr, to_bytes(name), value), f"{self.kind} config {name}")
        return self


def to_bytes(s):
    if s is None:
        return None
    if isinstance(s, bytes):
        return s
    return str(s).encode("utf-8")


# ---- memory of Python objects -------------------------------------------------

def _typestr_itemsize(typestr):
    try:
        return int(typestr[2:])
    except ValueError:
        raise TypeError(f"unsupported array typestr {typestr!r}") from None


def buffer_address(obj, writable=True):
    """(address, nbytes) of the memory behind `obj` and a keep-alive object.

    Accepts a numpy array (or anything with __array_interface__), a ctypes
    array/structure, an object with data_ptr() (a CPU torch tensor), or a
    writable buffer (bytearray, mmap, memoryview). The memory must be
    C-contiguous. The returned keep-alive must be held for as long as the
    address is in use.
    """
    ai = getattr(obj, "__array_interface__", None)
    if ai is not None:
        addr, readonly = ai["data"]
        if writable and readonly:
            raise ValueError("kvferry: array is read-only")
        shape = ai["shape"]
        itemsize = _typestr_itemsize(ai["typestr"])
        n = 1
        for s in shape:
            n *= s
        strides = ai.get("strides")
        if strides is not None and n > 1:
            # Explicit strides: accept only the C-contiguous ones.
            expect = itemsize
            for dim, st in zip(reversed(shape), reversed(strides)):
                if dim != 1 and st != expect:
                    raise ValueError("kvferry: array is not C-contiguous")
                expect *= dim
        return int(addr or 0), n * itemsize, obj
    if isinstance(obj, (ctypes.Array, ctypes.Structure, ctypes.Union)) or isinstance(
        obj, ctypes._SimpleCData
    ):
        return ctypes.addressof(obj), ctypes.sizeof(obj), obj
    data_ptr = getattr(obj, "data_ptr", None)
    if callable(data_ptr) and hasattr(obj, "element_size"):
        if hasattr(obj, "is_contiguous") and not obj.is_contiguous():
            raise ValueError("kvferry: tensor is not contiguous")
        return int(data_ptr()), int(obj.numel()) * int(obj.element_size()), obj
    try:
        mv = memoryview(obj)
    except TypeError:
        raise TypeError(
            f"kvferry: cannot take the address of {type(obj).__name__}; pass a numpy array, "
            "a ctypes buffer or a writable buffer"
        ) from None
    if not mv.c_contiguous:
        raise ValueError("kvferry: buffer is not C-contiguous")
    if mv.readonly:
        raise ValueError("kvferry: buffer is read-only")
    n = mv.nbytes
    if n == 0:
        return 0, 0, obj
    holder = (ctypes.c_char * n).from_buffer(mv.cast("B"))
    return ctypes.addressof(holder), n, (obj, holder)
