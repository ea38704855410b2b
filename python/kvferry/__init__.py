"""kvferry: KV-cache transfer for disaggregated LLM inference (ctypes binding).

    TransferEngine      the data plane, with mooncake.engine.TransferEngine's methods
    KVManager           one rank's KV manager (prefill or decode)
    KVSender/KVReceiver per-request handles; poll() -> TransferPoll
    BootstrapServer     the prefill instance's HTTP rendezvous server
    KVTransferError     raised by failure_exception()
    KVFerryError        a C call failed (.code is the negative KVF_E* value)

kvferry.tokenspeed (imported on demand) holds tokenspeed's Mooncake PD classes
on kvferry and install(), which switches a tokenspeed process to them
(docs/TOKENSPEED.md).

The shared library is found through $KVFERRY_LIB, next to this package, in a
kvferry checkout's build/ directory, or on the system library path.
"""

from ._lib import LIB_PATH, KVFerryError, lib as _api, strerror
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

LOG_ERROR, LOG_WARN, LOG_INFO, LOG_DEBUG = 0, 1, 2, 3


def set_log_level(level):
    """The C library's log level: LOG_ERROR..LOG_DEBUG or "error".."debug"."""
    if isinstance(level, str):
        level = {"error": 0, "warn": 1, "warning": 1, "info": 2, "debug": 3}[level.lower()]
    _api.kvf_set_log_level(int(level))


def version():
    return __version__


__all__ = [
    "LIB_PATH",
    "BootstrapServer",
    "KVFerryError",
    "KVManager",
    "KVReceiver",
    "KVSender",
    "KVTransferError",
    "TOKEN_LATER",
    "TransferEngine",
    "TransferPoll",
    "set_log_level",
    "strerror",
    "version",
]
