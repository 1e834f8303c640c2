"""fs/scan.py: scanning a real folder into a snapshot (every entry kind, chunking, hard links,
dedup, skipped special files, excludes, sources that change after the scan)."""

from __future__ import annotations

import gc
import os
import socket
import stat
import threading
import time
import weakref
from pathlib import Path

import pytest

from helpers import SMALL
from monarch_fs.fs.chunk import chunk_id, spans
from monarch_fs.fs.manifest import Entry, Kind, Manifest, ManifestError
from monarch_fs.fs.rescan import rescan
from monarch_fs.fs.scan import ScanStopped, scan
from monarch_fs.fs.scan_cache import ScanCache
from monarch_fs.fs.snapshot import Snapshot, SourceChanged


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
    assert Manifest.load(m.id, m.objects().__getitem__).entries == m.entries


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
    assert first.manifest.id == second.manifest.id
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


def change_second_chunk(snap, path, entry, data: bytes, size: int) -> None:
    """One byte of `path`'s second chunk changed, same size: its first chunk still reads, the
    second is refused as changed."""
    with open(path, "r+b") as f:
        f.seek(size + 100)
        f.write(bytes([data[size + 100] ^ 1]))
    assert snap.read_chunk(entry.chunks[0]) == data[:size]
    with pytest.raises(SourceChanged):
        snap.read_chunk(entry.chunks[1])


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

    change_second_chunk(snap, src / "big", big, data, SMALL)

    (src / "small").write_bytes(b"01234")  # truncated
    with pytest.raises(SourceChanged):
        snap.read_chunk(small.chunks[0])
    (src / "small").write_bytes(b"0123456789")  # restored: the same bytes are fine again
    assert snap.read_chunk(small.chunks[0]) == b"0123456789"
    (src / "small").write_bytes(b"9876543210")  # rewritten, same length
    with pytest.raises(SourceChanged):
        snap.read_chunk(small.chunks[0])


async def test_a_large_chunk_the_scan_read_is_sent_without_a_second_hash_unless_it_changed(
        tmp_path, monkeypatch):
    """One hash per byte on the dev box: a large chunk of a file the scan read whole, read
    again under the same stat key, is not hashed again (its bytes are those the scan hashed);
    once the file is written, the key moves and the read is checked against the id."""
    import monarch_fs.fs.scan as scan_module
    import monarch_fs.fs.snapshot as snapshot_module

    monkeypatch.setattr(scan_module, "RACY_NS", 0)  # (the file was written a moment ago)
    size = 4 * SMALL  # chunks of snapshot.TRUST_FROM bytes
    data = os.urandom(3 * size)
    (tmp_path / "big").write_bytes(data)
    time.sleep(0.05)  # past the timestamp granularity: the write below moves the key
    snap = await scan(tmp_path, chunk_size=size)
    big = snap.manifest.get(b"big")
    hashed: list[int] = []
    monkeypatch.setattr(snapshot_module, "chunk_id",
                        lambda b: hashed.append(len(b)) or chunk_id(b))
    assert file_bytes(snap, big) == data
    assert hashed == []

    change_second_chunk(snap, tmp_path / "big", big, data, size)
    assert len(hashed) == 2


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



async def test_a_scan_stops_between_folders_once_asked_and_the_next_one_is_whole(tmp_path):
    """push --watch's whole-scan check gives way to an edit: `stop`, set from the watcher's
    thread while the walk runs, ends it with ScanStopped; its cache is left usable."""
    root = tmp_path / "src"
    for i in range(200):
        (root / f"d{i:03}").mkdir(parents=True)
        (root / f"d{i:03}" / "f").write_bytes(b"%d" % i)
    cache = ScanCache(tmp_path / "cache", root)
    first = await scan(root, chunk_size=SMALL, cache=cache)
    stop = threading.Event()
    listed = 0
    real = os.scandir

    def counting(path):
        nonlocal listed
        listed += 1
        if listed == 50:
            stop.set()
        return real(path)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "scandir", counting)
        with pytest.raises(ScanStopped) as stopped:
            await scan(root, chunk_size=SMALL, cache=cache, stop=stop)
    assert listed == 50  # not one folder more
    # What the walk found goes with the exception, for the catcher to drop when it suits it
    # (the watch: after the push that stopped it). The frames, a reference cycle, do not hold
    # it: it is freed with its last reference, not left to the collector.
    found = stopped.value.found
    assert len(found.entries) > 50
    stopped.value.found = None
    gc.disable()
    try:
        gone = weakref.ref(found)
        del found
        assert gone() is None
    finally:
        gc.enable()
    again = await scan(root, chunk_size=SMALL, cache=cache)
    assert again.manifest.id == first.manifest.id


async def test_scan_of_an_empty_directory(tmp_path):
    snap = await scan(tmp_path, chunk_size=SMALL)
    assert [e.path for e in snap.manifest] == [b""]
    assert snap.sources == {} and snap.manifest.chunk_ids() == []


# ---- rescan: a watcher's changed paths, not the whole tree --------------------------------

async def rescanned(root: Path, prev: Snapshot, *changed: str, excludes=()) -> Snapshot:
    """rescan() after `changed`, checked against a whole scan of the same tree: the same
    manifest (so the same version), and every chunk readable from the sources it names."""
    again = await rescan(prev, [os.fsencode(c) for c in changed], excludes, chunk_size=SMALL)
    whole = await scan(root, excludes, chunk_size=SMALL)
    assert [e.path for e in again.manifest] == [e.path for e in whole.manifest]
    assert again.manifest.id == whole.manifest.id
    assert again.manifest.objects() == whole.manifest.objects()
    assert sorted(again.manifest.chunk_ids()) == sorted(whole.manifest.chunk_ids())
    assert again.chunk_refs() == whole.chunk_refs()  # counted from the change, not the tree
    assert again.manifest.totals == Manifest(whole.manifest.entries).file_totals()
    assert set(again.sources) == set(whole.sources)  # no source of a chunk nothing holds
    for e in again.manifest:
        if e.kind == Kind.FILE:
            assert file_bytes(again, e) == file_bytes(whole, e)
    return again


async def test_rescan_of_a_watchers_paths_gives_the_whole_scans_snapshot(tmp_path):
    root = tmp_path / "src"
    make_tree(root)
    snap = await scan(root, ("*.skip",), chunk_size=SMALL)
    skip = ("*.skip",)

    (root / "pkg" / "__init__.py").write_bytes(b"VALUE = 2\n")  # edited in place
    snap = await rescanned(root, snap, "pkg/__init__.py", excludes=skip)
    (root / "new" / "deep" / "er").mkdir(parents=True)  # a new subtree, only its leaf told
    (root / "new" / "deep" / "er" / "f.py").write_bytes(b"new")
    (root / "new" / "x.skip").write_bytes(b"excluded")
    snap = await rescanned(root, snap, "new/deep/er/f.py", "new/x.skip", excludes=skip)
    os.rename(root / "pkg", root / "pkg2")  # a folder moved: both its names are told
    snap = await rescanned(root, snap, "pkg", "pkg2", excludes=skip)
    (root / "text.txt").unlink()  # the copy the sources read; its hard link holds the bytes
    snap = await rescanned(root, snap, "text.txt", excludes=skip)
    (root / "empty-dir").rmdir()
    (root / "empty-dir").write_bytes(b"a file where a folder was")
    odd = os.fsdecode(b"dir-\xff")  # a folder named in Latin-1
    (root / odd).chmod(0o700)
    os.unlink(root / "rel-link")
    os.symlink("elsewhere", root / "rel-link")
    snap = await rescanned(root, snap, "empty-dir", odd, "rel-link", excludes=skip)
    for p in (root / "pkg2" / "sub").iterdir():  # a folder replaced by a link to another
        p.unlink()
    (root / "pkg2" / "sub").rmdir()
    os.symlink("../pkg2", root / "pkg2" / "sub")
    snap = await rescanned(root, snap, "pkg2/sub", "pkg2/sub/data.bin", excludes=skip)
    for p in sorted((root / "new").rglob("*"), reverse=True):  # a subtree removed
        p.rmdir() if p.is_dir() else p.unlink()
    (root / "new").rmdir()
    await rescanned(root, snap, "new/deep/er/f.py", "new/deep/er", "new/deep", "new/x.skip",
                    "new", excludes=skip)


async def test_rescan_lists_only_the_folders_that_hold_changes(tmp_path, monkeypatch):
    root = tmp_path / "src"
    for i in range(20):
        (root / f"d{i}").mkdir(parents=True)
        (root / f"d{i}" / "f").write_bytes(b"%d" % i)
    snap = await scan(root, chunk_size=SMALL)
    listed = []
    real = os.scandir
    monkeypatch.setattr(os, "scandir", lambda p: listed.append(os.fsencode(p)) or real(p))
    (root / "d7" / "f").write_bytes(b"edited")
    again = await rescan(snap, [b"d7/f"], chunk_size=SMALL)
    assert listed == [os.fsencode(root / "d7")]
    assert file_bytes(again, again.manifest.get(b"d7/f")) == b"edited"


def test_a_file_that_grew_after_the_walk_is_read_whole_and_not_trusted(tmp_path):
    """A small file is read once, up to the size the walk saw (no read that only finds its
    end): one that grew since is still read to its end, and not taken as unchanged."""
    from monarch_fs.fs.scan import _File, _hash_file
    from monarch_fs.fs.scan_cache import stat_key

    p = tmp_path / "f"
    p.write_bytes(b"a" * 100)
    st = os.stat(p)
    walked = _File(b"f", bytes(p), st.st_mode, stat_key(st))
    buf = memoryview(bytearray(4 << 20))
    size, chunks, unchanged = _hash_file(walked, buf)
    assert (size, [c for c, _ in chunks], unchanged) == (100, [chunk_id(b"a" * 100)], True)
    with open(p, "ab") as f:
        f.write(b"b" * 50)
    size, chunks, unchanged = _hash_file(walked, buf)
    assert size == 150 and [c for c, _ in chunks] == [chunk_id(b"a" * 100 + b"b" * 50)]
    assert not unchanged


class _HeldSink:
    """A tap's sink that holds its file until `release` is set (a link too slow to take more)."""

    def __init__(self, release: threading.Event) -> None:
        self.release = release

    def buffer(self, size: int) -> memoryview:
        if not self.release.wait(timeout=20):
            raise TimeoutError("the small files were never hashed")
        return memoryview(bytearray(size))

    def chunk(self, cid: bytes, buf: memoryview, length: int) -> None:
        pass

    def done(self, unchanged: bool) -> None:
        pass


async def test_small_files_are_hashed_while_large_files_wait_on_their_link(tmp_path):
    # A push streams a large file as it is hashed, so its hashing waits on the link; the small
    # files' hashing must go on meanwhile (an env's .so files beside its venv), even with more
    # large files than the scan has workers.
    large = [tmp_path / f"lib{i}.so" for i in range((os.cpu_count() or 2) + 1)]
    for path in large:
        with open(path, "wb") as f:
            f.truncate(8 << 20)
    (tmp_path / "pkg").mkdir()
    for i in range(600):
        (tmp_path / "pkg" / f"m{i}.py").write_bytes(b"x = %d\n" % i)
    small_bytes = sum(p.stat().st_size for p in (tmp_path / "pkg").iterdir())
    release = threading.Event()
    hashed_before_release = []

    def progress(done: int, total: int) -> None:
        if done >= small_bytes and not release.is_set():
            hashed_before_release.append(done)
            release.set()

    snap = await scan(tmp_path, progress=progress,
                      tap=lambda path, size: _HeldSink(release) if size >= 8 << 20 else None)
    assert hashed_before_release == [small_bytes]  # every small file, and no large one yet
    assert len(snap.manifest) == 1 + len(large) + 1 + 600
