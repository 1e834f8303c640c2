"""What a manifest refuses, from a peer that may be hostile: unsafe names and paths, missing or
wrong parents and roots, duplicates, malformed entries and fields past what the kernel takes,
truncated or malformed folder objects, absurd counts (failing fast, without allocating), and,
fuzzed, any bytes at all: only a ManifestError, never another exception. A valid manifest's
round trip, layout and edits: test_manifest.py."""

from __future__ import annotations

import struct
import subprocess
import sys
import tracemalloc

import pytest
from hypothesis import given
from hypothesis import strategies as st

from helpers import FOLDER_HEAD, FOLDER_MAGIC, FUZZ, SMALL, folder_object
from manifest_objects import ROOT, cid, load, raw_tree, sample_manifest
from monarch_fs.fs.chunk import CHUNK_SIZE, ID_SIZE, MAX_CHUNK_SIZE, chunk_id
from monarch_fs.fs.entry import MAX_NAME, MAX_PATH, UnsafePath, check_path
from monarch_fs.fs.manifest import (
    Entry,
    Kind,
    Manifest,
    ManifestError,
    MissingObject,
    TooManyEntries,
)

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


UNSAFE_NAMES = [b"", b".", b"..", b"a/b", b"/abs", b"../x", b"a\0b", b"x" * (MAX_NAME + 1)]


@pytest.mark.parametrize("name", UNSAFE_NAMES)
@pytest.mark.parametrize("depth", [0, 2])
def test_unsafe_names_are_refused_by_load_in_any_folder(name, depth):
    """A hostile peer's folder object, at the root or deeper, names a child that could
    escape the mount or that the kernel cannot take."""
    records = [(Kind.FILE, 0o644, 0, 0, name, b"", ())]
    objects: dict[bytes, bytes] = {}
    for _ in range(depth):
        inner = folder_object(records)
        objects[chunk_id(inner)] = inner
        records = [(Kind.DIR, 0, 0, 0, b"sub", b"", (chunk_id(inner),))]
    root = folder_object(records)
    objects[chunk_id(root)] = root
    with pytest.raises(ManifestError, match="unsafe path|duplicate"):
        load(objects)


def test_a_path_longer_than_the_kernel_takes_is_refused():
    """Every name is legal, but nesting makes the path longer than MAX_PATH."""
    name = b"d" * 200
    objects: dict[bytes, bytes] = {}
    records = [(Kind.FILE, 0o644, 0, 0, b"f", b"", ())]
    for _ in range(21):
        blob = folder_object(records)
        objects[chunk_id(blob)] = blob
        records = [(Kind.DIR, 0, 0, 0, name, b"", (chunk_id(blob),))]
    root = folder_object(records)
    objects[chunk_id(root)] = root
    with pytest.raises(UnsafePath, match="too long"):
        load(objects)


@pytest.mark.parametrize("path", UNSAFE_PATHS)
def test_unsafe_paths_are_refused_by_validate(path):
    entries = _with_parents(path)
    m = Manifest([Entry(p, Kind(k), mo, s, t, tg, c) for p, k, mo, s, t, tg, c in entries])
    with pytest.raises(UnsafePath):
        m.validate()


def test_unsafe_path_is_a_manifest_error_and_a_value_error():
    assert issubclass(UnsafePath, ManifestError) and issubclass(ManifestError, ValueError)


def _bad(entries, **kw) -> None:
    """validate() refuses `entries`, and so does load() of the folder objects a hostile peer
    would build from them (when they can be folder objects at all)."""
    chunk_size = kw.get("chunk_size", CHUNK_SIZE)
    for known in ((), {cid(999)}):  # the whole check, and the one that skips known folders
        with pytest.raises(ManifestError):
            Manifest([Entry(p, Kind(k), mo, s, t, tg, c) for p, k, mo, s, t, tg, c in entries],
                     chunk_size).validate(known)
    objects = raw_tree(entries, chunk_size)
    if objects is not None:
        with pytest.raises(ManifestError):
            load(objects)


def test_missing_or_wrong_parents_are_refused():
    _bad([ROOT, (b"a/b", Kind.FILE, 0o644, 0, 0, b"", ())])
    _bad([ROOT, (b"f", Kind.FILE, 0o644, 0, 0, b"", ()), (b"f/x", Kind.FILE, 0o644, 0, 0, b"", ())])
    _bad([ROOT, (b"l", Kind.SYMLINK, 0o777, 1, 0, b"d", ()),
          (b"l/x", Kind.FILE, 0o644, 0, 0, b"", ())])
    with pytest.raises(ManifestError, match="no parent"):  # nothing to be listed in
        Manifest([Entry(b"", Kind.DIR, 0o755, 0, 0), Entry(b"a/b", Kind.FILE, 0o644, 0, 0)]
                 ).objects()


def test_missing_or_wrong_root_is_refused():
    _bad([])
    _bad([(b"a", Kind.DIR, 0o755, 0, 0, b"", ())])
    _bad([(b"", Kind.FILE, 0o644, 0, 0, b"", ())])
    with pytest.raises(ManifestError, match="no root"):
        Manifest([Entry(b"a", Kind.DIR, 0o755, 0, 0)]).objects()


def test_duplicates_are_refused():
    f = (b"a", Kind.FILE, 0o644, 0, 0, b"", ())
    _bad([ROOT, f, f])
    _bad([ROOT, ROOT])
    _bad([ROOT, (b"a", Kind.DIR, 0o755, 0, 0, b"", ()), f])
    with pytest.raises(ManifestError, match=r"duplicate entry b'a'"):
        load(raw_tree([ROOT, f, f]))


@pytest.mark.parametrize("size,nchunks", [(1, 0), (0, 1), (CHUNK_SIZE + 1, 1),
                                          (CHUNK_SIZE, 2), (3 * CHUNK_SIZE, 4)])
def test_wrong_chunk_counts_are_refused(size, nchunks):
    _bad([ROOT, (b"f", Kind.FILE, 0o644, size, 0, b"", tuple(cid(i) for i in range(nchunks)))])


def test_right_chunk_counts_are_accepted():
    for size, n in [(0, 0), (1, 1), (SMALL, 1), (SMALL + 1, 2), (3 * SMALL, 3)]:
        objects = raw_tree([ROOT, (b"f", Kind.FILE, 0o644, size, 0, b"", tuple(
            cid(i) for i in range(n)))], SMALL)
        assert load(objects).get(b"f").size == size


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
            load(raw_tree([ROOT, (b"x", kind, 0o644, 0, 0, b"", ())]))


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
    for bad in (Entry(b"f", Kind.FILE, 0o644, 0, 2**63),
                Entry(b"f", Kind.FILE, 0o644, 0, -(2**63) - 1),
                Entry(b"f", Kind.FILE, -1, 0, 0), Entry(b"f", Kind.FILE, 0o644, -1, 0)):
        with pytest.raises(ManifestError, match="b'f'"):  # not encodable: validate() only
            Manifest([Entry(b"", Kind.DIR, 0o755, 0, 0), bad]).validate()
    with pytest.raises(ManifestError, match=r"directory b'd': size 18446744073709551615"):
        Manifest([Entry(b"", Kind.DIR, 0o755, 0, 0),
                  Entry(b"d", Kind.DIR, 0o755, 2**64 - 1, 0)]).validate()
    with pytest.raises(ManifestError, match=r"directory b'd': a folder's record"):
        load(raw_tree([ROOT, (b"d", Kind.DIR, 0o755, 2**64 - 1, 0, b"", ())]))


def test_fields_at_the_kernel_limits_are_accepted():
    m = load(raw_tree([
        (b"", Kind.DIR, 0o7777, 0, -(2**63), b"", ()),
        (b"l", Kind.SYMLINK, 0, 4095, 2**63 - 1, b"t" * 4095, ()),
        (b"n" * MAX_NAME, Kind.FILE, 0o7777, SMALL + 1, 0, b"", (cid(1), cid(2))),
    ], SMALL))
    assert [e.size for e in m] == [0, 4095, SMALL + 1]


def test_every_truncation_and_any_trailing_bytes_are_refused():
    objects = sample_manifest().objects()
    for oid, blob in objects.items():  # the root and a folder inside
        for n in range(len(blob)):
            with pytest.raises(ManifestError):
                load({**objects, oid: blob[:n]})
        with pytest.raises(ManifestError):
            load({**objects, oid: blob + b"\0"})


def test_bad_magic_is_refused():
    objects = sample_manifest().objects()
    for oid, blob in objects.items():
        for magic in (b"MFSD\x02", b"MFSM\x01", b"\0" * 5):
            with pytest.raises(ManifestError, match="magic"):
                load({**objects, oid: magic + blob[5:]})


def test_non_canonical_order_is_refused():
    a = (Kind.FILE, 0o644, 0, 0, b"a", b"", ())
    b = (Kind.FILE, 0o644, 0, 0, b"b", b"", ())

    def root(*records) -> dict[bytes, bytes]:
        blob = folder_object(list(records))
        return {chunk_id(blob): blob}

    assert [e.path for e in load(root(a, b))] == [b"", b"a", b"b"]
    with pytest.raises(ManifestError, match="order"):
        load(root(b, a))
    d = (b"d", Kind.DIR, 0o755, 0, 0, b"", ())
    dx = (b"d/x", Kind.FILE, 0o644, 0, 0, b"", ())
    dash = (b"d-", Kind.FILE, 0o644, 0, 0, b"", ())  # byte order would put it before d/x
    assert [e.path for e in load(raw_tree([ROOT, d, dx, dash]))] == [b"", b"d", b"d/x", b"d-"]
    with pytest.raises(ManifestError, match="order"):
        load(raw_tree([ROOT, dash, d, dx]))  # the root lists d- before d


def test_a_folder_of_another_chunk_size_is_refused():
    inner = folder_object([], chunk_size=SMALL)
    root = folder_object([(Kind.DIR, 0, 0, 0, b"d", b"", (chunk_id(inner),))])
    with pytest.raises(ManifestError, match="chunk size"):
        load({chunk_id(inner): inner, chunk_id(root): root})


_ABSURD = r"""
import resource, struct, sys, time, tracemalloc
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, resource.RLIM_INFINITY))
from monarch_fs.fs.chunk import chunk_id
from monarch_fs.fs.manifest import MAGIC, Kind, Manifest, ManifestError
HEAD, ENTRY, CS = struct.Struct("<5sIIqI"), struct.Struct("<BIQqHHI"), 4 << 20
def head(count):
    return HEAD.pack(MAGIC, CS, 0o755, 0, count)
cases = {
    "10M children in 20 bytes": head(10_000_000) + bytes(7),
    "4G children, no body": head(2**32 - 1),
    "4G chunk ids": head(1) + ENTRY.pack(Kind.FILE, 0o644, 0, 0, 1, 0, 2**32 - 1) + bytes(64),
    "64K name and target": head(1) + ENTRY.pack(Kind.FILE, 0o644, 0, 0, 65535, 65535, 0)
                           + bytes(64),
    "1000 records of 4G chunks": head(1000) + ENTRY.pack(Kind.FILE, 0o644, 2**64 - 1, 0, 0, 0,
                                                         2**32 - 1) * 1000,
}
for name, data in cases.items():
    tracemalloc.start()
    t = time.perf_counter()
    try:
        Manifest.load(chunk_id(data), lambda oid: data)
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
    """Headers and records that claim far more than the object holds fail at once, without
    allocating for the claim (in a child with a 1 GiB address-space limit and a timeout, so a
    regression fails the test instead of exhausting the machine)."""
    proc = subprocess.run([sys.executable, "-c", _ABSURD], capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 0, proc.stderr or proc.stdout


def test_a_tree_that_names_one_folder_many_times_stops_at_the_entry_limit():
    """Objects are content-addressed, so a hostile tree can name one folder many times: 100
    folders of 100 folders of 100 files is a million entries from three small objects. The
    entries are counted as they are made, and the load stops at the limit."""
    leaf = folder_object([(Kind.FILE, 0o644, 0, 0, b"f%03d" % i, b"", ()) for i in range(100)])
    mid = folder_object([(Kind.DIR, 0, 0, 0, b"m%03d" % i, b"", (chunk_id(leaf),))
                         for i in range(100)])
    root = folder_object([(Kind.DIR, 0, 0, 0, b"r%03d" % i, b"", (chunk_id(mid),))
                          for i in range(100)])
    objects = {chunk_id(b): b for b in (leaf, mid, root)}
    with pytest.raises(TooManyEntries, match="more than the limit of 50,000"):
        load(objects, max_entries=50_000)


def test_a_missing_object_is_named_with_its_folder():
    m = sample_manifest()
    objects = dict(m.objects())
    pkg = next(oid for oid, blob in objects.items() if b"__init__.py" in blob)
    del objects[pkg]
    with pytest.raises(MissingObject) as e:
        load(objects)
    assert e.value.oid == pkg and e.value.path == b"pkg" and isinstance(e.value, KeyError)


# Hypothesis: valid manifests, their objects, and arbitrary or mutated objects.

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


@pytest.mark.slow
@FUZZ
@given(manifests())
def test_fuzz_valid_manifests_round_trip(m):
    m.validate()
    back = load(m.objects())
    assert back.entries == m.entries and back.chunk_size == m.chunk_size
    assert back.objects() == m.objects() and back.id == m.id


def _load_only_manifest_errors(root: bytes, objects: dict[bytes, bytes]) -> None:
    """Load a tree whose root object is `root` (stored under the id it claims to have, as a
    store that did not check would): only a ManifestError, or a MissingObject for a folder it
    names that is not there. Whatever is accepted is canonical: it encodes back to `root`."""
    oid = chunk_id(b"claimed")
    try:
        m = Manifest.load(oid, {**objects, oid: root}.__getitem__)
    except (ManifestError, MissingObject):
        return
    again = Manifest(m.entries, m.chunk_size).objects()
    assert list(again.values())[-1] == bytes(root)


@FUZZ
@given(st.one_of(st.binary(max_size=400),
                 st.binary(max_size=400).map(lambda b: FOLDER_MAGIC + b),
                 st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1),
                           st.binary(max_size=400)).map(
                     lambda t: FOLDER_HEAD.pack(FOLDER_MAGIC, t[0], 0o755, 0, t[1]) + t[2])))
def test_fuzz_load_of_arbitrary_bytes_raises_only_manifest_error(data):
    _load_only_manifest_errors(data, {})


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


@pytest.mark.slow
@FUZZ
@given(manifests(), st.lists(_mutation, min_size=1, max_size=4))
def test_fuzz_load_of_mutated_objects_raises_only_manifest_error(m, ops):
    objects = m.objects()
    root = _mutate(objects[m.id], ops)
    tracemalloc.start()
    try:
        _load_only_manifest_errors(root, objects)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < (1 << 20) + 20 * sum(map(len, objects.values()))
