"""A run folder's own records read back (issue 49): summary.json, owner.json and the lock files,
metrics.jsonl, tune.json and tune-loader.json, a checkpoint's metadata. Whatever is at their path
(any bytes, any JSON value, a FIFO, a folder), each reader gives a value of its declared shape, a
relisting (a damaged summary.json is a run killed before it wrote it; metrics.jsonl's cut lines are
dropped; a damaged tune.json is kept aside) or one sentence naming the file, within a second: never
a traceback, never a hang.

Run: python -m pytest -q tests/test_record_readers.py      (the command-line runs: -m slow)
"""
import argparse
import json
import os
import subprocess
import sys
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import DLOJZ, ROOT, TINY
from dlojzlib.errors import Complete, UsageError
from dlojzlib.modes import tune as T
from dlojzlib.record import resume, rundir, state
from dlojzlib.record.checkpoint import load_checkpoint, load_latest_checkpoint
from strategies import json_values

JSON = json_values(text=20, keys=12, size=4, leaves=20)
FAST = settings(deadline=1000, max_examples=120,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


def within(seconds, fn, *fifos):
    """fn() in a thread -> its value (or its exception raised here); a failure when it is still
    running after `seconds`, the FIFOs then opened for writing so that a blocked read ends."""
    out = {}

    def go():
        try:
            out['value'] = fn()
        except BaseException as e:  # noqa: B902 - handed to the test's thread
            out['error'] = e
    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        for fifo in fifos:
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        t.join(5)
        pytest.fail(f'still reading after {seconds} s: blocked on a FIFO')
    if 'error' in out:
        raise out['error']
    return out.get('value')


def resume_args(out, **kw):
    a = dict(output_dir=str(out), test=True, test_nsteps=2, epochs=1, batch_size=8, accum_steps=1,
             evaluate=False, resume='auto', allow_batch_change=False, arch='resnet18', tune=False)
    return argparse.Namespace(**{**a, **kw})


DIST = argparse.Namespace(is_main=True, world_size=1)


def use_summary(out):
    """Everything --resume auto does with a run folder's summary.json (record.rundir's choices,
    record.state.check_resume) -> what it decided, or one sentence."""
    args = resume_args(out)
    done = rundir.completed_run(str(out))
    if done is not None:
        rundir.asks_nothing_more(done, args, 1)
        rundir.complete_sentence(str(out), done)
    rundir.run_status(str(out))
    T.holds_another_record(str(out))
    try:
        state.check_resume(args, DIST, None, None, None, None, None, 8, 3, 2)
    except (Complete, UsageError) as e:
        return str(e)
    return done


# ------------------------------------------------------------------------------- summary.json

def test_a_fifo_summary_json_is_refused_without_blocking(tmp_path):
    """It blocked in open() before dlojz printed a line, and SIGTERM did not end it (Python retries
    the open after its handler)."""
    os.mkfifo(tmp_path / 'summary.json')
    with pytest.raises(UsageError) as e:
        within(5, lambda: rundir.completed_run(str(tmp_path)), tmp_path / 'summary.json')
    assert f'{tmp_path}/summary.json is a FIFO, not a file' in str(e.value)
    assert 'remove it' in str(e.value) and '\n' not in str(e.value)


@pytest.mark.parametrize('text', [
    '[]', '{"status": 5}', '{"status": "completed", "global_step": "x"}',
    '{"status": "completed", "config": [1]}',
    '{"status": "completed", "data": "x", "global_batch": 8}',
    '{"status": "completed", "global_step": 2, "val": {"top1": "x"}, '
    '"config": {"test": true, "test_nsteps": 2, "epochs": 1}}'])
def test_a_damaged_summary_json_is_a_run_killed_before_it_wrote_it(tmp_path, text):
    """A string step compared with the run's end (TypeError), a config that is a list, a top-1 that
    is text (ValueError in the 'complete' sentence): tracebacks. Now the record reads as none."""
    (tmp_path / 'summary.json').write_text(text)
    assert use_summary(tmp_path) is None
    said = []
    assert rundir.run_record(str(tmp_path), said.append) is None
    assert said and said[0].startswith(f'Note: {tmp_path}/summary.json ') and \
        'killed before it wrote' in said[0], said


def test_a_complete_summary_still_reads(tmp_path):
    (tmp_path / 'summary.json').write_text(json.dumps(
        {'status': 'completed', 'global_step': 2, 'global_batch': 8, 'val': {'top1': 0.5},
         'config': {'test': True, 'test_nsteps': 2, 'epochs': 1},
         'data': {'batches_per_epoch': 12}}))
    assert 'is complete (step 2, validation top-1 0.5000)' in use_summary(tmp_path)


@FAST
@given(data=st.binary(max_size=200) | JSON.map(lambda v: json.dumps(v).encode()))
def test_any_summary_json_gives_a_record_none_or_one_sentence(tmp_path_factory, data):
    out = tmp_path_factory.mktemp('s')
    (out / 'summary.json').write_bytes(data)
    t = time.monotonic()
    got = use_summary(out)
    assert got is None or isinstance(got, (dict, str)) and '\n' not in str(got)
    assert time.monotonic() - t < 1


# ------------------------------------------------------------------------ owner.json, lock files

def test_a_fifo_owner_json_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / rundir.OWNER)
    with pytest.raises(UsageError) as e:
        within(5, lambda: rundir.held_by_another_job(str(tmp_path), '12', lambda j: True),
               tmp_path / rundir.OWNER)
    assert f'{tmp_path}/owner.json is a FIFO, not a file' in str(e.value)


@pytest.mark.parametrize('text', ['{"job_id": [1]}', '{"job_id": "-h"}', '{"job_id": "1 2"}', '7'])
def test_an_owner_that_is_no_job_id_holds_nothing(tmp_path, text):
    """squeue was asked about '[1]' (and answered by a fake, that it lives)."""
    (tmp_path / rundir.OWNER).write_text(text)
    asked = []
    held = rundir.held_by_another_job(str(tmp_path), '12', lambda j: asked.append(j) or True)
    assert held is False
    assert asked == []


@FAST
@given(data=st.binary(max_size=100) | JSON.map(lambda v: json.dumps({'job_id': v}).encode())
       | JSON.map(lambda v: json.dumps(v).encode()))
def test_any_owner_json_holds_a_folder_or_not(tmp_path_factory, data):
    out = tmp_path_factory.mktemp('o')
    (out / rundir.OWNER).write_bytes(data)
    (out / rundir.LOCK).write_bytes(data)
    asked = []
    held = rundir.held_by_another_job(str(out), '12', lambda j: asked.append(j) or True)
    assert held in (True, False) and all(j.isdigit() for j in asked)
    owner = rundir._read_owner(str(out / rundir.LOCK))
    assert owner is None or isinstance(owner, dict)
    assert '\n' not in rundir.busy_sentence(str(out), owner)


@pytest.mark.parametrize('job_id', ['', '4242', None])
def test_the_claim_a_run_writes_is_read_back_whole(tmp_path, job_id):
    """Outside Slurm the claim's job_id is '': its shape refused it, so a busy folder's sentence
    said 'its owner is not recorded' and a dead run's stale claim could not be told from a live
    one (the long tier's test_a_second_run_in_a_busy_folder_is_refused found it)."""
    from dlojzlib.record.rundir import FolderLock, _read_owner
    lock = FolderLock(host='h', pid=os.getpid())
    lock.acquire(str(tmp_path), job_id=job_id)
    try:
        owner = _read_owner(lock.token or lock.path)
        assert owner is not None and owner['pid'] == os.getpid() and owner['job_id'] == job_id
    finally:
        lock.release()


def test_a_fifo_lock_claim_is_not_read(tmp_path):
    os.mkfifo(tmp_path / rundir.LOCK_EXCL)
    assert within(5, lambda: rundir._read_owner(str(tmp_path / rundir.LOCK_EXCL)),
                  tmp_path / rundir.LOCK_EXCL) is None


# --------------------------------------------------------------------------------- metrics.jsonl

def test_a_fifo_metrics_jsonl_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / 'metrics.jsonl')
    with pytest.raises(UsageError) as e:
        within(5, lambda: rundir.trim_metrics(str(tmp_path / 'metrics.jsonl'), None, 3),
               tmp_path / 'metrics.jsonl')
    assert f'{tmp_path}/metrics.jsonl is a FIFO, not a file' in str(e.value)


def test_a_deeply_nested_metrics_line_is_a_cut_line(tmp_path):
    """json.loads raised RecursionError through trim_metrics."""
    path = tmp_path / 'metrics.jsonl'
    path.write_bytes(b'{"global_step": 1}\n' + b'[' * 100000 + b'\n{"global_step": 5}\n')
    assert rundir.trim_metrics(str(path), None, 3) == 2
    assert path.read_bytes() == b'{"global_step": 1}\n'


@FAST
@given(lines=st.lists(st.binary(max_size=30) | JSON.map(json.dumps).map(str.encode)
                      | st.integers(-3, 9).map(lambda s: json.dumps({'global_step': s}).encode())
                      | JSON.map(lambda s: json.dumps({'global_step': s}).encode()), max_size=8),
       size=st.none() | st.integers(0, 400))
def test_any_metrics_jsonl_keeps_the_steps_up_to_the_checkpoint(tmp_path_factory, lines, size):
    path = tmp_path_factory.mktemp('m') / 'metrics.jsonl'
    data = b'\n'.join(line.replace(b'\n', b' ') for line in lines) + b'\n'
    path.write_bytes(data)
    dropped = rundir.trim_metrics(str(path), size, 3)
    kept = path.read_bytes()
    assert isinstance(dropped, int) and dropped >= 0 and len(kept) <= len(data)
    if size is None:  # every line kept is a record of a step up to 3, or one without a step
        for line in kept.splitlines():
            step = json.loads(line).get('global_step')
            assert step is None or step <= 3


# ------------------------------------------------------------------------------------- tune.json

def tune_args(tmp_path):
    return argparse.Namespace(output_dir=str(tmp_path), batch_size=8, tune_budget=30.0,
                              tune_steps=5, tune_memory_gib=None, tune_max_batch=16,
                              tune_machine=None, lr=None, base_lr=0.1, accum_steps=1,
                              arch='resnet18', bucket_cap_mb=25.0)


def fake_runner(argv, out):
    b = int(argv[argv.index('-b') + 1])
    return {'status': 'completed', 'data': {'train_images': 100, 'classes': 4},
            'memory': {'host_peak_rss_bytes': b, 'gpu_max_allocated_bytes': None},
            'timing': {'steady_images_per_s': 10.0 * b, 'bound': 'compute',
                       'stats': {'step': {'mean': 0.1}, 'backward': {'mean': 0.05}}}}, 0, ''


def test_a_tune_json_whose_trials_are_of_another_shape_is_kept_aside(tmp_path):
    """Rows that are objects but not trials were taken as the sweep's: KeyError 'wall_s'."""
    (tmp_path / 'tune.json').write_text(json.dumps({'base_argv': [], 'trials': [{'name': 5}]}))
    said = []
    record = T.Tuner(tune_args(tmp_path), [], False, said.append, fake_runner).sweep()
    assert record['status'] == 'completed' and len(record['trials']) == 5  # b8, b16, 3 more at b16
    assert any('tune.json is damaged' in m and 'trials[0]' in m for m in said), said


def test_a_second_damaged_tune_json_keeps_the_first_one_kept(tmp_path):
    """The second damaged tune.json was renamed over the first one's tune.json.damaged."""
    (tmp_path / 'tune.json.damaged').write_text('first')
    (tmp_path / 'tune.json').write_text('second')
    said = []
    T.Tuner(tune_args(tmp_path), [], False, said.append, fake_runner)
    assert (tmp_path / 'tune.json.damaged').read_text() == 'first'
    assert (tmp_path / 'tune.json.damaged.2').read_text() == 'second'
    assert 'tune.json.damaged.2' in said[0]


def test_a_fifo_tune_json_is_set_aside_without_blocking(tmp_path):
    os.mkfifo(tmp_path / 'tune.json')
    said = []
    tuner = within(5, lambda: T.Tuner(tune_args(tmp_path), [], False, said.append, fake_runner),
                   tmp_path / 'tune.json')
    assert tuner.record['trials'] == [] and 'is a FIFO, not a file' in said[0]


@FAST
@given(data=st.binary(max_size=200) | JSON.map(lambda v: json.dumps(v).encode())
       | st.lists(JSON | st.fixed_dictionaries({'name': st.just('b8-off-nchw-eager'), 'batch': JSON,
                                                 'wall_s': JSON, 'status': JSON}), max_size=3)
       .map(lambda rows: json.dumps({'base_argv': [], 'trials': rows}).encode()))
def test_any_tune_json_continues_or_is_kept_aside(tmp_path_factory, data):
    out = tmp_path_factory.mktemp('t')
    (out / 'tune.json').write_bytes(data)
    said = []
    record = T.Tuner(tune_args(out), [], False, said.append, fake_runner).record
    T.trials_table(record['trials'])
    T.winner(record)
    assert said == [] or (out / 'tune.json.damaged').exists() and len(said) == 1


@pytest.mark.parametrize('text', ['{"verdict": []}', '{"verdict": {"best": 5}}',
                                  '{"verdict": {"best": {"decode": "pil"}}}'])
def test_a_damaged_tune_loader_json_gives_no_flags(tmp_path, text):
    """TypeError and KeyError out of the loader doctor's record."""
    (tmp_path / 'tune-loader.json').write_text(text)
    said = []
    assert T.doctor_flags(str(tmp_path), said.append) == []
    assert said and 'tune-loader.json' in said[0]


@FAST
@given(data=st.binary(max_size=100)
       | JSON.map(lambda v: json.dumps({'verdict': {'best': v}}).encode())
       | st.fixed_dictionaries({'num_workers': JSON | st.integers(0, 8), 'decode': JSON
                                | st.sampled_from(['fast', 'pil', 'dali']), 'pin_memory': JSON,
                                'prefetch_factor': JSON | st.none()})
       .map(lambda v: json.dumps({'verdict': {'best': v}}).encode()))
def test_any_tune_loader_json_gives_flags_or_none(tmp_path_factory, data):
    out = tmp_path_factory.mktemp('l')
    (out / 'tune-loader.json').write_bytes(data)
    flags = T.doctor_flags(str(out), lambda s: None)
    assert all(isinstance(f, str) and '\n' not in f for f in flags)


# ------------------------------------------------------------------------- a checkpoint's metadata

def checkpoint(**kw):
    ckpt = {'arch': 'resnet18', 'num_classes': 4, 'classes': ['a', 'b', 'c', 'd'],
            'train_images': 96,
            'model': {}, 'optimizer': {'state': {}, 'param_groups': []}, 'scheduler': {},
            'scaler': {}, 'epoch': 0, 'step_in_epoch': 2, 'end_due': False, 'metrics_bytes': 10,
            'global_step': 2, 'global_batch': 8, 'args': {'seed': 1, 'lr': 0.1}, 'ema': None,
            'race': {'best_top1': None, 'reached': {}, 'images': 16, 'wall_s': 1.0},
            'rng': {'torch': None, 'numpy': None, 'python': None, 'device': [None]}}
    return {**ckpt, **kw}


@pytest.mark.parametrize('field, value', [('args', ['lr']), ('epoch', 'x'), ('metrics_bytes', 'x'),
                                          ('global_batch', 0), ('args', {'seed': 'x'}),
                                          ('race', {'images': [1]})])
def test_a_checkpoint_field_of_another_shape_is_one_sentence(field, value):
    """Saved args that are a list (TypeError in the resume contract), an epoch that is text, a
    seed the checkpoint rule would have put back as text: tracebacks after the checks passed."""
    with pytest.raises(UsageError) as e:
        state.check_form(resume_args('/x'), checkpoint(**{field: value}), 'c.pt')
    assert str(e.value).startswith(f'checkpoint c.pt has ') and f' at {field}' in str(e.value)
    assert 'pass another checkpoint' in str(e.value) and '\n' not in str(e.value)


FIELDS = ('epoch', 'step_in_epoch', 'global_step', 'global_batch', 'metrics_bytes', 'args', 'race',
          'arch', 'num_classes', 'classes', 'end_due', 'train_images', 'rng', 'optimizer')


@FAST
@given(fields=st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=3),
       args=st.dictionaries(st.sampled_from(['seed', 'lr', 'mom', 'pipeline_split', 'epochs']),
                            JSON, max_size=3))
def test_any_checkpoint_metadata_resumes_or_is_one_sentence(fields, args):
    ckpt = checkpoint(**{'args': {'seed': 1, **args}, **fields})
    run = resume_args('/x', seed=1, lr=0.1, mom=0.9, pipeline_split='time', epochs=1,
                      scheduler='onecycle')
    try:
        state.check_form(run, ckpt, 'c.pt')
    except UsageError as e:
        assert str(e).startswith('checkpoint c.pt ') and '\n' not in str(e)
        return
    was = ckpt.get('args') or {}
    resume.resolve(run, {k: v for k, v in was.items() if k in ('seed', 'pipeline_split')},
                   lambda s: None)
    resume.schedule_changes(run, was)
    assert isinstance(run.seed, int)
    assert ckpt['global_step'] * ckpt['global_batch'] // 8 >= 0 and ckpt['epoch'] + 1 > 0


def test_a_fifo_checkpoint_is_named_for_what_it_is(tmp_path):
    """It was called missing ('does not exist')."""
    os.mkfifo(tmp_path / 'checkpoint-00000002.pt')
    warned = []
    assert within(5, lambda: load_latest_checkpoint(str(tmp_path), warned.append)) == (None, None)
    assert 'checkpoint-00000002.pt is a FIFO, not a file' in warned[0], warned


def test_a_fifo_in_a_sharded_checkpoint_is_refused_without_blocking(tmp_path):
    folder = tmp_path / 'checkpoint-00000002.dcp'
    folder.mkdir()
    os.mkfifo(folder / '.metadata')
    with pytest.raises(UsageError) as e:
        within(10, lambda: load_checkpoint(str(folder)), folder / '.metadata')
    assert f'checkpoint {folder} cannot be read (.metadata is a FIFO, not a file)' in str(e.value)


def test_the_metadata_file_of_a_sharded_checkpoint_names_its_folder(tmp_path):
    """--resume .../checkpoint-2.dcp/.metadata was 'cannot be read (RuntimeError); it may be
    truncated'."""
    folder = tmp_path / 'checkpoint-00000002.dcp'
    folder.mkdir()
    (folder / '.metadata').write_bytes(b'x')
    with pytest.raises(UsageError) as e:
        load_checkpoint(str(folder / '.metadata'))
    assert str(e.value) == (f'--resume {folder}/.metadata is the metadata file of the sharded '
                            f'checkpoint {folder}; pass the folder {folder} itself.')


def test_the_exports_sentences_name_its_argument_not_resume(tmp_path):
    """dlojz_export.py reached load_checkpoint's sentences written for dlojz.py: '--resume
    RUN is a folder ... or --resume auto --output-dir RUN'."""
    for path in (tmp_path, tmp_path / 'cut.pt'):
        if path != tmp_path:
            path.write_bytes(b'PK not a checkpoint')
        with pytest.raises(UsageError) as e:
            load_checkpoint(str(path), given='CHECKPOINT')
        assert '--resume' not in str(e.value), str(e.value)


# ------------------------------------------------------------------------ the command line, slow

@pytest.mark.slow
@pytest.mark.parametrize('name', ['summary.json', 'metrics.jsonl'])
def test_resume_auto_into_a_folder_with_a_fifo_ends_in_one_sentence(tmp_path, name):
    """The issue's example: dlojz blocked in open() before its first line, and its SIGTERM handler
    did not end it."""
    out = tmp_path / 'run'
    out.mkdir()
    os.mkfifo(out / name)
    t = time.monotonic()
    try:
        r = subprocess.run([sys.executable, DLOJZ, *TINY, '--cache-dir', str(tmp_path / 'cache'),
                            '--output-dir', str(out), '--test-nsteps', '2', '--resume', 'auto'],
                           capture_output=True, text=True, timeout=120, cwd=ROOT)
    except subprocess.TimeoutExpired:
        os.close(os.open(out / name, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f'dlojz --resume auto blocked on a FIFO {name}')
    assert time.monotonic() - t < 120
    assert r.returncode == 2 and 'Traceback' not in r.stderr, r.stderr
    assert f'dlojz: error: {out}/{name} is a FIFO, not a file' in r.stderr, r.stderr
    assert sorted(os.listdir(out)) == [name]  # nothing written, the FIFO left as it was


# ------------------------------------------------------------------------------------------------
# The loader doctor reads its trials' summary.json through the shared shape (dlojzlib.formats)

TRIAL_SUMMARIES = [{'status': 'completed', 'loader': 5, 'data': {'classes': 10}},
                   {'status': 'completed', 'data': {'classes': 10}},
                   {'status': 'completed', 'loader': {'images_per_second': 'fast'}},
                   {'status': 'completed', 'loader': {}, 'data': None}]


def _doctor_over(monkeypatch, tmp_path, summary):
    import torch
    from dlojzlib.flags import get_args_parser
    from dlojzlib.modes import doctor
    parser = get_args_parser()
    raw = parser.parse_args(['--tune-loader', '--output-dir', str(tmp_path)])
    monkeypatch.setattr(doctor, 'run_for_summary', lambda cmd, out: (summary, 0, ''))
    monkeypatch.setattr(doctor, 'sweep', lambda *a, **k: [
        {'num_workers': 0, 'prefetch_factor': None, 'pin_memory': False, 'decode': 'fast'}])
    return doctor.tune_loader(raw, vars(raw), parser, None, torch.device('cpu'), lambda line: None,
                              script='dlojz.py')


@pytest.mark.parametrize('summary', TRIAL_SUMMARIES)
def test_a_loader_trial_summary_of_another_shape_is_one_sentence(monkeypatch, tmp_path, summary):
    """The doctor read a trial's loader, data.classes and timing with no shape: a trial summary
    of another shape was a TypeError or KeyError traceback."""
    with pytest.raises(UsageError) as e:
        _doctor_over(monkeypatch, tmp_path, summary)
    assert 'summary.json' in str(e.value) and '\n' not in str(e.value), e.value


@settings(deadline=1000, max_examples=60,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.sampled_from(['loader', 'data', 'classes', 'timing',
                                                       'images_per_second', 'first_batch_s']),
                                      inner, max_size=4), max_leaves=12))
def test_any_loader_trial_summary_is_a_value_or_one_sentence(monkeypatch, tmp_path, loader):
    from dlojzlib.modes import doctor
    monkeypatch.setattr(doctor, 'run_for_summary', lambda cmd, out: (
        {'status': 'completed', 'loader': loader, 'data': {'classes': 3}}, 0, ''))
    try:
        doctor._run(['python', 'dlojz.py'], str(tmp_path), doctor.LOADER_TRIAL_SUMMARY)
    except UsageError as e:
        assert '\n' not in str(e)
