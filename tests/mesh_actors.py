"""Actor classes for tests/test_mesh.py. The procs import them by name, with the tests folder on
their python_path."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

from monarch_fs.mesh import Actor, endpoint


class Counter(Actor):
    def __init__(self, start: int) -> None:
        self.value = start

    @endpoint
    def incr(self, by: int = 1) -> int:
        self.value += by
        return self.value

    @endpoint
    async def get(self) -> tuple[int, int, str, int]:
        return self.rank, self.value, self.host.name, os.getpid()

    @endpoint
    def thread(self) -> int:
        return threading.get_ident()

    @endpoint
    def fail_on(self, rank: int) -> int:
        if self.rank == rank:
            raise ValueError(f"rank {self.rank} refuses")
        return self.rank

    def not_an_endpoint(self) -> None:
        pass


class Victim(Actor):
    @endpoint
    def pid(self) -> int:
        print(f"victim {self.rank} says goodbye on stderr", file=sys.stderr)
        return os.getpid()

    @endpoint
    def nap(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank


    @endpoint
    def stall(self, rank: int, seconds: float) -> int:
        if self.rank == rank:
            time.sleep(seconds)
        return self.rank

    @endpoint
    def fail_stall(self, rank: int) -> int:
        if self.rank == rank:
            raise ValueError("no")
        return self.rank


class Tidy(Actor):
    def __init__(self, folder: str) -> None:
        self.folder = folder

    @endpoint
    def ping(self) -> int:
        return self.rank

    def __cleanup__(self) -> None:
        with open(os.path.join(self.folder, f"cleanup-{self.rank}"), "w") as f:
            f.write("done")


class Echo(Actor):
    @endpoint
    def echo(self, value):
        return value

    @endpoint
    def double(self, t):
        return t * 2


class BadInit(Actor):
    def __init__(self) -> None:
        if self.rank == 1:
            raise RuntimeError("cannot start on rank 1")


class Worker(Actor):
    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def die(self) -> None:
        print("worker dies now", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


class Boss(Actor):
    """Owns a mesh of workers; handles their failures only if told to."""

    def __init__(self, handle: bool) -> None:
        self.handle = handle
        self.seen: list[str] = []

    @endpoint
    def start(self) -> list[int]:
        self.workers = self.hosts.spawn_procs(per_host=1, name="workers").spawn("w", Worker)
        return self.workers.pid.call().get().values()

    @endpoint
    def kill_worker(self, host: int) -> str:
        try:  # the dead worker never answers: the call fails once its death is known
            self.workers.slice(host=host).die.broadcast()
            self.workers.pid.call().get()
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return "no error"

    @endpoint
    async def seen_failures(self) -> list[str]:
        return self.seen

    def __supervise__(self, failure) -> bool:  # a message like any other: runs after kill_worker
        self.seen.append(failure.describe())
        return self.handle


# A grandchild (started by an actor, inheriting every inheritable descriptor) reports its own
# environment block and its parent's, as any process of the same user could read them.
_GRANDCHILD = """
import json, os
print(json.dumps({"environ": open("/proc/self/environ").read(),
                  "parent": open(f"/proc/{os.getppid()}/environ").read()}))
"""


class EnvProbe(Actor):
    @endpoint
    def probe(self) -> dict:
        raw = open("/proc/self/environ", "rb").read().decode()
        grandchild = subprocess.run([sys.executable, "-c", _GRANDCHILD], close_fds=False,
                                    capture_output=True, text=True, check=True).stdout
        return {"environ": dict(kv.split("=", 1) for kv in raw.split("\0") if kv),
                "os_environ": dict(os.environ), "grandchild": json.loads(grandchild)}


class Imports(Actor):
    """Which of some modules its proc has imported; `self.hosts` from a sync endpoint."""

    @endpoint
    def loaded(self, names: list[str]) -> list[str]:
        return [n for n in names if n in sys.modules]

    @endpoint
    def host_count(self) -> int:
        return len(self.hosts.hosts)


class Where(Actor):
    """Reports where it runs, by Monarch's functions."""

    @endpoint
    def where(self) -> tuple:
        from monarch_fs.mesh import context, current_actor_name, current_rank, current_size

        point = current_rank()
        return (dict(point), point.rank, current_size(), context().actor_instance is self,
                current_actor_name(), self.host.name)

    @endpoint
    async def where_async(self) -> tuple:
        from monarch_fs.mesh import context, current_rank

        return dict(current_rank()), context().actor_instance is self

    @endpoint
    def later(self, step: float) -> int:
        time.sleep(step * (self.world_size - self.rank))
        return self.rank

    @endpoint
    def on_this_host(self) -> tuple:
        """Spawns a proc on its own host through this_host(), and asks an actor there."""
        from monarch_fs.mesh import this_host

        procs = this_host().spawn_procs(per_host={"gpus": 1}, name="inner")
        try:
            inner = procs.spawn("inner", Where)
            return procs.sizes, inner.where.call_one().get(timeout=30)
        finally:
            procs.stop()


class Buffer(Actor):
    """A replay buffer that generators fill directly."""

    def __init__(self) -> None:
        self.items: list = []

    @endpoint
    def add(self, item) -> int:
        self.items.append(item)
        return self.rank

    @endpoint
    async def contents(self) -> list:
        return self.items

    @endpoint
    def pid(self) -> int:
        return os.getpid()


class Producer(Actor):
    """Calls a buffer mesh it was given, from a sync endpoint and from an async one."""

    @endpoint
    def produce(self, buffer, n: int) -> list[int]:
        return [buffer.add.choose((self.rank, i)).get(timeout=30) for i in range(n)]

    @endpoint
    async def produce_async(self, buffer) -> list[int]:
        return list(await buffer.add.call(("async", self.rank)))

    @endpoint
    def keep(self, buffer):
        self.buffer = buffer
        return buffer  # a reference travels back to whoever called

    @endpoint
    def try_add(self) -> str:
        try:
            self.buffer.add.call("late").get(timeout=30)
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return "no error"


class Trainer(Actor):
    """torch.distributed inside an actor mesh, from the environment the mesh gives."""

    @endpoint
    def env(self) -> dict:
        keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "MASTER_ADDR", "MASTER_PORT")
        return {k: os.environ.get(k) for k in keys}

    @endpoint
    def all_reduce(self) -> float:
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=60))
        try:
            t = torch.tensor([float(self.rank + 1)])
            dist.all_reduce(t)
            return float(t.item())
        finally:
            dist.destroy_process_group()


class AsyncUser(Actor):
    """An async endpoint that needs asyncio: a queue, tasks, the running loop."""

    @endpoint
    async def pipeline(self, n: int) -> dict:
        import asyncio

        queue: asyncio.Queue[int] = asyncio.Queue(maxsize=2)

        async def produce() -> None:
            for i in range(n):
                await queue.put(i)
                await asyncio.sleep(0.01)
            await queue.put(-1)

        async def consume() -> int:
            total = 0
            while (item := await queue.get()) != -1:
                total += item
            return total

        _, total = await asyncio.gather(produce(), consume())
        loop = asyncio.get_running_loop()
        value = await loop.run_in_executor(None, lambda: 7)
        return {"total": total, "executor": value, "rank": self.rank}


class Chatter(Actor):
    @endpoint
    def chatter(self, tag: str) -> None:
        import logging

        print(f"same line {tag}", flush=True)
        print(f"rank {self.rank} alone {tag}", flush=True)
        logging.getLogger("chatter").info(f"info line {tag} rank {self.rank}")
        logging.getLogger("chatter").debug(f"debug line {tag} rank {self.rank}")
        for handler in logging.getLogger().handlers:
            handler.flush()


class WeightOwner(Actor):
    """Shares its weights as a TensorBuffer; readers fetch them straight from this proc."""

    def __init__(self, n: int) -> None:
        import torch

        self.weights = torch.arange(n, dtype=torch.float32)

    @endpoint
    def share(self):
        from monarch_fs.mesh import TensorBuffer

        self.handle = TensorBuffer(self.weights)
        return self.handle

    @endpoint
    def step(self) -> None:
        self.weights += 1  # in place: the next read sees it

    @endpoint
    def drop(self) -> None:
        self.handle.drop()


class WeightReader(Actor):
    def __init__(self, n: int) -> None:
        import torch

        self.weights = torch.zeros(n)

    @endpoint
    def pull(self, handle) -> float:
        handle.read_into(self.weights).get(timeout=30)
        return float(self.weights.sum())

    @endpoint
    async def pull_async(self, handle) -> float:
        fresh = await handle.read_into()
        return float(fresh.sum())

    @endpoint
    def pull_error(self, handle) -> str:
        try:
            handle.read_into(self.weights).get(timeout=30)
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return "no error"
