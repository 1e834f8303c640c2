"""Where a version's large files go, read from its folder objects without loading the version.

A node that receives a push learns from the manifest, which comes first, where each large
file's chunks go (fs/file_objects.py), and takes in no other chunk until it knows: a chunk that
arrived before would be written to a pack and copied again. Loading a whole version to learn it
(Manifest.load: every record made an Entry and checked) held a fresh node's receive for
0.16-0.57 s at the start of each cold push of the torch venv (46k entries), while the dev box
waited. The large files are a few hundred of those records: this reads each folder object's
records as they are laid out (fs/folder.parse checks every length) and keeps only the files
large enough to be file objects, in a fifth of the time. The version itself is loaded, and
every record checked, before anything is published (prepare): a file placed from a version
that fails that check is never served, and its object goes with the next collect.
"""

from __future__ import annotations

from collections.abc import Callable

from .backing import MIN_SIZE, key
from .chunk import MAX_CHUNK_SIZE
from .entry import Entry, Kind, ManifestError, MissingObject, TooManyEntries
from .folder import parse
from .store import Store


def large_files(version: bytes, get: Callable[[bytes], bytes | memoryview], limit: int
                ) -> tuple[int, list[Entry]]:
    """(the version's chunk size, its files of MIN_SIZE or more), read from the folder objects
    `get(id)` returns (KeyError: MissingObject says which). ManifestError for an object that
    is not laid out as one, TooManyEntries past `limit` records. A file whose chunk count does
    not fit its size is left out: the version's load refuses it."""
    chunk_size = 0
    count = 0
    found: list[Entry] = []
    stack = [(version, b"")]
    while stack:
        oid, path = stack.pop()
        try:
            blob = get(oid)
        except KeyError:
            raise MissingObject(oid, path) from None
        size, _, _, records = parse(oid, blob, path, count, limit)
        if not chunk_size:
            if not (64 * 1024 <= size <= MAX_CHUNK_SIZE):
                raise ManifestError(f"chunk size {size} out of range")
            chunk_size = size
        elif size != chunk_size:
            raise ManifestError(f"folder {path!r}: chunk size {size}, the root's is {chunk_size}")
        count += len(records)
        if count > limit:
            raise TooManyEntries(count, limit)
        for kind, mode, fsize, mtime, name, target, chunks in records:
            if kind == Kind.DIR:
                if len(chunks) != 1:
                    raise ManifestError(f"directory {name!r}: a folder's record has only its "
                                        "object id")
                stack.append((chunks[0], path + b"/" + name if path else name))
            elif (kind == Kind.FILE and fsize >= MIN_SIZE and not target
                  and len(chunks) == -(-fsize // chunk_size)):
                found.append(Entry(path + b"/" + name if path else name, Kind.FILE, mode, fsize,
                                   mtime, b"", chunks))
    return chunk_size, found


def place(store: Store, chunk_size: int, files: list[Entry]) -> int:
    """Tell the store where `files`' chunks go before they arrive (as backing.place_files); how
    many file objects will be written. Blocking."""
    return sum(store.expect_file(key(e), e.size, e.chunks, chunk_size) for e in files)
