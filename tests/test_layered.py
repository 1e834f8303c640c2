"""fs/layered.py: a mapping derived from another at the cost of its changes behaves as a copy
of a dict would, whatever the history of derives, sets, pops and folds; and deriving never
changes the mapping it came from (a node serves the old version while it indexes the new)."""

from __future__ import annotations

import random

import pytest

from monarch_fs.fs import layered
from monarch_fs.fs.layered import Layered


def same(m: Layered, model: dict) -> None:
    assert m.flat() == model and len(m) == len(model)
    for k in list(model)[:50]:
        assert k in m and m[k] == model[k] and m.get(k) == model[k]
    for k in ("absent", -1):
        assert k not in m and m.get(k) is None and m.get(k, "d") == "d"
        with pytest.raises(KeyError):
            m[k]


@pytest.mark.parametrize("seed", range(10))
def test_derived_mappings_are_copies_and_leave_their_parents_alone(seed, monkeypatch):
    monkeypatch.setattr(layered, "FOLD_MIN", 8)  # fold often
    rng = random.Random(seed)
    model = {i: f"v{i}" for i in range(200)}
    m = Layered(dict(model))
    history = [(m, dict(model))]
    for _ in range(60):
        parent, parent_model = rng.choice(history)  # derive from any version, as retained ones
        m, model = parent.derive(), dict(parent_model)
        for _ in range(rng.randint(1, 12)):
            k = rng.randrange(260)
            if rng.random() < 0.4:
                assert m.pop(k, None) == model.pop(k, None)
            else:
                m[k] = model[k] = f"w{rng.random()}"
        same(m, model)
        history.append((m, model))
    for m, model in history:  # nothing derived later changed any of them
        same(m, model)


def test_a_mapping_with_many_changes_folds_them_into_a_new_base():
    m = Layered({i: i for i in range(100_000)})
    for i in range(layered.FOLD_MIN * 8):
        m = m.derive()
        m[i] = -i
    assert len(m._top) <= max(layered.FOLD_MIN, len(m._base) // 16) + 1
    assert m[5] == -5 and m[99_999] == 99_999 and len(m) == 100_000
