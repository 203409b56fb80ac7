"""tests/gpu cannot look green without a GPU: `bash tests/gpu/run.sh` on a machine where torch sees no CUDA
GPU exits non-zero with one sentence and starts no test (pytest is never invoked), and DLOJZ_REQUIRE_GPU=1
turns "skipped for want of CUDA" into a failed session. The check's verdict is a pure function of the facts
(torch's CUDA, the driver, the GPUs, the wheel's architectures), tested here for each way a node fails.
The lists run.sh runs (quick.txt, later.txt) name tests that exist, and each list's planned
seconds fit the test budget of the call that runs it.

Run: python -m pytest -q tests/test_gpu_runner.py
"""
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import torch
from hypothesis import given, strategies as st

from conftest import TINY
from gpu import bench, cuda_check, results, side_by_side  # tests/gpu's scripts, as modules

ROOT = pathlib.Path(__file__).resolve().parent.parent

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason='this machine has a GPU: run.sh would run the suite')
H100 = ('NVIDIA H100 80GB HBM3', (9, 0))
CU13_ARCHS = ['sm_75', 'sm_80', 'sm_86', 'sm_90', 'sm_100', 'sm_120']


@no_gpu
@pytest.mark.parametrize('options', [  # 2 s each: the last, with every option, in the fast tier
    pytest.param([], marks=pytest.mark.slow), pytest.param(['--quick'], marks=pytest.mark.slow),
    ['--quick', '--no-compile', '--results', 'R']])
def test_run_sh_without_cuda_stops_before_any_test(tmp_path, options):
    log = tmp_path / 'invocations'
    wrapper = tmp_path / 'python'
    wrapper.write_text(f'#!/bin/sh\necho "$@" >> {log}\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    results = tmp_path / 'R'
    options = [str(results) if o == 'R' else o for o in options]
    p = subprocess.run(['bash', str(ROOT / 'tests' / 'gpu' / 'run.sh'), *options],
                       capture_output=True, text=True, env={**os.environ, 'PYTHON': str(wrapper)},
                       timeout=120)
    out = (p.stdout + p.stderr).strip()
    assert p.returncode == 1, out
    assert len(out.splitlines()) == 1 and out.startswith('tests/gpu needs CUDA') and 'Traceback' not in out, out
    calls = log.read_text().splitlines()  # neither pytest nor bench.py started
    assert len(calls) == 1 and calls[0].split()[0] == 'tests/gpu/cuda_check.py', calls
    assert not results.exists()  # nothing written


@pytest.mark.slow  # 4 s each: pytest collects tests/gpu in a process of its own
@pytest.mark.parametrize('name', ['quick.txt', 'later.txt'])
def test_the_lists_name_tests_that_exist(name):
    """run.sh passes a list's node ids (quick.txt for --quick) to pytest, which stops the whole
    session on one that does not exist (a renamed test): collected here, where they are skipped,
    each must be found."""
    ids = results.asked(ROOT / 'tests' / 'gpu' / name)
    env = {k: v for k, v in os.environ.items() if k != 'DLOJZ_REQUIRE_GPU'}
    p = subprocess.run([sys.executable, '-m', 'pytest', '--collect-only', '-q', '-m', 'not slurm',
                        *ids], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    collected = [line for line in p.stdout.splitlines() if line.startswith('tests/gpu/')]
    found = [i for i in ids if any(c == i or c.startswith(i + '[') for c in collected)]
    assert found == ids, (ids, collected)
    assert len(ids) == len(set(ids)) >= 15


# The calls that run each list, as tests/gpu/README.md gives them
CALLS = {'quick.txt': ['--quick'],  # the first call: 540 s, tests and the benchmark
         'later.txt': ['--list', 'tests/gpu/later.txt', '--tests-only', '--seconds', '400']}


def plan(*options):
    """run.sh's plan for these options (--plan: JSON, nothing run) -> dict."""
    run_sh = str(ROOT / 'tests' / 'gpu' / 'run.sh')
    p = subprocess.run(['bash', run_sh, *map(str, options), '--plan'], capture_output=True,
                       text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def assert_fits(list_path, options):
    """Every line of the list planned (seconds and where they come from), and their sum within
    the test budget run.sh gives its call."""
    lines = results.entries(list_path)
    unplanned = [line for line in lines if not line[1] or line[2] not in results.BASES]
    assert lines and not unplanned, unplanned
    budget = plan('--list', list_path, *options)['test_budget_s']
    assert results.planned(list_path) <= budget, (list_path, results.planned(list_path), budget)


@pytest.mark.parametrize('name', sorted(CALLS))
def test_each_list_fits_its_calls_test_budget_on_paper(tmp_path, name):
    """Each call fits its budget on paper: a list's planned seconds (measured on the first GPU run,
    else estimated) add up to no more than the test budget run.sh derives from its call's seconds
    (quick.txt's: 295 s of a 540 s call; later.txt's: 305 of 400). The check fails on a list
    that plans more than its call holds."""
    assert_fits(ROOT / 'tests' / 'gpu' / name, CALLS[name])
    heavier = tmp_path / name
    heavier.write_text((ROOT / 'tests' / 'gpu' / name).read_text() +
                       'tests/gpu/test_gpu.py::test_one_more 60 estimated\n')
    with pytest.raises(AssertionError):
        assert_fits(heavier, CALLS[name])
    unplanned = tmp_path / 'ids.txt'  # a rerun list of ids alone is no plan
    unplanned.write_text('tests/gpu/test_gpu.py::test_one\n')
    with pytest.raises(AssertionError):
        assert_fits(unplanned, CALLS[name])


@no_gpu
@pytest.mark.slow  # two pytest sessions that collect tests/gpu (imports dlojz and torch): ~25 s on 2 cores
def test_require_gpu_turns_the_skips_into_a_failure():
    """The same command, with and without the variable: it alone turns the skipped suite into a failure."""
    run = lambda env: subprocess.run([sys.executable, '-m', 'pytest', '-q', '-p', 'no:randomly', 'tests/gpu'],
                                     capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    env = {k: v for k, v in os.environ.items() if k != 'DLOJZ_REQUIRE_GPU'}
    required = run({**env, 'DLOJZ_REQUIRE_GPU': '1'})
    assert required.returncode != 0 and 'passed' not in required.stdout and 'skipped' not in required.stdout
    assert 'DLOJZ_REQUIRE_GPU=1 and tests/gpu needs a CUDA GPU' in required.stdout + required.stderr
    plain = run(env)  # the default suite on a CPU machine: skipped, green
    assert plain.returncode == 0 and 'skipped' in plain.stdout and 'failed' not in plain.stdout


@pytest.mark.parametrize('facts, ok, words', [
    (('2.14.1+cpu', None, None, [], []), False, 'is a CPU-only build'),
    (('2.14.1+cu130', '13.0', None, [], []), False, 'finds no NVIDIA driver'),
    (('2.14.1+cu130', '13.0', '550.54.15', [], []), False, 'needs NVIDIA driver 580 or newer, but this node has 550.54.15'),
    (('2.14.1+cu126', '12.6', '550.54.15', [], []), False, 'sees no GPU'),
    (('2.14.1+cu130', '13.0', '580.65.06', [('Tesla V100-SXM2-32GB', (7, 0))], CU13_ARCHS), False,
     'has no kernels for the Tesla V100-SXM2-32GB (sm70; the oldest it has is sm_75); install a CUDA 12.6 build'),
    (('2.14.1+cu126', '12.6', '550.54.15', [H100, H100], ['sm_50', 'sm_70', 'sm_90']), True,
     'CUDA: torch 2.14.1+cu126 built for CUDA 12.6, driver 550.54.15, 2 x NVIDIA H100 80GB HBM3 (sm90)'),
    (('2.14.1+cu130', '13.0', '580.65.06', [('NVIDIA B300', (10, 3))], CU13_ARCHS), True, 'NVIDIA B300 (sm103)'),
])
def test_the_verdict_for_each_kind_of_node(facts, ok, words):
    got_ok, line = cuda_check.verdict(*facts)
    assert got_ok == ok and words in line and len(line.splitlines()) == 1, line


def bench_summary(train=100.0, loader=500.0):
    """The fields of a completed run's summary.json that bench.py's table reads."""
    return {'status': 'completed', 'config': {'amp': 'bf16'}, 'provenance': None,
            'timing': {'train_throughput': train, 'gpu_throughput': 120.0, 'bound': 'compute',
                       'device_busy': 0.95, 'steps': 50},  # bench.py's default --steps
            'memory': {'gpu_max_allocated_bytes': 2 ** 30}, 'energy': {'joules_per_image': 0.5},
            'loader': {'images_per_second': loader}, 'data': {'gpu_decode': None}}


def quick_bench(monkeypatch, tmp_path, broken=None, failure=None, summary=bench_summary, calls=None):
    """bench.py --quick on a fake GPU, its runs a fake run_one: the run whose folder is `broken`
    returns failure() instead of summary(folder name). -> the exit code."""
    monkeypatch.setattr(bench.torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(bench, 'jpeg_set', lambda opts: str(tmp_path / 'jpegs'))

    def run_one(flags, out_dir, env=None):
        name = os.path.basename(out_dir)
        if calls is not None:
            calls.append((name, [str(f) for f in flags], env))
        return failure() if name == broken else (summary(name) if summary is not bench_summary else summary(), None)
    monkeypatch.setattr(bench, 'run_one', run_one)
    return bench.main(['--quick', '--out', str(tmp_path)])


@pytest.mark.parametrize('failing', ['loader_gpu_nvimgcodec', 'fast', 'fake_reduce-overhead'])
def test_bench_exits_1_when_any_run_failed(tmp_path, monkeypatch, capsys, failing):
    """A failed row of either table makes bench.py exit 1 (the decode table's failures were shown as
    'failed' cells and never counted: exit 0). The failing row is named."""
    refused = lambda: (None, 'exit 1: dlojz: nvJPEG refused every image')  # noqa: E731
    assert quick_bench(monkeypatch, tmp_path, failing, refused) == 1
    out = capsys.readouterr()
    assert 'failed (exit 1: dlojz: nvJPEG refused every image)' in out.out
    assert '1 row(s) failed' in out.err
    assert quick_bench(monkeypatch, tmp_path) == 0


def test_the_issues_rows_in_their_order_and_the_jpeg_rows_at_the_fastest_mode(tmp_path, monkeypatch, capsys):
    """The quick table (issue 45): fake data eager, then the CUDA graphs of reduce-overhead; then each
    JPEG path, the loader alone and training on the same flags, training at the faster of the two
    (here reduce-overhead's 300 img/s), the loader alone compiling nothing; torchvision's decoder by
    DLOJZ_REGION_DECODE=0; the default compile last (what the budget cuts first); batch 256, bf16
    (auto), channels-last."""
    calls = []
    rates = {'fake_eager': 100.0, 'fake_reduce-overhead': 300.0, 'fake_default': 200.0}
    assert quick_bench(monkeypatch, tmp_path, calls=calls,
                       summary=lambda name: bench_summary(rates.get(name, 90.0), 500.0)) == 0
    names = [name for name, _, _ in calls]
    assert names == ['fake_eager', 'fake_reduce-overhead', 'loader_gpu_nvimgcodec', 'gpu_nvimgcodec',
                     'loader_gpu_torchvision', 'gpu_torchvision', 'loader_fast', 'fast', 'fake_default']
    flags = {name: ' '.join(f) for name, f, _ in calls}
    assert all('-b 256' in f and '--amp auto' in f and '--channels-last' in f for f in flags.values())
    assert '--compile --compile-mode reduce-overhead' in flags['gpu_torchvision']
    assert '--compile' not in flags['loader_gpu_torchvision'] and '--loader-only' in flags['loader_fast']
    env = {name: e for name, _, e in calls}
    assert env['gpu_torchvision'] == {'DLOJZ_REGION_DECODE': '0'} and not env['gpu_nvimgcodec']
    out = capsys.readouterr().out
    assert 'train with `--compile --compile-mode reduce-overhead`' in out
    assert '| fake data, compile reduce-overhead | 300.0 | 120.0 | 95 | compute |' in out


def test_a_loader_alone_below_its_training_is_a_defect(tmp_path, monkeypatch, capsys):
    """The first GPU run's table had --decode fast's loader alone at 2,432 img/s and training with it at
    3,579 (it timed an epoch restart training never made): a figure that cannot be. bench.py now says
    so in the cell and fails."""
    assert quick_bench(monkeypatch, tmp_path, summary=lambda name: bench_summary(3579.0, 2432.0)) == 1
    out = capsys.readouterr()
    assert '| 2432.0 (below training: a measurement defect) | 3579.0 |' in out.out
    assert 'gpu_nvimgcodec' in out.err


def test_an_interrupted_bench_prints_the_runs_that_finished(tmp_path, monkeypatch, capsys):
    """run.sh stops the quick benchmark with SIGINT when its time is up: the tables keep every row
    that ended before and name the one that was stopped; a time limit is no failure (exit 0, run.sh
    exited 124 whatever the rows did)."""
    def interrupt():
        raise KeyboardInterrupt
    assert quick_bench(monkeypatch, tmp_path, 'gpu_torchvision', interrupt) == 0
    out = capsys.readouterr()
    assert '| fake data, eager | 100.0' in out.out and '| --decode gpu, nvImageCodec | 500.0 | 100.0' in out.out
    assert 'Stopped by its time limit while it ran: gpu_torchvision.' in out.out
    assert "torchvision's nvJPEG" not in out.out and '--decode fast' not in out.out.split('| JPEG |')[1]
    assert 'interrupted during gpu_torchvision' in out.err


def test_bench_budget_starts_no_row_after_it(tmp_path, monkeypatch, capsys):
    """--budget 0: no run starts, the table says which rows were left out."""
    monkeypatch.setattr(bench.torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(bench, 'jpeg_set', lambda opts: str(tmp_path / 'jpegs'))
    monkeypatch.setattr(bench, 'run_one', lambda flags, out_dir, env=None: pytest.fail('a run started'))
    assert bench.main(['--quick', '--budget', '0', '--out', str(tmp_path)]) == 0
    assert ('Not run (--budget 0 s spent): fake_eager, fake_reduce-overhead, gpu_nvimgcodec, '
            'gpu_torchvision, fast, fake_default.') in capsys.readouterr().out


@pytest.mark.parametrize('required', [False, True])
def test_a_profile_without_gpu_kernels_fails_where_a_gpu_is_required(monkeypatch, required):
    """The profiler check of tests/gpu on a profile with no CUDA kernel (CUPTI missing; here a CPU
    profile): a skip, which DLOJZ_REQUIRE_GPU=1 did not turn into a failure, so the check vanished
    from a GPU run."""
    from gpu.test_gpu import profiled_kernels
    monkeypatch.setenv('DLOJZ_REQUIRE_GPU', '1' if required else '0')
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.ones(4).add_(1)
    outcome = pytest.fail.Exception if required else pytest.skip.Exception
    with pytest.raises(outcome, match='no CUDA kernel'):
        profiled_kernels(prof)


def test_the_references_rate_is_images_over_the_time_of_its_windows():
    """The reference prints, every 20 iterations, the mean time of the last 20. With 20 steps of
    warm-up and 40 measured: the lines at 40 (0.100 s) and 60 (0.300 s) tile iterations 21..60: 40 x
    256 images in 20 x (0.1 + 0.3) = 8 s, 1280 img/s (the mean of the two windows' rates, 2560 and
    853, would read 1707). The line at 20 is the warm-up's; a missing window is no figure."""
    log = '\n'.join(f'Epoch: [0]  [{i:3d}/222]  eta: 0:00:30  lr: 0.1  img/s: 999.0  '
                    f'loss: 6.9 (6.9)  acc1: 0.0 (0.0)  acc5: 0.0 (0.0)  time: {t:.4f}  '
                    f'data: 0.0010  max mem: 21000'
                    for i, t in ((0, 5.0), (20, 0.5), (40, 0.1), (60, 0.3), (80, 0.2)))
    rate, windows = side_by_side.reference_rate(log, 256, 20, 40)
    assert windows == 2 and rate == pytest.approx(40 * 256 / 8.0)
    assert side_by_side.reference_rate(log, 256, 20, 80) == (None, 3)  # the line at 100 is missing


def test_the_best_row_takes_the_tuners_flags_and_keeps_the_comparisons_own(tmp_path):
    """From a tune.json's recommended command: the batch, precision, layout and compile flags, not
    the data, model, workers or output folder the side by side sets itself."""
    tune = tmp_path / 'tune.json'
    command = ('python dlojz.py --arch resnet50 --data-dir /x --num-workers 8 -b 384 --amp bf16 '
               '--channels-last --compile')
    tune.write_text(json.dumps({'recommended': {'command': command}}))
    args = side_by_side.argparse.Namespace(tune_json=str(tune), best='--amp off')
    flags, source = side_by_side.best_flags(args)
    assert flags == ['-b', '384', '--amp', 'bf16', '--channels-last', '--compile']
    assert 'tune.json' in source


BUDGET_TESTS = '''
import os, sys, time
import dlojz

def test_first():
    pass

def test_run():
    flags = {flags!r}
    dlojz.main(dlojz.get_args_parser().parse_args(flags))

def test_after():
    time.sleep(60)  # a test the time limit should never reach
'''


def test_a_budget_signal_into_an_in_process_run_keeps_every_test_by_name(tmp_path, cache_dir):
    """run.sh's time limit sends SIGINT to pytest's process group while a test runs dlojz in the
    pytest process. dlojz turned it into an ordinary test failure and then ignored SIGINT: pytest went
    on to the next test, was killed 20 s later and wrote no junit.xml (issue 45). Now the interrupt
    reaches pytest as a KeyboardInterrupt, which ends the session at once with junit.xml written, and
    progress.txt names the test that was stopped: every test that ran is in the record by name."""
    run_dir = tmp_path / 'run'
    flags = [*TINY, '--cache-dir', cache_dir, '--output-dir', str(run_dir), '-e', '1000', '--log-interval', '1']
    (tmp_path / 'conftest.py').write_text(
        'from gpu.progress import pytest_runtest_logfinish, pytest_runtest_logstart  # noqa\n')
    (tmp_path / 'test_budget.py').write_text(BUDGET_TESTS.format(flags=flags))
    progress, junit = tmp_path / 'progress.txt', tmp_path / 'junit.xml'
    env = {**os.environ, 'DLOJZ_GPU_PROGRESS': str(progress),
           'PYTHONPATH': os.pathsep.join([str(ROOT), str(ROOT / 'tests'), os.environ.get('PYTHONPATH', '')])}
    p = subprocess.Popen([sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', '-p', 'no:randomly',
                          f'--junitxml={junit}', 'test_budget.py'], cwd=tmp_path, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / 'metrics.jsonl').exists() or not (run_dir / 'metrics.jsonl').read_text():
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()[0][-3000:]
            time.sleep(0.1)
        os.killpg(p.pid, signal.SIGINT)  # as `timeout -s INT` does: the whole process group
        out, _ = p.communicate(timeout=20)  # not the 60 s of test_after
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert junit.exists(), out[-3000:]
    rows = results.merge(results.outcomes(junit), *results.read_progress(progress.read_text()))
    got = {results.short(node): outcome for node, outcome, *_ in rows}
    assert got == {'test_first': 'passed', 'test_run': 'interrupted'}, (got, out[-3000:])
    assert results.main([str(junit), '--progress', str(progress)]) == 1  # a test was stopped
    assert json.loads((run_dir / 'summary.json').read_text())['status'] == 'interrupted'


# What pytest 9 wrote when SIGINT stopped the second of three tests (reproduced by hand): the
# stopped test is a <testcase> with neither classname nor name.
INTERRUPTED_JUNIT = ('<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests"><testsuite '
                     'name="pytest" errors="0" failures="0" skipped="0" tests="1" time="2.856"><testcase '
                     'classname="tests.gpu.test_gpu" name="test_one" time="0.400" /><testcase time="0.000" />'
                     '</testsuite></testsuites>')


def test_a_stopped_test_is_named_and_counted_as_stopped(tmp_path, capsys):
    """results.py read the nameless <testcase> of a test a time limit stopped as a passed test named
    'None'. From progress.txt it is now named, said to be stopped, and the verdict is 1; the test the
    budget left out is listed as not run, without failing the verdict by itself."""
    junit, progress, wanted = tmp_path / 'junit.xml', tmp_path / 'progress.txt', tmp_path / 'quick.txt'
    junit.write_text(INTERRUPTED_JUNIT)
    one, two, three = (f'tests/gpu/test_gpu.py::test_{n}' for n in ('one', 'two', 'three'))
    progress.write_text(f'start\t{one}\nend\t{one}\nstart\t{two}\n')
    wanted.write_text(f'# the list\n{one}\n{two}\n{three}\n')
    assert results.main([str(junit), '--progress', str(progress), '--list', str(wanted)]) == 1
    out = capsys.readouterr().out
    assert '| `test_one` | passed |' in out and '| `test_two` | interrupted: stopped by a time limit' in out
    assert '| `test_three` | not run |' in out and 'None' not in out
    progress.write_text(f'start\t{one}\nend\t{one}\n')  # the budget ended the session between tests
    junit.write_text(INTERRUPTED_JUNIT.replace('<testcase time="0.000" />', ''))
    assert results.main([str(junit), '--progress', str(progress), '--list', str(wanted)]) == 0
    assert '2 not run' in capsys.readouterr().out
    junit.unlink()  # pytest killed before it wrote the XML: the progress file still names the test
    assert results.main([str(junit), '--progress', str(progress)]) == 1
    out = capsys.readouterr().out
    assert '| `test_one` | unknown: ran; its outcome was lost' in out and 'no JUnit XML' in out


@given(text=st.lists(st.sampled_from(['start', 'end', '\t', '\n', 'a', 'b', '::', ' ', '\x00', 'é']),
                     max_size=60).map(''.join))
def test_any_progress_file_gives_each_started_test_one_row(text):
    """progress.txt cut anywhere by a kill, or garbled: read without error, every test that started
    has exactly one row, and one that never ended is never called passed."""
    started, ended = results.read_progress(text)
    rows = results.merge([], started, ended)
    assert sorted(r[0] for r in rows) == sorted(set(started))
    assert all(outcome == 'interrupted' for node, outcome, *_ in rows if node not in ended)
    assert results.verdict(rows) == 1  # nothing from JUnit: no test is known to have passed
    assert results.table(rows)  # and it prints


SLEEPER = '''
import os, sys, time
with open(os.path.join(sys.argv[1], f"worker{os.environ['RANK']}"), "w") as f:
    f.write(str(os.getpid()))
time.sleep(120)
'''


@pytest.mark.slow  # 6 s: torchrun's launcher and two workers import torch
def test_a_time_limit_during_a_torchrun_test_leaves_no_worker(tmp_path):
    """run.sh's SIGINT lands while a test waits for torchrun: the KeyboardInterrupt ended the wait and
    subprocess.run killed the launcher alone, leaving its workers running (on the GPU node, holding
    the GPU for the next test). conftest.torchrun now ends the launcher's whole process group."""
    from conftest import torchrun
    script = tmp_path / 'sleeper.py'
    script.write_text(SLEEPER)
    workers = [tmp_path / 'worker0', tmp_path / 'worker1']

    def interrupt_once_started():
        deadline = time.monotonic() + 60
        while not all(w.exists() and w.read_text() for w in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGINT)
    import threading
    threading.Thread(target=interrupt_once_started, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        torchrun(2, tmp_path, script=str(script), timeout=90)
    pids = [int(w.read_text()) for w in workers]
    deadline = time.monotonic() + 15
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in pids if os.path.exists(f'/proc/{pid}') and
                 open(f'/proc/{pid}/stat').read().split(') ')[1][0] != 'Z']
        time.sleep(0.2)
    for pid in alive:  # this test's own leftovers, by pid
        os.kill(pid, signal.SIGKILL)
    assert not alive, f'torchrun workers {alive} outlived the interrupted test'


STAGE_TESTS = '''
import time

def test_first():
    pass

def test_slow():
    time.sleep(1.5)

def test_{last}():
    assert {ok}
'''


def fake_check_python(tmp_path):
    """PYTHON for run.sh on this machine: the CUDA check answers as a GPU node's would, everything
    else is this interpreter (a fake of the outside: the GPU)."""
    wrapper = tmp_path / 'python'
    wrapper.write_text(f'#!/bin/sh\nif [ "$1" = tests/gpu/cuda_check.py ]; then echo "CUDA: a fake GPU for a '
                       f'CPU test"; exit 0; fi\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


@pytest.mark.parametrize('ok, code', [(True, 0), (False, 1)])
def test_run_sh_says_failures_not_budgets(tmp_path, ok, code):
    """run.sh's exit code was timeout's 124 (or 137) whenever a budget cut a stage, failures or not
    (issue 45). Now the test stage stops between two tests when its budget is spent (pytest-timeout's
    --session-timeout), what it left out is listed as not run, and the exit code says whether a test
    that ran failed: 0 with a budget cut, 1 with a failure before it."""
    (tmp_path / 'conftest.py').write_text(
        'from gpu.progress import pytest_runtest_logfinish, pytest_runtest_logstart  # noqa\n')
    last = 'last' if ok else 'fails'
    tests = tmp_path / 'test_stage.py'
    tests.write_text(STAGE_TESTS.format(last=last, ok=ok))
    order = [f'{tests}::test_first', f'{tests}::test_{last}' if not ok else f'{tests}::test_slow',
             f'{tests}::test_slow' if not ok else f'{tests}::test_last']
    listed = tmp_path / 'list.txt'
    listed.write_text('\n'.join(order) + '\n')
    results_dir = tmp_path / 'R'
    env = {**os.environ, 'PYTHON': fake_check_python(tmp_path),
           'PYTHONPATH': os.pathsep.join([str(ROOT / 'tests'), os.environ.get('PYTHONPATH', '')])}
    p = subprocess.run(['bash', str(ROOT / 'tests' / 'gpu' / 'run.sh'), '--list', str(listed), '--test-budget', '1',
                        '--tests-only', '--results', str(results_dir)], capture_output=True, text=True, env=env,
                       timeout=120)
    summary = (results_dir / 'summary.md').read_text()
    assert p.returncode == code, p.stdout[-3000:] + p.stderr[-2000:]
    assert '| `test_first` | passed |' in summary and f'| `{order[2].split("::")[1]}` | not run' in summary
    assert ('| `test_slow` | passed |' in summary) if ok else ('| `test_fails` | failed' in summary)
    assert sorted(os.listdir(results_dir)) == ['env.txt', 'junit.xml', 'log.txt', 'progress.txt', 'summary.md']


def test_a_side_by_side_stopped_by_its_time_limit_still_prints_its_table(tmp_path, monkeypatch, capsys):
    """run.sh stops side_by_side.py with SIGINT at its limit: the rows that finished make the table
    (the reference's, here), and the table says which row was stopped."""
    reference = tmp_path / 'train.py'
    reference.write_text('')
    monkeypatch.setattr(side_by_side, 'make_dataset', lambda args: str(tmp_path))
    monkeypatch.setattr(side_by_side, 'reference_row', lambda args, data, out: {
        'run': "torchvision's reference train.py", 'flags': 'NCHW', 'precision': 'fp32', 'img_s': 100.0,
        'bound': '', 'why': None})

    def interrupted(*a, **kw):
        raise KeyboardInterrupt
    monkeypatch.setattr(side_by_side, 'dlojz_row', interrupted)
    code = side_by_side.main(['--device', 'cpu', '--reference', str(reference), '--out', str(tmp_path / 'o')])
    out = capsys.readouterr()
    assert code == 0 and "| torchvision's reference train.py | `NCHW` | fp32 | 100 | 1.00 |" in out.out
    assert 'Stopped by its time limit during row 2 of 3.' in out.out and 'interrupted during row 2' in out.err


def test_a_test_in_a_class_is_one_row_under_its_own_name(tmp_path):
    """JUnit writes a class's test as classname 'tests.gpu.test_a.TestK', name 'test_x'; the progress
    file as tests/gpu/test_a.py::TestK::test_x. They are the same test: one row, passed, verdict 0
    (a review of issue 45 found it listed twice, once as 'unknown', which failed the verdict)."""
    junit = tmp_path / 'junit.xml'
    junit.write_text('<testsuites><testsuite><testcase classname="tests.gpu.test_a.TestK" name="test_x[p]" '
                     'time="0.5" /></testsuite></testsuites>')
    node = 'tests/gpu/test_a.py::TestK::test_x[p]'
    rows = results.merge(results.outcomes(junit), *results.read_progress(f'start\t{node}\nend\t{node}\n'))
    assert rows == [(node, 'passed', 0.5, '')] and results.verdict(rows) == 0
    assert results.junit_key(node) == ('tests.gpu.test_a.TestK', 'test_x[p]')


def test_run_sh_reads_a_list_written_on_windows_and_refuses_an_empty_one(tmp_path):
    """A list with CRLF line endings and edge spaces names its tests (pytest found none: 'not found'); a
    list of comments only is refused in one line (it ran every test of tests/); a results folder
    reused keeps no junit.xml of the previous run (its outcomes were taken for this run's)."""
    (tmp_path / 'conftest.py').write_text(
        'from gpu.progress import pytest_runtest_logfinish, pytest_runtest_logstart  # noqa\n')
    tests = tmp_path / 'test_stage.py'
    tests.write_text('def test_first():\n    pass\n')
    listed = tmp_path / 'list.txt'
    listed.write_bytes(f'# a comment\r\n  {tests}::test_first  \r\n'.encode())
    results_dir = tmp_path / 'R'
    results_dir.mkdir()
    (results_dir / 'junit.xml').write_text('<testsuites><testsuite><testcase classname="old" name="test_gone" '
                                           'time="1" /></testsuite></testsuites>')
    env = {**os.environ, 'PYTHON': fake_check_python(tmp_path),
           'PYTHONPATH': os.pathsep.join([str(ROOT / 'tests'), os.environ.get('PYTHONPATH', '')])}
    run = lambda: subprocess.run(['bash', str(ROOT / 'tests' / 'gpu' / 'run.sh'), '--list', str(listed),  # noqa
                                  '--tests-only', '--results', str(results_dir)], capture_output=True, text=True,
                                 env=env, timeout=120)
    p = run()
    summary = (results_dir / 'summary.md').read_text()
    assert p.returncode == 0 and '| `test_first` | passed |' in summary and 'test_gone' not in summary, p.stdout
    listed.write_text('# nothing but comments\n\n')
    p = run()
    assert p.returncode != 0 and 'names no test' in p.stdout + p.stderr
