"""A Slurm job's environment, read without torch: whether this process is a task of a job step,
and the torchrun variables (rank, world size, rendezvous address) such a task stands for."""

from __future__ import annotations

from collections.abc import Mapping


def slurm_rank_env(env: Mapping[str, str]) -> dict[str, str]:
    """torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT) for a task of a Slurm job step of several tasks; {} for anything else.

    The step's variables decide, not the job's: a batch script sees SLURM_PROCID = 0 and
    SLURM_NTASKS = 4 of its job, but it is one process, not rank 0 of 4; and a step
    (`srun -N1 -w n2` inside a two-node job) runs on its own nodes with its own task count.
    MASTER_ADDR and MASTER_PORT already set (by the user) are kept.
    """
    tasks = int(env.get("SLURM_STEP_NUM_TASKS", "0") or 0)
    if not is_slurm_step(env) or tasks <= 1 or "SLURM_PROCID" not in env:
        return {}
    local = local_task_count(env)
    out = {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": str(tasks),
           "LOCAL_RANK": env.get("SLURM_LOCALID", "0"), "LOCAL_WORLD_SIZE": str(local),
           "MASTER_ADDR": env.get("MASTER_ADDR") or first_host(
               env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
               or env.get("SLURM_NODELIST") or "localhost"),
           "MASTER_PORT": env.get("MASTER_PORT") or str(slurm_port(
               int(env.get("SLURM_JOB_ID", "0") or 0), int(env.get("SLURM_STEP_ID", "0") or 0)))}
    return out


# Step ids Slurm reserves (the batch script, the extern and interactive steps, a pending step);
# none of them is a step of tasks that srun started.
_SPECIAL_STEPS = {"4294967290", "4294967291", "4294967292", "4294967293", "4294967294",
                  "batch", "extern", "interactive"}


def is_slurm_step(env: Mapping[str, str]) -> bool:
    """Whether this process is a task that srun started (not a batch script or salloc shell)."""
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
    return step is not None and step not in _SPECIAL_STEPS and "SLURM_STEP_NUM_TASKS" in env


def slurm_port(job_id: int, step_id: int) -> int:
    """A rendezvous port for one step of one job, in 10000-32750 (below Linux's ephemeral
    ports). Steps of one job, and jobs whose ids differ by less than about 350, never get the
    same port (the key job*64 + step taken modulo a prime)."""
    return 10000 + (job_id * 64 + step_id % 64) % 22751


def local_task_count(env: Mapping[str, str]) -> int:
    """Tasks of this step on this node: SLURM_STEP_TASKS_PER_NODE ("2(x3),1") at this node's
    index, else the global task ids listed for this node, else the job's tasks per node."""
    per_node = expand_counts(env.get("SLURM_STEP_TASKS_PER_NODE", ""))
    node = int(env.get("SLURM_NODEID", "0") or 0)
    if 0 <= node < len(per_node):
        return per_node[node]
    if env.get("SLURM_GTIDS"):
        return len(env["SLURM_GTIDS"].split(","))
    return int(env.get("SLURM_NTASKS_PER_NODE", "1") or 1)


def expand_counts(text: str) -> list[int]:
    """Slurm's compressed counts: "2(x3),1" -> [2, 2, 2, 1]; "" -> []."""
    counts: list[int] = []
    for item in filter(None, text.split(",")):
        value, _, repeat = item.partition("(x")
        counts += [int(value)] * (int(repeat.rstrip(")")) if repeat else 1)
    return counts


def first_host(nodelist: str) -> str:
    """The first name of a Slurm node list: "gpu[07-09,12],cpu1" -> "gpu07"."""
    head, _, rest = nodelist.strip().partition("[")
    if "," in head or not rest:
        return head.split(",")[0]
    first = rest.split(",")[0].split("-")[0].rstrip("]")
    suffix = rest.split("]", 1)[1].split(",")[0] if "]" in rest else ""
    return head + first + suffix
