"""Measurement tools: the Chronometer, which splits every training step into data wait, host->device
copy, forward, backward, optimizer and "other" without stalling the GPU; the --prof torch.profiler
(power and energy: measure.power).

    chrono = Chronometer(device, phases=True)
    for images, labels in chrono.iterate(loader, max_steps):
        with chrono.phase('h2d'): ...
        with chrono.phase('forward'): ...

Two clocks, never mixed in one subtraction:
- The host clock times the data wait (asking the loader for a batch until it is there) and the whole step
  (from asking for a batch to asking for the next one), so the steps of a run tile its wall time.
- On a GPU (without --sync-timing) the device clock times the step's work: a CUDA event pair around the
  step, from the moment the batch is in hand to the end of the step, and one pair per phase. They are read
  once they have completed (event.query(), no synchronisation). "compute" is the step pair's span. Host step
  minus data wait would be kernel-launch time whenever the loader wait overlaps queued GPU work.
- A span is the device's work only if the device ran it back to back. A step's events (its start, each
  phase's pair, its end) form a chain; each time one is recorded the Chronometer asks whether the one
  before it has completed (event.query(), no synchronisation). If it never has, the device was always
  still busy with earlier work when the next piece of the step was queued, so nothing in the span waited
  for the host: the step is "clean" and its span is pure device work. Otherwise the device may have sat
  idle inside the span, waiting for launches (a host-bound step) or for the batch. The step after such a
  starved one is then a probe (until PROBE_MIN clean steps are measured, then at most one per PROBE_EVERY
  steps): a spin kernel of 1.5x the host's last launch time is queued before its start event, so that the
  step's kernels queue up behind it and its span is clean. A host blocked by a full launch queue (a
  compute-bound step with more kernels than the queue holds) is clean too: the device is always ahead of
  the events. See docs/chronometer.md.
- GPU work per step = sum of the clean spans / their number; `gpu_throughput` = global batch / that;
  device busy time = the clean spans + the GPU work per step for each other steady step.
- Throughputs and estimates are sums: `train_throughput` = images of the steady steps / their total host
  time, `epoch_time_estimate_s` = mean steady step x batches per epoch, `compute_headroom` = total steady
  time / device busy time. Medians describe per-phase latencies only (the '>>>' lines, `stats`).
- "other" is the step's time outside the named phases (scheduler, metrics, logging), measured on the
  compute clock. The phase check compares the named phases with the step span, two independent
  measurements: the named phases can never exceed their step, so `phase_sum_error` > 0 means a timing bug.
- `device_busy` = device busy time / host time of the steady steps. `shares` splits the steady
  steps' time by what it went to (step_shares): the device's own work ('compute'), the exposed
  transfer of the gradient all-reduce ('communication'), waiting for a late rank ('straggler';
  measure.comm measures the waits in collectives, and record.summary.ranks_summary splits them once
  every rank's numbers are gathered at the end), the data wait ('loader') and the rest ('host':
  Python, kernel launches, synchronisations). The verdict `bound` is the largest share.
- The first `warmup` steps (worker start-up, cudnn autotune, compilation) are reported separately and
  left out of the statistics; `on_steady` callbacks run once, before the first steady step asks for its
  batch (peak-memory reset, start of the energy window). So are an epoch's smaller last batches: a new
  shape re-tunes cudnn and compiles another graph, inside that step. So are the steps in `exclude_steps`
  (--prof's profiled steps, the same on every rank).
"""
import datetime
import math
import statistics
import time
from contextlib import contextmanager, nullcontext

import torch

from dlojzlib import compat
from dlojzlib.measure import bubble, comm

PHASES = ('data', 'h2d', 'forward', 'backward', 'optimizer', 'other')
# summary()'s figures of the steady steps, and those of the whole run: null where not measured
STEADY_FIGURES = ('train_throughput', 'steady_images_per_s', 'gpu_throughput', 'device_busy',
                  'data_share', 'shares', 'bound', 'compute_headroom')
LATER_FIGURES = ('epoch_time_estimate_s', 'val_time_s', 'full_val_time_estimate_s',
                 'training_wall_s')
NO_STEP, NO_VAL, NO_LENGTH = 'no training step ran', 'no validation ran', 'the loader has no length'
NO_WALL = 'the chronometer was not started and stopped'
# --prof: the course's record_function tags (solutions/dlojz1_4.py), one per phase
LABELS = {'h2d': 'host to device copy', 'forward': 'inference and loss function', 'backward': 'gradient compute',
          'optimizer': 'optimizer step and weights update'}
GPU_PHASES = ('h2d', 'forward', 'backward', 'optimizer')
SHARES = ('compute', 'communication', 'bubble', 'straggler', 'loader', 'host')  # step_shares' names
PROBE_MIN, PROBE_EVERY = 5, 100  # probe steps: until 5 clean steps are measured, then one per 100 steps
PROBE_MAX_S = 0.5  # the longest spin a probe queues (seconds)


def step_shares(wall, busy, data, comm=0.0, late=0.0, data_excess=0.0, idle=None):
    """What the steady steps' time went to, from their sums (seconds, one rank or all ranks added
    up) -> {name: seconds}, largest first (ties in SHARES' order), adding up to `wall`:
    - 'compute': the device's own work, its busy time less the time it spent inside collectives
      waiting for the transfer (`comm`) or for a late peer (`late`);
    - 'communication': the exposed all-reduce; 'bubble': a pipeline stage's waits for the others
      inside its schedule (`idle`, measure.bubble; no such share where it is None);
      'straggler': the wait for a late peer, and the part
      of the data wait by which this rank's loader was slower than the fastest rank's
      (`data_excess`: it made the others wait);
    - 'loader': the rest of the data wait, as far as the device was idle during it (on a GPU the
      host can wait for a batch while queued work still runs: that part is compute's);
    - 'host': the time left, with the device idle and nothing waited for (launches, Python,
      synchronisations). On the host clock (CPU) it is the few microseconds between steps."""
    work = min(wall, max(0.0, busy - comm - late - (idle or 0.0)))
    left, out = wall - work, {'compute': work}
    waits = (('communication', comm), *((('bubble', idle),) if idle is not None else ()),
             ('straggler', late + data_excess), ('loader', data - data_excess))
    for name, v in waits:
        out[name] = min(max(0.0, v), left)
        left -= out[name]
    out['host'] = left
    return dict(sorted(out.items(), key=lambda kv: (-kv[1], SHARES.index(kv[0]))))


def verdict(wall, busy, data, comm=0.0, late=0.0, data_excess=0.0, idle=None):
    """What bounds a run: the largest share of its steps' time (step_shares)."""
    return next(iter(step_shares(wall, busy, data, comm, late, data_excess, idle)))


def percents(fractions):
    """Fractions adding up to 1 -> whole percents adding up to 100 (largest remainders round up), so
    that a line of shares adds up as its figures are printed."""
    raw = {k: 100 * v for k, v in fractions.items()}
    out = {k: math.floor(v) for k, v in raw.items()}
    for k in sorted(raw, key=lambda k: out[k] - raw[k])[:100 - sum(out.values())]:
        out[k] += 1
    return out


def describe(values):
    """min, median, mean, p90 (nearest rank) and population std of a list of seconds."""
    if not values:
        return None
    s = sorted(values)
    p90 = s[math.ceil(0.9 * len(s)) - 1]
    return {'n': len(s), 'min': s[0], 'median': statistics.median(s), 'mean': statistics.fmean(s),
            'p90': p90, 'std': statistics.pstdev(s) if len(s) > 1 else 0.0}


@contextmanager
def _both(first, second):
    with first, second:
        yield


def _images(batch):
    """Images in an (images, labels) batch, from the labels (a list of them: --accum-steps
    micro-batches); None for anything else."""
    try:
        labels = batch[-1]
        if isinstance(labels, list) and labels and isinstance(labels[0], torch.Tensor):  # micro-batches
            return sum(len(y) for y in labels)
        return len(labels)
    except TypeError:
        return None


class DeviceEvent:
    """A CUDA timing event recorded on its device's current stream, whichever thread records it."""
    __slots__ = ('event', 'cuda', 'index')

    def __init__(self, event, cuda, index):
        self.event, self.cuda, self.index = event, cuda, index

    def record(self):
        self.event.record(self.cuda.current_stream(self.index))

    def query(self):
        return self.event.query()

    def synchronize(self):
        self.event.synchronize()

    def elapsed_time(self, end):
        return self.event.elapsed_time(end.event)


class CudaTimeline:
    """One GPU as the Chronometer and the all-reduce hook see it: timing events, a synchronise and a
    spin.

    Events go to this GPU's current stream from any thread. gloo runs the all-reduce's done callback
    on its own thread, whose current CUDA device is 0 whatever this rank's is: an event recorded
    there on the current device would land on GPU 0 (a context opened there by every rank, and
    elapsed_time across two devices raises). `cuda` is torch.cuda, or a fake in tests; tests also
    give the Chronometer a fake asynchronous device with the same calls instead."""

    def __init__(self, device=None, cuda=torch.cuda):
        index = None if device is None else torch.device(device).index
        self.cuda = cuda
        self.index = cuda.current_device() if index is None else index

    def event(self):
        return DeviceEvent(self.cuda.Event(enable_timing=True), self.cuda, self.index)

    def synchronize(self):
        self.cuda.synchronize(self.index)

    def calibrate(self):
        """Clock cycles per second of the spin kernel: measured once (one synchronisation), where
        the Chronometer synchronises anyway (the start of the steady window)."""
        if not hasattr(self, 'hz'):
            start, end = self.event(), self.event()
            start.record()
            self._spin(10 ** 6)
            end.record()
            end.synchronize()
            self.hz = 10 ** 6 / max(start.elapsed_time(end) / 1e3, 1e-6)

    def delay(self, seconds):
        """Queue a kernel that keeps the device busy for about `seconds` (a probe step's head
        start), on this GPU's current stream."""
        self.calibrate()
        self._spin(int(seconds * self.hz))

    def _spin(self, cycles):
        """The spin on this GPU's current stream, where the events go, whichever device is current
        in the calling thread."""
        with self.cuda.device(self.index):
            compat.spin(self.cuda, cycles)


class Chronometer:
    def __init__(self, device, phases=True, sync=False, warmup=1, clock=time.perf_counter, timeline=None):
        self.cuda = torch.device(device).type == 'cuda'
        self.phases_on, self.sync, self.warmup, self.clock = phases, sync, warmup, clock
        self.timeline = timeline or (CudaTimeline(device) if self.cuda else None)
        self.events = self.cuda and not sync  # device clock for compute and phases
        self.on_steady = []    # callables run once, before the first steady step
        self.exclude_steps = range(0)  # indices of steps left out of the statistics (--prof, on every rank)
        self.probe = self.events and hasattr(self.timeline, 'delay')  # probe steps (see the docstring)
        self._probe_s = None   # spin of the next step's probe (seconds), None: no probe
        self._last_probe = None
        self._clean = 0        # clean steps after the warm-up
        self.labels = False    # --prof: each phase is also a torch.profiler record_function range
        self.comm = None       # measure.comm.CommTimer of a distributed run: each step's all-reduce stamps
        self.pipe = None       # measure.bubble.StageTimer of a pipeline: each step's chunks
        self.steps = []        # completed records: {'data': s, 'step': s, 'compute': s, 'h2d': s, ...}
        self._pending = []     # records whose events may not have completed yet
        self._current = None
        self._begun = 0        # steps begun, over every iterate() call
        self._steadied = False  # steady_check() has run
        self._interval = []    # data-wait seconds of the steps begun since the last interval() call
        self.val_time = None
        self.val_batches = 0
        self.start_time = self.stop_time = None

    # ---------------------------------------------------------------- run and steps
    def start(self):
        self.start_time = datetime.datetime.now()

    def stop(self):
        """End of the timed run (idempotent: the first call counts)."""
        self.finish()
        if self.stop_time is None:
            self.stop_time = datetime.datetime.now()

    def _event(self, rec):
        """Record an event; `rec`'s step (None outside a step) chains it (see the docstring on clean
        steps)."""
        e = self.timeline.event()
        e.record()
        if rec is not None:
            if rec['last'] is not None and rec['last'].query():
                rec['clean'] = False  # the device reached the previous event before this one was queued
            rec['last'] = e
        return e

    def iterate(self, iterable, max_steps=None):
        """Yield batches from `iterable`, timing the wait for each and closing each step when the
        next batch is asked for. Stops after max_steps batches (None: exhaust the iterable)."""
        it = iter(iterable)
        n = 0
        while max_steps is None or n < max_steps:
            self.steady_check()
            t0 = self.clock()
            try:
                batch = next(it)
            except StopIteration:
                return
            self.begin_step(batch, t0, self.clock() - t0)
            n += 1
            yield batch
            self.end_step()

    def steady_check(self):
        """Before the first steady step asks for its batch: the warm-up's queued work is not the
        steady window's (one sync per run), and the on_steady callables run (once)."""
        if self._begun == self.warmup and not self._steadied:
            self._steadied = True
            if self.events:
                self.timeline.synchronize()
                if self.probe and hasattr(self.timeline, 'calibrate'):
                    self.timeline.calibrate()
            for fn in self.on_steady:
                fn()

    def begin_step(self, batch, t0, data):
        """A step begins with `batch` in hand: asked for at host time t0, after `data` seconds of
        waiting. iterate() calls it; a loop it does not drive (dlojzlib.lightning) calls it and
        end_step() itself, and steady_check() before the step's batch is asked for."""
        self._current = {'t0': t0, 'data': data, 'events': [], 'images': _images(batch)}
        if self.comm is not None:  # a wait stamped between steps (an epoch's closing NaN check)
            self.comm.take()       # is in no step's time
        if self._begun in self.exclude_steps:
            self._current['excluded'] = True
        if self.events:  # the step's work starts now, on the device's clock
            if self._probe_s is not None:
                self.timeline.delay(self._probe_s)
                self._current['probe'], self._probe_s, self._last_probe = True, None, self._begun
            self._current.update(clean=True, last=None)
            self._current['span'] = self._event(self._current)
        self._interval.append(self._current['data'])
        self._begun += 1

    @property
    def in_step(self):
        return self._current is not None

    def end_step(self):
        rec = self._current
        self._current = None
        rec['step'] = self.clock() - rec.pop('t0')
        if self.comm is not None:
            rec['comm'] = self.comm.take()
        if self.pipe is not None:
            rec['pipe'] = self.pipe.take()
        if self.events:
            rec['span'] = (rec['span'], self._event(rec))
            del rec['last']
            if not rec['clean']:
                self._schedule_probe(rec)
            elif self._begun > self.warmup:
                self._clean += 1
        self._pending.append(rec)
        self._resolve(block=False)

    def _schedule_probe(self, rec):
        """The device waited for the host in this step: measure the next one behind a spin kernel."""
        due = self._last_probe is None or self._begun - self._last_probe >= PROBE_EVERY
        if self.probe and self._begun >= self.warmup and (self._clean < PROBE_MIN or due):
            self._probe_s = min(PROBE_MAX_S, 1.5 * (rec['step'] - rec['data']))

    @contextmanager
    def _timed_phase(self, name):
        rec = self._current
        if self.events:
            start = self._event(rec)
            yield
            rec['events'].append((name, start, self._event(rec)))
        else:
            if self.sync and self.cuda:
                self.timeline.synchronize()
            t = self.clock()
            yield
            if self.sync and self.cuda:
                self.timeline.synchronize()
            rec[name] = rec.get(name, 0.0) + self.clock() - t

    def phase(self, name):
        if not self.phases_on or self._current is None:
            return nullcontext()
        if self.labels:
            return _both(self._timed_phase(name), torch.profiler.record_function(LABELS.get(name, name)))
        return self._timed_phase(name)

    def _resolve(self, block):
        if block and self.events and self._pending:
            t = self.clock()
            self.timeline.synchronize()
            # the device finishing the queued work belongs to the last step: the steps tile the wall
            # time until the device is done (a host ahead by a full launch queue would otherwise
            # overstate rates)
            self._pending[-1]['step'] += self.clock() - t
        while self._pending:
            rec = self._pending[0]
            if self.events and not block and not (rec['span'][1].query() and
                                                  all(end.query() for _, _, end in rec['events']) and
                                                  comm.completed(*rec.get('comm', ([], [])))):
                return  # the GPU has not reached the end of this step yet; try again next step
            if 'comm' in rec:
                timed = comm.resolve(*rec.pop('comm'))
                if timed:
                    rec.update(exposed=timed['exposed'], link=timed['link'], comm_bytes=timed['bytes'],
                               buffers=timed['buffers'])
            if rec.get('pipe'):  # the stage's chunks: its forward and backward; the rest waited
                timed = bubble.resolve(rec.pop('pipe'))
                rec.update(forward=timed['forward'], backward=timed['backward'],
                           pipe_span=timed['span'], bubble=timed['span'] - timed['compute'],
                           chunks=timed['chunks'])
            for name, start, end in rec.pop('events'):
                rec[name] = rec.get(name, 0.0) + start.elapsed_time(end) / 1e3  # ms -> s
            if self.events:
                start, end = rec.pop('span')
                rec['compute'] = start.elapsed_time(end) / 1e3
            else:
                rec['compute'] = rec['step'] - rec['data']
                rec['clean'] = True  # a host interval (CPU, --sync-timing): nothing queued behind the host
            if self.phases_on:
                named = (*GPU_PHASES, 'bubble')
                rec['other'] = rec['compute'] - sum(rec.get(p, 0.0) for p in named)
            self.steps.append(rec)
            self._pending.pop(0)

    def finish(self):
        """Resolve every pending record (one synchronisation, at the end of a training loop)."""
        self._resolve(block=True)

    def interval(self):
        """(mean data wait in seconds, number of steps) over the steps begun since the last call,
        the current one included: what the periodic log line reports."""
        n = len(self._interval)
        data = sum(self._interval) / n if n else 0.0
        self._interval = []
        return data, n

    # ---------------------------------------------------------------- validation
    @contextmanager
    def validation(self):
        if self.cuda:
            self.timeline.synchronize()
        t = self.clock()
        yield
        if self.cuda:
            self.timeline.synchronize()
        self.val_time = self.clock() - t

    # ---------------------------------------------------------------- results
    @property
    def full_batch(self):
        """The largest batch seen (images): an epoch's last batch may be smaller."""
        return max((r['images'] for r in self.steps if r['images'] is not None), default=None)

    @property
    def steady(self):
        """The steps the statistics are made of: after the warm-up, full batches only."""
        full = self.full_batch
        return [r for r in self.steps[self.warmup:] if r['images'] == full and not r.get('excluded')]

    @property
    def images_after_warmup(self):
        """Images of every step after the warm-up (partial batches included): what energy is divided
        by."""
        return sum(r['images'] or 0 for r in self.steps[self.warmup:])

    def unmeasured(self):
        """Why the figures of the steady steps (medians, throughputs, the verdict) are missing, in
        one phrase with the fix; None where there are steady steps."""
        n, w = len(self.steps), self.warmup
        if self.steady or not n:
            return None if self.steady else NO_STEP
        if n <= w:
            steps = 'the training step fell' if n == 1 else f'the {n} training steps all fell'
            return (f'{steps} in the {w} warm-up steps; run more steps (--test-nsteps) than '
                    f'--warmup-steps')
        return (f'the {n - w} steps after the warm-up were profiled (--prof), which leaves them '
                f'out; run more steps than --prof-wait + --prof-warmup + --prof-active')

    def stats(self):
        keys = ['step', 'data', 'compute'] + (list(PHASES[1:]) if self.phases_on else [])
        return {k: describe([r.get(k, 0.0) for r in self.steady]) for k in keys}

    def totals(self):
        """Sums over the steady steps (seconds): what throughputs, busy time and the verdict are
        made of; every rank's are gathered at the end of a run. gpu_step_s: the device work of one
        step, from the clean spans ('clean'), else from every span ('spans': an upper bound, the
        device may have waited inside them)."""
        steady = self.steady
        res = {'steady_steps': len(steady), 'images': sum(r['images'] or 0 for r in steady),
               'wall_s': sum(r['step'] for r in steady), 'data_s': sum(r['data'] for r in steady),
               'probe_steps': sum(bool(r.get('probe')) for r in steady), 'busy_s': None, 'gpu_step_s': None,
               'gpu_step_source': None, 'gpu_measured_steps': 0, 'backward_s': None}
        timed = [r for r in steady if 'exposed' in r]  # the all-reduce of a distributed run (measure.comm)
        if timed:
            res.update(comm_steps=len(timed), exposed_s=sum(r['exposed'] for r in timed),
                       link_s=sum(r['link'] for r in timed), comm_bytes=sum(r['comm_bytes'] for r in timed),
                       buffers_s=sum(r['buffers'] for r in timed))
            res['collective_s'] = res['exposed_s'] + res['buffers_s']  # waiting in collectives, for any reason
        piped = [r for r in steady if 'bubble' in r]  # a pipeline stage's (measure.bubble)
        if piped:
            mid = sorted(piped, key=lambda r: r['pipe_span'])[len(piped) // 2]
            res.update(pipe_steps=len(piped), bubble_s=sum(r['bubble'] for r in piped),
                       pipe_span_s=sum(r['pipe_span'] for r in piped), timeline=mid['chunks'],
                       timeline_span_s=mid['pipe_span'])
        clean = [r for r in steady if r.get('clean')]
        measured, source = (clean, 'clean') if clean else (steady, 'spans')
        if not measured:
            return res
        work = sum(r['compute'] for r in measured)
        res.update(gpu_step_s=work / len(measured), gpu_step_source=source, gpu_measured_steps=len(measured),
                   busy_s=work + work / len(measured) * (len(steady) - len(measured)))
        # mean backward (and forward) time of a measured step: where a rank waits for its peers
        if self.phases_on:
            res['backward_s'] = sum(r.get('backward', 0.0) for r in measured) / len(measured)
            res['forward_s'] = sum(r.get('forward', 0.0) for r in measured) / len(measured)
        return res

    def summary(self, global_batch, batches_per_epoch=None, val_batches_total=None):
        """The dict written to summary.json['timing']."""
        st, steady, tot = self.stats(), self.steady, self.totals()
        full = self.full_batch
        res = {'steps': len(self.steps), 'warmup_steps': min(self.warmup, len(self.steps)),
               'partial_batch_steps': sum(r['images'] != full for r in self.steps[self.warmup:]),
               'profiled_steps': sum(bool(r.get('excluded')) for r in self.steps),
               'sync_timing': self.sync, 'phase_timing': self.phases_on,
               'clock': ('host+sync' if self.sync else 'cuda-events') if self.cuda else 'host',
               'first_steps': self.steps[:self.warmup],
               'stats': st, 'totals': tot,
               'per_step': {k: [r.get(k) for r in self.steps] for k in ['step', 'compute', *PHASES, 'exposed', 'images']
                            if any(k in r for r in self.steps)}}
        total, busy = tot['wall_s'], tot['busy_s']
        # a figure that cannot be measured is null, with why in 'unmeasured', never an absent key
        res.update(dict.fromkeys(STEADY_FIGURES + LATER_FIGURES + ('gpu_step_source',)))
        if steady and total > 0:
            # rates are sums: a median step lands on the short steps of a loader that delivers in
            # bursts
            res['train_throughput'] = res['steady_images_per_s'] = global_batch * len(steady) / total
            res['gpu_throughput'] = global_batch / tot['gpu_step_s'] if tot['gpu_step_s'] else None
            res['gpu_step_source'] = tot['gpu_step_source']
            res['device_busy'] = busy / total
            res['data_share'] = tot['data_s'] / total
            shares = step_shares(total, busy, tot['data_s'], tot.get('collective_s', 0.0),
                                 idle=tot.get('bubble_s'))
            res['shares'] = {k: v / total for k, v in shares.items()}
            res['bound'] = next(iter(shares))
            if 'collective_s' in tot:
                res['exposed_share'] = tot['collective_s'] / total
                res['buffers_timed'] = self.comm.buffers_timed  # False: --no-broadcast-buffers, or no hook
            res['compute_headroom'] = total / busy if busy else None  # speed-up if nothing waited
            spans = sum(r['compute'] for r in steady)
            if self.phases_on and spans > 0:
                named = sum(r.get(p, 0.0) for r in steady for p in GPU_PHASES)
                # the named phases lie inside their step span; measured apart, their sum can exceed
                # it only through a timing bug (overlapping phases, events on another stream)
                res['phase_sum_error'] = max(0.0, named - spans) / spans
                res['phase_share'] = {p: sum(r.get(p, 0.0) for r in steady) / total for p in PHASES}
            if batches_per_epoch:
                res['epoch_time_estimate_s'] = total / len(steady) * batches_per_epoch
        if self.val_time is not None:
            res['val_time_s'] = self.val_time
            res['val_batches'] = self.val_batches
            if val_batches_total and self.val_batches:
                res['full_val_time_estimate_s'] = self.val_time / self.val_batches * val_batches_total
        if self.start_time and self.stop_time:
            res['training_wall_s'] = (self.stop_time - self.start_time).total_seconds()
        res['unmeasured'] = self.reasons(res, total)
        return res

    def reasons(self, res, total):
        """{figure: why it is null} of a summary(): the phrase each '>>>' line prints instead."""
        why = self.unmeasured() or (None if total > 0 else 'the steady steps took no time')
        out = dict.fromkeys(('stats',) + STEADY_FIGURES, why) if why else {}
        for key in ('gpu_throughput', 'compute_headroom'):
            if not why and res[key] is None:
                out[key] = 'no step\'s compute was timed'
        if res['epoch_time_estimate_s'] is None:
            out['epoch_time_estimate_s'] = why or NO_LENGTH
        if self.val_time is None:
            out['val_time_s'] = out['full_val_time_estimate_s'] = NO_VAL
        elif res['full_val_time_estimate_s'] is None:
            out['full_val_time_estimate_s'] = 'the validation loader has no length'
        if res['training_wall_s'] is None:
            out['training_wall_s'] = NO_WALL
        return out

    def display_lines(self, batches_per_epoch=None):
        """The course's '>>>' summary lines (reference/course.md §2.1), seconds to 0.1 ms; "avg" is
        the median for training and the mean for loading, as the course defined them (its tools read
        these positions). A figure that cannot be measured keeps its line, which says why."""
        st, lines = self.stats(), []
        why = self.unmeasured() or 'no steady step'
        wall = self.stop_time - self.start_time if self.start_time and self.stop_time else \
            'not measured: ' + NO_WALL
        lines.append(f'>>> Training complete in: {wall}')
        if st['compute']:
            c = st['compute']
            lines.append(f">>> Training performance time: min {c['min']:.4f} avg {c['median']:.4f} seconds "
                         f"(+/- {c['std']:.4f})")
            load = describe([r['data'] + r.get('h2d', 0.0) for r in self.steady])
            lines.append(f">>> Loading performance time: min {load['min']:.4f} avg {load['mean']:.4f} seconds "
                         f"(+/- {load['std']:.4f})")
        else:
            lines += [f'>>> {name} performance time: not measured: {why}'
                      for name in ('Training', 'Loading')]
        for name in ('Forward', 'Backward', 'Optimizer'):
            key = name.lower()
            if st.get(key):
                lines.append(f">>> {name} performance time: {st[key]['mean']:.4f} seconds "
                             f"(+/- {st[key]['std']:.4f})")
            else:
                off = 'phase timing is off (--no-timing)' if not self.phases_on else why
                lines.append(f'>>> {name} performance time: not measured: {off}')
        val = 'not measured: ' + NO_VAL if self.val_time is None else \
            datetime.timedelta(seconds=self.val_time)
        lines.append(f'>>> Validation time: {val}')
        first = self.steps and f"{self.steps[0]['data'] + self.steps[0].get('h2d', 0.0):.4f}"
        lines.append(f'>>> First step loading time: {first or "not measured: " + NO_STEP}')
        per_epoch = f'not known: {NO_LENGTH}' if batches_per_epoch is None else batches_per_epoch
        lines.append(f'>>> Number of batch per epoch: {per_epoch}')
        return lines


def profiler(device, trace_dir, wait, warmup, active):
    """--prof: torch.profiler over `active` training steps after `wait` + `warmup` (the loop calls
    prof.step() once per step), traces for TensorBoard/Perfetto in trace_dir."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.device(device).type == 'cuda':
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(
        activities=activities, profile_memory=True,
        schedule=torch.profiler.schedule(wait=wait, warmup=warmup, active=active, repeat=1),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(trace_dir))
