"""The asyncio Redis client's commands packed by hiredis (substrate.redispack) are the bytes redis-py's own
packer makes, and bad values fail as redis-py's do."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from redis.asyncio.connection import Connection, UnixDomainSocketConnection
from redis.exceptions import DataError

from substrate.directory import Directory
from substrate.redispack import use_hiredis_packer

_values = st.one_of(st.text(alphabet=st.characters(exclude_categories=("Cs",))), st.binary(),
                    st.integers(), st.floats(allow_nan=False))


def _pool(cls: type = Connection, **kwargs):
    return type("Pool", (), {"connection_class": cls, "connection_kwargs": kwargs})()


def _bytes(parts: list) -> bytes:
    return b"".join(bytes(p) for p in parts)


@given(name=st.sampled_from(["SET", "HSET", "CONFIG GET", b"CLIENT SETNAME", b"XADD"]),
       args=st.lists(_values, max_size=12))
def test_hiredis_packs_the_same_bytes_as_redis_py(name, args) -> None:
    pool = _pool()
    assert use_hiredis_packer(pool)
    ours, theirs = pool.connection_class(), Connection()
    assert _bytes(ours.pack_command(name, *args)) == _bytes(theirs.pack_command(name, *args))
    cmds = [(name, *args), ("GET", "k")]
    assert _bytes(ours.pack_commands(cmds)) == _bytes(theirs.pack_commands(cmds))


@pytest.mark.parametrize("bad", [None, True, object()])
def test_a_value_redis_cannot_take_is_a_data_error_as_with_redis_py(bad) -> None:
    pool = _pool()
    use_hiredis_packer(pool)
    with pytest.raises(DataError):
        Connection().pack_command("SET", "k", bad)
    with pytest.raises(DataError):
        pool.connection_class().pack_command("SET", "k", bad)


def test_each_connection_kind_keeps_its_own_class_and_other_encodings_are_left_alone() -> None:
    unix = _pool(UnixDomainSocketConnection)
    assert use_hiredis_packer(unix)
    assert issubclass(unix.connection_class, UnixDomainSocketConnection)
    latin = _pool(encoding="latin-1")
    assert not use_hiredis_packer(latin) and latin.connection_class is Connection
    lenient = _pool(encoding_errors="replace")
    assert not use_hiredis_packer(lenient) and lenient.connection_class is Connection


async def test_the_directory_packs_with_hiredis() -> None:
    d = Directory("redis://127.0.0.1:1/0")  # no command is sent
    try:
        assert d.redis.connection_pool.connection_class.pack_command is not Connection.pack_command
        assert issubclass(d.redis.connection_pool.connection_class, Connection)
    finally:
        await d.close()
