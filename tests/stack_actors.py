"""Actor classes for tests/test_stacks.py (the procs import them by name, with the tests folder
on their python_path): a step in which rank 3 blocks loading a batch while the others wait for
it."""

from __future__ import annotations

import time

from monarch_fs.mesh import Actor, endpoint


def load_batch() -> None:
    time.sleep(600)


def wait_for_batch() -> None:
    while True:
        time.sleep(0.05)


class Loader(Actor):
    @endpoint
    def step(self) -> int:
        if self.rank == 3:
            load_batch()
        else:
            wait_for_batch()
        return self.rank
