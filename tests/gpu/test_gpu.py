"""What only a real GPU can prove (every test here is skipped on a machine without CUDA):

- mixed precision (fp16; bf16 from sm80) x channels-last x torch.compile trains: finite losses, the
  precision asked for, a completed summary, phases that fit in their step;
- steady training steps never make the host wait for the GPU
  (torch.cuda.set_sync_debug_mode('error')), fp16's GradScaler with the fused optimizer included, on
  pinned batches copied without blocking;
- the Chronometer's CUDA-event phases add up to the kernel time torch.profiler records (within 5 %);
- NVML energy is positive and within the board's enforced power limit x the elapsed time;
- the all-reduce hook's done event (measure.comm) comes after the all-reduce, on NCCL; on gloo with
  CUDA tensors both events are on this rank's GPU and read;
- an AdamW checkpoint written on the CPU continues fused on the GPU, and back;
- torchrun with NCCL at world size 1, and 2 GPUs with --sync-bn where the node has them; 2 ranks
  sharing one GPU (--share-gpu: gloo, since NCCL refuses it), its energy counted once;
- under --deterministic, a run resumed from a checkpoint reproduces the uninterrupted run's losses
  exactly;
- the device-clock verdicts: a fake-data ResNet-50 is compute-bound; the same run behind a slow
  loader is loader-bound, and its device clock still measures the same GPU time per step;
- device busy time on real CUDA events: a step that sleeps on the host between its launches is
  'host' bound and its probe steps measure the GPU work queued back to back, not the launch rate;
  the spin kernel behind the probes lasts what it was asked to, also when calibrated on an idle GPU;
- --decode gpu: nvJPEG's crops equal the CPU seam's (libjpeg-turbo) within 2 levels; nvImageCodec
  decodes a batch in one call per backend with no torch-side host wait, and records which backend
  decoded how many images, and whether the hardware engine decodes a region (hw_roi); a --decode
  fast worker forked after CUDA imports nvImageCodec itself and decodes regions quietly; decoding
  one batch ahead on a thread gives the same batches and the training stream never reads one before
  its decode ends; decoding never writes into memory that queued training kernels still read
  (pytorch/vision#9606; the same check catches a decode on the training stream, its positive
  control), and a run trains with it;
- batches handed over in shared slots and pinned by the pin-memory thread equal the default
  collate's; --loader dali's mixed decoder gives its CPU pipeline's batches on the device, and a run
  trains with it.

Run: python -m pytest -q tests/gpu    (bash tests/gpu/run.sh also runs the benchmark matrix)
"""
import io
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
import torchvision
from torch.autograd import DeviceType

from conftest import ROOT, TINY, latest, run_cli, run_main, torchrun
import dlojz
from dlojzlib import flags
from dlojzlib.data import datasets
from dlojzlib.data import decode, gpu_decode, nvdecode, region
from dlojzlib.dist import launch
from .conftest import unavailable
from dlojzlib.measure.power import PowerMeter
from dlojzlib.metrics import Meters
from dlojzlib.record.log import Console

CUDA = ['--device', 'cuda']


def losses(records):
    return {r['global_step']: r['loss'] for r in records if r['type'] == 'train'}


def read_run(out):
    """-> (summary.json, metrics.jsonl records) of a run directory."""
    with open(os.path.join(out, 'summary.json')) as f:
        summary = json.load(f)
    with open(os.path.join(out, 'metrics.jsonl')) as f:
        return summary, [json.loads(line) for line in f]


def skip_bf16_below_sm80(amp):
    if amp == 'bf16' and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip('--amp bf16 needs compute capability 8.0 (dlojz refuses it below)')


def heavy_flags():
    """A ResNet-50 step long enough that the GPU, not Python launching kernels, sets the pace: fp32
    (TF32) at 224 px, fake data so that the loader costs nothing, and as many images as memory
    allows (fp32 training keeps roughly 0.1 GiB of activations per image): 256 from 70 GiB (H100,
    A100-80GB), 128 from 30 GiB, else 64. At 64 x 128 px in bf16 an H100 would finish a step in a
    few ms, before eager PyTorch has launched its ~1000 kernels: the host, not the GPU, would set
    the pace."""
    memory = torch.cuda.get_device_properties(0).total_memory
    b = 256 if memory >= 70 * 2 ** 30 else 128 if memory >= 30 * 2 ** 30 else 64
    return [*CUDA, '--fake-data', '--arch', 'resnet50', '--amp', 'off', '-b', b, '--image-size', 224,
            '--val-resize', 256, '--val-image-size', 224, '--val-batch-size', b, '--fake-val-size', b]


@contextmanager
def built(tmp_path, cache_dir, *extra):
    """A run built in-process the way dlojz._main builds it (same backend flags, same seeding), for
    tests that drive train_step themselves. Nothing is logged (a disabled console opens no metrics
    file)."""
    argv = [str(a) for a in [*TINY, *CUDA, '--cache-dir', cache_dir, '--output-dir', tmp_path,
                             *extra]]
    dist = dlojz.get_dist_info()
    device = launch.pick_device('cuda', dist)
    args = flags.check_args(dlojz.get_args_parser().parse_args(argv), device, dist.world_size)
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    torch.use_deterministic_algorithms(args.deterministic)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = args.tf32
    dlojz.seed_everything(args.seed)
    run, _ = dlojz.build_run(args, dist, device, Console(False))
    try:
        yield run
    finally:
        run.log.close()


# ------------------------------------------------------------------------------ precision x layout x compile

CASES = [pytest.param(amp, nhwc, comp, id=f"{amp}-{'nhwc' if nhwc else 'nchw'}-{'compile' if comp else 'eager'}",
                      marks=[pytest.mark.slow] if comp else [])  # inductor compiles train and eval graphs
         for amp in ('fp16', 'bf16') for nhwc in (True, False) for comp in (False, True)]


@pytest.mark.parametrize('amp, channels_last, compiled', CASES)
def test_precision_layout_compile_train(tmp_path, cache_dir, amp, channels_last, compiled):
    skip_bf16_below_sm80(amp)
    if compiled:
        import torch._dynamo
        torch._dynamo.reset()  # earlier cases' graphs of the same forward would count against the recompile limit
    layout = '--channels-last' if channels_last else '--no-channels-last'
    s, recs = run_main(tmp_path, cache_dir, *CUDA, '--amp', amp, layout, *(['--compile'] if compiled else []),
                       '--test-nsteps', 4, '--log-interval', 1)
    assert s['status'] == 'completed' and s['provenance']['device'].startswith('cuda')
    c = s['config']
    assert (c['amp'], c['channels_last'], c['compile']) == (amp, channels_last, compiled)
    train = losses(recs)
    assert sorted(train) == [1, 2, 3, 4] and all(math.isfinite(v) for v in train.values()), train
    assert math.isfinite(s['val']['loss'])
    t, m = s['timing'], s['memory']
    assert t['clock'] == 'cuda-events' and t['phase_sum_error'] < 0.01
    assert m['gpu_max_allocated_bytes'] > 0 and m['peak_after_warmup']


# ------------------------------------------------------------------------------ no host sync in the hot loop

@pytest.mark.parametrize('amp', ['off', 'fp16', 'bf16'])
def test_steady_steps_never_wait_for_the_gpu(tmp_path, cache_dir, amp):
    """'error' makes every operation that blocks the host on the GPU raise: a tensor read on the
    host (.item(), bool(), .tolist(), .cpu()), nonzero, a blocking copy. No sync had to be allowed:
    the loss, the NaN guard and the meters stay on the device (the guard reads every --log-interval
    steps: never here), fp16's GradScaler hands its scale and inf flag to the fused SGD as tensors,
    and batches are copied with non_blocking=True. The mode cannot tell whether such a copy is truly
    asynchronous: from pageable memory the host stays in cudaMemcpyAsync while the driver stages the
    batch through its own pinned buffer, with no device sync to flag. Hence the check that the
    loader's batches are pinned."""
    skip_bf16_below_sm80(amp)
    with built(tmp_path, cache_dir, '--amp', amp, '--log-interval', 10 ** 6) as run:
        assert run.args.pin_memory and run.args.non_blocking
        meters = Meters(len(run.data.classes), run.device)
        batches = run.chrono.iterate(run.data.train_loader)  # steps timed by CUDA events, as in the loop
        for _ in range(2):  # warm-up: cudnn autotuning, allocator growth, momentum buffers, the scaler's state
            dlojz.train_step(run, *next(batches))
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode('error')
        try:
            for _ in range(3):  # the loader's pinning and the Chronometer's event queries run in here too
                images, labels = next(batches)
                assert images.is_pinned() and labels.is_pinned()
                meters.update(*dlojz.train_step(run, images, labels))
        finally:
            torch.cuda.set_sync_debug_mode('default')
        batches.close()
        run.chrono.finish()
        assert math.isfinite(meters.compute()['loss'])


def test_recipe_steps_never_wait_for_the_gpu(tmp_path, cache_dir):
    """The same check with the recipe's device-side work: mixup and cutmix (lambda and box drawn on
    the host), two accumulated micro-batches, the EMA update, a poly schedule with warm-up."""
    with built(tmp_path, cache_dir, '--amp', 'fp16', '--log-interval', 10 ** 6, '--mixup', 0.2, '--cutmix', 1.0,
               '--accum-steps', 2, '--ema-decay', 0.999, '--scheduler', 'poly', '--warmup-epochs', 0.1) as run:
        meters = Meters(len(run.data.classes), run.device)
        batches = run.chrono.iterate(run.data.train_steps)
        for _ in range(2):
            dlojz.train_step(run, *next(batches))
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode('error')
        try:
            for _ in range(2):
                meters.update(*dlojz.train_step(run, *next(batches)))
        finally:
            torch.cuda.set_sync_debug_mode('default')
        batches.close()
        run.chrono.finish()
        assert math.isfinite(meters.compute()['loss'])


# ------------------------------------------------------------------------------ CUDA events vs the profiler

def kernel_intervals(prof):
    """(start, end) in µs of every CUDA kernel torch.profiler recorded.

    prof.events() holds each kernel once, as a device-side event (device_type CUDA) whose time_range
    is the kernel's own span: the same attributes in every torch from 2.4 on. The same kernel is
    counted again in the device time of the CPU operator that launched it (device_time_total /
    self_device_time_total; older torch names them cuda_time_total / self_cuda_time_total, kept as
    deprecated aliases), and key_averages() has a row for the kernel and one for its operator:
    summing either view over all events counts kernels twice. Device-side events that are not
    kernels: Memcpy/Memset, and GPU user annotations (record_function ranges such as the optimizer's
    'Optimizer.step#SGD.step' mirrored on the device timeline, spanning many kernels and named as
    their CPU range). Recent torch (2.14) labels each event's activity_type ('kernel', 'gpu_memcpy',
    'gpu_user_annotation'...); without it, the names tell them apart."""
    events = prof.events()
    cpu_names = {e.name for e in events if e.device_type == DeviceType.CPU}

    def is_kernel(e):
        kind = getattr(e, 'activity_type', None)
        if kind:
            return kind == 'kernel'
        return not e.name.startswith(('Memcpy', 'Memset')) and e.name not in cpu_names
    return [(e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA and is_kernel(e)]


def profiled_kernels(prof):
    """kernel_intervals(prof); none at all means the profiler cannot see the GPU (no CUPTI):
    unavailable()."""
    kernels = kernel_intervals(prof)
    if not kernels:
        unavailable('torch.profiler recorded no CUDA kernel (CUPTI unavailable to this PyTorch)')
    return kernels


def busy_us(intervals):
    """Length of the union of intervals: time the GPU ran at least one kernel. Kernels of one stream
    may overlap a little (programmatic dependent launch on Hopper), so their durations are not
    simply added."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def test_phase_events_add_up_to_profiled_kernel_time(tmp_path, cache_dir):
    """A GPU-bound step (the queue stays full, so kernels follow each other without waiting for
    launches): the forward + backward + optimizer event times of 10 steps against the kernel time
    the profiler records for the same steps. Tolerance 5 %: the phases also hold the gaps between
    kernels (1-2 µs each on a full queue, ~1000 kernels in a step of 100 ms or more: 1-2 %) and any
    memset, and leave out the normalisation and NaN-guard kernels between phases (< 1 %). A host
    clock around queued work, or events on another stream, are off by far more (the course's
    host-clock forward/backward split read 5 %/95 % for a true ~1:2)."""
    n = 10
    with built(tmp_path, cache_dir, *heavy_flags(), '--log-interval', 10 ** 6) as run:
        # no probe steps: a probe's spin kernel runs before its step's start event, outside the
        # steps (H100: kernels 1.054 s against spans 1.029 s, a spin queued behind the idle-started
        # first step)
        run.chrono.probe = False
        for images, labels in run.chrono.iterate(run.data.train_loader, 5):  # cudnn autotuning, allocator growth
            dlojz.train_step(run, images, labels)
        run.chrono.finish()
        torch.cuda.synchronize()  # the profiler then records these n steps' kernels and nothing else
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            for images, labels in run.chrono.iterate(run.data.train_loader, n):
                dlojz.train_step(run, images, labels)
            run.chrono.finish()
            torch.cuda.synchronize()
        steps = run.chrono.steps[-n:]
    kernels = profiled_kernels(prof)
    gpu_s = busy_us(kernels) / 1e6
    phases_s = sum(r['forward'] + r['backward'] + r['optimizer'] for r in steps)
    span_s = sum(r['compute'] for r in steps)
    detail = f'{len(kernels)} kernels busy {gpu_s:.4f} s, phases {phases_s:.4f} s, step spans {span_s:.4f} s'
    assert len(steps) == n and gpu_s <= 1.01 * span_s, detail  # every kernel ran inside its step's event pair
    assert phases_s == pytest.approx(gpu_s, rel=0.05), detail


# ------------------------------------------------------------------------------ NVML energy

def test_nvml_energy_within_the_power_limit():
    """~3 s of fp16 matmuls: the energy counter moves, by no more than the enforced power limit (W,
    from mW) x the elapsed time + 10 % (boards exceed their limit only in transients), and agrees
    within 2x with the sampled mean power x the time (a mJ/J or mW/W slip is 1000x). From Ampere on
    (A100 excepted) NVML's power reading is a 1 s average, so the first samples lag the load: hence
    the loose factor."""
    try:
        import pynvml
        pynvml.nvmlInit()
    except ImportError:
        unavailable('nvidia-ml-py is not installed')
    except pynvml.NVMLError as e:
        unavailable(f'NVML cannot start ({e})')
    meter = PowerMeter('cuda')
    assert meter.available, meter.why
    try:
        limit_w = pynvml.nvmlDeviceGetEnforcedPowerLimit(meter._handle) / 1e3
    except pynvml.NVMLError as e:
        pytest.skip(f'this board reports no enforced power limit ({e})')
    a = torch.randn(8192, 8192, device='cuda', dtype=torch.float16)
    t0 = time.perf_counter()
    meter.start()
    while time.perf_counter() - t0 < 3.0:
        for _ in range(10):
            a @ a  # 1.1 TFLOP each: ~2 ms on an H100, ~30 ms on a T4
        torch.cuda.synchronize()
    meter.stop()
    elapsed = time.perf_counter() - t0
    s = meter.summary()
    assert s['available'] and meter.energy_j > 0
    assert meter.energy_j <= limit_w * elapsed * 1.1, (meter.energy_j, limit_w, elapsed)
    if s['mean_w']:
        assert 0.5 <= meter.energy_j / (s['mean_w'] * elapsed) <= 2, (meter.energy_j, s['mean_w'], elapsed)


# ------------------------------------------------------------------------------ torchrun and NCCL

def test_torchrun_one_gpu_runs_nccl_and_ddp(tmp_path, cache_dir):
    """A launcher at world size 1 still joins an NCCL group and wraps DDP (dlojz runs 1 GPU as it
    runs 32). Only a real NCCL communicator writes 'NCCL INFO' lines: --nccl-debug's log must hold
    them, after the initialisation marker."""
    p = torchrun(1, *TINY, *CUDA, '--cache-dir', cache_dir, '--output-dir', tmp_path, '--test-nsteps', 3,
                 '--nccl-debug')
    assert p.returncode == 0, p.stderr[-3000:]
    s, _ = read_run(tmp_path)
    assert s['status'] == 'completed' and s['world_size'] == 1
    assert s['provenance']['launcher'] == 'torchrun' and 'communication' in s
    assert s['timing']['totals']['comm_steps'] >= 1  # the all-reduce hook's CUDA events were read
    log = (tmp_path / 'nccl.rank0.log').read_text()
    assert 'Train step 0 - rank 0' in log and 'NCCL INFO' in log.split('Train step 0 - rank 0', 1)[1], log[-2000:]


def test_the_all_reduce_done_event_waits_for_the_all_reduce(tmp_path):
    """measure.comm on CUDA events, NCCL at world size 1: the all-reduce is queued behind a 50 ms
    spin on a side stream (a slow link), the backward pass's stream is not. The done event, recorded
    in the future's callback, must come after it: exposed ~50 ms. Recorded on a stream that does not
    wait, it would read ~0."""
    import torch.distributed as tdist

    from dlojzlib.measure import comm
    from dlojz_chrono import CudaTimeline
    timeline = CudaTimeline()
    timeline.delay(0.001)  # calibrates the spin
    tdist.init_process_group('nccl', init_method=f'file://{tmp_path}/store', rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 2)).cuda()
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0])
        side = torch.cuda.Stream()

        def slow_all_reduce(t):
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                timeline.delay(0.050)
                return tdist.all_reduce(t, async_op=True).get_future()
        timer = comm.CommTimer(1, timeline, all_reduce=slow_all_reduce)
        ddp.register_comm_hook(None, timer.hook)
        for _ in range(2):
            ddp(torch.randn(32, 64, device='cuda')).square().mean().backward()
            torch.cuda.synchronize()
            got = comm.resolve(*timer.take())
        assert got['exposed'] == pytest.approx(0.050, abs=0.015) and got['bytes'] == 4 * (64 * 64 + 64 + 64 * 2 + 2)
    finally:
        tdist.destroy_process_group()


def test_objects_travel_on_an_nccl_group_in_gpu_tensors(tmp_path):
    """Under Lightning dlojz makes no gloo group: launch's gather and broadcast then run on the
    default group, NCCL's, which takes no CPU tensor (dist/objects.py puts them on the current GPU;
    the CPU tests only see gloo). World size 1, in this process."""
    import torch.distributed as tdist

    from dlojzlib.dist import objects
    tdist.init_process_group('nccl', init_method=f'file://{tmp_path}/store', rank=0, world_size=1)
    try:
        box = {'rank': 0, 'times': [0.25] * 100}
        assert objects.gather(box, None) == [box] and objects.broadcast(box, 0, None) == box
    finally:
        tdist.destroy_process_group()


def test_the_hooks_events_on_gloo_with_cuda_tensors(tmp_path):
    """gloo on CUDA tensors (ranks sharing GPUs) runs the done callback on gloo's own thread, whose
    current CUDA device is 0: CudaTimeline records both of a bucket's events on this rank's GPU, and
    elapsed_time reads them (it raised across devices). The rank drives the last GPU, so that on a
    node with two or more the callback's thread is on another device and the device check can fail
    (on GPU 0 it held by construction); one GPU cannot show a second device, and there the check is
    left to tests/test_comm.py's fake."""
    import threading
    import torch.distributed as tdist

    from dlojzlib.measure import comm
    from dlojz_chrono import CudaTimeline
    device = torch.device('cuda', torch.cuda.device_count() - 1)
    torch.cuda.set_device(device)
    tdist.init_process_group('gloo', init_method=f'file://{tmp_path}/store', rank=0, world_size=1)
    seen = []  # (thread, its current device) where the hook's done callback ran
    try:
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 2)).to(device)
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index])
        timer = comm.CommTimer(1, CudaTimeline(device))

        def hook(state, bucket):
            def done(fut):
                seen.append((threading.current_thread(), torch.cuda.current_device()))
                return fut.value()  # timer.hook's future holds the bucket's tensor
            return timer.hook(state, bucket).then(done)
        ddp.register_comm_hook(None, hook)
        for _ in range(2):
            ddp(torch.randn(32, 64, device=device)).square().mean().backward()
            torch.cuda.synchronize()
            marks, buffers, _ = timer.take()
            got = comm.resolve(marks, buffers)
        parameters = 64 * 64 + 64 + 64 * 2 + 2
        assert got is not None and got['exposed'] >= 0 and got['bytes'] == 4 * parameters
        assert all(e.index == device.index for mark in marks for e in mark[:2])
        if device.index > 0:  # the check discriminates: the callback ran on another device
            assert any(current != device.index for _, current in seen), seen
    finally:
        tdist.destroy_process_group()
        torch.cuda.set_device(0)


def test_torchrun_two_ranks_share_one_gpu(tmp_path, cache_dir):
    """--share-gpu with 2 ranks on 1 GPU: NCCL refuses two ranks on one device ("Duplicate GPU
    detected"), so the group is gloo (CUDA all-reduce through host memory) and DDP trains to the end
    on both ranks. The all-reduce hook's events were read on both ranks, and the one board's energy,
    read by both, is counted once: the ranks' sum is about what one rank's counter read (the windows
    differ by start-up skew)."""
    first_gpu = os.environ.get('CUDA_VISIBLE_DEVICES', '0').split(',')[0]
    p = torchrun(2, *TINY, *CUDA, '--cache-dir', cache_dir, '--output-dir', tmp_path,
                 '--test-nsteps', 6, '--share-gpu', '--chkpt',
                 env={'CUDA_VISIBLE_DEVICES': first_gpu})
    assert p.returncode == 0, p.stderr[-3000:]
    assert 'all-reduced with gloo' in p.stdout
    s, _ = read_run(tmp_path)
    assert s['status'] == 'completed' and s['world_size'] == 2 and len(s['timing']['ranks']) == 2
    assert all(r['comm_steps'] >= 1 for r in s['timing']['ranks']), s['timing']['ranks']
    e = s['energy']
    if e['available']:
        assert e['ranks_on_board'] == 2
        assert all(r['ranks_on_board'] == 2 for r in s['timing']['ranks'])
        assert e['energy_j_all_ranks'] == pytest.approx(e['energy_j'], rel=0.5), e


def test_torchrun_two_gpus_sync_bn(tmp_path, cache_dir):
    if torch.cuda.device_count() < 2:
        pytest.skip('needs 2 GPUs on this node')
    import torchvision
    p = torchrun(2, *TINY, *CUDA, '--cache-dir', cache_dir, '--output-dir', tmp_path, '--test-nsteps', 3, '--sync-bn',
                 '--chkpt')
    assert p.returncode == 0, p.stderr[-3000:]
    s, _ = read_run(tmp_path)
    assert s['status'] == 'completed' and s['world_size'] == 2 and s['config']['sync_bn']
    assert len(s['timing']['ranks']) == 2 and s['memory']['gpu_max_allocated_bytes_any_rank'] > 0
    # SyncBatchNorm keeps BatchNorm's state-dict keys: the checkpoint loads into a plain torchvision
    # model
    state = torch.load(latest(tmp_path), map_location='cpu', weights_only=False)['model']
    torchvision.models.resnet18(num_classes=4).load_state_dict(state)


# ------------------------------------------------------------------------------ bit-exact resume on the GPU

DETERMINISTIC = [*TINY, *CUDA, '--deterministic', '-e', 2, '--log-interval', 1]


def cli_run(out, cache_dir, *flags):
    """One `python dlojz.py` process per run: CUBLAS_WORKSPACE_CONFIG only counts when set before
    CUDA starts, which an in-process run after other GPU tests cannot do. -> metrics records."""
    p = run_cli(*DETERMINISTIC, '--cache-dir', cache_dir, '--output-dir', out, *flags)
    assert p.returncode == 0, p.stderr[-3000:]
    return read_run(out)[1]


@pytest.fixture(scope='module')
def uninterrupted(tmp_path_factory, cache_dir):
    """The reference: 2 epochs of 12 steps, deterministic, a log line per step."""
    return cli_run(tmp_path_factory.mktemp('uninterrupted'), cache_dir)


@pytest.mark.parametrize('stop', [12, 18])  # end of epoch 1; mid-epoch 2 (sampler offset, as on CPU)
def test_resume_on_gpu_is_bit_exact(tmp_path, cache_dir, uninterrupted, stop):
    first = cli_run(tmp_path / 'part', cache_dir, '--test-nsteps', stop, '--chkpt')
    assert torch.load(latest(tmp_path / 'part'), map_location='cpu', weights_only=False)['global_step'] == stop
    second = cli_run(tmp_path / 'resumed', cache_dir, '--resume', latest(tmp_path / 'part'))
    ref, a, b = losses(uninterrupted), losses(first), losses(second)
    assert sorted(ref) == list(range(1, 25)) and sorted(b) == list(range(stop + 1, 25))
    assert [a[k] for k in range(1, stop + 1)] == [ref[k] for k in range(1, stop + 1)]  # GPU runs repeat at all
    assert [b[k] for k in range(stop + 1, 25)] == [ref[k] for k in range(stop + 1, 25)]
    final_ref = [r for r in uninterrupted if r['type'] == 'val'][-1]
    final_res = [r for r in second if r['type'] == 'val'][-1]
    assert (final_res['loss'], final_res['top1']) == (final_ref['loss'], final_ref['top1'])


def test_an_adamw_checkpoint_written_on_the_cpu_continues_fused_on_the_gpu(tmp_path, cache_dir):
    """AdamW on the CPU (not fused: its step counts stay on the CPU through load_state_dict),
    resumed on the GPU, where it is fused: the fused kernel was given a CPU step (a device mismatch;
    an illegal memory access with a tensor learning rate). Then back."""
    flags = [*TINY, '--cache-dir', cache_dir, '--optimizer', 'adamw', '--log-interval', 1]
    p = run_cli(*flags, '--device', 'cpu', '--output-dir', tmp_path / 'cpu', '--test-nsteps', 2,
                '--chkpt')
    assert p.returncode == 0, p.stderr[-3000:]
    p = run_cli(*flags, *CUDA, '--output-dir', tmp_path / 'gpu', '--test-nsteps', 4, '--chkpt',
                '--resume', latest(tmp_path / 'cpu'))
    assert p.returncode == 0, p.stderr[-3000:]
    s, recs = read_run(tmp_path / 'gpu')
    assert s['status'] == 'completed' and sorted(losses(recs)) == [3, 4]
    assert all(math.isfinite(v) for v in losses(recs).values())
    p = run_cli(*flags, '--device', 'cpu', '--output-dir', tmp_path / 'back', '--test-nsteps', 6,
                '--resume', latest(tmp_path / 'gpu'))
    assert p.returncode == 0, p.stderr[-3000:]
    assert read_run(tmp_path / 'back')[0]['status'] == 'completed'


# ------------------------------------------------------------------------------ device-clock verdicts

@pytest.fixture(scope='module')
def gpu_bound(tmp_path_factory, cache_dir):
    """A fake-data ResNet-50 run: nothing but the GPU sets the pace. -> summary."""
    return run_main(tmp_path_factory.mktemp('gpu-bound'), cache_dir, *heavy_flags(), '--test-nsteps', 20,
                    '--warmup-steps', 3)[0]


def test_fake_data_resnet50_is_compute_bound(gpu_bound):
    t, m, e = gpu_bound['timing'], gpu_bound['memory'], gpu_bound['energy']
    assert gpu_bound['status'] == 'completed' and t['clock'] == 'cuda-events'
    assert t['bound'] == 'compute' and t['device_busy'] >= 0.9, (t['bound'], t['device_busy'], t['data_share'])
    assert t['compute_headroom'] < 1.2  # median host step / median GPU step: nothing but the GPU to wait for
    assert t['phase_sum_error'] < 0.01
    assert m['peak_after_warmup'] and m['gpu_max_allocated_bytes'] > 2 ** 30
    if e['available']:
        assert e['energy_j'] > 0 and e['train_energy_j'] > 0 and e['joules_per_image'] > 0


def test_cuda_graphs_keep_the_gpu_busy(tmp_path, cache_dir):
    """--compile-mode reduce-overhead on fake-data ResNet-50 (bf16, channels-last, batch 128): the
    kernels replayed as CUDA graphs, the GPU waits for no launch: device busy at least 95 % (issue 45's
    goal; the default mode measured 73 % on the first GPU run, host-bound) and finite losses. Its
    throughput is printed, not compared with eager's: the benchmark's fake-data rows (bench.py) put
    the two side by side."""
    import torch._dynamo
    torch._dynamo.reset()
    flags = [*CUDA, '--arch', 'resnet50', '--image-size', 224, '-b', 128, '--amp', 'bf16', '--channels-last',
             '--fake-data', '--test-nsteps', 40, '--warmup-steps', 10, '--log-interval', 10]
    s, recs = run_main(tmp_path / 'graphs', cache_dir, *flags, '--compile', '--compile-mode', 'reduce-overhead')
    t = s['timing']
    assert s['status'] == 'completed' and all(math.isfinite(v) for v in losses(recs).values())
    print(f"reduce-overhead: {t['train_throughput']:.0f} img/s, device busy {t['device_busy']:.1%}, {t['bound']}")
    assert t['device_busy'] >= 0.95, (t['device_busy'], t['bound'])


def test_slow_loader_is_loader_bound_by_the_device_clock(tmp_path, cache_dir, gpu_bound, monkeypatch):
    """The same run behind a loader that takes three times the GPU's step time per batch: the device
    idles two thirds of each step, so the verdict (the largest share) is 'loader' (at twice, the
    GPU's work and its idle time are even: issue 39's rule would be a coin toss), and the device
    clock still measures the GPU's work per step (as without the wait, within 25 %: clocks ramp
    after idling) while host step minus data wait sees only the kernel launches, which the GPU runs
    during the next wait."""
    gpu_step = gpu_bound['timing']['stats']['compute']['median']
    wait = max(0.05, 3 * gpu_step)
    fast = datasets.FakeLoader.__iter__

    def slow(self):
        for batch in fast(self):
            time.sleep(wait)
            yield batch
    monkeypatch.setattr(datasets.FakeLoader, '__iter__', slow)
    s, _ = run_main(tmp_path, cache_dir, *heavy_flags(), '--test-nsteps', 8, '--warmup-steps', 2)
    t = s['timing']
    w, compute = t['warmup_steps'], t['stats']['compute']['median']
    host = statistics.median(a - d for a, d in zip(t['per_step']['step'][w:], t['per_step']['data'][w:]))
    assert s['status'] == 'completed' and t['bound'] == 'loader' and t['data_share'] > 0.5, t['bound']
    assert t['shares']['loader'] > 0.5, t['shares']
    assert t['gpu_throughput'] > 1.5 * t['train_throughput']
    assert compute == pytest.approx(gpu_step, rel=0.25)
    assert compute > 1.5 * host, (compute, host)
    assert t['phase_sum_error'] < 0.01


# ------------------------------------------------------------------------------------------ --decode gpu

def encoded_batch(n=32, size=64, seed=0):
    """n samples of three real-photo-like synthetic JPEGs (baseline, 4:2:0), as the workers hand
    them over."""
    gpu = gpu_decode.GpuTrainTransform(size, decode.host_train_transform(size))
    blobs = []
    for k in range(3):
        buf = io.BytesIO()
        datasets.synthetic_image(k, 'train', k, 0, 10).save(buf, 'JPEG', quality=90)
        blobs.append(decode.Blob(buf.getvalue(), f'synthetic-{k}'))
    samples = [(gpu(blobs[i % 3], random.Random(f'{seed}-0-{i}')), 0) for i in range(n)]
    return gpu_decode.GpuCollate(size)(samples)[0]


TORCHVISION = (None, "torchvision's decoder under test")


def nvimgcodec_decoder():
    """A DeviceDecode that must decode with nvImageCodec on this GPU: run.sh installs its wheel for
    torch's CUDA (tests/gpu/wheels.sh); without it the check is one this node was meant to make."""
    decoder = gpu_decode.DeviceDecode()
    device = torch.device('cuda', torch.cuda.current_device())
    if decoder._nv_of(device) is None:
        unavailable(f'nvImageCodec does not decode on this GPU: {decoder.why_not}')
    return decoder, device


@pytest.mark.parametrize('decoder', ['nvimgcodec', 'torchvision'])
def test_gpu_decoders_crops_match_the_cpu_seam(decoder):
    """Each GPU decoder's batch against the CPU seam's (libjpeg-turbo), same boxes and flips: the GPU's
    IDCT and chroma upsampling differ slightly, another crop would be tens of levels away."""
    batch = encoded_batch()
    if decoder == 'nvimgcodec':
        gpu, device = nvimgcodec_decoder()
    else:
        gpu, device = gpu_decode.DeviceDecode(nvimgcodec=TORCHVISION), torch.device('cuda')
    on_gpu = gpu(batch, device).cpu()
    on_cpu = batch.to('cpu')
    diff = (on_gpu.int() - on_cpu.int()).abs().float().mean(dim=(1, 2, 3))
    assert on_gpu.shape == on_cpu.shape and diff.max() < 2, diff
    assert gpu.decoder.startswith(decoder) and gpu.nv_refused == 0 and gpu.refused == 0


def test_the_batched_geometry_never_waits_for_the_gpu():
    """resize.resized_crops on the GPU under torch.cuda.set_sync_debug_mode('error'): any host wait
    for the device (a tensor built from a host list on the device, a read back) raises. Behind a
    long kernel, so that a wait would be a real one."""
    from dlojzlib.data import resize
    g = torch.Generator().manual_seed(0)
    images = [torch.randint(0, 256, (3, 300 + k, 400 - k), generator=g, dtype=torch.uint8).cuda()
              for k in range(16)]
    boxes = [(k, 2 * k, 200, 250 + k, bool(k % 2)) for k in range(16)]
    resize.resized_crops(images, boxes, 224)  # warm-up: cuBLAS and cuSPARSE handles
    torch.cuda.synchronize()
    torch.cuda._sleep(20_000_000)
    torch.cuda.set_sync_debug_mode('error')
    try:
        out = resize.resized_crops(images, boxes, 224)
    finally:
        torch.cuda.set_sync_debug_mode('default')
    assert out.shape == (16, 3, 224, 224) and out.is_cuda


class CountedCalls:
    """An nvImageCodec Decoder whose decode calls are kept: how many images each was handed."""

    def __init__(self, real):
        self.real, self.calls = real, []

    def decode(self, sources, **kw):
        self.calls.append(len(sources))
        return self.real.decode(sources, **kw)


def test_nvimgcodec_decodes_a_batch_in_one_call_without_a_host_wait_per_image(request):
    """nvImageCodec's decode of 128-image batches after a warm-up: each backend is called at most
    once a batch, the first one with the whole batch, never once per image; and under
    torch.cuda.set_sync_debug_mode('error') nothing around the call (the crops copied into torch's
    memory, the batched geometry, the stream waits and the ready event) makes the host wait for the
    GPU. nvImageCodec's own wait for its batch, inside each call, is not torch's and is not seen:
    the counted calls bound it. The backends' counts add up to the images decoded; they are printed
    and kept in junit.xml, with the rate, which must beat the 1,074 img/s that training reached with
    torchvision's decoder on the first GPU run (BENCHMARKS.md)."""
    decoder, device = nvimgcodec_decoder()
    batch = encoded_batch(128, size=224)
    for _ in range(2):
        decoder(batch, device)
    nv = decoder._nv[device]
    nv.chain = [(name, CountedCalls(backend)) for name, backend in nv.chain]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        decoder(batch, device)
    torch.cuda.synchronize()
    rate = 5 * 128 / (time.perf_counter() - t0)
    torch.cuda.set_sync_debug_mode('error')
    try:
        decoder(batch, device)
    finally:
        torch.cuda.set_sync_debug_mode('default')
    torch.cuda.synchronize()
    calls = {name: backend.calls for name, backend in nv.chain}
    backends = decoder.record()['nvimgcodec_backends']
    print(f'nvImageCodec, 128 images of 224 px: {rate:.0f} img/s ({decoder.decoder}); images per '
          f'backend {backends}; images per call {calls}')
    request.node.user_properties.append(('nvimgcodec_backends', json.dumps(backends)))
    request.node.user_properties.append(('img_per_s', f'{rate:.0f}'))
    assert calls[nv.chain[0][0]] == [128] * 6 and all(len(c) <= 6 for c in calls.values()), calls
    assert sum(backends.values()) + decoder.nv_refused == 8 * 128, backends
    assert rate > 2000, rate


def test_nvimgcodec_records_which_backend_decoded(request):
    """Whether this GPU's hardware JPEG engine decodes a region (hw_roi): a decoder holding that
    backend alone decodes one crop of a synthetic JPEG, or returns None (then nvImageCodec's CUDA
    decoder decodes every crop, on the SMs that training needs). Then a batch through the run's
    decoder: its counts per backend add up to the images it decoded. Both are printed and kept in
    junit.xml (hw_roi, nvimgcodec_backends, libnvjpeg) for BENCHMARKS.md."""
    decoder, device = nvimgcodec_decoder()
    n = region.import_nvimgcodec()
    try:
        engine = n.Decoder(device_id=device.index, max_num_cpu_threads=1,
                           backends=[n.Backend(n.BackendKind.HW_GPU_ONLY)])
    except RuntimeError as e:  # no engine on this GPU that nvImageCodec can start
        print(f'nvImageCodec\'s hardware decoder could not start: {e}')
        engine = None
    crop = None
    if engine is not None:
        alone = nvdecode.NvDecoder(n, device, chain=[('hardware', engine)])
        box = (40, 56, 160, 200, False)  # inside every synthetic image (300 px or more a side)
        crop = alone([encoded_batch(1).data], [box], torch.cuda.current_stream(device))[0]
        torch.cuda.synchronize()
    hw_roi = crop is not None
    batch = encoded_batch(32)
    decoder(batch, device)
    torch.cuda.synchronize()
    backends = decoder.record()['nvimgcodec_backends']
    print(f'hw_roi: {str(hw_roi).lower()}; {decoder.decoder} decoded a batch of 32: {backends}, '
          f'{decoder.nv_refused} refused; libnvjpeg {decoder.libnvjpeg}')
    request.node.user_properties.extend([('hw_roi', str(hw_roi).lower()),
                                         ('nvimgcodec_backends', json.dumps(backends)),
                                         ('libnvjpeg', str(decoder.libnvjpeg))])
    assert list(backends) == ['hardware', 'cuda', 'hybrid'], backends
    assert sum(backends.values()) == 32 - decoder.nv_refused, backends


# A --decode fast worker as a training run forks it: after the parent has used CUDA. nvImageCodec is
# imported in the worker, at its first decode (never by `import dlojz`), so its nvJPEG extension
# starts in a forked child where CUDA cannot; a 500 x 375 JPEG at 224 px is always a region decode.
FORKED_AFTER_CUDA = """
import multiprocessing, random, tempfile
import torch
import dlojz
from dlojzlib.data import datasets, decode
torch.ones(1, device='cuda').sum().item()
path = tempfile.mkdtemp() + '/a.JPEG'
datasets.synthetic_image(5, 'train', 5, 5, 10).resize((500, 375)).save(path, 'JPEG', quality=90)
fast = decode.FastTrainTransform(224)
worker = multiprocessing.get_context('fork').Process(
    target=lambda: [fast(path, random.Random(i)) for i in range(3)])
worker.start()
worker.join()
print(worker.exitcode, decode.REGION.counts[0], decode.REGION.counts[1])
"""


def test_a_fast_decode_worker_forked_after_cuda_decodes_regions_quietly():
    """--decode fast on a GPU node: a worker forked after the parent used CUDA imports nvImageCodec
    itself and decodes the crops' regions (the shared counts: 3 regions, no whole file), and its
    nvJPEG extension, which cannot start CUDA there, says nothing (it would, in every worker)."""
    if decode.REGION.why_not is not None:
        unavailable(f'no region decoder: {decode.REGION.why_not}')
    p = subprocess.run([sys.executable, '-c', FORKED_AFTER_CUDA], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    print(p.stderr[-2000:])
    assert p.returncode == 0 and p.stdout.split() == ['0', '3', '0'], (p.stdout, p.stderr[-2000:])
    noise = [line for line in p.stderr.splitlines() if 'nvjpeg' in line.lower()
             or 'nvimgcodec' in line.lower()]
    assert noise == [], noise


def overwritten(batch, decoder, trials=20):
    """Tensors the size of the decoded images are filled, reductions over them are queued behind a
    long kernel, the tensors are freed (their blocks return to the caching allocator at once), then
    `decoder()` runs. -> how many reductions saw other values than the fill: blocks a decoder wrote
    before the queued kernels read them."""
    files = list(torch.split(batch.data, batch.sizes))
    sizes = [tuple(img.shape) for img in gpu_decode.decode_jpeg(files, mode=gpu_decode.ImageReadMode.RGB)]
    bad = 0
    for trial in range(trials):
        held = [torch.full(s, 7, dtype=torch.uint8, device='cuda') for s in sizes]
        torch.cuda.synchronize()
        torch.cuda._sleep(50_000_000)  # ~25 ms of GPU time ahead of the reductions
        sums = [t.sum(dtype=torch.int64) for t in held]
        del held
        decoder()
        torch.cuda.synchronize()
        bad += sum(int(s.item()) != 7 * math.prod(shape) for s, shape in zip(sums, sizes))
    return bad


def test_decode_never_writes_into_memory_queued_kernels_read():
    """With torchvision's decode_jpeg called on the training stream, nvJPEG may be handed blocks
    that queued kernels still read and overwrite them before they run (pytorch/vision#9606); dlojz
    decodes with a stream of its own. torchvision's decoder is asked for by name: nvImageCodec, the
    run's decoder where its wheel is, writes into buffers of its own (cudaMallocAsync), never into
    blocks of torch's allocator, so it would pass whatever the streams. The next test shows the
    check sees the race."""
    batch = encoded_batch(16)
    decoder, device = gpu_decode.DeviceDecode(nvimgcodec=TORCHVISION), gpu_decode.indexed('cuda')
    assert overwritten(batch, lambda: decoder(batch, device)) == 0
    assert decoder.decoder.startswith('torchvision') and decoder.refused == 0


def test_the_race_check_sees_a_decode_on_the_training_stream():
    """Positive control of the test above: torchvision's decode_jpeg called on the current stream,
    as without dlojz's side stream. From 0.20 its batched decoder writes from a private stream that
    does not wait for the current one; 0.19 decodes on the current stream (no race to show)."""
    if not gpu_decode.decodes_lists(torchvision.__version__):
        pytest.skip(f'torchvision {torchvision.__version__} decodes on the current stream: no race to show')
    batch = encoded_batch(16)
    chunks = list(torch.split(batch.data, batch.sizes))
    bad = overwritten(batch, lambda: gpu_decode.decode_jpeg(chunks, mode=gpu_decode.ImageReadMode.RGB,
                                                              device='cuda'))
    # 0 means either the check cannot see the race or this torchvision fixed it: the test above then
    # proves nothing on this version, which is worth a red line
    assert bad > 0, (f'torchvision {torchvision.__version__} overwrote nothing in 20 trials on the training stream '
                     f'(pytorch/vision#9606 fixed here?)')


def test_decode_ahead_gives_what_decoding_in_the_step_gives():
    """Through the decode thread and its streams, the batches equal those decoded at the step, bit
    for bit."""
    batches = [(encoded_batch(16, seed=k), torch.arange(16) + 100 * k) for k in range(3)]
    want = [(x.to('cuda').cpu(), y) for x, y in batches]
    got = [(x.to('cuda').cpu(), y) for x, y in gpu_decode.DecodeAhead(batches, 'cuda')]
    assert len(got) == 3 and all(torch.equal(g, w) and torch.equal(gy, wy) for (g, gy), (w, wy) in zip(got, want))


def unfinished_reads(take, trials=10):
    """The geometry stream is held back (~25 ms of spin) before a batch is decoded; the training
    stream then takes the batch with `take` and sums it at once. -> how many sums differ from the
    batch's own, read after a full synchronisation: reads of a batch the decoder had not finished
    writing."""
    decoder = gpu_decode.DeviceDecode()
    device = torch.device('cuda', torch.cuda.current_device())
    geometry = decoder._streams_of(device)['geometry']
    bad = 0
    for trial in range(trials):
        batch = encoded_batch(16, seed=trial)  # other crops each time: a stale block holds other values
        torch.cuda.synchronize()
        with torch.cuda.stream(geometry):
            torch.cuda._sleep(50_000_000)
        decoded = decoder.decoded(batch, device)
        early = take(decoded).sum(dtype=torch.int64)
        torch.cuda.synchronize()
        bad += int(early.item() != decoded.images.sum(dtype=torch.int64).item())
    return bad


def test_the_training_stream_waits_for_the_decoded_batch():
    """DecodedBatch.to() makes the training stream wait for the decoder's event: no early read. The
    positive control reads the images without it, as a step would if the wait were lost, and sees
    unfinished batches."""
    assert unfinished_reads(lambda d: d.to('cuda')) == 0
    assert unfinished_reads(lambda d: d.images) > 0, 'the check cannot see an early read'


def test_a_run_trains_with_gpu_decode(tmp_path, cache_dir):
    s, recs = run_main(tmp_path, cache_dir, *CUDA, '--decode', 'gpu', '--num-workers', 2, '--test-nsteps', 6,
                       '--log-interval', 1)
    assert s['status'] == 'completed' and s['config']['decode'] == 'gpu'
    assert sorted(losses(recs)) == [1, 2, 3, 4, 5, 6] and all(math.isfinite(v) for v in losses(recs).values())
    assert s['data']['gpu_decode']['cpu_after_nvjpeg'] == 0  # the synthetic quirk files go through the workers


# ------------------------------------------------------------------------------ device busy time, for real

def spin_steps(chrono, steps, host_gap_s, kernel_s, timeline):
    """Steps of four phases; each sleeps `host_gap_s` on the host (Python launching slowly), then
    queues a spin kernel of `kernel_s` seconds."""
    for _ in chrono.iterate(range(steps)):
        for name in ('h2d', 'forward', 'backward', 'optimizer'):
            with chrono.phase(name):
                time.sleep(host_gap_s)
                timeline.delay(kernel_s)
    chrono.finish()


def test_probe_spin_lasts_what_it_was_asked():
    from dlojz_chrono import CudaTimeline
    timeline = CudaTimeline()
    timeline.delay(0.001)  # calibrates
    start, end = timeline.event(), timeline.event()
    start.record()
    timeline.delay(0.050)
    end.record()
    end.synchronize()
    assert start.elapsed_time(end) / 1e3 == pytest.approx(0.050, rel=0.1)


def test_a_spin_calibrated_on_an_idle_gpu_holds_once_it_is_busy():
    """torch.cuda._sleep counts SM clock cycles, and the probe's spin is calibrated by one 0.5 ms
    kernel where the steady window starts. Suspected: on a GPU idle long enough for its clocks to
    drop, the calibration reads a low clock and later spins, at full clock, come out shorter than
    asked. Calibrated after 2 s idle, then 1 s of matmuls: a 50 ms spin must still last 50 ms within
    15 %."""
    from dlojz_chrono import CudaTimeline
    torch.cuda.synchronize()
    time.sleep(2.0)
    timeline = CudaTimeline()
    timeline.calibrate()
    a = torch.randn(4096, 4096, device='cuda')
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 1.0:
        a @ a
        torch.cuda.synchronize()
    spans = []
    for _ in range(3):
        start, end = timeline.event(), timeline.event()
        start.record()
        timeline.delay(0.050)
        end.record()
        end.synchronize()
        spans.append(start.elapsed_time(end) / 1e3)
    assert statistics.median(spans) == pytest.approx(0.050, rel=0.15), spans


def test_host_bound_steps_are_called_host_and_measured_by_probes():
    """20 ms of host time per step, 2 ms of GPU work: before issue 20 the spans said busy ~1 and
    'compute'."""
    from dlojz_chrono import Chronometer, CudaTimeline
    timeline = CudaTimeline()
    chrono = Chronometer('cuda', warmup=2, timeline=timeline)
    spin_steps(chrono, 60, 0.005, 0.0005, timeline)
    s, tot = chrono.summary(global_batch=256), chrono.totals()
    assert s['bound'] == 'host' and tot['gpu_step_source'] == 'clean' and tot['probe_steps'] >= 5
    assert tot['gpu_step_s'] == pytest.approx(0.002, rel=0.2)  # the spin's calibration is within ~10 %
    assert s['device_busy'] < 0.25


def test_queued_work_is_clean_and_compute_bound():
    from dlojz_chrono import Chronometer, CudaTimeline
    timeline = CudaTimeline()
    chrono = Chronometer('cuda', warmup=2, timeline=timeline)
    spin_steps(chrono, 30, 0.0, 0.02, timeline)
    s, tot = chrono.summary(global_batch=256), chrono.totals()
    # the first steady step starts on an idle device (the window's sync): at most a probe or two
    assert s['bound'] == 'compute' and tot['gpu_step_source'] == 'clean' and tot['probe_steps'] <= 2
    assert tot['gpu_step_s'] == pytest.approx(0.08, rel=0.2)


# ------------------------------------------------------------------------------ batches into pinned memory, DALI

def test_pinned_shared_batches_equal_the_default_collates():
    """With pinned memory, torch's pin-memory thread copies each shared slot into a pinned batch
    (data.handover.SlotBatch.pin_memory) and frees the slot: the batches equal the default
    collate's."""
    from dlojzlib.data import handover
    from dlojzlib.data.workers import DataLoader

    class Pictures(torch.utils.data.Dataset):
        def __len__(self):
            return 40

        def __getitem__(self, i):
            return torch.full((3, 8, 8), i % 251, dtype=torch.uint8), i % 5

    kw = dict(batch_size=6, num_workers=2, prefetch_factor=2, pin_memory=True)
    want = list(DataLoader(Pictures(), **kw))
    collate = handover.SharedCollate(2, 2, 6, 8)
    got = list(DataLoader(Pictures(), collate_fn=collate, **kw))
    assert len(got) == len(want) == 7 and collate.stats()['batches_in_slots'] == 7
    for (x, y), (wx, wy) in zip(got, want):
        assert x.is_pinned() and y.is_pinned() and torch.equal(x, wx) and torch.equal(y, wy)


def test_dali_mixed_decoder_matches_its_cpu_pipeline(tmp_path, cache_dir):
    """--loader dali on a GPU: the 'mixed' decoder (nvJPEG, the hardware engine on A100/H100) gives
    the CPU pipeline's batches on the device, within a few levels (IDCT and upsampling differ), and
    a run trains."""
    from dlojzlib.data import dali
    if dali.dali() is None:
        pytest.skip('NVIDIA DALI is not installed')
    s, _ = run_main(tmp_path / 'run', cache_dir, *CUDA, '--loader', 'dali', '--num-workers', 2, '--test-nsteps', 4)
    assert s['status'] == 'completed' and s['data']['dali']['decoder'] == 'mixed'
    argv = [*TINY, '--cache-dir', cache_dir, '--loader', 'dali', '--num-workers', '2']
    args = flags.check_args(dlojz.get_args_parser().parse_args(argv), torch.device('cuda'))
    dist = SimpleNamespace(rank=0, world_size=1, local_rank=0, is_main=True)
    on = {d: datasets.build_data(args, dist, log=lambda *a: None, device=torch.device(d))
          for d in ('cuda', 'cpu')}
    for d in on.values():
        d.set_epoch(0)
    gx, gy = next(iter(on['cuda'].train_loader))
    cx, cy = next(iter(on['cpu'].train_loader))
    assert gx.device.type == 'cuda' and torch.equal(gy, cy)
    assert (gx.cpu().int() - cx.int()).abs().float().mean() < 3
