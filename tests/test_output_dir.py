"""A run folder holds one run: a second run into a folder that holds another is refused with a sentence and
nothing of the first is touched; --overwrite replaces it (its checkpoints included); --resume continues it.
Each checkpoint write prints its path and step. A folder has one owner at a time (FolderLock): flock, or an
O_EXCL owner file where the file system has no flock, whose stale claims are taken over.

Run: python -m pytest -q tests/test_output_dir.py
"""
import errno
import json
import os
import socket
import subprocess

import pytest

from conftest import TINY
import dlojz


def cli(out, cache_dir, *flags):
    return dlojz.cli([*TINY, '--cache-dir', cache_dir, '--output-dir', str(out), '--test-nsteps', '2', '--chkpt',
                      *map(str, flags)])


def snapshot(out):
    return {n: open(os.path.join(out, n), 'rb').read() for n in sorted(os.listdir(out))}


def test_a_folder_holds_one_run(tmp_path, cache_dir, capsys):
    out = tmp_path / 'run'
    assert cli(out, cache_dir) == 0
    assert f'Checkpoint {out}/checkpoint-00000002.pt written (step 2)' in capsys.readouterr().out
    first = snapshot(out)
    assert cli(out, cache_dir, '--seed', '7') == 2
    err = capsys.readouterr().err
    assert f'dlojz: error: --output-dir {out} already holds a run (checkpoint-00000002.pt, config.json, ' \
           f'metrics.jsonl, summary.json); pass --resume auto to continue it, --overwrite to replace it' in err
    assert snapshot(out) == first
    assert cli(out, cache_dir, '--seed', '7', '--test-nsteps', '1', '--overwrite') == 0
    assert sorted(os.listdir(out)) == ['checkpoint-00000001.pt', 'config.json', 'metrics.jsonl', 'summary.json']
    second = snapshot(out)
    assert cli(out, cache_dir, '--seed', '7', '--test-nsteps', '1', '--resume', 'auto') == 0  # the same command
    assert f'dlojz: the run in {out} is complete (step 1, validation top-1 ' in capsys.readouterr().err
    assert snapshot(out) == second
    assert cli(out, cache_dir, '--seed', '7', '--test-nsteps', '2', '--resume', 'auto') == 0  # a longer one
    assert 'continuing from' in capsys.readouterr().out


def test_an_early_error_leaves_no_empty_folder(tmp_path, cache_dir, capsys):
    out = tmp_path / 'run'
    assert cli(out, cache_dir, '--data-dir', tmp_path / 'missing') == 2
    assert 'does not exist' in capsys.readouterr().err and not out.exists()


def test_a_run_name_is_continued_until_its_run_is_over(tmp_path, cache_dir, capsys, monkeypatch):
    """--run-name: the folder a resubmitted job (new job id) continues. A completed run there says so and stays
    as it is (as with --output-dir); one that ended in NaN or OOM is kept, and the next run goes to <name>.2; a
    preempted run there is continued."""
    monkeypatch.chdir(tmp_path)

    def named(*flags):
        return dlojz.cli([*TINY, '--cache-dir', cache_dir, '--test-nsteps', '2', '--chkpt', '--run-name', 'r',
                          '--resume', 'auto', *flags])
    monkeypatch.setenv('SLURM_JOB_ID', '101')
    assert named() == 0 and os.path.exists('runs/r/summary.json') and not os.path.exists('runs/r.2')
    first = snapshot('runs/r')
    monkeypatch.setenv('SLURM_JOB_ID', '102')
    assert named() == 0
    assert 'dlojz: the run in runs/r is complete (step 2' in capsys.readouterr().err
    assert snapshot('runs/r') == first and not os.path.exists('runs/r.2')
    with open('runs/r/summary.json') as f:
        summary = json.load(f)
    with open('runs/r/summary.json', 'w') as f:  # a run that ended in NaN: continuing it would repeat its end
        json.dump({**summary, 'status': 'nan'}, f)
    first = snapshot('runs/r')
    monkeypatch.setenv('SLURM_JOB_ID', '103')
    assert named() == 0
    assert 'runs/r holds a finished run (nan); this run goes to runs/r.2' in capsys.readouterr().out
    assert snapshot('runs/r') == first and os.path.exists('runs/r.2/checkpoint-00000002.pt')
    with open('runs/r.2/summary.json') as f:  # what a preempted run leaves (tests/test_preempt.py makes one)
        summary = json.load(f)
    with open('runs/r.2/summary.json', 'w') as f:
        json.dump({**summary, 'status': 'preempted'}, f)
    assert named('--test-nsteps', '3') == 0
    out = capsys.readouterr().out
    assert 'continuing from runs/r.2/checkpoint-00000002.pt' in out and 'runs/r.3' not in out
    assert not os.path.exists('runs/r.3')
    assert dlojz.cli([*TINY, '--cache-dir', cache_dir, '--run-name', 'r', '--output-dir', 'x']) == 2
    assert dlojz.cli([*TINY, '--cache-dir', cache_dir, '--run-name', 'a/b']) == 2
    err = capsys.readouterr().err
    assert '--run-name and --output-dir both name the run folder; give one.' in err
    assert "--run-name 'a/b' is not a folder name" in err
    assert not os.path.exists('x') and not os.path.exists('runs/a')


def test_a_duplicate_live_job_gets_its_own_folder(tmp_path):
    """The same script and flags submitted twice: the second job must not write into the folder the first,
    still alive, writes (a requeued job, same id, and a job after a dead one continue there)."""
    from dlojzlib.record.rundir import OWNER, named_run_dir
    root = tmp_path / 'runs'
    (root / 'r').mkdir(parents=True)
    (root / 'r' / OWNER).write_text('{"job_id": "11"}')
    alive = {'11'}
    assert named_run_dir('r', True, str(root), job_id='12', alive=alive.__contains__) == str(root / 'r.2')
    assert named_run_dir('r', True, str(root), job_id='11', alive=alive.__contains__) == str(root / 'r')  # requeued
    alive.clear()  # job 11 is over: job 12 continues its run
    assert named_run_dir('r', True, str(root), job_id='12', alive=alive.__contains__) == str(root / 'r')


def test_one_owner_per_folder_with_flock(tmp_path):
    from dlojzlib.errors import UsageError
    from dlojzlib.record.rundir import LOCK, FolderLock
    folder = str(tmp_path / 'run')
    first = FolderLock().acquire(folder, job_id='11')
    with open(os.path.join(folder, LOCK)) as f:
        assert json.load(f)['pid'] == os.getpid()
    with pytest.raises(UsageError, match=rf'--output-dir {folder} is in use by another dlojz run \(pid '
                                         rf'{os.getpid()} on {socket.gethostname()}, Slurm job 11, since '):
        FolderLock(wait_s=0).acquire(folder)  # another open file: flock refuses it, even in this process
    first.release()
    assert os.listdir(folder) == []  # the claim leaves nothing behind
    FolderLock().acquire(folder).release()


def test_the_owner_file_where_flock_is_missing(tmp_path):
    """A file system without flock (ENOLCK, as some Lustre/GPFS mounts): the claim is an O_EXCL file, and the
    one a killed run left is taken over when it is stale, never when its owner may live."""
    from dlojzlib.errors import UsageError
    from dlojzlib.record.rundir import LOCK_EXCL, FolderLock

    def no_flock(fd, operation):
        raise OSError(errno.ENOLCK, 'No locks available')
    folder, notes = tmp_path / 'run', []
    claim = lambda **kw: FolderLock(flock=no_flock, say=notes.append, alive=lambda job: True, **kw)
    first = claim().acquire(str(folder), job_id='11')
    owner = json.loads((folder / LOCK_EXCL).read_text())
    assert (owner['pid'], owner['host'], owner['job_id']) == (os.getpid(), socket.gethostname(), '11')
    with pytest.raises(UsageError, match=rf'is in use by another dlojz run \(pid {os.getpid()} on '):
        claim().acquire(str(folder), job_id='12')  # a live pid on this host
    first.release()
    assert os.listdir(folder) == []
    dead = subprocess.Popen(['true'])
    dead.wait()
    (folder / LOCK_EXCL).write_text(json.dumps({'pid': dead.pid, 'host': socket.gethostname(), 'job_id': None}))
    claim().acquire(str(folder)).release()  # killed on this host: stale
    assert notes and notes[-1].startswith(f'Removed the stale claim {folder / LOCK_EXCL} of a run that is over')
    (folder / LOCK_EXCL).write_text(json.dumps({'pid': 1, 'host': 'node2', 'job_id': '13'}))
    with pytest.raises(UsageError, match=r'\(pid 1 on node2, Slurm job 13, since None\)'):
        claim().acquire(str(folder), job_id='14')  # another node, a job squeue may still run
    claim(host='node3').acquire(str(folder), job_id='13').release()  # job 13 requeued on node3: its own claim
    assert os.listdir(folder) == []
