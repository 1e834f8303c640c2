"""fs/store.py: the content-addressed store (packs, indexes, collection and compaction, damage
detection, the read path's page-cache behaviour). Real files on a real filesystem; no mocks."""

from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import flip_bits as _flip
from monarch_fs.fs import chunk
from monarch_fs.fs import collect as collect_module
from monarch_fs.fs.chunk import RAW, ZSTD, CorruptChunk, chunk_id, encode
from monarch_fs.fs.pack import RECORD
from monarch_fs.fs.store import NOWAIT_MAX, READ_AROUND, Store, StoreBusy


def _blob_bytes(s: Store, c: bytes) -> bytes:
    path, off, length = s.locate(c)
    return path.read_bytes()[off:off + length]


def _write_blob(s: Store, c: bytes, blob: bytes) -> None:
    """Overwrite an object's bytes in its pack (same length), as a failing disk might."""
    path, off, length = s.locate(c)
    assert len(blob) == length
    b = bytearray(path.read_bytes())
    b[off:off + length] = blob
    path.write_bytes(bytes(b))


def test_store_put_get_has_missing(tmp_path):
    s = Store(tmp_path / "store")
    a, b = b"alpha" * 100, os.urandom(5000)
    ida = s.put(a)
    assert ida == chunk_id(a)
    assert s.has(ida) and not s.has(chunk_id(b))
    assert s.get(ida) == a
    idb = chunk_id(b)
    absent = chunk_id(b"absent")
    assert s.missing([absent, ida, idb]) == [absent, idb]
    assert s.put(b) == idb
    assert s.missing([ida, idb]) == []
    with pytest.raises(KeyError):
        s.get(absent)
    assert s.put(b"") == chunk_id(b"") and s.get(chunk_id(b"")) == b""


def test_store_survives_reopen_and_sealing(tmp_path):
    s = Store(tmp_path / "store", pack_limit=64 * 1024)
    datas = [os.urandom(20_000) for _ in range(10)]  # several packs get sealed
    ids = [s.put(d) for d in datas]
    assert _blob_bytes(s, ids[0]) == chunk.encode(datas[0])
    s.close()
    again = Store(tmp_path / "store", pack_limit=64 * 1024)
    assert [again.get(c) for c in ids] == datas
    assert len(list((tmp_path / "store" / "packs").glob("*.idx"))) >= 2
    again.put(b"after reopen")
    assert again.get(chunk_id(b"after reopen")) == b"after reopen"


def test_cut_back_drops_what_was_appended_since_the_store_was_last_durable(tmp_path):
    """What a failed push stored after the last sync goes, index entries included, and its
    space comes back; what a sync or a seal made durable (a prepared version) stays."""
    s = Store(tmp_path / "store", pack_limit=64 * 1024)
    sealed = [s.put(os.urandom(20_000)) for _ in range(4)]  # the fourth seals pack 1
    assert s.cut_back() == 0  # a fresh pack: nothing to give back
    synced = s.put(os.urandom(20_000))
    s.sync()
    pack = max((tmp_path / "store" / "packs").glob("*.pack"))
    size = pack.stat().st_size
    late = [os.urandom(20_000), os.urandom(10_000)]
    ids = [s.put(d) for d in late]
    grown = pack.stat().st_size
    assert s.cut_back() == grown - size > 30_000
    assert pack.stat().st_size == size
    assert s.missing(sealed + [synced] + ids) == ids
    assert s.put(late[1]) == ids[1]  # sent again by a later push
    s.close()
    again = Store(tmp_path / "store", pack_limit=64 * 1024)
    assert again.missing(sealed + [synced] + ids) == ids[:1]
    assert again.get(ids[1]) == late[1]


def test_collect_deletes_the_sealed_packs_with_nothing_live(tmp_path):
    """Packs are deleted whole, only when no object in them is live; the open pack is never
    touched; a collected object is missing (a push sends it again) and can be stored again."""
    s = Store(tmp_path / "store", pack_limit=64 * 1024)
    # 3 sealed packs of 2 objects (64 KiB packs)
    old = [s.put(os.urandom(40_000)) for _ in range(6)]
    keep = [s.put(os.urandom(40_000)) for _ in range(2)]  # a 4th sealed pack
    shared = s.put(os.urandom(40_000))  # in the 5th pack, with a dead neighbour
    neighbour = s.put(os.urandom(40_000))
    recent = s.put(os.urandom(1_000))  # the open pack
    packs = tmp_path / "store" / "packs"
    before = sorted(p.name for p in packs.glob("*.pack"))
    size_before = s.usage()[1]

    removed, freed = s.collect(lambda: [set(keep) | {shared}])
    assert removed == 3 and freed > 0 and s.usage()[1] == size_before - freed
    assert s.missing(old + keep + [shared, neighbour, recent]) == old
    assert len(list(packs.glob("*.pack"))) == len(before) - 3
    assert {p.stem for p in packs.glob("*.idx")} <= {p.stem for p in packs.glob("*.pack")}
    # a live neighbour keeps its pack; the open pack stays
    assert s.get(neighbour) and s.get(recent)
    data = os.urandom(40_000)
    again = s.put(data)  # stored anew
    s.close()

    reopened = Store(tmp_path / "store", pack_limit=64 * 1024)
    assert reopened.missing(old + keep + [shared, neighbour, recent, again]) == old
    assert reopened.get(again) == data


def test_collect_after_a_crash_between_index_and_pack(tmp_path):
    """A pack whose index was deleted but not the pack itself (a crash mid-collect) is
    scanned at the next start, and the next collect deletes it."""
    s = Store(tmp_path / "store", pack_limit=64 * 1024)
    dead = [s.put(os.urandom(40_000)) for _ in range(2)]
    live = [s.put(os.urandom(40_000)) for _ in range(2)]
    s.close()
    packs = tmp_path / "store" / "packs"
    first = sorted(packs.glob("*.idx"))[0]
    first.unlink()  # what a crash after the index and before the pack would leave
    s = Store(tmp_path / "store", pack_limit=64 * 1024)
    assert s.missing(dead + live) == []
    assert s.collect(lambda: [live])[0] == 1
    assert s.missing(dead + live) == dead and [len(s.get(c)) for c in live] == [40_000] * 2


def _packs(root: Path) -> list[str]:
    return sorted(p.stem for p in (root / "packs").glob("*.pack"))


def test_collect_compacts_packs_that_are_mostly_dead(tmp_path):
    """A sealed pack less than half live has its live objects copied to the open pack and is
    deleted; a half-live one stays as it is. Nothing live is lost, across a restart too."""
    root = tmp_path / "store"
    s = Store(root, pack_limit=64 * 1024)
    blobs = {}
    for _ in range(13):  # 20 KB objects: packs 1-3 sealed with 4 each, the 13th in pack 4
        data = os.urandom(20_000)
        blobs[s.put(data)] = data
    ids = list(blobs)
    assert _packs(root) == ["00000001", "00000002", "00000003", "00000004"]
    live = {ids[0], ids[4], ids[5], ids[12]}  # pack 1: a quarter live, pack 2: half, 3: none
    size_before = s.usage()[1]

    removed, freed = s.collect(lambda: [live, live, live])  # 3 versions sharing them
    assert removed == 2 and s.usage()[1] == size_before - freed
    assert freed == 2 * 4 * (20_000 + 1 + 24) - (20_000 + 1 + 24)  # two packs, less one copy
    assert _packs(root) == ["00000002", "00000004"]
    assert s.locate(ids[0])[0].stem == "00000004"  # copied to the open pack
    gone = ids[1:4] + ids[8:12]  # the half-live pack keeps its dead objects
    assert s.missing(ids) == gone
    assert all(s.get(c) == blobs[c] for c in live)
    s.close()
    s = Store(root, pack_limit=64 * 1024)
    assert s.missing(ids) == gone
    assert all(s.get(c) == blobs[c] for c in live)


def test_a_crash_after_compacting_copies_loses_nothing(tmp_path):
    """The copies are durable before the old pack goes; if it survives a crash, the copy wins
    at start and the next collect deletes the old pack."""
    root = tmp_path / "store"
    s = Store(root, pack_limit=64 * 1024)
    ids = [s.put(os.urandom(20_000)) for _ in range(5)]
    saved = {p.name: p.read_bytes() for p in (root / "packs").glob("00000001.*")}
    assert s.collect(lambda: [[ids[0], ids[4]]])[0] == 1
    s.close()
    for name, data in saved.items():  # as if the deletion had not reached the disk
        (root / "packs" / name).write_bytes(data)
    s = Store(root, pack_limit=64 * 1024)
    assert s.locate(ids[0])[0].stem == "00000002"
    assert s.collect(lambda: [[ids[0], ids[4]]]) == (1, 4 * (20_000 + 1 + 24))
    assert _packs(root) == ["00000002"] and len(s.get(ids[0])) == 20_000


def test_compacting_drops_a_damaged_object_instead_of_copying_it(tmp_path):
    s = Store(tmp_path / "store", pack_limit=64 * 1024)
    ids = [s.put(os.urandom(20_000)) for _ in range(5)]
    path, off, _ = s.locate(ids[0])
    _flip(path, off + 100, 0x01)
    assert s.collect(lambda: [[ids[0], ids[4]]])[0] == 1
    assert s.missing([ids[0]]) == [ids[0]]  # a push sends it again
    assert len(s.get(ids[4])) == 20_000


def test_compacting_copies_at_most_its_budget_per_collect(tmp_path, monkeypatch):
    monkeypatch.setattr(collect_module, "COMPACT_MAX_BYTES", 30_000)
    s = Store(tmp_path / "store", pack_limit=64 * 1024)
    ids = [s.put(os.urandom(20_000)) for _ in range(9)]  # packs 1 and 2 sealed, 9th open
    live = [ids[0], ids[4], ids[8]]
    assert s.collect(lambda: [live])[0] == 1  # one 20 KB copy fits, not two
    assert s.collect(lambda: [live])[0] == 1
    assert s.collect(lambda: [live])[0] == 0
    assert all(len(s.get(c)) == 20_000 for c in live)


def test_a_read_racing_a_compaction_finds_the_object_where_it_went(tmp_path):
    s = Store(tmp_path / "store", pack_limit=64 * 1024)
    ids = [s.put(os.urandom(20_000)) for _ in range(5)]
    old = s._index[ids[0]]
    s.collect(lambda: [[ids[0], ids[4]]])

    class Stale(dict):
        """An index read just before the compaction moved the object, then a current one."""
        def __getitem__(self, cid):
            if cid == ids[0] and not getattr(self, "served", False):
                self.served = True
                return old
            return super().__getitem__(cid)

    s._index = Stale(s._index)
    assert len(s.get(ids[0])) == 20_000


def test_one_process_owns_a_store(tmp_path):
    s = Store(tmp_path / "store")
    with pytest.raises(StoreBusy):
        Store(tmp_path / "store")
    s.close()
    Store(tmp_path / "store").close()


def test_store_put_is_idempotent_and_usage_counts_disk_bytes(tmp_path):
    s = Store(tmp_path / "store")
    assert s.usage() == (0, 0)
    datas = [b"text " * 10_000, os.urandom(3000), b"tiny"]
    for d in datas:
        s.put(d)
    used = s.usage()
    assert used[0] == 3
    assert sum(len(chunk.encode(d)) for d in datas) < used[1] < sum(map(len, datas))
    for d in datas:  # putting the same content again adds nothing
        s.put(d)
        assert s.put_blob(chunk_id(d), chunk.encode(d)) is False
    assert s.usage() == used
    s.sync()
    assert [s.get(chunk_id(d)) for d in datas] == datas


def test_put_blob_stores_a_verified_blob(tmp_path):
    s = Store(tmp_path / "store")
    data = b"sent by a peer " * 500
    assert s.put_blob(chunk_id(data), memoryview(chunk.encode(data))) is True
    assert s.get(chunk_id(data)) == data
    raw = os.urandom(1000)
    s.put_blob(chunk_id(raw), bytes([RAW]) + raw)
    assert s.get(chunk_id(raw)) == raw


@pytest.mark.parametrize("make_blob", [
    lambda d: chunk.encode(b"other content " * 500),  # a valid blob of other bytes
    lambda d: chunk.encode(d)[:-1],  # truncated
    lambda d: bytes([RAW]) + d[:-1] + b"X",  # one byte changed
    lambda d: b"\x07" + d,  # unknown codec
    lambda d: b"",
], ids=["other", "truncated", "flipped", "codec", "empty"])
def test_put_blob_refuses_a_mismatched_blob_and_stores_nothing(tmp_path, make_blob):
    s = Store(tmp_path / "store")
    data = b"the real content " * 500
    with pytest.raises(CorruptChunk):
        s.put_blob(chunk_id(data), make_blob(data))
    assert not s.has(chunk_id(data))
    assert s.usage() == (0, 0)
    with pytest.raises(KeyError):
        s.get(chunk_id(data))


def test_a_torn_record_at_the_end_of_a_pack_is_cut_off(tmp_path):
    """A crash mid-append leaves part of a record: it must not become an object."""
    s = Store(tmp_path / "store")
    keep = s.put(b"keep me " * 100)
    s.close()
    pack = next((tmp_path / "store" / "packs").glob("*.pack"))
    good_size = pack.stat().st_size
    with open(pack, "ab") as f:  # the header and half the blob of a 1000-byte record
        f.write(b"MFSR" + chunk_id(b"x" * 1000) + (1001).to_bytes(4, "little") + b"\0" * 500)
    s2 = Store(tmp_path / "store")
    assert s2.get(keep) == b"keep me " * 100
    assert not s2.has(chunk_id(b"x" * 1000)) and len(s2) == 1
    assert pack.stat().st_size == good_size
    assert s2.put(b"x" * 1000) == chunk_id(b"x" * 1000)  # appends cleanly after the cut


def test_store_write_failure_leaves_no_object(tmp_path):
    """A write that fails half way (here: file size limit) must not leave a partial object."""
    root = tmp_path / "store"
    script = f"""
import os, resource, signal, sys
from monarch_fs.fs import chunk
from monarch_fs.fs.store import Store
s = Store({str(root)!r})
s.put(b"small, written before the limit")
data = os.urandom(1 << 20)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
try:
    s.put(data)
except OSError:
    pass
else:
    sys.exit("write unexpectedly succeeded")
os._exit(0) if s.has(chunk.chunk_id(data)) else print(chunk.chunk_id(data).hex())
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr
    failed = bytes.fromhex(proc.stdout.strip())
    s = Store(root)  # as the failed writer left it
    assert not s.has(failed) and len(s) == 1
    assert s.get(chunk_id(b"small, written before the limit"))


@pytest.mark.parametrize("data", [os.urandom(3000), b"compressible " * 3000],
                         ids=["raw", "zstd"])
@pytest.mark.parametrize("where", [0, 1, -1, "middle"])
def test_get_of_a_damaged_object_raises_never_returns_wrong_bytes(tmp_path, data, where):
    s = Store(tmp_path / "store")
    c = s.put(data)
    path, off, length = s.locate(c)
    index = off + (length // 2 if where == "middle" else where % length)
    _flip(path, index, 0x01)
    with pytest.raises(CorruptChunk):
        s.get(c)


def test_get_of_a_truncated_or_swapped_object_raises(tmp_path):
    s = Store(tmp_path / "store")
    a = s.put(b"first " * 2000)
    b = s.put(os.urandom(2000))
    # a valid blob, but of another chunk, of the same length
    other = chunk.encode(b"other " * 2000)
    if len(other) == s.locate(a)[2]:
        _write_blob(s, a, other)
        with pytest.raises(CorruptChunk):
            s.get(a)
    path, off, length = s.locate(b)
    os.truncate(path, off + length // 2)  # the pack lost its tail
    with pytest.raises(CorruptChunk):
        s.get(b)


def _evicted(path: Path) -> bool:
    """Drop a file's pages from the page cache; False where the filesystem keeps them."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        try:
            os.preadv(fd, [bytearray(1)], 0, os.RWF_NOWAIT)
        except BlockingIOError:
            return True
        return False
    finally:
        os.close(fd)


def test_get_if_cached_answers_small_chunks_from_memory_only(tmp_path):
    s = Store(tmp_path / "store")
    small, packed = os.urandom(3000), b"compressible " * 3000
    a, b = s.put(small), s.put(packed)
    assert s.get_if_cached(a) is None  # no read has opened the pack yet
    assert s.get(a) == small
    assert s.get_if_cached(a) == small and s.get_if_cached(b) == packed
    assert s.get_if_cached(chunk_id(b"absent")) is None
    big = s.put(os.urandom(NOWAIT_MAX + 1))  # too long to decode on the FUSE thread...
    zeros = s.put(bytes(NOWAIT_MAX * 4))  # ...and a short blob that decodes to too much
    assert s.get(big) and s.get(zeros)
    assert s.get_if_cached(big) is None and s.get_if_cached(zeros) is None
    _flip(*s.locate(b)[:2], 0x01)
    with pytest.raises(CorruptChunk):  # verified like any read
        s.get_if_cached(b)


def _resident(path: Path, off: int, length: int) -> bool:
    """Whether every page of a file's range is in the page cache (mincore): unlike a read with
    RWF_NOWAIT, asking starts no readahead."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    start = off // page * page
    pages = (off + length - start + page - 1) // page
    vec = (ctypes.c_ubyte * pages)()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as m:
        base = ctypes.c_char.from_buffer(m)
        try:
            if libc.mincore(ctypes.c_void_p(ctypes.addressof(base) + start),
                            ctypes.c_size_t(pages * page), vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
        finally:
            del base
    return all(v & 1 for v in vec)


def test_a_chunk_read_from_disk_brings_the_next_part_of_its_pack_into_memory(tmp_path):
    s = Store(tmp_path / "store")
    s.put(os.urandom(100_000))
    a = s.put(os.urandom(3000))
    s.put(os.urandom(READ_AROUND // 2))
    b = s.put(os.urandom(3000))
    s.put(os.urandom(2 * READ_AROUND))
    c = s.put(os.urandom(3000))
    pack, b_off, b_len = s.locate(b)
    assert s.get(a)
    if not _evicted(pack):
        pytest.skip("this filesystem keeps every page in memory (tmpfs)")
    assert not _resident(pack, b_off, b_len)
    assert s.get(c) and s.get(a)  # a read far behind the last one: the kernel reads no more
    deadline = time.monotonic() + 10  # the read-around is asynchronous
    while not _resident(pack, b_off, b_len):
        assert time.monotonic() < deadline, "the chunk after it never reached the page cache"
        time.sleep(0.01)


@pytest.mark.slow
@pytest.mark.parametrize("data, codec", [(os.urandom(300), RAW),
                                         (b"hello world " * 500 + b"tail", ZSTD)],
                         ids=["raw", "zstd"])
def test_every_single_byte_flip_of_an_object_is_detected(tmp_path, data, codec):
    s = Store(tmp_path / "store")
    c = s.put(data)
    good = _blob_bytes(s, c)
    assert good[0] == codec
    for i in range(len(good)):
        for mask in (0x01, 0x80, 0xFF):
            b = bytearray(good)
            b[i] ^= mask
            _write_blob(s, c, bytes(b))
            with pytest.raises(CorruptChunk):
                s.get(c)


def test_raw_store_keeps_compressed_blobs_decompressed(tmp_path):
    s = Store(tmp_path / "store")
    data = b"compressible text " * 5000
    blob = chunk.encode(data)
    assert blob[0] == ZSTD
    assert s.put_blob(chunk_id(data), blob, raw=True)
    assert _blob_bytes(s, chunk_id(data)) == bytes([RAW]) + data  # read back with a hash only
    assert s.get(chunk_id(data)) == data
    with pytest.raises(CorruptChunk):  # still verified before it is written
        s.put_blob(chunk_id(b"other"), blob, raw=True)


# ---- file objects: a large file written once, in place (fs/file_objects.py) ------------------

CS = 64 * 1024  # the smallest chunk size a manifest allows


def _file(n: int, tail: int = 100) -> tuple[bytes, list[bytes], list[bytes]]:
    data = os.urandom(n * CS + tail)
    pieces = [data[i:i + CS] for i in range(0, len(data), CS)]
    return data, pieces, [chunk_id(p) for p in pieces]


def test_a_large_file_is_written_once_and_readable_while_it_arrives(tmp_path):
    s = Store(tmp_path / "store")
    data, pieces, ids = _file(3)
    assert s.expect_file("k", len(data), ids, CS)
    s.put_blob(ids[1], chunk.encode(pieces[1]))
    assert bytes(s.get(ids[1])) == pieces[1]  # readable before the file is complete
    assert s.missing(ids) == [ids[0], ids[2], ids[3]]
    assert s.file_object("k") is None  # partial: passthrough would read holes
    for i in (0, 2, 3):
        s.put_blob(ids[i], chunk.encode(pieces[i]))
    assert s.usage()[1] == 0  # nothing went to a pack
    whole = s.file_object("k")  # complete, not durable yet: passthrough may bind it
    assert whole is not None and whole.name == "k.part" and whole.read_bytes() == data
    s.sync()
    path = s.file_object("k")
    assert path is not None and path.name == "k" and path.read_bytes() == data
    s.close()
    s = Store(tmp_path / "store")  # recorded: trusted at start
    assert s.file_object("k") == path and all(bytes(s.get(c)) == p for c, p in zip(ids, pieces))


def test_an_unrecorded_file_object_is_deleted_at_start(tmp_path):
    """A crash before sync: the partial file goes, its chunks are missing, nothing torn shows."""
    s = Store(tmp_path / "store")
    data, pieces, ids = _file(2)
    s.expect_file("k", len(data), ids, CS)
    s.put_blob(ids[0], chunk.encode(pieces[0]))
    s.close()
    s = Store(tmp_path / "store")
    assert os.listdir(tmp_path / "store" / "files") == []
    assert s.missing(ids) == ids and s.file_object("k") is None


def test_a_file_object_is_completed_from_chunks_already_in_the_store(tmp_path):
    s = Store(tmp_path / "store")
    data, pieces, ids = _file(2)
    s.put(pieces[0])  # from an older version, in a pack
    assert s.expect_file("k", len(data), ids, CS)
    for i in (1, 2):
        s.put_blob(ids[i], chunk.encode(pieces[i]))
    s.sync()
    path = s.file_object("k")
    assert path is not None and path.read_bytes() == data


def test_an_incomplete_file_object_leaves_its_chunks_durable_in_a_pack(tmp_path):
    """A sync while a file object lacks a chunk the store does not have (another push still
    arriving): the chunks it holds are copied to the pack, so a prepare that counted on them is
    not undone by a crash."""
    s = Store(tmp_path / "store")
    data, pieces, ids = _file(2)
    s.expect_file("k", len(data), ids, CS)
    s.put_blob(ids[0], chunk.encode(pieces[0]))
    s.sync()
    s.close()
    s = Store(tmp_path / "store")
    assert bytes(s.get(ids[0])) == pieces[0] and s.missing(ids) == ids[1:]


def test_cut_back_drops_unrecorded_file_objects(tmp_path):
    s = Store(tmp_path / "store")
    data, pieces, ids = _file(2)
    s.expect_file("k", len(data), ids, CS)
    s.put_blob(ids[0], chunk.encode(pieces[0]))
    assert s.cut_back() == len(data)
    assert s.missing(ids) == ids and os.listdir(tmp_path / "store" / "files") == []


def test_a_damaged_file_object_is_an_error_never_wrong_bytes(tmp_path):
    s = Store(tmp_path / "store")
    data, pieces, ids = _file(1)
    s.expect_file("k", len(data), ids, CS)
    for c, p in zip(ids, pieces):
        s.put_blob(c, chunk.encode(p))
    s.sync()
    path = s.file_object("k")
    assert path is not None
    os.chmod(path, 0o600)
    _flip(path, 10, 0x01)
    with pytest.raises(CorruptChunk):
        s.get(ids[0])


def test_collect_deletes_file_objects_no_live_chunk_uses(tmp_path):
    s = Store(tmp_path / "store")
    kept, dropped = _file(1), _file(1)
    for key, (data, pieces, ids) in (("kept", kept), ("dropped", dropped)):
        s.expect_file(key, len(data), ids, CS)
        for c, p in zip(ids, pieces):
            s.put_blob(c, chunk.encode(p))
    s.sync()
    s.collect(lambda: [kept[2]])
    assert s.file_object("kept") is not None and s.file_object("dropped") is None
    assert s.missing(dropped[2]) == dropped[2] and not s.missing(kept[2])
    assert sorted(os.listdir(tmp_path / "store" / "files")) == ["kept", "kept.ids"]


def test_will_need_brings_a_file_objects_chunks_into_the_page_cache(tmp_path):
    """push --early's first reads are read right after the publish: their chunks, written
    with O_DIRECT past the page cache, are read into it first."""
    s = Store(tmp_path / "store")
    data, pieces, ids = _file(8)
    s.expect_file("k", len(data), ids, CS)
    for c, p in zip(ids, pieces):
        s.put_blob(c, chunk.encode(p))
    part = next((tmp_path / "store" / "files").iterdir())
    fd = os.open(part, os.O_RDONLY)
    os.fdatasync(fd)  # written pages (a buffer O_DIRECT could not take) are clean, evictable
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    size = part.stat().st_size
    if _resident(part, 0, CS):
        pytest.skip("this filesystem keeps file pages in memory (tmpfs)")
    assert s.will_need(ids[:4] + [chunk_id(b"not in a file object")]) == 4 * CS
    deadline = time.monotonic() + 10
    while not _resident(part, 0, 4 * CS) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _resident(part, 0, 4 * CS)
    assert not _resident(part, 4 * CS, size - 4 * CS)  # only what was asked for
    assert [bytes(s.get(c)) for c in ids] == pieces


def test_a_batch_of_blobs_is_verified_each_and_appended_together(tmp_path):
    """Store.put_blobs (a node's write batch): each blob verified on its own, a repeat or an
    object already held stored once, a bad one refused without the rest, all in one append."""
    s = Store(tmp_path / "store")
    held = s.put(os.urandom(50))
    a, b = os.urandom(100), os.urandom(200)
    size = s._size
    out = s.put_blobs([(chunk_id(a), encode(a)), (chunk_id(a), encode(a)),
                       (chunk_id(b), encode(b)[:-1] + b"?"), (held, encode(b"x"))])
    assert out[:2] == [True, False] and isinstance(out[2], CorruptChunk) and out[3] is False
    assert s._size == size + RECORD.size + len(encode(a))  # one record: a's
    s.close()
    s = Store(tmp_path / "store")
    try:
        assert s.get(chunk_id(a)) == a and not s.has(chunk_id(b)) and len(s) == 2
    finally:
        s.close()
