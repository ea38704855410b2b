"""`mooncake.engine` as tokenspeed imports it: TransferEngine is kvferry's."""

from kvferry.engine import TransferEngine

__all__ = ["TransferEngine"]
