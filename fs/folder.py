"""A version's folders: the Folder each is in memory, and the content-addressed object each is
on the wire and on disk.

A folder's object is its own mode and mtime, then a record per child in name order (a child
folder's record names its object), so the root's id names the whole tree. `read_tree` reads a
version from its objects, checking every record in tree order, and takes each folder whose
object a version read before has at the same path as it is, so loading an edit costs the
folders on its path.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator

from .chunk import ID_SIZE, MAX_CHUNK_SIZE
from .entry import (
    KINDS,
    MAX_FILE_SIZE,
    MAX_NAME,
    MAX_PATH,
    MTIME_RANGE,
    Entry,
    Kind,
    ManifestError,
    MissingObject,
    TooManyEntries,
    UnsafePath,
    check_entry,
    check_path,
)

MAGIC = b"MFSD\x01"  # a folder object
# A folder object: the head, then one record per child in name order. A child folder's record
# has kind DIR, zero mode, size and mtime, no target and one "chunk": the folder's object id.
_HEAD = struct.Struct("<5sIIqI")  # magic, chunk size, the folder's mode, its mtime_ns, children
_ENTRY = struct.Struct("<BIQqHHI")  # kind, mode, size, mtime_ns, name len, target len, chunks
# An Entry from its fields, without the named tuple's keyword-taking __new__ (read_tree makes
# one per record it loads).
_entry = tuple.__new__


def record(e: Entry, name: bytes) -> bytes:
    """A file or symlink as its folder's object lists it."""
    return b"".join([_ENTRY.pack(e.kind, e.mode, e.size, e.mtime_ns, len(name),
                                 len(e.target), len(e.chunks)), name, e.target, *e.chunks])


def folder_record(name: bytes, oid: bytes) -> bytes:
    return b"".join([_ENTRY.pack(Kind.DIR, 0, 0, 0, len(name), 0, 1), name, oid])


def folder_blob(folder: Entry, records: list[bytes], chunk_size: int) -> bytes:
    """A folder's object: its head, then its children's records."""
    return b"".join([_HEAD.pack(MAGIC, chunk_size, folder.mode, folder.mtime_ns, len(records)),
                     *records])


def parse(oid: bytes, blob: bytes | memoryview, path: bytes, counted: int, limit: int
           ) -> tuple[int, int, int, list[tuple[int, int, int, int, bytes, bytes, tuple]]]:
    """A folder object's (chunk size, mode, mtime_ns, child records), each record (kind, mode,
    size, mtime_ns, name, target, chunks). Only the layout is checked here: every length
    against what is left before it is used, and the children's count, with the `counted`
    entries before them, against `limit` before a single one is parsed."""
    # Sliced as bytes, not through a memoryview: a node parses every record of every version
    # it loads (43k for a torch venv), and a bytes slice is one step where a view's is two.
    data = blob if isinstance(blob, bytes) else bytes(blob)
    size = len(data)
    if size < _HEAD.size:
        raise ManifestError(f"folder {path!r}: object {oid.hex()[:12]} truncated")
    magic, chunk_size, mode, mtime, count = _HEAD.unpack_from(data)
    if magic != MAGIC:
        raise ManifestError(f"folder {path!r}: not a monarch-fs folder object (bad magic)")
    if counted + count > limit:
        raise TooManyEntries(counted + count, limit)
    if count * _ENTRY.size > size - _HEAD.size:
        raise ManifestError(f"folder {path!r}: claims {count} children, more than it holds")
    records: list[tuple[int, int, int, int, bytes, bytes, tuple]] = []
    append = records.append
    unpack = _ENTRY.unpack_from
    head = _ENTRY.size
    pos = _HEAD.size
    for _ in range(count):
        if pos + head > size:
            raise ManifestError(f"folder {path!r}: object truncated inside a record")
        kind, cmode, fsize, cmtime, nlen, tlen, nchunks = unpack(data, pos)
        pos += head
        base = pos + nlen + tlen
        end = base + nchunks * ID_SIZE
        if end > size:
            raise ManifestError(f"folder {path!r}: object truncated inside a record")
        if nchunks == 1:  # most files, and every folder
            chunks: tuple[bytes, ...] = (data[base:end],)
        else:
            chunks = tuple(data[i:i + ID_SIZE] for i in range(base, end, ID_SIZE))
        append((kind, cmode, fsize, cmtime, data[pos:pos + nlen],
                data[pos + nlen:base] if tlen else b"", chunks))
        pos = end
    if pos != size:
        raise ManifestError(f"folder {path!r}: trailing bytes after the last record")
    return chunk_size, mode, mtime, records


class Folder:
    """A folder of a version with all that is below it: its entry, its object id, its children
    in name order (`kids`; a child folder is there by its entry, and in `sub` by name) and how
    many entries its subtree holds (`span`, itself included).

    Never changed once its version is made, so versions share every folder they have
    unchanged, whole: loading or making an edit makes the folders on its path and takes the
    others as they are. A version as one flat list had to copy the list for every edit, and
    free the last one's, each O(tree) (a few ms a version at 100k files)."""

    __slots__ = ("entry", "oid", "kids", "sub", "span")

    def __init__(self, entry: Entry, oid: bytes, kids: tuple[Entry, ...],
                 sub: dict[bytes, Folder], span: int):
        self.entry = entry
        self.oid = oid
        self.kids = kids
        self.sub = sub  # in name order too
        self.span = span

    def walk(self) -> Iterator[Entry]:
        """Every entry of the subtree, in tree order (this folder's first)."""
        yield self.entry
        stack = [(iter(self.kids), self.sub)]
        while stack:
            kids, sub = stack[-1]
            for e in kids:
                if e.kind == Kind.DIR:
                    f = sub[e.name]
                    yield f.entry
                    stack.append((iter(f.kids), f.sub))
                    break
                yield e
            else:
                stack.pop()

    def folders(self) -> Iterator[Folder]:
        """This folder and every folder below it, parents first."""
        stack = [self]
        while stack:
            f = stack.pop()
            yield f
            stack.extend(reversed(f.sub.values()))


def read_tree(version: bytes, get: Callable[[bytes], bytes | memoryview], limit: int,
              known: Folder | None, known_chunk_size: int) -> tuple[Folder, int, list[Folder]]:
    """The tree of the version whose root object is `version`, its chunk size, and the folders
    read from objects (the others are `known`'s, taken whole): see Manifest.load."""
    chunk_size = 0
    count = 0  # entries so far
    read: list[Folder] = []

    def open_folder(path: bytes, oid: bytes, k: Folder | None) -> Folder | list:
        """Enter the folder at `path` (known's there: `k`): known's whole when its object
        is the same, else a frame: [its records, the Folder made, its kids so far, `k`,
        k's children by name, its path, the last child's name, the count before it]."""
        nonlocal chunk_size, count
        if k is not None and k.oid == oid:
            count += k.span
            if count > limit:
                raise TooManyEntries(count, limit)
            return k
        try:
            blob = get(oid)
        except KeyError:
            raise MissingObject(oid, path) from None
        size, mode, mtime, records = parse(oid, blob, path, count + 1, limit)
        if not chunk_size:
            if not (64 * 1024 <= size <= MAX_CHUNK_SIZE):
                raise ManifestError(f"chunk size {size} out of range")
            chunk_size = size
        elif size != chunk_size:
            raise ManifestError(f"folder {path!r}: chunk size {size}, the root's is "
                                f"{chunk_size}")
        e = Entry(path, Kind.DIR, mode, 0, mtime)
        check_entry(e, chunk_size)
        if k is not None and k.entry == e:
            e = k.entry  # the same folder with new contents: one object in memory
        f = Folder(e, oid, (), {}, 0)
        read.append(f)
        count += 1
        kids = {c.name: c for c in k.kids} if k is not None else {}
        return [iter(records), f, [], k, kids, path, b"", count - 1]

    top = open_folder(b"", version, known)
    if isinstance(top, Folder):  # the version known is
        return top, known_chunk_size, read
    stack = [top]
    while stack:
        frame = stack[-1]
        records, f, kids, k_folder, k_kids, path, last, start = frame
        record = next(records, None)
        if record is None:
            f.kids, f.span = tuple(kids), count - start
            stack.pop()
            continue
        kind, mode, size, mtime, name, target, chunks = record
        child = path + b"/" + name if path else name
        if b"/" in name:  # check_path would see two names
            raise UnsafePath(f"unsafe path {child!r}: '/' inside a name")
        # Its folder's path was checked: the new name and the whole length are what is left
        # (check_path on every path split each one again: a fifth of a venv's load).
        if not (0 < len(name) <= MAX_NAME and len(child) <= MAX_PATH and b"\0" not in name
                and name != b"." and name != b".."):
            check_path(child)  # says which rule it breaks
        if name <= last:
            raise ManifestError(f"duplicate entry {child!r}" if name == last else
                                f"folder {path!r}: children not in name order at {child!r}")
        frame[6] = name
        if kind == Kind.DIR:
            if mode or size or mtime or target or len(chunks) != 1:
                raise ManifestError(f"directory {child!r}: a folder's record has only "
                                    "its object id")
            k = k_folder.sub.get(name) if k_folder is not None else None
            inner = open_folder(child, chunks[0], k)
            sub = inner if isinstance(inner, Folder) else inner[1]
            kids.append(sub.entry)
            f.sub[name] = sub
            if isinstance(inner, list):
                stack.append(inner)
            continue
        kind_ = KINDS.get(kind)
        if kind_ is None:
            raise ManifestError(f"entry {child!r}: unknown kind {kind}")
        e = _entry(Entry, (child, kind_, mode, size, mtime, target, chunks))
        was = k_kids.get(name) if k_kids else None
        if was is not None and was == e:
            e = was  # unchanged: checked when it was loaded
        elif not (kind_ is Kind.FILE and not target and 0 <= mode <= 0o7777
                  and 0 <= size <= MAX_FILE_SIZE and mtime in MTIME_RANGE
                  and len(chunks) == -(-size // chunk_size)):
            check_entry(e, chunk_size)  # (a regular file's fields, checked just above)
        kids.append(e)
        count += 1
        if count > limit:
            raise TooManyEntries(count, limit)
    return top[1], chunk_size, read
