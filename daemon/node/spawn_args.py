"""What a spawn's argv, environment and folder must be before anything is made for it.

exec takes C strings: a NUL byte in an argument, a variable or the folder, or a variable name
holding '=' or empty, cannot be passed, and Popen refuses them only after the daemon has made
the child's pipes (issue 33, finding 6: each such refusal leaked two descriptors). So the
process table checks them first and refuses, saying which one, with nothing made.
"""

from __future__ import annotations


def problem(argv: list[str], env: dict[str, str], cwd: str | None) -> str | None:
    """The first argument, variable or folder exec cannot take, said for the client; or None."""
    for i, arg in enumerate(argv):
        if "\0" in arg:
            return f"spawn: argument {i} holds a NUL byte"
    for name, value in env.items():
        if not name or "=" in name or "\0" in name:
            return (f"spawn: environment variable name {name!r} is empty or holds '=' or a "
                    "NUL byte")
        if "\0" in value:
            return f"spawn: environment variable {name} holds a NUL byte"
    if cwd is not None and "\0" in cwd:
        return "spawn: cwd holds a NUL byte"
    return None
