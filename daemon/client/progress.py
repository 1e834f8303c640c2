"""What a push reports as it goes (scanning, hashing, sending, publishing): the CLI draws it as
a progress bar; the default reports nothing."""

from __future__ import annotations


class Progress:
    """A push's progress, phase by phase; the default is silent."""

    def phase(self, name: str, total: int, unit: str = "B") -> None:
        """A new phase starts, of `total` units (0: unknown)."""

    def update(self, done: int) -> None:
        """`done` units of the current phase are done."""


def fmt_bytes(n: float) -> str:
    """A byte count for people: "512 B", "1.5 MiB", up to TiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
