"""Stand-in for the `mooncake` package, backed by kvferry.

Put python/compat on PYTHONPATH (ahead of any real Mooncake) and
`from mooncake.engine import TransferEngine` returns a kvferry.TransferEngine
with Mooncake's return conventions (0 / negative codes instead of KVFError),
kvferry's tcp transport underneath.
Not installed by `pip install ./python`, so it never shadows a real Mooncake.
"""

try:
    import kvferry as _kvferry  # noqa: F401
except ImportError:
    # A checkout: python/compat/mooncake -> python/, where the kvferry package lives.
    import os as _os
    import sys as _sys

    _root = _os.path.dirname(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))))
    if _os.path.isdir(_os.path.join(_root, "kvferry")) and _root not in _sys.path:
        _sys.path.append(_root)
    import kvferry as _kvferry  # noqa: F401
