"""One parser per environment variable dlojz reads (issue 49): torchrun's, srun's SLURM_*, OpenMP's
and DLOJZ_FAULT. Any text gives a value or one sentence that names the variable and its value
(a UsageError: `dlojz: error:` and exit 2), within a second: never a traceback, never a node list
expanded past what a cluster has. The defects it fixes: 'jz[a-b]' (ValueError), '2(x0)'
(IndexError), SLURM_RESTART_COUNT=x (ValueError at import, on every run), '²' taken as a digit
(ValueError), n[0-999999999] and 1(x999999999) expanded (the memory), the Lightning example's bare
int().

python -m pytest -q tests/test_environment_parsers.py"""
import importlib.util
import os
import resource
import subprocess
import sys

import pytest
from hypothesis import given, settings, strategies as st

from conftest import ROOT
from dlojzlib import environment as E
from dlojzlib.dist import launch
from dlojzlib.errors import UsageError
from dlojzlib.modes import doctor

# What srun exports to task 5 of `srun --nodes 2 --ntasks-per-node 4` (as tests/test_dist.py's)
SRUN = {'SLURM_PROCID': '5', 'SLURM_LOCALID': '1', 'SLURM_NODEID': '1', 'SLURM_NTASKS': '8',
        'SLURM_STEP_ID': '0', 'SLURM_STEP_NUM_TASKS': '8', 'SLURM_STEP_NODELIST': 'jz[001-002]',
        'SLURM_JOB_NODELIST': 'jz[001-002]', 'SLURM_STEP_TASKS_PER_NODE': '4(x2)',
        'SLURM_TASKS_PER_NODE': '4(x2)', 'SLURM_JOB_ID': '123456'}
TORCHRUN = {'RANK': '3', 'LOCAL_RANK': '1', 'WORLD_SIZE': '4', 'LOCAL_WORLD_SIZE': '2',
            'MASTER_ADDR': 'h1', 'MASTER_PORT': '1234'}
# Text near the launchers' own, so that the search reaches past the first character
SLURMISH = st.text(alphabet='0123456789[]-,x()jz.²', max_size=30)
ANY = st.one_of(st.text(max_size=40), SLURMISH)
FAULTISH = st.text(alphabet='slow-steps:0.5,SIGUSR2', max_size=30)


def one_sentence(e, name):
    text = str(e.value)
    assert name in text and '\n' not in text and len(text) < 400, text


# ------------------------------------------------------------------------------- the defects

@pytest.mark.parametrize('change,name', [
    ({'SLURM_STEP_NODELIST': 'jz[a-b]'}, 'SLURM_STEP_NODELIST'),       # was ValueError
    ({'SLURM_STEP_NODELIST': 'jz[3-1]'}, 'SLURM_STEP_NODELIST'),       # was a silent empty range
    ({'SLURM_STEP_TASKS_PER_NODE': '2(x0)'}, 'SLURM_STEP_TASKS_PER_NODE'),  # was IndexError
    ({'SLURM_STEP_TASKS_PER_NODE': ','}, 'SLURM_STEP_TASKS_PER_NODE'),      # was IndexError
    ({'SLURM_JOB_ID': '²', 'MASTER_PORT': '1'}, 'SLURM_JOB_ID'),    # '²'.isdigit(), int() refuses
    ({'MASTER_PORT': '²'}, 'MASTER_PORT'),                           # was ValueError
    ({'SLURM_PROCID': '٣'}, 'SLURM_PROCID'),                         # int() took Arabic digits
])
def test_a_malformed_srun_variable_is_one_sentence(change, name):
    with pytest.raises(UsageError) as e:
        launch.get_dist_info({**SRUN, **change})
    one_sentence(e, name)


def test_the_node_list_slurm_writes_still_expands():
    """Brackets anywhere in a name, as Slurm's hostlist writes them, and the width of the first
    number: the old reading took 'n[1-2]-ib' for three hosts, the last '-ib'."""
    assert E.expand_nodelist('jz[001-003,010],gpu7') == ('jz001', 'jz002', 'jz003', 'jz010', 'gpu7')
    assert E.expand_nodelist('n[1-2]-ib') == ('n1-ib', 'n2-ib')
    assert E.expand_nodelist('r[1-2]n[09-10]') == ('r1n09', 'r1n10', 'r2n09', 'r2n10')
    assert E.expand_nodelist('') == () and E.expand_tasks_per_node('4(x2),3') == [4, 4, 3]


def bounded(code, seconds=10):
    """Run `code` in a Python that may hold 1 GiB: a list expanded to 10⁹ entries fails there, not
    in the test's machine."""
    limit = lambda: resource.setrlimit(resource.RLIMIT_AS, (2**30, 2**30))  # noqa: E731
    return subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, cwd=ROOT,
                          timeout=seconds, preexec_fn=limit)


@pytest.mark.parametrize('name,value', [('SLURM_JOB_NODELIST', 'n[0-999999999]'),
                                        ('SLURM_JOB_NODELIST', 'a[0-99999],b[0-99999]'),
                                        ('SLURM_JOB_NODELIST', 'r[0-9999]n[0-9999]'),
                                        ('SLURM_TASKS_PER_NODE', '1(x999999999)')])
def test_a_huge_list_is_refused_before_it_is_expanded(name, value):
    p = bounded('from dlojzlib.environment import read\n'
                f'try:\n    read({name!r}, {{{name!r}: {value!r}}})\n'
                'except Exception as e:\n    print(type(e).__name__, e)')
    assert p.returncode == 0 and p.stdout.startswith(f'UsageError {name}='), p.stdout + p.stderr
    assert 'at most 100000 nodes' in p.stdout


def test_a_bad_restart_count_is_one_sentence_at_start_up_not_at_import():
    """SLURM_RESTART_COUNT=x raised ValueError when dlojzlib.failpoints was imported: a traceback on
    every run. Now the import goes on, and dlojz.py refuses it with one line before torch loads."""
    env = {**os.environ, 'SLURM_RESTART_COUNT': 'x'}
    p = subprocess.run([sys.executable, '-c', 'import dlojzlib.failpoints'], capture_output=True,
                       text=True, cwd=ROOT, env=env, timeout=60)
    assert p.returncode == 0, p.stderr
    p = subprocess.run([sys.executable, 'dlojz.py', '--fake-data', '--test-nsteps', '1'],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)
    assert p.returncode == 2 and 'Traceback' not in p.stderr, p.stderr
    assert p.stderr.strip().splitlines() == [
        "dlojz: error: SLURM_RESTART_COUNT='x' is not an integer from 0 to 2147483647; Slurm sets "
        "it itself: unset it, or run dlojz with srun inside an sbatch/salloc allocation."]


def test_the_memory_budget_and_the_cpus_per_task_read_slurm_through_the_parsers():
    """'²'.isdigit() is True and int('²') a ValueError: the old checks let it through."""
    for env in ({'SLURM_MEM_PER_NODE': '²'}, {'SLURM_NTASKS_PER_NODE': 'x4'},
                {'SLURM_MEM_PER_CPU': '1', 'SLURM_CPUS_ON_NODE': '²'}):
        with pytest.raises(UsageError) as e:
            doctor.memory_budget(env, cgroup=lambda: None, meminfo='/nonexistent')
        one_sentence(e, list(env)[-1])
    assert doctor.memory_budget({'SLURM_MEM_PER_NODE': '1024', 'SLURM_NTASKS_PER_NODE': '4'},
                                cgroup=lambda: None, meminfo='/nonexistent') == 2**28
    with pytest.raises(UsageError) as e:
        launch.slurm_cpus_per_task({'SLURM_CPUS_PER_TASK': '²'})
    one_sentence(e, 'SLURM_CPUS_PER_TASK')
    assert launch.slurm_cpus_per_task({'SLURM_CPUS_PER_TASK': '10'}) == 10
    assert launch.slurm_cpus_per_task({}) is None


def test_the_lightning_example_reads_slurm_through_the_parsers(monkeypatch):
    """Its bare int(SLURM_NNODES) was a traceback; SLURM_NTASKS_PER_NODE=x silently 'auto'."""
    pytest.importorskip('lightning.pytorch', reason='Lightning is optional')
    spec = importlib.util.spec_from_file_location(
        'lightning_resnet50', os.path.join(ROOT, 'examples', 'lightning_resnet50.py'))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setenv('SLURM_NTASKS_PER_NODE', 'x')
    with pytest.raises(UsageError) as e:
        mod.get_args_parser()
    one_sentence(e, 'SLURM_NTASKS_PER_NODE')
    monkeypatch.setenv('SLURM_NTASKS_PER_NODE', '4')
    args = mod.get_args_parser().parse_args([])
    assert args.devices == '4'
    monkeypatch.setenv('SLURM_NNODES', 'two')
    with pytest.raises(UsageError) as e:
        mod.main(args)
    one_sentence(e, 'SLURM_NNODES')


# --------------------------------------------------------------------- any text, every parser

@pytest.mark.parametrize('name', sorted(E.PARSERS))
@settings(deadline=1000, max_examples=60)
@given(text=ANY)
def test_any_text_gives_a_value_or_one_sentence(name, text):
    try:
        E.read(name, {name: text})
    except UsageError as e:
        assert str(e).startswith(f'{name}=') and '\n' not in str(e) and len(str(e)) < 400


@settings(deadline=1000, max_examples=100)
@given(name=st.sampled_from(sorted(k for k in E.PARSERS if k.startswith('SLURM_'))), text=ANY)
def test_any_srun_variable_gives_dist_info_or_one_sentence(name, text):
    try:
        launch.get_dist_info({**SRUN, name: text})
    except UsageError as e:
        assert '\n' not in str(e)


@settings(deadline=1000, max_examples=60)
@given(name=st.sampled_from(sorted(TORCHRUN)), text=ANY)
def test_any_torchrun_variable_gives_dist_info_or_one_sentence(name, text):
    try:
        launch.get_dist_info({**TORCHRUN, name: text})
    except UsageError as e:
        assert '\n' not in str(e)


@settings(deadline=1000, max_examples=100)
@given(fault=st.one_of(st.text(max_size=40), FAULTISH),
       restart=ANY)
def test_any_fault_and_restart_count_give_failpoints_or_one_sentence(fault, restart):
    try:
        E.faults({'DLOJZ_FAULT': fault, 'SLURM_RESTART_COUNT': restart})
    except UsageError as e:
        assert '\n' not in str(e)


@settings(deadline=1000, max_examples=60)
@given(name=st.sampled_from(['OMP_NUM_THREADS', 'DLOJZ_REGION_DECODE', 'DLOJZ_HANDOVER',
                             'DLOJZ_MASTER_SUFFIX', 'DLOJZ_FAULT', 'SLURM_RESTART_COUNT',
                             'DLOJZ_AS_IF_CUDA']),
       text=ANY)
def test_the_start_up_check_gives_nothing_or_one_sentence(name, text):
    try:
        E.check_environment({name: text})
    except UsageError as e:
        assert '\n' not in str(e)
