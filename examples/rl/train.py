"""A small RL loop on the actor mesh: generators, a replay buffer and a trainer that call one
another directly, weights sent back to the generators every step, and a generator killed
mid-run and replaced. The walk-through is examples/README.md.

    .venv/bin/python examples/rl/train.py [--steps 8] [--kill-at 3]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import warnings

import torch

from monarch_fs.mesh import Actor, HostMesh, SupervisionError, endpoint

OBS, ACTIONS = 4, 2
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")  # torch without numpy


def make_policy() -> torch.nn.Module:
    torch.manual_seed(0)  # every actor starts from the same weights
    return torch.nn.Linear(OBS, ACTIONS)


class ReplayBuffer(Actor):
    """Keeps the latest `capacity` transitions; generators add, the trainer samples."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.obs = torch.empty(0, OBS)
        self.actions = torch.empty(0, dtype=torch.long)
        self.rewards = torch.empty(0)

    @endpoint
    def add(self, obs: torch.Tensor, actions: torch.Tensor, rewards: torch.Tensor) -> int:
        self.obs = torch.cat([self.obs, obs])[-self.capacity:]
        self.actions = torch.cat([self.actions, actions])[-self.capacity:]
        self.rewards = torch.cat([self.rewards, rewards])[-self.capacity:]
        return len(self.rewards)

    @endpoint
    def sample(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        idx = torch.randint(len(self.rewards), (n,))
        return self.obs[idx], self.actions[idx], self.rewards[idx]


class Generator(Actor):
    """Plays episodes with its copy of the policy and puts them straight into the buffer."""

    def __init__(self) -> None:
        self.policy = make_policy()
        self.version = 0

    @endpoint
    def set_weights(self, weights: dict[str, torch.Tensor], version: int) -> int:
        self.policy.load_state_dict(weights)
        self.version = version
        return self.version

    @endpoint
    def generate(self, buffer, episodes: int) -> dict:
        rewards = []
        for _ in range(episodes):
            obs = torch.randn(32, OBS)
            with torch.no_grad():
                actions = torch.distributions.Categorical(logits=self.policy(obs)).sample()
            reward = (actions == (obs[:, 0] > 0).long()).float()  # the right action pays 1
            buffer.add.call_one(obs, actions, reward).get(timeout=30)  # actor to actor
            rewards.append(float(reward.mean()))
        return {"rank": self.rank, "version": self.version, "reward": sum(rewards) / episodes}

    @endpoint
    def pid(self) -> int:
        return os.getpid()


class Trainer(Actor):
    """Samples the buffer itself, takes a policy-gradient step, returns the new weights."""

    def __init__(self, lr: float) -> None:
        self.policy = make_policy()
        self.optimizer = torch.optim.SGD(self.policy.parameters(), lr=lr)

    @endpoint
    def step(self, buffer, batch: int) -> tuple[float, dict[str, torch.Tensor]]:
        obs, actions, rewards = buffer.sample.call_one(batch).get(timeout=30)  # actor to actor
        logp = torch.log_softmax(self.policy(obs), dim=1).gather(1, actions[:, None])[:, 0]
        loss = -(logp * (rewards - rewards.mean())).mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        weights = {k: v.detach().clone() for k, v in self.policy.state_dict().items()}
        return float(loss.detach()), weights


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--kill-at", type=int, default=3, help="step at which a generator dies")
    args = parser.parse_args()

    hosts = HostMesh.local(2)
    gen_procs = hosts.spawn_procs(per_host={"gpus": 1}, name="generators")  # one per host
    generators = gen_procs.spawn("generators", Generator)
    buffer = hosts.slice(hosts=0).spawn_procs(name="buffer").spawn("buffer", ReplayBuffer, 4096)
    trainer = hosts.slice(hosts=1).spawn_procs(name="trainer").spawn("trainer", Trainer, 0.5)

    weights, replaced = make_policy().state_dict(), 0
    for step in range(args.steps):
        if step == args.kill_at:  # a generator dies, as on a real cluster
            os.kill(generators.slice(hosts=1).pid.call_one().get(), signal.SIGKILL)
        try:
            stats = generators.generate.call(buffer, 2).get(timeout=120)
        except SupervisionError as e:  # only the calls to the dead rank failed
            rank = e.failure.rank
            print(f"step {step}: generator rank {rank} died; replacing it", flush=True)
            gen_procs.respawn(rank)
            new = generators.slice(**generators.point_of(rank))  # the rank, by its coordinates
            new.set_weights.call(weights, step).get(timeout=60)
            replaced += 1
            stats = generators.generate.call(buffer, 2).get(timeout=120)
        loss, weights = trainer.step.call_one(buffer, 256).get(timeout=120)
        versions = generators.set_weights.call(weights, step + 1).get(timeout=60)  # sync back
        reward = sum(s["reward"] for s in stats) / len(stats)
        print(f"step {step}: loss {loss:+.3f}, reward {reward:.2f}, generators at versions "
              f"{list(versions)}", flush=True)
    print(f"done: {args.steps} steps, {replaced} generator replaced", flush=True)
    hosts.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
