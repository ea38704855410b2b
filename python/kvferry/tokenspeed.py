"""kvferry as tokenspeed's Mooncake PD transfer backend, with unchanged callers.

Classes with the names, constructor signatures and method semantics of
tokenspeed's runtime/pd/mooncake classes, backed by libkvferry through
kvferry.kv:

    MooncakeKVManagerPrefill(args, kv_args)     MooncakeKVManagerDecode(args, kv_args)
    MooncakeKVSender(mgr, bootstrap_addr, bootstrap_room)
    MooncakeKVReceiver(mgr, bootstrap_addr, bootstrap_room)
    MooncakeKVBootstrapServer(port)
    TransferPoll, KVTransferError, KVClassType, get_kv_class

`args` and `kv_args` are tokenspeed's KVManagerArgs / KVArgs or any object
with those attribute names (duck-typed). install() makes a tokenspeed process
use these classes without editing tokenspeed; docs/TOKENSPEED.md lists what
it patches, what kvferry reads from the arguments and the layerwise step
counter, and every deliberate difference from tokenspeed's behaviour.

Addresses: the managers advertise $KVFERRY_HOST if set, else the address of
the interface that routes outward (tokenspeed's get_local_ip_by_remote),
else 127.0.0.1. The prefill registers with the bootstrap server at
args.dist_init_addr's host (or that local address) and args.bootstrap_port.

Page size: tokenspeed gives page_size to its PD executors, not to the
managers they build; install() wraps the executors' constructors so a
manager built inside one learns it (page_size_scope() does the same for
code that builds the managers itself). A decode manager that does not know
its page size refuses heterogeneous-TP rooms with a reason instead of
landing head slices cut out of multi-token pages.
"""

import contextlib
import enum
import functools
import inspect
import logging
import os
import socket
import sys
import threading
import time
import weakref
from dataclasses import dataclass

from ._lib import KVF_EEXIST, KVF_ENOTFOUND, KVFerryError
from .kv import (
    TOKEN_LATER,
    BootstrapServer,
    KVManager,
    KVReceiver,
    KVSender,
    KVTransferError,
    TransferPoll,
)

logger = logging.getLogger("kvferry.tokenspeed")

# The step counter's wrap-around modulus when the counter's class names none
# (tokenspeed's StepCounter.COUNT_NUM_MAX).
STEP_COUNT_MAX = 2**62
# How often the layerwise worker re-reads the step counter while a layer
# group is not ready (tokenspeed's transfer worker sleeps 1e-4 s).
LAYERWISE_POLL_S = 1e-4
# A layer group whose step is not ready this long after the worker first
# waited on it fails the room (tokenspeed waits forever). None: the
# manager's bootstrap timeout (TOKENSPEED_DISAGGREGATION_BOOTSTRAP_TIMEOUT,
# default 120 s).
LAYERWISE_STEP_TIMEOUT_S = None
_DEFAULT_BOOTSTRAP_TIMEOUT_S = 120
# Rooms whose first token was published before the room had a sender, kept
# until the sender comes or discard_expired_metadata_room; past this many the
# oldest is dropped (tokenspeed's table is unbounded).
MAX_EARLY_METADATA = 65536


class KVClassType(enum.Enum):
    """tokenspeed's KVClassType (runtime/pd/utils.py)."""

    MANAGER_PREFILL = "manager_prefill"
    MANAGER_DECODE = "manager_decode"
    MANAGER = "manager"
    SENDER = "sender"
    RECEIVER = "receiver"
    BOOTSTRAP_SERVER = "bootstrap_server"


# The exception class failure_exception() raises: kvferry's KVTransferError
# (same attributes and text as tokenspeed's), or tokenspeed's own class once
# install() ran, so `except KVTransferError` in tokenspeed code catches it.
_error_cls = KVTransferError


def _local_ip():
    host = os.environ.get("KVFERRY_HOST")
    if host:
        return host
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("8.8.8.8", 80))  # no packet is sent: this only picks the route
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def _ints(values):
    if values is None:
        return []
    return [int(v) for v in (values.tolist() if hasattr(values, "tolist") else values)]


# The page size of the PD executor whose constructor is running on this
# thread (install() wraps DisaggPrefillExecutor / DisaggDecodeExecutor, which
# build their manager in __init__), or of a page_size_scope() block.
_scope = threading.local()


@contextlib.contextmanager
def page_size_scope(page_size):
    """Managers built on this thread inside the block have `page_size` tokens
    per page. install() runs tokenspeed's PD executor constructors in one with
    the page_size tokenspeed passes them; use it when building the managers
    without those executors."""
    page_size = int(page_size)
    if page_size <= 0:
        raise ValueError(f"kvferry: page_size must be positive, got {page_size}")
    prev = getattr(_scope, "page_size", None)
    _scope.page_size = page_size
    try:
        yield page_size
    finally:
        _scope.page_size = prev


def _page_size(args):
    """Tokens per page, or None when nothing says: args.page_size if the
    object has one (tokenspeed's KVManagerArgs has not), else the page_size
    of the PD executor building this manager (install(), page_size_scope()),
    else $KVFERRY_PAGE_SIZE. Unknown, the manager runs with 1, and a decode
    refuses heterogeneous-TP rooms (PROTOCOL §8 item 11): their head slices
    would be cut per page out of token-major pages of more tokens."""
    for where, value in (("args.page_size", getattr(args, "page_size", None)),
                         ("the PD executor's page_size", getattr(_scope, "page_size", None)),
                         ("$KVFERRY_PAGE_SIZE", os.environ.get("KVFERRY_PAGE_SIZE"))):
        if value is None or value == "":
            continue
        try:
            n = int(value)
        except (TypeError, ValueError):
            raise ValueError(f"kvferry: {where} is not an integer: {value!r}") from None
        if n <= 0:
            raise ValueError(f"kvferry: {where} must be positive, got {n}")
        return n
    return None


# Why a decode that does not know its page size refuses a heterogeneous-TP room.
PAGE_SIZE_UNKNOWN_REASON = (
    "kvferry: refusing a heterogeneous-TP transfer (prefill and decode TP sizes differ): this decode's "
    "page size is not known, and with pages of more than one token the head slices would land wrong "
    "bytes. Call kvferry.tokenspeed.install() before tokenspeed builds its PD executors (it takes their "
    "page_size), or set KVFERRY_PAGE_SIZE")


def _env_seconds(name, default):
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return float(default)


class _Base:
    """What both managers share: tokenspeed's attributes and checks, one
    kvferry KVManager (self.kv), and the room -> handle table."""

    def __init__(self, args, kv_args, role, **extra):
        if not args.enable_dp_attention and args.dp_size != 1:
            raise ValueError("If dp_attention is not enabled, dp size must be 1 in disaggregation mode.")
        if bool(getattr(args, "enable_mla_l1_5_cache", False)):
            raise NotImplementedError("kvferry: the MLA L1.5 partial cache (enable_mla_l1_5_cache) is not supported")
        self.args = args
        self.kv_args = kv_args
        self.attn_tp_rank = args.attn_tp_rank
        self.attn_dp_rank = args.attn_dp_rank
        self.is_mla_backend = args.is_mla_backend
        self.draft_is_mla_backend = getattr(args, "draft_is_mla_backend", False)
        self.bootstrap_port = args.bootstrap_port
        self.dist_init_addr = args.dist_init_addr
        self.world_size = args.world_size
        self.dp_size = args.dp_size
        self.enable_dp_attention = args.enable_dp_attention
        self.src_mode = "OFF"
        self.kv_transfer_metrics = None  # tokenspeed's KV metrics are not reported
        self.host = _local_ip()
        self.page_size = _page_size(args)  # None: not known (see _page_size)
        offsets = [list(map(int, layer)) for layer in (getattr(kv_args, "offsets", None) or [])]
        self.n_kv_layers = len(offsets)
        state_ptrs = list(getattr(kv_args, "state_data_ptrs", None) or [])
        self.kv = KVManager(
            role,
            kv_data_ptrs=[int(p) for p in kv_args.kv_data_ptrs],
            kv_data_lens=[int(n) for n in kv_args.kv_data_lens],
            kv_item_lens=[int(n) for n in kv_args.kv_item_lens],
            kv_unit_lens=_ints(getattr(kv_args, "kv_unit_lens", None)) or None,
            state_data_ptrs=[int(p) for p in state_ptrs] or None,
            state_data_lens=_ints(getattr(kv_args, "state_data_lens", None)) or None,
            state_item_lens=_ints(getattr(kv_args, "state_item_lens", None)) or None,
            state_unit_lens=_ints(getattr(kv_args, "state_unit_lens", None)) or None,
            layer_bufs=offsets or None,
            engine_rank=int(kv_args.engine_rank),
            world_size=int(args.world_size),
            dp_size=int(args.dp_size),
            is_mla=bool(args.is_mla_backend),
            page_size=self.page_size or 1,
            host=self.host,
            target_layer_num=int(getattr(kv_args, "target_layer_num", 0) or 0),
            **extra,
        )
        if not self.n_kv_layers:  # kvferry's MHA default: n/2 layers of {K, V}
            self.n_kv_layers = len(kv_args.kv_data_ptrs) // 2
        self.rank_port = None
        self._lock = threading.Lock()
        self._handles = weakref.WeakValueDictionary()  # room -> live sender / receiver

    def get_session_id(self):
        return self.kv.session_id

    def _handle(self, room):
        with self._lock:
            return self._handles.get(room)

    def _add(self, room, handle):
        with self._lock:
            self._handles[room] = handle

    def check_status(self, bootstrap_room):
        """The room's TransferPoll; KeyError for a room with no live handle."""
        h = self._handle(bootstrap_room)
        if h is None:
            raise KeyError(bootstrap_room)
        if getattr(h, "_refused", None) is not None:
            return TransferPoll.Failed
        return h._h.poll()

    def room_status(self, bootstrap_room):
        try:
            return self.check_status(bootstrap_room)
        except (KeyError, RuntimeError):
            return None

    def close(self):
        """Stop the layerwise worker (prefill), clear live handles, destroy the manager."""
        self.kv.close()


# ---------------------------------------------------------------- prefill


@dataclass
class TransferInfoView:
    """One decode destination of a room, as far as kvferry exposes it
    (tokenspeed's TransferInfo carries the whole M2; its executors read
    is_dummy and decode_prefix_len)."""

    room: int
    is_dummy: bool
    decode_prefix_len: int


class _TransferInfos:
    """tokenspeed's MooncakeKVManagerPrefill.transfer_infos, read-only:
    transfer_infos[room] is {key: TransferInfoView} for the M2s the room's
    sender has received; KeyError while none arrived (or no sender)."""

    def __init__(self, mgr):
        self._mgr = weakref.ref(mgr)

    def _lookup(self, room):
        mgr = self._mgr()
        sender = mgr._handle(room) if mgr is not None else None
        if sender is None:
            return None
        try:
            nreal, ndummy, prefix = sender._h.dest_info()
        except (KVFerryError, RuntimeError):
            return None
        if nreal + ndummy == 0:
            return None
        infos = {f"real{i}": TransferInfoView(room, False, prefix) for i in range(nreal)}
        infos.update({f"dummy{i}": TransferInfoView(room, True, 0) for i in range(ndummy)})
        return infos

    def __getitem__(self, room):
        infos = self._lookup(room)
        if infos is None:
            raise KeyError(room)
        return infos

    def __contains__(self, room):
        return self._lookup(room) is not None

    def get(self, room, default=None):
        infos = self._lookup(room)
        return default if infos is None else infos


def _step_ready(ready, target, modulus):
    """tokenspeed's StepCounter.is_step_ready: the device has finished step
    `target` (a wrap-around count)."""
    return target != ready and (target + modulus - ready) % modulus > modulus / 2


class _LayerJob:
    __slots__ = ("sender", "pages", "index_begin", "is_last", "aux_index", "token", "cands", "state",
                 "begin_step", "interval", "next_layer", "wait_since")

    def __init__(self, sender, pages, index_begin, is_last, aux_index, token, cands, state, begin_step, interval):
        self.sender, self.pages, self.index_begin, self.is_last = sender, pages, index_begin, is_last
        self.aux_index, self.token, self.cands, self.state = aux_index, token, cands, state
        self.begin_step, self.interval = begin_step, max(int(interval), 1)
        self.next_layer = 0
        self.wait_since = None


class _LayerwiseWorker:
    """One thread per prefill manager that turns send_layerwise chunks into
    kvferry layer-group sends as the step counter says each group's KV is
    written (tokenspeed's transfer worker does the same wait). Jobs advance
    side by side, so one request's wait does not hold back another's ready
    layers."""

    def __init__(self, mgr):
        self._mgr = weakref.ref(mgr)
        self._cond = threading.Condition()
        self._jobs = []
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="kvferry-layerwise", daemon=True)
        self._thread.start()

    def submit(self, job):
        with self._cond:
            self._jobs.append(job)
            self._cond.notify()

    def stop(self):
        with self._cond:
            self._stop = True
            self._jobs = []
            self._cond.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    def _run(self):
        while True:
            with self._cond:
                while not self._jobs and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                jobs = list(self._jobs)
            mgr = self._mgr()
            if mgr is None:
                return
            done, progressed = [], False
            for job in jobs:
                moved, finished = mgr._advance(job)
                progressed |= moved
                if finished:
                    done.append(job)
            del mgr
            with self._cond:
                for job in done:
                    self._jobs.remove(job)
                if not progressed and not self._stop:
                    self._cond.wait(LAYERWISE_POLL_S)


class MooncakeKVManagerPrefill(_Base):
    """tokenspeed's MooncakeKVManagerPrefill(args, kv_args) on kvferry."""

    def __init__(self, args, kv_args):
        host = _local_ip()
        if args.dist_init_addr:
            host = socket.gethostbyname(str(args.dist_init_addr).rsplit(":", 1)[0].strip("[]"))
        # IPv6 hosts in brackets, as kvf_addr parses them ([::1]:8998).
        self.bootstrap_addr = f"[{host}]:{int(args.bootstrap_port)}" if ":" in host else f"{host}:{int(args.bootstrap_port)}"
        super().__init__(args, kv_args, "prefill", bootstrap_addr=self.bootstrap_addr)
        self.transfer_infos = _TransferInfos(self)
        kv_ids = list(getattr(kv_args, "kv_layer_ids", None) or range(self.n_kv_layers))
        self.kv_layer_ids = kv_ids
        self.state_layer_ids = list(getattr(kv_args, "state_layer_ids", None) or [])
        ids = kv_ids + self.state_layer_ids
        self.layer_num = (max(ids) + 1) if ids else self.n_kv_layers
        self._kv_layer_to_index = {int(lid): i for i, lid in enumerate(kv_ids[: self.n_kv_layers])}
        self.layerwise_interval = 1
        self.step_counter = None
        self.bootstrap_time_out = _env_seconds("TOKENSPEED_DISAGGREGATION_BOOTSTRAP_TIMEOUT",
                                               _DEFAULT_BOOTSTRAP_TIMEOUT_S)
        self._metadata = {}  # room -> (token, cands) published before the room had a sender
        self._worker = None

    # --- the layerwise step counter

    def register_layerwise_step_counter(self, step_counter, interval):
        self.step_counter = step_counter
        self.layerwise_interval = max(int(interval), 1)

    def reserve_layerwise_cache_steps(self):
        if self.step_counter is None:
            return 0
        cache_step, _ = self.step_counter.current_step()
        self.step_counter.advance_step(delta_cache_step=self.layer_num, delta_aux_step=0)
        return cache_step

    # --- first token and speculative ids (layerwise)

    def set_prefill_metadata(self, room, token, spec_candidate_ids=None):
        sender = self._handle(room)
        if sender is None:
            with self._lock:
                self._metadata.pop(room, None)
                if len(self._metadata) >= MAX_EARLY_METADATA:
                    self._metadata.pop(next(iter(self._metadata)))
                self._metadata[room] = (int(token), spec_candidate_ids)
            return
        sender._publish(int(token), spec_candidate_ids)

    def _take_metadata(self, room):
        with self._lock:
            return self._metadata.pop(room, None)

    def discard_expired_metadata_room(self, room):
        with self._lock:
            self._metadata.pop(room, None)

    def abort_room(self, room, reason):
        """Fail `room` and tell every decode destination whose request
        arrived (tokenspeed's EPD abort path). Works with or without a
        sender for the room."""
        sender = self._handle(room)
        if sender is not None:
            try:
                sender._h.abort(reason)
                return
            except RuntimeError:
                pass  # cleared: the room is gone from libkvferry, abort it afresh
        tmp = KVSender(self.kv, room)
        try:
            tmp.abort(reason)
        finally:
            tmp.clear()

    def receive_decode_prefix_info(self, bootstrap_room):
        infos = self.transfer_infos.get(bootstrap_room) or {}
        for info in infos.values():
            if not info.is_dummy and info.decode_prefix_len > 0:
                return info.decode_prefix_len
        return 0

    # --- layerwise worker

    def _submit(self, job):
        with self._lock:
            if self._worker is None:
                self._worker = _LayerwiseWorker(self)
            worker = self._worker
        worker.submit(job)

    def _send_group(self, job, begin, end):
        """The KV layers of global layer ids [begin, end), as contiguous runs
        of kvferry KV layer indices."""
        idx = sorted(i for lid, i in self._kv_layer_to_index.items() if begin <= lid < end)
        run_lo = None
        for k, i in enumerate(idx):
            if run_lo is None:
                run_lo = i
            if k + 1 == len(idx) or idx[k + 1] != i + 1:
                job.sender._h.send_layers(job.pages, job.index_begin, run_lo, i + 1, is_last=False)
                run_lo = None

    def _advance(self, job):
        """Send every layer group of `job` whose step is ready, then (is_last)
        the closing chunk. Returns (progressed, finished)."""
        counter = self.step_counter
        modulus = getattr(type(counter), "COUNT_NUM_MAX", STEP_COUNT_MAX)
        ready = counter.query_ready_cache_step() if counter is not None else None
        try:
            with job.sender._lock:  # not while the scheduler clears the sender
                return self._advance_locked(job, counter, modulus, ready)
        except (KVFerryError, RuntimeError) as e:  # the room failed or was cleared meanwhile
            logger.debug("kvferry: layerwise chunk of room %s dropped: %s", job.sender.bootstrap_room, e)
            return True, True

    def _advance_locked(self, job, counter, modulus, ready):
        """_advance with the sender's lock held."""
        moved = False
        while job.next_layer < self.layer_num:
            begin = job.next_layer
            end = min(begin + job.interval, self.layer_num)
            if counter is not None and not _step_ready(ready, job.begin_step + end - 1, modulus):
                now = time.monotonic()
                job.wait_since = job.wait_since or now
                limit = LAYERWISE_STEP_TIMEOUT_S or self.bootstrap_time_out
                if now - job.wait_since >= limit:
                    job.sender._h.abort(
                        f"Request {job.sender.bootstrap_room}: layers [{begin},{end}) not computed within "
                        f"{limit:g}s (step counter at {ready}, waiting for step {job.begin_step + end - 1})")
                    return True, True
                return moved, False
            job.wait_since = None
            if job.pages:
                self._send_group(job, begin, end)
            job.next_layer = end
            moved = True
        if job.is_last:
            job.sender._h.send_layers(job.pages, job.index_begin, 0, 0, is_last=True, aux_index=job.aux_index,
                                      bootstrap_token=job.token, spec_candidate_ids=job.cands,
                                      state_indices=job.state)
        return True, True

    def close(self):
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.stop()
        super().close()


class MooncakeKVSender:
    """tokenspeed's MooncakeKVSender(mgr, bootstrap_addr, bootstrap_room)."""

    def __init__(self, mgr, bootstrap_addr, bootstrap_room):
        self.kv_mgr = mgr
        self.bootstrap_server_url = bootstrap_addr
        self.bootstrap_room = int(bootstrap_room)
        self.init_time = None
        self.conclude_state = None
        self.curr_idx = 0
        self._layerwise_transfer_started = False
        self._lock = threading.Lock()  # the layerwise worker's sends vs clear()
        self._h = KVSender(mgr.kv, self.bootstrap_room, bootstrap_addr)
        mgr._add(self.bootstrap_room, self)
        early = mgr._take_metadata(self.bootstrap_room)
        if early is not None:
            self._publish(*early)

    def has_layerwise_transfer(self):
        return self._layerwise_transfer_started

    def _failed(self):
        try:
            return self._h.poll() == TransferPoll.Failed
        except RuntimeError:
            return True

    def send(self, kv_indices, aux_index, is_last, mla_l1_5_args=None, bootstrap_token=-1,
             spec_candidate_ids=None, mamba_indices=None):
        """A chunk of prefill pages for destination indices [curr_idx,
        curr_idx + len) (the executor has already skipped the decode's
        prefix). The last chunk carries the request-pool slot, first token,
        speculative ids and state slots."""
        pages = _ints(kv_indices)
        begin = self.curr_idx
        self.curr_idx += len(pages)
        if is_last and aux_index is None:
            raise ValueError("aux_index must be set for the last transfer chunk.")
        if self._failed():
            return  # tokenspeed drops chunks of a failed room
        try:
            if is_last:
                self._h.send_layers(pages, begin, 0, self.kv_mgr.n_kv_layers, is_last=True, aux_index=aux_index,
                                    bootstrap_token=bootstrap_token, spec_candidate_ids=spec_candidate_ids,
                                    state_indices=mamba_indices)
            elif pages:
                self._h.send_layers(pages, begin, 0, self.kv_mgr.n_kv_layers, is_last=False)
        except KVFerryError:
            if not self._failed():
                raise

    def send_layerwise(self, kv_indices, index_slice, aux_index, is_last, begin_cache_step, layerwise_interval,
                       mla_l1_5_args=None, bootstrap_token=-1, wait_for_bootstrap_token=False,
                       spec_candidate_ids=None, mamba_indices=None):
        """Queue a chunk whose layer groups go out as the step counter
        reaches begin_cache_step + end_layer - 1 for each group."""
        self._layerwise_transfer_started = True
        self.curr_idx = max(self.curr_idx, index_slice.stop)
        pages = _ints(kv_indices)
        if not pages and not is_last:
            return
        if is_last and aux_index is None:
            raise ValueError("aux_index must be set for the last transfer chunk.")
        token = int(bootstrap_token)
        if is_last and wait_for_bootstrap_token and token == -1:
            token = TOKEN_LATER  # set_prefill_metadata publishes it
        self.kv_mgr._submit(_LayerJob(self, pages, int(index_slice.start), bool(is_last),
                                      aux_index if is_last else None, token, spec_candidate_ids,
                                      _ints(mamba_indices) if is_last and mamba_indices is not None else None,
                                      int(begin_cache_step or 0), layerwise_interval))

    def _publish(self, token, spec_candidate_ids):
        try:
            self._h.set_metadata(token, spec_candidate_ids)
        except KVFerryError as e:
            if e.code not in (KVF_EEXIST, KVF_ENOTFOUND):
                raise
            logger.debug("kvferry: prefill metadata for room %s not taken: %s", self.bootstrap_room, e)
        except RuntimeError:
            pass  # cleared

    def poll(self):
        if self.conclude_state is None:
            st = self._h.poll()
            if st in (TransferPoll.Success, TransferPoll.Failed):
                self.conclude_state = st
            return st
        return self.conclude_state

    def clear(self):
        with self._lock:
            self._h.clear()

    def failure_exception(self):
        if self.conclude_state is None:
            self.conclude_state = TransferPoll.Failed
        with self._lock:
            _raise_failure(self._h)


def _raise_failure(handle):
    """handle.failure_exception(), raised as the class tokenspeed catches."""
    try:
        handle.failure_exception()
    except KVTransferError as e:
        raise _error_cls(e.bootstrap_room, e.failure_reason, e.remote_endpoint) from None


# ---------------------------------------------------------------- decode


class MooncakeKVManagerDecode(_Base):
    """tokenspeed's MooncakeKVManagerDecode(args, kv_args) on kvferry."""

    def __init__(self, args, kv_args):
        super().__init__(args, kv_args, "decode")
        self.waiting_timeout = _env_seconds("TOKENSPEED_DISAGGREGATION_WAITING_TIMEOUT", 300)

    def pop_prefill_metadata(self, bootstrap_room):
        """(first token or -1, speculative ids or None) of a Success room."""
        r = self._handle(bootstrap_room)
        if r is None:
            return -1, None
        try:
            return r._h.pop_metadata()
        except RuntimeError:
            return -1, None

    def pop_bootstrap_token(self, bootstrap_room):
        return self.pop_prefill_metadata(bootstrap_room)[0]


class MooncakeKVReceiver:
    """tokenspeed's MooncakeKVReceiver(mgr, bootstrap_addr, bootstrap_room):
    the bootstrap lookups and registration run in the constructor; a lookup
    failure leaves it Failed with tokenspeed's reason."""

    def __init__(self, mgr, bootstrap_addr, bootstrap_room):
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = int(bootstrap_room)
        self.session_id = mgr.get_session_id()
        self.conclude_state = None
        self.init_time = None
        self.prefill_enable_mla_l1_5_cache = None
        self.dst_enable_mla_l1_5_cache = False
        self.decode_prefix_len = 0
        self._synced = False
        self._refused = None  # why this room was refused here, before any request went out
        self._h = KVReceiver(mgr.kv, bootstrap_addr, self.bootstrap_room)
        self.supports_remote_spec_candidates = self._h.supports_spec_candidates
        if mgr.page_size is None and not self.supports_remote_spec_candidates:
            # A fragmented plan (heterogeneous TP) with an unknown page size:
            # fail the room now, before the M2 that would let the prefill write.
            self._refused = PAGE_SIZE_UNKNOWN_REASON
            self.conclude_state = TransferPoll.Failed
            logger.error("room %s: %s", self.bootstrap_room, self._refused)
            self._h.clear()
        mgr._add(self.bootstrap_room, self)

    def prefill(self, kv_indices, aux_index=None, decode_prefix_len=0, mla_l1_5_args=None, mamba_indices=None):
        """The transfer request: destination pages after the decode's prefix,
        request-pool slot, prefix length in tokens, state slots."""
        if mla_l1_5_args is not None:
            raise NotImplementedError("kvferry: decode-side MLA L1.5 partial cache (mla_l1_5_args) is not supported")
        self.decode_prefix_len = decode_prefix_len
        if self._refused is not None:  # Failed already: no request goes to the prefill
            self.init_time = time.time()
            return
        self._h.prefill(_ints(kv_indices), aux_index=aux_index, decode_prefix_len=int(decode_prefix_len or 0),
                        state_indices=_ints(mamba_indices) if mamba_indices is not None else None)
        self.init_time = time.time()

    def poll(self):
        if self.conclude_state is not None:
            return self.conclude_state
        st = self._h.poll()
        if st == TransferPoll.Success and not self._synced:
            self.kv_mgr.kv.sync()  # order the engine's writes before the caller reads the KV
            self._synced = True
        if st in (TransferPoll.Success, TransferPoll.Failed):
            self.conclude_state = st
        return st

    def clear(self):
        self._h.clear()

    def failure_exception(self):
        if self.conclude_state is None:
            self.conclude_state = TransferPoll.Failed
        if self._refused is not None:
            raise _error_cls(self.bootstrap_room, self._refused, self.bootstrap_addr)
        _raise_failure(self._h)


class MooncakeKVBootstrapServer(BootstrapServer):
    """tokenspeed's MooncakeKVBootstrapServer(port): the prefill instance's
    bootstrap HTTP server on every interface ($KVFERRY_BOOTSTRAP_HOST to
    bind one address)."""

    def __init__(self, port):
        super().__init__(os.environ.get("KVFERRY_BOOTSTRAP_HOST", "0.0.0.0"), int(port))


# ---------------------------------------------------------------- look-up


_CLASSES = {
    "manager_prefill": MooncakeKVManagerPrefill,
    "manager_decode": MooncakeKVManagerDecode,
    "sender": MooncakeKVSender,
    "receiver": MooncakeKVReceiver,
    "bootstrap_server": MooncakeKVBootstrapServer,
}


def get_kv_class(*args):
    """get_kv_class(class_type) or tokenspeed's get_kv_class(transfer_backend,
    class_type): kvferry's class for a KVClassType (tokenspeed's enum, this
    module's, or its string value), None for a type kvferry has no class for
    (the async backend's role-agnostic MANAGER)."""
    if len(args) not in (1, 2):
        raise TypeError("get_kv_class(class_type) or get_kv_class(transfer_backend, class_type)")
    class_type = args[-1]
    return _CLASSES.get(str(getattr(class_type, "value", class_type)))


# ---------------------------------------------------------------- install()

_PD = "runtime.pd"
# Where tokenspeed defines (and re-exports) the Mooncake classes.
_DEFINED = {
    "mooncake.conn": ("MooncakeKVBootstrapServer",),
    "mooncake.prefill": ("MooncakeKVManagerPrefill", "MooncakeKVSender"),
    "mooncake.decode": ("MooncakeKVManagerDecode",),
    "mooncake.sender": ("MooncakeKVSender",),
    "mooncake.receiver": ("MooncakeKVReceiver",),
    "mooncake": ("MooncakeKVBootstrapServer", "MooncakeKVManagerDecode", "MooncakeKVManagerPrefill",
                 "MooncakeKVReceiver", "MooncakeKVSender"),
}
_OURS = {
    "MooncakeKVBootstrapServer": MooncakeKVBootstrapServer,
    "MooncakeKVManagerPrefill": MooncakeKVManagerPrefill,
    "MooncakeKVManagerDecode": MooncakeKVManagerDecode,
    "MooncakeKVSender": MooncakeKVSender,
    "MooncakeKVReceiver": MooncakeKVReceiver,
}
# tokenspeed's PD executors: (module under runtime.pd, class); each takes
# page_size in its constructor and builds its manager there.
_EXECUTORS = (("prefill_executor", "DisaggPrefillExecutor"), ("decode_executor", "DisaggDecodeExecutor"))
_patched = []  # (module or class, attribute, original) for uninstall()


def _patched_name(owner, attr):
    if isinstance(owner, type):
        return f"{owner.__module__}.{owner.__qualname__}.{attr}"
    return f"{owner.__name__}.{attr}"


def _executor_init(orig):
    """orig (a PD executor's __init__) run in page_size_scope(page_size), so
    the manager it builds learns tokenspeed's page size."""
    sig = inspect.signature(orig)

    @functools.wraps(orig)
    def __init__(self, *a, **kw):
        try:
            page_size = sig.bind(self, *a, **kw).arguments.get("page_size")
        except TypeError:
            page_size = None
        if page_size is None:
            return orig(self, *a, **kw)
        with page_size_scope(page_size):
            return orig(self, *a, **kw)

    __init__._kvferry_page_size = True
    return __init__


def _make_get_kv_class(original):
    def get_kv_class_kvferry(transfer_backend, class_type):
        backend = str(getattr(transfer_backend, "value", transfer_backend))
        if backend == "mooncake_async":
            raise ValueError("kvferry.tokenspeed.install() replaced the Mooncake classes, and kvferry has no "
                             "counterpart of the async backend's MooncakeAsyncKVManager: use the 'mooncake' "
                             "transfer backend")
        if backend in ("mooncake", "kvferry"):
            return get_kv_class(class_type)
        return original(transfer_backend, class_type)

    get_kv_class_kvferry.__wrapped__ = original
    return get_kv_class_kvferry


def install(package="tokenspeed"):
    """Make this process's tokenspeed use kvferry, with no edit to tokenspeed.
    Call it once, early (before the scheduler builds its PD executors).

    Imports <package>.runtime.pd.{utils, mooncake, mooncake.conn,
    mooncake.prefill, mooncake.decode, mooncake.sender, mooncake.receiver,
    mooncake.entities} and replaces: the Mooncake class attributes of those
    modules; every other reference to those classes (or to utils.get_kv_class)
    held by an already imported <package>.* module, e.g. the executors'
    `from ... import MooncakeKVManagerPrefill`; utils.get_kv_class by a
    wrapper returning kvferry's classes for the "mooncake" backend. Modules
    imported later pick the patched attributes up through their own imports.
    The constructors of <package>.runtime.pd.{prefill,decode}_executor's
    DisaggPrefillExecutor / DisaggDecodeExecutor are wrapped so the manager
    each builds learns the page_size tokenspeed passes it (without it a
    decode refuses heterogeneous-TP rooms). failure_exception() then raises
    tokenspeed's KVTransferError class. Returns the list of
    "module.attribute" names patched; idempotent."""
    global _error_cls
    import importlib

    base = f"{package}.{_PD}"
    if _patched:
        return [_patched_name(m, a) for m, a, _ in _patched]
    try:
        utils = importlib.import_module(f"{base}.utils")
        mods = {sub: importlib.import_module(f"{base}.{sub}") for sub in _DEFINED}
        entities = importlib.import_module(f"{base}.mooncake.entities")
    except ImportError as e:
        raise ImportError(f"kvferry.tokenspeed.install(): cannot import {package}'s PD package ({e})") from e

    replace = {}  # id(original object) -> replacement
    for sub, names in _DEFINED.items():
        for name in names:
            orig = getattr(mods[sub], name, None)
            if orig is not None and orig is not _OURS[name]:
                replace[id(orig)] = _OURS[name]
    orig_get = utils.get_kv_class
    replace[id(orig_get)] = _make_get_kv_class(orig_get)

    def patch(mod, name, new):
        _patched.append((mod, name, getattr(mod, name)))
        setattr(mod, name, new)

    for sub, names in _DEFINED.items():
        for name in names:
            if getattr(mods[sub], name, None) is not _OURS[name]:
                patch(mods[sub], name, _OURS[name])
    patch(utils, "get_kv_class", replace[id(orig_get)])
    for modname, mod in list(sys.modules.items()):
        if mod is None or not (modname == package or modname.startswith(package + ".")):
            continue
        for name, value in list(vars(mod).items()):
            new = replace.get(id(value))
            if new is not None and getattr(mod, name) is not new:
                patch(mod, name, new)
    for sub, cls_name in _EXECUTORS:
        try:
            cls = getattr(importlib.import_module(f"{base}.{sub}"), cls_name, None)
        except ImportError as e:
            cls = None
            logger.warning("kvferry.tokenspeed.install(): cannot import %s.%s (%s)", base, sub, e)
        init = cls.__dict__.get("__init__") if isinstance(cls, type) else None
        if init is None:
            logger.warning("kvferry.tokenspeed.install(): no %s.%s.%s: managers will not learn tokenspeed's "
                           "page size (set KVFERRY_PAGE_SIZE), and decodes refuse heterogeneous-TP rooms",
                           base, sub, cls_name)
        elif not getattr(init, "_kvferry_page_size", False):
            patch(cls, "__init__", _executor_init(init))
    _error_cls = getattr(entities, "KVTransferError", KVTransferError)
    return [_patched_name(m, a) for m, a, _ in _patched]


def uninstall():
    """Undo install(): restore every patched attribute."""
    global _error_cls
    while _patched:
        mod, name, orig = _patched.pop()
        setattr(mod, name, orig)
    _error_cls = KVTransferError


__all__ = [
    "KVClassType",
    "KVTransferError",
    "MooncakeKVBootstrapServer",
    "MooncakeKVManagerDecode",
    "MooncakeKVManagerPrefill",
    "MooncakeKVReceiver",
    "MooncakeKVSender",
    "TransferInfoView",
    "TransferPoll",
    "get_kv_class",
    "install",
    "page_size_scope",
    "uninstall",
]
