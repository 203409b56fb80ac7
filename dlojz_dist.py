"""The one place that knows how dlojz was launched: torchrun, srun, or a plain single process.

No other module reads RANK/WORLD_SIZE/SLURM_* variables; everything else receives a DistInfo.
"""
import os
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    master_addr: str = '127.0.0.1'
    master_port: int = 29500
    nodes: tuple = ()
    launcher: str = 'single'  # 'torchrun', 'slurm' or 'single'
    job_id: str = ''          # SLURM job id when running under SLURM, else ''

    @property
    def is_main(self):
        return self.rank == 0

    @property
    def distributed(self):
        return self.world_size > 1


def expand_nodelist(nodelist):
    """Expand a SLURM host list such as 'jz[001-003,010],gpu7' into ('jz001', ..., 'gpu7')."""
    hosts = []
    for prefix, ranges, plain in re.findall(r'([^,\[]+)\[([^\]]+)\]|([^,\[\]]+)', nodelist):
        if plain:
            hosts.append(plain)
            continue
        for part in ranges.split(','):
            lo, _, hi = part.partition('-')
            if not hi:
                hosts.append(prefix + lo)
            else:
                hosts += [f'{prefix}{i:0{len(lo)}d}' for i in range(int(lo), int(hi) + 1)]
    return tuple(hosts)


def get_dist_info(environ=os.environ):
    job_id = environ.get('SLURM_JOB_ID', environ.get('SLURM_JOBID', ''))
    if 'RANK' in environ and 'WORLD_SIZE' in environ:
        return DistInfo(rank=int(environ['RANK']), local_rank=int(environ.get('LOCAL_RANK', 0)),
                        world_size=int(environ['WORLD_SIZE']),
                        local_world_size=int(environ.get('LOCAL_WORLD_SIZE', environ['WORLD_SIZE'])),
                        master_addr=environ.get('MASTER_ADDR', '127.0.0.1'),
                        master_port=int(environ.get('MASTER_PORT', 29500)), launcher='torchrun', job_id=job_id)
    # Under srun every task has SLURM_STEP_ID; the batch script itself (python run without srun) is a
    # single process even when the allocation has several tasks.
    if 'SLURM_PROCID' in environ and 'SLURM_STEP_ID' in environ and 'SLURM_NTASKS' in environ:
        nodes = expand_nodelist(environ.get('SLURM_STEP_NODELIST', environ.get('SLURM_JOB_NODELIST', '')))
        # A port from the job id keeps two jobs sharing a node from colliding (range 20000-39999).
        port = 20000 + int(job_id) % 20000 if job_id.isdigit() else 29500
        return DistInfo(rank=int(environ['SLURM_PROCID']), local_rank=int(environ.get('SLURM_LOCALID', 0)),
                        world_size=int(environ['SLURM_NTASKS']),
                        local_world_size=int(environ.get('SLURM_NTASKS_PER_NODE', '1').split('(')[0] or 1),
                        master_addr=nodes[0] if nodes else '127.0.0.1', master_port=port, nodes=nodes,
                        launcher='slurm', job_id=job_id)
    return DistInfo(job_id=job_id)
