"""tests/gpu cannot look green without a GPU: `bash tests/gpu/run.sh` on a machine where torch sees no CUDA
GPU exits non-zero with one sentence and starts no test (pytest is never invoked), and DLOJZ_REQUIRE_GPU=1
turns "skipped for want of CUDA" into a failed session. The check's verdict is a pure function of the facts
(torch's CUDA, the driver, the GPUs, the wheel's architectures), tested here for each way a node fails.

Run: python -m pytest -q tests/test_gpu_runner.py
"""
import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location('cuda_check', ROOT / 'tests' / 'gpu' / 'cuda_check.py')
cuda_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cuda_check)

spec = importlib.util.spec_from_file_location('gpu_bench', ROOT / 'tests' / 'gpu' / 'bench.py')
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason='this machine has a GPU: run.sh would run the suite')
H100 = ('NVIDIA H100 80GB HBM3', (9, 0))
CU13_ARCHS = ['sm_75', 'sm_80', 'sm_86', 'sm_90', 'sm_100', 'sm_120']


@no_gpu
def test_run_sh_without_cuda_stops_before_any_test(tmp_path):
    log = tmp_path / 'invocations'
    wrapper = tmp_path / 'python'
    wrapper.write_text(f'#!/bin/sh\necho "$@" >> {log}\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    p = subprocess.run(['bash', str(ROOT / 'tests' / 'gpu' / 'run.sh')], capture_output=True, text=True,
                       env={**os.environ, 'PYTHON': str(wrapper)}, timeout=120)
    out = (p.stdout + p.stderr).strip()
    assert p.returncode == 1, out
    assert len(out.splitlines()) == 1 and out.startswith('tests/gpu needs CUDA') and 'Traceback' not in out, out
    assert log.read_text().splitlines() == ['tests/gpu/cuda_check.py']  # neither pytest nor bench.py started


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


def bench_summary():
    """The fields of a completed run's summary.json that bench.py's table reads."""
    return {'status': 'completed', 'config': {'amp': 'bf16'}, 'provenance': None,
            'timing': {'train_throughput': 100.0, 'gpu_throughput': 120.0, 'bound': 'compute', 'device_busy': 0.95,
                       'steps': 30},
            'memory': {'gpu_max_allocated_bytes': 2 ** 30}, 'energy': {'joules_per_image': 0.5},
            'loader': {'images_per_second': 500.0}}


@pytest.mark.parametrize('failing', ['loader_gpu', 'train_fast', 'amp_nhwc_compile_fake'])
def test_bench_exits_1_when_any_run_failed(tmp_path, monkeypatch, capsys, failing):
    """A failed row of either table makes bench.py exit 1 (the decode table's failures were shown as 'failed'
    cells and never counted: exit 0). The runs are a fake run_one; the failing one is named by its folder."""
    monkeypatch.setattr(bench.torch.cuda, 'is_available', lambda: True)

    def run_one(flags, out_dir):
        if os.path.basename(out_dir) == failing:
            return None, 'exit 1: dlojz: nvJPEG refused every image'
        return bench_summary(), None
    monkeypatch.setattr(bench, 'run_one', run_one)
    assert bench.main(['--quick', '--out', str(tmp_path)]) == 1
    out = capsys.readouterr()
    assert 'failed (exit 1: dlojz: nvJPEG refused every image)' in out.out and '1 run(s) failed' in out.err
    monkeypatch.setattr(bench, 'run_one', lambda flags, out_dir: (bench_summary(), None))
    assert bench.main(['--quick', '--out', str(tmp_path)]) == 0


def test_bench_budget_starts_no_row_after_it(tmp_path, monkeypatch, capsys):
    """--budget 0: no run starts, the table says which rows were left out."""
    monkeypatch.setattr(bench.torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(bench, 'run_one', lambda flags, out_dir: pytest.fail('a run started'))
    assert bench.main(['--quick', '--budget', '0', '--out', str(tmp_path)]) == 0
    assert 'Not run (--budget 0 s spent): amp_nhwc_eager_fake, amp_nhwc_compile_fake, --decode fast' in \
        capsys.readouterr().out


@pytest.mark.parametrize('required', [False, True])
def test_a_profile_without_gpu_kernels_fails_where_a_gpu_is_required(monkeypatch, required):
    """The profiler check of tests/gpu on a profile with no CUDA kernel (CUPTI missing; here a CPU profile): a
    skip, which DLOJZ_REQUIRE_GPU=1 did not turn into a failure, so the check vanished from a GPU run."""
    from gpu.test_gpu import profiled_kernels
    monkeypatch.setenv('DLOJZ_REQUIRE_GPU', '1' if required else '0')
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.ones(4).add_(1)
    with pytest.raises(pytest.fail.Exception if required else pytest.skip.Exception, match='no CUDA kernel'):
        profiled_kernels(prof)
