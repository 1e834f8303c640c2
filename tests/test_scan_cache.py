"""The scan cache: an unchanged file is never read again, a one-file edit hashes one file, and
nothing the cache holds can make a push send wrong bytes.

What "not read" means here is observed from outside the scan: the kernel's inotify IN_OPEN
events on every folder of the tree list each file the scan opened. The scan's own counters are
checked too, but they are not the evidence. Through the command line and a cluster:
test_scan_cache_cli.py."""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers import SMALL
from monarch_fs.fs.chunk import CHUNK_SIZE, chunk_id
from monarch_fs.fs.manifest import Kind
from monarch_fs.fs.rescan import rescan
from monarch_fs.fs.scan import scan
from monarch_fs.fs.scan_cache import (
    FOLDERS,
    RACY_NS,
    ScanCache,
    _prune,
    cache_file,
    stat_key,
)
from monarch_fs.fs.snapshot import SourceChanged
from scan_sources import RACY, make_tree, past_racy_window


def content(snap, rel: str) -> bytes:
    e = snap.manifest.get(os.fsencode(rel))
    return b"".join(snap.read_chunk(c) for c in e.chunks)


async def fresh(src: Path) -> bytes:
    """The manifest a scan without any cache gives: what every cached scan must equal."""
    return (await scan(src, chunk_size=SMALL)).manifest.id


async def cached_scan(src: Path, cache_dir: Path, racy_ns: int = RACY, **kw):
    cache = ScanCache.for_folder(cache_dir, src, racy_ns=racy_ns)  # loaded from disk each time
    return await scan(src, chunk_size=SMALL, cache=cache, **kw), cache


@pytest.fixture
def src(tmp_path):
    d = tmp_path / "src"
    d.mkdir()
    return d


async def test_unchanged_tree_is_not_read_again(src, tmp_path, opens):
    files = make_tree(src)
    past_racy_window(src)
    seen = opens(src)
    first, _ = await cached_scan(src, tmp_path / "cache")
    # Every distinct inode was read once (the hard link is the same inode).
    assert seen.files() == sorted(set(files) - {"pkg0/big-hardlink.bin"})
    assert first.cached_files == 0 and first.hashed_files == len(files) - 1

    reports = []
    second, cache = await cached_scan(src, tmp_path / "cache",
                                      progress=lambda done, total: reports.append((done, total)))
    assert seen.files() == []  # not one file opened
    assert second.hashed_files == 0 and second.hashed_bytes == 0
    assert second.cached_files == len(files) and cache.hits == len(files)
    assert reports == [(0, 0)]
    assert second.manifest.id == first.manifest.id == await fresh(src)
    # The cached sources point at the right bytes (reading them is the push's check).
    for rel, data in files.items():
        assert content(second, rel) == data, rel


async def test_a_one_file_edit_hashes_exactly_that_file(src, tmp_path, opens):
    files = make_tree(src)
    past_racy_window(src)
    await cached_scan(src, tmp_path / "cache")
    seen = opens(src)
    (src / "pkg1" / "mod4.py").write_bytes(b"edited = True\n")
    (src / "pkg2" / "new.py").write_bytes(b"new file\n")
    seen.files()
    snap, _ = await cached_scan(src, tmp_path / "cache")
    assert seen.files() == ["pkg1/mod4.py", "pkg2/new.py"]
    assert snap.hashed_files == 2 and snap.cached_files == len(files) - 1
    assert snap.manifest.id == await fresh(src)
    assert content(snap, "pkg1/mod4.py") == b"edited = True\n"


async def test_a_chunk_of_an_edited_file_is_read_from_an_unread_file_that_still_holds_it(
        src, tmp_path):
    """dup1 and dup2 hold the same bytes, and a scan with the cache read neither: where their
    chunk is read from is found when a push asks. Once dup1 is edited, a rescan (push --watch)
    finds that chunk in dup2, which still holds it."""
    files = make_tree(src)
    past_racy_window(src)
    await cached_scan(src, tmp_path / "cache")
    snap, _ = await cached_scan(src, tmp_path / "cache")
    assert snap.hashed_files == 0
    old = snap.manifest.get(b"dup1").chunks[0]
    assert snap.sources[old].unread and snap.read_chunk(old) == files["dup1"]
    (src / "dup1").write_bytes(b"dup1 edited")
    again = await rescan(snap, [b"dup1"], chunk_size=SMALL)
    assert again.manifest.id == await fresh(src)
    assert again.sources[old].path == os.path.join(os.fsencode(src), b"dup2")
    assert again.read_chunk(old) == files["dup2"]
    assert content(again, "dup1") == b"dup1 edited"
    assert not again.sources[again.manifest.get(b"dup1").chunks[0]].unread  # read: hashed


async def test_same_size_same_mtime_rewrite_is_caught_by_ctime(src, tmp_path, opens):
    """The honest limit: size and mtime can be put back (os.utime, `touch -d`, tar, rsync -t),
    ctime cannot. The rewritten file's ctime moved, so it is read again."""
    make_tree(src)
    past_racy_window(src)
    await cached_scan(src, tmp_path / "cache")
    path = src / "pkg0" / "mod3.py"
    before = os.stat(path)
    new = bytes(b ^ 1 for b in path.read_bytes())  # same length, different bytes
    path.write_bytes(new)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
        before.st_ino, before.st_size, before.st_mtime_ns)
    assert after.st_ctime_ns != before.st_ctime_ns
    seen = opens(src)
    snap, _ = await cached_scan(src, tmp_path / "cache")
    assert seen.files() == ["pkg0/mod3.py"]
    assert content(snap, "pkg0/mod3.py") == new
    assert snap.manifest.id == await fresh(src)


async def test_deleted_and_renamed_files(src, tmp_path, opens):
    files = make_tree(src)
    past_racy_window(src)
    await cached_scan(src, tmp_path / "cache")
    os.unlink(src / "pkg2" / "mod5.py")
    os.unlink(src / "pkg0" / "big-hardlink.bin")
    os.rename(src / "pkg1" / "mod7.py", src / "pkg2" / "moved.py")
    seen = opens(src)
    snap, cache = await cached_scan(src, tmp_path / "cache")
    renamed_read = seen.files()
    # Unlinking big.bin's second name changed its link count, so its ctime: it is read again.
    # The renamed file keeps its inode: read again only if the rename moved its ctime.
    assert "big.bin" in renamed_read and set(renamed_read) <= {"big.bin", "pkg2/moved.py"}
    paths = {e.path for e in snap.manifest}
    assert b"pkg2/mod5.py" not in paths and b"pkg1/mod7.py" not in paths
    assert content(snap, "pkg2/moved.py") == files["pkg1/mod7.py"]
    assert snap.manifest.id == await fresh(src)
    # The files read again are recorded once past the racy window, and that write drops the
    # deleted file's entry: one entry per inode left.
    past_racy_window(src)
    again, cache = await cached_scan(src, tmp_path / "cache")
    assert again.hashed_files == len(renamed_read)
    last, cache = await cached_scan(src, tmp_path / "cache")
    inodes = {os.stat(src / os.fsdecode(e.path)).st_ino for e in snap.manifest
              if e.kind == Kind.FILE}
    assert cache.loaded == len(inodes) and last.hashed_files == 0


def saved_cache(tmp_path: Path, n: int) -> tuple[Path, ScanCache, list[SimpleNamespace]]:
    """A cache file of `n` recorded files (their stats: SimpleNamespace), written."""
    path = tmp_path / "cache" / "c"
    cache = ScanCache(path, tmp_path)
    cache.begin(CHUNK_SIZE, started_ns=time.time_ns() + 10**12)
    stats = [SimpleNamespace(st_dev=7, st_ino=1000 + i, st_size=10, st_mtime_ns=5,
                             st_ctime_ns=5) for i in range(n)]
    for st in stats:
        cache.record(stat_key(st), [chunk_id(b"%d" % st.st_ino)])
    assert cache.save()
    return path, cache, stats


def test_a_scan_that_records_nothing_rewrites_only_for_many_unused_entries(tmp_path):
    """A file just edited is not recorded (racily clean), and its old entry goes unused: not
    worth rewriting 15k entries at every push of an edit. Past an eighth unused, it is."""
    path, cache, stats = saved_cache(tmp_path, 80)

    def scan_seeing(n: int) -> bool:
        cache.begin(CHUNK_SIZE)
        for st in stats[:n]:
            assert cache.lookup(st) is not None
        return cache.save()

    assert not scan_seeing(79) and not scan_seeing(71)  # 1 and 9 unused: kept
    assert scan_seeing(69)  # 11 of 80 unused: rewritten without them
    assert cache.loaded == 80
    cache.begin(CHUNK_SIZE)
    assert cache.loaded == 69


@pytest.mark.parametrize("damage", ["empty", "truncated", "flipped", "garbage", "directory",
                                    "other-folder"])
async def test_a_corrupt_cache_file_is_ignored(src, tmp_path, damage, opens):
    files = make_tree(src)
    past_racy_window(src)
    await cached_scan(src, tmp_path / "cache")
    path = Path(cache_file(tmp_path / "cache", src))
    data = path.read_bytes()
    if damage == "empty":
        path.write_bytes(b"")
    elif damage == "truncated":
        path.write_bytes(data[:len(data) // 2])
    elif damage == "flipped":
        path.write_bytes(data[:-20] + bytes([data[-20] ^ 0x10]) + data[-19:])
    elif damage == "garbage":
        path.write_bytes(os.urandom(len(data)))
    elif damage == "directory":
        path.unlink()
        path.mkdir()
    elif damage == "other-folder":  # a valid cache of another folder at this name
        other = tmp_path / "other"
        other.mkdir()
        (other / "f").write_bytes(b"other")
        past_racy_window(other)
        await cached_scan(other, tmp_path / "cache")
        path.write_bytes(Path(cache_file(tmp_path / "cache", other)).read_bytes())
    seen = opens(src)
    snap, cache = await cached_scan(src, tmp_path / "cache")
    assert cache.loaded == 0 and snap.cached_files == 0
    assert len(seen.files()) == len(files) - 1  # everything read again
    assert snap.manifest.id == await fresh(src)
    if damage != "directory":  # rewritten whole: the next scan trusts it again
        seen.files()
        again, _ = await cached_scan(src, tmp_path / "cache")
        assert seen.files() == [] and again.cached_files == len(files)


async def test_a_cache_of_another_chunk_size_is_not_used(src, tmp_path, opens):
    files = make_tree(src)
    past_racy_window(src)
    await cached_scan(src, tmp_path / "cache")
    seen = opens(src)
    cache = ScanCache.for_folder(tmp_path / "cache", src, racy_ns=RACY)
    snap = await scan(src, chunk_size=2 * SMALL, cache=cache)
    assert cache.loaded == 0 and len(seen.files()) == len(files) - 1
    assert len(snap.manifest.get(b"big.bin").chunks) == 2
    assert snap.manifest.id == (await scan(src, chunk_size=2 * SMALL)).manifest.id


@pytest.mark.slow
async def test_racily_clean_files_are_hashed_again(src, tmp_path, opens):
    """With the default window (2 s): a file changed just before the scan is not cached, since
    a second write within its timestamp granularity could leave the key as it is. It is read
    again by the next scan, and cached once it is older than the window."""
    (src / "old").write_bytes(b"old")
    cache = ScanCache.for_folder(tmp_path / "cache", src)
    assert cache.racy_ns == RACY_NS == 2_000_000_000
    await scan(src, chunk_size=SMALL, cache=cache)
    assert cache.stored == 0  # "old" is 0 s old: racy
    past_racy_window(src, RACY_NS)
    (src / "fresh").write_bytes(b"fresh")
    seen = opens(src)
    first = await scan(src, chunk_size=SMALL, cache=ScanCache.for_folder(tmp_path / "cache", src))
    assert seen.files() == ["fresh", "old"] and first.hashed_files == 2
    second = await scan(src, chunk_size=SMALL,
                        cache=ScanCache.for_folder(tmp_path / "cache", src))
    assert seen.files() == ["fresh"]  # racy last time: read again; "old" is trusted
    assert second.cached_files == 1 and content(second, "fresh") == b"fresh"


async def test_a_stale_entry_is_a_clear_source_changed_and_clears_the_cache(src, tmp_path,
                                                                            opens):
    """A file changed behind the file system's back (its key unchanged) cannot be seen by the
    scan; the push's read check catches it, names the cause, and drops the cache so the next
    push is right. The stale entry is planted through the cache's own API."""
    files = make_tree(src)
    past_racy_window(src)
    await cached_scan(src, tmp_path / "cache")
    target = src / "pkg1" / "mod1.py"
    planted = ScanCache.for_folder(tmp_path / "cache", src, racy_ns=RACY)
    planted.begin(SMALL)
    for rel in files:  # keep every real entry...
        planted.lookup(os.stat(src / rel))
    planted.record(stat_key(os.stat(target)), [chunk_id(b"not what the file holds")])  # ...but one
    planted.save()

    seen = opens(src)
    snap, _ = await cached_scan(src, tmp_path / "cache")
    assert seen.files() == []  # the key matched: trusted without reading
    wrong = snap.manifest.get(b"pkg1/mod1.py").chunks[0]
    assert wrong == chunk_id(b"not what the file holds")
    with pytest.raises(SourceChanged, match="scan cache") as e:
        snap.read_chunk(wrong)
    assert "mod1.py" in str(e.value) and "push again" in str(e.value)
    assert not Path(cache_file(tmp_path / "cache", src)).exists()
    again, _ = await cached_scan(src, tmp_path / "cache")
    assert content(again, "pkg1/mod1.py") == files["pkg1/mod1.py"]
    assert again.manifest.id == await fresh(src)


async def test_a_file_edited_after_the_scan_is_still_changed_during_the_push(src, tmp_path):
    make_tree(src)
    past_racy_window(src)
    await cached_scan(src, tmp_path / "cache")
    snap, _ = await cached_scan(src, tmp_path / "cache")
    (src / "pkg0" / "mod0.py").write_bytes(b"edited after the scan")
    with pytest.raises(SourceChanged, match="changed during the push"):
        snap.read_chunk(snap.manifest.get(b"pkg0/mod0.py").chunks[0])
    assert Path(cache_file(tmp_path / "cache", src)).exists()  # the cache was right: kept


def test_saving_and_loading_15000_entries_round_trips(tmp_path):
    """Its speed is measured by bench/push_bench.py (the re-push cases), not timed here: a
    timed unit test fails on a loaded machine."""
    folder = tmp_path / "big"
    cache = ScanCache.for_folder(tmp_path / "cache", folder)
    cache.begin(CHUNK_SIZE, started_ns=time.time_ns() + 10**12)
    for i in range(15_000):
        size = 1000 + i if i % 100 else 9 * CHUNK_SIZE + i  # a few multi-chunk files
        ids = [chunk_id(b"%d-%d" % (i, k)) for k in range(-(-size // CHUNK_SIZE))]
        cache.record((2049, 1_000_000 + i, size, 1_700_000_000_000_000_000 + i,
                      1_700_000_000_000_000_000 + i), ids)
    assert cache.save()
    loader = ScanCache.for_folder(tmp_path / "cache", folder)
    loader.begin(CHUNK_SIZE)
    assert loader.loaded == 15_000
    assert loader._old == cache._old


def test_least_recently_used_cache_files_are_pruned(tmp_path):
    for i in range(6):
        (tmp_path / f"c{i}").write_bytes(b"x")
        (tmp_path / f"c{i}{FOLDERS}").write_bytes(b"x")  # its folder facts go with it
        os.utime(tmp_path / f"c{i}", ns=(i * 10**9, i * 10**9))
    _prune(str(tmp_path), keep=4)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        n for i in range(2, 6) for n in (f"c{i}", f"c{i}{FOLDERS}")]


@pytest.mark.parametrize("damage", ["truncated", "flipped", "directory"])
async def test_folder_facts_are_kept_and_a_damaged_file_of_them_is_ignored(src, tmp_path,
                                                                          damage):
    """A scan keeps the ids of the folder objects it validated beside the cache; the next one
    checks only folders not among them. Damaged, they are ignored: everything is checked."""
    make_tree(src)
    past_racy_window(src)
    snap, _ = await cached_scan(src, tmp_path / "cache")
    _, cache = await cached_scan(src, tmp_path / "cache")
    assert cache.checked == set(snap.manifest.object_ids())
    (src / "pkg1" / "new.py").write_bytes(b"y = 1\n")
    edited, cache = await cached_scan(src, tmp_path / "cache")
    assert len(set(edited.manifest.object_ids()) - set(snap.manifest.object_ids())) == 2
    assert cache.checked == set(edited.manifest.object_ids())  # the last scan's only
    facts = Path(cache_file(tmp_path / "cache", src) + FOLDERS)
    data = facts.read_bytes()
    if damage == "truncated":
        facts.write_bytes(data[:len(data) // 2])
    elif damage == "flipped":
        facts.write_bytes(data[:-3] + bytes([data[-3] ^ 1]) + data[-2:])
    else:
        facts.unlink()
        facts.mkdir()
    loader = ScanCache.for_folder(tmp_path / "cache", src)
    loader.begin(SMALL)
    assert loader.checked == set()
    again, _ = await cached_scan(src, tmp_path / "cache")
    assert again.manifest.id == edited.manifest.id == await fresh(src)
    if damage != "directory":  # written again whole
        loader = ScanCache.for_folder(tmp_path / "cache", src)
        loader.begin(SMALL)
        assert loader.checked == set(again.manifest.object_ids())


def test_a_cache_file_is_read_again_only_when_another_wrote_it(tmp_path, opens):
    """push --watch's whole-scan checks begin a scan every few seconds: while the file is the
    one this cache last read or wrote, it is not read and decoded again (96 ms and 300k objects
    at 100k files). Once another process replaced it, it is, and says what that one wrote."""
    path, cache, stats = saved_cache(tmp_path, 10)
    seen = opens(path.parent)
    for _ in range(3):
        cache.begin(CHUNK_SIZE)
        assert all(cache.lookup(st) is not None for st in stats)
        cache.save()
    assert seen.files() == []  # not opened once
    assert cache.loaded == 10

    other = ScanCache(path, tmp_path)  # another push of the folder records one more file
    other.begin(CHUNK_SIZE, started_ns=time.time_ns() + 10**12)
    new = SimpleNamespace(st_dev=7, st_ino=5000, st_size=10, st_mtime_ns=5, st_ctime_ns=5)
    other.record(stat_key(new), [chunk_id(b"new")])
    assert other.save()
    seen.files()
    cache.begin(CHUNK_SIZE)
    assert seen.files() == ["c"] and cache.loaded == 1
    assert cache.lookup(new) is not None and cache.lookup(stats[0]) is None
