"""Data parallelism with torch.distributed, launched by torchrun (or any launcher that sets the env).

No DistributedDataParallel wrapper: each process computes loss *sums* on its share of the
global batch, the normalizer (total weight) and the gradients are all-reduced with SUM, so a
step equals the single-process step on the same global batch up to summation order.
gloo on CPU, nccl on GPU; 127.0.0.1 works for single-machine runs.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dspark import envs
from dspark.train.errors import TrainError


@dataclass
class DistContext:
    rank: int = 0
    world: int = 1
    device: str = "cpu"
    owns_group: bool = False  # we initialized the process group, so we tear it down

    @property
    def main(self) -> bool:
        return self.rank == 0


def setup(device: str | None = None) -> DistContext:
    world = envs.world_size()
    want_cuda = torch.cuda.is_available() if device is None else str(device).startswith("cuda")
    if world <= 1:
        return DistContext(device=device or ("cuda" if want_cuda else "cpu"))
    local = envs.local_rank()
    if want_cuda:
        if torch.cuda.device_count() <= local:
            raise TrainError(f"LOCAL_RANK {local} but only {torch.cuda.device_count()} CUDA devices")
        torch.cuda.set_device(local)
        dev = f"cuda:{local}"
    else:
        dev = "cpu"
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group(backend="nccl" if want_cuda else "gloo")
    return DistContext(rank=dist.get_rank(), world=dist.get_world_size(), device=dev, owns_group=owns)


def teardown(ctx: DistContext) -> None:
    if ctx.owns_group and dist.is_initialized():
        # Without a final rendezvous a fast rank tears down gloo's pairs while a slow one still
        # holds them, and the slow one aborts ("terminate called without an active exception").
        dist.barrier()
        dist.destroy_process_group()
        # The group sits in a reference cycle; left to the collector at interpreter exit, its
        # gloo worker threads try to take the GIL of a finalizing interpreter and abort.
        gc.collect()


def all_sum(ctx: DistContext, values: list[float]) -> list[float]:
    if ctx.world == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t)
    return t.tolist()


def sum_gradients(ctx: DistContext, params: list[torch.nn.Parameter]) -> None:
    """One flat all-reduce of every gradient (missing ones count as zero)."""
    if ctx.world == 1:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    i = 0
    for p in params:
        n = p.numel()
        p.grad = flat[i : i + n].view_as(p).clone()
        i += n


def broadcast_parameters(ctx: DistContext, module: torch.nn.Module) -> None:
    """Start every process from rank 0's weights (whatever each seeded or resumed)."""
    if ctx.world == 1:
        return
    for t in module.state_dict().values():
        dist.broadcast(t, src=0)


def barrier(ctx: DistContext) -> None:
    if ctx.world > 1:
        dist.barrier()
