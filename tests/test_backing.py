"""Backing files written from a real store: raw and compressed chunks, damage, pruning."""

from __future__ import annotations

import os

import pytest

from monarch_fs.fs.backing import MIN_SIZE, BackingFiles, key, wanted
from monarch_fs.fs.chunk import CorruptChunk, chunk_id, encode
from monarch_fs.fs.manifest import Entry, Kind
from monarch_fs.fs.store import Store

CHUNK = 1 << 20


def stored_file(store: Store, data: bytes, *, raw: bool, path: bytes = b"lib.so") -> Entry:
    ids = []
    for i in range(0, len(data), CHUNK):
        piece = data[i:i + CHUNK]
        cid = chunk_id(piece)
        store.put_blob(cid, encode(piece), raw=raw)
        ids.append(cid)
    return Entry(path, Kind.FILE, 0o644, len(data), 0, chunks=tuple(ids))


@pytest.mark.parametrize("raw", [True, False], ids=["raw", "compressed"])
def test_backing_file_holds_the_content(tmp_path, raw):
    store = Store(tmp_path / "store")
    data = os.urandom(CHUNK) + b"text " * (CHUNK // 2) + os.urandom(1234)  # mixed, 3+ chunks
    e = stored_file(store, data, raw=raw)
    b = BackingFiles(tmp_path / "backing")
    assert b.missing([e]) == [e] and b.ready(e) is None
    b.write(e, store)
    assert b.ready(e) == b.path(e) and b.path(e).read_bytes() == data
    assert b.missing([e]) == [] and b.usage() == (1, len(data))
    assert b.path(e).stat().st_mode & 0o777 == 0o400  # read-only, private


def test_damaged_chunk_leaves_no_backing_file(tmp_path):
    store = Store(tmp_path / "store")
    data = b"compressible " * 200_000
    e = stored_file(store, data, raw=False)
    path, off, length = store.locate(e.chunks[1])
    with open(path, "r+b") as f:  # flip a byte inside the compressed record
        f.seek(off + length // 2)
        byte = f.read(1)
        f.seek(off + length // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    b = BackingFiles(tmp_path / "backing")
    with pytest.raises(CorruptChunk):
        b.write(e, store)
    assert os.listdir(b.root) == []


def test_which_files_get_one_and_pruning(tmp_path):
    store = Store(tmp_path / "store")
    small = stored_file(store, os.urandom(MIN_SIZE - 1), raw=True, path=b"small")
    big = stored_file(store, os.urandom(MIN_SIZE), raw=True, path=b"big")
    link = Entry(b"link", Kind.SYMLINK, 0o777, MIN_SIZE, 0, target=b"big")
    assert not wanted(small) and wanted(big) and not wanted(link)
    b = BackingFiles(tmp_path / "backing")
    same = Entry(b"elsewhere/big", Kind.FILE, 0o600, big.size, 7, chunks=big.chunks)
    assert b.missing([small, big, same]) == [big]  # one backing file per content
    b.write(big, store)
    assert b.ready(same) == b.path(big)
    (b.root / "leftover.tmp").write_bytes(b"x")
    assert b.prune({key(big)}) == 0 and b.ready(big)
    assert b.prune(set()) == 1 and b.ready(big) is None
    b.write(big, store)
    b.close()
    # A restart after a clean stop keeps the backing files, and removes a file cut short by a
    # crash while it was written.
    assert os.listdir(BackingFiles(b.root).root) == [key(big)]


def test_only_a_clean_stop_keeps_backing_files(tmp_path):
    store = Store(tmp_path / "store")
    e = stored_file(store, os.urandom(MIN_SIZE), raw=True)
    b = BackingFiles(tmp_path / "backing")
    b.write(e, store)
    b.close()  # flushed and marked clean
    again = BackingFiles(b.root)
    assert again.trusted and again.ready(e) == again.path(e)
    # No close: like a crash. The next start cannot trust what is there.
    after_crash = BackingFiles(b.root)
    assert not after_crash.trusted and after_crash.ready(e) is None


async def test_an_open_waits_for_its_queued_copy_and_failures_are_reported(tmp_path):
    """`write_missing` copies in the background of a publish; `wait` (what an open calls)
    returns only once that file's copy is written, even if it was still queued behind others,
    and a file written twice at once is written once."""
    import trio

    store = Store(tmp_path / "store")
    entries = [stored_file(store, os.urandom(2 * CHUNK), raw=True, path=b"lib%d.so" % i)
               for i in range(6)]
    b = BackingFiles(tmp_path / "backing")
    results = []
    async with trio.open_nursery() as nursery:
        async def background() -> None:
            results.append(await b.write_missing(entries, store, parallel=1))

        nursery.start_soon(background)
        nursery.start_soon(background)  # a second publish of the same files
        while b.writing < len(entries):
            await trio.sleep(0)
        await b.wait(entries[-1])  # the last one queued
        assert b.path(entries[-1]).read_bytes() == b"".join(
            store.get(c) for c in entries[-1].chunks)
        assert b.waits == 1
    assert results == [[], []] and b.writing == 0
    assert sorted(os.listdir(b.root)) == sorted(key(e) for e in entries)

    # A copy that cannot be made is reported, names the file, and leaves nothing behind.
    gone = Entry(b"gone.so", Kind.FILE, 0o644, MIN_SIZE, 0, chunks=(b"\1" * 16,))
    (failed,) = await b.write_missing([gone], store)
    assert failed.startswith("cannot write the backing file of gone.so")
    assert b.ready(gone) is None and b.writing == 0
    await b.wait(gone)  # nothing queued: returns at once


def test_a_copy_stopped_midway_leaves_nothing_behind(tmp_path):
    """A daemon that stops does not wait for a large copy: the checkpoint between chunks
    raises (trio.Cancelled in a daemon) and the partial file is removed."""
    store = Store(tmp_path / "store")
    e = stored_file(store, os.urandom(4 * CHUNK), raw=True)
    b = BackingFiles(tmp_path / "backing")
    calls = []

    def stop_at_third_chunk() -> None:
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # what trio.Cancelled is to this code: not an error to catch

    with pytest.raises(KeyboardInterrupt):
        b.write(e, store, stop_at_third_chunk)
    assert os.listdir(b.root) == [] and b.ready(e) is None
    b.write(e, store)
    assert b.path(e).read_bytes() == b"".join(store.get(c) for c in e.chunks)


async def test_cancelling_background_copies_stops_them_midway(tmp_path):
    """Cancelling the copies (the daemon stopping) stops the running ones at their next chunk,
    not at the end of the file, and leaves no partial file."""
    import trio

    store = Store(tmp_path / "store")
    entries = [stored_file(store, os.urandom(16 * CHUNK), raw=True, path=b"w%d" % i)
               for i in range(2)]
    b = BackingFiles(tmp_path / "backing")
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(b.write_missing, entries, store)
            while not (b._copies and all(c.started for c in b._copies.values())):
                await trio.sleep(0)
            scope.cancel()
    assert b.writing == 0 and os.listdir(b.root) == []
