"""A tiny SPMD training step for `monarch-fs run`: every rank all-reduces a tensor with
torch.distributed (gloo, CPU) and prints what it got and where its code came from.

    monarch-fs push ./job                                   # job/train.py is this file (make demo)
    monarch-fs run --per-host 2 --max-restarts 1 --workspace job -- python train.py --crash-once 3

--crash-once RANK makes that rank die on the first attempt (TORCHELASTIC_RESTART_COUNT=0), to
show supervision at work: the failure is reported, the other ranks stopped, the group restarted.
--hang RANK makes that rank block loading its batch while the others wait for it in all_reduce
(`run --hang-timeout` catches it, and `monarch-fs stacks` shows it).
"""

import argparse
import os
import sys
import time
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")  # torch without numpy

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def load_batch(rank: int, hang: int | None) -> torch.Tensor:
    if rank == hang:
        time.sleep(3600)  # a stuck read: this rank never reaches the collective
    return torch.tensor([float(rank + 1)])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--crash-once", type=int, metavar="RANK")
    ap.add_argument("--hang", type=int, metavar="RANK")
    args = ap.parse_args()
    rank = int(os.environ["RANK"])
    if args.crash_once == rank and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        print(f"rank {rank}: simulated crash on the first attempt", file=sys.stderr)
        return 1
    dist.init_process_group("gloo")
    if args.hang is not None:
        print(f"rank {rank}: loading a batch", flush=True)
    t = load_batch(rank, args.hang)
    try:
        dist.all_reduce(t)
    except RuntimeError as e:  # a peer was stopped (run --hang-timeout stops them all)
        print(f"rank {rank}: all_reduce failed: {str(e).splitlines()[0][:100]}", file=sys.stderr)
        return 1
    print(f"rank {rank} of {dist.get_world_size()}: all_reduce(rank + 1) = {t.item():g}; "
          f"code from {os.path.relpath(__file__, os.environ['MONARCH_FS_MOUNT'])} on the "
          f"mount {os.environ['MONARCH_FS_MOUNT']}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
