"""kvferry: KV-cache transfer for disaggregated LLM inference (ctypes binding).

    TransferEngine      the data plane, with mooncake.engine.TransferEngine's methods
    KVManager           one rank's KV manager (prefill or decode)
    KVSender/KVReceiver per-request handles; poll() -> TransferPoll
    BootstrapServer     the prefill instance's HTTP rendezvous server
    KVTransferError     raised by failure_exception()
    KVFError            a C call failed (.code is the negative KVF_E* value, .name
                        its C name); KVFerryError is the same class

kvferry.tokenspeed (imported on demand) holds tokenspeed's Mooncake PD classes
on kvferry and install(), which switches a tokenspeed process to them
(docs/TOKENSPEED.md).

The shared library is found through $KVFERRY_LIB, next to this package, in a
kvferry checkout's build/ directory, or on the system library path.
"""

from ._lib import CONSTS, LIB_PATH, KVFError, KVFerryError, err_name, lib as _api, strerror
from .engine import TransferEngine
from .kv import (
    BootstrapServer,
    KVManager,
    KVReceiver,
    KVSender,
    KVTransferError,
    TOKEN_LATER,
    TransferPoll,
)

__version__ = _api.kvf_version().decode()

ROLE_PREFILL = "prefill"
ROLE_DECODE = "decode"

LOG_ERROR, LOG_WARN, LOG_INFO, LOG_DEBUG = (CONSTS[f"KVF_LOG_{n}"] for n in ("ERROR", "WARN", "INFO", "DEBUG"))
MAX_CANDIDATES = CONSTS["KVF_MAX_CANDIDATES"]


def set_log_level(level):
    """The C library's log level: LOG_ERROR..LOG_DEBUG or "error".."debug"."""
    if isinstance(level, str):
        level = {"error": LOG_ERROR, "warn": LOG_WARN, "warning": LOG_WARN, "info": LOG_INFO,
                 "debug": LOG_DEBUG}[level.lower()]
    _api.kvf_set_log_level(int(level))


def version():
    return __version__


__all__ = [
    "LIB_PATH",
    "BootstrapServer",
    "KVFError",
    "KVFerryError",
    "MAX_CANDIDATES",
    "KVManager",
    "KVReceiver",
    "KVSender",
    "KVTransferError",
    "TOKEN_LATER",
    "TransferEngine",
    "TransferPoll",
    "err_name",
    "set_log_level",
    "strerror",
    "version",
]
