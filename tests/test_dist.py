"""get_dist_info(): the launcher seam reads torchrun first, then srun's SLURM variables (with node
lists like jz[001-003,010] and task lists like 4(x2),3), else a single process; the batch script
itself is not mistaken for a task, and a malformed environment is one clear UsageError. The gloo
side group of host-side collectives ends a wait for a hung peer within --dist-timeout. Ranks that
share a GPU (--share-gpu or MPS, more tasks than GPUs: an injected device count) join with gloo,
since NCCL refuses two ranks on one device.

Run: python -m pytest -q tests/test_dist.py"""
import os
import time

import pytest
import torch

from conftest import free_port, on_ranks
from dlojzlib.dist import launch
from dlojzlib.dist.launch import DistInfo, get_dist_info
from dlojzlib.environment import expand_nodelist, expand_tasks_per_node
from dlojzlib.errors import UsageError

# What srun exports to task 5 of `srun --nodes 2 --ntasks-per-node 4` (values as Slurm 23 writes
# them).
SRUN = {'SLURM_PROCID': '5', 'SLURM_LOCALID': '1', 'SLURM_NODEID': '1', 'SLURM_NTASKS': '8', 'SLURM_STEP_ID': '0',
        'SLURM_STEP_NUM_TASKS': '8', 'SLURM_STEP_NODELIST': 'jz[001-002]', 'SLURM_JOB_NODELIST': 'jz[001-002]',
        'SLURM_STEP_TASKS_PER_NODE': '4(x2)', 'SLURM_TASKS_PER_NODE': '4(x2)', 'SLURM_JOB_ID': '123456'}


def test_expand_nodelist():
    assert expand_nodelist('jz[001-003,010]') == ('jz001', 'jz002', 'jz003', 'jz010')
    assert expand_nodelist('gpu7,node[9-10],x1') == ('gpu7', 'node9', 'node10', 'x1')
    assert expand_nodelist('') == ()


def test_expand_tasks_per_node():
    assert expand_tasks_per_node('4(x2),3') == [4, 4, 3]
    assert expand_tasks_per_node('8') == [8]
    with pytest.raises(ValueError):
        expand_tasks_per_node('four')


def test_torchrun_wins():
    d = get_dist_info({'RANK': '3', 'LOCAL_RANK': '1', 'WORLD_SIZE': '4', 'LOCAL_WORLD_SIZE': '2',
                       'MASTER_ADDR': 'h1', 'MASTER_PORT': '1234', 'SLURM_PROCID': '0', 'SLURM_JOB_ID': '77'})
    assert (d.launcher, d.rank, d.local_rank, d.world_size, d.master_addr, d.master_port, d.job_id) == \
        ('torchrun', 3, 1, 4, 'h1', 1234, '77')
    assert d.distributed and not d.is_main and d.num_nodes == 2


def test_srun_task():
    d = get_dist_info(SRUN)
    assert (d.launcher, d.rank, d.local_rank, d.world_size, d.local_world_size) == ('slurm', 5, 1, 8, 4)
    assert d.master_addr == 'jz001' and d.nodes == ('jz001', 'jz002') and d.num_nodes == 2
    assert d.master_port == 20000 + 123456 % 10000
    assert get_dist_info({**SRUN, 'SLURM_JOB_ID': '123457'}).master_port != d.master_port
    # JSC: the master address is the first node's InfiniBand name, <node>i; the site's script sets
    # the suffix
    assert get_dist_info({**SRUN, 'DLOJZ_MASTER_SUFFIX': 'i'}).master_addr == 'jz001i'
    # heterogeneous node: the third node runs 3 tasks
    d = get_dist_info({**SRUN, 'SLURM_STEP_TASKS_PER_NODE': '4(x2),3', 'SLURM_STEP_NUM_TASKS': '11',
                       'SLURM_PROCID': '9', 'SLURM_NODEID': '2', 'SLURM_STEP_NODELIST': 'jz[001-003]'})
    assert (d.world_size, d.local_world_size, d.num_nodes) == (11, 3, 3)


def test_single_task_under_srun_is_still_launched():
    d = get_dist_info({'SLURM_PROCID': '0', 'SLURM_LOCALID': '0', 'SLURM_NTASKS': '1', 'SLURM_STEP_ID': '3',
                       'SLURM_STEP_NODELIST': 'n1', 'SLURM_STEP_TASKS_PER_NODE': '1', 'SLURM_JOB_ID': '5'})
    assert (d.launcher, d.world_size, d.distributed) == ('slurm', 1, True)


def test_batch_script_and_plain_process_are_single():
    d = get_dist_info({'SLURM_PROCID': '0', 'SLURM_NTASKS': '8', 'SLURM_JOB_ID': '9'})  # no SLURM_STEP_ID
    assert (d.launcher, d.world_size, d.job_id, d.distributed) == ('single', 1, '9', False)
    assert get_dist_info({}).world_size == 1


@pytest.mark.parametrize('change,words', [
    ({'SLURM_PROCID': '8'}, 'inconsistent'),                        # rank beyond the task count
    ({'SLURM_LOCALID': '4'}, 'inconsistent'),                       # local rank beyond tasks on this node
    ({'SLURM_STEP_NODELIST': '', 'SLURM_JOB_NODELIST': ''}, 'rank-0 host is unknown'),
    ({'SLURM_PROCID': 'x'}, 'not an integer'),
    ({'SLURM_STEP_TASKS_PER_NODE': 'many'}, 'tasks-per-node'),
])
def test_malformed_slurm_environment_is_one_sentence(change, words):
    with pytest.raises(UsageError) as e:
        get_dist_info({**SRUN, **change})
    assert words in str(e.value) and '\n' not in str(e.value)


def test_malformed_torchrun_environment():
    with pytest.raises(UsageError, match='inconsistent'):
        get_dist_info({'RANK': '2', 'WORLD_SIZE': '2'})


def test_gpu_binding(monkeypatch):
    """One task per GPU: the local rank picks the GPU; a launcher that binds one GPU per task leaves
    one visible GPU (index 0); more tasks than GPUs on a node is refused with a sentence."""
    d = get_dist_info(SRUN)  # local rank 1 of 4
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: 4)
    assert launch.cuda_device_for(d) == 1
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: 1)
    assert launch.cuda_device_for(d) == 0
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: 1)
    d3 = get_dist_info({**SRUN, 'SLURM_LOCALID': '3'})
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: 2)
    with pytest.raises(UsageError, match='only 2 GPUs are visible'):
        launch.cuda_device_for(d3)



def _side_group_rank(rank, port, result):
    """A rank of a 2-process gloo group: rank 1 never joins the side-group collective rank 0 starts."""
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
    info = DistInfo(rank=rank, world_size=2, local_world_size=2, master_port=port, launcher='torchrun')
    launch.setup(info, torch.device('cpu'), timeout_min=0.05)  # 3 s
    if rank == 1:
        time.sleep(30)
        return
    t = time.time()
    try:
        launch.all_gather_object('rank 0 is waiting')
        result.put(('returned', time.time() - t))
    except RuntimeError:
        result.put(('timed out', time.time() - t))


@pytest.mark.slow  # 6 s: waits for the timeout
def test_side_group_has_the_dist_timeout():
    """Host-side collectives (output folder, timings, the stop flag) use a gloo side group, on CPU
    runs as on GPU ones; it gets --dist-timeout too (new_group's own default would make a hung peer
    a 30 min wait)."""
    import multiprocessing as mp
    ctx = mp.get_context('spawn')
    result, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_side_group_rank, args=(r, port, result)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        what, seconds = result.get(timeout=60)
    finally:
        for p in procs:
            p.kill()
            p.join()
    assert what == 'timed out' and seconds < 20, (what, seconds)


def test_after_a_dead_peer_the_nccl_group_is_abandoned(monkeypatch):
    """NCCL's teardown can wait forever for a dead peer: after a communication failure the group is
    left to os._exit; a gloo group, or a run that ended normally, is destroyed."""
    destroyed = []
    monkeypatch.setattr(launch.tdist, 'is_initialized', lambda: True)
    monkeypatch.setattr(launch.tdist, 'destroy_process_group', lambda *a: destroyed.append(1))
    monkeypatch.setattr(launch, 'abandoned', False)
    for backend, peer_failed, abandoned, n in [('nccl', False, False, 1), ('gloo', True, False, 2),
                                               ('nccl', True, True, 2)]:
        monkeypatch.setattr(launch.tdist, 'get_backend', lambda *a: backend)
        launch.cleanup(peer_failed)
        assert (launch.abandoned, len(destroyed)) == (abandoned, n), backend


def _threads():
    """{thread id: name} of this process (torch 2.4's gloo threads have no names of their own)."""
    import glob
    return {int(p.split('/')[-2]): open(p).read().strip() for p in glob.glob('/proc/self/task/*/comm')}


def _ending_rank(rank, port, drop, result):
    """A rank of a 2-process gloo run that ends normally: DDP's model kept in a reference cycle, as
    a run's is, then cleanup(). drop=False: destroy_process_group() alone, the teardown before the
    fix."""
    torch.set_num_threads(1)  # no intra-op pool threads among those counted
    start = _threads()
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
    info = DistInfo(rank=rank, world_size=2, local_world_size=2, master_port=port, launcher='torchrun')
    launch.setup(info, torch.device('cpu'))
    cycle = {'model': torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))}
    cycle['self'] = cycle
    launch.all_gather_object(rank)
    during = {k: v for k, v in _threads().items() if k not in start}
    del cycle
    if drop:
        launch.cleanup(synchronize=True)
    else:
        launch.tdist.barrier(group=launch._CPU_GROUP)
        launch.tdist.destroy_process_group()
    result.put((rank, during, {k: v for k, v in _threads().items() if k not in start}))


@pytest.mark.skipif(not os.path.isdir('/proc/self/task'), reason='threads are listed from /proc')
@pytest.mark.parametrize('drop', [True, pytest.param(False, marks=pytest.mark.slow)])  # 4 s each
def test_a_normal_end_joins_the_groups_threads(drop):
    """gloo's threads still running at the interpreter's finalisation could abort a rank after a
    normal end (`terminate called without an active exception`): cleanup() leaves none of the
    threads the process group started. The same run without the fix (drop=False) must keep them, or
    this test would not see the difference."""
    seen, exits = on_ranks(2, _ending_rank, (free_port(), drop), 2, wait=120)
    assert len(seen) == 2, f'{len(seen)} of 2 ranks ended'
    for rank, during, after in seen:
        assert len(during) >= 3, during  # two groups' threads at least (torch 2.14: 7 for 2 ranks)
        assert (after == {}) == drop, (rank, drop, after)
    assert exits == [0, 0]


def _ends_in_a_row(rank, ports, result):
    """A rank of 2-process gloo runs that end normally one after another in this process, each
    with the host-side collectives a run makes and DDP's model in a reference cycle, then
    cleanup()."""
    torch.set_num_threads(1)
    for port in ports:
        os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
        info = DistInfo(rank=rank, world_size=2, local_world_size=2, master_port=port,
                        launcher='torchrun')
        launch.setup(info, torch.device('cpu'))
        cycle = {'model': torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))}
        cycle['self'] = cycle
        reduced = launch.all_reduce_(torch.full((1,), rank + 1.0)).item()
        sent = launch.broadcast_object(f'rank {rank}')
        seen = (reduced, sent, launch.all_gather_object(list(range(50 * rank))))  # as summary
        del cycle
        launch.cleanup(synchronize=True)
        result.put((rank, seen))


ENDS = 24  # ~0.3 s each on 2 cores


def test_normal_ends_in_a_row_never_hang():
    """Before torch 2.8, freeing a gloo group joined its threads with the GIL held, while one of
    them waited for the GIL to free a tensor torch's all_gather_object had made (dist/objects.py).
    At the floor (torch 2.4) a rank hung in cleanup(): at the 3rd to 5th end in each of 4 loops
    like this one, and at 7 of 55 single ends. Here every end finishes on both ranks, with the
    collectives' results."""
    seen, exits = on_ranks(2, _ends_in_a_row, ([free_port() for _ in range(ENDS)],), 2 * ENDS,
                                wait=20)  # an end takes 0.3 s
    want = (3.0, 'rank 0', [[], list(range(50))])  # pickles of two lengths
    assert sorted(r for r, _ in seen) == [0] * ENDS + [1] * ENDS, f'{len(seen)} of {2 * ENDS} ends'
    assert all(s == want for _, s in seen), seen
    assert exits == [0, 0]


def test_gpu_sharing_needs_mps_or_the_flag(monkeypatch, tmp_path):
    """The Alliance Canada guide runs several small replicas per GPU under NVIDIA MPS: local rank
    modulo the GPUs then, refused (with the way out) otherwise."""
    d3 = get_dist_info({**SRUN, 'SLURM_LOCALID': '3'})
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: 2)
    with pytest.raises(UsageError, match='run NVIDIA MPS'):
        launch.cuda_device_for(d3)
    assert launch.cuda_device_for(d3, share=True) == 1
    assert not launch.mps_active({'CUDA_MPS_PIPE_DIRECTORY': str(tmp_path)})
    (tmp_path / 'control').touch()
    assert launch.mps_active({'CUDA_MPS_PIPE_DIRECTORY': str(tmp_path)})


@pytest.mark.parametrize('device_type, gpus, per_node, share, backend', [
    ('cpu', 0, 4, False, 'gloo'),
    ('cuda', 4, 4, False, 'nccl'),   # one task per GPU
    ('cuda', 4, 4, True, 'nccl'),    # --share-gpu where nothing is shared
    ('cuda', 2, 4, True, 'gloo'),    # 4 tasks on 2 GPUs: NCCL would refuse ("Duplicate GPU detected")
    ('cuda', 1, 8, True, 'gloo'),    # 8 replicas on one GPU under MPS
    ('cuda', 1, 4, False, 'nccl'),   # srun --gpus-per-task: each task sees its own GPU
])
def test_backend_when_ranks_share_a_gpu(device_type, gpus, per_node, share, backend):
    assert launch.process_group_backend(device_type, gpus, per_node, share) == backend


def test_setup_joins_with_gloo_when_ranks_share_a_gpu(monkeypatch, capsys):
    """setup() with an injected device count (no GPU here): 4 tasks, 2 GPUs, --share-gpu -> the
    process group is gloo, rank 0 says why; 4 tasks on 4 GPUs -> NCCL."""
    joined = []
    monkeypatch.setattr(launch.tdist, 'init_process_group',
                        lambda backend, **kw: joined.append(backend))
    monkeypatch.setattr(launch.tdist, 'new_group', lambda **kw: None)
    monkeypatch.setattr(launch, '_check_distinct_gpus', lambda *a: None)
    monkeypatch.setattr(launch, '_CPU_GROUP', None)
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: 2)
    dist = DistInfo(rank=0, local_rank=0, world_size=4, local_world_size=4, launcher='torchrun')
    launch.setup(dist, torch.device('cuda', 0), share_gpu=True)
    assert joined == ['gloo'] and 'all-reduced with gloo' in capsys.readouterr().out
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: 4)
    launch.setup(dist, torch.device('cuda', 0), share_gpu=True)
    assert joined == ['gloo', 'nccl'] and capsys.readouterr().out == ''


def test_srun_port_stays_out_of_the_ports_outgoing_connections_take():
    """A job's port in the kernel's ephemeral range can be taken by any connection on the node (a CI
    job failed with EADDRINUSE on 37142 while another job's gloo mesh connected): every job id's
    port lies below this machine's range."""
    with open('/proc/sys/net/ipv4/ip_local_port_range') as f:
        ephemeral_low = int(f.read().split()[0])
    ports = {get_dist_info({**SRUN, 'SLURM_JOB_ID': str(job)}).master_port
             for job in range(0, 200_000, 7)}
    assert 1024 < min(ports) and max(ports) < ephemeral_low
    assert len(ports) > 9000  # two jobs on a node rarely share one


def test_srun_port_from_the_user_or_the_system():
    assert get_dist_info({**SRUN, 'MASTER_PORT': '31234'}).master_port == 31234
    one_task = {**SRUN, 'SLURM_STEP_NUM_TASKS': '1', 'SLURM_PROCID': '0', 'SLURM_LOCALID': '0',
                'SLURM_NODEID': '0', 'SLURM_STEP_TASKS_PER_NODE': '1',
                'SLURM_STEP_NODELIST': 'jz001'}
    assert get_dist_info(one_task).master_port == 0  # nobody else has to find it: a free one
    for bad in ('abc', '0', '70000'):
        with pytest.raises(UsageError, match=f"MASTER_PORT='{bad}' is not a port number"):
            get_dist_info({**SRUN, 'MASTER_PORT': bad})


def test_two_ranks_on_one_gpu_are_refused_unless_shared(monkeypatch):
    """The UUIDs of the ranks' GPUs, gathered (fakes of torch.cuda's properties and of the
    gather): a repeated UUID on a host is refused in one sentence, unless the GPU is shared."""
    import socket
    from types import SimpleNamespace
    host = socket.gethostname()
    monkeypatch.setattr(torch.cuda, 'get_device_properties',
                        lambda d: SimpleNamespace(uuid='GPU-a'))
    dist = DistInfo(rank=0, local_rank=0, world_size=3, local_world_size=3)
    for uuids, refused in ((['GPU-a', 'GPU-b', 'GPU-c'], False),
                           (['GPU-a', 'GPU-b', 'GPU-a'], True)):
        monkeypatch.setattr(launch, 'all_gather_object', lambda me: [(host, u) for u in uuids])
        if refused:
            with pytest.raises(UsageError, match=r'^ranks 0 and 2 share GPU GPU-a on '
                                                 r'.*--share-gpu\) to share it\.$'):
                launch._check_distinct_gpus(dist, torch.device('cuda', 0))
        else:
            launch._check_distinct_gpus(dist, torch.device('cuda', 0))
        launch._check_distinct_gpus(dist, torch.device('cuda', 0), share=True)
