"""Chronometer arithmetic with an injected clock: exact per-phase times, warm-up exclusion, statistics,
phases that add up to the step, and the course's '>>>' lines parsed the way controle_technique parses them.
On a fake asynchronous GPU (a device timeline on the same fake clock): compute and GPU throughput come from
the device's clock in loader-bound and GPU-bound runs, nothing synchronises between steps, and the phase
check fails when phases overlap. The PowerMeter on a fake NVML: the GPU found by UUID whatever
CUDA_VISIBLE_DEVICES says, and J/image over the steady training steps only.

Run: python -m pytest -q tests/test_chrono.py
"""
import statistics
import time

import pytest
import torch

from dlojz_chrono import Chronometer, describe
from dlojzlib.measure.power import PowerMeter
from dlojzlib.record.summary import energy_over_ranks, final_lines, ranks_summary


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t

    def advance(self, dt):
        self.t += dt


class SlowLoader:
    """Each batch costs `waits[i]` seconds of the fake clock."""

    def __init__(self, clock, waits):
        self.clock, self.waits = clock, waits

    def __iter__(self):
        for i, w in enumerate(self.waits):
            self.clock.advance(w)
            yield i


def drive(chrono, clock, waits, phase_times, other=0.0, max_steps=None):
    for i in chrono.iterate(SlowLoader(clock, waits), max_steps):
        for name, dt in phase_times[i].items():
            with chrono.phase(name):
                clock.advance(dt)
        clock.advance(other)
    chrono.finish()


def test_exact_phases_steps_and_other():
    clock = FakeClock()
    chrono = Chronometer('cpu', warmup=1, clock=clock)
    waits = [2.0, 0.1, 0.2, 0.3]
    phases = [{'h2d': 0.5, 'forward': 1.0, 'backward': 2.0, 'optimizer': 0.25}] + \
             [{'h2d': 0.01, 'forward': 0.1 * k, 'backward': 0.2 * k, 'optimizer': 0.05} for k in (1, 2, 3)]
    drive(chrono, clock, waits, phases, other=0.04)
    assert len(chrono.steps) == 4
    assert sum(r['step'] for r in chrono.steps) == pytest.approx(clock.t)  # the steps tile all the time spent
    for rec, w, ph in zip(chrono.steps, waits, phases):
        assert rec['data'] == pytest.approx(w)
        for name, dt in ph.items():
            assert rec[name] == pytest.approx(dt)
        assert rec['other'] == pytest.approx(0.04)
        assert rec['step'] == pytest.approx(w + sum(ph.values()) + 0.04)
    st = chrono.stats()
    # warm-up step 0 (2 s wait, 3.75 s compute) is excluded from every statistic
    fwd = [0.1, 0.2, 0.3]
    assert st['forward']['n'] == 3
    assert st['forward']['mean'] == pytest.approx(statistics.fmean(fwd))
    assert st['forward']['median'] == pytest.approx(0.2)
    assert st['forward']['std'] == pytest.approx(statistics.pstdev(fwd))
    assert st['data']['min'] == pytest.approx(0.1)
    assert st['data']['p90'] == pytest.approx(0.3)
    compute = [0.01 + 0.3 * k + 0.05 + 0.04 for k in (1, 2, 3)]
    assert st['compute']['median'] == pytest.approx(compute[1])
    s = chrono.summary(global_batch=64, batches_per_epoch=100)
    assert s['phase_sum_error'] == pytest.approx(0.0, abs=1e-12)
    assert s['gpu_throughput'] == pytest.approx(64 / compute[1])
    assert s['train_throughput'] == pytest.approx(64 / (0.2 + compute[1]))
    assert s['epoch_time_estimate_s'] == pytest.approx(100 * (0.2 + compute[1]))
    assert s['first_steps'][0]['data'] == pytest.approx(2.0)
    assert sum(s['phase_share'].values()) == pytest.approx(1.0)


def test_max_steps_stops_and_closes_last_step():
    clock = FakeClock()
    chrono = Chronometer('cpu', warmup=0, clock=clock)
    drive(chrono, clock, [0.1] * 10, [{'forward': 1.0}] * 10, max_steps=3)
    assert len(chrono.steps) == 3
    assert all(r['step'] == pytest.approx(1.1) for r in chrono.steps)


def test_phases_off_records_only_host_times():
    clock = FakeClock()
    chrono = Chronometer('cpu', phases=False, warmup=0, clock=clock)
    drive(chrono, clock, [0.1, 0.1], [{'forward': 1.0}] * 2)
    assert set(chrono.steps[0]) == {'data', 'step', 'compute', 'images', 'clean'}
    assert chrono.stats()['compute']['median'] == pytest.approx(1.0)


def test_interval_includes_current_step_and_resets():
    clock = FakeClock()
    chrono = Chronometer('cpu', clock=clock)
    seen = []
    for i in chrono.iterate(SlowLoader(clock, [0.5, 0.1, 0.3])):
        clock.advance(1.0)
        if i == 1:
            seen.append(chrono.interval())  # logged inside step 2: steps 1 and 2 count
    assert seen == [(pytest.approx(0.3), 2)]
    assert chrono.interval() == (pytest.approx(0.3), 1)
    assert chrono.interval() == (0.0, 0)


def test_course_summary_lines_parse_like_controle_technique():
    clock = FakeClock()
    chrono = Chronometer('cpu', warmup=1, clock=clock)
    chrono.start()
    drive(chrono, clock, [1.0, 0.1, 0.1, 0.1], [{'forward': 0.2, 'backward': 0.4}] * 4)
    with chrono.validation():
        clock.advance(65.5)
    chrono.stop()
    lines = chrono.display_lines(batches_per_epoch=2503)
    train = next(l for l in lines if 'Training performance' in l) + '\n'
    st = chrono.stats()['compute']
    # dlojz_tools.controle_technique: avg = split(' ')[-4], min = [-6], std = [-1][:-2]
    assert float(train.split(' ')[-4]) == pytest.approx(st['median'], abs=5e-5)  # printed to 0.1 ms
    assert float(train.split(' ')[-6]) == pytest.approx(st['min'], abs=5e-5)
    assert float(train.split(' ')[-1][:-2]) == pytest.approx(st['std'], abs=5e-5)
    assert next(l for l in lines if 'batch per epoch' in l).split()[-1] == '2503'
    assert '>>> Validation time: 0:01:05.500000' in lines
    assert float(next(l for l in lines if 'First step loading' in l).split()[-1]) == pytest.approx(1.0)
    fwd = next(l for l in lines if 'Forward performance' in l)
    assert float(fwd.split(' ')[-4]) == pytest.approx(0.2, abs=5e-5)


def test_describe_nearest_rank_p90():
    d = describe([float(i) for i in range(1, 11)])
    assert (d['min'], d['median'], d['p90'], d['mean']) == (1.0, 5.5, 9.0, 5.5)
    assert describe([]) is None


def test_real_clock_phases_fit_in_their_step():
    """With the real host clock, each step holds its phases and 'other' is what is left (never negative on
    CPU, where every phase is a host interval)."""
    chrono = Chronometer('cpu', warmup=0)
    x = torch.randn(256, 256)
    for _ in chrono.iterate(range(10)):
        with chrono.phase('forward'):
            y = x @ x
        with chrono.phase('backward'):
            y = y @ x
    for r in chrono.steps:
        assert r['step'] >= r['data'] + r['forward'] + r['backward'] and r['other'] >= 0
    assert chrono.summary(1)['phase_sum_error'] < 1e-9


def test_power_meter_unavailable_on_cpu():
    p = PowerMeter('cpu')
    p.start()
    p.stop()
    assert p.summary() == {'available': False, 'why_unavailable': 'not a CUDA device',
                           'board': None, 'ranks_on_board': 1, 'peak_w': None,
                           'mean_w': None, 'energy_j': None, 'train_energy_j': None, 'train_images': 0,
                           'joules_per_image': None,
                           'unmeasured': dict.fromkeys(['peak_w', 'energy_j', 'joules_per_image'],
                                                       'not a CUDA device')}


class CountingClock:
    def __init__(self):
        self.reads = 0

    def __call__(self):
        self.reads += 1
        return float(self.reads)


@pytest.mark.parametrize('phases, reads_per_step', [(True, 3 + 2 * 4), (False, 3)])
def test_cost_per_step_is_a_few_clock_reads(phases, reads_per_step, monkeypatch):
    """The Chronometer's own cost, counted rather than timed (a busy machine cannot change a count): per
    step, the wait for the batch (2 reads) and the end of the step (1), plus 2 per phase when phases are on;
    on CPU no CUDA call at all. Measured: 13.9 us per step with phases, 2.7 us without (BENCHMARKS.md)."""
    monkeypatch.setattr(torch.cuda, 'synchronize', lambda *a: pytest.fail('synchronize on CPU'))
    monkeypatch.setattr(torch.cuda, 'Event', lambda *a, **k: pytest.fail('CUDA event on CPU'))
    clock = CountingClock()
    chrono = Chronometer('cpu', phases=phases, warmup=0, clock=clock)
    n, entered = 50, 0
    for _ in chrono.iterate(range(n)):
        for name in ('h2d', 'forward', 'backward', 'optimizer'):
            with chrono.phase(name):
                entered += 1
    chrono.finish()
    assert entered == 4 * n
    assert clock.reads == n * reads_per_step + 1  # + the read that finds the loader exhausted


# ------------------------------------------------------------------------------ a fake asynchronous GPU

class FakeGPU:
    """A device timeline on the fake host clock: work launched at host time t starts when the device has
    finished what was queued before it; an event completes when the device reaches it. Like CUDA, reading
    an event that has not completed raises, and the host blocks when more than `depth` seconds of work are
    queued (the launch queue is finite)."""

    def __init__(self, clock, depth=0.3):
        self.clock, self.depth, self.free_at, self.syncs = clock, depth, 0.0, 0

    def launch(self, seconds):
        self.free_at = max(self.free_at, self.clock.t) + seconds
        if self.free_at - self.clock.t > self.depth:  # the launch blocks until the queue has room
            self.clock.t = self.free_at - self.depth

    def event(self):
        return FakeEvent(self)

    def delay(self, seconds):  # a spin kernel: a probe step's head start
        self.launch(seconds)

    def synchronize(self):
        self.syncs += 1
        self.clock.t = max(self.clock.t, self.free_at)


class FakeEvent:
    def __init__(self, gpu):
        self.gpu, self.at = gpu, None

    def record(self):
        self.at = max(self.gpu.free_at, self.gpu.clock.t)  # reached once the work queued before it is done

    def query(self):
        return self.gpu.clock.t >= self.at

    def elapsed_time(self, end):
        if not (self.query() and end.query()):
            raise RuntimeError('cudaErrorNotReady: event not completed')
        return (end.at - self.at) * 1e3


GPU_WORK = {'h2d': 0.005, 'forward': 0.035, 'backward': 0.065, 'optimizer': 0.005}  # 110 ms per step
LAUNCH = 0.001  # host seconds to launch each phase's kernels


def drive_gpu(chrono, clock, gpu, wait, steps):
    """A training loop on the fake GPU: the loader makes the host wait `wait` s per batch; each phase costs
    the host LAUNCH s and queues its GPU_WORK. -> synchronisations seen during the loop."""
    for _ in chrono.iterate(SlowLoader(clock, [wait] * steps)):
        for name, work in GPU_WORK.items():
            with chrono.phase(name):
                clock.advance(LAUNCH)
                gpu.launch(work)
    during = gpu.syncs
    chrono.finish()
    return during


def test_loader_bound_gpu_throughput_comes_from_the_device_clock():
    """The issue's simulation: 110 ms of GPU work per step of 128 images, the loader at 1 000 img/s. Host
    step minus data wait is 4 ms of launches (32 000 img/s); the device clock gives the true ~1 150."""
    clock = FakeClock()
    gpu = FakeGPU(clock)
    chrono = Chronometer('cuda', warmup=1, clock=clock, timeline=gpu)
    assert drive_gpu(chrono, clock, gpu, wait=0.128, steps=20) == 1  # one, where the steady window starts
    s = chrono.summary(global_batch=128)
    true = 128 / sum(GPU_WORK.values())
    assert s['clock'] == 'cuda-events'
    assert s['gpu_throughput'] == pytest.approx(true, rel=0.02)  # launch latency of the first phase: 1 ms
    # 19 steady steps of 132 ms, and the last one waits for the device to finish its work: 111 ms after the
    # step began (its first launch, then 110 ms of work) instead of 4 ms
    assert s['train_throughput'] == pytest.approx(128 * 19 / (19 * 0.132 + 0.107), rel=1e-6)
    busy = 19 * 0.110 / (19 * 0.132 + 0.107)
    assert s['device_busy'] == pytest.approx(busy, rel=1e-6)
    # the device works 83 % of the steps: the largest share, the device idle for the batch the rest
    assert s['bound'] == 'compute' and s['shares'] == pytest.approx(
        {'compute': busy, 'loader': 1 - busy, 'host': 0.0, 'communication': 0.0, 'straggler': 0.0},
        abs=1e-6)
    for rec in chrono.steady:
        assert rec['forward'] == pytest.approx(0.035) and rec['backward'] == pytest.approx(0.065)
        assert rec['other'] >= -1e-12  # the named phases lie inside the step's span
    assert s['phase_sum_error'] == pytest.approx(0.0, abs=1e-9)
    assert gpu.syncs == 2  # and finish()


def test_gpu_bound_run_is_compute_bound():
    clock = FakeClock()
    gpu = FakeGPU(clock)
    chrono = Chronometer('cuda', warmup=1, clock=clock, timeline=gpu)
    assert drive_gpu(chrono, clock, gpu, wait=0.002, steps=60) == 1
    s = chrono.summary(global_batch=128)
    assert s['gpu_throughput'] == pytest.approx(128 / 0.110, rel=1e-6)  # queued work: no launch gap
    assert s['bound'] == 'compute' and s['device_busy'] > 0.9
    assert s['train_throughput'] == pytest.approx(128 / 0.110, rel=0.01)  # the host is throttled by the queue


def test_phase_check_fails_when_phases_overlap():
    """The check compares two measurements: phases nested in each other count twice and exceed the step."""
    clock = FakeClock()
    chrono = Chronometer('cpu', warmup=0, clock=clock)
    for _ in chrono.iterate(SlowLoader(clock, [0.1] * 3)):
        with chrono.phase('forward'):
            with chrono.phase('backward'):
                clock.advance(1.0)
    chrono.finish()
    assert chrono.summary(1)['phase_sum_error'] == pytest.approx(1.0)


def test_sync_timing_uses_the_host_clock_and_synchronises_at_phase_boundaries():
    clock = FakeClock()
    gpu = FakeGPU(clock)
    chrono = Chronometer('cuda', sync=True, warmup=0, clock=clock, timeline=gpu)
    drive_gpu(chrono, clock, gpu, wait=0.128, steps=3)
    s = chrono.summary(global_batch=128)
    assert s['clock'] == 'host+sync' and gpu.syncs == 3 * 2 * len(GPU_WORK)
    assert chrono.steps[-1]['forward'] == pytest.approx(LAUNCH + 0.035)


def test_on_steady_runs_once_after_warmup():
    clock = FakeClock()
    chrono = Chronometer('cpu', warmup=2, clock=clock)
    seen = []
    chrono.on_steady.append(lambda: seen.append(len(chrono.steps)))
    for epoch in range(2):  # over two epochs: once in all
        for _ in chrono.iterate(SlowLoader(clock, [0.1] * 3)):
            clock.advance(1.0)
    assert seen == [2]


# ------------------------------------------------------------------------------ a fake NVML

class FakeNVML:
    """Four GPUs in PCI order; each has a UUID, a PCI address and an energy counter (mJ) the test moves."""

    class PciInfo:
        def __init__(self, bus):
            self.domain, self.bus, self.device = 0, bus, 0

    def __init__(self):
        self.uuids = [f'GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd' for i in range(4)]
        self.energy = [0, 0, 0, 0]
        self.power_mw = [100_000, 200_000, 300_000, 400_000]

    def nvmlInit(self):
        pass

    def nvmlDeviceGetCount(self):
        return 4

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetUUID(self, h):
        return self.uuids[h]

    def nvmlDeviceGetPciInfo(self, h):
        return self.PciInfo(0x10 + h)

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        return self.energy[h]

    def nvmlDeviceGetPowerUsage(self, h):
        return self.power_mw[h]


class Props:
    """torch.cuda.get_device_properties of the one GPU visible with CUDA_VISIBLE_DEVICES=2: CUDA index 0,
    NVML index 2. torch prints UUIDs without NVML's 'GPU-' prefix."""
    name = 'Fake A100'
    uuid = '00000002-aaaa-bbbb-cccc-dddddddddddd'
    pci_domain_id, pci_bus_id, pci_device_id = 0, 0x12, 0


def test_power_meter_opens_the_visible_gpu_by_uuid(monkeypatch):
    monkeypatch.setenv('CUDA_VISIBLE_DEVICES', '2')
    nvml = FakeNVML()
    p = PowerMeter('cuda:0', nvml=nvml, props=Props(), synchronize=lambda: None)
    assert p.available and p._handle == 2  # by CUDA index it would be NVML's GPU 0


def test_power_meter_falls_back_to_the_pci_address():
    class MIG(Props):
        uuid = 'MIG-ffffffff-0000-1111-2222-333333333333'  # a MIG instance: its parent has the PCI address
    p = PowerMeter('cuda:0', nvml=FakeNVML(), props=MIG(), synchronize=lambda: None)
    assert p.available and p._handle == 2


def test_power_meter_says_why_when_the_gpu_is_not_found():
    class Other(Props):
        uuid, pci_bus_id = '99999999-0000-0000-0000-000000000000', 0x99
    s = PowerMeter('cuda:0', nvml=FakeNVML(), props=Other(), synchronize=lambda: None).summary()
    assert not s['available'] and 'Fake A100' in s['why_unavailable'] and s['joules_per_image'] is None


def test_joules_per_image_counts_steady_training_only():
    """Run energy 8 J: 1 J of warm-up and compilation, 5 J over the steady steps (10 images), 2 J of
    validation. J/image is 5 J / 10 images, not 8 / 10."""
    nvml, syncs = FakeNVML(), []
    p = PowerMeter('cuda:0', nvml=nvml, props=Props(), synchronize=lambda: syncs.append(1), period=0.001)
    p.start()
    nvml.energy[2] += 1000
    p.window_start()
    nvml.energy[2] += 5000
    p.window_stop(images=10)
    nvml.energy[2] += 2000
    time.sleep(0.01)
    p.stop()
    s = p.summary()
    assert s['energy_j'] == pytest.approx(8.0) and s['train_energy_j'] == pytest.approx(5.0)
    assert s['joules_per_image'] == pytest.approx(0.5) and s['peak_w'] == pytest.approx(300.0)
    assert syncs == [1]  # the warm-up's queued work is waited for once, outside the timed steps


def test_ranks_sharing_a_board_count_its_energy_once():
    """Ranks 0 and 1 share NVML board 2 (--share-gpu, MPS), rank 2 has board 3 (the fake GPU with
    UUID ...03). Each rank reads its board's counter. Over the steady windows board 2 spends 6 J and
    board 3 4 J while each rank trains 10 images; board 2 spends 2 J more in validation. By hand:
    the run's energy over all ranks 8 + 4 = 12 J (each rank summing its board's counter read 20 J),
    10 J / 30 images = 0.333 J/image over all ranks; rank 0 (or 1): 6 J / the board's 20 images =
    0.3 J/image (not 0.6); rank 2: 0.4 J/image."""
    class Board3(Props):
        uuid, pci_bus_id = '00000003-aaaa-bbbb-cccc-dddddddddddd', 0x13
    nvml = FakeNVML()
    meters = [PowerMeter('cuda:0', nvml=nvml, props=props, synchronize=lambda: None, period=0.001)
              for props in (Props(), Props(), Board3())]
    boards = [m.board for m in meters]  # what every rank's all-gather returns
    assert boards[0] == boards[1] != boards[2]
    for m in meters:
        m.share(boards)
        m.start()
        m.window_start()
    nvml.energy[2] += 6000  # mJ
    nvml.energy[3] += 4000
    for m in meters:
        m.window_stop(images=10)
    nvml.energy[2] += 2000
    for m in meters:
        m.stop()
    assert [m.summary()['joules_per_image'] for m in meters] == pytest.approx([0.3, 0.3, 0.4])
    # each board's own counter
    assert [m.summary()['energy_j'] for m in meters] == pytest.approx([8.0, 8.0, 4.0])
    over = energy_over_ranks([m.report() for m in meters])
    assert over['energy_j_all_ranks'] == pytest.approx(12.0)
    assert over['joules_per_image_all_ranks'] == pytest.approx(10 / 30)


def test_evaluate_with_nvml_ends_with_its_lines():
    """An --evaluate run on a GPU: power sampled, no training window. The closing lines must not fail on a
    J/image of None (it ended in a traceback after the summary)."""
    summary = {'timing': {}, 'config': {'output_dir': 'x'},
               'energy': {'peak_w': 250.0, 'energy_j': 12.0, 'joules_per_image': None},
               'memory': {'gpu_max_allocated_bytes': 2 ** 30, 'gpu_max_reserved_bytes': 2 ** 31,
                          'host_peak_rss_bytes': 2 ** 30}}
    lines = final_lines(summary, Chronometer('cpu'), 10)
    assert any('Peak Power during training: 250.0 W; energy 12.0 J' in line for line in lines)


def test_smaller_last_batch_is_left_out_of_the_statistics():
    """A new shape re-tunes cudnn and compiles another graph inside its step: the epoch's last, smaller
    batch is timed and counted for energy, not in the statistics."""
    clock = FakeClock()
    chrono = Chronometer('cpu', warmup=1, clock=clock)
    batches = [(None, [0] * 8)] * 4 + [(None, [0] * 3)]
    for _, labels in chrono.iterate(batches):
        clock.advance(10.0 if len(labels) == 3 else 1.0)
    chrono.finish()
    s = chrono.summary(8)
    assert s['partial_batch_steps'] == 1 and s['stats']['step']['p90'] == pytest.approx(1.0)
    assert chrono.images_after_warmup == 3 * 8 + 3


# ------------------------------------------------------------------------------ the verdict matrix

def drive_timeline(chrono, clock, gpu, wait, launch, work, steps):
    """Each step: the loader makes the host wait `wait` s; then each of the four phases costs the host
    `launch` s of kernel launches, after which its `work` s of device work is queued."""
    for _ in chrono.iterate(SlowLoader(clock, [wait] * steps)):
        for name in GPU_PHASES:
            with chrono.phase(name):
                clock.advance(launch)
                gpu.launch(work)
    chrono.finish()


GPU_PHASES = ('h2d', 'forward', 'backward', 'optimizer')

# (wait, launch per phase, work per phase, queue depth, batch) -> the expected verdict and the truth by hand:
# GPU throughput = batch / (4 x work); overall = batch / the host's or the device's step, whichever is longer.
MATRIX = {
    # the case: 20 ms of launches, 2 ms of GPU work per step (before: busy 0.985, 'compute', 12.7k)
    'host': (0.0, 0.005, 0.0005, 0.3, 256, 'host', 256 / 0.002, 256 / 0.020),
    # the device idle 194 ms of each 304 ms step, waiting for the batch
    'loader': (0.300, 0.001, 0.0275, 0.3, 128, 'loader', 128 / 0.110, 128 / 0.304),
    # the margin: the host waits 128 ms of each 132 ms step for its batch, but the device works 110
    # ms of it on the step before (before issue 39: 'loader', by the 90 % busy threshold). The
    # largest share is the device's work; the data wait's share is the 22 ms the device idled.
    'compute, a loader just slower': (0.128, 0.001, 0.0275, 0.3, 128, 'compute', 128 / 0.110,
                                      128 / 0.132),
    'compute': (0.002, 0.001, 0.0275, 0.3, 128, 'compute', 128 / 0.110, 128 / 0.110),
    # a launch queue shorter than a step: the host blocks in it, the device always ahead of the events
    'compute, shallow queue': (0.002, 0.001, 0.0275, 0.05, 128, 'compute', 128 / 0.110, 128 / 0.110),
}


@pytest.mark.parametrize('case', MATRIX)
def test_verdict_and_throughputs_on_fake_device_timelines(case):
    wait, launch, work, depth, batch, bound, gpu_truth, train_truth = MATRIX[case]
    clock = FakeClock()
    gpu = FakeGPU(clock, depth=depth)
    chrono = Chronometer('cuda', warmup=2, clock=clock, timeline=gpu)
    drive_timeline(chrono, clock, gpu, wait, launch, work, steps=200)
    s = chrono.summary(global_batch=batch)
    assert s['bound'] == bound
    assert s['gpu_throughput'] == pytest.approx(gpu_truth, rel=0.05)
    assert s['train_throughput'] == pytest.approx(train_truth, rel=0.05)
    busy_truth = (batch / gpu_truth) / (batch / train_truth)  # device work per step / wall time per step
    assert s['device_busy'] == pytest.approx(busy_truth, rel=0.05)
    # the shares by hand: the device's work, and its idle time went to the loader where the host
    # waited for a batch, else to the host's launches
    idle_for = 'loader' if wait > 4 * launch else 'host'
    assert s['shares']['compute'] == pytest.approx(busy_truth, rel=0.05)
    assert s['shares'][idle_for] == pytest.approx(1 - busy_truth, abs=0.03)
    assert sum(s['shares'].values()) == pytest.approx(1.0)


def test_host_bound_steps_are_measured_by_probes():
    """The device idles between launches: no plain span is clean; the probe steps (a spin kernel ahead of the
    step) measure 2 ms, not the 20 ms of launching, and there are few of them."""
    clock = FakeClock()
    gpu = FakeGPU(clock)
    chrono = Chronometer('cuda', warmup=2, clock=clock, timeline=gpu)
    drive_timeline(chrono, clock, gpu, 0.0, 0.005, 0.0005, steps=400)
    tot = chrono.totals()
    assert tot['gpu_step_source'] == 'clean' and tot['gpu_step_s'] == pytest.approx(0.002, rel=1e-6)
    assert 5 <= tot['probe_steps'] <= 5 + 400 // 100
    assert chrono.stats()['compute']['median'] == pytest.approx(0.020, rel=0.05)  # a span: the launching


def test_without_probes_a_starved_span_is_only_an_upper_bound():
    clock = FakeClock()
    gpu = FakeGPU(clock)
    chrono = Chronometer('cuda', warmup=2, clock=clock, timeline=gpu)
    chrono.probe = False
    drive_timeline(chrono, clock, gpu, 0.0, 0.005, 0.0005, steps=50)
    assert chrono.totals()['gpu_step_source'] == 'spans'


def test_bursty_loader_throughput_is_a_sum_not_a_median():
    """Defect 4: 8 workers deliver in bursts: one 0.43 s wait, then 7 batches already there; 20 ms of compute
    per step. By hand: 8 steps take 0.43 + 8 x 0.02 = 0.59 s, so 64 x 8 / 0.59 = 867.8 img/s (the median
    step, 0.02 s, said 3 200), an epoch of 1 000 steps 1000 x 0.59 / 8 = 73.75 s, headroom 0.59 / 0.16."""
    clock = FakeClock()
    chrono = Chronometer('cpu', warmup=8, clock=clock)
    drive(chrono, clock, ([0.43] + [0.0] * 7) * 10, [{'forward': 0.02}] * 80)
    s = chrono.summary(global_batch=64, batches_per_epoch=1000)
    assert s['train_throughput'] == pytest.approx(64 * 8 / 0.59)
    assert s['epoch_time_estimate_s'] == pytest.approx(1000 * 0.59 / 8)
    assert s['compute_headroom'] == pytest.approx(0.59 / 0.16)
    assert s['gpu_throughput'] == pytest.approx(64 / 0.02)
    assert s['bound'] == 'loader'
    assert s['stats']['step']['median'] == pytest.approx(0.02)  # the median stays a per-step latency


def drive_phases(chrono, clock, gpu, works, steps, wait=0.002, launch=0.001):
    for _ in chrono.iterate(SlowLoader(clock, [wait] * steps)):
        for name, work in works.items():
            with chrono.phase(name):
                clock.advance(launch)
                gpu.launch(work)
    chrono.finish()


def rank(number, works):
    """One rank of a data-parallel run on its own fake device -> what it sends at the end of the run."""
    clock = FakeClock()
    gpu = FakeGPU(clock)
    chrono = Chronometer('cuda', warmup=2, clock=clock, timeline=gpu)
    drive_phases(chrono, clock, gpu, works, steps=100)
    return {'rank': number, 'step_median_s': chrono.stats()['step']['median'], **chrono.totals()}


def test_waiting_for_a_rank_slow_in_its_forward_is_a_share_beside_the_work():
    """Rank 1 is slow in its forward pass (100 ms); rank 0's gradient all-reduce, at the end of its
    backward pass, waits for it: 95 ms of its 105 ms backward (no hook: the backward above the
    fastest rank's is the wait). Each GPU is busy all the time, yet by hand rank 0 waits 95 of its
    110 device-ms per step for rank 1 and works 15: the job is bound by a straggler, rank 1, whose
    own verdict is its work. Before issue 39 the sums read 'communication', the largest idle share;
    from issue 39 to 57, 'compute', from both ranks' sums (125 working of 220)."""
    fast = rank(0, {'h2d': 0.001, 'forward': 0.004, 'backward': 0.105, 'optimizer': 0.0})
    slow = rank(1, {'h2d': 0.001, 'forward': 0.099, 'backward': 0.010, 'optimizer': 0.0})
    s = ranks_summary([fast, slow])
    assert (s['bound'], s['straggler_rank'], s['straggler_bound']) == ('straggler', 1, 'compute')
    assert s['late_share'] == pytest.approx(95 / 110, rel=0.05) and s['comm_share'] == 0.0
    assert list(s['shares_job'])[:2] == ['straggler', 'compute']
    assert s['shares_job']['compute'] == pytest.approx(15 / 110, rel=0.1)
    assert s['device_busy_job'] == pytest.approx(1.0, rel=0.05)
    assert s['compute_headroom_job'] == pytest.approx(110 / 15, rel=0.1)
    same = ranks_summary([rank(0, {'forward': 0.05, 'backward': 0.06}), rank(1, {'forward': 0.05, 'backward': 0.06})])
    # the control
    assert same['bound'] == 'compute' and same['late_share'] == pytest.approx(0.0, abs=1e-9)


def test_under_fsdp2_a_rank_waits_in_its_forward_too():
    """--shard full gathers each block's parameters from every rank in the forward as well: rank 0,
    fast in its own work, waits 40 ms in its forward and 50 ms in its backward for rank 1 (90 of its
    200 device-ms per step, by hand). DDP's reading (the backward alone) would see 50."""
    works = ({'h2d': 0.0, 'forward': 0.09, 'backward': 0.11, 'optimizer': 0.0},
             {'h2d': 0.0, 'forward': 0.05, 'backward': 0.06, 'optimizer': 0.0})
    fsdp = ranks_summary([rank(0, works[0]), rank(1, works[1])], gathers=True)
    assert fsdp['comm_measured'] == 'forward and backward above the fastest rank'
    assert fsdp['late_share'] == pytest.approx(90 / 200, rel=0.05)  # rank 0's, the typical's
    ddp = ranks_summary([rank(0, works[0]), rank(1, works[1])])
    assert ddp['late_share'] == pytest.approx(50 / 200, rel=0.05)
