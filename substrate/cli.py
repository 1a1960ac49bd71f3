"""The ``substrate`` command: run the runtime and drive it.

    substrate up [--host H] [--port P] [--config DIR]   run the embedded default until SIGINT/SIGTERM/SIGHUP
    substrate demo                                       up + create/invoke/suspend/wake a session, then stop
    substrate sessions create|get|list|invoke|suspend|resume|events|delete ...
    substrate events [--tenant T] [--all] [-o jsonl|table|json|ids]   the tenant's audit trail
    substrate pools | templates | stats
    substrate keys create|revoke|list|rotate-signing                 API keys and activation-token keys

Client commands talk to ``--server`` (env ``SUBSTRATE_SERVER``, default http://127.0.0.1:8080).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterator, NoReturn, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from substrate.client import ApiError, SubstrateClient, checked_idempotency_key, next_continue

app = typer.Typer(help="Agent session runtime: many bursty, stateful agent sessions on few warm workers.",
                  no_args_is_help=True, add_completion=False)
sessions = typer.Typer(help="Create, inspect, invoke and delete sessions.", no_args_is_help=True)
app.add_typer(sessions, name="sessions")
keys_app = typer.Typer(help="API keys (tenants) and the activation-token signing keys. Writes to the Redis at "
                            "SUBSTRATE_REDIS_URL (prefix SUBSTRATE_REDIS__KEY_PREFIX), or with --file to a key "
                            "file read by `substrate up` (SUBSTRATE_AUTH__API_KEYS_FILE).", no_args_is_help=True)
app.add_typer(keys_app, name="keys")
store_app = typer.Typer(help="The snapshot store: its status, and adopting it after its objects were lost for good.",
                        no_args_is_help=True)
app.add_typer(store_app, name="store")
console = Console()
err = Console(stderr=True, soft_wrap=True)  # one error, one line (no wrap at the terminal width)

ServerOpt = typer.Option("http://127.0.0.1:8080", "--server", "-s", envvar="SUBSTRATE_SERVER",
                         help="Base URL of the API.")
#: the client's credential. Not ``SUBSTRATE_API__AUTH_TOKEN``: that is the server's admin token, and sharing
#: one variable made a tenant's key an admin token when `substrate up` was started from the same shell
#: a session's id, as every session command takes it (as the README writes it; the usage line said ``{sid}``)
SessionArg = typer.Argument(..., metavar="ID", help="The session's id (from `sessions create` or `sessions list`).")
TokenOpt = typer.Option(None, "--token", envvar="SUBSTRATE_TOKEN",
                        help="API key (sk_...) or JWT for the client commands (env SUBSTRATE_TOKEN).")


def _warn_unknown_env(refused: frozenset[str] = frozenset()) -> None:
    """One warning line per ``SUBSTRATE_`` variable nothing reads (a typo such as ``SUBSTRATE_API__PORTT``
    was silently ignored), naming the closest known one, and per field nothing reads in the JSON value of a
    group (``SUBSTRATE_QUOTA='{"defualt": {...}}'``). Only a warning: it may be meant for another tool.
    Not for the ``refused`` ones (upper-case): an error names them, and "is ignored" would contradict it."""
    from substrate.settings import unknown_env, unknown_json_fields

    for var, close in unknown_env(os.environ):
        if var.upper() in refused:
            continue
        hint = f"; did you mean {close}?" if close else " (the settings are in substrate/settings.py)"
        err.print(f"[yellow]warning[/yellow]: {escape(var)} is not a substrate setting and is ignored{hint}")
    for var, field, close in unknown_json_fields(os.environ):  # SUBSTRATE_QUOTA='{"defualt": ...}'
        if var.upper() in refused:
            continue
        hint = f"; did you mean {close!r}?" if close else ""
        err.print(f"[yellow]warning[/yellow]: {escape(var)}: field {escape(repr(field))} is not a setting and is "
                  f"ignored{escape(hint)}")


def _env_name(loc: tuple[Any, ...]) -> str:
    """The variable a pydantic error location names: field names joined by ``__``, then list indexes and
    fields inside a JSON value as ``[0].tenant`` (``SUBSTRATE_AUTH__API_KEYS[0].tenant``)."""
    names: list[str] = []
    rest = ""
    for p in loc:
        if rest or isinstance(p, int):
            rest += f"[{p}]" if isinstance(p, int) else f".{p}"
        else:
            names.append(str(p).upper())
    var = "SUBSTRATE_" + "__".join(names)
    if var == "SUBSTRATE_REDIS__URL" and var not in os.environ and "SUBSTRATE_REDIS_URL" in os.environ:
        var = "SUBSTRATE_REDIS_URL"  # the short alias the user set
    return var + rest


def _setting_error(x: Any) -> tuple[str | None, str]:
    """One pydantic error of the settings as (the variable set that it is in, or None; the line
    ``VARIABLE: what is wrong``), naming the variable actually set and, for an error inside its JSON value,
    the field there (with a "did you mean" for an unknown one)."""
    from substrate.settings import env_var_of

    loc, msg = tuple(x["loc"]), str(x["msg"]).removeprefix("Value error, ")
    if not loc:  # an error of the whole model (e.g. the SUBSTRATE_REDIS_URL alias) names its variable itself
        return None, msg
    found = env_var_of(loc, os.environ)
    if found is None:  # nothing set names it (e.g. a model check across fields): the field's own variable
        return None, f"{_env_name(loc)}: {msg}"
    var, inner = found
    return var, f"{var}: {_setting_problem(loc, inner, x['type'], msg)}"


def _setting_problem(loc: tuple[Any, ...], inner: tuple[Any, ...], kind: str, msg: str) -> str:
    """What is wrong at ``loc`` of the settings, whose variable holds it at ``inner`` in its JSON value."""
    from substrate.settings import closest, fields_at

    if kind == "extra_forbidden":
        if not inner:  # the nested variable form: SUBSTRATE_QUOTA__DEFAULT__MAXRUNING=3
            close = closest(str(loc[-1]).upper(), [n.upper() for n in fields_at(loc)])
            var = "SUBSTRATE_" + "__".join(str(p).upper() for p in loc[:-1]) + "__"
            return "not a setting" + (f" (did you mean {var}{close}?)" if close else "")
        fields = fields_at(loc)
        close = closest(str(loc[-1]), fields)
        hint = (f" (did you mean {_json_path(inner[:-1] + (close,))!r}?)" if close
                else f" (its fields: {', '.join(fields)})" if fields else "")
        return f"field {_json_path(inner)!r} is not allowed{hint}"
    return f"field {_json_path(inner)!r}: {msg}" if inner else msg


def _json_path(path: tuple[Any, ...]) -> str:
    """A place inside a JSON value: ``default.maxRunning``, ``[0].tenant``."""
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).removeprefix(".")


def _settings(warn: bool = True) -> Any:
    """The runtime's settings, or one clear line and exit 2 when an environment variable is invalid; also
    (``warn``) a warning per unknown ``SUBSTRATE_`` variable that no error names."""
    from pydantic import ValidationError
    from pydantic_settings import SettingsError

    from substrate.settings import Settings, bad_json_env

    try:
        settings = Settings()
    except ValidationError as e:
        errors = [_setting_error(x) for x in e.errors()]
        if warn:
            _warn_unknown_env(frozenset(var.upper() for var, _ in errors if var))
        for _, line in errors:
            err.print(f"[red]error[/red]: {escape(line)}")
        raise typer.Exit(2) from None
    except SettingsError as e:  # a value meant as JSON that is not JSON: pydantic-settings names only the field
        if warn:
            _warn_unknown_env()
        bad = bad_json_env(os.environ) or [(str(e), str(e.__cause__ or "not valid JSON"))]
        for var, why in bad:
            err.print(f"[red]error[/red]: {escape(var)}: {escape(why)}")
        raise typer.Exit(2) from None
    if warn:
        _warn_unknown_env()
    return settings


def _folder_problem(path: Path) -> str | None:
    """None if ``path`` is a folder this process can write in, or can be created, else why not (checked
    before anything starts: a regular file there was a NotADirectoryError traceback)."""
    p = path.absolute()
    while not p.exists():
        if p.is_symlink():  # a dangling link: mkdir would fail on it
            return f"{path} is a broken symbolic link"
        p = p.parent
    if not p.is_dir():
        return f"{p} is not a folder" if p == path.absolute() else f"{p} (in {path}) is not a folder"
    if not os.access(p, os.W_OK | os.X_OK):
        return f"{p} is not writable" + ("" if p == path.absolute() else f" (to create {path})")
    if p == path.absolute():
        # another user's folder (made there before this runtime did, e.g. in a world-writable data folder)
        # lets that user read, move or delete what the runtime keeps in it: snapshots, the Redis files
        # (fresh-user round 17 moved every committed snapshot of a session away that way)
        st = p.stat()
        if st.st_uid != os.geteuid():
            return (f"{p} is owned by uid {st.st_uid}, not this user (uid {os.geteuid()}): that user could read, "
                    "move or delete what the runtime keeps there; remove it, or chown it to this user")
        if st.st_mode & 0o002 and not st.st_mode & 0o1000:
            return (f"{p} is writable by every user: another user could move what the runtime keeps there; "
                    "chmod o-w (or +t) it")
    if p != path.absolute():
        # os.access says yes for root on file systems that refuse folders (/proc, /sys): try making the
        # first missing one, and take it away again (a check changes nothing)
        first = path.absolute()
        while first.parent != p:
            first = first.parent
        try:
            first.mkdir(0o700)
            first.rmdir()
        except OSError as e:
            return f"cannot create {path}: {e.strerror or e}"
    return None


def _prestart_problems(settings: Any, *, local: bool = True) -> list[str]:
    """Problems of the settings that would otherwise show only after the API started (a traceback and exit 3):
    the runtime's folders (``local``: the embedded default's) and the API key file. Each is one line naming
    its variable."""
    from substrate.apikeys import load_key_file
    from substrate.settings import duplicate_api_key
    from substrate.errors import SubstrateError

    out: list[str] = []
    if local:
        d = settings.data_dir
        folders = [("SUBSTRATE_DATA_DIR", d)]
        if not settings.redis.url:  # the embedded Redis keeps its append-only file here
            folders.append(("SUBSTRATE_REDIS__DATA_DIR", settings.redis.data_dir))
        folders.append(("SUBSTRATE_WORKER__ROOT_DIR", settings.worker.root_dir))
        if settings.snapshot.store == "local":
            folders.append(("SUBSTRATE_SNAPSHOT__LOCAL_DIR", settings.snapshot.local_dir))
        said: set[str] = set()
        for var, path in folders:
            # a folder that follows data_dir is that variable's problem, said once
            var = "SUBSTRATE_DATA_DIR" if Path(path).is_relative_to(d) else var
            if var not in said and (why := _folder_problem(Path(path))):
                out.append(f"{var}: {why}")
                said.add(var)
    if local and (why := _worker_host_problem(settings.worker.host)):
        out.append(f"SUBSTRATE_WORKER__HOST: {why}")
    if settings.auth.api_keys_file:
        try:
            from_file = load_key_file(settings.auth.api_keys_file)
        except SubstrateError as e:
            out.append(f"SUBSTRATE_AUTH__API_KEYS_FILE: {e.message}")
        else:  # the same key in both: one of them would be dropped at import
            env = settings.auth.api_keys
            if why := duplicate_api_key([*env, *from_file], [f"SUBSTRATE_AUTH__API_KEYS entry {i}" for i in range(len(env))]
                                        + [f"entry {i} of {settings.auth.api_keys_file}" for i in range(len(from_file))]):
                out.append(f"SUBSTRATE_AUTH__API_KEYS_FILE: {why}")
    return out


def port_parser(lowest: int = 1) -> Any:
    """A typer ``parser`` for a TCP port: plain decimal digits within ``lowest``..65535. Stricter than an
    int: ``18535.0`` and ``080`` are refused (exit 2, a usage error naming the option) rather than read
    as 18535 and 80, which hid typos. Raises ``typer.BadParameter``."""

    def parse(value: Any) -> int:
        text = str(value).strip()
        if isinstance(value, bool) or not (text.isascii() and text.isdigit()) \
                or (len(text) > 1 and text[0] == "0") or not lowest <= int(text) <= 65535:
            raise typer.BadParameter(f"{value!r} is not a port: use {lowest}-65535, in decimal digits")
        return int(text)

    return parse


def _free_port(host: str, port: int) -> str | None:
    """None if ``host:port`` can be bound now, else why not and what to do (checked before anything is
    started): a taken port is told apart from an address this machine does not have."""
    import errno
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as e:
        return f"cannot resolve {host}: {e}"
    for family, kind, proto, _, addr in infos[:1]:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(addr)
            except OSError as e:
                why = f"cannot listen on {host}:{port}: {e.strerror or e}"
                if e.errno == errno.EADDRINUSE:
                    return f"{why} (another `substrate up`? choose one with --port)"
                if e.errno == errno.EADDRNOTAVAIL:
                    return (f"{why} ({host} is not an address of this machine; choose one with --host, e.g. "
                            "127.0.0.1, or 0.0.0.0 for all)")
                if e.errno == errno.EACCES:
                    return f"{why} (ports below 1024 need privileges; choose another with --port)"
                return why
    return None


def _worker_host_problem(host: str) -> str | None:
    """None if local workers can listen on ``host`` (an IPv4 address of this machine or a name that
    resolves to one, or an IPv6 literal of this machine such as ``::1``: ``workers.server.listen_socket``
    binds IPv6 for a literal, IPv4 otherwise), else why not. Checked before anything starts: a wrong one
    had every worker crash at start, one a second, and then every create wait 30 s for a 503
    ``no_capacity`` (a fresh-user run)."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        addr = socket.getaddrinfo(host.strip("[]"), 0, family=family, type=socket.SOCK_STREAM)[0][4]
    except OSError as e:
        return (f"{host!r} is not an IPv4 address, an IPv6 literal or a name of an IPv4 address "
                f"({e.strerror or e}); use e.g. 127.0.0.1, or 0.0.0.0 for all")
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((addr[0], 0))
        except OSError as e:
            return (f"cannot listen on {host}: {e.strerror or e} (not an address of this machine? use e.g. "
                    "127.0.0.1, or 0.0.0.0 for all)")
    return None


def _safe_redis_url(url: str) -> str:
    """``url`` with its password (if any) replaced by ``***``, for a terminal."""
    from urllib.parse import urlsplit, urlunsplit

    u = urlsplit(url)
    if u.password is None:
        return url
    user = f"{u.username}:***" if u.username else ":***"
    host = u.netloc.rpartition("@")[2]
    return urlunsplit(u._replace(netloc=f"{user}@{host}"))


def _redis_problem(url: str) -> str | None:
    """None if the Redis at ``url`` answers a PING (with its password), else why not: an unreachable
    external Redis showed only after the API began starting, as a traceback and exit 3."""
    import asyncio

    from redis.exceptions import RedisError

    from substrate.directory import Directory

    async def ping() -> None:
        d = Directory(url, socket_timeout_s=5)
        try:
            await d.redis.ping()
        finally:
            await d.close()
    try:
        asyncio.run(ping())
    except (OSError, RedisError, asyncio.TimeoutError) as e:  # redis-py's ConnectionError is no OSError
        return f"{e.__class__.__name__}: {e}" if str(e) else e.__class__.__name__
    return None


def _is_loopback_host(host: str) -> bool:
    """Whether ``host`` (a listen address or name) is this machine's loopback only."""
    import ipaddress

    if host.strip("[]").lower() in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # another name: it may resolve anywhere


def _open_mode_on_a_network(settings: Any, redis_url: str, host: str) -> bool:
    """Whether this start serves open mode (no credentials of any kind: no API key configured or ever
    made, no OIDC issuer, no admin token) on an address beyond loopback, where open mode's ``Host`` check
    does not apply: anyone who reaches the port drives every session (fresh-user round 24: no word of it at
    start). False when Redis cannot be asked (the runtime's start asks again)."""
    import asyncio

    if _is_loopback_host(host) or settings.auth.api_keys or settings.auth.api_keys_file or \
            settings.auth.oidc_issuer or settings.api.auth_token:
        return False
    from substrate.apikeys import ApiKeyStore
    from substrate.directory import Directory

    async def ask() -> bool:
        d = Directory(redis_url, settings.redis.key_prefix, socket_timeout_s=5)
        try:
            return not await ApiKeyStore(d.redis, d.keys).ever_configured()
        finally:
            await d.close()
    try:
        return asyncio.run(ask())
    except Exception:  # noqa: BLE001 - only a warning
        return False


def _store_location_problem(settings: Any, redis_url: str) -> str | None:
    """The objection of ``substrate.storeloc.check`` to this start's snapshot store (None: none, and the
    location is recorded), or why Redis could not be asked (then the runtime's own start asks again)."""
    import asyncio

    from redis.exceptions import RedisError

    from substrate import storeloc
    from substrate.directory import Directory

    async def ask() -> str | None:
        d = Directory(redis_url, settings.redis.key_prefix, socket_timeout_s=5)
        try:
            return await storeloc.check(d.redis, d.keys, settings.snapshot)
        finally:
            await d.close()
    try:
        return asyncio.run(ask())
    except (OSError, RedisError, asyncio.TimeoutError):
        return None


def _client(server: str, token: Optional[str]) -> SubstrateClient:
    """The SDK client for a CLI command; a token it refuses is one line and exit 1 (never the token); a
    server URL that cannot name one is a bad argument: one line naming ``--server``, exit 2 (it read as
    an HTTP answer, ``error 400 invalid_server_url``, exit 1: fresh-user round 11)."""
    try:
        return SubstrateClient(server, token=token)
    except ApiError as e:
        if e.code != "invalid_server_url":
            _api_error_exit(e)
        err.print(f"[red]error[/red]: --server (or SUBSTRATE_SERVER): {escape(e.message)}", soft_wrap=True,
                  highlight=False)
        raise typer.Exit(2) from None


def _print(obj: Any) -> None:
    console.print_json(json.dumps(obj))


def usage_refused(status: int, code: str, details: dict[str, Any] | None = None) -> bool:
    """Whether an API error refused the command's own arguments, which then exits 2 as a bad option the
    CLI itself catches does, so a script can tell "fix the command" (2) from every other failure (1)
    wherever the check was made (fresh-user tester 45: ``--state bogus`` exited 2, ``--tenant BAD`` 1):
    400 ``bad_json`` or ``bad_request``, a 400/422 ``invalid_...``, and a 422 ``unknown_template`` or
    ``unknown_worker`` (a template or worker the command names that the API lacks: tester 46), and a 400
    ``unsupported_template`` (a template the command names that no worker can run: tester 51). Not
    ``unknown_pool`` (the server's catalog at fault), nor an ``unknown_template`` of ``details.reason``
    ``template_removed`` (a wake of a session whose template the server's config no longer has: tester 54),
    nor the agent's own 422s (``agent_error``, ``state_load_failed``): the command was well formed."""
    if (details or {}).get("reason") == "template_removed":
        return False  # the session's own template, gone from the server's config: not the command's fault
    return status in (400, 422) and (code in ("bad_json", "bad_request") or code.startswith("invalid_")) or (
        status == 422 and code in ("unknown_template", "unknown_worker")) or (
        status == 400 and code == "unsupported_template")


def _api_error_exit(e: ApiError) -> NoReturn:
    """One line for an API error (status, code, message) and exit 1, or 2 when it refused the command's
    arguments (``usage_refused``); a replayed one (the kept answer of a turn that already ran under the
    key) says so first; an error after a streamed answer began prints the chunks before it (on stdout, as
    ``--stream`` does) and is not called status 200."""
    if e.replayed:
        err.print("note: replayed: a turn with this idempotency key already ran; this is its kept answer "
                  "(the turn was not run again)", markup=False, highlight=False)
    if e.details.get("mid_stream"):
        for chunk in e.chunks:
            _print(chunk)
        err.print(f"[red]error[/red]: the turn failed after its answer began ({escape(e.code)}: {escape(e.message)})")
        raise typer.Exit(1) from None
    # a 401's message names the HTTP header; this CLI's way to send one is --token (fresh-user run)
    hint = " (this CLI sends one with --token or SUBSTRATE_TOKEN)" if e.status == 401 else ""
    err.print(f"[red]error {e.status} {e.code}[/red]: {escape(e.message)}{hint}")
    raise typer.Exit(2 if usage_refused(e.status, e.code, e.details) else 1) from None


def _run(fn: Any) -> Any:
    try:
        return fn()
    except typer.Exit:
        raise  # an exit already said why (it printed "error: Exit: 1" after its own line: round 25)
    except ApiError as e:
        _api_error_exit(e)
    except Exception as e:  # noqa: BLE001 - connection errors etc. as one clear line
        import httpx

        if isinstance(e, httpx.TransportError):
            # name the server: "Connection refused" alone did not say which URL was tried (fresh-user run)
            try:
                where = f"{e.request.url.scheme}://{e.request.url.netloc.decode()}"
            except RuntimeError:  # no request attached
                where = "the server"
            err.print(f"[red]error[/red]: cannot reach the API at {escape(where)}: {e.__class__.__name__}: "
                      f"{escape(str(e))} (is `substrate up` running there? --server or SUBSTRATE_SERVER "
                      "names another)")
            raise typer.Exit(1) from None
        err.print(f"[red]error[/red]: {e.__class__.__name__}: {escape(str(e))}")
        raise typer.Exit(1) from None


def _fit_output() -> None:
    """Output to a pipe or a file (no terminal, no ``COLUMNS``) is not wrapped at rich's default 80 columns:
    ``sessions delete ID > f`` split a long ID over three lines and ``sessions list | ...`` wrapped the
    WORKER column (fresh-user run); each line is as long as its content then. A terminal keeps its width."""
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console.width, console.soft_wrap = 4096, True
    else:
        console.width, console.soft_wrap = None, False  # the module's console outlives one invocation


@app.callback()
def _main(server: Optional[str] = typer.Option(None, "--server", "-s", help="Base URL of the API for the "
                                               "client commands (also accepted after the subcommand; env "
                                               "SUBSTRATE_SERVER)."),
          token: Optional[str] = typer.Option(None, "--token", help="API key or JWT for the client commands "
                                              "(also accepted after the subcommand; env SUBSTRATE_TOKEN).")) -> None:
    """Agent session runtime: many bursty, stateful agent sessions on few warm workers."""
    _fit_output()
    if server:
        os.environ["SUBSTRATE_SERVER"] = server
    if token:
        os.environ["SUBSTRATE_TOKEN"] = token


@app.command()
def up(host: str = typer.Option(None, help="Listen address (default 127.0.0.1)."),
       port: int = typer.Option(None, parser=port_parser(), help="Listen port (default 8080)."),
       config: Path = typer.Option(None, "--config", "-c", help="Folder of ActorTemplate/WorkerPool YAML "
                                                               "(default: the examples shipped in the package)."),
       ) -> None:
    """Run the embedded default in the foreground: API + state manager + local worker pool (+ an embedded
    Redis when SUBSTRATE_REDIS_URL is unset). Stops everything it started on SIGINT/SIGTERM/SIGHUP (a
    closed terminal), gracefully."""
    # SIGINT stops `up` from its first moment, as it does once serving: a shell starts a background job
    # (`substrate up &` in a script) with SIGINT ignored, and until the server installed its handler a
    # `kill -INT` was lost and the runtime went on to serve (fresh-user round 11). Before serving, it
    # ends like a Ctrl-C at a prompt: exit 130, nothing started is left (the finally below)
    signal.signal(signal.SIGINT, signal.default_int_handler)

    from substrate.embedded import EmbeddedRedis
    from substrate.logs import configure_logging
    from substrate.serving import Server, server_config

    if config is not None:
        os.environ["SUBSTRATE_CONFIG_DIR"] = str(config)
    from substrate.backends.local import check_capacity, check_port_range
    from substrate.specs import SpecError, load_catalog

    if os.environ.get("SUBSTRATE_ROLE", "embedded") != "embedded":
        # the embedded default is what `up` runs: an inherited SUBSTRATE_ROLE=router (a shell set up for
        # `substrate router`) made it serve the API with no worker pool, never ready, without a word
        err.print(f"note: SUBSTRATE_ROLE={escape(os.environ['SUBSTRATE_ROLE'])} ignored: `substrate up` runs the "
                  "embedded default (API + workers); `substrate router` runs a router alone")
    os.environ["SUBSTRATE_ROLE"] = "embedded"
    settings = _settings()
    try:
        # fail before starting anything, with the file and field; an entrypoint module the workers (this
        # interpreter) cannot import too (a user trial: only the first create failed, 500 agent_start_failed)
        # its warnings (a field of no meaning here) are logged once, by the runtime's own load below
        catalog = load_catalog(settings.config_dir, check_modules=True, log_warnings=False)
        # and no more workers or slots than this machine can run (a fresh-user `replicas: 100000`)
        check_capacity(catalog, settings, source=str(settings.config_dir))
    except SpecError as e:
        # which setting named the folder: --config, SUBSTRATE_CONFIG_DIR, or neither (the default)
        source = ("--config" if config is not None else "SUBSTRATE_CONFIG_DIR" if os.environ.get("SUBSTRATE_CONFIG_DIR")
                  else "the default config folder")
        hint = "" if config is not None else " (use --config DIR)"
        err.print(f"[red]error[/red]: {escape(e.message)} (the folder of {source}){hint}", highlight=False)
        raise typer.Exit(2) from None
    configure_logging(settings.log_level, settings.log_json)
    host = host or settings.api.host
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]  # an IPv6 literal as URLs write it ('[::1]' could not be resolved: round 25)
    port = port or settings.api.port
    try:
        if short := check_port_range(catalog, settings, api_port=port, embedded_redis=not settings.redis.url):
            err.print(f"warning: {short}", markup=False, highlight=False)
    except ValueError as e:
        err.print(f"[red]error[/red]: {escape(str(e))}")
        raise typer.Exit(2) from None
    if why := _free_port(host, port):  # before Redis and workers start, not as an error deep in the log
        err.print(f"[red]error[/red]: {escape(why)}")
        raise typer.Exit(2)
    if problems := _prestart_problems(settings):
        for why in problems:
            err.print(f"[red]error[/red]: {escape(why)}")
        raise typer.Exit(2)
    if settings.redis.url and (why := _redis_problem(settings.redis.url)):
        err.print(f"[red]error[/red]: SUBSTRATE_REDIS_URL={escape(_safe_redis_url(settings.redis.url))}: Redis did "
                  f"not answer ({escape(why)}); start that Redis or fix the URL, or unset SUBSTRATE_REDIS_URL "
                  "to run an embedded one")
        raise typer.Exit(2)
    # made now, by this user, not at first use (and only once every check passed: a refused start makes
    # nothing): in a data folder others can write in, a folder another user made first would be theirs
    # (snapshots: 0700; workers: 0755, entered by the slots' uids)
    settings.worker.root_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
    if settings.snapshot.store == "local":
        settings.snapshot.local_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    embedded = None
    if not settings.redis.url:
        # persistent: a restart keeps every session
        embedded = EmbeddedRedis(settings.redis.data_dir, port_range=settings.worker.ports)
        try:
            os.environ["SUBSTRATE_REDIS_URL"] = embedded.start()
        except RuntimeError as e:
            err.print(f"[red]error[/red]: {e}")
            raise typer.Exit(2) from None
        except OSError as e:  # no free port in SUBSTRATE_WORKER__PORT_RANGE
            embedded.stop()
            err.print(f"[red]error[/red]: the embedded Redis: {escape(e.strerror or str(e))} "
                      "(SUBSTRATE_WORKER__PORT_RANGE): widen the range or free a port of it")
            raise typer.Exit(2) from None
        err.print(f"embedded Redis at {embedded.safe_url}")
    if why := _store_location_problem(settings, os.environ.get("SUBSTRATE_REDIS_URL") or settings.redis.url):
        err.print(f"[red]error[/red]: {escape(why)}")
        if embedded is not None:
            embedded.stop()
        raise typer.Exit(2)
    if _open_mode_on_a_network(settings, os.environ.get("SUBSTRATE_REDIS_URL") or settings.redis.url, host):
        err.print(f"warning: open mode (no API key or other credential) on {host}, beyond loopback: anyone who can "
                  "reach this port can create, drive and delete every session (the Host check that guards open "
                  "mode applies to loopback only); create a key first (`substrate keys create NAME --admin`) or "
                  "listen on 127.0.0.1", markup=False, highlight=False)
    # one deployment per workers folder, whatever Redis it uses (the embedded Redis locks its own folder
    # too): two runtimes of different key prefixes on an external Redis shared a data folder, so its local
    # snapshot store (then fenced: another directory's marker) and the workers' folders (fresh-user round
    # 23); processes of one deployment may share it (the chaos run's two `up`)
    from substrate.embedded import claim_folder

    deployment = (f"Redis {_safe_redis_url(settings.redis.url)}" if settings.redis.url
                  else f"embedded Redis in {settings.redis.data_dir.resolve()}") + \
        f", key prefix {settings.redis.key_prefix!r}"
    try:
        workers_lock = claim_folder(settings.worker.root_dir, deployment, f"workers folder {settings.worker.root_dir}")
    except RuntimeError as e:
        err.print(f"[red]error[/red]: {escape(str(e))}")
        if embedded is not None:
            embedded.stop()
        raise typer.Exit(2) from None

    def _term(*_: object) -> None:
        # uvicorn re-raises the signal it caught after a graceful shutdown; turn SIGTERM (and SIGHUP: a
        # closed terminal) into an exception so the finally below still stops the embedded Redis
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, _term)
    signal.signal(signal.SIGHUP, _term)
    try:
        cfg = server_config(settings.api, host, port)
        # a doubled Ctrl-C (terminal + `uv run`) still stops gracefully; a deliberate second one exits at
        # once (status 130), and this finally does not run then: the embedded Redis's keeper stops it once
        # the workers have suspended their sessions, as after a kill -9 (substrate/redis_keeper.py)
        server = Server(cfg)

        def _quiesce() -> None:  # the pools start no worker while the stop waits for requests in flight
            app = getattr(server.config, "loaded_app", None)  # the API, inside uvicorn's middleware
            for _ in range(10):
                if app is None or getattr(app, "runtime", None) is not None:
                    break
                app = getattr(app, "app", None)
            pools = getattr(getattr(app, "runtime", None), "pools", None)
            if pools is not None:
                pools.quiesce()

        server.before_shutdown = _quiesce

        def _announce() -> None:  # only once the port accepts connections
            while not server.started and not server.should_exit:
                time.sleep(0.05)
            if server.started:
                shown = f"[{host}]" if ":" in host and not host.startswith("[") else host  # an IPv6 literal
                bound = [sock.getsockname()[0] for srv in getattr(server, "servers", []) for sock in srv.sockets]
                err.print(f"serving on http://{shown}:{port}{listen_note(host, bound)} (docs at /docs); Ctrl-C stops",
                          markup=False)

        threading.Thread(target=_announce, name="announce", daemon=True).start()
        server.run()
        if not server.started:
            raise typer.Exit(1)
    finally:
        if embedded is not None:
            embedded.stop()
        os.close(workers_lock)


@app.command()
def convert(files: list[Path] = typer.Argument(..., metavar="FILES", help="YAML files (e.g. the repository's tests/k8s/seed/*.yaml, "
                                                         "the documents of the articles this project comes "
                                                         "from); - reads standard input.")) -> None:
    """Print FILES as this runtime's API takes them (pipe into kubectl apply -f -): the seed documents'
    apiVersions and spellings (tests/k8s/seed/ in the repository) translated, v1alpha2 DRA objects
    converted to resource.k8s.io/v1; warnings on stderr."""
    import logging

    import yaml

    from substrate.specs import SpecError, convert_documents, parse_yaml_documents

    logging.getLogger("substrate.specs").setLevel(logging.ERROR)  # warnings are printed below, once

    out: list[Any] = []
    for f in files:
        try:
            text = sys.stdin.read() if str(f) == "-" else f.read_text()
            parsed = parse_yaml_documents(text)
            loaded = [d for d in parsed if isinstance(d, dict) and "kind" in d]
            if not loaded:  # e.g. /etc/passwd parses as one YAML string: not a document of ours
                raise SpecError("no Kubernetes-style documents (mappings with apiVersion and kind) found")
            docs, warnings = convert_documents(loaded, str(f))
            # beside Kubernetes-style ones, another tool's YAML is left out with a word, as `up` does
            # (it made the whole file "no Kubernetes-style documents": fresh-user round 8); never its content
            warnings = [f"{f} document {i} is {'a mapping without kind' if isinstance(d, dict) else 'a YAML list, string or number'}"
                        ", not a Kubernetes-style document; left out" for i, d in enumerate(parsed, 1)
                        if d is not None and not (isinstance(d, dict) and "kind" in d)] + warnings
        except (OSError, yaml.YAMLError, SpecError, RecursionError, UnicodeDecodeError) as e:
            from substrate.specs import yaml_problem

            # a YAML error in one line, as `up` gives it (PyYAML's own text spans six, with excerpts)
            msg = ("nested too deeply" if isinstance(e, RecursionError)
                   else f"not valid YAML: {yaml_problem(e)}" if isinstance(e, yaml.YAMLError)
                   else getattr(e, "message", None) or str(e))
            where = f"{f}: " if not msg.startswith(str(f)) else ""  # a SpecError may name the file itself
            err.print(f"[red]error[/red]: {where}{escape(msg)}")
            raise typer.Exit(2) from None
        for w in warnings:
            err.print(f"[yellow]warning[/yellow]: {escape(w)}")
        out += docs
    sys.stdout.write(yaml.safe_dump_all(out, sort_keys=False))


@app.command()
def worker(pool: str = typer.Option(None, envvar="SUBSTRATE_WORKER_POOL", help="WorkerPool this worker serves."),
           slots: int = typer.Option(None, envvar="SUBSTRATE_WORKER_SLOTS", min=1, help="Session slots."),
           port: int = typer.Option(8081, envvar="SUBSTRATE_WORKER_PORT", parser=port_parser(lowest=0),
                                    help="Listen port (0: any free one)."),
           host: str = typer.Option("0.0.0.0", envvar="SUBSTRATE_WORKER_LISTEN_HOST", help="Listen address."),
           advertise: str = typer.Option(None, envvar="SUBSTRATE_POD_IP",
                                         help="Address registered for routers (the Pod IP, downward API)."),
           worker_id: str = typer.Option(None, envvar="SUBSTRATE_POD_NAME", help="Worker id (the Pod name)."),
           ) -> None:
    """Run one worker (one per Pod on Kubernetes): listens on HOST:PORT, registers the Pod IP, keeps its
    workspaces under SUBSTRATE_WORKER__ROOT_DIR (a mounted volume), takes the internal token from
    SUBSTRATE_WORKER__INTERNAL_TOKEN (a Secret). SIGTERM stops it within the Pod's grace period."""
    import importlib

    _settings()  # an invalid variable: one line and exit 2, not a traceback from the worker
    if not pool or not slots:
        err.print("[red]error[/red]: --pool and --slots (or SUBSTRATE_WORKER_POOL / SUBSTRATE_WORKER_SLOTS) are required")
        raise typer.Exit(2)
    if not os.environ.get("SUBSTRATE_WORKER__INTERNAL_TOKEN"):
        err.print("[red]error[/red]: SUBSTRATE_WORKER__INTERNAL_TOKEN is not set (mount the internal-token Secret)")
        raise typer.Exit(2)
    if not (os.environ.get("SUBSTRATE_REDIS_URL") or os.environ.get("SUBSTRATE_REDIS__URL")):
        err.print("[red]error[/red]: SUBSTRATE_REDIS_URL is not set")
        raise typer.Exit(2)
    argv = ["--pool", pool, "--slots", str(slots), "--host", host, "--port", str(port)]
    if advertise:
        argv += ["--advertise-host", advertise]
    if worker_id:
        argv += ["--worker-id", worker_id]
    # the worker lives in the workers package (substrate imports none of it statically: import rule)
    importlib.import_module("workers.server").main(argv)


def _serve_api(host: str, port: int) -> None:
    from substrate.logs import configure_logging
    from substrate.serving import Server, server_config

    settings = _settings(warn=False)  # the router warned before its own checks
    if problems := _prestart_problems(settings, local=False):
        for why in problems:
            err.print(f"[red]error[/red]: {escape(why)}")
        raise typer.Exit(2)
    configure_logging(settings.log_level, settings.log_json)
    cfg = server_config(settings.api, host, port)
    server = Server(cfg)
    server.run()
    if not server.started:
        raise typer.Exit(1)


def listen_note(host: str, bound: list[str]) -> str:
    """What ``serving on`` adds when ``host`` is a name: the addresses the server listens on (``--host
    localhost`` listens on the first address the name resolves to, 127.0.0.1, and a client that resolves
    it to ::1 first was refused while the line said "localhost": fresh-user tester 50); "" for an
    address given as such, or when nothing is known."""
    import ipaddress

    try:
        ipaddress.ip_address(host.strip("[]"))
        return ""
    except ValueError:
        pass
    addrs = sorted(set(bound))
    return f" (listening on {', '.join(addrs)} only)" if addrs else ""


@app.command()
def router(host: str = typer.Option("0.0.0.0", help="Listen address."),
           port: int = typer.Option(8080, parser=port_parser(), help="Listen port."),
           kubernetes: bool = typer.Option(True, "--kubernetes/--files",
                                           help="Templates and pools from the Kubernetes API (default) or from "
                                                "the YAML files in SUBSTRATE_CONFIG_DIR (default: the shipped "
                                                "examples).")) -> None:
    """Run the public REST API and proxy only (stateless: run any number side by side). Needs
    SUBSTRATE_REDIS_URL and SUBSTRATE_WORKER__INTERNAL_TOKEN (the same value on every router)."""
    _warn_unknown_env()
    if not (os.environ.get("SUBSTRATE_REDIS_URL") or os.environ.get("SUBSTRATE_REDIS__URL")):
        err.print("[red]error[/red]: SUBSTRATE_REDIS_URL is not set (a router has no embedded Redis)")
        raise typer.Exit(2)
    if not os.environ.get("SUBSTRATE_WORKER__INTERNAL_TOKEN"):
        err.print("[red]error[/red]: SUBSTRATE_WORKER__INTERNAL_TOKEN is not set (routers must share it)")
        raise typer.Exit(2)
    if kubernetes:
        _exit_without_kube()
    os.environ["SUBSTRATE_ROLE"] = "router"
    os.environ["SUBSTRATE_CATALOG_SOURCE"] = "kubernetes" if kubernetes else "files"
    _serve_api(host, port)


def _exit_without_kube() -> None:
    """One line and exit 2 when no Kubernetes API is configured (``substrate.k8s.api.config_problem``)."""
    from substrate.k8s.api import config_problem

    if why := config_problem(_settings()):
        err.print(f"[red]error[/red]: {escape(why)}", soft_wrap=True, highlight=False)
        raise typer.Exit(2)


@app.command()
def controller(host: str = typer.Option("0.0.0.0", help="Probe/metrics listen address."),
               port: int = typer.Option(8090, parser=port_parser(), help="Probe/metrics port.")) -> None:
    """Run the pool controller and state manager against the Kubernetes API (one leader through a
    coordination.k8s.io Lease; extra replicas wait as standbys)."""
    import importlib

    _settings()  # an invalid variable: one line and exit 2, not a traceback from the controller
    if not (os.environ.get("SUBSTRATE_REDIS_URL") or os.environ.get("SUBSTRATE_REDIS__URL")):
        err.print("[red]error[/red]: SUBSTRATE_REDIS_URL is not set")
        raise typer.Exit(2)
    if not os.environ.get("SUBSTRATE_WORKER__INTERNAL_TOKEN"):
        err.print("[red]error[/red]: SUBSTRATE_WORKER__INTERNAL_TOKEN is not set (workers and routers share it)")
        raise typer.Exit(2)
    _exit_without_kube()
    raise typer.Exit(importlib.import_module("api.controller").main(host, port))


def _drop_prefix(redis_url: str, prefix: str) -> int:
    """Delete every key under ``prefix:`` in the Redis at ``redis_url`` (cluster URLs too); returns how
    many. Used by the demo to leave nothing in a Redis it shares with the user."""
    import asyncio

    from substrate.directory import Directory

    async def run() -> int:
        d = Directory(redis_url, prefix, socket_timeout_s=5)
        n = 0
        try:
            async for key in d.redis.scan_iter(match=f"{prefix}:*", count=1000):
                n += await d.redis.delete(key)
        finally:
            await d.close()
        return n
    return asyncio.run(run())


#: in a demo's temporary folder: the demo's pid, Redis key prefix and shared Redis URL (or null)
DEMO_OWNER_FILE = "demo-owner.json"


def _sweep_killed_demos() -> None:
    """Remove the temporary folders (and shared-Redis keys) of demos that were killed before they could
    clean up (SIGKILL, a crash): a ``substrate-demo-*`` folder whose owner file names a pid that no
    longer runs. A folder without that file, or whose demo still runs, is left alone."""
    import shutil
    import tempfile

    for folder in Path(tempfile.gettempdir()).glob("substrate-demo-*"):
        try:
            owner = json.loads((folder / DEMO_OWNER_FILE).read_text())
            pid = int(owner["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        try:
            os.kill(pid, 0)
            continue  # still running (or the pid was reused: leave it rather than guess)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # another user's live process
        if owner.get("redis"):
            try:
                _drop_prefix(str(owner["redis"]), str(owner["prefix"]))
            except Exception as e:  # noqa: BLE001 - say what is left, go on
                err.print(f"could not remove a killed demo's Redis keys (prefix {owner.get('prefix')}): "
                          f"{escape(str(e))}")
                continue
        shutil.rmtree(folder, ignore_errors=True)
        err.print(f"removed the data of a demo that was killed ({folder})")


def _show_tail(log_file: Path, lines: int = 30) -> None:
    """Print the last ``lines`` lines of a demo server's log to stderr (nothing if it is missing or empty)."""
    try:
        tail = log_file.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return
    if tail:
        err.print(f"last {len(tail)} lines of the demo server's log:")
        for line in tail:
            err.print(escape(line), soft_wrap=True, highlight=False)


@app.command()
def demo(port: int = typer.Option(18080, parser=port_parser(), help="Port for the demo server."),
         keep: bool = typer.Option(False, help="Leave the server running (Ctrl-C stops).")) -> None:
    """Start the embedded default, create a counter session and invoke it, suspend it and wake it with
    the next invoke, do the same with a notebook session (its variables survive), then stop everything. The demo's runtime keeps its data (embedded Redis, snapshots,
    workspaces) in a fresh temporary folder (the local snapshot store there, whatever SUBSTRATE_SNAPSHOT__STORE says), and under its own key prefix when SUBSTRATE_REDIS_URL names a
    Redis; at the end it deletes its sessions, that folder and those keys: nothing of it is left."""
    import shutil
    import tempfile
    import uuid

    def say(line: str) -> None:
        # one line each, never wrapped at the terminal's width ("(state" / "RUNNING)" on 80 columns)
        console.print(line, soft_wrap=True)

    from substrate.embedded import die_with_parent_hook

    _sweep_killed_demos()

    def _stop(signum: int, _frame: object) -> None:
        # SIGTERM or SIGHUP (a closed terminal) ends the demo as Ctrl-C does: through the finally blocks
        # below, which delete its sessions, stop its server and remove its data (they were left behind:
        # fresh-user round 24)
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGHUP, _stop)
    # Ctrl-C too when the shell started the demo with SIGINT ignored (a background job), as `up` does
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # checked before anything starts: with the port taken, the readiness poll below found whatever server
    # held it, and the demo ran (and left its sessions) there (a fresh-user run)
    if why := _free_port("127.0.0.1", port):
        err.print(f"error: {escape(why)}")
        raise typer.Exit(2)
    data = Path(tempfile.mkdtemp(prefix="substrate-demo-"))
    prefix = f"substrate-demo-{uuid.uuid4().hex[:8]}"
    env = dict(os.environ, SUBSTRATE_LOG_LEVEL=os.environ.get("SUBSTRATE_LOG_LEVEL", "WARNING"),
               # every folder the runtime writes to, so none of the user's settings points it at ./var
               SUBSTRATE_DATA_DIR=str(data), SUBSTRATE_REDIS__DATA_DIR=str(data / "redis"),
               SUBSTRATE_WORKER__ROOT_DIR=str(data / "workers"), SUBSTRATE_SNAPSHOT__LOCAL_DIR=str(data / "snapshots"),
               # the local store in that folder even when the shell names an S3 store: the demo wrote into the
               # user's bucket and prefix, left its marker there, and a real runtime then found that bucket
               # holding "another directory's snapshots" (fresh-user round 21)
               SUBSTRATE_SNAPSHOT__STORE="local", SUBSTRATE_REDIS__KEY_PREFIX=prefix)
    shared_redis = env.get("SUBSTRATE_REDIS_URL") or env.get("SUBSTRATE_REDIS__URL")
    # who owns the folder: a later demo removes it (and the keys) if this one is killed before its end
    (data / DEMO_OWNER_FILE).write_text(json.dumps({"pid": os.getpid(), "prefix": prefix, "redis": shared_redis}))
    err.print(f"demo data in {data}" + (f" and under Redis key prefix {prefix}" if shared_redis else "")
              + "; removed when the demo ends")
    # SIGTERM to the server if the demo itself is killed, so no runtime outlives it
    # the server's log (its audit records are JSON lines whatever the level) goes to a file, so it does
    # not interleave with the demo's own lines (a fresh-user run); its tail is shown if the demo fails
    server_log = data / "server.log"
    with server_log.open("wb") as log_out:
        proc = subprocess.Popen([sys.executable, "-m", "substrate.cli", "up", "--port", str(port)], env=env,
                                stdout=log_out, stderr=subprocess.STDOUT, preexec_fn=die_with_parent_hook())
    url = f"http://127.0.0.1:{port}"
    created: list[str] = []
    ok = False
    stopping = {"interrupted": False, "again": False}

    def _cleanup_interrupt(_signum: int, _frame: object) -> None:
        # what is left of the deletes is skipped; the server is left to stop (a killed one leaves workers
        # and its Redis writing into the folder while it is removed)
        stopping["interrupted"] = stopping["again"] = True

    try:
        with SubstrateClient(url) as c:
            try:
                for _ in range(300):
                    # its own server first: one that could not listen must not let another answer for it
                    if proc.poll() is not None:
                        err.print("[red]the server exited[/red]")
                        raise typer.Exit(1)
                    try:
                        if c.http.get("/readyz").status_code == 200 and proc.poll() is None:
                            break
                    except Exception:  # noqa: BLE001 - not up yet
                        pass
                    time.sleep(0.1)
                s = _run(lambda: c.create_session("counter"))
                created.append(s["id"])
                say(f"created session [bold]{s['id']}[/bold] on worker {s['worker']} (state {s['state']})")
                for _ in range(3):
                    say(f"invoke increment -> {_run(lambda: c.invoke(s['id'], 'increment'))}")
                st = _run(lambda: c.suspend(s["id"]))
                say(f"suspended ({st['suspendReason']}) -> state {st['state']}, "
                    f"snapshot {st['snapshot']['sizeBytes']} bytes")
                t0 = time.perf_counter()
                out = _run(lambda: c.invoke(s["id"], "increment"))
                say(f"invoke increment (woke it in {1000 * (time.perf_counter() - t0):.0f} ms) -> {out}")
                st = _run(lambda: c.get_session(s["id"]))
                say(f"state {st['state']} on worker {st['worker']}, epoch {st['epoch']}, "
                    f"restoredFrom {st['restoredFrom']}")
                nb = _run(lambda: c.create_session("notebook"))
                created.append(nb["id"])
                _run(lambda: c.invoke(nb["id"], "x = 6 * 7"))
                _run(lambda: c.suspend(nb["id"]))
                say(f"notebook after suspend/resume: x -> {_run(lambda: c.invoke(nb['id'], 'x'))}")
                ok = True  # the demo ran through (a Ctrl-C under --keep is its normal end)
                if keep:
                    say(f"server at {url} (its log: {server_log}); Ctrl-C stops (and removes the demo's data)")
                    proc.wait()
            finally:
                # the clean-up runs to its end: a Ctrl-C during it (a second one, or the first coming late,
                # after the notebook line) raised out of it and left the folder behind with no word
                # (fresh-user tester 53); now such a Ctrl-C stops the server at once and skips what is left
                # of the deletes, and the folder and keys still go below
                signal.signal(signal.SIGINT, _cleanup_interrupt)
                # through the API while the server runs: that also deletes their snapshots wherever the
                # store is (an S3 bucket from SUBSTRATE_SNAPSHOT__* too), not only in the folder below
                # a Ctrl-C reaches the server too (the terminal signals the whole group): its deletes then
                # fail as it stops, which loses nothing (its store is the folder removed below); said only
                # when the demo was not interrupted (one alarming line per session: fresh-user round 25)
                interrupted = isinstance(sys.exc_info()[1], (KeyboardInterrupt, SystemExit))
                stopping["interrupted"] = stopping["interrupted"] or interrupted
                for sid in created if proc.poll() is None and not stopping["again"] else []:
                    try:
                        c.delete_session(sid)
                    except Exception:  # noqa: BLE001 - best effort; the folder and keys go below anyway
                        if not stopping["interrupted"]:
                            err.print(f"could not delete demo session {sid}")
    finally:
        signal.signal(signal.SIGINT, _cleanup_interrupt)  # (also when the start-up was cut short)
        if isinstance(sys.exc_info()[1], (KeyboardInterrupt, SystemExit)):
            stopping["interrupted"] = True
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if shared_redis:
            try:
                _drop_prefix(shared_redis, prefix)
            except Exception as e:  # noqa: BLE001 - say what is left rather than hide the demo's outcome
                err.print(f"could not remove the demo's Redis keys (prefix {prefix}): {escape(str(e))}")
        if not ok and not stopping["interrupted"]:  # a Ctrl-C is no failure: no server log tail (tester 53)
            _show_tail(server_log)
        # a server that was forced to exit (a second Ctrl-C) leaves its workers suspending their sessions
        # into the folder and its Redis until they are gone (seconds): removed again until it stays gone
        for _ in range(30):
            shutil.rmtree(data, ignore_errors=True)
            if not data.exists():
                break
            time.sleep(0.5)
        if data.exists():
            err.print(f"demo data left in {data}: its processes were still writing there; the next "
                      "`substrate demo` removes it")
        else:
            err.print(f"demo data removed ({data})")
        if stopping["again"] and sys.exc_info()[1] is None:  # a Ctrl-C during the clean-up: exit as Ctrl-C does
            raise typer.Exit(130)


@sessions.command("create")
def s_create(template: str = typer.Argument(..., metavar="TEMPLATE", help="ActorTemplate name, e.g. counter"),
             id: Optional[str] = typer.Option(None, "--id", help="Client-chosen session ID."),
             label: list[str] = typer.Option([], "--label", "-l", help="key=value, repeatable"),
             env: list[str] = typer.Option([], "--env", "-e", help="NAME=value for the session's agent, "
                                                                   "repeatable (values are never echoed back)"),
             tenant: Optional[str] = typer.Option(None, help="Admins: create it for this tenant."),
             server: str = ServerOpt, token: Optional[str] = TokenOpt) -> None:
    """Create and start a session."""
    labels = _pairs(label, "-l/--label", "key=value")
    env_vars = _pairs(env, "-e/--env", "NAME=value")
    from substrate.labelselector import selectable

    for k, v in labels.items():  # kept as given, but said: `-l k=v,k2=v2` made one label (tester 55)
        if not selectable(v):
            err.print(f"note: label {escape(k)}'s value {escape(json.dumps(v, ensure_ascii=False))} holds whitespace "
                      "or one of = ! ( ) , so a label selector can select it by its key only (-l "
                      f"{escape(k)})" + (", not by its value; one label per -l: -l k=v -l k2=v2" if "," in v and "=" in v
                                         else ", not by its value"), soft_wrap=True, highlight=False)
    with _client(server, token) as c:
        _print(_run(lambda: c.create_session(template, id=id, labels=labels, env=env_vars or None, tenant=tenant)))


def _pairs(given: list[str], option: str, form: str) -> dict[str, str]:
    """``key=value`` options (``option``, written as ``form`` in messages) as a dict; exits 2 (nothing
    sent) on one without ``=`` or a key, or a key given twice (the later one silently won before: a
    fresh-user run)."""
    bad = [x for x in given if "=" not in x or x.startswith("=")]
    if bad:
        err.print(f"[red]error[/red]: {option} takes {form}, got {escape(', '.join(bad))}")
        raise typer.Exit(2)
    keys = [x.split("=", 1)[0] for x in given]
    if dup := sorted({k for k in keys if keys.count(k) > 1}):
        err.print(f"[red]error[/red]: {option}: {escape(', '.join(dup))} given twice")
        raise typer.Exit(2)
    return dict(x.split("=", 1) for x in given)


@sessions.command("get")
def s_get(sid: str = SessionArg, server: str = ServerOpt, token: Optional[str] = TokenOpt) -> None:
    """Show one session."""
    with _client(server, token) as c:
        _print(_run(lambda: c.get_session(sid)))


@sessions.command("list")
def s_list(states: list[str] = typer.Option([], "--state", help="RUNNING, SUSPENDED, ... (any case)"),
           templates: list[str] = typer.Option([], "--template", help="Only this ActorTemplate's sessions."),
           limit: int = typer.Option(50, min=1, max=1000, help="Page size (1 to 1000)."),
           all_pages: bool = typer.Option(False, "--all", help="Follow pagination to the end (from --continue TOKEN if given)."),
           continue_: Optional[str] = typer.Option(None, "--continue",
                                                   help="Start after the page that printed this token."),
           tenant: Optional[str] = typer.Option(None, help="Admins: only this tenant's sessions."),
           selectors: list[str] = typer.Option([], "--selector", "-l",
                                               help="Label selector, as kubectl takes it: 'team=a', "
                                                    "'team=a,env!=prod', 'gpu', '!gpu', 'tier in (web,api)'; "
                                                    "repeated, every one must hold."),
           output: str = typer.Option("table", "--output", "-o",
                                      help="table (IDs never cut, wide columns wrap), json (the API's page: "
                                           "items and metadata.continue) or ids (one ID a line, for pipes)."),
           server: str = ServerOpt, token: Optional[str] = TokenOpt) -> None:
    """List sessions as a table (an admin sees every tenant's, with a TENANT column), JSON or IDs."""
    _check_output(output, ("table", "json", "ids"))
    # a repeated --state or --template kept the last one without a word; a repeated -l dropped the earlier
    # selectors though every one was meant (fresh-user tester 55): those are ANDed, as the API's commas are
    for name, given in (("--state", states), ("--template", templates)):
        if len(given) > 1:
            err.print(f"[red]error[/red]: {name} is given {len(given)} times; a listing takes one (its sessions "
                      "are in one state, of one template)")
            raise typer.Exit(2)
    state = states[0] if states else None
    template = templates[0] if templates else None
    selector = ",".join(selectors) if selectors else None
    if state is not None:
        from substrate.models import LISTABLE_STATES

        # any case (`--state running`), checked before a request: the API takes the upper-case names only
        listable = [s.value for s in LISTABLE_STATES]
        if state.strip().upper() not in listable:
            err.print(f"[red]error[/red]: --state {escape(state)!r} is no state a listing shows; "
                      f"one of {', '.join(listable)}")
            raise typer.Exit(2)
        state = state.strip().upper()
    with _client(server, token) as c:
        if all_pages:
            items = _run(lambda: list(c.iter_sessions(state=state, template=template, limit=limit, tenant=tenant,
                                                      continue_=continue_, label_selector=selector)))
            nxt = None
        else:
            page = _run(lambda: c.list_sessions(state=state, template=template, limit=limit, tenant=tenant,
                                                continue_=continue_, label_selector=selector))
            items, nxt = page["items"], page["metadata"]["continue"]
    if output == "json":
        _print({"items": items, "metadata": {"continue": nxt}})
        return
    if output == "ids":  # plain lines: a pipe gets whole IDs whatever the terminal's width (fresh-user run)
        for s in items:
            print(s["id"])
        # on stderr, so the pipe gets IDs only but nobody mistakes a first page for all (`-o ids | xargs
        # ... delete` handled 50 of 158 sessions without a word: fresh-user run)
        if nxt:
            err.print(f"more: --all, or --continue {nxt}", soft_wrap=True, highlight=False)
        return
    # LABELS last: the columns before it stay where scripts reading the table found them
    header = ("ID", "TENANT", "STATE", "TEMPLATE", "WORKER", "EPOCH", "LABELS")
    rows = [(s["id"], s.get("tenant") or "-", s["state"], s["actorTemplate"], s.get("worker") or "-",
             str(s["epoch"]), _labels_cell(s.get("labels"))) for s in items]
    _print_table(header, rows)
    if nxt:  # one line, never wrapped: the token is copied whole
        console.print(f"more: --all, or --continue {nxt}", soft_wrap=True, highlight=False)


#: how much of a session's labels the LABELS column shows (64 labels of 256 characters would fill screens)
LABELS_CELL_CHARS = 40


def _labels_cell(labels: Any) -> str:
    """A session's labels for the LABELS column: ``k=v`` by key (a value no selector can name in JSON
    quotes, ``k="a,b"``), comma-separated, as many whole ones as fit
    ``LABELS_CELL_CHARS`` then ``+N`` for the rest (one longer than that alone is cut, ending in ``...``);
    ``-`` for none. ``-o json`` has them all."""
    if not isinstance(labels, dict) or not labels:
        return "-"
    from substrate.labelselector import selectable

    # a value a selector cannot name is quoted: `k=v,k2=v2` (one label) read as two (tester 55)
    pairs = [f"{k}={v if selectable(str(v)) else json.dumps(v, ensure_ascii=False)}" for k, v in sorted(labels.items())]
    shown: list[str] = []
    for pair in pairs:
        more = len(pairs) - len(shown) - 1
        if len(",".join([*shown, pair])) + (len(f",+{more}") if more else 0) > LABELS_CELL_CHARS:
            if not shown:  # the first alone is too long: its start
                shown.append(pair[:LABELS_CELL_CHARS - 3 - (len(f",+{more}") if more else 0)] + "...")
            break
        shown.append(pair)
    left = len(pairs) - len(shown)
    return ",".join(shown) + (f",+{left}" if left else "")


def _print_table(header: tuple[str, ...], rows: list[tuple[str, ...]], keep: int = 0) -> None:
    """``rows`` as a table whose column ``keep`` (an ID) is never cut (it was, to "s-00bd36096e5e4…", on
    an 80-column terminal) while the others wrap. A table whose kept column leaves the others under 8
    characters each (3 per column and 1: its borders and padding) cannot show them: rich dropped them
    all (a 128-character ID, a fresh-user run); then plain aligned lines, as kubectl prints, which the
    terminal wraps whole."""
    kept_width = max((len(r[keep]) for r in rows), default=len(header[keep]))
    if kept_width + 3 * len(header) + 1 + (len(header) - 1) * 8 > console.width:
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
        for r in (header, *rows):
            print("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
        return
    t = Table()
    for i, name in enumerate(header):
        if i == keep:
            t.add_column(name, no_wrap=True, min_width=kept_width)
        else:
            t.add_column(name, overflow="fold")
    for r in rows:
        t.add_row(*(escape(v) for v in r))  # text, not markup: a label value "[red]" or "[/]" is printed as is
    console.print(t)


@sessions.command("invoke")
def s_invoke(sid: str = SessionArg, input: str = typer.Argument(..., metavar="INPUT", help="Input; parsed as JSON if it is JSON, else a string "
                                                        "(--text: always a string); `-` reads it from standard "
                                                        "input (a lone dash as the input: '\"-\"' or --text with "
                                                        "a dash on standard input)"),
             text: bool = typer.Option(False, "--text", "-t",
                                       help="Send INPUT as a string, as typed: `true`, `42`, `null` or `[1]` "
                                            "are otherwise sent as JSON values (an agent that takes text, "
                                            "such as the shell, refuses them)"),
             stream: bool = typer.Option(False, help="Stream chunks."),
             idempotency_key: Optional[str] = typer.Option(
                 None, "--idempotency-key", "-k",
                 help="The turn's Idempotency-Key: the same command again with the same key is answered "
                      "from the kept answer, never run twice (default: a new automatic key per command, which "
                      "makes room first in the session's window of kept answers)"),
             server: str = ServerOpt, token: Optional[str] = TokenOpt) -> None:
    """Invoke a session (wakes it if suspended)."""
    if input == "-":
        input = _stdin_input()
    value = _input_value(input, text_only=text)
    # the key is made here, so a command cut off can name it: the turn may still run (or have run) on the
    # server, and a resend with it is answered from the kept answer, never run twice (fresh-user testers
    # 50 and 53: Ctrl-C said nothing, and a server stopped mid-turn read as "cannot reach the API")
    if idempotency_key is not None:
        _run(lambda: checked_idempotency_key(idempotency_key))  # `-k ''` was taken as no key (tester 53)
    key = idempotency_key if idempotency_key is not None else uuid.uuid4().hex
    auto = idempotency_key is None
    with _client(server, token) as c:
        if stream:
            # each chunk as it arrives (``list(...)`` printed them all only after the turn ended: a
            # fresh-user run); an error mid-stream is one line after the chunks before it. A streamed turn
            # is not retried here, so it always carries a key the error line can name for a resend
            chunks = iter(c.invoke_stream(sid, value, idempotency_key=key, key_is_auto=auto,
                                          on_answer=lambda a: _answer_notes(sid, a)))
            end = object()
            while (chunk := _run(lambda: _resend_hint(key, lambda: _next_chunk(chunks, end, key)))) is not end:
                _print(chunk)
        else:
            answer = _run(lambda: _resend_hint(key, lambda: c.invoke_answer(sid, value, idempotency_key=key,
                                                                           key_is_auto=auto)))
            _answer_notes(sid, answer)
            for out in answer.output if answer.streamed else [answer.output]:
                _print(out)  # a streamed turn's replay: its chunks, as --stream prints them


#: 5xx codes answered before the turn reached an agent (no slot, no wake, no store, no token, every worker
#: fenced): a resend hint after them said the turn "may have run" when it certainly had not (tester 54)
_NOT_RUN_CODES = frozenset({"no_capacity", "snapshot_store_unavailable", "resume_timeout", "too_many_parked",
                            "no_signing_key", "worker_fenced"})


def _resend_hint(key: str, fn: Any) -> Any:
    """``fn()`` for one turn sent with Idempotency-Key ``key``. Interrupted (Ctrl-C): one line naming the key,
    exit 130. A failure after which the turn may have run (the server unreachable or gone mid-turn, a 502,
    503 or 504 such as ``router_stopping``, not one of ``_NOT_RUN_CODES``): a note naming the key first, then the error as usual (raised
    on to ``_run``). A resend with the key is always safe: a turn that ran is answered from its kept answer."""
    import httpx

    try:
        return fn()
    except KeyboardInterrupt:
        err.print(f"interrupted: the turn may still run on the server; to get its answer without running "
                  f"it twice, send it again with -k {escape(key)}", soft_wrap=True, highlight=False)
        raise typer.Exit(130) from None
    except (httpx.TransportError, ApiError) as e:
        if isinstance(e, httpx.TransportError) or (e.status in (502, 503, 504) and not e.details.get("mid_stream")
                                                   and e.code not in _NOT_RUN_CODES):
            err.print(f"note: the turn may have run on the server: send it again with -k {escape(key)} (a turn "
                      "that ran is answered from its kept answer, never run twice)", soft_wrap=True, highlight=False)
        raise


def _next_chunk(chunks: Any, end: object, key: str) -> Any:
    """The next chunk of a streamed turn, ``end`` after the last; an error after the answer began (a worker
    lost mid-stream: it printed "error 200 worker_unavailable" with no way on, fresh-user round 24) is
    one line naming what to resend, and exit 1."""
    try:
        return next(chunks, end)
    except ApiError as e:
        if not e.details.get("mid_stream") or e.replayed or e.code != "worker_unavailable":
            if e.details.get("mid_stream"):  # its chunks were printed as they came, its replay note too
                e.chunks, e.replayed = [], False
            raise  # an agent's own error, or a kept one: a resend answers the same (no advice)
        err.print(f"[red]error[/red]: the turn failed after its answer began ({escape(e.code)}: {escape(e.message)}); "
                  f"resend it with -k {escape(key)}: a turn that completed is answered from its kept answer, "
                  "one that did not runs again")
        raise typer.Exit(1) from None


def _answer_notes(sid: str, answer: Any) -> None:
    """What an answer's headers say that its output does not, one line each on stderr (stdout stays the
    output alone, for pipes): a state older than the session had (``X-Substrate-Restored``: the CLI and
    the SDK had dropped it, so a session that came back empty looked like a fresh one; fresh-user round
    23), and a replay of a turn that already ran under the same key."""
    if answer.restored:
        since = ""
        if answer.restored_snapshot_at is not None:
            since = time.strftime(" from its snapshot of %Y-%m-%d %H:%M:%S UTC",
                                  time.gmtime(answer.restored_snapshot_at))
        err.print(f"warning: session {sid} answered from an older state{since} ({answer.restored}): its state "
                  "since its last snapshot is gone", markup=False, highlight=False)
    if answer.replayed:
        err.print("note: replayed: a turn with this idempotency key already ran; this is its kept answer "
                  "(the turn was not run again)", markup=False, highlight=False)


def _not_json_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _stdin_input() -> str:
    """INPUT ``-``: standard input as UTF-8 text without its one final line break (``echo x |`` sends
    ``x``, as ``$(cat)`` would: fresh-user run 36 sent ``"increment\\n"``, which the agent refused). Empty,
    or not UTF-8: one error line, exit 2, nothing sent."""
    raw = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        err.print(f"error: standard input is not UTF-8 text (byte {raw[e.start]:#04x} at {e.start}); nothing was sent")
        raise typer.Exit(2) from None
    text = text[:-2] if text.endswith("\r\n") else text[:-1] if text.endswith("\n") else text
    if not text:
        err.print("error: standard input is empty (INPUT '-' reads the turn's input there); nothing was sent")
        raise typer.Exit(2)
    return text


def _input_value(text: str, *, text_only: bool = False) -> Any:
    """INPUT as sent: with ``text_only`` the string itself; else its JSON value if it is JSON (standard JSON:
    ``NaN`` and ``Infinity``, which Python reads but no JSON body may hold, stay strings), else the string
    itself. A lone surrogate (``"\\ud800"``), which no UTF-8 body can carry, or a number out of range
    (``1e999``) is one error line and exit 2 (they were raw ``UnicodeEncodeError`` / ``ValueError`` lines,
    exit 1)."""
    value: Any = text
    if not text_only:
        try:
            value = json.loads(text, parse_constant=_not_json_constant)
        except (ValueError, RecursionError) as e:
            if text.lstrip()[:1] in ('{', '[', '"'):  # meant as JSON, perhaps (or a shell's `{ ...; }`, `[ -f x ]`)
                err.print(f"note: INPUT is not JSON ({escape(str(e))[:120]}): sent as a string (--text says so "
                          "and hides this note)")
    try:
        json.dumps(value, ensure_ascii=False, allow_nan=False).encode("utf-8")
    except UnicodeEncodeError:
        err.print("error: INPUT holds a lone surrogate (e.g. \\ud800), which is not valid Unicode; nothing was sent")
        raise typer.Exit(2) from None
    except ValueError:  # 1e999: JSON, but out of any float's range
        err.print("error: INPUT holds a number out of range (e.g. 1e999); quote it, or use --text, to send it as a string; "
                  "nothing was sent")
        raise typer.Exit(2) from None
    return value


@sessions.command("suspend")
def s_suspend(sid: str = SessionArg, server: str = ServerOpt, token: Optional[str] = TokenOpt) -> None:
    """Snapshot a session and free its slot."""
    with _client(server, token) as c:
        _print(_run(lambda: c.suspend(sid)))


@sessions.command("resume")
def s_resume(sid: str = SessionArg, worker: Optional[str] = typer.Option(None, help="Wake it on this worker only."),
             server: str = ServerOpt, token: Optional[str] = TokenOpt) -> None:
    """Wake a suspended session now."""
    with _client(server, token) as c:
        _print(_run(lambda: c.resume(sid, worker=worker)))


#: the ``-o`` of the event commands: ``jsonl`` (one record a line, their first and default output) and
#: the ones ``sessions list`` has
EVENT_OUTPUTS = ("jsonl", "table", "json", "ids")
EventsOutputOpt = typer.Option("jsonl", "--output", "-o",
                               help="jsonl (one JSON record a line, oldest first), table, json (the API's page: "
                                    "items and metadata.continue) or ids (one record ID a line, for pipes).")
EventsLimitOpt = typer.Option(100, min=1, max=1000, help="Page size (1 to 1000).")
EventsAllOpt = typer.Option(False, "--all", help="Follow pagination to the end (from --continue TOKEN if given).")
EventsContinueOpt = typer.Option(None, "--continue", help="Start after the page that printed this token.")


def _check_output(output: str, formats: tuple[str, ...]) -> None:
    """Exit 2 (nothing sent) unless ``output`` is one of ``formats``."""
    if output not in formats:
        err.print(f"[red]error[/red]: --output {escape(output)!r} is none of {', '.join(formats)}")
        raise typer.Exit(2)


def _event_time(t: Any) -> str:
    """An audit record's ``time`` (Unix s) in ISO 8601 UTC to the millisecond (one word: the plain-lines
    form of a narrow table stays split by whitespace); anything else as it came."""
    if not isinstance(t, (int, float)) or isinstance(t, bool):
        return str(t) if t is not None else "-"
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t * 1000) % 1000:03d}Z"


def _print_events(fetch: Any, *, continue_: Optional[str], all_pages: bool, output: str, session_column: bool) -> None:
    """Pages of audit records from ``fetch(continue_token)`` in ``output`` form (``EVENT_OUTPUTS``), the
    first page or, with ``all_pages``, every page; then, if more pages follow, the ``more:`` line (on
    stderr for ``jsonl`` and ``ids``, so a pipe gets records only; on stdout under a table, as
    ``sessions list`` prints it). ``jsonl`` and ``ids`` print each page as it comes."""
    kept: list[dict[str, Any]] = []
    cont = continue_
    sent = {cont} if cont else set()
    while True:
        page = _run(lambda: fetch(cont))
        for item in page["items"]:
            if output == "jsonl":
                print(json.dumps(item, ensure_ascii=False))
            elif output == "ids":
                print(item.get("id", ""))
        if output in ("json", "table"):
            kept += page["items"]
        if not all_pages:
            cont = page["metadata"]["continue"]
            break
        # a repeated token is an error (a server looping would never end): ApiError, said as any other
        cont = _run(lambda: next_continue(page, sent))
        if not cont:
            break
    if output == "json":
        _print({"items": kept, "metadata": {"continue": cont}})
        return
    if output == "table":
        header = ("TIME", "ACTION", "REASON", *(("SESSION",) if session_column else ()), "WHO", "WORKER",
                  "EPOCH", "RESULT")
        rows = [(_event_time(e.get("time")), str(e.get("action") or "-"), str(e.get("reason") or "-"),
                 *((str(e.get("session") or "-"),) if session_column else ()), str(e.get("who") or "-"),
                 str(e.get("worker") or "-"), "-" if e.get("epoch") is None else str(e["epoch"]),
                 str(e.get("result") or "-")) for e in kept]
        _print_table(header, rows, keep=3 if session_column else 0)
        if cont:
            console.print(f"more: --all, or --continue {cont}", soft_wrap=True, highlight=False)
        return
    if cont:
        err.print(f"more: --all, or --continue {cont}", soft_wrap=True, highlight=False)


@sessions.command("events")
def s_events(sid: str = SessionArg, limit: int = EventsLimitOpt, all_pages: bool = EventsAllOpt,
             continue_: Optional[str] = EventsContinueOpt, output: str = EventsOutputOpt,
             server: str = ServerOpt, token: Optional[str] = TokenOpt) -> None:
    """The session's audit records, oldest first, as JSON lines (kept after a delete); -o table, json, ids.
    The tenant's whole trail: `substrate events`."""
    _check_output(output, EVENT_OUTPUTS)
    with _client(server, token) as c:
        _print_events(lambda cont: c.session_events(sid, limit=limit, continue_=cont), continue_=continue_,
                      all_pages=all_pages, output=output, session_column=False)


@sessions.command("delete")
def s_delete(sids: list[str] = typer.Argument(..., metavar="ID...", help="The sessions' ids (one or more)."),
             server: str = ServerOpt, token: Optional[str] = TokenOpt) -> None:
    """Delete sessions and their snapshots, one after the other: each one deleted is said on stdout, each
    one that fails in an error line; the others are deleted all the same (as `rm` does), and the exit
    status is then that of the last failure (1, or 2 for a refused ID)."""
    status = 0
    with _client(server, token) as c:
        for sid in sids:
            try:
                _run(lambda sid=sid: c.delete_session(sid))
            except typer.Exit as e:
                status = e.exit_code
                continue
            console.print(f"deleted {sid}")
    if status:
        raise typer.Exit(status)


@app.command()
def pools(server: str = ServerOpt, token: Optional[str] = TokenOpt) -> None:
    """Worker pools with replicas, ready replicas and free slots (admins and the open mode; a tenant's key
    sees the pools' names only: their capacity and load are not its to see), then each condition that is
    False (no ready worker; ``WorkersHealthy``: its workers keep exiting and starts back off)."""
    with _client(server, token) as c:
        items = _run(c.pools)
    fields = ("replicas", "readyReplicas", "slots", "freeSlots")
    t = Table("NAME", "REPLICAS", "READY", "SLOTS", "FREE")
    for p in items:
        st = p.get("status") or {}
        # the API leaves these out for an ordinary tenant: "-", not a KeyError
        t.add_row(p["metadata"]["name"], *(str(st[f]) if f in st else "-" for f in fields))
    console.print(t)
    # what keeps a pool from serving or growing (kubectl shows it with `describe`): "Scaling" False is the
    # ordinary state, the others False are a problem
    for p in items:
        for cond in (p.get("status") or {}).get("conditions") or []:
            if cond.get("status") == "False" and cond.get("type") != "Scaling":
                err.print(f"pool {p['metadata']['name']}: {cond.get('type')}=False ({cond.get('reason')}): "
                          f"{cond.get('message')}", markup=False, highlight=False)
    if any(not set(fields) & set(p.get("status") or {}) for p in items):
        err.print("replicas and slots are shown to admins only")


@app.command()
def templates(server: str = ServerOpt, token: Optional[str] = TokenOpt) -> None:
    """Actor templates the control plane knows."""
    with _client(server, token) as c:
        items = _run(c.templates)
    t = Table("NAME", "RUNS", "POOL", "MAX IDLE", "SNAPSHOT EVERY")
    for x in items:
        sp = x["spec"]
        runs = sp.get("entrypoint") or " ".join(sp.get("command") or []) or (sp.get("container") or {}).get("image", "")
        sm = sp.get("stateManagement", {})
        t.add_row(x["metadata"]["name"], runs, sp.get("workerPool") or "(default)", str(sm.get("maxIdleTime")),
                  str(sm.get("snapshotInterval")))
    console.print(t)


@app.command("events")
def events_cmd(tenant: Optional[str] = typer.Option(None, help="Admins: this tenant's records (default: "
                                                    "the caller's tenant's)."),
               limit: int = EventsLimitOpt, all_pages: bool = EventsAllOpt,
               continue_: Optional[str] = EventsContinueOpt, output: str = EventsOutputOpt,
               server: str = ServerOpt, token: Optional[str] = TokenOpt) -> None:
    """Your tenant's audit trail (every session's creates, suspends, wakes, deletes ..., also of deleted
    sessions), oldest first, as JSON lines; -o table, json, ids. One session's: `sessions events ID`."""
    _check_output(output, EVENT_OUTPUTS)
    with _client(server, token) as c:
        _print_events(lambda cont: c.events(tenant=tenant, limit=limit, continue_=cont), continue_=continue_,
                      all_pages=all_pages, output=output, session_column=True)


@app.command()
def stats(server: str = ServerOpt, token: Optional[str] = TokenOpt) -> None:
    """Your sessions by state and quota usage; admins (and open mode) also see workers, slots, worker-seconds."""
    with _client(server, token) as c:
        _print(_run(c.stats))


@store_app.command("status")
def store_status(server: str = ServerOpt, token: Optional[str] = TokenOpt) -> None:
    """Where the snapshot store is, whether it answers, whether its marker is this runtime's, and why it is
    fenced if it is (then suspends and wakes that read a snapshot answer 503 snapshot_store_unavailable), as
    JSON. Exit 0 when it serves, 1 when it is fenced or does not answer. Admins (and open mode)."""
    with _client(server, token) as c:
        st = _run(c.snapshot_store)
    _print(st)
    if not st.get("verified") or not st.get("reachable", True):
        raise typer.Exit(1)  # a script can tell (tester 55: it exited 0 when fenced)


@store_app.command("adopt")
def store_adopt(yes: bool = typer.Option(False, "--yes", help="Do it: without it, only says what it would do."),
                server: str = ServerOpt, token: Optional[str] = TokenOpt) -> None:
    """Take the configured store as this runtime's when its marker object is missing because its objects are
    gone for good (a bucket deleted or emptied, a folder lost): suspends and wakes are served again within 5 s.
    Sessions whose snapshots were lost fall back at their next wake (after SUBSTRATE_SNAPSHOT__MISSING_GRACE_S)
    to an earlier snapshot or a fresh start, and say so. If the objects still exist elsewhere, fix the
    settings or put them back instead. Refused (409 store_taken) for a store another runtime uses."""
    with _client(server, token) as c:
        if yes:  # straight to it: a status read first answered a tenant "may not read" (tester 55)
            out = _run(c.adopt_snapshot_store)
            _print(out)
            return
        st = _run(c.snapshot_store)
        if st.get("verified"):
            console.print(f"the snapshot store {st.get('location')} is this runtime's already: nothing to do")
            return
        err.print(f"the snapshot store {st.get('location')} is fenced: {st.get('fenced') or st.get('error')}\n"
                  "adopting it writes this runtime's marker there; sessions whose snapshots are not there fall "
                  "back at their next wake to an earlier one or a fresh start. Run again with --yes to adopt it.")
        raise typer.Exit(1)


def _keys_backend() -> tuple[Any, Any]:
    """(settings, redis client) for the key commands; exits with a clear line if no Redis URL is set."""
    import redis.asyncio as aioredis


    from substrate.embedded import url_file

    settings = _settings()
    url = settings.redis.url
    if not url:  # a running `substrate up` on this data folder leaves its embedded Redis' URL here (0600)
        try:
            url = url_file(settings.redis.data_dir).read_text().strip()
        except OSError:
            url = None
    if not url:
        err.print("[red]error[/red]: no runtime found: start `substrate up` (its embedded Redis is found through "
                  f"{url_file(settings.redis.data_dir)}; run this from the folder it was started in, or set the "
                  "SUBSTRATE_DATA_DIR it was started with), set SUBSTRATE_REDIS_URL, or use --file")
        raise typer.Exit(2)
    return settings, aioredis.from_url(url, decode_responses=True, socket_timeout=5)


async def _prefix_mismatch(r: Any, prefix: str) -> str | None:
    """If no runtime runs on this Redis under key prefix ``prefix`` while runtimes run under others (their
    store holds, ``substrate.storeloc.live_holders``): which, as one line; else None. Reads the holds only:
    a SCAN of the keyspace for them, as a CLI command may."""
    from substrate.keys import Keys
    from substrate.storeloc import live_holders

    suffix = Keys("x").snapshot_location_holders.removeprefix("x")
    mine = f"{prefix}{suffix}"
    if await live_holders(r, mine):
        return None
    others = sorted({str(k)[:-len(suffix)] async for k in r.scan_iter(match=f"*{suffix}", count=10_000)
                     if str(k) != mine and await live_holders(r, str(k))})
    if not others:
        return None
    names = ", ".join(repr(o) for o in others[:5]) + (" ..." if len(others) > 5 else "")
    return (f"no runtime runs on this Redis with key prefix {prefix!r} (SUBSTRATE_REDIS__KEY_PREFIX), but runtimes "
            f"with {names} do: this command acts on {prefix!r}, which they do not read; set "
            "SUBSTRATE_REDIS__KEY_PREFIX to theirs")


def _async(coro_fn: Any) -> Any:
    import asyncio

    from substrate.errors import SubstrateError

    from redis.exceptions import RedisError

    where: list[str] = []

    async def run() -> Any:
        settings, r = _keys_backend()
        # which runtime was asked: a key "not found" here may live in another one (fresh-user round 16)
        where.append(f"Redis {_safe_redis_url(settings.redis.url)}, key prefix {settings.redis.key_prefix}"
                     if settings.redis.url else f"the runtime of the data folder {settings.data_dir}")
        try:
            # before the command: a key made under a prefix no runtime uses leaves the API of the one
            # that runs (another prefix) as it was, e.g. open, while the command says it made the key
            if why := await _prefix_mismatch(r, settings.redis.key_prefix):
                err.print(f"warning: {why}", markup=False, highlight=False)
            return await coro_fn(settings, r)
        finally:
            await r.aclose()
    try:
        return asyncio.run(run())
    except SubstrateError as e:
        said = f" (looked in {where[0]}; SUBSTRATE_DATA_DIR or SUBSTRATE_REDIS_URL picks another)" \
            if where and e.code.endswith("not_found") else ""
        err.print(f"[red]error {e.code}[/red]: {escape(e.message)}{escape(said)}")
        raise typer.Exit(1) from None
    except (OSError, RedisError) as e:  # redis-py's ConnectionError is not an OSError: one line, not a traceback
        err.print(f"[red]error[/red]: Redis unreachable: {escape(str(e))}")
        raise typer.Exit(1) from None


def _file_keys(path: Path) -> list[dict[str, Any]]:
    """The entries of key file ``path`` ([] if it does not exist yet); a file that cannot be read or is
    no list of key entries is one line and exit 2 (they were tracebacks)."""
    import yaml

    if not path.exists() and not path.is_symlink():
        if not path.parent.is_dir():
            _file_error(path, f"its folder {path.parent} does not exist")
        return []
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        _file_error(path, f"cannot read it: {getattr(e, 'strerror', None) or e}")
    except yaml.YAMLError as e:
        from substrate.specs import yaml_problem

        _file_error(path, f"not valid YAML: {yaml_problem(e)}")
    if data is None:
        return []
    if isinstance(data, dict) and isinstance(data.get("keys"), list):
        data = data["keys"]
    if not isinstance(data, list) or not all(isinstance(x, dict) for x in data):
        _file_error(path, "it must hold a list of keys ({tenant, sha256, admin?, name?} each)")
    from pydantic import ValidationError

    from substrate.settings import ApiKeySpec

    for i, entry in enumerate(data):  # what `substrate up` would refuse is refused here, before a write
        try:
            ApiKeySpec.model_validate(entry)
        except ValidationError as e:
            first = e.errors()[0]
            _file_error(path, f"entry {i}: {'.'.join(map(str, first.get('loc', ()))) or 'entry'}: {first.get('msg')}")
    return list(data)


def _key_file_exists(path: Path) -> None:
    """One line and exit 2 when key file ``path`` does not exist: ``keys list``/``revoke --file`` read a
    missing file as an empty one (an empty table, "no key x"), so a mistyped path looked like a file
    without keys (fresh-user tester 53). ``keys create --file`` makes the file instead."""
    if not path.exists() and not path.is_symlink():
        if not path.parent.is_dir():
            _file_error(path, f"its folder {path.parent} does not exist")
        _file_error(path, "it does not exist (keys create --file makes it)")


def _file_error(path: Path, why: str) -> NoReturn:
    err.print(f"[red]error[/red]: key file {escape(str(path))}: {escape(why)}")
    raise typer.Exit(2)


@contextlib.contextmanager
def _key_file_locked(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on the key file's folder while a command reads, changes and writes
    the file: of ``keys create --file`` commands run in parallel each one's entry is kept (a fresh-user
    tester ran 10 at once: 3 to 6 entries were left, and keys already in the file were gone, so a
    provisioning script revoked an admin's key at the next start). The folder, not the file, is locked:
    the file may not exist yet, and a command refused halfway must leave no file behind."""
    import fcntl

    folder = path.resolve().parent if path.parent.is_dir() else path.parent
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:  # no such folder: _file_keys says so, in its words
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _write_file_keys(path: Path, entries: list[dict[str, Any]]) -> None:
    """Replace the key file's content with ``entries`` atomically (a temporary file in the same folder,
    then ``os.replace``): a runtime or another command reading it meanwhile sees the old file or the new
    one, never an empty or half-written one. A symlink is followed (its target is replaced); the file
    keeps its permission bits, and a new one is made readable by its owner only."""
    import tempfile

    import yaml

    target = path.resolve()
    try:
        mode = target.stat().st_mode & 0o7777
    except FileNotFoundError:
        mode = 0o600
    except OSError as e:
        _file_error(path, f"cannot write it: {e.strerror or e}")
    tmp = None
    try:
        with tempfile.NamedTemporaryFile("w", dir=target.parent, prefix=f".{target.name}.", suffix=".tmp",
                                         delete=False) as f:
            tmp = f.name
            f.write(yaml.safe_dump(entries, sort_keys=False))
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
        tmp = None
    except OSError as e:
        _file_error(path, f"cannot write it: {e.strerror or e}")
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


@keys_app.command("create")
def keys_create(tenant: str = typer.Argument(..., metavar="TENANT", help="Tenant the key acts for (lower-case name)."),
                admin: bool = typer.Option(False, help="The key may see and touch every tenant's sessions."),
                name: str = typer.Option("", help="A label for the key (shown by `keys list`; with --file, its "
                                         "ID): at most 128 characters, no control character, line separator, bidi control or invisible character, no "
                                         "space at either end, not starting with sk_."),
                file: Optional[Path] = typer.Option(None, "--file", help="Append the key's hash to this key file "
                                                    "instead of writing to Redis (the file is rewritten: YAML "
                                                    "comments are not kept).")) -> None:
    """Create an API key and print it once (only its SHA-256 is stored)."""
    from substrate.apikeys import ApiKeyStore, check_tenant, hash_key
    from substrate.errors import SubstrateError
    from substrate.keys import Keys

    from substrate.settings import key_name_problem

    try:  # bad input exits 2 (as every input error does) before anything is read or written
        check_tenant(tenant)
    except SubstrateError as e:
        err.print(f"[red]error {e.code}[/red]: {escape(e.message)}")
        raise typer.Exit(2) from None
    if (why := key_name_problem(name)) is not None:
        err.print(f"[red]error invalid_key_name[/red]: {escape(why)}")
        raise typer.Exit(2)
    if file is not None:
        import secrets as _secrets

        kid = _secrets.token_hex(4)
        key = f"sk_{kid}_{_secrets.token_urlsafe(32)}"
        with _key_file_locked(file):
            entries = _file_keys(file)
            if any(e.get("name") == (name or kid) for e in entries):  # its name is its ID: `keys revoke NAME`
                err.print(f"[red]error invalid_input[/red]: {file} already has a key named {escape(name or kid)}: "
                          "a key's name is its ID (`substrate keys revoke`); give another --name")
                raise typer.Exit(2)
            entries.append({"tenant": tenant, "sha256": hash_key(key), "admin": admin, "name": name or kid})
            _write_file_keys(file, entries)
        # the absolute path: a relative one in the hint worked only from this folder (tester 53)
        err.print(f"added to {file}: it works from the next start of a runtime reading that file "
                  f"(SUBSTRATE_AUTH__API_KEYS_FILE={file.absolute()}); without --file a key works at once")
        print(key)
        return

    async def go(settings: Any, r: Any) -> Any:
        return await ApiKeyStore(r, Keys(settings.redis.key_prefix)).create(tenant, admin=admin, name=name)
    rec, key = _async(go)
    err.print(f"key {rec.id} for tenant {rec.tenant}{' (admin)' if rec.admin else ''}; shown once:")
    print(key)


def _entry_digest(e: dict[str, Any]) -> str:
    """The SHA-256 (hex) of a key file entry's key: its ``sha256``, or the hash of its ``key``."""
    from substrate.apikeys import hash_key

    return str(e.get("sha256") or (hash_key(str(e["key"])) if e.get("key") else "")).lower().removeprefix("sha256:")


def _entry_id(e: dict[str, Any]) -> str:
    """A key file entry's ID, as the runtime gives it at import (``apikeys.file_key_id``)."""
    from substrate.apikeys import file_key_id

    name, key = e.get("name"), e.get("key")
    return file_key_id(str(name) if name else None, str(key) if key else None, _entry_digest(e))


@keys_app.command("revoke")
def keys_revoke(key_id: str = typer.Argument(..., metavar="KEY_ID", help="Key ID (from `keys list`) or the key itself."),
                file: Optional[Path] = typer.Option(None, "--file", help="Remove it from this key file instead "
                                                    "(takes effect when the runtime restarts).")) -> None:
    """Revoke an API key: every router refuses it at once."""
    from substrate.apikeys import ApiKeyStore, hash_key
    from substrate.keys import Keys

    if not key_id.strip():  # no key has an empty ID: bad input (exit 2), not a key that was not found (1)
        err.print("[red]error invalid_input[/red]: KEY_ID is empty: give a key ID from `substrate keys list`, "
                  "or the key itself")
        raise typer.Exit(2)
    if file is not None:
        _key_file_exists(file)
        with _key_file_locked(file):
            entries = _file_keys(file)
            keep = [e for e in entries if key_id not in (_entry_id(e), e.get("sha256"), e.get("key"))
                    and e.get("sha256") != hash_key(key_id)]
            if len(keep) == len(entries):
                err.print(f"[red]error api_key_not_found[/red]: no key {escape(key_id)} in {file}")
                raise typer.Exit(1)
            _write_file_keys(file, keep)
        console.print(f"removed from {file}; restart the runtime, or also run without --file to revoke at once")
        return

    async def go(settings: Any, r: Any) -> Any:
        return await ApiKeyStore(r, Keys(settings.redis.key_prefix)).revoke(key_id)
    rec = _async(go)
    console.print(f"revoked key {rec.id} of tenant {rec.tenant}")


@keys_app.command("list")
def keys_list(file: Optional[Path] = typer.Option(None, "--file", help="List the keys of this key file instead "
                                                  "(what a runtime reading it imports at its next start)."),
              output: str = typer.Option("table", "--output", "-o",
                                         help="table, or json (a list of {id, tenant, admin, name, createdAt} "
                                              "from Redis; {id, tenant, admin, name, sha256} from a file)")) -> None:
    """API keys in Redis (IDs, tenants, roles; never the keys)."""
    from substrate.apikeys import ApiKeyStore, hash_key
    from substrate.keys import Keys

    # -o json as `sessions list` has it, for scripts that manage keys (fresh-user tester 52)
    if output not in ("table", "json"):
        err.print(f"[red]error[/red]: --output {escape(output)!r} is none of table, json")
        raise typer.Exit(2)
    if file is not None:  # as create and revoke take it (fresh-user run: "No such option: --file")
        _key_file_exists(file)
        rows = [{"id": _entry_id(e), "tenant": str(e.get("tenant", "")), "admin": bool(e.get("admin")),
                 "name": e.get("name"), "sha256": _entry_digest(e)} for e in _file_keys(file)]
        if output == "json":
            print(json.dumps(rows))
            return
        t = Table("ID", "TENANT", "ADMIN", "SHA256")
        for row in rows:
            t.add_row(row["id"], row["tenant"], "yes" if row["admin"] else "", row["sha256"][:16] + "...")
        console.print(t)
        return

    async def go(settings: Any, r: Any) -> Any:
        return await ApiKeyStore(r, Keys(settings.redis.key_prefix)).list()
    keys = _async(go)
    if output == "json":
        print(json.dumps([{"id": k.id, "tenant": k.tenant, "admin": k.admin, "name": k.name,
                           "createdAt": k.createdAt} for k in keys]))
        return
    t = Table("ID", "TENANT", "ADMIN", "NAME", "CREATED")
    for k in keys:
        t.add_row(k.id, k.tenant, "yes" if k.admin else "", k.name,
                  time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(k.createdAt)))
    console.print(t)


@keys_app.command("rotate-signing")
def keys_rotate_signing() -> None:
    """Rotate the key that signs per-activation tokens: routers sign with the new key after their next
    refresh, workers accept the new one, the previous one and any key current within the last minute, so
    no call fails."""
    from substrate.keys import Keys
    from substrate.tokens import SigningKeyRing

    async def go(settings: Any, r: Any) -> Any:
        ring = SigningKeyRing(r, Keys(settings.redis.key_prefix), refresh_s=settings.auth.signing_refresh_s)
        return (*await ring.rotate(), ring.rotation_keep_s)
    new, prev, keep_s = _async(go)
    console.print(f"signing key {new} is current; {prev or '(none)'} stays accepted, and so does any key that was "
                  f"current within the last {keep_s:g} s, until a later rotation")


if __name__ == "__main__":
    app()
