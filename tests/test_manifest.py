"""fs/manifest.py: the snapshot manifest, its wire layout, and everything validate and decode
refuse (unsafe paths, malformed entries, fields past the kernel's limits, absurd counts), with
hypothesis fuzzing of valid, arbitrary and mutated encodings."""

from __future__ import annotations

import struct
import subprocess
import sys
import tracemalloc

import pytest
from hypothesis import given
from hypothesis import strategies as st

from helpers import FUZZ, SMALL
from monarch_fs.fs.chunk import CHUNK_SIZE, ID_SIZE, MAX_CHUNK_SIZE, chunk_id
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


def test_decode_shares_a_known_versions_entries_and_still_checks_the_tree():
    """A node decodes each version knowing the one before: equal entries are the same objects
    (held once), the result is what a plain decode gives, and a shared entry must still have
    its folder and its place in the order."""
    known = Manifest.decode(sample_manifest().encode())
    edited = [e if e.path != b"pkg/__init__.py" else Entry(e.path, e.kind, e.mode, 11, 12,
                                                               chunks=(cid(9),))
              for e in sample_manifest().entries]
    data = Manifest(edited).encode()
    back = Manifest.decode(data, known=known)
    assert back.entries == Manifest.decode(data).entries and back.encode() == data
    assert back.get(b"run.sh") is known.get(b"run.sh")
    assert back.get(b"pkg/__init__.py").chunks == (cid(9),)

    pkg = (b"pkg", Kind.DIR, 0o755, 0, 2, b"", ())
    init = (b"pkg/__init__.py", Kind.FILE, 0o644, 10, 3, b"", (cid(1),))
    known = Manifest.decode(raw_manifest([ROOT, pkg, init]))
    with pytest.raises(ManifestError, match="no parent"):
        Manifest.decode(raw_manifest([ROOT, init]), known=known)
    known = Manifest.decode(raw_manifest([ROOT, pkg, init]))
    with pytest.raises(ManifestError, match="canonical order"):
        Manifest.decode(raw_manifest([ROOT, init, pkg]), known=known)


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
    for bad in (Entry(b"f", Kind.FILE, 0o644, 0, 2**63),
                Entry(b"f", Kind.FILE, 0o644, 0, -(2**63) - 1),
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
                                 + ENTRY.pack(Kind.FILE, 0o644, 2**64 - 1, 0, 0, 0,
                                              2**32 - 1) * 1000,
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


@pytest.mark.slow
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


@pytest.mark.slow
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
