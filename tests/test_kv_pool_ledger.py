"""The shared KV memory pool's ledger against files it did not create and contents no engine
writes: a symlink, another user's or a world-writable file, a fake live slot, zeroed
holdings, random bytes; and the file gone once the last engine leaves. No model."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvferry.kv import pool_ledger
from kvferry.kv.pool_ledger import (
    FILE_BYTES,
    KVPoolLedgerError,
    Slot,
    encode_header,
    encode_slot,
    slot_offset,
)
from kvferry.kv.shared_pool import KVPoolSpec, SharedKVPool, pool_size_bytes
from tests.test_elastic_shared_pool import PAGE, allocate, engine_pool, held

SIZE = 4 * PAGE


@pytest.fixture
def pool_name() -> Iterator[str]:
    name = f"test-{uuid.uuid4().hex[:12]}"
    yield name
    path = KVPoolSpec(name).path
    if path.is_symlink() or path.exists():
        path.unlink()


def _start_time(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])


def _overwrite(path: Path, offset: int, data: bytes) -> None:
    """What another process of this user writes into the ledger behind the engines' backs."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


def _refused(spec: KVPoolSpec, match: str) -> None:
    """Neither joining nor creating the pool, nor reading its size, accepts the file."""
    for attempt in (spec, KVPoolSpec(spec.name)):
        with pytest.raises(KVPoolLedgerError, match=match) as caught:
            SharedKVPool(attempt)
        assert caught.value.pool == spec.name and str(spec.path) in str(caught.value)
    with pytest.raises(KVPoolLedgerError, match=match):
        pool_size_bytes(KVPoolSpec(spec.name))


@pytest.mark.parametrize("target_exists", [True, False])
def test_a_symlink_at_the_ledger_path_is_refused_and_its_target_untouched(pool_name, tmp_path, target_exists):
    spec = KVPoolSpec(pool_name, SIZE)
    target = tmp_path / "root-owned-file"
    if target_exists:
        target.write_bytes(b"precious\n")
    os.symlink(target, spec.path)  # planted by another local user (/dev/shm is world-writable)
    _refused(spec, "is a symbolic link")
    if target_exists:
        assert target.read_bytes() == b"precious\n"
    else:
        assert not target.exists()  # not created through the link either
    assert spec.path.is_symlink()


def _plant(path: Path, data: bytes, mode: int = 0o600) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, data)
    os.close(fd)
    os.chmod(path, mode)


def _valid_ledger() -> bytes:
    """The bytes of an empty ledger of SIZE, as kvferry writes it."""
    return encode_header(SIZE).ljust(FILE_BYTES, b"\0")


@pytest.mark.parametrize(
    ("plant", "match"),
    [
        (lambda p: _plant(p, _valid_ledger(), 0o666), "has mode 0666, not 0600"),
        (lambda p: (_plant(p, _valid_ledger()), os.chown(p, 4242, 4242)), "owned by uid 4242"),
        (
            lambda p: (
                _plant(p.with_name(p.name + "-x"), _valid_ledger()),
                os.link(p.with_name(p.name + "-x"), p),
            ),
            "2 hard links",
        ),
        (lambda p: os.mkfifo(p, 0o600), "not a regular file"),
        (lambda p: _plant(p, _valid_ledger()[:100]), "is 100 bytes"),
    ],
    ids=["world-writable", "foreign-owner", "hard-link", "fifo", "short"],
)
def test_a_file_kvferry_did_not_create_is_refused_and_left_as_it_is(pool_name, plant, match):
    spec = KVPoolSpec(pool_name, SIZE)
    plant(spec.path)
    before = os.stat(spec.path)
    contents = spec.path.read_bytes() if spec.path.is_file() else None
    try:
        _refused(spec, match)
        after = os.stat(spec.path)
        assert (after.st_mode, after.st_uid, after.st_size) == (before.st_mode, before.st_uid, before.st_size)
        assert contents is None or spec.path.read_bytes() == contents
    finally:
        spec.path.with_name(spec.path.name + "-x").unlink(missing_ok=True)


def test_the_ledger_is_created_owner_only_whatever_the_umask(pool_name):
    old = os.umask(0o277)  # would leave 0400
    try:
        pool = SharedKVPool(KVPoolSpec(pool_name, SIZE))
    finally:
        os.umask(old)
    info = os.stat(pool.spec.path, follow_symlinks=False)
    assert (oct(info.st_mode & 0o7777), info.st_uid, info.st_nlink) == ("0o600", os.geteuid(), 1)
    second = SharedKVPool(KVPoolSpec(pool_name))  # the next engine accepts it
    second.close()
    pool.close()


def test_a_fake_live_slot_holding_the_whole_pool_is_an_error_not_a_wait(pool_name):
    """A slot naming a live process (right pid and start time) that never attached to the pool,
    holding all of it: the engine's next grant and any new engine fail naming the pool and the
    slot, instead of waiting forever for bytes nobody will give back."""
    pool = engine_pool(pool_name)
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        fake = Slot(bystander.pid, _start_time(bystander.pid), SIZE)
        _overwrite(pool.budget.pool.spec.path, slot_offset(5), encode_slot(5, fake))
        with pytest.raises(KVPoolLedgerError, match=f"slot 5 claims {SIZE} bytes for pid {bystander.pid}"):
            allocate(pool, 1)
        assert held(pool) == 0
        with pytest.raises(KVPoolLedgerError, match="not attached to the pool"):
            SharedKVPool(KVPoolSpec(pool_name))
    finally:
        bystander.kill()
        bystander.wait()


@pytest.mark.parametrize(
    ("zeroed", "match"),
    [
        ("held bytes", "slot 0 is damaged"),
        ("whole slot", "slot 0 should show this engine .* holding 0 bytes, not pid 0"),
    ],
)
def test_zeroed_holdings_keep_the_page_changes_and_fail_the_next_grant_clearly(pool_name, zeroed, match):
    pool = engine_pool(pool_name)
    blocks = allocate(pool, 12)  # 3 pages
    assert pool.take_page_changes().mapped == (0, 1, 2) and held(pool) == 3 * PAGE
    path = pool.budget.pool.spec.path
    field = 16 if zeroed == "held bytes" else 0  # the held bytes sit after pid and start time
    _overwrite(path, slot_offset(0) + field, bytes(pool_ledger.SLOT_BYTES - field))
    pool.free_blocks(blocks)
    assert pool.take_page_changes().unmapped == (0, 1, 2)  # the step's changes are not lost
    assert held(pool) == 0
    with pytest.raises(KVPoolLedgerError, match=match):
        allocate(pool, 1)
    if zeroed == "held bytes":
        with pytest.raises(KVPoolLedgerError, match=match):
            SharedKVPool(KVPoolSpec(pool_name))


@pytest.mark.parametrize("where", ["whole file", "slots"])
def test_random_bytes_are_an_error_never_a_reclaimed_limit(pool_name, where):
    """Random bytes used to read as dead engines: every slot, the engine's own included, was
    "reclaimed" and the engine took grants past the pool."""
    first = SharedKVPool(KVPoolSpec(pool_name, SIZE))
    assert first.try_take(3 * PAGE)
    start = 0 if where == "whole file" else slot_offset(0)
    _overwrite(first.spec.path, start, os.urandom(FILE_BYTES - start))
    match = "not a kvferry KV pool ledger" if where == "whole file" else "slot 0 is damaged"
    with pytest.raises(KVPoolLedgerError, match=match):
        first.try_take(PAGE)
    assert first.held_bytes() == 3 * PAGE
    with pytest.raises(KVPoolLedgerError, match=match):
        SharedKVPool(KVPoolSpec(pool_name))
    first.give(3 * PAGE)  # no exception: the damage is reported where a grant is asked for
    first.close()
    assert first.spec.path.exists()  # a damaged ledger is left for its owner to look at


_HOLDER = """
import sys, time
from kvferry.kv.shared_pool import KVPoolSpec, SharedKVPool
pool = SharedKVPool(KVPoolSpec(sys.argv[1]))
assert pool.try_take(4096)
print("holding", flush=True)
time.sleep(60)
"""


def test_the_ledger_is_gone_once_the_last_engine_leaves(pool_name):
    spec = KVPoolSpec(pool_name, SIZE)
    first, second = SharedKVPool(spec), SharedKVPool(KVPoolSpec(pool_name))
    assert first.try_take(PAGE) and second.try_take(PAGE)
    first.close()
    assert spec.path.exists() and second.used_bytes() == PAGE
    killed = subprocess.Popen([sys.executable, "-c", _HOLDER, pool_name], stdout=subprocess.PIPE, text=True)
    try:
        assert killed.stdout.readline().strip() == "holding"
        killed.kill()  # -9: its slot stays in the ledger, its process is gone
        killed.wait(timeout=10)
    finally:
        killed.kill()
    second.close()  # the last live engine: the dead one's slot is reclaimed, the file removed
    assert not spec.path.exists()
    third = SharedKVPool(spec)  # a new pool under the same name
    assert third.used_bytes() == 0 and third.try_take(SIZE)
    third.close()
    assert not spec.path.exists()


_CHURN = """
import os, sys
from kvferry.kv.shared_pool import KVPoolSpec, SharedKVPool
spec = KVPoolSpec(sys.argv[1], int(sys.argv[2]))
for _ in range(int(sys.argv[3])):
    pool = SharedKVPool(spec)
    with pool.ledger.locked():  # the engine's file is the pool's: not one its last engine removed
        mine, named = os.fstat(pool.ledger.fd), os.stat(spec.path, follow_symlinks=False)
        assert (mine.st_ino, mine.st_nlink) == (named.st_ino, 1)
    if pool.try_take(4096):
        pool.give(4096)
    pool.close()
print("done", flush=True)
"""


def test_engines_joining_while_the_last_one_leaves_always_share_one_ledger(pool_name):
    """Two processes join and leave the pool 300 times each: the last engine removes the file
    under the lock, so an engine joining meanwhile never holds a file that is gone."""
    churners = [
        subprocess.Popen(
            [sys.executable, "-c", _CHURN, pool_name, str(SIZE), "300"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        outputs = [c.communicate(timeout=120) for c in churners]
    finally:
        for churner in churners:
            churner.kill()
    assert [c.returncode for c in churners] == [0, 0], [err[-2000:] for _, err in outputs]
    assert [out for out, _ in outputs] == ["done\n"] * 2
    assert not KVPoolSpec(pool_name).path.exists()
