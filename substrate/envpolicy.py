"""Which environment variables a client may give a session (``POST /v1/sessions`` ``env``).

A session's env reaches its agent process, so a name that a dynamic loader, an interpreter, a shell or
the runtime itself acts on would let a client run code or change limits through the create call alone
(``LD_PRELOAD``, ``PYTHONWARNINGS``, ``BROWSER``, ``PATH``, ``BASH_ENV``, ``SUBSTRATE_...``). Rules:

* names match ``[A-Z_][A-Z0-9_]*`` (whole string), at most :data:`MAX_NAME_CHARS` characters;
* at most :data:`MAX_VARS` variables, each value at most :data:`MAX_VALUE_BYTES` UTF-8 bytes, all
  names and values together at most :data:`MAX_TOTAL_BYTES`; values are valid Unicode without NUL;
* no name in :data:`DENIED_NAMES` nor starting with a prefix in :data:`DENIED_PREFIXES`;
* no name the template itself sets (template settings such as ``SHELL_TIMEOUT_S`` are not overridable).

:func:`check_session_env` raises ``InvalidInput`` (422, code ``invalid_env``) naming the first offending
variable in the message and in ``details.name``. The worker applies the same check again before it starts
an agent (defence in depth: a record written by something other than the API is not trusted either).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from substrate.errors import InvalidInput, clip

NAME_RE = re.compile(r"[A-Z_][A-Z0-9_]*")
MAX_NAME_CHARS = 128
MAX_VARS = 64
MAX_VALUE_BYTES = 4096
MAX_TOTAL_BYTES = 32 * 1024

#: prefixes of variables that loaders, interpreters, language runtimes, TLS/HTTP libraries or this runtime
#: act on (glibc ``LD_``/``GCONV_``/``MALLOC_``, Python, Perl, Ruby, Node, Java, Go, shells, git, AWS ...)
DENIED_PREFIXES: tuple[str, ...] = (
    "LD_", "GCONV_", "MALLOC_", "GLIBC_", "PYTHON", "PERL", "RUBY", "GEM_", "BUNDLE_", "NODE_", "NPM_",
    "JAVA_", "JDK_", "_JAVA_", "CLASSPATH", "GOFLAGS", "GODEBUG", "GOPATH", "GOROOT", "GOPROXY",
    "GOTOOLCHAIN", "GOENV", "CGO_", "DOTNET_", "BASH_", "ZDOTDIR", "KSH_", "SHELL",
    "GIT_", "SSH_", "SSL_", "CURL_", "REQUESTS_", "AWS_", "BOTO", "KUBE", "SUBSTRATE_", "UV_", "PIP_",
    "VIRTUAL_ENV", "CONDA", "TCL", "TK_", "LUA_", "R_", "OPENSSL", "NSS_", "XDG_", "DBUS_", "SYSTEMD_",
    "LC_", "LANG", "TZ", "TERM", "HOSTALIASES", "RES_OPTIONS", "LOCALDOMAIN", "NLSPATH", "LOCPATH",
)
#: single names with the same effect, and the fixed minimum the runtime sets itself
DENIED_NAMES: frozenset[str] = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "ENV", "IFS", "PS1", "PS2", "PS4", "PROMPT_COMMAND", "CDPATH",
    "BROWSER", "EDITOR", "VISUAL", "PAGER", "MANPAGER", "LESSOPEN", "LESSCLOSE", "TMPDIR", "TEMP", "TMP",
    "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "FTP_PROXY", "SOCKS_PROXY", "POSIXLY_CORRECT",
    "MAIL", "MAILPATH", "INPUTRC", "HISTFILE", "OLDPWD", "PWD", "DISPLAY", "WAYLAND_DISPLAY",
})


def _bad(name: str, why: str) -> InvalidInput:
    return InvalidInput(f"env {clip(name)}: {why}", code="invalid_env", details={"name": clip(name, 256, quote=False)})


def _utf8(text: str) -> bytes | None:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate such as "\ud800"
        return None


def check_session_env(env: Mapping[str, object], template_names: Iterable[str] = ()) -> dict[str, str]:
    """Validate a client-supplied env; returns it as ``dict[str, str]``.

    ``template_names`` are the names the template sets (not overridable). Raises ``InvalidInput``
    (``invalid_env``, ``details.name`` = the offending name) on the first violation.
    """
    if not isinstance(env, Mapping):
        raise InvalidInput("env must be an object of NAME: value strings", code="invalid_env")
    if len(env) > MAX_VARS:
        raise InvalidInput(f"env has {len(env)} variables; at most {MAX_VARS} are allowed", code="invalid_env")
    fixed = set(template_names)
    total = 0
    out: dict[str, str] = {}
    for name, value in env.items():
        if not isinstance(name, str) or _utf8(name) is None:
            raise _bad(repr(name), "names must be strings of A-Z, 0-9 and '_'")
        if len(name) > MAX_NAME_CHARS or not NAME_RE.fullmatch(name):
            raise _bad(name, f"names must match [A-Z_][A-Z0-9_]* (at most {MAX_NAME_CHARS} characters)")
        # the template's own reason first: SHELL_TIMEOUT_S is also under a denied prefix (SHELL)
        if name in fixed:
            raise _bad(name, "the ActorTemplate sets this variable; a session cannot override it")
        if name in DENIED_NAMES or name.startswith(DENIED_PREFIXES):
            raise _bad(name, "loaders, interpreters or the runtime act on this variable; it cannot be set "
                             "per session (set it in the ActorTemplate if the agent needs it)")
        if not isinstance(value, str):
            raise _bad(name, "values must be strings")
        raw = _utf8(value)
        if raw is None or "\0" in value:
            raise _bad(name, "value is not valid Unicode text (lone surrogate or NUL)")
        if len(raw) > MAX_VALUE_BYTES:
            raise _bad(name, f"value is {len(raw)} bytes; at most {MAX_VALUE_BYTES} are allowed")
        total += len(name) + len(raw)
        if total > MAX_TOTAL_BYTES:
            raise _bad(name, f"env is over {MAX_TOTAL_BYTES} bytes in total")
        out[name] = value
    return out
