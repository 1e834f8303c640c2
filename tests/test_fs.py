"""The content layer: chunks, the content-addressed store, manifests, the directory scan and the
read-path chunk cache. Real files on a real filesystem; no mocks."""

from __future__ import annotations

import ctypes
import mmap
import os
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import pytest
import trio
import trio.testing
import xxhash
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from monarch_fs.fs import chunk
from monarch_fs.fs.chunk import (
    CHUNK_SIZE,
    ID_SIZE,
    MAX_CHUNK_SIZE,
    RAW,
    ZSTD,
    CorruptChunk,
    chunk_id,
    spans,
)
from monarch_fs.fs.chunk_cache import ChunkCache
from monarch_fs.fs.manifest import (
    MAGIC,
    MAX_NAME,
    MAX_PATH,
    Entry,
    Kind,
    Manifest,
    ManifestError,
    UnsafePath,
    check_path,
)
from monarch_fs.fs.scan import Snapshot, SourceChanged, scan
from monarch_fs.fs import store as store_module
from monarch_fs.fs.store import NOWAIT_MAX, READ_AROUND, Store, StoreBusy

FUZZ = settings(max_examples=300, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
SMALL = 64 * 1024  # the smallest chunk size a manifest allows

# The documented wire layout of a manifest, written out independently of fs/manifest.py so that
# tests can hand-craft hostile bytes that Manifest.encode would never produce.
HEAD = struct.Struct("<5sII")  # magic, chunk size, entry count
ENTRY = struct.Struct("<BIQqHHI")  # kind, mode, size, mtime_ns, path len, target len, chunks


def raw_manifest(entries, chunk_size: int = CHUNK_SIZE, magic: bytes = MAGIC,
                 count: int | None = None) -> bytes:
    """entries: (path, kind, mode, size, mtime_ns, target, chunks), encoded in the given order."""
    out = [HEAD.pack(magic, chunk_size, len(entries) if count is None else count)]
    for path, kind, mode, size, mtime, target, chunks in entries:
        out.append(ENTRY.pack(kind, mode, size, mtime, len(path), len(target), len(chunks)))
        out += [path, target, *chunks]
    return b"".join(out)


ROOT = (b"", Kind.DIR, 0o755, 0, 0, b"", ())


def cid(n: int) -> bytes:
    return chunk_id(b"chunk-%d" % n)


# --------------------------------------------------------------------------------------------
# chunk.py


def test_chunk_id_is_xxh3_128_of_the_raw_bytes():
    assert chunk_id(b"hello") == xxhash.xxh3_128_digest(b"hello")
    assert len(chunk_id(b"")) == ID_SIZE == 16
    assert chunk_id(memoryview(b"hello")) == chunk_id(b"hello")
    assert chunk_id(b"hello") != chunk_id(b"hellp")


def test_spans_cover_the_file_exactly():
    assert spans(0) == []
    assert spans(1, 10) == [(0, 1)]
    assert spans(10, 10) == [(0, 10)]
    assert spans(25, 10) == [(0, 10), (10, 10), (20, 5)]
    assert len(spans(CHUNK_SIZE + 1)) == 2


@pytest.mark.parametrize("data", [
    b"",
    b"x",
    b"a" * 255,  # below the compression threshold
    b"a" * 100_000,  # compressible
    os.urandom(100_000),  # incompressible
], ids=["empty", "one", "short", "compressible", "random"])
def test_encode_decode_round_trip(data):
    blob = chunk.encode(data)
    assert chunk.decode(chunk_id(data), blob) == data
    assert chunk.decode(chunk_id(data), memoryview(blob)) == data


def test_encode_compresses_only_when_it_saves_space():
    text = b"hello world " * 10_000
    blob = chunk.encode(text)
    assert blob[0] == ZSTD and len(blob) < len(text) // 10
    noise = os.urandom(10_000)
    assert chunk.encode(noise) == bytes([RAW]) + noise
    assert chunk.encode(b"a" * 100) == bytes([RAW]) + b"a" * 100  # too small to bother


def test_decode_refuses_bytes_that_do_not_match_the_id():
    data = b"hello world " * 1000
    for blob in (chunk.encode(data), bytes([RAW]) + data):
        with pytest.raises(CorruptChunk):
            chunk.decode(chunk_id(b"something else"), blob)


@pytest.mark.parametrize("blob", [
    b"",
    b"\x02payload",
    b"\xffpayload",
    b"\x01not a zstd frame at all",
    b"\x01",
])
def test_decode_refuses_malformed_blobs(blob):
    with pytest.raises(CorruptChunk):
        chunk.decode(chunk_id(b"payload"), blob)


def test_decode_enforces_max_size():
    data = b"a" * 10_000
    with pytest.raises(CorruptChunk):
        chunk.decode(chunk_id(data), bytes([RAW]) + data, max_size=1000)
    with pytest.raises(CorruptChunk):
        chunk.decode(chunk_id(data), chunk.encode(data), max_size=1000)
    # A decompression bomb whose frame does not declare its size is cut off too.
    bomb = zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * (4 << 20))
    with pytest.raises(CorruptChunk):
        chunk.decode(chunk_id(b"\0" * (4 << 20)), bytes([ZSTD]) + bomb, max_size=1 << 20)


def _zstd_with_declared_size(data: bytes, declared: int) -> bytes:
    """A zstd blob for `data` whose frame header claims `declared` content bytes."""
    frame = zstandard.ZstdCompressor().compress(data)
    fhd = frame[4]
    assert fhd >> 6 == 1 and fhd & 0x20, "expected a single-segment frame with a 2-byte size"
    return bytes([ZSTD]) + frame[:4] + bytes([0xE0]) + struct.pack("<Q", declared) + frame[7:]


@pytest.mark.parametrize("declared", [2**31, 2**40], ids=["2GiB", "1TiB"])
def test_decode_of_a_frame_claiming_a_huge_size_fails_fast_as_corrupt(declared):
    data = b"a" * 1000
    blob = _zstd_with_declared_size(data, declared)
    assert len(blob) < 64
    tracemalloc.start()
    try:
        with pytest.raises(CorruptChunk):
            chunk.decode(chunk_id(data), blob)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= 2 * MAX_CHUNK_SIZE


@FUZZ
@given(st.binary(max_size=300), st.binary(min_size=16, max_size=16))
def test_decode_of_arbitrary_bytes_raises_only_corrupt_chunk(blob, some_id):
    try:
        data = chunk.decode(some_id, blob)
    except CorruptChunk:
        return
    assert chunk_id(data) == some_id  # only possible if the fuzzer found a real preimage


# --------------------------------------------------------------------------------------------
# store.py


def _flip(path: Path, index: int, mask: int) -> None:
    b = bytearray(path.read_bytes())
    b[index] ^= mask
    path.write_bytes(bytes(b))


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
    old = [s.put(os.urandom(40_000)) for _ in range(6)]  # 3 sealed packs of 2 objects (64 KiB packs)
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
    assert s.get(neighbour) and s.get(recent)  # a live neighbour keeps its pack; the open pack stays
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
    monkeypatch.setattr(store_module, "COMPACT_MAX_BYTES", 30_000)
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


# --------------------------------------------------------------------------------------------
# manifest.py


def sample_manifest(chunk_size: int = CHUNK_SIZE) -> Manifest:
    return Manifest([
        Entry(b"", Kind.DIR, 0o755, 0, 1),
        Entry(b"pkg", Kind.DIR, 0o755, 0, 2),
        Entry(b"pkg/__init__.py", Kind.FILE, 0o644, 10, 3, chunks=(cid(1),)),
        Entry(b"run.sh", Kind.FILE, 0o755, chunk_size + 1, 4, chunks=(cid(2), cid(3))),
        Entry(b"empty", Kind.FILE, 0o600, 0, -5),
        Entry(b"with space", Kind.FILE, 0o644, 3, 6, chunks=(cid(1),)),
        Entry(b"new\nline", Kind.FILE, 0o644, 3, 7, chunks=(cid(4),)),
        Entry(b"latin-\xe9", Kind.DIR, 0o700, 0, 8),
        Entry(b"latin-\xe9/\xff\xfe", Kind.SYMLINK, 0o777, 13, 9, target=b"/etc/hostname"),
        Entry(b"pkg/up", Kind.SYMLINK, 0o777, 11, 10, target=b"../../../x\n"),
        Entry(b"setuid", Kind.FILE, 0o7777, 1, 11, chunks=(cid(5),)),
    ], chunk_size)


def test_manifest_round_trip_keeps_every_field():
    m = sample_manifest()
    m.validate()
    data = m.encode()
    back = Manifest.decode(data)
    assert back.entries == m.entries
    assert back.chunk_size == m.chunk_size
    assert back.encode() == data and back.id == m.id == chunk_id(data)
    assert Manifest.decode(memoryview(data)).entries == m.entries
    assert Manifest.decode(bytearray(data)).entries == m.entries
    assert back.get(b"latin-\xe9/\xff\xfe").target == b"/etc/hostname"
    assert back.get(b"new\nline").chunks == (cid(4),)
    assert back.get(b"missing") is None
    assert back.get(b"empty").mtime_ns == -5


def test_manifest_layout_matches_the_documented_format():
    m = sample_manifest()
    by_hand = raw_manifest([(e.path, e.kind, e.mode, e.size, e.mtime_ns, e.target, e.chunks)
                            for e in m.entries], m.chunk_size)
    assert m.encode() == by_hand


def test_manifest_orders_parents_first_and_subtrees_contiguously():
    m = Manifest([
        Entry(b"a-b", Kind.FILE, 0o644, 0, 0),
        Entry(b"a/z", Kind.FILE, 0o644, 0, 0),
        Entry(b"a", Kind.DIR, 0o755, 0, 0),
        Entry(b"", Kind.DIR, 0o755, 0, 0),
        Entry(b"a/b", Kind.DIR, 0o755, 0, 0),
        Entry(b"a/b/c", Kind.FILE, 0o644, 0, 0),
    ])
    m.validate()
    assert [e.path for e in m] == [b"", b"a", b"a/b", b"a/b/c", b"a/z", b"a-b"]


def test_manifest_id_is_deterministic_and_content_sensitive():
    m = sample_manifest()
    shuffled = Manifest(list(reversed(m.entries)), m.chunk_size)
    assert shuffled.encode() == m.encode() and shuffled.id == m.id
    changes = [
        lambda e: Entry(e.path, e.kind, e.mode, e.size, e.mtime_ns + 1, e.target, e.chunks),
        lambda e: Entry(e.path, e.kind, e.mode ^ 0o100, e.size, e.mtime_ns, e.target, e.chunks),
        lambda e: Entry(e.path, e.kind, e.mode, e.size, e.mtime_ns, e.target, (cid(99),)),
        lambda e: Entry(e.path + b"2", e.kind, e.mode, e.size, e.mtime_ns, e.target, e.chunks),
    ]
    ids = {m.id}
    for change in changes:
        entries = [change(e) if e.path == b"pkg/__init__.py" else e for e in m.entries]
        ids.add(Manifest(entries, m.chunk_size).id)
    assert len(ids) == 1 + len(changes)
    assert Manifest(m.entries, SMALL).id != m.id


def test_manifest_helpers():
    m = sample_manifest()
    assert len(m) == len(m.entries) == 11
    # In canonical file order; cid(1) is used by two files and listed once.
    assert m.chunk_ids() == [cid(4), cid(1), cid(2), cid(3), cid(5)]
    assert m.total_bytes == 10 + CHUNK_SIZE + 1 + 3 + 3 + 1
    e = m.get(b"latin-\xe9/\xff\xfe")
    assert e.name == b"\xff\xfe" and e.parent == b"latin-\xe9"
    assert m.get(b"pkg/__init__.py").same_content(m.get(b"pkg/__init__.py"))
    assert not m.get(b"with space").same_content(m.get(b"new\nline"))


UNSAFE_PATHS = [
    b"/abs", b"/", b"..", b"../x", b"a/../b", b"a/..", b".", b"./a", b"a/./b",
    b"a//b", b"a/", b"a\0b", b"\0", b"x" * (MAX_NAME + 1), b"a/" + b"y" * (MAX_NAME + 1),
    b"/".join([b"d" * 200] * 21),  # every name legal, but longer than MAX_PATH
]


@pytest.mark.parametrize("path", UNSAFE_PATHS)
def test_check_path_refuses_paths_that_could_escape(path):
    with pytest.raises(UnsafePath):
        check_path(path)


def test_check_path_accepts_odd_but_safe_names():
    for path in [b"a", b"...", b".hidden", b"a..b", b"x" * MAX_NAME, b"new\nline",
                 b"with space", b"\xff\xfe", b"a/b/c", b"/".join([b"d" * 200] * 20)]:
        check_path(path)
    assert len(b"/".join([b"d" * 200] * 20)) <= MAX_PATH


def _with_parents(path: bytes) -> list[tuple]:
    """ROOT, a DIR entry for every proper prefix of `path` (that is itself safe), and `path`."""
    out, parts = [ROOT], path.split(b"/")
    for i in range(1, len(parts)):
        prefix = b"/".join(parts[:i])
        try:
            check_path(prefix)
        except UnsafePath:
            break
        if not prefix:  # "/abs": its parent is the root itself
            break
        out.append((prefix, Kind.DIR, 0o755, 0, 0, b"", ()))
    out.append((path, Kind.FILE, 0o644, 0, 0, b"", ()))
    return out


@pytest.mark.parametrize("path", UNSAFE_PATHS)
def test_unsafe_paths_are_refused_by_validate_and_by_decode(path):
    entries = _with_parents(path)
    m = Manifest([Entry(p, Kind(k), mo, s, t, tg, c) for p, k, mo, s, t, tg, c in entries])
    with pytest.raises(UnsafePath):
        m.validate()
    # Hand-crafted bytes, in canonical order, as a hostile peer would send them.
    entries.sort(key=lambda e: tuple(e[0].split(b"/")) if e[0] else ())
    with pytest.raises(UnsafePath):
        Manifest.decode(raw_manifest(entries))


def test_unsafe_path_is_a_manifest_error_and_a_value_error():
    assert issubclass(UnsafePath, ManifestError) and issubclass(ManifestError, ValueError)


def _bad(entries, **kw) -> None:
    """Both validate() and decode() of the hand-crafted encoding refuse `entries`."""
    chunk_size = kw.get("chunk_size", CHUNK_SIZE)
    with pytest.raises(ManifestError):
        Manifest([Entry(p, Kind(k), mo, s, t, tg, c) for p, k, mo, s, t, tg, c in entries],
                 chunk_size).validate()
    with pytest.raises(ManifestError):
        Manifest.decode(raw_manifest(entries, chunk_size))


def test_missing_or_wrong_parents_are_refused():
    _bad([ROOT, (b"a/b", Kind.FILE, 0o644, 0, 0, b"", ())])
    _bad([ROOT, (b"f", Kind.FILE, 0o644, 0, 0, b"", ()), (b"f/x", Kind.FILE, 0o644, 0, 0, b"", ())])
    _bad([ROOT, (b"l", Kind.SYMLINK, 0o777, 1, 0, b"d", ()),
          (b"l/x", Kind.FILE, 0o644, 0, 0, b"", ())])


def test_missing_or_wrong_root_is_refused():
    _bad([])
    _bad([(b"a", Kind.DIR, 0o755, 0, 0, b"", ())])
    _bad([(b"", Kind.FILE, 0o644, 0, 0, b"", ())])


def test_duplicates_are_refused():
    f = (b"a", Kind.FILE, 0o644, 0, 0, b"", ())
    _bad([ROOT, f, f])
    _bad([ROOT, ROOT])
    _bad([ROOT, (b"a", Kind.DIR, 0o755, 0, 0, b"", ()), f])


@pytest.mark.parametrize("size,nchunks", [(1, 0), (0, 1), (CHUNK_SIZE + 1, 1),
                                          (CHUNK_SIZE, 2), (3 * CHUNK_SIZE, 4)])
def test_wrong_chunk_counts_are_refused(size, nchunks):
    _bad([ROOT, (b"f", Kind.FILE, 0o644, size, 0, b"", tuple(cid(i) for i in range(nchunks)))])


def test_right_chunk_counts_are_accepted():
    for size, n in [(0, 0), (1, 1), (SMALL, 1), (SMALL + 1, 2), (3 * SMALL, 3)]:
        data = raw_manifest([ROOT, (b"f", Kind.FILE, 0o644, size, 0, b"", tuple(
            cid(i) for i in range(n)))], SMALL)
        assert Manifest.decode(data).get(b"f").size == size


def test_other_malformed_entries_are_refused():
    _bad([ROOT, (b"d", Kind.DIR, 0o755, 0, 0, b"", (cid(1),))])  # chunks on a dir
    _bad([ROOT, (b"l", Kind.SYMLINK, 0o777, 1, 0, b"x", (cid(1),))])  # chunks on a link
    _bad([ROOT, (b"f", Kind.FILE, 0o644, 0, 0, b"target", ())])  # target on a file
    _bad([ROOT, (b"l", Kind.SYMLINK, 0o777, 0, 0, b"", ())])  # empty target
    _bad([ROOT, (b"l", Kind.SYMLINK, 0o777, 3, 0, b"a\0b", ())])  # NUL in target
    _bad([ROOT, (b"l", Kind.SYMLINK, 0o777, 0, 0, b"t" * (MAX_PATH + 1), ())])
    _bad([ROOT, (b"f", Kind.FILE, 0o10644, 0, 0, b"", ())])  # mode beyond 0o7777
    _bad([ROOT], chunk_size=SMALL - 1)
    _bad([ROOT], chunk_size=MAX_CHUNK_SIZE + 1)
    for kind in (0, 4, 255):
        with pytest.raises(ManifestError):
            Manifest.decode(raw_manifest([ROOT, (b"x", kind, 0o644, 0, 0, b"", ())]))


def test_fields_past_what_the_kernel_takes_are_refused():
    """Issue 16, finding 4: a directory of size 2^64-1 passed, and the first `ls` of it raised
    OverflowError inside a FUSE handler. Every field is now held to the kernel's limits."""
    _bad([ROOT, (b"d", Kind.DIR, 0o755, 2**64 - 1, 0, b"", ())])
    _bad([ROOT, (b"d", Kind.DIR, 0o755, 4096, 0, b"", ())])  # a directory's size is 0
    _bad([ROOT, (b"l", Kind.SYMLINK, 0o777, 2**64 - 1, 0, b"t", ())])
    _bad([ROOT, (b"l", Kind.SYMLINK, 0o777, 2, 0, b"t", ())])  # size = the target's length
    _bad([ROOT, (b"l", Kind.SYMLINK, 0o777, 4096, 0, b"t" * 4096, ())])  # readlink: < PATH_MAX
    _bad([ROOT, (b"f", Kind.FILE, 0o644, 2**64 - 1, 0, b"", (cid(1),))])
    _bad([ROOT, (b"f", Kind.FILE, 2**32 - 1, 0, 0, b"", ())])
    for bad in (Entry(b"f", Kind.FILE, 0o644, 0, 2**63), Entry(b"f", Kind.FILE, 0o644, 0, -(2**63) - 1),
                Entry(b"f", Kind.FILE, -1, 0, 0), Entry(b"f", Kind.FILE, 0o644, -1, 0)):
        with pytest.raises(ManifestError, match="b'f'"):  # not encodable: validate() only
            Manifest([Entry(b"", Kind.DIR, 0o755, 0, 0), bad]).validate()
    with pytest.raises(ManifestError, match=r"directory b'd': size 18446744073709551615"):
        Manifest.decode(raw_manifest([ROOT, (b"d", Kind.DIR, 0o755, 2**64 - 1, 0, b"", ())]))


def test_fields_at_the_kernel_limits_are_accepted():
    m = Manifest.decode(raw_manifest([
        (b"", Kind.DIR, 0o7777, 0, -(2**63), b"", ()),
        (b"l", Kind.SYMLINK, 0, 4095, 2**63 - 1, b"t" * 4095, ()),
        (b"n" * MAX_NAME, Kind.FILE, 0o7777, SMALL + 1, 0, b"", (cid(1), cid(2))),
    ], SMALL))
    assert [e.size for e in m] == [0, 4095, SMALL + 1]


def test_every_truncation_and_any_trailing_bytes_are_refused():
    data = sample_manifest().encode()
    for n in range(len(data)):
        with pytest.raises(ManifestError):
            Manifest.decode(data[:n])
    with pytest.raises(ManifestError):
        Manifest.decode(data + b"\0")


def test_bad_magic_is_refused():
    data = sample_manifest().encode()
    for magic in (b"MFSM\x02", b"XFSM\x01", b"\0" * 5):
        with pytest.raises(ManifestError, match="magic"):
            Manifest.decode(magic + data[5:])


def test_non_canonical_order_is_refused():
    a = (b"a", Kind.FILE, 0o644, 0, 0, b"", ())
    b = (b"b", Kind.FILE, 0o644, 0, 0, b"", ())
    assert Manifest.decode(raw_manifest([ROOT, a, b])).encode() == raw_manifest([ROOT, a, b])
    with pytest.raises(ManifestError, match="order"):
        Manifest.decode(raw_manifest([ROOT, b, a]))
    with pytest.raises(ManifestError):
        Manifest.decode(raw_manifest([a, ROOT, b]))
    d = (b"d", Kind.DIR, 0o755, 0, 0, b"", ())
    dx = (b"d/x", Kind.FILE, 0o644, 0, 0, b"", ())
    dash = (b"d-", Kind.FILE, 0o644, 0, 0, b"", ())  # byte order would put it before d/x
    Manifest.decode(raw_manifest([ROOT, d, dx, dash]))
    with pytest.raises(ManifestError):
        Manifest.decode(raw_manifest([ROOT, d, dash, dx]))


_ABSURD = r"""
import resource, struct, sys, time, tracemalloc
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, resource.RLIM_INFINITY))
from monarch_fs.fs.manifest import MAGIC, Kind, Manifest, ManifestError
HEAD, ENTRY, CS = struct.Struct("<5sII"), struct.Struct("<BIQqHHI"), 4 << 20
cases = {
    "10M entries in 20 bytes": HEAD.pack(MAGIC, CS, 10_000_000) + bytes(7),
    "4G entries, no body": HEAD.pack(MAGIC, CS, 2**32 - 1),
    "4G chunk ids": HEAD.pack(MAGIC, CS, 1) + ENTRY.pack(Kind.DIR, 0o755, 0, 0, 0, 0, 2**32 - 1)
                    + bytes(64),
    "64K path and target": HEAD.pack(MAGIC, CS, 1)
                           + ENTRY.pack(Kind.DIR, 0o755, 0, 0, 65535, 65535, 0) + bytes(64),
    "1000 entries of 4G chunks": HEAD.pack(MAGIC, CS, 1000)
                                 + ENTRY.pack(Kind.FILE, 0o644, 2**64 - 1, 0, 0, 0, 2**32 - 1) * 1000,
}
for name, data in cases.items():
    tracemalloc.start()
    t = time.perf_counter()
    try:
        Manifest.decode(data)
    except ManifestError:
        pass
    else:
        sys.exit(f"{name}: accepted")
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    if time.perf_counter() - t > 0.5 or peak > 1 << 20:
        sys.exit(f"{name}: {time.perf_counter() - t:.2f} s, {peak} bytes allocated")
"""


def test_absurd_counts_fail_fast_without_allocating():
    """Headers and entries that claim far more than the input holds fail at once, without
    allocating for the claim (in a child with a 1 GiB address-space limit and a timeout, so a
    regression fails the test instead of exhausting the machine)."""
    proc = subprocess.run([sys.executable, "-c", _ABSURD], capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 0, proc.stderr or proc.stdout


# Hypothesis: valid manifests, their encodings, and mutations of them.

_names = st.binary(min_size=1, max_size=16).filter(
    lambda b: b"/" not in b and b"\0" not in b and b not in (b".", b".."))
_ids = st.binary(min_size=ID_SIZE, max_size=ID_SIZE)


@st.composite
def manifests(draw) -> Manifest:
    chunk_size = draw(st.sampled_from([SMALL, CHUNK_SIZE, MAX_CHUNK_SIZE]))
    mtimes = st.integers(-(2**63), 2**63 - 1)
    entries = [Entry(b"", Kind.DIR, draw(st.integers(0, 0o7777)), 0, draw(mtimes))]
    dirs, seen = [b""], {b""}
    for _ in range(draw(st.integers(0, 10))):
        parent = draw(st.sampled_from(dirs))
        name = draw(_names)
        path = parent + b"/" + name if parent else name
        if path in seen:
            continue
        seen.add(path)
        kind = draw(st.sampled_from(Kind))
        mode = draw(st.integers(0, 0o7777))
        mtime = draw(mtimes)
        if kind == Kind.DIR:
            entries.append(Entry(path, kind, mode, 0, mtime))
            dirs.append(path)
        elif kind == Kind.FILE:
            n = draw(st.integers(0, 3))
            size = draw(st.integers((n - 1) * chunk_size + 1, n * chunk_size)) if n else 0
            chunks = tuple(draw(_ids) for _ in range(n))
            entries.append(Entry(path, kind, mode, size, mtime, chunks=chunks))
        else:
            target = draw(st.binary(min_size=1, max_size=40).filter(lambda b: b"\0" not in b))
            entries.append(Entry(path, kind, mode, len(target), mtime, target))
    order = draw(st.permutations(range(len(entries))))
    return Manifest([entries[i] for i in order], chunk_size)


@FUZZ
@given(manifests())
def test_fuzz_valid_manifests_round_trip(m):
    m.validate()
    data = m.encode()
    back = Manifest.decode(data)
    assert back.entries == m.entries and back.chunk_size == m.chunk_size
    assert back.encode() == data and back.id == m.id


def _decode_only_manifest_errors(data: bytes) -> None:
    try:
        m = Manifest.decode(data)
    except ManifestError:
        return
    # Whatever is accepted is canonical: it encodes back to exactly the same bytes.
    assert m.encode() == bytes(data)


@FUZZ
@given(st.one_of(st.binary(max_size=400),
                 st.binary(max_size=400).map(lambda b: MAGIC + b),
                 st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1),
                           st.binary(max_size=400)).map(
                     lambda t: HEAD.pack(MAGIC, t[0], t[1]) + t[2])))
def test_fuzz_decode_of_arbitrary_bytes_raises_only_manifest_error(data):
    _decode_only_manifest_errors(data)


_mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10**6), st.integers(1, 255)),
    st.tuples(st.just("cut"), st.integers(0, 10**6), st.integers(0, 10**6)),
    st.tuples(st.just("insert"), st.integers(0, 10**6), st.binary(min_size=1, max_size=24)),
    st.tuples(st.just("u32"), st.integers(0, 10**6), st.sampled_from(
        [0, 1, 255, 256, 4095, 4096, 65535, 2**31, 2**32 - 1])),
    st.tuples(st.just("u16"), st.integers(0, 10**6), st.sampled_from([0, 1, 255, 256, 65535])),
)


def _mutate(data: bytes, ops) -> bytes:
    b = bytearray(data)
    for op, pos, arg in ops:
        i = pos % (len(b) + 1)
        if op == "flip" and i < len(b):
            b[i] ^= arg
        elif op == "cut":
            del b[i:i + arg % 64 + 1]
        elif op == "insert":
            b[i:i] = arg
        elif op == "u32" and i + 4 <= len(b):
            b[i:i + 4] = struct.pack("<I", arg)
        elif op == "u16" and i + 2 <= len(b):
            b[i:i + 2] = struct.pack("<H", arg)
    return bytes(b)


@FUZZ
@given(manifests(), st.lists(_mutation, min_size=1, max_size=4))
def test_fuzz_decode_of_mutated_encodings_raises_only_manifest_error(m, ops):
    data = _mutate(m.encode(), ops)
    tracemalloc.start()
    try:
        _decode_only_manifest_errors(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < (1 << 20) + 20 * len(data)


# --------------------------------------------------------------------------------------------
# scan.py


def make_tree(root: Path) -> dict[str, bytes]:
    """A source folder with every kind of entry; returns the contents of the regular files."""
    files = {
        "pkg/__init__.py": b"VALUE = 1\n",
        "pkg/sub/data.bin": os.urandom(3 * SMALL + 17),  # four chunks
        "exact.bin": os.urandom(2 * SMALL),  # exactly two chunks
        "one.bin": os.urandom(SMALL),  # exactly one chunk
        "text.txt": b"hello " * 10_000,
        "empty": b"",
        "run.sh": b"#!/bin/sh\necho ran\n",
        "private": b"secret",
        "with space": b"space",
        "new\nline": b"newline",
        os.fsdecode(b"latin-\xe9"): b"not utf-8",
        os.fsdecode(b"dir-\xff/inner"): b"inside a non-utf-8 dir",
    }
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    (root / "empty-dir").mkdir()
    (root / "run.sh").chmod(0o755)
    (root / "private").chmod(0o600)
    os.symlink("pkg/__init__.py", root / "rel-link")
    os.symlink("/etc/hostname", root / "abs-link")
    os.symlink("../../outside/escape", root / "pkg" / "escaping-link")
    os.symlink("missing-target", root / "dangling")
    os.symlink("pkg", root / "dir-link")
    os.symlink(b"\xfe\xfd-target", os.fsencode(root / "odd-link"))
    os.link(root / "text.txt", root / "hardlink.txt")
    files["hardlink.txt"] = files["text.txt"]
    return files


def file_bytes(snap: Snapshot, e: Entry) -> bytes:
    return b"".join(snap.read_chunk(c) for c in e.chunks)


async def test_scan_records_every_entry_kind(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    files = make_tree(src)
    os.utime(src / "run.sh", ns=(1, 1_234_567_891_234_567_890))
    snap = await scan(src, chunk_size=SMALL)
    m = snap.manifest
    assert snap.root == os.fsencode(src) and snap.warnings == []
    m.validate()

    expected_paths = {os.fsencode(p) for p in files} | {
        b"", b"pkg", b"pkg/sub", b"empty-dir", b"dir-\xff", b"rel-link", b"abs-link",
        b"pkg/escaping-link", b"dangling", b"dir-link", b"odd-link"}
    assert {e.path for e in m} == expected_paths

    for rel, data in files.items():
        e = m.get(os.fsencode(rel))
        st_ = os.lstat(src / rel)
        assert e.kind == Kind.FILE
        assert e.size == len(data) == st_.st_size
        assert e.mode == stat.S_IMODE(st_.st_mode)
        assert e.mtime_ns == st_.st_mtime_ns
        assert len(e.chunks) == -(-len(data) // SMALL)
        assert file_bytes(snap, e) == data, rel
    assert m.get(b"run.sh").mode == 0o755
    assert m.get(b"run.sh").mtime_ns == 1_234_567_891_234_567_890
    assert m.get(b"private").mode == 0o600
    assert m.get(b"empty").chunks == () and m.get(b"empty").size == 0

    for rel in [b"", b"pkg", b"pkg/sub", b"empty-dir", b"dir-\xff"]:
        e = m.get(rel)
        st_ = os.lstat(os.path.join(os.fsencode(src), rel) if rel else os.fsencode(src))
        assert e.kind == Kind.DIR and e.chunks == () and e.target == b""
        assert e.mode == stat.S_IMODE(st_.st_mode) and e.mtime_ns == st_.st_mtime_ns

    links = {b"rel-link": b"pkg/__init__.py", b"abs-link": b"/etc/hostname",
             b"pkg/escaping-link": b"../../outside/escape", b"dangling": b"missing-target",
             b"dir-link": b"pkg", b"odd-link": b"\xfe\xfd-target"}
    for rel, target in links.items():
        e = m.get(rel)
        assert e.kind == Kind.SYMLINK and e.target == target and e.chunks == ()
        assert e.size == len(target)
    # A symlink to a directory is not followed.
    assert not any(e.path.startswith(b"dir-link/") for e in m)

    # The manifest survives its own wire format.
    assert Manifest.decode(m.encode()).entries == m.entries


async def test_scan_splits_large_files_into_ceil_size_over_chunk_size_chunks(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    sizes = {"a": 0, "b": 1, "c": SMALL - 1, "d": SMALL, "e": SMALL + 1, "f": 5 * SMALL + 3}
    for name, size in sizes.items():
        (src / name).write_bytes(os.urandom(size))
    snap = await scan(src, chunk_size=SMALL)
    for name, size in sizes.items():
        e = snap.manifest.get(name.encode())
        assert len(e.chunks) == -(-size // SMALL), name
        data = (src / name).read_bytes()
        assert [chunk_id(data[o:o + n]) for o, n in spans(size, SMALL)] == list(e.chunks)
    assert snap.manifest.total_bytes == sum(sizes.values())
    assert snap.manifest.chunk_size == SMALL


async def test_scan_is_deterministic_and_sensitive_to_changes(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    make_tree(src)
    first = await scan(src, chunk_size=SMALL)
    second = await scan(src, chunk_size=SMALL)
    assert first.manifest.encode() == second.manifest.encode()
    assert first.manifest.id == second.manifest.id
    st_ = os.stat(src / "pkg" / "__init__.py")
    (src / "pkg" / "__init__.py").write_bytes(b"VALUE = 2\n")  # same size, same mtime
    os.utime(src / "pkg" / "__init__.py", ns=(st_.st_atime_ns, st_.st_mtime_ns))
    third = await scan(src, chunk_size=SMALL)
    assert third.manifest.id != first.manifest.id


async def test_hard_links_share_chunks_and_are_hashed_once(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    data = os.urandom(2 * SMALL + 5)
    (src / "orig").write_bytes(data)
    os.link(src / "orig", src / "link1")
    os.mkdir(src / "d")
    os.link(src / "orig", src / "d" / "link2")
    (src / "other").write_bytes(b"xyz")
    reports = []
    snap = await scan(src, chunk_size=SMALL, progress=lambda done, total: reports.append(
        (done, total)))
    m = snap.manifest
    chunks = {m.get(p).chunks for p in (b"orig", b"link1", b"d/link2")}
    assert len(chunks) == 1 and len(next(iter(chunks))) == 3
    # Progress counts each inode once: the links' bytes are not hashed again.
    assert reports and reports[-1] == (len(data) + 3, len(data) + 3)
    assert len(snap.sources) == 4
    assert file_bytes(snap, m.get(b"d/link2")) == data


async def test_scan_dedups_equal_content_across_files(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(300):  # more files than one hashing batch
        (src / f"f{i:03}").write_bytes(b"same content" if i % 2 else b"file %d" % i)
    snap = await scan(src, chunk_size=SMALL)
    m = snap.manifest
    assert len(m) == 301
    assert len(m.chunk_ids()) == 151 == len(snap.sources)
    for i in range(300):
        e = m.get(b"f%03d" % i)
        assert file_bytes(snap, e) == (b"same content" if i % 2 else b"file %d" % i)


async def test_fifos_and_sockets_are_skipped_with_one_warning_each(tmp_path):
    src = tmp_path / "s"
    src.mkdir()
    (src / "d").mkdir()
    os.mkfifo(src / "fifo")
    os.mkfifo(src / "d" / "fifo2")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(src / "sock"))
        (src / "file").write_bytes(b"x")
        snap = await scan(src, chunk_size=SMALL)
    finally:
        sock.close()
    assert {e.path for e in snap.manifest} == {b"", b"d", b"file"}
    assert len(snap.warnings) == 3
    assert sum("fifo" in w and "fifo2" not in w for w in snap.warnings) == 1
    assert sum("d/fifo2" in w for w in snap.warnings) == 1
    assert sum("sock" in w for w in snap.warnings) == 1


async def test_excludes_match_names_and_relative_paths(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for rel in ["keep.py", "drop.pyc", "pkg/mod.py", "pkg/mod.pyc", "pkg/__pycache__/x.pyc",
                "pkg/sub/data.bin", "other/sub/data.bin", ".git/HEAD", "build/out/a.o"]:
        p = src / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(rel.encode())
    os.mkfifo(src / ".git" / "fifo")  # would warn if the excluded dir were descended
    os.mkfifo(src / "build" / "out" / "fifo")
    snap = await scan(src, ["*.pyc", "__pycache__", ".git", "pkg/sub", "build/out"],
                      chunk_size=SMALL)
    paths = {e.path for e in snap.manifest}
    assert paths == {b"", b"keep.py", b"pkg", b"pkg/mod.py", b"other", b"other/sub",
                     b"other/sub/data.bin", b"build"}
    assert snap.warnings == []
    # A glob on the relative path reaches into subdirectories.
    snap2 = await scan(src, ["other/*"], chunk_size=SMALL)
    assert {e.path for e in snap2.manifest if e.path.startswith(b"other")} == {b"other"}


async def test_read_chunk_detects_a_source_modified_after_the_scan(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    data = os.urandom(3 * SMALL)
    (src / "big").write_bytes(data)
    (src / "small").write_bytes(b"0123456789")
    snap = await scan(src, chunk_size=SMALL)
    big = snap.manifest.get(b"big")
    small = snap.manifest.get(b"small")
    for c in big.chunks + small.chunks:
        assert chunk_id(snap.read_chunk(c)) == c
    assert file_bytes(snap, big) == data

    with open(src / "big", "r+b") as f:  # same size, one byte changed in the second chunk
        f.seek(SMALL + 100)
        f.write(bytes([data[SMALL + 100] ^ 1]))
    assert snap.read_chunk(big.chunks[0]) == data[:SMALL]
    with pytest.raises(SourceChanged):
        snap.read_chunk(big.chunks[1])

    (src / "small").write_bytes(b"01234")  # truncated
    with pytest.raises(SourceChanged):
        snap.read_chunk(small.chunks[0])
    (src / "small").write_bytes(b"0123456789")  # restored: the same bytes are fine again
    assert snap.read_chunk(small.chunks[0]) == b"0123456789"
    (src / "small").write_bytes(b"9876543210")  # rewritten, same length
    with pytest.raises(SourceChanged):
        snap.read_chunk(small.chunks[0])


async def test_scan_of_a_non_directory_raises(tmp_path):
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(NotADirectoryError):
        await scan(tmp_path / "file", chunk_size=SMALL)
    with pytest.raises(FileNotFoundError):
        await scan(tmp_path / "absent", chunk_size=SMALL)


async def test_scan_refuses_a_chunk_size_below_the_minimum(tmp_path):
    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(ManifestError):
        await scan(tmp_path, chunk_size=SMALL - 1)


async def test_scan_of_an_empty_directory(tmp_path):
    snap = await scan(tmp_path, chunk_size=SMALL)
    assert [e.path for e in snap.manifest] == [b""]
    assert snap.sources == {} and snap.manifest.chunk_ids() == []


# --------------------------------------------------------------------------------------------
# chunk_cache.py


async def cget(cache: ChunkCache, key: bytes) -> bytes:
    with trio.fail_after(5):  # a broken cache fails the test rather than hanging it
        return await cache.get(key)


class Loader:
    """A load function that counts its calls and can be held until released."""

    def __init__(self, size: int = 10, hold: bool = False):
        self.calls: list[bytes] = []
        self.size = size
        self.started = threading.Event()
        self.release = threading.Event()
        if not hold:
            self.release.set()

    def __call__(self, cid_: bytes) -> bytes:
        self.calls.append(cid_)
        self.started.set()
        assert self.release.wait(5), "never released"
        return cid_[:1] * self.size


async def test_concurrent_gets_of_one_chunk_share_one_load():
    load = Loader(hold=True)
    cache = ChunkCache(load)
    results = []

    async def reader():
        results.append(await cget(cache, b"A"))

    async with trio.open_nursery() as nursery:
        for _ in range(20):
            nursery.start_soon(reader)
        try:
            with trio.fail_after(5):
                while not load.started.is_set():  # the load is running in its thread...
                    await trio.sleep(0.001)
            await trio.testing.wait_all_tasks_blocked()
            await trio.sleep(0.05)  # ...and every reader has had time to ask for the chunk
            assert load.calls == [b"A"]  # every other reader is waiting on the one load
        finally:
            load.release.set()
    assert results == [b"A" * 10] * 20
    assert load.calls == [b"A"]
    assert cache.misses == 1 and cache.hits == 19
    assert await cget(cache, b"A") == b"A" * 10 and load.calls == [b"A"]


async def test_distinct_chunks_load_independently():
    load = Loader()
    cache = ChunkCache(load)
    async with trio.open_nursery() as nursery:
        for k in (b"A", b"B", b"C"):
            nursery.start_soon(cget, cache, k)
    assert sorted(load.calls) == [b"A", b"B", b"C"]


async def test_eviction_bounds_cached_bytes_least_recently_used_first():
    load = Loader(size=40)
    cache = ChunkCache(load, max_bytes=100)  # room for two 40-byte chunks
    await cget(cache, b"A")
    await cget(cache, b"B")
    await cget(cache, b"A")  # A is now the most recently used
    await cget(cache, b"C")  # over the bound: B goes
    assert load.calls == [b"A", b"B", b"C"]
    await cget(cache, b"A")
    await cget(cache, b"C")
    assert load.calls == [b"A", b"B", b"C"]
    await cget(cache, b"B")
    assert load.calls == [b"A", b"B", b"C", b"B"]

    # However many chunks pass through, at most two stay cached.
    for k in b"DEFGHIJK":
        await cget(cache, bytes([k]))
    before = len(load.calls)
    for k in b"DEFGHIJK":
        await cget(cache, bytes([k]))
    assert len(load.calls) - before >= 6


async def test_a_chunk_larger_than_the_cache_is_still_served():
    load = Loader(size=1000)
    cache = ChunkCache(load, max_bytes=100)
    assert await cget(cache, b"A") == b"A" * 1000
    assert await cget(cache, b"B") == b"B" * 1000
    assert await cget(cache, b"A") == b"A" * 1000
    assert load.calls == [b"A", b"B", b"A"]


async def test_a_failed_load_is_raised_and_not_cached():
    attempts = []

    def load(c: bytes) -> bytes:
        attempts.append(c)
        if len(attempts) == 1:
            raise CorruptChunk("damaged")
        return b"fine"

    cache = ChunkCache(load)
    with pytest.raises(CorruptChunk):
        await cget(cache, b"A")
    assert await cget(cache, b"A") == b"fine"
    assert attempts == [b"A", b"A"]


async def test_a_miss_found_in_memory_needs_no_load():
    load = Loader()
    cache = ChunkCache(load, load_cached=lambda c: b"mem" if c == b"A" else None)
    assert await cget(cache, b"A") == b"mem" and await cget(cache, b"B") == b"B" * 10
    assert load.calls == [b"B"]
    assert (cache.misses, cache.nowait, cache.hits) == (2, 1, 0)
    assert await cget(cache, b"A") == b"mem" and cache.hits == 1  # kept like any load


async def test_cache_over_a_real_store(tmp_path):
    s = Store(tmp_path / "store")
    data = b"real bytes " * 5000
    c = s.put(data)
    cache = ChunkCache(s.get)
    assert await cget(cache, c) == data
    path, off, _ = s.locate(c)
    _flip(path, off + 1, 0x01)
    assert await cget(cache, c) == data  # served from the cache, already verified
    other = s.put(b"other " * 500)
    path, off, length = s.locate(other)
    _flip(path, off + length - 1, 0x01)
    with pytest.raises(CorruptChunk):
        await cget(cache, other)


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
