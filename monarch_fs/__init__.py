"""monarch-fs: content-addressed snapshots pushed to every node, served read-only over FUSE.

The code lives in the top-level folders `fs/`, `daemon/` and `mesh/`, installed as
`monarch_fs.fs`, `monarch_fs.daemon` and `monarch_fs.mesh`. This package itself holds what
every layer may import (`settings`, the environment) and what sees all three (`cli`).
"""

__version__ = "0.1.0"
