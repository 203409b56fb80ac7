"""A full disk (issue 21, item 4): whichever file a run is writing when the space runs out (a
checkpoint, summary.json, metrics.jsonl, config.json), the user gets one sentence, "no space left on
<folder> (N MiB free)", exit code 6 and status 'disk_full' where summary.json can still be written;
no temp file is left, every earlier checkpoint stays whole and loadable, and summary.json never
describes an earlier attempt as the current state (each attempt starts by writing its own 'running'
summary). Free space is checked before each checkpoint against the newest one's size, with a warning
while there is still room.

Two ways: OSError(ENOSPC) injected at each write site through record.log.open_for_write
(table-driven, in process), and a real full filesystem (a small tmpfs, where mounting one is
permitted).

Run: python -m pytest -q tests/test_disk_full.py"""
import errno
import glob
import json
import os
import shutil
import subprocess
import tempfile
from collections import namedtuple

import pytest
import torch

from conftest import TINY, run_cli
import dlojz
from dlojzlib.record import checkpoint
from dlojzlib.record import log
from test_exits import at_step, usr2


class FullFile:
    """A file on a disk that has `room` bytes left: the write that would pass it writes what fits,
    then raises ENOSPC (as a buffered file's write does when write(2) comes back short, then fails).
    """

    def __init__(self, f, room):
        self.f, self.room = f, room

    def write(self, b):
        if len(b) > self.room:
            self.f.write(b[:self.room])
            self.room = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.f.name)
        self.room -= len(b)
        return self.f.write(b)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def fill_at(pattern, nth, room=0):
    """An open_for_write whose opens of a file whose name contains `pattern` get `room` bytes from
    the nth on."""
    seen = [0]

    def opener(path, mode='r', *a, **kw):
        f = open(path, mode, *a, **kw)
        if pattern in os.path.basename(path):
            seen[0] += 1
            if seen[0] >= nth:
                return FullFile(f, room)
        return f
    return opener


Usage = namedtuple('Usage', 'total used free')


def run(capsys, out, *flags):
    code = dlojz.cli([*TINY, '--output-dir', str(out), *[str(f) for f in flags]])
    return code, capsys.readouterr()


def error_line(err):
    assert 'Traceback' not in err, err
    lines = [line for line in err.splitlines() if line.startswith('dlojz: error:')]
    assert len(lines) == 1, err
    return lines[0]


def assert_intact(out, steps, exact=True, killed=False):
    """The checkpoints of these steps are there (and no other when exact) and every checkpoint
    loads; no temp file anywhere (but the one a kill left: the next start removes it)."""
    names = [os.path.basename(p) for p in checkpoint.list_checkpoints(str(out))]
    wanted = [f'checkpoint-{s:08d}.pt' for s in steps]
    assert names == wanted if exact else set(wanted) <= set(names), names
    for path in checkpoint.list_checkpoints(str(out)):
        step = torch.load(path, map_location='cpu', weights_only=False)['global_step']
        assert path.endswith(f'checkpoint-{step:08d}.pt')
    if killed:
        return
    assert not glob.glob(os.path.join(out, '*.tmp')) and not glob.glob(os.path.join(out, '.*.tmp'))


# site -> (file name pattern, from which open of it on the disk is full, bytes left then, the status
# summary.json holds afterwards (None: no summary), checkpoints left)
SITES = {
    # the second checkpoint (step 4): torch's zip writer fails partway through
    'checkpoint': ('.checkpoint-', 2, 10_000, 'disk_full', [2]),
    # every summary, from the 'running' one at the start: nothing trained, no summary, nothing else
    # lost
    'summary-start': ('summary.json', 1, 100, None, []),
    # the final summaries: this attempt's 'running' record stays, never a half-written file
    'summary-end': ('summary.json', 2, 100, 'running', [2, 4]),
    # metrics.jsonl: full after its first records
    'metrics': ('metrics.jsonl', 1, 250, 'disk_full', []),
    'config': ('config.json', 1, 10, 'disk_full', []),
}


@pytest.mark.parametrize('site', list(SITES))
def test_enospc_at_each_write_site(site, tmp_path, cache_dir, monkeypatch, capsys):
    pattern, nth, room, status, kept = SITES[site]
    monkeypatch.setattr(log, 'open_for_write', fill_at(pattern, nth, room))
    monkeypatch.setattr(log, 'disk_usage',
                        lambda p: Usage(100 * 2**30, 100 * 2**30 - 3 * 2**20, 3 * 2**20))
    out = tmp_path / 'run'
    code, cap = run(capsys, out, '--cache-dir', cache_dir, '--test-nsteps', '4', '--chkpt-every', '2', '--log-interval',
                    '1')
    line = error_line(cap.err)
    assert code == 6
    assert f'no space left on {out} (3 MiB free) while writing' in line and 'continue with --resume auto' in line, line
    assert_intact(out, kept)
    summary = json.load(open(out / 'summary.json')) if (out / 'summary.json').exists() else None
    assert (summary or {}).get('status') == status
    if status == 'disk_full':
        assert summary['error'] in line and summary['disk_full_path'].startswith(str(out))
    if status == 'running':  # this attempt's: its config, the step it started from
        assert summary['config']['output_dir'] == str(out) and summary['global_step'] == 0
    if site == 'metrics':  # the lines written before stay whole; the half of the refused one goes
        text = open(out / 'metrics.jsonl').read()
        records = [json.loads(x) for x in text.splitlines()]
        assert text.endswith('\n') and records and all(r['type'] == 'train' for r in records)
    if site == 'config':
        assert not (out / 'config.json').exists()


def test_resumed_attempt_never_leaves_the_previous_summary(tmp_path, cache_dir, monkeypatch, capsys):
    """A preempted run, then a resumed attempt whose final summary cannot be written: summary.json
    is that attempt's 'running' record, not the first attempt's 'preempted' one."""
    out = tmp_path / 'run'
    monkeypatch.setattr(dlojz, 'train_step', at_step(2, usr2))
    code, cap = run(capsys, out, '--cache-dir', cache_dir, '--test-nsteps', '4', '--chkpt')
    assert code == 5 and json.load(open(out / 'summary.json'))['status'] == 'preempted'
    monkeypatch.undo()
    monkeypatch.setattr(log, 'open_for_write', fill_at('summary.json', 2, 100))
    code, cap = run(capsys, out, '--cache-dir', cache_dir, '--test-nsteps', '4', '--chkpt', '--resume', 'auto')
    assert code == 6 and 'summary.json' in error_line(cap.err)
    summary = json.load(open(out / 'summary.json'))
    assert summary['status'] == 'running' and summary['global_step'] == 2  # where this attempt started
    assert_intact(out, [2], exact=False)  # and the final one, whatever --test-nsteps counts from on a resume


@pytest.mark.slow  # a subprocess: ~10 s on 2 idle cores
def test_killed_attempt_never_leaves_the_previous_summary(tmp_path, cache_dir, monkeypatch, capsys):
    """A preempted run, then a resumed attempt killed (SIGKILL, as a node failure) while writing its
    first checkpoint: summary.json says 'running' with that attempt's start, not 'preempted' as if
    it were current."""
    out = tmp_path / 'run'
    monkeypatch.setattr(dlojz, 'train_step', at_step(2, usr2))
    code, cap = run(capsys, out, '--cache-dir', cache_dir, '--test-nsteps', '4', '--chkpt')
    assert code == 5 and json.load(open(out / 'summary.json'))['status'] == 'preempted'
    r = run_cli(*TINY, '--cache-dir', cache_dir, '--output-dir', out, '--test-nsteps', '4', '--chkpt', '--resume',
                'auto', env={'DLOJZ_FAULT': 'kill-in-checkpoint:1'})
    assert r.returncode == -9, r.stderr
    summary = json.load(open(out / 'summary.json'))
    assert summary['status'] == 'running' and summary['global_step'] == 2 and summary['error'] is None
    assert_intact(out, [2], killed=True)


def test_translate_a_write_site_not_wrapped(tmp_path):
    """A profiler trace or any other write that raises ENOSPC itself still ends as disk_full, exit
    6."""
    from dlojzlib import errors as E
    args = dlojz.get_args_parser().parse_args([])
    err = E.translate(OSError(errno.ENOSPC, 'No space left on device', str(tmp_path / 'trace.json')), args, step=3)
    assert type(err) is E.DiskFull and (err.status, err.exit_code) == ('disk_full', 6)
    assert str(err).startswith(f'no space left on {tmp_path} (') and 'trace.json' in str(err)
    assert err.extra['failed_step'] == 3
    assert E.translate(OSError(errno.EACCES, 'Permission denied'), args) is None  # another OSError: a crash


def test_space_warning():
    """Twice the newest checkpoint's size is the line: this write and the next."""
    with tempfile.TemporaryDirectory() as d:
        # no checkpoint yet: no size to go by
        assert checkpoint.space_warning(d, lambda p: Usage(0, 0, 0)) is None
        with open(checkpoint.checkpoint_path(d, 2), 'wb') as f:
            f.write(b'x' * 2**20)
        at = lambda mib: checkpoint.space_warning(d, lambda p: Usage(0, 0, int(mib * 2**20)))
        assert at(2) is None
        assert 'room for one more checkpoint only' in at(1.5) and '2 MiB free' in at(1.5)
        assert 'the next checkpoint will not fit' in at(0.5)


@pytest.fixture
def small_tmpfs():
    """A 150 MiB tmpfs (a checkpoint of the tiny run takes ~85 MiB); skipped where mounting is not
    permitted."""
    d = tempfile.mkdtemp(prefix='dlojz-tmpfs-')
    try:
        r = subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=150m', 'tmpfs', d], capture_output=True, text=True)
    except OSError as e:
        r = e
    if not isinstance(r, subprocess.CompletedProcess) or r.returncode != 0:
        os.rmdir(d)
        pytest.skip(f'cannot mount a tmpfs here ({getattr(r, "stderr", r)})')
    try:
        yield d
    finally:
        subprocess.run(['umount', d], check=True)
        os.rmdir(d)


def test_real_full_filesystem(small_tmpfs, cache_dir, capsys):
    out = os.path.join(small_tmpfs, 'run')
    code, cap = run(capsys, out, '--cache-dir', cache_dir, '--test-nsteps', '4', '--chkpt-every', '2')
    assert code == 6, cap.err
    warnings = [line for line in cap.err.splitlines() if line.startswith('dlojz: warning:')]
    assert len(warnings) == 1 and 'the next checkpoint will not fit' in warnings[0], cap.err  # before step 4's
    free = shutil.disk_usage(small_tmpfs).free / 2**20
    line = error_line(cap.err)
    assert f'no space left on {out} (' in line and 'checkpoint-00000004.pt' in line, line
    assert abs(float(line.split(f'{out} (')[1].split(' MiB')[0]) - free) <= 1  # what df says, once the temp file went
    assert_intact(out, [2])
    summary = json.load(open(os.path.join(out, 'summary.json')))
    assert summary['status'] == 'disk_full'
