"""`mooncake.engine` as tokenspeed imports it: kvferry's TransferEngine with
Mooncake's return conventions.

kvferry.TransferEngine raises KVFError when a call fails; Mooncake's methods
return 0 (or a non-negative value: a batch id, a status) on success and a
negative number on failure, never raising for a failed transfer. This class
maps one onto the other: KVFError becomes its (negative) code, logged once
per call at error level, and transfer_check_status reports 1 (done) / 0 (in
progress). kvferry's own methods (register_array, write, sync, get_stats,
close) keep raising.
"""

import functools
import logging

import kvferry
from kvferry import KVFError

log = logging.getLogger("kvferry")

# Mooncake-named methods whose success value is 0.
_ZERO_ON_SUCCESS = (
    "initialize",
    "register_memory",
    "unregister_memory",
    "batch_register_memory",
    "batch_unregister_memory",
    "transfer_sync_write",
    "batch_transfer_sync_write",
    "get_batch_transfer_status",
    "transfer_sync_read",
)
# Mooncake-named methods that return a value on success.
_VALUE_ON_SUCCESS = ("transfer_submit_write", "batch_transfer_async_write")


def _returning_codes(name, native, zero):
    @functools.wraps(native)
    def call(self, *args, **kwargs):
        try:
            value = native(self, *args, **kwargs)
        except KVFError as e:
            log.error("kvferry: %s failed: %s", name, e)
            return e.code
        return 0 if zero else value

    return call


class TransferEngine(kvferry.TransferEngine):
    """kvferry.TransferEngine with Mooncake's return codes (see above)."""

    def transfer_check_status(self, batch_id):
        """1 = done, 0 = in progress, negative = failed (or unknown id)."""
        try:
            return 1 if super().transfer_check_status(batch_id) else 0
        except KVFError as e:
            return e.code


for _name in _ZERO_ON_SUCCESS + _VALUE_ON_SUCCESS:
    setattr(TransferEngine, _name,
            _returning_codes(_name, getattr(kvferry.TransferEngine, _name), _name in _ZERO_ON_SUCCESS))
del _name

__all__ = ["TransferEngine"]
