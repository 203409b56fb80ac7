"""--stage-dir (data.stage): the shards copied to a node-local folder once, then read there.

- the copy is the source byte for byte; a second start finds it complete and copies nothing;
- a copy SIGKILLed in the middle of a file is never taken for complete: the next start keeps the files the
  journal lists whole, copies the rest, and the result is whole; a shard prepared again is copied again;
- too little room: one sentence before the first byte (DiskFull, exit 6); a disk that fills during the copy
  (a real tmpfs where mounting one is permitted): the same, with the unfinished file removed;
- a run with --stage-dir trains to the same losses as the run reading the shards in place, reads them from
  the copy, and says what was copied in summary.json; ImageFolder data are noted as not staged;
- two ranks on one node: one copy (slow tier).

Run: python -m pytest -q tests/test_stage.py"""
import filecmp
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections import namedtuple

import pytest

from conftest import ROOT, TINY, run_cli, torchrun
import dlojz
from dlojzlib.data import datasets as D
from dlojzlib.data import shards as S
from dlojzlib.data import stage as G
from dlojzlib.errors import DiskFull

Usage = namedtuple('Usage', 'total used free')


@pytest.fixture(scope='module')
def shards(cache_dir, tmp_path_factory):
    src = os.path.join(cache_dir, 'synthetic-v1-c4-n24-v6-s0')  # what TINY trains on
    D.ensure_synthetic_dataset(src, 4, 24, 6, 0, log=lambda m: None)
    dst = str(tmp_path_factory.mktemp('shards') / 'ds')
    S.prepare(src, dst, shard_size_mb=2, log=lambda m: None)
    return dst


def same_files(src, dest):
    names = [n for n, _, _ in G.files_to_copy(src)]
    match, mismatch, errors = filecmp.cmpfiles(src, dest, names, shallow=False)
    return len(names) > 3 and match == names and not mismatch and not errors


def test_copy_is_whole_and_a_second_start_copies_nothing(shards, tmp_path):
    lines = []
    rec = G.stage(shards, str(tmp_path / 'local'), log=lines.append)
    total = sum(os.path.getsize(os.path.join(shards, n)) for n, _, _ in G.files_to_copy(shards))
    assert rec['copied_bytes'] == rec['bytes'] == total and not rec['skipped'] and rec['seconds'] >= 0
    assert same_files(shards, rec['dir']) and not [n for n in os.listdir(rec['dir']) if n.endswith('.part')]
    again = G.stage(shards, str(tmp_path / 'local'), log=lines.append)
    assert again['skipped'] and again['copied_bytes'] == 0 and again['dir'] == rec['dir']
    assert 'nothing to copy' in lines[-1]


@pytest.mark.parametrize('damage', ['delete', 'truncate'])
def test_a_copy_changed_after_staging_is_copied_again(shards, tmp_path, damage):
    """Issue 40: a staged shard deleted or truncated on the local disk after a complete copy read
    "already holds the 14 files ... nothing to copy", then the run failed and advised a new prepare.
    The copy is checked against what was copied (each file's size) at every start: the changed file
    is copied again, and only it."""
    local = str(tmp_path / 'local')
    rec = G.stage(shards, local, log=lambda m: None)
    name = [n for n, _, _ in G.files_to_copy(shards) if n.endswith('.tar')][0]
    path = os.path.join(rec['dir'], name)
    if damage == 'delete':
        os.remove(path)
    else:
        with open(path, 'r+b') as f:
            f.truncate(os.path.getsize(path) // 2)
    lines = []
    again = G.stage(shards, local, log=lines.append)
    assert not again['skipped']
    assert again['copied_bytes'] == os.path.getsize(os.path.join(shards, name))
    assert any(f'1 file(s) of the copy in {rec["dir"]} changed since it was made ({name} first' in x
               for x in lines), lines
    assert same_files(shards, rec['dir'])


@pytest.mark.parametrize('where', ['the same folder', 'empty'])
def test_a_stage_dir_that_cannot_be_used_is_refused(shards, cache_dir, tmp_path, capsys, where):
    """--stage-dir equal to --data-dir copied the dataset into itself; --stage-dir "" (an unset
    $SLURM_TMPDIR in quotes) was silently ignored. Both: one sentence, exit 2, nothing written."""
    stage_dir = shards if where == 'the same folder' else ''
    before = sorted(os.listdir(shards))
    code = dlojz.cli([*TINY, '--cache-dir', cache_dir, '--data-dir', shards, '--test-nsteps', '1',
                      '--output-dir', str(tmp_path / 'run'), '--stage-dir', stage_dir])
    err = capsys.readouterr().err
    assert code == 2 and 'Traceback' not in err
    assert ('is the shards folder' if stage_dir else '--stage-dir is empty') in err, err
    assert sorted(os.listdir(shards)) == before and not (tmp_path / 'run').exists()


def test_progress_lines_give_bytes_rate_and_time_left(shards, tmp_path, monkeypatch):
    monkeypatch.setattr(G, 'CHUNK', 2**20)
    ticks = iter(range(0, 10000, 2))  # a clock that advances 2 s per read: 1 MiB every 2 s
    lines = []
    G.stage(shards, str(tmp_path / 'local'), log=lines.append, clock=lambda: next(ticks))
    progress = [ln for ln in lines if ' MB/s, ' in ln]
    assert progress, lines
    # 1 MiB per 2 s = 0.52 MB/s: printed as 1 MB/s with no decimals
    assert all(ln.endswith(' s left') and ' of ' in ln for ln in progress)


KILLER = textwrap.dedent('''
    import os, signal, sys
    sys.path.insert(0, {root!r})
    from dlojzlib.data import stage as G
    G.CHUNK = 256 * 1024
    calls = [0]
    def clock():
        calls[0] += 1
        if calls[0] == {at}:  # in the middle of a file: some chunks written, not renamed
            os.kill(os.getpid(), signal.SIGKILL)
        return 0.0
    G.stage({src!r}, {dst!r}, log=lambda m: None, clock=clock)
''')


def test_a_copy_killed_mid_file_is_not_taken_for_complete(shards, tmp_path):
    local = str(tmp_path / 'local')
    r = subprocess.run([sys.executable, '-c', KILLER.format(root=ROOT, at=12, src=shards, dst=local)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr
    dest = G.destination(shards, local)
    assert not os.path.exists(os.path.join(dest, G.DONE))
    assert [n for n in os.listdir(dest) if n.endswith('.part')]  # killed inside a file
    with open(os.path.join(dest, G.JOURNAL)) as f:
        whole = [json.loads(line)[0] for line in f]
    assert whole  # some files were finished before the kill
    files = G.files_to_copy(shards)
    rec = G.stage(shards, local, log=lambda m: None)
    assert not rec['skipped'] and rec['copied_bytes'] == sum(s for n, s, _ in files if n not in whole)
    assert same_files(shards, dest)


def test_a_shard_prepared_again_is_copied_again(shards, tmp_path):
    src = str(tmp_path / 'src')
    subprocess.run(['cp', '-a', shards, src], check=True)
    local = str(tmp_path / 'local')
    G.stage(src, local, log=lambda m: None)
    name = G.files_to_copy(src)[-1][0]
    with open(os.path.join(src, name), 'r+b') as f:  # the same size, other bytes, a new mtime
        f.write(b'\1' * 16)
    os.utime(os.path.join(src, name), ns=(0, 10**18))
    rec = G.stage(src, local, log=lambda m: None)
    assert rec['copied_bytes'] == os.path.getsize(os.path.join(src, name)) and same_files(src, rec['dir'])


def test_too_little_room_stops_before_the_first_byte(shards, tmp_path):
    local = str(tmp_path / 'local')
    with pytest.raises(DiskFull) as e:
        G.stage(shards, local, log=lambda m: None, usage=lambda p: Usage(10**9, 10**9 - 5000, 5000))
    msg = str(e.value)
    assert msg.startswith(f'--stage-dir {local} has 0 MB free and the shards need ') and 'leave --stage-dir out' \
        in msg and '\n' not in msg
    assert os.listdir(G.destination(shards, local)) == ['.lock']


@pytest.fixture
def small_tmpfs(tmp_path):
    mnt = tmp_path / 'tmpfs'
    mnt.mkdir()
    r = subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=1m', 'tmpfs', str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f'cannot mount a tmpfs here: {r.stderr.decode().strip()}')
    yield str(mnt)
    subprocess.run(['umount', str(mnt)], check=False)


def test_a_disk_that_fills_during_the_copy(shards, small_tmpfs):
    """The free-space check is told there is room (a disk shared with another job can fill after
    it)."""
    roomy = lambda p: Usage(10**12, 0, 10**12)  # noqa: E731
    with pytest.raises(DiskFull) as e:
        G.stage(shards, small_tmpfs, log=lambda m: None, usage=roomy)
    assert str(e.value).startswith(f'--stage-dir {small_tmpfs} filled during the copy (')
    dest = G.destination(shards, small_tmpfs)
    assert not [n for n in os.listdir(dest) if n.endswith('.part')] and not os.path.exists(
        os.path.join(dest, G.DONE))


def losses(out):
    with open(os.path.join(out, 'metrics.jsonl')) as f:
        return {r['global_step']: r['loss'] for r in map(json.loads, f) if r['type'] == 'train'}


def test_a_run_reads_the_copy_and_trains_as_in_place(shards, cache_dir, tmp_path):
    flags = [*TINY, '--cache-dir', cache_dir, '--data-dir', shards, '--test-nsteps', '4', '--log-interval', '1']
    assert dlojz.cli([*flags, '--output-dir', str(tmp_path / 'ref')]) == 0
    local = str(tmp_path / 'local')
    assert dlojz.cli([*flags, '--output-dir', str(tmp_path / 'run'), '--stage-dir', local]) == 0
    with open(tmp_path / 'run' / 'summary.json') as f:
        s = json.load(f)
    st = s['data']['staging']
    assert st['used'] and st['from'] == shards and s['data']['root'] == st['dir'] == G.destination(shards, local)
    assert st['copied_bytes'] == st['bytes'] > 0 and len(st['nodes']) == 1
    assert s['data']['shard_file_opens'] > 0 and losses(tmp_path / 'run') == losses(tmp_path / 'ref')
    assert s['val']['images'] == 24
    assert dlojz.cli([*flags, '--output-dir', str(tmp_path / 'again'), '--stage-dir', local]) == 0
    with open(tmp_path / 'again' / 'summary.json') as f:
        assert json.load(f)['data']['staging']['copied_bytes'] == 0


@pytest.mark.slow  # 4 s; the fast tier stages shards (test_a_run_reads_the_copy...)
def test_folder_data_are_read_in_place_and_recorded_as_not_staged(cache_dir, tmp_path):
    r = run_cli(*TINY, '--cache-dir', cache_dir, '--test-nsteps', '1', '--output-dir', tmp_path / 'run',
                '--stage-dir', tmp_path / 'local')
    assert r.returncode == 0, r.stderr[-2000:]
    assert 'Note: --stage-dir ' in r.stdout + r.stderr and 'not used: the data are synthetic' in r.stdout + r.stderr
    with open(tmp_path / 'run' / 'summary.json') as f:
        st = json.load(f)['data']['staging']
    assert st['used'] is False and 'only shards' in st['reason']
    assert not os.path.exists(tmp_path / 'local')


def test_a_full_local_disk_is_one_sentence_and_exit_6(shards, cache_dir, small_tmpfs, tmp_path):
    r = run_cli(*TINY, '--cache-dir', cache_dir, '--data-dir', shards, '--test-nsteps', '1',
                '--output-dir', tmp_path / 'run', '--stage-dir', small_tmpfs)
    assert r.returncode == 6 and 'Traceback' not in r.stderr, r.stderr[-2000:]
    assert f'--stage-dir {small_tmpfs} has ' in r.stderr and 'the shards need' in r.stderr
    assert not os.path.exists(tmp_path / 'run')  # stopped before the run wrote anything


@pytest.mark.slow
def test_two_ranks_on_a_node_copy_once(shards, cache_dir, tmp_path):
    local = tmp_path / 'local'
    p = torchrun(2, *TINY, '--cache-dir', cache_dir, '--data-dir', shards, '--test-nsteps', '2',
                 '--output-dir', tmp_path / 'run', '--stage-dir', local)
    assert p.returncode == 0, p.stderr[-3000:]
    with open(tmp_path / 'run' / 'summary.json') as f:
        s = json.load(f)
    st = s['data']['staging']
    assert len(st['nodes']) == 1 and st['copied_bytes'] == st['bytes'] and s['val']['images'] == 24
    assert (p.stdout + p.stderr).count('Staging: copying ') == 1


@pytest.mark.slow  # 8 s: two nodes' copies
def test_a_variable_in_stage_dir_is_each_nodes_own(shards, cache_dir, tmp_path):
    """The Alliance scripts pass '$SLURM_TMPDIR' unexpanded: each task reads its own node's value;
    unset, one sentence."""
    flags = [*TINY, '--cache-dir', cache_dir, '--data-dir', shards, '--test-nsteps', '1']
    r = run_cli(*flags, '--output-dir', tmp_path / 'run', '--stage-dir', '$SLURM_TMPDIR',
                env={'SLURM_TMPDIR': str(tmp_path / 'node-local')})
    assert r.returncode == 0, r.stderr[-2000:]
    assert os.path.isfile(os.path.join(G.destination(shards, str(tmp_path / 'node-local')), G.DONE))
    env = {k: v for k, v in os.environ.items() if k != 'SLURM_TMPDIR'}
    r = subprocess.run([sys.executable, os.path.join(ROOT, 'dlojz.py'), *flags, '--output-dir', str(tmp_path / 'x'),
                        '--stage-dir', '$SLURM_TMPDIR'], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2 and 'Traceback' not in r.stderr
    assert '--stage-dir $SLURM_TMPDIR: $SLURM_TMPDIR is not set on ' in r.stderr
