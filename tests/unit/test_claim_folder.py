"""``substrate.embedded.claim_folder``: a workers folder is shared by the processes of one deployment and
refused to another (fresh-user round 23: two runtimes of different key prefixes shared a data folder)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from substrate.embedded import DEPLOYMENT_FILE, claim_folder


def test_one_deployment_shares_the_folder_and_another_is_refused(tmp_path: Path) -> None:
    a1 = claim_folder(tmp_path, "Redis r, key prefix 'a'", "workers folder X")
    a2 = claim_folder(tmp_path, "Redis r, key prefix 'a'", "workers folder X")  # a second process of 'a'
    with pytest.raises(RuntimeError, match=r"workers folder X is in use by another runtime \(Redis r, key prefix 'a'\)"):
        claim_folder(tmp_path, "Redis r, key prefix 'b'", "workers folder X")
    os.close(a1)
    with pytest.raises(RuntimeError, match="in use"):  # one process of 'a' still holds it
        claim_folder(tmp_path, "Redis r, key prefix 'b'", "workers folder X")
    os.close(a2)
    b = claim_folder(tmp_path, "Redis r, key prefix 'b'", "workers folder X")  # free again: 'b' takes it
    assert (tmp_path / DEPLOYMENT_FILE).read_text().strip() == "Redis r, key prefix 'b'"
    with pytest.raises(RuntimeError, match="key prefix 'b'"):
        claim_folder(tmp_path, "Redis r, key prefix 'a'", "workers folder X")
    os.close(b)


def test_a_stale_name_left_by_a_stopped_runtime_is_replaced(tmp_path: Path) -> None:
    (tmp_path / DEPLOYMENT_FILE).write_text("Redis old, key prefix 'gone'\n")  # nobody holds the lock
    fd = claim_folder(tmp_path, "Redis r, key prefix 'a'", "workers folder X")
    assert (tmp_path / DEPLOYMENT_FILE).read_text().strip() == "Redis r, key prefix 'a'"
    os.close(fd)
