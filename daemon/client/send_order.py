"""The order a push sends chunks in, after the manifest: what keeps both the CPU and the link
busy (interleave), and what a node can store while it places the manifest's large files
(lead)."""

from __future__ import annotations

from collections.abc import Collection, Mapping

from ...fs import backing
from ...fs.manifest import Manifest

LARGE_CHUNK = 1 << 20  # interleave(): chunks this big cost link time more than CPU
SMALL_RUN = 4 << 20
# Small files' bytes sent before any chunk a node writes in place: lead().
LEAD = 64 << 20


def in_place(manifest: Manifest | None) -> set[bytes]:
    """The chunks a node writes in place, in file objects: those of a large file, whatever
    their size (fs/backing.py's `wanted`); none known without the manifest."""
    return {c for e in manifest or () if backing.wanted(e) for c in e.chunks}


def interleave(ids: list[bytes], sizes: Mapping[bytes, int]) -> list[bytes]:
    """The order to send `ids` in: runs of small chunks (whole small files) spread among the
    large chunks in proportion to their bytes, each kind still in folder order.

    Small files cost CPU per byte (a read, a compression, a frame and a store write each, on
    every node); large chunks cost link time. Sent in folder order, a push is bound first by
    one and then by the other; mixed, it keeps both busy. A run of small files is up to
    SMALL_RUN bytes long, so files of one folder still sit together in a node's pack."""
    small = [c for c in ids if sizes[c] < LARGE_CHUNK]
    large = [c for c in ids if sizes[c] >= LARGE_CHUNK]
    if not small or not large:
        return ids
    small_total = sum(sizes[c] for c in small)
    large_total = sum(sizes[c] for c in large)
    out: list[bytes] = []
    i = j = small_done = large_done = 0
    while i < len(small) or j < len(large):
        # Small files next while they are behind the large chunks, as fractions sent.
        if j == len(large) or (i < len(small)
                               and small_done * large_total <= large_done * small_total):
            run = 0
            while i < len(small) and run < SMALL_RUN:
                out.append(small[i])
                run += sizes[small[i]]
                i += 1
            small_done += run
        else:
            out.append(large[j])
            large_done += sizes[large[j]]
            j += 1
    return out


def lead(ids: list[bytes], sizes: Mapping[bytes, int], in_place: Collection[bytes],
         limit: int = LEAD) -> list[bytes]:
    """The order to send `ids` in right after a manifest: up to `limit` bytes of the chunks
    of small files first (none of `in_place`, a large file's), in folder order, then
    interleave() the rest.

    A node places the manifest's large files as it arrives (it loads the manifest: 0.2-0.3 s
    for a venv of 43k files, node/manifest_first.py), and a chunk that may be one of theirs
    waits for that; a small file's is stored meanwhile. Sent after a large chunk, the dev box
    waited for that placement with the rest."""
    first: list[bytes] = []
    total = 0
    for c in ids:
        if total >= limit:
            break
        if c not in in_place:
            first.append(c)
            total += sizes[c]
    if not first:
        return interleave(ids, sizes)
    taken = set(first)
    return first + interleave([c for c in ids if c not in taken], sizes)
