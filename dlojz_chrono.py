"""Measurement tools: the Chronometer, which splits every training step into data wait, host->device
copy, forward, backward, optimizer and "other" without stalling the GPU; the PowerMeter (NVML energy and
power); the --prof torch.profiler.

    chrono = Chronometer(device, phases=True)
    for images, labels in chrono.iterate(loader, max_steps):
        with chrono.phase('h2d'): ...
        with chrono.phase('forward'): ...

- Data wait and the whole step are host-clock intervals: the step runs from asking the loader for a
  batch to asking for the next one, so the steps of a run tile its wall time.
- GPU phases are CUDA events recorded on the current stream and read once they have completed
  (event.query(), no synchronisation); a host clock around queued kernels would time the launch queue.
  With sync=True (--sync-timing) each phase boundary synchronises and the host clock is used instead.
- "other" = step - data - named phases: the bookkeeping between phases (scheduler, metrics, logging).
  On the GPU without --sync-timing the named phases are GPU time while data and step are host time, so
  "other" can be negative when the loader wait overlapped queued GPU work; it is reported, not hidden.
- The first `warmup` steps (worker start-up, cudnn autotune, compilation) are reported separately and
  left out of the statistics.
"""
import datetime
import math
import statistics
import threading
import time
from contextlib import contextmanager, nullcontext

import torch

PHASES = ('data', 'h2d', 'forward', 'backward', 'optimizer', 'other')
GPU_PHASES = ('h2d', 'forward', 'backward', 'optimizer')


def describe(values):
    """min, median, mean, p90 (nearest rank) and population std of a list of seconds."""
    if not values:
        return None
    s = sorted(values)
    p90 = s[math.ceil(0.9 * len(s)) - 1]
    return {'n': len(s), 'min': s[0], 'median': statistics.median(s), 'mean': statistics.fmean(s),
            'p90': p90, 'std': statistics.pstdev(s) if len(s) > 1 else 0.0}


class Chronometer:
    def __init__(self, device, phases=True, sync=False, warmup=1, clock=time.perf_counter):
        self.cuda = torch.device(device).type == 'cuda'
        self.phases_on, self.sync, self.warmup, self.clock = phases, sync, warmup, clock
        self.steps = []        # completed records: {'data': s, 'step': s, 'h2d': s, ...}
        self._pending = []     # records whose CUDA events may not have completed yet
        self._current = None
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

    def iterate(self, iterable, max_steps=None):
        """Yield batches from `iterable`, timing the wait for each and closing each step when the
        next batch is asked for. Stops after max_steps batches (None: exhaust the iterable)."""
        it = iter(iterable)
        n = 0
        while max_steps is None or n < max_steps:
            t0 = self.clock()
            try:
                batch = next(it)
            except StopIteration:
                return
            self._current = {'t0': t0, 'data': self.clock() - t0, 'events': []}
            self._interval.append(self._current['data'])
            n += 1
            yield batch
            self._end_step()

    def _end_step(self):
        rec = self._current
        self._current = None
        rec['step'] = self.clock() - rec.pop('t0')
        self._pending.append(rec)
        self._resolve(block=False)

    @contextmanager
    def _timed_phase(self, name):
        rec = self._current
        if self.cuda and not self.sync:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            rec['events'].append((name, start, end))
        else:
            if self.sync and self.cuda:
                torch.cuda.synchronize()
            t = self.clock()
            yield
            if self.sync and self.cuda:
                torch.cuda.synchronize()
            rec[name] = rec.get(name, 0.0) + self.clock() - t

    def phase(self, name):
        if not self.phases_on or self._current is None:
            return nullcontext()
        return self._timed_phase(name)

    def _resolve(self, block):
        if block and self.cuda and self._pending:
            torch.cuda.synchronize()
        while self._pending:
            rec = self._pending[0]
            if self.cuda and not block and not all(end.query() for _, _, end in rec['events']):
                return  # the GPU has not reached this step yet; try again next step
            for name, start, end in rec.pop('events'):
                rec[name] = rec.get(name, 0.0) + start.elapsed_time(end) / 1e3  # ms -> s
            if self.phases_on:
                rec['other'] = rec['step'] - rec['data'] - sum(rec.get(p, 0.0) for p in GPU_PHASES)
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
            torch.cuda.synchronize()
        t = self.clock()
        yield
        if self.cuda:
            torch.cuda.synchronize()
        self.val_time = self.clock() - t

    # ---------------------------------------------------------------- results
    def stats(self):
        steady = self.steps[self.warmup:]
        keys = ['step', 'data'] + (list(PHASES[1:]) if self.phases_on else [])
        out = {k: describe([r.get(k, 0.0) for r in steady]) for k in keys}
        out['compute'] = describe([r['step'] - r['data'] for r in steady])
        return out

    def summary(self, global_batch, batches_per_epoch=None, val_batches_total=None):
        """The dict written to summary.json['timing']."""
        st = self.stats()
        steady = self.steps[self.warmup:]
        res = {'steps': len(self.steps), 'warmup_steps': min(self.warmup, len(self.steps)),
               'sync_timing': self.sync, 'phase_timing': self.phases_on,
               'clock': ('host+sync' if self.sync else 'cuda-events') if self.cuda else 'host',
               'first_steps': self.steps[:self.warmup],
               'stats': st,
               'per_step': {k: [r.get(k) for r in self.steps] for k in (['step'] + list(PHASES))
                            if any(k in r for r in self.steps)}}
        if st['step'] is not None:
            compute, step = st['compute']['median'], st['step']['median']
            res['gpu_throughput'] = global_batch / compute if compute > 0 else None
            res['train_throughput'] = global_batch / step if step > 0 else None
            total = sum(r['step'] for r in steady)
            res['steady_images_per_s'] = global_batch * len(steady) / total if total > 0 else None
            if self.phases_on:
                parts = sum(sum(r.get(p, 0.0) for p in PHASES) for r in steady)
                res['phase_sum_error'] = abs(parts - total) / total if total > 0 else None
                res['phase_share'] = {p: sum(r.get(p, 0.0) for r in steady) / total for p in PHASES}
            if batches_per_epoch:
                res['epoch_time_estimate_s'] = step * batches_per_epoch
        if self.val_time is not None:
            res['val_time_s'] = self.val_time
            res['val_batches'] = self.val_batches
            if val_batches_total and self.val_batches:
                res['full_val_time_estimate_s'] = self.val_time / self.val_batches * val_batches_total
        if self.start_time and self.stop_time:
            res['training_wall_s'] = (self.stop_time - self.start_time).total_seconds()
        return res

    def display_lines(self, batches_per_epoch=None):
        """The course's '>>>' summary lines (reference/course.md §2.1); min/avg(median)/std in seconds."""
        st, lines = self.stats(), []
        if self.start_time and self.stop_time:
            lines.append(f'>>> Training complete in: {self.stop_time - self.start_time}')
        if st['compute']:
            c = st['compute']
            lines.append(f">>> Training performance time: min {c['min']} avg {c['median']} seconds (+/- {c['std']})")
            load = describe([r['data'] + r.get('h2d', 0.0) for r in self.steps[self.warmup:]])
            lines.append(f">>> Loading performance time: min {load['min']} avg {load['mean']} seconds "
                         f"(+/- {load['std']})")
            for name, key in (('Forward', 'forward'), ('Backward', 'backward'), ('Optimizer', 'optimizer')):
                if st.get(key):
                    lines.append(f">>> {name} performance time: {st[key]['mean']} seconds (+/- {st[key]['std']})")
        if self.val_time is not None:
            lines.append(f'>>> Validation time: {datetime.timedelta(seconds=self.val_time)}')
        if self.steps:
            first = self.steps[0]
            lines.append(f">>> First step loading time: {first['data'] + first.get('h2d', 0.0)}")
        if batches_per_epoch is not None:
            lines.append(f'>>> Number of batch per epoch: {batches_per_epoch}')
        return lines


class PowerMeter:
    """GPU power and energy through NVML, off the hot path.

    Energy comes from the board's cumulative counter (nvmlDeviceGetTotalEnergyConsumption, mJ) read
    at start and stop; peak and mean power from a background thread sampling nvmlDeviceGetPowerUsage
    (mW) every `period` seconds. Unavailable (CPU, no driver, no nvidia-ml-py): all fields None.
    """

    def __init__(self, device, period=0.1):
        self.available, self.samples, self.period = False, [], period
        self.energy_j = None
        self._stop = threading.Event()
        self._thread = None
        dev = torch.device(device)
        if dev.type != 'cuda':
            return
        try:
            import pynvml
            pynvml.nvmlInit()
            index = dev.index if dev.index is not None else torch.cuda.current_device()
            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self.available = True
        except Exception:  # no NVML on this machine: power is reported as unavailable, never guessed
            return

    def _energy_mj(self):
        try:
            return self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)
        except Exception:
            return None

    def _sample(self):
        while not self._stop.wait(self.period):
            try:
                self.samples.append(self._nvml.nvmlDeviceGetPowerUsage(self._handle) / 1e3)
            except Exception:
                return

    def start(self):
        if not self.available:
            return
        self._t0, self._e0 = time.perf_counter(), self._energy_mj()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def stop(self):
        """Idempotent: every exit path of a run calls it."""
        if self._thread is None or self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        e1, seconds = self._energy_mj(), time.perf_counter() - self._t0
        if self._e0 is not None and e1 is not None:
            self.energy_j = (e1 - self._e0) / 1e3
        elif self.samples:  # no energy counter (pre-Volta boards): integrate the samples
            self.energy_j = statistics.fmean(self.samples) * seconds

    def summary(self, images):
        peak = max(self.samples) if self.samples else None
        mean = statistics.fmean(self.samples) if self.samples else None
        per_image = self.energy_j / images if (self.energy_j is not None and images) else None
        return {'available': self.available, 'peak_w': peak, 'mean_w': mean, 'energy_j': self.energy_j,
                'joules_per_image': per_image}


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
