"""Every site's shipped script submitted to the real Slurm of tests/slurm (two emulated nodes, a per-node
$SLURM_TMPDIR from a TaskProlog), with stub `module`, `conda`, `virtualenv`/`pip` and `nvidia-cuda-mps-control`
commands that record what the script asked of them, on which node, with which $SLURM_TMPDIR:

- each script trains and validates every image once, at the world size and node count it asks for, and ran
  its site's set-up: Jean Zay's module purge / arch / conda deactivate / pytorch-gpu in IDRIS's order;
  Alliance Canada's python module and one virtualenv per node on that node's own $SLURM_TMPDIR; JSC's stage
  and modules; the MPS daemon started and stopped around the 4 tasks sharing a GPU;
- the Alliance Canada scripts stage the shards once per node to the node's $SLURM_TMPDIR; the two-node one,
  requeued by SIGUSR2, continues where it stopped and copies nothing the second time.

cpu.slurm, jz-a100-8gpu.slurm and generic-4gpu.slurm are submitted by test_real_slurm.py.
Run: DLOJZ_SLURM_SETUP=1 python -m pytest -q -m slurm tests/slurm/test_site_scripts.py (as root)
"""
import os

import pytest

from conftest import TINY
from dlojzlib.data import datasets as D
from dlojzlib.data import shards as Sh
from dlojzlib.tools import slurm as S
from test_real_slurm import job_log, submit, summary, train_losses, wait_for_steps, wait_requeued
from test_real_slurm import slurm, workdir  # noqa: F401 - the fixtures, shared with that module

pytestmark = pytest.mark.slurm
ELSEWHERE = ('cpu.slurm', 'jz-a100-8gpu.slurm', 'generic-4gpu.slurm')  # test_real_slurm.py submits them
SITE_SCRIPTS = [(m, g, r) for m, g, r in S.SHIPPED if S.script_name(m, g, r) not in ELSEWHERE]


@pytest.fixture(scope='module')
def shards(cache_dir, tmp_path_factory):
    """TINY's synthetic dataset (generated here once, so that concurrent jobs find it made) and its shards."""
    src = os.path.join(cache_dir, 'synthetic-v1-c4-n24-v6-s0')
    D.ensure_synthetic_dataset(src, 4, 24, 6, 0, log=lambda m: None)
    dst = str(tmp_path_factory.mktemp('site-shards') / 'ds')
    Sh.prepare(src, dst, shard_size_mb=2, log=lambda m: None)
    return dst


def stub_calls(path):
    """-> [(command line, node, $SLURM_TMPDIR)] from the stubs' log."""
    if not os.path.exists(path):
        return []
    calls = []
    with open(path) as f:
        for line in f:
            head, tmp = line.rstrip('\n').rsplit(' tmp=', 1)
            cmd, node = head.rsplit(' node=', 1)
            calls.append((cmd, node, tmp))
    return calls


def expected_set_up(machine, nodes):
    """What the site's documentation has the script run, in order, for the batch shell (node 1)."""
    m = S.MACHINES[machine]
    if m['site'] == 'jz':
        return ['module purge', *[f'module load {x}' for x in m['modules'] if x.startswith('arch/')],
                'conda deactivate', *[f'module load {x}' for x in m['modules'] if not x.startswith('arch/')]]
    if m['site'] == 'ac':
        return [f'module load {" ".join(m["modules"])}']
    return [f'module load {m["modules"][0]}', f'module load {" ".join(m["modules"][1:])}']


def submit_site(slurm, workdir, name, cache_dir, out, stubs, *flags, data=()):  # noqa: F811
    site = next(S.MACHINES[m]['site'] for m, g, r in S.SHIPPED if S.script_name(m, g, r) == name)
    return submit(slurm, workdir, name, *TINY, '--cache-dir', cache_dir, *data, '--output-dir', out, *flags,
                  options=['--partition=debug'] if site == 'jsc' else [],  # the test cluster's only partition
                  DLOJZ_STUB_LOG=str(stubs), DLOJZ_MASTER_SUFFIX='')  # no <node>i name resolves here


def test_every_site_script_trains_with_its_sites_set_up(slurm, workdir, cache_dir, shards, tmp_path):  # noqa: F811
    jobs = {}
    for machine, gpus, ranks in SITE_SCRIPTS:  # all submitted at once: Slurm runs what fits side by side
        name = S.script_name(machine, gpus, ranks)
        data = ['--data-dir', shards] if S.MACHINES[machine].get('stage') else []
        # -b 4: 16 tasks x 4 = 64 images a step, within TINY's 96 (a larger global batch is refused)
        jobs[name] = submit_site(slurm, workdir, name, cache_dir, tmp_path / name, tmp_path / f'{name}.stubs',
                                 '--test-nsteps', '1', '-b', '4', data=data)
    for machine, gpus, ranks in SITE_SCRIPTS:
        name = S.script_name(machine, gpus, ranks)
        job, m = jobs[name], S.MACHINES[machine]
        info = slurm.wait(job, timeout=900)
        assert info['JobState'] == 'COMPLETED', (name, job_log(workdir, job, 'err')[-3000:])
        nodes, per_node = S.shape(machine, gpus)
        s = summary(tmp_path / name)
        assert (s['status'], s['world_size'], s['num_nodes']) == ('completed', nodes * per_node * ranks, nodes), name
        assert s['val']['images'] == 24 and s['provenance']['slurm_job_id'] == job, name
        calls = stub_calls(tmp_path / f'{name}.stubs')
        batch = [c for c, node, _ in calls if not c.startswith(('virtualenv', 'pip', 'nvidia'))]
        assert batch == expected_set_up(machine, nodes), name
        if m['site'] == 'ac':  # one virtualenv per node, each on that node's own $SLURM_TMPDIR
            venvs = [(node, tmp) for c, node, tmp in calls if c.startswith('virtualenv --no-download ')]
            assert len({n for n, _ in venvs}) == len(venvs) == nodes and len({t for _, t in venvs}) == nodes, calls
            assert all(c == f'virtualenv --no-download {tmp}/env' for c, _, tmp in calls if c.startswith('virtualenv'))
            assert sum(c == 'pip install --no-index -r requirements.txt' for c, _, _ in calls) == nodes
            st = s['data']['staging']  # the shards, copied once per node, to that node's $SLURM_TMPDIR
            assert st['used'] and len(st['nodes']) == nodes and st['copied_bytes'] == nodes * st['bytes'], st
            assert sorted(r['dir'].rsplit('/', 1)[0] for r in st['nodes']) == sorted(t for _, t in venvs), st
        if ranks > 1:
            mps = [c for c, _, _ in calls if c.startswith('nvidia-cuda-mps-control')]
            assert mps == ['nvidia-cuda-mps-control -d', 'nvidia-cuda-mps-control stdin=quit'], calls  # on, off


def test_two_node_alliance_job_requeued_copies_nothing_and_continues(slurm, workdir, cache_dir, shards,  # noqa: F811
                                                                      tmp_path):
    name = 'ac-narval-8gpu.slurm'
    out = tmp_path / 'run'
    job = submit_site(slurm, workdir, name, cache_dir, out, tmp_path / 'stubs', '-e', '30', '--log-interval', '1',
                      data=['--data-dir', shards])
    wait_for_steps(slurm, job, out, 3, timeout=600)
    r = slurm.run('scancel', '--batch', '--signal=USR2', job, check=False)
    assert r.returncode == 0, r.stderr
    wait_requeued(slurm, job)
    info = slurm.wait(job, timeout=900)
    assert info['JobState'] == 'COMPLETED', job_log(workdir, job, 'err')[-3000:]
    log = job_log(workdir, job) + job_log(workdir, job, 'err')
    assert 'was requeued' in log and 'continuing from' in log
    assert log.count('Staging: copying ') == 2 and log.count('nothing to copy') == 2  # per node, then none
    steps = sorted(train_losses(out))
    s = summary(out)
    assert steps == list(range(1, s['global_step'] + 1)) and s['status'] == 'completed'
    assert s['data']['staging']['copied_bytes'] == 0 and len(s['data']['staging']['nodes']) == 2


# TINY's data, as the Lightning example's DataModule flags
LIGHTNING_TINY = ['--arch', 'resnet18', '--image-size', '32', '--num-workers', '0',
                  '--accelerator', 'cpu', '--data-flag=--synthetic-classes=4',
                  '--data-flag=--synthetic-train-per-class=24',
                  '--data-flag=--synthetic-val-per-class=6', '--data-flag=--val-resize=36',
                  '--data-flag=--val-image-size=32', '--data-flag=--val-batch-size=16']


def test_the_lightning_scripts_train_with_jscs_set_up(slurm, workdir, cache_dir,  # noqa: F811
                                                      tmp_path):
    """The JSC course's Lightning script (examples/lightning_resnet50.py) under its Booster
    scripts: Lightning takes Slurm's tasks as its processes, the callback's record names every
    rank, the stage and modules ran."""
    pytest.importorskip('lightning', reason='optional: .ci/run installs '
                        'requirements-lightning.txt for it')
    jobs = {}
    for machine, gpus, program in S.SHIPPED_PROGRAMS:
        name = S.script_name(machine, gpus, recipe=program)
        jobs[name] = submit(slurm, workdir, name, *LIGHTNING_TINY,
                            f'--data-flag=--cache-dir={cache_dir}', '--output-dir',
                            tmp_path / name, '-b', '4', '--max-epochs', '1',
                            options=['--partition=debug'],
                            DLOJZ_STUB_LOG=str(tmp_path / f'{name}.stubs'))
    for machine, gpus, program in S.SHIPPED_PROGRAMS:
        name = S.script_name(machine, gpus, recipe=program)
        info = slurm.wait(jobs[name], timeout=900)
        assert info['JobState'] == 'COMPLETED', (name, job_log(workdir, jobs[name], 'err')[-3000:])
        s = summary(tmp_path / name / 'dlojz')
        assert (s['status'], s['world_size']) == ('completed', gpus), name
        assert s['global_batch'] == 4 * gpus, name
        assert s['provenance']['slurm_job_id'] == jobs[name], name
        assert s['provenance']['launcher'] == 'lightning (SLURMEnvironment)', name
        assert s['timing']['steps'] == 96 // (4 * gpus), name
        assert len(s['timing'].get('ranks', [0])) == gpus, name
        calls = [c for c, _, _ in stub_calls(tmp_path / f'{name}.stubs')]
        assert calls == expected_set_up(machine, 1), name
