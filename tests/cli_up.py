"""``substrate up`` run in-process for its start-up checks (config, capacity, signals)."""

from __future__ import annotations

import socket
from pathlib import Path

from click.testing import Result
from typer.testing import CliRunner

from substrate.cli import app


def up_on_a_taken_port(cfg: Path) -> Result:
    """``substrate up --config cfg`` on a port another socket holds: a check that refuses the config must
    answer before the port check would (exit 2 naming the port), so nothing is ever served."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        return CliRunner().invoke(app, ["up", "--host", "127.0.0.1", "--port", str(s.getsockname()[1]),
                                        "--config", str(cfg)])
