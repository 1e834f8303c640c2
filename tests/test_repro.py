"""`monarch-fs repro` (daemon/client/repro.py) against real daemons and real processes: a rank
that failed on the cluster fails the same way on the dev box, from the version it ran (not the
one pushed since), with the same arguments and environment, and repro says what differs."""

from __future__ import annotations

import os
import re
import shutil
import sys
import textwrap

import pytest

from helpers import mfs

pytestmark = pytest.mark.mount

TRAIN = textwrap.dedent("""
    import os, sys
    rank = int(os.environ["RANK"])
    shard = open("data.txt").read().strip()
    weights = open("weights.txt").read()
    assert len(weights) == 200_000, len(weights)
    if rank == int(sys.argv[1]) and os.environ.get("MODE") == "strict":
        raise ValueError(f"rank {rank} of {os.environ['WORLD_SIZE']}: bad {shard!r}")
    print(f"rank {rank} read {shard}")
""")


def test_a_failed_rank_fails_the_same_way_here_from_the_version_it_ran(fresh_cluster,
                                                                        tmp_path, monkeypatch):
    monkeypatch.setenv("MONARCH_FS_EVENTS_INTERVAL", "0.2")  # (a query does not flush yet)
    c = fresh_cluster(2)
    src = tmp_path / "ws"
    src.mkdir()
    (src / "train.py").write_text(TRAIN)
    (src / "data.txt").write_text("shard-A\n")
    (src / "weights.txt").write_text("0123456789" * 20_000)  # compressible: in the store
    c.push(src)
    hosts = ("--hosts", c.hostfile, "--token-file", c.token_file)
    r = mfs("run", *hosts, "--per-host", "2", "--workspace", "ws", "--env", "MODE=strict",
            "--", sys.executable, "train.py", "3", check=False, timeout=90)
    assert r.returncode == 1, r.stderr
    failure = "ValueError: rank 3 of 4: bad 'shard-A'"
    assert failure in r.stderr
    job = re.search(r"monarch-fs repro (\S+) --rank 3", r.stderr).group(1)

    # the next version: no failure, another shard
    (src / "train.py").write_text(TRAIN.replace('"strict"', '"never"'))
    (src / "data.txt").write_text("shard-B\n")
    c.push(src)

    for args in (("--rank", "3"), (job, "--rank", "3")):  # the newest job, and by its id
        here = mfs("repro", *args, *hosts, check=False, timeout=90)
        assert here.returncode == 1, here.stderr
        assert failure in here.stderr, here.stderr
        assert "exit code 1 here; on node-1: exit code 1: the same" in here.stderr
        assert f"rank 3 of job {job}: {sys.executable} train.py 3" in here.stderr
        assert "differs: host:" in here.stderr and "not node-1" in here.stderr
        assert re.search(r"differs: working folder: \S+/ws, not \S+/node-1/mnt/\.versions/ws/",
                         here.stderr), here.stderr
        assert re.search(r"differs: MASTER_PORT=\d+, not \d+", here.stderr)  # a port here
        assert "weights.txt" not in here.stderr  # every file was found, checked
        # train.py and weights.txt from the dev box store; data.txt, too small for it to
        # keep and edited since in the source folder, from the node that ran the rank
        assert "2 files from the dev box store" in here.stderr
        assert "1 files from the node" in here.stderr

    # under pdb: it stops at the exception, where the shard it read can be looked at
    dbg = mfs("repro", job, "--rank", "3", "--pdb", *hosts, check=False, timeout=90,
              input="c\np shard\nq\n")
    assert "Entering post mortem debugging" in dbg.stdout, dbg.stdout + dbg.stderr
    assert "'shard-A'" in dbg.stdout
    assert f"rank 3 of job {job}: {sys.executable} -m pdb train.py 3" in dbg.stderr

    # rank 0 ran to its end on the cluster, and here too; it was not stopped for nothing
    ok = mfs("repro", job, "--rank", "0", *hosts, check=False, timeout=90)
    assert ok.returncode == 0, ok.stderr
    assert "rank 0 read shard-A" in ok.stdout

    nope = mfs("repro", "nope", "--rank", "0", *hosts, check=False)
    assert nope.returncode == 1
    assert "no node recorded a start of rank 0 of job nope" in nope.stderr


ALL_REDUCE = textwrap.dedent("""
    import os, warnings
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    print(f"sum {t.item():g} of {dist.get_world_size()}", flush=True)
    dist.destroy_process_group()
    if rank == 3:
        raise SystemExit(f"rank 3 refuses the sum {t.item():g}")
""")


def test_world_runs_every_rank_here_as_one_torch_world(fresh_cluster, tmp_path, monkeypatch):
    """--world: the four ranks of a 2x2 torch job form their gloo world on the dev box (rank 3
    alone would wait for the others forever), and rank 3 fails as it did on the cluster."""
    monkeypatch.setenv("MONARCH_FS_EVENTS_INTERVAL", "0.2")
    c = fresh_cluster(2)
    src = tmp_path / "dist"
    src.mkdir()
    (src / "train.py").write_text(ALL_REDUCE)
    c.push(src)
    hosts = ("--hosts", c.hostfile, "--token-file", c.token_file)
    r = mfs("run", *hosts, "--per-host", "2", "--workspace", "dist", "--", sys.executable,
            "train.py", check=False, timeout=120)
    assert r.returncode == 1, r.stderr
    assert "rank 3 refuses the sum 10" in r.stderr

    here = mfs("repro", "--world", *hosts, check=False, timeout=120)
    assert here.returncode == 1, here.stderr
    assert "[ranks 0-3] sum 10 of 4" in here.stdout, here.stdout + here.stderr
    assert "[rank 3] rank 3 refuses the sum 10" in here.stderr
    assert "all 4 ranks of job" in here.stderr and "ran on node-0, node-1" in here.stderr
    assert "rank 3: exit code 1 here; on node-1: exit code 1: the same" in here.stderr
    assert "rank 3 failed first" in here.stderr


def test_a_restarted_job_is_reproduced_from_the_attempt_that_failed(fresh_cluster, tmp_path,
                                                                      monkeypatch):
    monkeypatch.setenv("MONARCH_FS_EVENTS_INTERVAL", "0.2")
    c = fresh_cluster(1)
    hosts = ("--hosts", c.hostfile, "--token-file", c.token_file)
    once = ("import os, sys; r = os.environ['RANK']; a = os.environ['TORCHELASTIC_RESTART_COUNT']"
            "; print('rank', r, 'attempt', a); sys.exit(7 if (r, a) == ('1', '0') else 0)")
    r = mfs("run", *hosts, "--per-host", "2", "--max-restarts", "1", "--", sys.executable,
            "-c", once, check=False, timeout=90)
    assert r.returncode == 0 and "exit code 7 (attempt 1 of 2)" in r.stderr, r.stderr

    failed = mfs("repro", "--rank", "1", *hosts, check=False, timeout=90)
    assert failed.returncode == 7, failed.stderr
    assert failed.stdout == "rank 1 attempt 0\n"
    assert "exit code 7 here; on node-0: exit code 7: the same" in failed.stderr

    fine = mfs("repro", "--rank", "0", *hosts, check=False, timeout=90)  # it never failed
    assert fine.returncode == 0 and fine.stdout == "rank 0 attempt 1\n", fine.stderr
    assert "(attempt 2)" in fine.stderr


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("munged")
                    or not shutil.which("useradd"),
                    reason="needs root, munged (package munge) and useradd")
def test_another_user_gets_no_chunk_of_a_workspace_under_identity_munge(tmp_path,
                                                                         monkeypatch):
    """A's job ran from A's workspace; B's repro of it may not read that version from the
    node (A's source folder being closed to B), and A's own repro may."""
    from test_identity import as_user, make_envs, munge_nodes

    monkeypatch.setenv("MONARCH_FS_EVENTS_INTERVAL", "0.2")

    with munge_nodes(tmp_path, 1) as (daemons, munged, _, (a, b)):
        addr = daemons[0].addr
        make_envs(a, b)
        (a.home / "env").chmod(0o700)
        out = as_user(a, munged, "push", str(a.home / "env"), "--hosts", addr)
        assert out.returncode == 0, out.stderr
        # (the daemon's mount is in a folder only root may enter: the rank runs in A's home)
        out = as_user(a, munged, "run", "--hosts", addr, "--workspace", "env", "--cwd",
                      str(a.home), "--", "/usr/bin/python3", "-c", "print('ran'); exit(3)")
        assert out.returncode == 3, out.stderr
        job = re.search(r"monarch-fs repro (\S+) --rank", out.stderr).group(1)

        # B does not even see what A's job started (the events show each user their own
        # processes), so B's repro reads no chunk of A's workspace
        theirs = as_user(b, munged, "repro", job, "--rank", "0", "--hosts", addr)
        assert theirs.returncode == 1, theirs.stderr
        assert f"no node recorded a start of rank 0 of job {job} that you may see" \
            in theirs.stderr, theirs.stderr
        assert "ran" not in theirs.stdout

        mine = as_user(a, munged, "repro", job, "--rank", "0", "--hosts", addr)
        assert mine.returncode == 3, mine.stderr
        assert mine.stdout == "ran\n"
        assert "exit code 3 here; on node: exit code 3: the same" in mine.stderr
