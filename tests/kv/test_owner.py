"""One owner per tier directory: a second store, in another process or this one, is refused
with the holder named, until the first closes or dies."""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

import pytest
from lucia_kv import owner
from lucia_kv.owner import LOCK_NAME, Taken
from lucia_kv.store import Store

from tests.kv.owner_child import child_store
from tests.kv.support import config

PAGE = 4096


def test_a_second_store_in_another_process_is_refused_naming_the_holder(tmp_path: Path) -> None:
    settings = config(tmp_path, {"nvme": 8 * PAGE, "hdd": 16 * PAGE})
    with child_store("ns-a", *(t.directory for t in settings.tiers)) as child:
        with pytest.raises(Taken) as refused:
            Store(settings)
        message = str(refused.value)
        assert f"pid {child.pid} on host {socket.gethostname()}" in message
        assert str(settings.tiers[0].directory) in message
        assert "a namespace directory of its own" in message
        # the refused store left nothing held: the child's lock is the only one
        assert child.stdin is not None and child.stdout is not None
        child.stdin.close()
        assert child.stdout.readline().strip() == "released"
    store = Store(settings)  # free again once the owner closed
    store.close()


def test_one_held_tier_refuses_the_store_and_frees_the_others(tmp_path: Path) -> None:
    settings = config(tmp_path, {"nvme": 8 * PAGE, "hdd": 16 * PAGE})
    hdd = settings.tiers[1].directory
    with child_store("ns-a", hdd):
        with pytest.raises(Taken, match=str(hdd)):
            Store(settings)
        # the nvme tier, claimed before the hdd refused, was released again
        with child_store("ns-a", settings.tiers[0].directory):
            pass


def test_the_lock_dies_with_its_process(tmp_path: Path) -> None:
    settings = config(tmp_path, {"hdd": 16 * PAGE})
    with child_store("ns-a", settings.tiers[0].directory) as child:
        child.send_signal(signal.SIGKILL)
        child.wait()
        store = Store(settings)
        store.close()


def test_two_stores_in_one_process_are_refused_too(tmp_path: Path) -> None:
    settings = config(tmp_path, {"hdd": 16 * PAGE})
    first = Store(settings)
    try:
        with pytest.raises(Taken, match=f"pid {os.getpid()} "):
            Store(settings)
    finally:
        first.close()
    Store(settings).close()


def test_the_lock_file_holds_the_holder_and_is_not_a_block(tmp_path: Path) -> None:
    settings = config(tmp_path, {"hdd": 16 * PAGE})
    store = Store(settings)
    try:
        lock = settings.tiers[0].directory / LOCK_NAME
        assert lock.read_text() == owner.holder() + "\n"
        assert os.stat(lock).st_mode & 0o777 == 0o600
        assert store.tiers[0].index() == []
    finally:
        store.close()
    store = Store(settings)  # reopened over the lock file: still no block indexed
    try:
        assert store.tiers[0].index() == []
    finally:
        store.close()
