"""monarch_fs.settings: every MONARCH_FS_* variable, read when used, and documented (the
docs' settings table is generated from these properties: tests/test_docs.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from monarch_fs.settings import Settings, settings

REPO = Path(__file__).resolve().parent.parent


def test_defaults_when_unset_or_empty():
    for env in ({}, {name: "" for name in _variables()}):
        s = Settings(env)
        assert s.home == Path("~/.monarch-fs").expanduser()
        assert s.token_file is None and s.hosts is None and s.rdma_device is None
        assert s.munge_socket is None
        assert s.max_entries == 500_000 and s.pack_limit == 256 << 20
        assert s.no_open and s.passthrough
        assert s.rdma_gid_index is None and (s.rdma_slots, s.rdma_slot_size) == (16, 1 << 20)


def test_values_are_parsed_and_a_bad_one_names_its_variable():
    s = Settings({"MONARCH_FS_HOME": "/x", "MONARCH_FS_PACK_MIB": "0",
                  "MONARCH_FS_NO_OPEN": "0", "MONARCH_FS_PASSTHROUGH": "1",
                  "MONARCH_FS_RDMA_GID_INDEX": "3", "MONARCH_FS_MAX_ENTRIES": "x"})
    assert s.home == Path("/x") and s.pack_limit == 1 << 20  # at least 1 MiB
    assert not s.no_open and s.passthrough and s.rdma_gid_index == 3
    with pytest.raises(ValueError, match=r"\$MONARCH_FS_MAX_ENTRIES='x': expected an integer"):
        s.max_entries  # noqa: B018 (reading the property is what raises)


def test_read_when_used_not_at_import(monkeypatch):
    monkeypatch.setenv("MONARCH_FS_HOSTS", "a:1")
    assert settings.hosts == "a:1"
    monkeypatch.setenv("MONARCH_FS_HOSTS", "b:2")
    assert settings.hosts == "b:2"


def test_every_variable_has_a_property_with_its_documented_default():
    """The docs' settings table is made from the properties' docstrings (docs/hooks.py): each
    variable read here has one, starting with its name."""
    documented = {re.match(r"\w*", p.__doc__ or "")[0] for p in vars(Settings).values()
                  if isinstance(p, property)}
    assert documented == set(_variables())


def _variables() -> list[str]:
    source = (REPO / "monarch_fs" / "settings.py").read_text()
    return sorted(set(re.findall(r'"(MONARCH_FS_\w+)"', source)))
