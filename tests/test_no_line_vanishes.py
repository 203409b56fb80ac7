"""No closing line vanishes (issue 49): every '>>>' line a run ends with is printed, and where its
figure cannot be measured (no steady step, no GPU, no validation, phase timing off) the same line
says why instead of the figure; summary.json holds the figure as null with the same reason under
its section's 'unmeasured'. The expected lines are the course's (reference/course.md) and dlojz's
own, as docs/outputs.md lists them.

    python -m pytest -q tests/test_no_line_vanishes.py
"""
import io
import json
import os
from contextlib import redirect_stdout

import pytest

from conftest import run_main
from dlojz_chrono import Chronometer
from dlojzlib.record.summary import final_lines

# every line of a one-process run, in the order printed
LINES = ['Training complete in', 'Training performance time', 'Loading performance time',
         'Forward performance time', 'Backward performance time', 'Optimizer performance time',
         'Validation time', 'First step loading time', 'Number of batch per epoch',
         'Train throughput', 'Bound by', 'Peak Power during training', 'Start-up', 'Memory',
         'Max Memory Allocated', 'Validation peak memory', 'Host peak memory (VmHWM)']
WARMUP = 'the 3 training steps all fell in the 10 warm-up steps; run more steps (--test-nsteps) ' \
         'than --warmup-steps'


def said(lines, name):
    """The line of `name` (one, exactly)."""
    found = [line for line in lines if line.startswith(f'>>> {name}')]
    assert len(found) == 1, (name, lines)
    return found[0]


@pytest.fixture(scope='module')
def warmup_only(tmp_path_factory, cache_dir):
    """The issue's run: 3 steps, all in a warm-up of 10. -> (printed lines, summary.json)."""
    out = tmp_path_factory.mktemp('warmup-only')
    buf = io.StringIO()
    with redirect_stdout(buf):
        run_main(out, cache_dir, '--test-nsteps', '3', '--warmup-steps', '10')
    with open(os.path.join(out, 'summary.json')) as f:
        return buf.getvalue().splitlines(), json.load(f)


def test_a_run_all_in_its_warmup_prints_every_line_and_why(warmup_only):
    lines, _ = warmup_only
    for name in LINES:
        said(lines, name)
    for name in ('Training performance time', 'Loading performance time',
                 'Forward performance time', 'Train throughput', 'Bound by'):
        assert said(lines, name) == f'>>> {name}: not measured: {WARMUP}'


def test_a_cpu_run_says_why_it_has_no_gpu_figures(warmup_only):
    lines, _ = warmup_only
    assert said(lines, 'Max Memory Allocated') == \
        '>>> Max Memory Allocated: not measured: the run is on cpu, not a GPU'
    assert said(lines, 'Validation peak memory') == \
        '>>> Validation peak memory: not measured: the run is on cpu, not a GPU'
    assert said(lines, 'Peak Power during training') == \
        '>>> Peak Power during training: not measured: not a CUDA device'


def test_summary_json_holds_a_null_and_the_same_reason(warmup_only):
    _, s = warmup_only
    t, m = s['timing'], s['memory']
    for key in ('train_throughput', 'gpu_throughput', 'bound', 'epoch_time_estimate_s'):
        assert key in t and t[key] is None and t['unmeasured'][key] == WARMUP
    assert m['gpu_max_allocated_bytes'] is None
    assert m['unmeasured']['gpu_max_allocated_bytes'] == 'the run is on cpu, not a GPU'
    assert s['energy']['peak_w'] is None and \
        s['energy']['unmeasured']['peak_w'] == 'not a CUDA device'


def chrono_with(steps, warmup=1, phases=True):
    """A Chronometer that ran `steps` steps of 1 s (fake clock), started and stopped."""
    t = [0.0]
    chrono = Chronometer('cpu', phases=phases, warmup=warmup, clock=lambda: t[0])
    chrono.start()
    for _ in chrono.iterate([(None, [0] * 8)] * steps):
        t[0] += 1.0
    chrono.stop()
    return chrono


def summary_of(chrono, **extra):
    return {'timing': chrono.summary(8, None), 'config': {'output_dir': 'x'},
            'energy': {'peak_w': None, 'why_unavailable': 'not a CUDA device'},
            'memory': {'gpu_max_allocated_bytes': None, 'host_peak_rss_bytes': None},
            'provenance': {'device': 'cpu'}, **extra}


def test_phase_timing_off_says_so():
    chrono = chrono_with(4, phases=False)
    lines = final_lines(summary_of(chrono), chrono, None)
    assert said(lines, 'Forward performance time') == \
        '>>> Forward performance time: not measured: phase timing is off (--no-timing)'
    assert said(lines, 'Number of batch per epoch').startswith(
        '>>> Number of batch per epoch: not known: ')
    assert 'epoch time estimate: not known' in said(lines, 'Train throughput')


def test_no_training_step_and_no_validation():
    chrono = chrono_with(0)
    lines = final_lines(summary_of(chrono), chrono, 12)
    assert said(lines, 'Train throughput') == \
        '>>> Train throughput: not measured: no training step ran'
    assert said(lines, 'First step loading time') == \
        '>>> First step loading time: not measured: no training step ran'
    assert said(lines, 'Validation time') == '>>> Validation time: not measured: no validation ran'
    assert said(lines, 'Host peak memory').startswith('>>> Host peak memory (VmHWM): not measured')
    assert said(lines, 'Start-up').startswith('>>> Start-up: not measured: ')


def test_the_report_says_the_same(warmup_only, tmp_path):
    from dlojzlib.tools import report
    _, s = warmup_only
    with redirect_stdout(io.StringIO()):
        assert report.cli([s['config']['output_dir'], '--out', str(tmp_path / 'r')]) == 0
    md = (tmp_path / 'r' / 'report.md').read_text()
    assert f'| Train throughput | not measured: {WARMUP} |' in md
    assert f'| Bound by | not measured: {WARMUP} |' in md
    assert '| Power, energy | not measured: not a CUDA device |' in md
