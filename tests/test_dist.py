"""get_dist_info(): the launcher seam reads torchrun first, then srun's SLURM variables (with node lists
like jz[001-003,010]), else a single process; the batch script itself is not mistaken for a task.

Run: python -m pytest -q tests/test_dist.py
"""
from dlojz_dist import expand_nodelist, get_dist_info


def test_expand_nodelist():
    assert expand_nodelist('jz[001-003,010]') == ('jz001', 'jz002', 'jz003', 'jz010')
    assert expand_nodelist('gpu7,node[9-10],x1') == ('gpu7', 'node9', 'node10', 'x1')
    assert expand_nodelist('') == ()


def test_torchrun_wins():
    d = get_dist_info({'RANK': '3', 'LOCAL_RANK': '1', 'WORLD_SIZE': '4', 'LOCAL_WORLD_SIZE': '2',
                       'MASTER_ADDR': 'h1', 'MASTER_PORT': '1234', 'SLURM_PROCID': '0', 'SLURM_JOB_ID': '77'})
    assert (d.launcher, d.rank, d.local_rank, d.world_size, d.master_addr, d.master_port, d.job_id) == \
        ('torchrun', 3, 1, 4, 'h1', 1234, '77')


def test_srun_task():
    env = {'SLURM_PROCID': '5', 'SLURM_LOCALID': '1', 'SLURM_NTASKS': '8', 'SLURM_STEP_ID': '0',
           'SLURM_JOB_NODELIST': 'jz[001-002]', 'SLURM_NTASKS_PER_NODE': '4', 'SLURM_JOB_ID': '123456'}
    d = get_dist_info(env)
    assert (d.launcher, d.rank, d.local_rank, d.world_size, d.local_world_size) == ('slurm', 5, 1, 8, 4)
    assert d.master_addr == 'jz001' and d.nodes == ('jz001', 'jz002')
    assert d.master_port == 20000 + 123456 % 20000
    assert get_dist_info({**env, 'SLURM_JOB_ID': '123457'}).master_port != d.master_port


def test_batch_script_and_plain_process_are_single():
    d = get_dist_info({'SLURM_PROCID': '0', 'SLURM_NTASKS': '8', 'SLURM_JOB_ID': '9'})  # no SLURM_STEP_ID
    assert (d.launcher, d.world_size, d.job_id) == ('single', 1, '9')
    assert get_dist_info({}).world_size == 1
