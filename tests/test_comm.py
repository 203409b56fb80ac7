"""The all-reduce timing (measure.comm) and the verdict made of it across ranks
(record.summary.ranks_summary), on stamps and rank reports whose expected values are worked out by
hand; FSDP2's waits against the sleeps put into its collectives. The same verdicts on real gloo
runs, with the cause outside the code (a shaped network link, a slowed loader, a rank sharing its
core), are in tests/test_ddp_truth.py."""
import contextlib
import multiprocessing
import os
import threading
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

from dlojz_chrono import Chronometer, CudaTimeline
from dlojzlib.measure import comm
from dlojzlib.metrics import NonFiniteGuard
from dlojzlib.record.summary import final_lines, ranks_summary


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class Bucket:
    def __init__(self, n):
        self.tensor = torch.full((n,), 6.0)

    def buffer(self):
        return self.tensor


def launch(timer, buckets):
    """Call the hook for each bucket; -> the futures the fake all-reduce returned, to complete by
    hand."""
    pending, outs = [], []

    def all_reduce(tensor):
        fut = torch.futures.Future()
        pending.append((fut, tensor))
        return fut
    timer.all_reduce = all_reduce
    for b in buckets:
        outs.append(timer.hook(None, b))
    return pending, outs


def test_host_stamps_give_exposed_time_link_time_and_bytes():
    """Three buckets ready at 10, 20 and 50 ms (the backward pass ends at 50 ms); the link reduces
    them one after another, 30 ms each: done at 40, 70 and 100 ms. By hand: exposed = 100 - 50 = 50
    ms, link = 90 ms, bytes = (100 + 200 + 300) x 4."""
    clock = Clock()
    timer = comm.CommTimer(2, clock=clock)
    buckets = [Bucket(100), Bucket(200), Bucket(300)]
    pending, outs = [], []
    timer.all_reduce = lambda t: (pending.append((torch.futures.Future(), t)) or pending[-1][0])
    for at, b in zip((0.010, 0.020, 0.050), buckets):
        clock.t = at
        outs.append(timer.hook(None, b))
    assert all(t.tensor[0].item() == 3.0 for t in buckets)  # divided by the world size before the sum
    for at, (fut, tensor) in zip((0.040, 0.070, 0.100), pending):
        clock.t = at
        fut.set_result([tensor * 2])  # the sum over 2 ranks of the same gradient
    assert [o.wait()[0].item() for o in outs] == [6.0, 6.0, 6.0]  # the mean, as DDP's own all-reduce gives
    got = comm.resolve(*timer.take())
    assert got['exposed'] == pytest.approx(0.050) and got['link'] == pytest.approx(0.090)
    assert got['bytes'] == 600 * 4
    assert timer.take() == ([], [], [])  # the next step starts empty


def test_a_link_idle_between_buckets_is_not_counted():
    """Bucket 1 done at 15 ms, bucket 2 ready only at 40 ms, done at 45: the link ran 5 + 5 ms, not
    45."""
    marks = [[0.010, 0.015, 4], [0.040, 0.045, 4]]
    got = comm.resolve(marks)
    assert got['link'] == pytest.approx(0.010) and got['exposed'] == pytest.approx(0.005)


def test_the_buffer_broadcast_before_the_forward_pass_is_timed():
    """DDP broadcasts rank 0's buffers before each forward pass; an early rank waits there for a
    late one (40 ms here). The wrapper keeps DDP's own method's effect and times it."""
    clock = Clock()
    calls = []

    class DDP:
        def _sync_buffers(self):
            calls.append(clock.t)
            clock.t += 0.040
    ddp = DDP()
    timer = comm.CommTimer(2, clock=clock)
    timer.time_buffers(ddp)
    ddp._sync_buffers()
    timer.marks.append([0.1, 0.11, 4])
    got = comm.resolve(*timer.take())
    assert calls == [0.0] and timer.buffers_timed and got['buffers'] == pytest.approx(0.040)
    assert comm.CommTimer(2).time_buffers(object()) is None  # no such method: not timed, no error


def test_the_guards_and_the_log_lines_all_reduce_are_waits_beside_ddps_buckets():
    """Issue 57: on the CPU the NaN guard reads its all-reduce every step. A rank that finished its
    optimizer step early waits there for a late one (30 ms here), outside DDP's buckets: before,
    that wait counted as its compute and hid a third of a late rank's cost. The guard's
    all-reduce, and the log line's, are stamped as waits and added to the bucket's exposed 5 ms."""
    clock = Clock()
    timer = comm.CommTimer(2, clock=clock)

    def late_peer():
        clock.t += 0.030
        return 'reduced'
    guard = NonFiniteGuard(torch.device('cpu'), 1, distributed=True, comm=timer)
    assert guard.collective(late_peer) == 'reduced'
    timer.marks.append([0.1, 0.105, 4])
    got = comm.resolve(*timer.take())
    assert got['exposed'] == pytest.approx(0.035) and got['bytes'] == 4
    assert comm.resolve([], (), [[0.0, 0.02]])['exposed'] == pytest.approx(0.02)  # no bucket
    assert NonFiniteGuard(torch.device('cpu'), 1).collective(lambda: 7) == 7  # no timer


def test_a_step_without_all_reduce_or_unfinished_has_no_measure():
    assert comm.resolve([]) is None  # a no_sync() micro-batch
    assert comm.resolve([[0.01, None, 4]]) is None  # the callback never ran


class Event:
    """A device event at a fixed device time (seconds); completed once `now` has passed it."""
    now = 0.0

    def __init__(self, at):
        self.at = at

    def query(self):
        return Event.now >= self.at

    def elapsed_time(self, end):
        if not (self.query() and end.query()):
            raise RuntimeError('cudaErrorNotReady')
        return (end.at - self.at) * 1e3  # ms, as CUDA gives it


def test_device_events_are_read_only_once_completed_and_in_milliseconds():
    """The same three buckets on the device's clock (events 1 000 s into the run, to catch an
    absolute reading): exposed 50 ms, link 90 ms; not readable before the last done event has
    completed."""
    base = 1000.0
    marks = [[Event(base + r), Event(base + d), 4] for r, d in ((0.010, 0.040), (0.020, 0.070), (0.050, 0.100))]
    Event.now = base + 0.080
    assert not comm.completed(marks) and comm.resolve(marks) is None
    Event.now = base + 0.100
    got = comm.resolve(marks)
    assert got['exposed'] == pytest.approx(0.050) and got['link'] == pytest.approx(0.090)


def test_the_hook_records_events_from_the_timeline_on_a_device():
    class Timeline:
        made = []

        def event(self):
            e = Event(None)
            e.record = lambda: setattr(e, 'at', Event.now)
            self.made.append(e)
            return e
    timer = comm.CommTimer(2, timeline=Timeline())
    Event.now = 5.0
    pending, _ = launch(timer, [Bucket(8)])
    Event.now = 5.25
    pending[0][0].set_result([pending[0][1]])
    assert len(Timeline.made) == 2 and comm.resolve(*timer.take())['exposed'] == pytest.approx(0.25)


class FakeCuda:
    """torch.cuda as CudaTimeline uses it: a current device per thread (0 in a new thread, as
    CUDA's), a current stream per device, and events that keep the stream they were recorded on and
    refuse elapsed_time between two devices, as CUDA does."""

    def __init__(self):
        self.local, cuda = threading.local(), self

        class Event:
            def __init__(self, enable_timing=False):
                self.stream = None

            def record(self, stream=None):
                self.stream = stream if stream is not None else cuda.current_stream()

            def query(self):
                return True

            def synchronize(self):
                pass

            def elapsed_time(self, end):
                if self.stream[1] != end.stream[1]:
                    raise RuntimeError('events recorded on different devices')
                return 0.0
        self.Event = Event

    def current_device(self):
        return getattr(self.local, 'device', 0)

    def set_device(self, index):
        self.local.device = index

    def current_stream(self, device=None):
        return ('default stream', self.current_device() if device is None else device)

    def synchronize(self, device=None):
        pass

    @contextlib.contextmanager
    def device(self, index):
        before = self.current_device()
        self.set_device(index)
        try:
            yield
        finally:
            self.set_device(before)

    def _sleep(self, cycles):  # torch.cuda._sleep: a kernel on the current device's current stream
        self.spins = getattr(self, 'spins', []) + [(self.current_stream(), cycles)]


def test_the_done_event_is_recorded_on_the_ranks_gpu_from_gloos_thread():
    """gloo on CUDA (ranks sharing GPUs): the all-reduce's done callback runs on gloo's own thread,
    whose current device is 0. This rank drives GPU 1: both of each bucket's events must be on GPU
    1's stream (on GPU 0, elapsed_time between the two raised, and every rank opened a context on
    GPU 0)."""
    cuda = FakeCuda()
    cuda.set_device(1)
    timer = comm.CommTimer(2, CudaTimeline(torch.device('cuda', 1), cuda=cuda))
    pending, outs = launch(timer, [Bucket(8)])
    (fut, tensor), = pending
    # the callback runs in the thread that sets the result
    gloo = threading.Thread(target=fut.set_result, args=([tensor],))
    gloo.start()
    gloo.join()
    assert outs[0].done() and torch.equal(outs[0].value(), torch.full((8,), 3.0))
    (ready, done, _), = timer.marks
    assert ready.event.stream == done.event.stream == ('default stream', 1)
    assert comm.resolve(*timer.take())['exposed'] == 0.0
    assert CudaTimeline('cuda', cuda=cuda).index == 1  # a device without an index: the current one


def test_the_probes_spin_runs_on_the_gpu_of_its_events():
    """The probe's spin kernel (its calibration and its head start) went to the calling thread's
    current device while its events went to the timeline's GPU (issue 45): with another device
    current, the head start kept the wrong GPU busy and the calibration timed an empty stream. Both
    spins now run on the timeline's GPU, the stream its events are recorded on."""
    cuda = FakeCuda()
    cuda.set_device(0)  # current here; the rank's GPU is 1
    timeline = CudaTimeline(torch.device('cuda', 1), cuda=cuda)
    timeline.delay(0.01)
    assert [stream for stream, _ in cuda.spins] == [('default stream', 1)] * 2  # calibration, head start
    assert cuda.current_device() == 0  # and this thread's device is left as it was


def test_the_chronometer_keeps_each_steps_stamps():
    """A CPU Chronometer with a timer: each step takes the stamps made during it; the steady steps'
    exposed and link times are summed in totals() (the first step is the warm-up)."""
    clock = Clock()
    chrono = Chronometer('cpu', warmup=1, clock=clock)
    chrono.comm = timer = comm.CommTimer(2, clock=clock)
    for i, _ in enumerate(chrono.iterate(range(4))):
        clock.t += 0.1  # backward computed
        timer.marks.append([clock.t, clock.t + 0.02 * (i + 1), 1024])
        clock.t += 0.02 * (i + 1)  # waits for the all-reduce
    tot = chrono.totals()
    assert tot['comm_steps'] == 3 and tot['exposed_s'] == pytest.approx(0.04 + 0.06 + 0.08)
    assert tot['comm_bytes'] == 3 * 1024
    assert chrono.summary(8)['per_step']['exposed'] == pytest.approx([0.02, 0.04, 0.06, 0.08])


# ------------------------------------------------------------------------------ the verdict across ranks

def report(rank, steps, data, compute, exposed, link=None, grad_bytes=40 * 2**20):
    """One rank's end-of-run report with the same step every time (seconds): compute includes the
    exposed wait (a CPU step: host time minus data wait), as the Chronometer measures it."""
    step = data + compute
    return {'rank': rank, 'step_median_s': step, 'steady_steps': steps, 'wall_s': step * steps,
            'busy_s': compute * steps, 'data_s': data * steps, 'backward_s': None,
            'comm_bytes': grad_bytes * steps, 'comm_steps': steps, 'exposed_s': exposed * steps,
            'collective_s': exposed * steps,  # as Chronometer.totals() gives it: exposed + buffers (none here)
            'link_s': (link if link is not None else exposed) * steps}


def test_a_slow_link_every_rank_waits_for_is_communication():
    """Both ranks compute 100 ms and wait 300 ms for a 40 MiB all-reduce after it: by hand,
    communication is 2 x 300 / 2 x 410 = 73 % of the time, 40 MiB / 0.3 s = 0.140 GB/s achieved,
    nobody is late."""
    s = ranks_summary([report(0, 10, 0.01, 0.4, 0.3), report(1, 10, 0.01, 0.4, 0.3)])
    assert s['bound'] == 'communication' and s['comm_share'] == pytest.approx(0.3 / 0.41)
    assert s['late_share'] == pytest.approx(0.0) and 'straggler_rank' not in s
    assert s['achieved_bytes_per_s'] == pytest.approx(40 * 2**20 / 0.3)
    assert s['compute_headroom_job'] == pytest.approx(0.41 / 0.1)


def test_a_slow_loader_on_one_rank_is_a_straggler_named_with_its_own_bound():
    """Rank 1 waits 150 ms per batch for its loader, rank 0 10 ms; both compute 100 ms and the
    transfer is 20 ms. Rank 0 arrives 140 ms early at the all-reduce: it waits 160 ms, rank 1 20 ms.
    By hand, as rank 0 (the typical rank: the one that waited) saw each 270 ms step: compute 100,
    transfer 20, the late rank 140, its own loader 10. Rank 1's own time, out of collectives, is
    250 ms against rank 0's 110: 2.27x. Rank 1's own verdict is its loader."""
    s = ranks_summary([report(0, 10, 0.01, 0.26, 0.16), report(1, 10, 0.15, 0.12, 0.02)])
    assert s['bound'] == 'straggler' and s['straggler_rank'] == 1 and s['straggler_bound'] == 'loader'
    assert s['typical_ranks'] == [0] and s['straggler_pace'] == pytest.approx(0.25 / 0.11)
    assert s['shares_job'] == pytest.approx({'straggler': 0.14 / 0.27, 'compute': 0.10 / 0.27,
                                             'communication': 0.02 / 0.27, 'loader': 0.01 / 0.27,
                                             'host': 0.0})
    assert s['straggler_share'] == pytest.approx(0.14 / 0.27)
    assert s['comm_share'] == pytest.approx(0.02 / 0.27)
    ranks = {r['rank']: r for r in s['ranks']}
    assert ranks[0]['late_s'] == pytest.approx(1.4) and ranks[1]['late_s'] == pytest.approx(0.0)
    assert ranks[0]['bound'] == 'straggler' and ranks[1]['bound'] == 'loader'
    line = next(x for x in final_lines_for(s) if x.startswith('>>> Bound by'))
    assert line.startswith(">>> Bound by: straggler (rank 1: its steps 2.27x the others', bound by "
                           "loader; waiting for a late rank 52%, compute 37%, exposed "
                           "communication 7%, data wait 4%, host 0% of the steady steps, as rank 0 "
                           "saw the job;"), line


def slowed(n, slow, factor, compute=0.1, transfer=0.01, steps=10):
    """n ranks whose steps compute `compute` s, rank `slow` `factor` times as long (its core shared:
    a cause outside the code); every rank's step lasts as long as the slow rank's, the others
    waiting for it in the all-reduce."""
    wait = (factor - 1) * compute
    return [report(r, steps, 0.0, compute * factor + transfer if r == slow else
                   compute + transfer + wait, transfer if r == slow else transfer + wait)
            for r in range(n)]


@pytest.mark.parametrize('n', [2, 3, 64])
def test_one_slow_rank_reads_straggler_at_any_rank_count(n):
    """One rank computing 3x as long as the others: by hand, every rank's step is 310 ms, of which
    a typical rank computes 100, waits 10 for the transfer and 200 for the slow rank. The verdict
    is straggler, naming the slow rank at 3.00x, at 2, 3 and 64 ranks alike. Before issue 57 the
    shares were every rank's sums, which at 2 ranks read compute (2 x 100 + 300 against 200 of
    waiting) and at 64 straggler: the word changed with the rank count."""
    slow = n - 1
    s = ranks_summary(slowed(n, slow, 3.0))
    assert (s['bound'], s['straggler_rank'], s['straggler_bound']) == ('straggler', slow, 'compute')
    assert s['straggler_share'] == pytest.approx(0.2 / 0.31)
    assert s['straggler_pace'] == pytest.approx(3.0)
    assert s['shares_job']['compute'] == pytest.approx(0.1 / 0.31)
    assert slow not in s['typical_ranks']


@pytest.mark.parametrize('n', [2, 3])
@pytest.mark.parametrize('factor, bound', [(1.9, 'compute'), (2.1, 'straggler'), (1.05, 'compute')])
def test_a_rank_late_every_step_is_the_straggler_once_its_lost_share_is_the_largest(n, factor,
                                                                                   bound):
    """The margin: a slow rank costs the others (factor - 1) x their compute per step, which is the
    largest share above a factor of 2 and only then; a rank 5 % slower every step is named in the
    record (straggler_rank) but the job is compute."""
    s = ranks_summary(slowed(n, 1, factor))
    assert s['bound'] == bound and s['straggler_rank'] == 1, s
    assert s['straggler_share'] == pytest.approx((factor - 1) * 0.1 / (factor * 0.1 + 0.01))


def test_the_typical_ranks_own_loader_is_its_loader_share():
    """Three ranks whose loaders take 100, 150 and 200 ms a step, each computing 100 ms with a
    10 ms transfer: every step lasts 310 ms. By hand, the typical rank (rank 1, the upper median
    by its wait) waits 150 ms for its loader and 50 for rank 2, computes 100: the job is loader
    bound, rank 2 the straggler at (310 - 10) / (310 - 10 - 50) = 1.2x. Its loader's 50 ms above
    rank 0's are its own: counted as a straggler share too, they read straggler by a tie."""
    s = ranks_summary([report(r, 10, d, 0.31 - d, 0.31 - d - 0.1) for r, d in
                       enumerate((0.10, 0.15, 0.20))])
    assert s['typical_ranks'] == [1] and s['bound'] == 'loader', s
    assert s['shares_job'] == pytest.approx({'loader': 0.15 / 0.31, 'compute': 0.1 / 0.31,
                                             'straggler': 0.05 / 0.31,
                                             'communication': 0.01 / 0.31, 'host': 0.0})
    assert s['straggler_rank'] == 2 and s['straggler_pace'] == pytest.approx(0.30 / 0.25)


def test_ranks_late_by_turns_are_communication_not_a_straggler():
    """Three ranks, each late in its turn by 5 % of a step: over the run each waited as long for
    the others, so the sums give every rank the same time in collectives. No rank is late, nobody is
    named: the waits read as communication, as they did before issue 57."""
    s = ranks_summary([report(r, 30, 0.0, 0.2, 0.02 + 2 / 3 * 0.01) for r in range(3)])
    assert s['bound'] == 'compute' and s['late_share'] == pytest.approx(0.0)
    assert 'straggler_rank' not in s and s['straggler_share'] == pytest.approx(0.0)


def stage(rank, pipe_rank, compute, bubble, collective, steps=10):
    """A pipeline rank's report (seconds per step): its chunks compute, its bubble and its wait
    in the replicas' all-reduce; a CPU step, all of it busy but the data wait (none)."""
    wall = compute + bubble + collective
    return {**report(rank, steps, 0.0, wall, collective), 'pipe_rank': pipe_rank,
            'bubble_s': bubble * steps}


def test_a_slow_replica_of_a_stage_is_a_straggler_and_the_slowest_stage_is_not():
    """2 stages x 2 replicas (rank = stage x 2 + replica). Rank 1, stage 0's second replica,
    computes 900 ms where rank 0 computes 300: its pipeline is slow, and the other pipeline's ranks
    wait 600 ms for it in their stage's all-reduce (transfer 20 ms). By hand, as rank 0 saw each
    1.3 s step: the late replica 600, bubble 380, compute 300, transfer 20: straggler, rank 1 at
    900 / 300 = 3x its replica's pace. Rank 3 (stage 1 in the slow pipeline) waits in its bubble,
    not in the all-reduce: it computes at its replicas' pace and is not named. The control: stage
    1 twice as slow as stage 0 with alike replicas has no late rank."""
    s = ranks_summary([stage(0, 0, 0.3, 0.38, 0.62), stage(1, 0, 0.9, 0.38, 0.02),
                       stage(2, 1, 0.3, 0.38, 0.62), stage(3, 1, 0.3, 0.98, 0.02)])
    assert (s['bound'], s['straggler_rank'], s['typical_ranks']) == ('straggler', 1, [0, 2]), s
    assert s['straggler_share'] == pytest.approx(0.6 / 1.3)
    assert s['straggler_pace'] == pytest.approx(3.0)
    assert s['shares_job']['bubble'] == pytest.approx(0.38 / 1.3)
    uneven = ranks_summary([stage(0, 0, 0.3, 0.35, 0.02), stage(1, 0, 0.3, 0.35, 0.02),
                            stage(2, 1, 0.6, 0.05, 0.02), stage(3, 1, 0.6, 0.05, 0.02)])
    assert uneven['late_share'] == pytest.approx(0.0) and 'straggler_rank' not in uneven
    assert uneven['bound'] in ('compute', 'bubble')


def test_alike_fast_ranks_are_compute():
    """The control: both ranks compute 200 ms with 2 ms of exposed transfer and 2 ms of data wait."""
    s = ranks_summary([report(0, 10, 0.002, 0.2, 0.002), report(1, 10, 0.002, 0.2, 0.002)])
    assert s['bound'] == 'compute' and s['late_share'] == pytest.approx(0.0)
    assert s['comm_share'] == pytest.approx(0.002 / 0.202)


def final_lines_for(timing):
    class Chrono:
        def display_lines(self, _):
            return []
    t = {'clock': 'host', 'data_share': 0.0, 'device_busy': 1.0, **timing}
    summary = {'timing': t, 'energy': None, 'config': {'output_dir': 'x'},
               'memory': {'gpu_max_allocated_bytes': None, 'host_peak_rss_bytes': None}}
    return final_lines(summary, Chrono(), None)


# ------------------------------------------------------------------------------ no host read in the step

def ddp_step(tmp_path, read_in_hook=False):
    """One DDP training step (gloo, a world of one) with the timer's hooks, under the host-read
    counter of tests/test_gpu_seams.py -> the reads seen, the step's measures. Run in a spawned
    process: gloo's threads would stay in the test process, and a later fork (a Pool, DataLoader
    workers) could deadlock on their locks."""
    import torch.distributed as tdist
    from test_gpu_seams import DeviceReads
    os.makedirs(tmp_path)
    tdist.init_process_group('gloo', init_method=f'file://{tmp_path}/store', rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(),
                                    torch.nn.LazyLinear(2))
        model(torch.randn(2, 3, 6, 6))
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        timer = comm.CommTimer(1)
        hook = timer.hook
        if read_in_hook:  # the control: a hook that reads a value on the host
            hook = lambda state, bucket: (bucket.buffer().sum().item(), timer.hook(state, bucket))[1]
        ddp.register_comm_hook(None, hook)
        timer.time_buffers(ddp)
        x = torch.randn(4, 3, 6, 6)
        with DeviceReads() as mode:
            ddp(x).square().mean().backward()
        marks, buffers, _ = timer.take()
        return mode.seen, len(buffers), comm.resolve(marks, buffers)
    finally:
        tdist.destroy_process_group()


def test_the_hooks_add_no_host_read_to_a_training_step(tmp_path):
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context('spawn')) as pool:
        (seen, buffers, got), (control, _, _) = pool.map(ddp_step, [str(tmp_path / 'a'), str(tmp_path / 'b')],
                                                         [False, True])
    assert seen == [] and buffers == 1
    assert got['bytes'] == 4 * (4 * 3 * 9 + 4 + 4 + 4 + 2 * 64 + 2)
    assert control  # the counter sees a read where there is one


def test_a_run_that_mostly_computes_reads_compute_with_its_waits_in_order():
    """Issue 39's two gloo ranks on the loopback: 284 ms steps, 23 ms of exposed transfer every rank
    waits for, and rank 0 waits 17 ms more for rank 1. By hand, as rank 0 (the typical rank: the
    one that waited) saw its 284 ms: work 244 ms (85.9 %), communication 23 (8.1 %), late rank 17
    (6.0 %), data wait 0. Before issue 39 it read 'communication', the largest idle share, as work
    was under 90 %; its line said 'busy 100 %' beside 'exposed communication 8 %'."""
    s = ranks_summary([report(0, 10, 0.0, 0.284, 0.040, link=0.023),
                       report(1, 10, 0.0, 0.284, 0.023)])
    assert s['bound'] == 'compute'
    by_hand = {'compute': 0.244, 'communication': 0.023, 'straggler': 0.017, 'loader': 0.0,
               'host': 0.0}
    assert s['shares_job'] == pytest.approx({k: v / 0.284 for k, v in by_hand.items()})
    line = next(x for x in final_lines_for(s) if x.startswith('>>> Bound by'))
    assert line.startswith('>>> Bound by: compute (compute 86%, exposed communication 8%, waiting '
                           'for a late rank 6%, data wait 0%, host 0% of the steady steps, as '
                           'rank 0 saw the job; with no waiting the steps would be 1.16x '
                           'faster)'), line


def test_the_shares_line_adds_up_as_printed():
    """Whole percents by largest remainders: three thirds print 34, 33, 33, not 33 three times; the
    order is kept."""
    from dlojz_chrono import percents
    assert percents({'a': 1 / 3, 'b': 1 / 3, 'c': 1 / 3}) == {'a': 34, 'b': 33, 'c': 33}
    got = percents({'compute': 0.889, 'communication': 0.081, 'straggler': 0.030, 'loader': 0.0})
    assert list(got.items()) == [('compute', 89), ('communication', 8), ('straggler', 3),
                                 ('loader', 0)]
    assert sum(percents({'x': 0.125, 'y': 0.125, 'z': 0.75}).values()) == 100


def test_each_share_reads_its_own_name_where_it_is_the_largest():
    """The verdict is the largest share, each regime by hand (wall 1 s; busy includes the waits in
    collectives): the data wait, the exposed transfer, the late rank and the host each name
    themselves when they exceed the work, and only then."""
    from dlojz_chrono import verdict
    assert verdict(1.0, 0.40, 0.60) == 'loader' and verdict(1.0, 0.60, 0.40) == 'compute'
    assert verdict(1.0, 1.0, 0.0, comm=0.51) == 'communication'
    assert verdict(1.0, 1.0, 0.0, comm=0.49) == 'compute'
    assert verdict(1.0, 1.0, 0.0, comm=0.1, late=0.5) == 'straggler'
    # 0.5 s with the device idle and nothing waited for
    assert verdict(1.0, 0.30, 0.2, data_excess=0.15) == 'host'
    # on a GPU the host may wait for a batch while the device works: only the idle part is the
    # loader's
    assert verdict(1.0, 0.7, 0.9) == 'compute'


# ------------------------------------------------------------------------------------------ FSDP2

GATHER_S, REDUCE_S = 0.05, 0.03  # what each FSDP2 all-gather and reduce-scatter is slowed by


def fsdp_step(rank, tmp_path):
    """One FSDP2 training step, the second (gloo, 2 ranks: a world of one calls no collective) of
    a root and two blocks, each its own unit,
    with every all-gather slowed by GATHER_S and every reduce-scatter by REDUCE_S (the collective
    functions FSDP2 calls, wrapped) -> (gathers, reduce-scatters called, the step's measures, the
    waits a forward without gradients added; the step's host reads beside those of the same step
    without the hooks, in 'reads'). Spawned, as ddp_step."""
    import time

    import torch.distributed as tdist
    from torch.distributed.fsdp import fully_shard
    tdist.init_process_group('gloo', init_method=f'file://{tmp_path}/store', rank=rank,
                             world_size=2)
    calls = {'gather': 0, 'reduce': 0}

    def slowed(kind, fn, seconds):
        def call(*a, **k):
            calls[kind] += 1
            time.sleep(seconds)
            return fn(*a, **k)
        return call
    for kind, names, seconds in (('gather', ('all_gather_single', 'all_gather_into_tensor'),
                                  GATHER_S),
                                 ('reduce', ('reduce_scatter_single', 'reduce_scatter_tensor'),
                                  REDUCE_S)):
        for name in names:
            if hasattr(tdist, name):
                setattr(tdist, name, slowed(kind, getattr(tdist, name), seconds))
    from test_gpu_seams import DeviceReads

    def sharded(timer):
        blocks = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()) for _ in range(2)]
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), *blocks, torch.nn.Linear(8, 2))
        for b in blocks:
            fully_shard(b)
        fully_shard(model)
        if timer is not None:
            timer.time_fsdp([*blocks, model])
        return model
    def step(model):
        model(torch.randn(3, 4)).square().mean().backward()
    try:
        # the control: FSDP2's own second step (the first initialises), its host reads whatever
        # they are
        plain_model = sharded(None)
        step(plain_model)
        with DeviceReads() as plain:
            step(plain_model)
        timer = comm.CommTimer(1)
        model = sharded(timer)
        step(model)
        timer.take()
        calls.update(gather=0, reduce=0)
        start = time.perf_counter()
        with DeviceReads() as timed:
            step(model)
        measured = {**comm.resolve(*timer.take()), 'wall': time.perf_counter() - start,
                    'reads': (timed.seen, plain.seen)}
        seen = dict(calls)
        with torch.no_grad():  # validation's forward is no step
            model(torch.randn(3, 4))
        return seen, measured, timer.take()[2]
    finally:
        tdist.destroy_process_group()


def test_fsdp2s_waits_are_timed_where_the_step_waits_for_them(tmp_path):
    """By hand: the forward gathers the root's and the two blocks' parameters (3 gathers), the
    backward the two blocks' again (the root stays gathered: FSDP2 does not reshard it after the
    forward), and each unit reduce-scatters its gradients, the root's in FSDP2's final callback,
    which no hook brackets: 5 gathers and 2 reduce-scatters are timed, 0.31 s of sleeps."""
    pytest.importorskip('torch.distributed.fsdp', reason='FSDP2')
    from torch.distributed import fsdp
    if not hasattr(fsdp, 'fully_shard'):
        pytest.skip('FSDP2 is public from torch 2.6')
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context('spawn')) as pool:
        ranks = list(pool.map(fsdp_step, [0, 1], [str(tmp_path)] * 2))
    timed = 5 * GATHER_S + 2 * REDUCE_S
    for calls, step, after in ranks:
        assert calls == {'gather': 5, 'reduce': 3}, calls
        # and no wait counted twice: within the step (on a busy machine each rank also waits for
        # the other as long as they drift apart)
        assert timed <= step['exposed'] <= step['wall'], step
        assert (step['link'], step['bytes'], step['buffers']) == (0.0, 0, 0.0)
        assert after == []
        hooked, plain = step['reads']
        assert hooked == plain, step['reads']  # the hooks read nothing on the host
