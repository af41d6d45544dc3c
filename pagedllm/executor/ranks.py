"""The processes of a tensor-parallel group: started by the LLM itself (one spawned process per rank > 0, meeting at
a TCP store on a free port), or launched by torchrun (env:// rendezvous, one host or several). Ranks > 0 serve
rank 0: they receive each step's plan and run it on their shard until rank 0 shuts the group down.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing import connection
from multiprocessing.process import BaseProcess

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagedllm import envs
from pagedllm.config import EngineConfig, ResolvedConfig
from pagedllm.executor.plan_broadcast import receive_plan
from pagedllm.executor.start_up import collect_start_up_garbage, start_worker
from pagedllm.executor.worker import Worker
from pagedllm.layers.parallel_state import TensorParallelGroup
from pagedllm.models.registry import check_tensor_parallel_size
from pagedllm.models.spec import DecoderSpec

# The model's collectives: every rank reaches them within one step of the others.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
# Ranks > 0 wait for the next plan for as long as the engine sits idle.
PLAN_WAIT_TIMEOUT = timedelta(days=365)
STARTUP_TIMEOUT_S = 300.0  # spawned ranks import torch and reach the store within this
STOP_TIMEOUT_S = 10.0  # after this, a rank asked to stop is terminated


def launched_by_torchrun() -> bool:
    return envs.RANK.get() is not None and envs.WORLD_SIZE.get() > 1


def is_rank_zero() -> bool:
    """False only in a process that torchrun launched as a rank other than 0."""
    return not launched_by_torchrun() or envs.RANK.get() == 0


def check_tensor_parallel(config: EngineConfig, spec: DecoderSpec, device: torch.device) -> None:
    """Every reason tensor_parallel_size cannot work, as a ValueError, before any process starts."""
    size = config.tensor_parallel_size
    backend = model_backend(device)
    if not (dist.is_available() and getattr(dist, f"is_{backend}_available")()):
        raise ValueError(
            f"tensor_parallel_size={size} on {device.type} needs torch.distributed with {backend}, which this torch "
            "build lacks; use tensor_parallel_size=1 or a torch build that has it"
        )
    check_tensor_parallel_size(spec, size)
    if launched_by_torchrun() and envs.WORLD_SIZE.get() != size:
        raise ValueError(
            f"torchrun started {envs.WORLD_SIZE.get()} processes but tensor_parallel_size={size}: "
            "launch exactly tensor_parallel_size processes (--nnodes x --nproc-per-node)"
        )
    if device.type == "cuda":
        needed = (envs.LOCAL_WORLD_SIZE.get() or size) if launched_by_torchrun() else (device.index or 0) + size
        if needed > torch.cuda.device_count():
            raise ValueError(
                f"tensor_parallel_size={size} needs {needed} GPUs on this host (one per rank"
                + (f", from cuda:{device.index}" if device.index else "")
                + f"), but torch sees {torch.cuda.device_count()}"
            )
    if dist.is_initialized():
        raise ValueError(
            "this process is already in a torch.distributed group (another tensor-parallel LLM?); "
            "one tensor-parallel LLM per process at a time: call shutdown() on the other first"
        )


def model_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: torch.device, rank_on_host: int) -> torch.device:
    """GPU ranks take consecutive GPUs from the configured one; CPU ranks all run on the CPU."""
    if device.type == "cuda":
        return torch.device("cuda", (device.index or 0) + rank_on_host)
    return device


def join_group(rank: int, size: int, device: torch.device, store: dist.Store | None) -> TensorParallelGroup:
    """Join the group (through `store`, or env:// under torchrun): the model's group (NCCL on CUDA, gloo on CPU),
    and a gloo group for the plans, whose ranks wait for the next plan as long as the engine idles."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rendezvous = {"store": store} if store is not None else {"init_method": "env://"}
    dist.init_process_group(model_backend(device), rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT, **rendezvous)
    host_group = dist.new_group(backend="gloo", timeout=PLAN_WAIT_TIMEOUT)
    return TensorParallelGroup(rank, size, dist.group.WORLD, host_group)


def serve_plans(worker: Worker) -> None:
    """The life of every rank but 0 once its worker is loaded: run each plan rank 0 sends, until the shutdown."""
    gather_weight_bytes(worker)
    collect_start_up_garbage()
    while (plan := receive_plan(worker.tp.host_group)) is not None:
        worker.execute(plan)
    worker.shutdown()
    dist.destroy_process_group()


def share_resolved_config(resolved: ResolvedConfig, tp: TensorParallelGroup) -> ResolvedConfig:
    """Under torchrun each process resolved its own settings: every rank takes rank 0's (kernel choices included),
    so no rank runs a choice of its own. Every rank calls this once, after joining the group."""
    shared = [resolved]
    dist.broadcast_object_list(shared, src=0, group=tp.host_group)
    return shared[0]


def error_key(rank: int) -> str:
    return f"pagedllm/error/{rank}"


def joining_key(rank: int) -> str:
    return f"pagedllm/joining/{rank}"


def run_spawned_rank(
    rank: int, size: int, host: str, port: int, resolved: ResolvedConfig, device: torch.device, num_threads: int
) -> None:
    """A process the LLM spawned for `rank`. Any error it hits is left in the store for rank 0 to report."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches rank 0, which stops the group
    torch.set_num_threads(num_threads)
    store = dist.TCPStore(host, port, size, is_master=False, timeout=timedelta(seconds=STARTUP_TIMEOUT_S))
    try:
        store.set(joining_key(rank), "1")
        serve_plans(start_worker(resolved, tp=join_group(rank, size, device, store), device=device))
    except BaseException:
        try:
            store.set(error_key(rank), traceback.format_exc())
        finally:
            os._exit(1)  # closes this rank's connections, which ends every collective waiting for it
    # Shut down in order (worker, then group): nothing is left to finalize. A rank that ended through the
    # interpreter's teardown aborted in 2 of 6 CPU suite runs (session 26: "terminate called without an active
    # exception", exit code -6, after a clean stop), most likely native threads destroyed during it; so the rank
    # ends here, its output flushed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class SpawnedRanks:
    """Ranks 1..size-1 as processes of this one (spawned, never forked: CUDA does not survive a fork). They meet
    rank 0 at a TCP store on MASTER_ADDR:MASTER_PORT if given, else on a free port of this host."""

    def __init__(self, resolved: ResolvedConfig, device: torch.device, num_threads: int):
        """resolved: rank 0's settings and kernel choices, which every rank runs; device: rank 0's (rank r takes the
        r-th GPU from it); num_threads: each rank's torch CPU threads."""
        self.size = resolved.config.tensor_parallel_size
        host = envs.MASTER_ADDR.get()
        port = envs.MASTER_PORT.get()  # 0: the store binds a free port, so engines never collide
        timeout = timedelta(seconds=STARTUP_TIMEOUT_S)
        self.store = dist.TCPStore(host, port, self.size, is_master=True, wait_for_workers=False, timeout=timeout)
        self.stopping = False
        self.died = threading.Event()  # set by the monitor when a rank ends unasked
        context = mp.get_context("spawn")
        self.processes = [
            context.Process(
                target=run_spawned_rank,
                args=(rank, self.size, host, self.store.port, resolved, rank_device(device, rank), num_threads),
                name=f"pagedllm-tp-rank-{rank}",
                daemon=True,
            )
            for rank in range(1, self.size)
        ]
        try:
            for process in self.processes:
                process.start()
        except BaseException:
            self.stop(0.0)
            raise
        self.abort_on_death = device.type == "cuda"
        threading.Thread(target=self.monitor, name="pagedllm-tp-monitor", daemon=True).start()

    def monitor(self) -> None:
        """A rank that ends unasked leaves rank 0's NCCL kernels waiting for it forever (gloo notices the closed
        connection by itself): abort the communicators, so that rank 0 gets control back and reports the rank."""
        waiting = {process.sentinel for process in self.processes}
        while waiting:
            for sentinel in connection.wait(list(waiting)):
                waiting.discard(sentinel)
                if not self.stopping and not self.died.is_set():
                    self.died.set()
                    if self.abort_on_death and dist.is_initialized():
                        dist.distributed_c10d._abort_process_group()

    def wait_until_joining(self) -> None:
        """Every rank has imported its modules and is joining the group (before that, a failure could leave
        rank 0 waiting in the rendezvous until the store's timeout)."""
        keys = [joining_key(rank) for rank in range(1, self.size)]
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self.store.check(keys):
            if self.failure() is not None:
                raise RuntimeError(f"tensor parallelism failed to start: {self.failure()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel ranks did not start within {STARTUP_TIMEOUT_S:.0f} s")
            time.sleep(0.02)

    def failure(self, wait_s: float = 0.0) -> str | None:
        """The first rank that has ended unasked (waiting up to wait_s for one to end), with the error it left."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank, process in enumerate(self.processes, start=1):
                if process.exitcode is not None:
                    return self.describe(rank, process)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    def describe(self, rank: int, process: BaseProcess) -> str:
        message = f"tensor-parallel rank {rank} (pid {process.pid}) exited with code {process.exitcode}"
        if self.store.check([error_key(rank)]):
            message += " after this error:\n" + self.store.get(error_key(rank)).decode(errors="replace")
        return message

    def stop(self, wait_s: float = STOP_TIMEOUT_S) -> None:
        """Wait up to wait_s for the ranks to exit (they were sent the shutdown, or cannot get one), then end them."""
        self.stopping = True
        deadline = time.monotonic() + wait_s
        started = [process for process in self.processes if process.pid is not None]
        for process in started:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in started:
            if process.is_alive():
                process.terminate()
                process.join(2.0)
            if process.is_alive():
                process.kill()
                process.join()


def gather_weight_bytes(worker: Worker) -> list[int] | None:
    """Every rank's parameter bytes, on rank 0 (None elsewhere); every rank calls this once, after loading."""
    tp = worker.tp
    mine = torch.tensor([worker.weight_bytes()])
    everyone = [torch.zeros(1, dtype=torch.int64) for _ in range(tp.size)] if tp.rank == 0 else None
    dist.gather(mine, everyone, dst=0, group=tp.host_group)
    return [int(count.item()) for count in everyone] if everyone is not None else None
