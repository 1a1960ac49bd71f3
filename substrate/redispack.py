"""Redis command packing in C for redis-py's asyncio connections.

redis-py's synchronous client packs commands with hiredis's ``pack_command`` when hiredis is installed
(``redis.connection.HiredisRespSerializer``); its asyncio client always packs them in Python
(``redis.asyncio.connection.AbstractConnection.pack_command``). That Python packer was the largest
single function by own time in a profile of a session's create (``docs/bench/2026-12-07-python312-ab.md``):
about 10 µs per 9-argument command against 2 µs in C, and a create and a delete send 30-40 commands.

:func:`use_hiredis_packer` switches a connection pool to a subclass of its connection class whose
``pack_command`` is hiredis's, with what redis-py's own sync serializer does around it (a command name of
several words split into arguments; a value of a type Redis cannot take raises ``redis.DataError``).
The bytes sent are the same (``tests/unit/test_redispack.py`` checks them against redis-py's packer).
Differences: a large value is copied into one buffer instead of being sent as its own chunk, which
matters only for values of hundreds of KiB (the directory's are small: snapshots go to the object
store). Applied only where the pool encodes text as strict UTF-8, as hiredis does.
"""

from __future__ import annotations

import functools
from typing import Any

from redis.exceptions import DataError

try:
    import hiredis
except ImportError:  # pragma: no cover - hiredis is a dependency (redis[hiredis]); without it, no change
    hiredis = None  # type: ignore[assignment]


@functools.cache
def _packed(cls: type) -> type:
    """``cls`` (a redis-py asyncio connection class) with hiredis's packer; one subclass per class."""

    def pack_command(self: Any, *args: Any) -> list[bytes]:
        # as redis-py's packers: a command name such as "CONFIG GET" is sent as separate arguments
        if isinstance(args[0], str):
            args = (*args[0].encode().split(), *args[1:])
        elif b" " in args[0]:
            args = (*args[0].split(), *args[1:])
        try:
            return [hiredis.pack_command(args)]
        except TypeError as e:  # None, a bool, an object: what redis-py's encoder refuses with DataError
            raise DataError(f"invalid input for a Redis command: {e}") from e

    return type(f"Hiredis{cls.__name__}", (cls,), {"pack_command": pack_command, "__module__": __name__})


def use_hiredis_packer(pool: Any) -> bool:
    """Make ``pool`` (a ``redis.asyncio.ConnectionPool``) pack commands with hiredis from its next new
    connection on. Call it before the pool's first command (connections made earlier keep redis-py's
    packer; both send the same bytes). Returns whether it did: not without hiredis, nor for a pool whose
    text encoding is not strict UTF-8."""
    if hiredis is None or not hasattr(hiredis, "pack_command"):
        return False
    kwargs = getattr(pool, "connection_kwargs", {})
    encoding = str(kwargs.get("encoding", "utf-8")).lower().replace("_", "-")
    if encoding not in ("utf-8", "utf8") or kwargs.get("encoding_errors", "strict") != "strict":
        return False
    pool.connection_class = _packed(pool.connection_class)
    return True
