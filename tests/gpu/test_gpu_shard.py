"""--shard on a GPU (what tests/test_shard.py cannot show on CPU/gloo):

- --shard full runs on CUDA at world size 1 (a process group of one, FSDP2's slices moved to the GPU
  from the host) with SGD, whose kernels over FSDP2's DTensors are foreach (DTensor has no rule for
  the fused SGD kernel: the first step crashed), and with AdamW, fused: its model states measured
  within 1 % of the plan, its peak allocation recorded with the activations;
- --cpu-offload keeps the states in host memory: the GPU's peak falls by at least half the model
  states the run without it held there (the blocks computing are gathered onto it either way);
- its DCP checkpoint, written on the GPU at step 3 of 6, resumes on the GPU where the uninterrupted
  run goes: the same losses at steps 4 to 6 and the same validation, bit for bit (--deterministic,
  as tests/gpu/test_gpu.py's resume and tests/test_shard.py's on CPU);
- its checkpoint validates unsharded on the CPU as on the GPU.

Each run is a `python dlojz.py` process, made when a test first needs it: a list that the budget
cuts (run.sh) makes no run for the tests it left out, and a run that fails fails its own tests.

Run: python -m pytest -q tests/gpu/test_gpu_shard.py
"""
import json
import os

import pytest
import torch

from conftest import TINY, latest, run_cli

# ResNet-50 at 64 px: model states (0.3 GiB with SGD) well above the batch's activations' noise;
# every run deterministic, so that a resumed one can be held to the uninterrupted one bit for bit
FLAGS = [*TINY, '--arch', 'resnet50', '--image-size', '64', '--val-resize', '73',
         '--val-image-size', '64', '--device', 'cuda', '--amp', 'bf16', '--test-nsteps', '6',
         '--log-interval', '1', '--shard', 'full', '--deterministic', '--chkpt']
RUNS = {'sgd': ['--optimizer', 'sgd'],
        'adamw': ['--optimizer', 'adamw', '--chkpt-every', '3'],  # checkpoints at steps 3 and 6
        'offload': ['--optimizer', 'sgd', '--cpu-offload']}
KERNELS = {'sgd': 'foreach', 'adamw': 'fused'}  # recipe.implementation's word in the header


def read_run(out):
    """-> (summary.json, {step: training loss}, [validation records]) of a run folder."""
    with open(os.path.join(out, 'summary.json')) as f:
        summary = json.load(f)
    with open(os.path.join(out, 'metrics.jsonl')) as f:
        records = [json.loads(line) for line in f]
    losses = {r['global_step']: r['loss'] for r in records if r['type'] == 'train'}
    return summary, losses, [r for r in records if r['type'] == 'val']


@pytest.fixture(scope='module')
def sharded(tmp_path_factory, cache_dir):
    """-> run(name): (folder, summary, stdout) of RUNS[name], run once, when first asked for."""
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip('--amp bf16 needs compute capability 8.0 (the sharded modes refuse fp16)')
    made = {}

    def run(name):
        if name not in made:
            out = tmp_path_factory.mktemp(name)
            made[name] = out, run_cli(*FLAGS, *RUNS[name], '--cache-dir', cache_dir,
                                      '--output-dir', out)
        out, p = made[name]
        assert p.returncode == 0, p.stderr[-3000:]
        return out, read_run(out)[0], p.stdout
    return run


@pytest.mark.parametrize('optimizer', ['sgd', 'adamw'])
def test_full_sharding_runs_on_one_gpu_with_its_memory_recorded(sharded, optimizer):
    out, s, stdout = sharded(optimizer)
    m = s['memory']
    assert s['status'] == 'completed' and s['config']['shard'] == 'full'
    assert f'optimizer {optimizer} ({KERNELS[optimizer]})' in stdout, stdout[:3000]
    assert m['model_state_bytes'] == pytest.approx(m['model_state_plan_bytes'], rel=0.01), m
    assert m['gpu_max_allocated_bytes'] > m['model_state_bytes'], m
    assert '>>> Memory: model states per rank' in stdout and '>>> Max Memory Allocated' in stdout
    assert latest(out).suffix == '.dcp'  # each rank's slices, in torch.distributed.checkpoint's


def test_cpu_offload_takes_the_states_off_the_gpu(sharded):
    on_gpu, offloaded = sharded('sgd')[1]['memory'], sharded('offload')[1]['memory']
    # the same states, elsewhere
    assert offloaded['model_state_bytes'] == on_gpu['model_state_bytes']
    # the blocks being computed are gathered onto the GPU either way (two of ResNet-50's largest:
    # 0.04 GB of its 0.28 GB of states), and their gradients pass through it: at least half must go
    saved = on_gpu['gpu_max_allocated_bytes'] - offloaded['gpu_max_allocated_bytes']
    assert saved >= 0.5 * on_gpu['model_state_bytes'], (on_gpu, offloaded)


def test_a_sharded_gpu_checkpoint_resumes_on_the_gpu_where_the_uninterrupted_run_goes(
        sharded, tmp_path, cache_dir):
    """AdamW's moments and step counts, sliced as DTensors on the GPU, written by DCP at step 3
    and read back into a new process's FSDP2 model on the GPU: steps 4 to 6 repeat the
    uninterrupted run's losses and its validation (a lost or misplaced state moves them)."""
    whole, _, _ = sharded('adamw')
    _, ref, ref_val = read_run(whole)
    cut = os.path.join(whole, 'checkpoint-00000003.dcp')
    assert os.path.isdir(cut), os.listdir(whole)
    p = run_cli(*FLAGS, *RUNS['adamw'], '--cache-dir', cache_dir, '--output-dir',
                tmp_path / 'resumed', '--resume', cut)
    assert p.returncode == 0, p.stderr[-3000:]
    s, resumed, val = read_run(tmp_path / 'resumed')
    assert s['status'] == 'completed' and sorted(resumed) == [4, 5, 6], resumed
    assert [resumed[k] for k in (4, 5, 6)] == [ref[k] for k in (4, 5, 6)], (resumed, ref)
    assert (val[-1]['loss'], val[-1]['top1']) == (ref_val[-1]['loss'], ref_val[-1]['top1'])


def test_a_sharded_gpu_checkpoint_validates_unsharded_on_the_cpu(sharded, tmp_path, cache_dir):
    out, s, _ = sharded('sgd')
    dropped = {'--device': 1, '--amp': 1, '--shard': 1, '--deterministic': 0, '--chkpt': 0}
    cpu, skip = [], 0
    for f in FLAGS:  # the flags of the run, less its device, precision and sharding
        if skip:
            skip -= 1
        elif f in dropped:
            skip = dropped[f]
        else:
            cpu.append(f)
    p = run_cli(*cpu, '--device', 'cpu', '--amp', 'off', '--cache-dir', cache_dir, '--output-dir',
                tmp_path / 'cpu', '--resume', latest(out), '--evaluate')
    assert p.returncode == 0, p.stderr[-3000:]
    # bf16 autocast on the GPU against fp32 on the CPU: top-1 may move by an image, the loss by 1 %
    with open(tmp_path / 'cpu' / 'summary.json') as f:
        val, cpu_val = s['val'], json.load(f)['val']
    assert cpu_val['loss'] == pytest.approx(val['loss'], rel=0.01), (cpu_val, val)
