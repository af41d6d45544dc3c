"""How long rank 0 is held in sending a decode plan of 256 sequences (block tables 256 wide) to one other rank over
gloo, while it spends STEP_WORK_S on its own work per step, as the engine does. CPU only, two processes.

    python benchmarks/experiments/plan_send_cost.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[2]
STEP_WORK_S = 0.002
NUM_PLANS = 300


def run(rank: int) -> None:
    sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "executor")]
    from test_plan_broadcast import make_plan

    from pagedllm.executor.plan_broadcast import PlanSender, pack_plan, receive_plan

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29561", rank=rank, world_size=2)
    plan = make_plan([1] * 256, 256, list(range(256)), 0)
    if rank == 0:
        sender, held_s = PlanSender(dist.group.WORLD), 0.0
        for _ in range(NUM_PLANS):
            start = time.perf_counter()
            sender.send(plan)
            held_s += time.perf_counter() - start
            time.sleep(STEP_WORK_S)
        sender.send_shutdown()
        payload_kb = pack_plan(plan)[1].numpy().nbytes / 1e3
        print(f"rank 0 held {1e3 * held_s / NUM_PLANS:.3f} ms per plan in send(); payload {payload_kb:.0f} kB")
    else:
        while receive_plan(dist.group.WORLD) is not None:
            pass
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, nprocs=2)
