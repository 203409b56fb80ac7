"""The report over bad bytes (issue 49): whatever a run folder holds as summary.json, config.json,
metrics.jsonl or nccl.rank<r>.log (any bytes, a FIFO, a folder, JSON of another shape), the report
finishes within seconds with that run marked by a note, or one sentence naming the file; never a
traceback, a hang or a view that fails ('## Problems'). The base folder is a real tiny run.

    python -m pytest -q tests/test_report_inputs.py
"""
import contextlib
import copy
import io
import json
import os
import pathlib
import shutil
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from dlojzlib.tools import report
from strategies import json_values, paths_of, replaced

JSON = json_values(text=8, keys=8, size=4, leaves=12)
FILES = ('summary.json', 'config.json', 'metrics.jsonl')


@pytest.fixture(scope='module')
def base(two_epochs):
    """A real run folder (conftest's reference run, which the fast tier makes anyway):
    summary.json, config.json, metrics.jsonl with a record per step."""
    return pathlib.Path(two_epochs[0]['config']['output_dir'])


class Folders:
    """Copies of the base run, each with some files replaced."""

    def __init__(self, root, base):
        self.root, self.base, self.n = root, base, 0

    def make(self, **files):
        """files: name -> bytes, str (its UTF-8), 'FIFO', 'FOLDER' or None (removed)."""
        self.n += 1
        path = self.root / f'run{self.n}'
        shutil.copytree(self.base, path)
        for name, content in files.items():
            target = path / name
            if target.exists():
                target.unlink()
            if content == 'FIFO':
                os.mkfifo(target)
            elif content == 'FOLDER':
                target.mkdir()
            elif content is not None:
                target.write_bytes(content if isinstance(content, bytes) else content.encode())
        return path


@pytest.fixture(scope='module')
def folders(tmp_path_factory, base):
    return Folders(tmp_path_factory.mktemp('folders'), base)


def report_of(path, out, timeout=20):
    """The report over one run, in-process -> (exit code, stdout, stderr, report.md or ''); fails
    when it has not ended after `timeout` seconds (a read that blocks)."""
    result, stdout, stderr = [], io.StringIO(), io.StringIO()

    def run():
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            result.append(report.cli([str(path), '--out', str(out)]))
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f'the report over {path} has not ended after {timeout} s'
    md = out / 'report.md'
    return result[0], stdout.getvalue(), stderr.getvalue(), md.read_text() if md.exists() else ''


def answered(code, out, err, md):
    """A report with no failed view and no traceback, or one error line."""
    assert 'Traceback' not in out + err
    if code == 2:
        assert len(err.strip().splitlines()) == 1 and err.startswith('dlojz_report: error: '), err
        return
    assert code == 0, (out, err)
    assert '## Problems' not in md and 'could not be built' not in md, md


BAD = {'not-json': b'{"status": "compl', 'list': '[]', 'timing-5': '{"timing": 5}',
       'status-list': '{"status": [1]}', 'config-5': '{"status": "failed", "config": 5}',
       'world-size-text': '{"status": "completed", "world_size": "x"}',
       'not-utf8': b'\xff\xfe', 'fifo': 'FIFO', 'folder': 'FOLDER'}


@pytest.mark.parametrize('kind', BAD)
def test_a_bad_summary_is_one_note_on_its_run(folders, tmp_path, kind):
    path = folders.make(**{'summary.json': BAD[kind]})
    code, out, err, md = report_of(path, tmp_path / 'r')
    answered(code, out, err, md)
    assert code == 0 and '*Note: summary.json is unreadable: ' in md, md
    assert 'no summary.json' not in out  # it is there: the report says what is wrong with it


@pytest.mark.parametrize('content', ['[1, 2]', 'FIFO', 'FOLDER', '{"batch_size": "x"}'])
def test_a_bad_config_is_one_note(folders, tmp_path, content):
    path = folders.make(**{'config.json': content, 'summary.json': None})
    code, out, err, md = report_of(path, tmp_path / 'r')
    answered(code, out, err, md)
    assert '*Note: config.json is unreadable: ' in md, md


def test_a_fifo_for_metrics_is_one_note(folders, tmp_path):
    path = folders.make(**{'metrics.jsonl': 'FIFO'})
    code, out, err, md = report_of(path, tmp_path / 'r')
    answered(code, out, err, md)
    assert '*Note: metrics.jsonl is unreadable: it is a FIFO, not a file.*' in md


def test_records_of_another_shape_are_left_out_and_counted(folders, base, tmp_path):
    lines = (base / 'metrics.jsonl').read_text()
    odd = ['{"type": "val", "global_step": "x", "wall_s": 1, "train_images": 8, "top1": 0.5}',
           '{"type": "val", "global_step": 3, "wall_s": 1, "train_images": 8, "top1": "z"}',
           '{"type": "metric_sync", "global_step": 2, "ranks": [{"after": {"loss": [1]}}]}',
           '{"type": ["train"], "global_step": 2}', '5']
    path = folders.make(**{'metrics.jsonl': lines + '\n'.join(odd) + '\n'})
    code, out, err, md = report_of(path, tmp_path / 'r')
    answered(code, out, err, md)
    assert '5 unreadable line(s) in metrics.jsonl' in md, md


@pytest.mark.parametrize('log', [
    'FIFO', 'FOLDER',
    'h:1:1 [0] NCCL INFO AllReduce: opCount zz sendbuff 0x1 recvbuff 0x2 count 4 datatype 7 op 0 '
    'root 0 comm 0x5 [nranks=2] stream 0x6\n'])
def test_a_bad_nccl_log_is_one_sentence_in_the_report(folders, tmp_path, log):
    path = folders.make(**{'nccl.rank0.log': log})
    code, out, err, md = report_of(path, tmp_path / 'r')
    answered(code, out, err, md)
    assert '## Communication (NCCL)' in md


def test_a_folder_that_cannot_be_listed_is_one_sentence(tmp_path, monkeypatch, capsys):
    from dlojzlib.tools.report import runs

    def denied(path):
        raise PermissionError(13, 'Permission denied', path)
    monkeypatch.setattr(runs.os, 'listdir', denied)  # as root, a chmod 000 folder lists anyway
    assert report.cli([str(tmp_path), '--out', str(tmp_path / 'r')]) == 2
    err = capsys.readouterr().err
    assert err == f'dlojz_report: error: cannot list {tmp_path} (Permission denied); pass a ' \
                  f'folder you can read.\n'


# ------------------------------------------------------------------------ any bytes, any JSON
@settings(deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow])
@given(summary=st.binary(max_size=200), metrics=st.binary(max_size=200))
def test_any_bytes_give_a_report(folders, tmp_path_factory, summary, metrics):
    path = folders.make(**{'summary.json': summary, 'metrics.jsonl': metrics})
    start = time.perf_counter()
    answered(*report_of(path, tmp_path_factory.mktemp('r') / 'r'))
    assert time.perf_counter() - start < 2


@settings(deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow])
@given(summary=JSON, config=JSON, record=JSON)
def test_any_json_gives_a_report(folders, tmp_path_factory, summary, config, record):
    path = folders.make(**{'summary.json': json.dumps(summary), 'config.json': json.dumps(config),
                           'metrics.jsonl': json.dumps(record) + '\n'})
    start = time.perf_counter()
    answered(*report_of(path, tmp_path_factory.mktemp('r') / 'r'))
    assert time.perf_counter() - start < 2


# What a summary holds beside a training run's, so that a change anywhere reaches every view: an
# LR sweep, the tuner's and the loader doctor's trials, a pipeline, a target, the all-reduce
EXTRA = {
    'findlr': {'lr': [1e-8 * 10 ** (i / 3) for i in range(24)],
               'loss': [2.3 - 0.05 * i for i in range(20)] + [3.0, 9.0, None, None]},
    'tune': {'trials': [{'batch': b, 'amp': 'off', 'channels_last': False, 'compile': False,
                         'images_per_s': 10.0 * b, 'step_ms': 80.0, 'memory_bytes': b * 2 ** 20,
                         'bound': 'compute', 'status': 'completed'} for b in (8, 16)],
             'recommended': {'images_per_s': 160.0, 'command': 'python dlojz.py -b 16',
                             'lr_rule': 'linear'},
             'skipped': ['bf16'], 'forecast': [{'gpus': 4, 'nodes': 1, 'images_per_s': 600.0,
                                                'efficiency': 0.94}]},
    'tune_loader': {'trials': [{'num_workers': w, 'pin_memory': None, 'prefetch_factor': 2,
                                'decode': 'fast', 'images_per_second': 50.0 * (w + 1),
                                'images_per_second_per_worker': 50.0, 'wait_mean_s': 0.01,
                                'first_batch_s': 0.3, 'host_peak_bytes': 2 ** 30} for w in (0, 2)],
                    'verdict': {'ceiling_images_per_second': 120.0, 'bound': 'loader',
                                'best': {'images_per_second': 150.0}},
                    'ceiling': {'images_per_second': 120.0}},
    'communication': {'gradient_bytes_per_step': 44714256},
    'time_to_accuracy': {'target_top1': 0.1, 'raw': {'wall_s': 2.0, 'epoch': 1,
                                                     'train_images': 24}, 'ema': None},
}
PIPELINE = {'schedule': '1f1b', 'n_stages': 2, 'microbatches': 4, 'expected_bubble': 0.2,
            'measured_bubble': 0.21, 'forecast_span_s': 0.5, 'span_s': 0.51,
            'stages': [{'stage': k, 'span_s': 0.5, 'compute_s': 0.4, 'wait_s': 0.1, 'bubble': 0.2,
                        'timeline': [['F', 0, 0.0, 0.1], ['B', 0, 0.2, 0.4]],
                        'timeline_span_s': 0.5} for k in (0, 1)]}
SYNC = {'type': 'metric_sync', 'global_step': 2, 'step': 2,
        'ranks': [{'rank': 0, 'before': {'loss': 1.5, 'top1': 0.25},
                   'after': {'loss': 1.4, 'top1': 0.25}}]}


@pytest.fixture(scope='module')
def rich(base):
    """The base run's summary with every other view's entries, and its records with a sync."""
    summary = json.loads((base / 'summary.json').read_text())
    summary.update(copy.deepcopy(EXTRA))
    summary['timing']['pipeline'] = copy.deepcopy(PIPELINE)
    records = [json.loads(line) for line in (base / 'metrics.jsonl').read_text().splitlines()]
    return summary, records + [SYNC]


def one_field_changed(folders, tmp_path_factory, rich, data, new):
    """The rich run with one place of its summary, or of one record, holding `new`."""
    summary, records = rich
    if data.draw(st.booleans()):
        where = data.draw(st.sampled_from(sorted(paths_of(summary, items=3), key=str)))
        summary = replaced(summary, where, new)
    else:
        i = data.draw(st.integers(0, len(records) - 1))
        where = data.draw(st.sampled_from(sorted(paths_of(records[i], items=3), key=str)))
        records = records[:i] + [replaced(records[i], where, new)] + records[i + 1:]
    path = folders.make(**{'summary.json': json.dumps(summary),
                           'metrics.jsonl': ''.join(json.dumps(r) + '\n' for r in records)})
    start = time.perf_counter()
    answered(*report_of(path, tmp_path_factory.mktemp('r') / 'r'))
    assert time.perf_counter() - start < 10  # the rich run draws 6 figures: ~1 s idle


@settings(deadline=None, max_examples=3, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), new=JSON)
def test_any_field_of_a_real_run_may_hold_any_json(folders, tmp_path_factory, rich, data, new):
    one_field_changed(folders, tmp_path_factory, rich, data, new)


@pytest.mark.slow
@settings(deadline=None, max_examples=100, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), new=JSON)
def test_any_field_of_a_real_run_may_hold_any_json_long(folders, tmp_path_factory, rich, data,
                                                        new):
    one_field_changed(folders, tmp_path_factory, rich, data, new)


def test_a_loader_doctor_ceiling_without_its_rate_draws_no_ceiling(tmp_path):
    """The long property test's example (CI's long tier, issue 57's stop): a tune_loader.ceiling
    holding no images_per_second raised KeyError in the doctor's figure, a failed view."""
    from types import SimpleNamespace
    from dlojzlib.tools.report import doctor
    tune = {'trials': [{'num_workers': 0, 'prefetch_factor': None, 'decode': 'fast',
                        'pin_memory': None, 'images_per_second': 10.0}], 'ceiling': {}}
    assert doctor.plot_doctor(SimpleNamespace(name='r'), tune, str(tmp_path)) == 'doctor-r.png'
