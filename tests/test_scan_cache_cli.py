"""The scan cache through the command line and a cluster: where the CLI keeps it, that a re-push
opens no source file (inotify, from outside the push process), that a stale entry fails the push
in one clear line, and that a push after the last one from a folder asks only about what changed.
The cache itself: test_scan_cache.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from helpers import mfs, tree
from monarch_fs.fs.chunk import CHUNK_SIZE, chunk_id
from monarch_fs.fs.scan_cache import RACY_NS, ScanCache, cache_file, stat_key
from scan_sources import make_tree, past_racy_window


@pytest.mark.mount
def test_push_through_the_command_line(cluster3, tmp_path, opens):
    """The CLI keeps the cache in $MONARCH_FS_HOME/scan-cache; --no-cache neither reads nor
    writes it; a re-push opens no source file (seen by inotify, from outside the push
    process); a stale entry fails the push with one clear line, and the next push is right."""
    src = tmp_path / "cli-src"
    src.mkdir()
    files = make_tree(src)
    home = tmp_path / "home"
    env = {"MONARCH_FS_HOME": str(home)}
    args = ["push", str(src), "--hosts", cluster3.hostfile, "--token-file",
            cluster3.token_file, "--json"]
    cfile = Path(cache_file(home / "scan-cache", src))
    first = json.loads(mfs(*args, "--no-cache", env=env).stdout)
    assert not cfile.exists()
    past_racy_window(src, RACY_NS)  # the CLI uses the default racy window
    seen = opens(src)
    assert json.loads(mfs(*args, env=env).stdout)["version"] == first["version"]
    assert cfile.exists() and len(seen.files()) == len(files) - 1
    again = json.loads(mfs(*args, env=env).stdout)
    assert seen.files() == []
    assert again["version"] == first["version"] and again["chunks_sent"] == 0
    seen_no_cache = json.loads(mfs(*args, "--no-cache", env=env).stdout)
    assert len(seen.files()) == len(files) - 1 and seen_no_cache["version"] == first["version"]

    # Plant a stale entry (the key unchanged, a wrong id) for one file.
    target = src / "pkg2" / "mod2.py"
    planted = ScanCache.for_folder(home / "scan-cache", src)
    planted.begin(CHUNK_SIZE)
    for rel in files:
        planted.lookup(os.stat(src / rel))
    planted.record(stat_key(os.stat(target)), [chunk_id(b"stale")])
    planted.save()
    out = mfs(*args, env=env, check=False)
    assert out.returncode == 1
    assert out.stderr.startswith("monarch-fs: error:") and "scan cache" in out.stderr
    assert "mod2.py" in out.stderr and "Traceback" not in out.stderr
    for mnt in cluster3.mounts():  # nothing was published
        assert (mnt / "cli-src" / "pkg2" / "mod2.py").read_bytes() == files["pkg2/mod2.py"]
    assert not cfile.exists()
    assert json.loads(mfs(*args, env=env).stdout)["version"] == first["version"]
    expected = tree(src)
    for mnt in cluster3.mounts():
        assert tree(mnt / "cli-src") == expected


@pytest.mark.mount
def test_a_push_after_the_last_from_this_folder_asks_only_about_what_changed(cluster3,
                                                                            tmp_path):
    """The scan cache keeps the version last pushed to every node, with its folder objects; a
    push to nodes that all serve it asks only about what its version adds (Manifest.ids_beyond,
    checked exactly in tests/test_manifest.py). A node that serves another version, or none,
    is asked about everything: here, one added to the hosts gets the whole tree."""
    src = tmp_path / "asked"
    src.mkdir()
    make_tree(src)
    env = {"MONARCH_FS_HOME": str(tmp_path / "home")}

    def push(hosts: list[str]) -> dict:
        return json.loads(mfs("push", str(src), "--hosts", ",".join(hosts), "--token-file",
                              cluster3.token_file, "--json", env=env).stdout)

    first = push(cluster3.hosts[:2])
    facts = ScanCache.for_folder(tmp_path / "home" / "scan-cache", src)
    facts.begin(CHUNK_SIZE)
    assert facts.pushed == bytes.fromhex(first["version"]) and facts.pushed_objects
    (src / "pkg1" / "mod1.py").write_bytes(b"edited = 1\n")
    second = push(cluster3.hosts)  # node 2 serves nothing: it is sent everything
    (src / "pkg2" / "new.py").write_bytes(b"new = 2\n")
    third = push(cluster3.hosts)  # every node serves the second: only the change is asked
    assert len({first["version"], second["version"], third["version"]}) == 3
    expected = tree(src)
    for mnt in cluster3.mounts():
        assert tree(mnt / "asked") == expected
