"""The lent GPU node's calls sized to the device time they may use (issue 56's review, F5 and F8),
on the CPU with the GPU faked:

- run.sh --seconds S derives each stage's limit from S (--plan prints them): the tests' budget and
  backstops, the benchmark's JPEG set and rows, the side by side; too few seconds for a call are
  refused in one sentence (exit 2);
- rehearsed with the CUDA check, bench.py and side_by_side.py answered by a fake interpreter: the
  benchmark gets the time the tests left, its JPEG set made first with the same --steps, 60 steps
  from 200 s left and 40 below (side_by_side.py: 100 and 60), no row in its last 60 s, and no
  benchmark at all, said in one line, when less than a row's time is left;
- bench.py makes its synthetic JPEGs before its clock starts, a few distinct images per class made
  on every usable core and hard-linked (side_by_side.py's method, whose distinct images it shares);
- a test of run.sh's list gets a time limit from its planned seconds (tests/gpu/conftest.py).

Run: python -m pytest -q tests/test_gpu_calls.py
"""
import json
import os
import pathlib
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

from gpu import bench, results, side_by_side

ROOT = pathlib.Path(__file__).resolve().parent.parent
RUN_SH = str(ROOT / 'tests' / 'gpu' / 'run.sh')


def run_sh(*options, env=None, timeout=120):
    return subprocess.run(['bash', RUN_SH, *map(str, options)], capture_output=True, text=True,
                          env=env, timeout=timeout)


@pytest.mark.parametrize('options, want', [
    (['--quick'], {'seconds': 540, 'test_budget_s': 295, 'bench_s': 190}),
    (['--quick', '--seconds', '300'], {'test_budget_s': 55}),
    (['--seconds', '400', '--tests-only'], {'test_budget_s': 305, 'bench_s': None}),
    (['--seconds', '400', '--test-budget', '100'], {'test_budget_s': 100}),
    (['--side-by-side'], {'seconds': 225, 'side_s': 190, 'test_budget_s': None}),
    (['--side-by-side', '--seconds', '300'], {'side_s': 265}),
    ([], {'seconds': None, 'test_budget_s': None}),  # a GPU node of one's own: no limit
])
def test_run_sh_plans_each_stage_from_the_seconds_of_its_call(options, want):
    """--seconds S: with the benchmark, the tests get S less the stages' start (25 s), the bench's
    JPEG set (20), its first rows (190) and the close (10); tests alone keep their SIGINT and
    SIGKILL backstops (40 + 20) inside S; the side by side gets S less the start and close."""
    p = run_sh(*options, '--plan')
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout)
    assert {k: got[k] for k in want} == want, got


@pytest.mark.parametrize('options, says', [
    (['--quick', '--seconds', '250'], 'leaves 5 s for the tests once the other stages have theirs; '
                                      'give at least 275 s, or --tests-only.'),
    (['--tests-only', '--seconds', '100'], 'leaves 5 s for the tests'),
    (['--side-by-side', '--seconds', '80'], 'give at least 95 s.'),
    (['--seconds', '9.5'], 'take whole seconds (got 9.5)'),
])
def test_seconds_too_few_for_a_call_are_one_sentence(options, says):
    p = run_sh(*options, '--plan')
    assert p.returncode == 2 and says in p.stderr and len(p.stderr.splitlines()) == 1, p.stderr


def fake_node(tmp_path):
    """-> (environment for run.sh, the file where the fakes log their arguments): the CUDA check
    answers as a GPU node's would, bench.py and side_by_side.py log their arguments and print
    nothing (so that no table replaces tests/gpu/last-bench.md), everything else is this
    interpreter."""
    calls, wrapper = tmp_path / 'calls', tmp_path / 'python'
    wrapper.write_text(f'#!/bin/sh\ncase "$1" in\n'
                       f'  tests/gpu/cuda_check.py) echo "CUDA: a fake GPU"; exit 0 ;;\n'
                       f'  tests/gpu/bench.py|tests/gpu/side_by_side.py) echo "$@" >> {calls}; '
                       f'exit 0 ;;\nesac\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    (tmp_path / 'conftest.py').write_text(
        'from gpu.progress import pytest_runtest_logfinish, pytest_runtest_logstart  # noqa\n')
    (tmp_path / 'test_stage.py').write_text('def test_first():\n    pass\n')
    (tmp_path / 'list.txt').write_text(f'{tmp_path / "test_stage.py"}::test_first 1 estimated\n')
    env = {**os.environ, 'PYTHON': str(wrapper),
           'PYTHONPATH': os.pathsep.join([str(ROOT / 'tests'), os.environ.get('PYTHONPATH', '')])}
    return env, calls


@pytest.mark.parametrize('seconds, steps', [
    pytest.param(260, 60, marks=pytest.mark.slow),  # 8 s each on 2 cores: pytest's start
    (220, 40),
    pytest.param(75, None, marks=pytest.mark.slow)])
def test_the_benchmark_takes_the_time_the_tests_left(tmp_path, seconds, steps):
    env, calls = fake_node(tmp_path)
    p = run_sh('--list', tmp_path / 'list.txt', '--seconds', seconds, '--test-budget', 1,
               '--results', tmp_path / 'R', env=env)
    log = p.stdout + p.stderr
    assert p.returncode == 0 and '| `test_first` | passed |' in log, log[-3000:]
    if steps is None:  # 75 s less the close and the tests: less than a row's 60 s
        assert not calls.exists() and re.search(r'run.sh: \d+ s left: no benchmark', log), log
        return
    made, ran = calls.read_text().splitlines()
    assert made.startswith(f'tests/gpu/bench.py --steps {steps} ') and made.endswith('--make-data')
    left, start_by, stop_at = map(int, re.search(
        rf'the benchmark has (\d+) s: --steps {steps}, no row after (\d+) s, SIGINT at (\d+) s',
        log).groups())
    assert seconds - 10 - 60 < left <= seconds - 10  # the close kept; the tests took a few s
    assert (start_by, stop_at) == (left - 70, left - 10)
    assert ran == f'tests/gpu/bench.py --steps {steps} --budget {start_by}', ran


@pytest.mark.parametrize("seconds, steps", [(250, 100), (150, 60)])
def test_the_side_by_side_takes_the_seconds_of_its_call(tmp_path, seconds, steps):
    env, calls = fake_node(tmp_path)
    p = run_sh('--side-by-side', '--seconds', seconds, '--results', tmp_path / 'R', env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert calls.read_text().startswith(f'tests/gpu/side_by_side.py --steps {steps} --out ')


def test_the_bench_makes_its_jpegs_before_its_clock_starts(tmp_path, monkeypatch, capsys):
    """The first JPEG row generated the bench's 10,400 JPEGs inside its budget (F5). The set is
    made before the clock: one that takes longer to make than the whole --budget still leaves the
    rows their start, and each JPEG row reads it; --make-data makes it alone (run.sh's first
    step), for the --steps given."""
    clock = [0.0]
    made = []

    def jpeg_set(opts):
        made.append(bench.per_class(opts))
        clock[0] += 1000.0  # longer than --budget
        return str(tmp_path / 'jpegs')
    monkeypatch.setattr(bench, 'jpeg_set', jpeg_set)
    monkeypatch.setattr(bench, 'Budget', lambda s, real=bench.Budget: real(s, lambda: clock[0]))
    monkeypatch.setattr(bench.torch.cuda, 'is_available', lambda: True)
    flags = {}

    def run_one(f, out_dir, env=None):
        clock[0] += 1.0
        flags[os.path.basename(out_dir)] = [str(x) for x in f]
        return None, 'a fake run'
    monkeypatch.setattr(bench, 'run_one', run_one)
    bench.main(['--quick', '--budget', '100', '--out', str(tmp_path / 'runs')])
    assert 'Not run' not in capsys.readouterr().out and len(flags) == 9, flags
    assert ' '.join(flags['gpu_nvimgcodec']).count(f"--data-dir {tmp_path / 'jpegs'}") == 1
    assert made == [1280]  # 50 steps (the default) of 256 images, 10 classes
    assert bench.main(['--make-data', '--steps', '40']) == 0 and made == [1280, 1024]
    assert capsys.readouterr().out == f"{tmp_path / 'jpegs'}\n"


def test_the_jpeg_set_is_a_few_distinct_images_linked(tmp_path, monkeypatch):
    """side_by_side.py's method for both scripts: `unique` JPEGs per class made once, on every
    usable core, each training file a hard link to one of them, as many per class as asked; a set
    of another size links the same distinct images, generating none."""
    from dlojzlib.data import synthetic
    real = synthetic.ensure_synthetic_dataset

    def spy(*args, workers=None, **kw):
        made = real(*args, workers=workers, **kw)
        spy.calls.append((workers, made))
        return made
    spy.calls = []
    monkeypatch.setattr(synthetic, 'ensure_synthetic_dataset', spy)
    roots = [side_by_side.linked_dataset(str(tmp_path), 2, n, val_per_class=1, log=print)
             for n in (5, 7)]
    cores = len(os.sched_getaffinity(0))
    assert spy.calls == [(cores, True), (cores, False)]  # generated once, on every core
    for root, n in zip(roots, (5, 7)):
        classes = sorted(os.listdir(os.path.join(root, 'train')))
        assert len(classes) == side_by_side.CLASSES
        files = [os.path.join(root, 'train', c, f) for c in classes
                 for f in os.listdir(os.path.join(root, 'train', c))]
        assert len(files) == n * side_by_side.CLASSES
        assert len({os.stat(f).st_ino for f in files}) == 2 * side_by_side.CLASSES
        assert all(open(f, 'rb').read(2) == b'\xff\xd8' for f in files)  # JPEGs


def test_a_listed_test_gets_a_time_limit_from_its_planned_seconds(tmp_path):
    """run.sh gives every test 120 s (--timeout); a list's test planned above 60 s (a cold compile)
    gets twice its plan, its cases their line's; the others, and every test without a list, keep
    run.sh's limit."""
    from gpu.conftest import limit_by_the_list
    listed = tmp_path / 'list.txt'
    listed.write_text('# a comment\ntests/gpu/t.py::test_compiled 90 estimated\n'
                      'tests/gpu/t.py::test_cases 80 estimated\n'
                      'tests/gpu/t.py::test_quick 3 measured\n')
    plugins = SimpleNamespace(hasplugin=lambda name: name == 'timeout')
    config = SimpleNamespace(pluginmanager=plugins)

    def items():
        found = [SimpleNamespace(nodeid=f'tests/gpu/t.py::{n}', marks=[])
                 for n in ('test_compiled', 'test_cases[a]', 'test_quick', 'test_unlisted')]
        for item in found:
            item.add_marker = item.marks.append
        return found
    got = items()
    limit_by_the_list(config, got, str(listed))
    assert [[m.args for m in i.marks] for i in got] == [[(180,)], [(160,)], [], []]
    got = items()
    limit_by_the_list(config, got, None)
    assert all(not i.marks for i in got)
    assert results.timeout_for(None) == 120 and results.timeout_for(59.5) == 120
