"""The time to the first step, split by cause: from the process's start (the kernel's start time,
host.process_start_time) to the end of the first training step, in named phases (the imports, the
process group, the dataset's index, the model, DDP's wrap, the loader's first batch, the first step
itself ...).

Each phase is timed on its own (a start and an end, host wall clock), never as "the rest": a phase
that runs inside another (the index inside the data's set-up) is cut out of its parent, so that
every rank's record is a sequence of disjoint segments, and the time no segment covers is shown as
`unaccounted_s`. GPU work a phase only queues (a model's move, DDP's first broadcast) ends in the
first step, which closes with one synchronisation: the only one, once per process.

Across ranks, a rank that waits in a collective (DDP's broadcast, the index's) shows the wait in
its own phase, not the cause. The job's split is therefore its critical path: segment by segment,
the time until the last rank ended it, charged to that rank's segment (summarize). It needs the
hosts' clocks to agree (NTP keeps cluster nodes within milliseconds; start-up phases last seconds).

    clock = StartUp(process_start_time())
    with clock.phase('dataset_index'):
        ...
    clock.first_step_done(device)      # after the first optimiser step
    clock.record()                     # -> {'total_s', 'phases': {name: s}, 'unaccounted_s', ...}
"""
import time
from contextlib import contextmanager

import torch

from dlojzlib import failpoints


class StartUp:
    def __init__(self, origin, clock=time.time, imports_until=None):
        """origin: when the process started (time.time()'s clock). imports_until: when the
        entry point began (the interpreter's start and the imports before it: phase 'imports')."""
        self.origin, self.clock = origin, clock
        self.segments = []  # [name, start, end], disjoint, in time order
        self._stack = []    # the open phases' names; the innermost is being timed since self._since
        self._since = None
        self._batch_in_hand = None
        self.end = None     # at the end of the first step
        if imports_until is not None:
            self.segments.append(['imports', origin, imports_until])

    @property
    def pending(self):
        return self.end is None

    @contextmanager
    def phase(self, name):
        """Time the block as phase `name` (the same name twice adds up); its parent's time stops
        meanwhile. After the first step, nothing is recorded."""
        if not self.pending:
            yield
            return
        self._switch(name)
        try:
            failpoints.startup_phase(name)  # slow-phase: the tests' injected cause
            yield
        finally:
            self._switch(None)

    def _switch(self, name):
        """Close the innermost open segment; open `name` inside it (None: back to the parent)."""
        now = self.clock()
        if self._stack:
            self.segments.append([self._stack[-1], self._since, now])
        if name is None:
            self._stack.pop()
        else:
            self._stack.append(name)
        self._since = now

    def first_batch(self, loader):
        """The loader, its start (workers forked, first batch in hand) timed as 'loader_start'."""
        return loader if not self.pending else self._first_batch(loader)

    def _first_batch(self, loader):
        start = self.clock()
        it = iter(loader)
        try:
            first = next(it)
        except StopIteration:
            return
        finally:
            self.segments.append(['loader_start', start, self.clock()])
        self._batch_in_hand = self.clock()
        yield first
        yield from it

    def first_step_done(self, device=None):
        """After the first training step: on a GPU the queued work is waited for (once), so that
        the step's end is the device's, not the host's."""
        if not self.pending:
            return
        if device is not None and device.type == 'cuda':
            torch.cuda.synchronize(device)
        self.end = self.clock()
        if self._batch_in_hand is not None:
            self.segments.append(['first_step', self._batch_in_hand, self.end])

    def record(self):
        """-> {'origin', 'total_s', 'phases', 'unaccounted_s', 'segments' (from the origin, s)}, or
        None before the first step ended."""
        if self.end is None:
            return None
        phases = {}
        for name, start, end in self.segments:
            phases[name] = phases.get(name, 0.0) + end - start
        total = self.end - self.origin
        return {'origin': self.origin, 'total_s': total, 'phases': phases,
                'unaccounted_s': total - sum(phases.values()),
                'segments': [[n, a - self.origin, b - self.origin] for n, a, b in self.segments]}


def summarize(records):
    """Every rank's record ({'rank', 'host'} and record()'s keys) -> the job's start-up, or None
    when no rank reached its first step: 'total_s' from the first process's start to the last rank's
    first step, and its critical path: 'launch', the time until the last process started, then for
    each segment in turn, the time from the end of the previous one (on the last rank to end it) to
    its end on the last rank to end it, charged to that rank's phase ('phases', 'phase_ranks'); a
    gap between that rank's two segments is 'unaccounted_s'. Records whose segments differ (another
    code path) fall back to the slowest rank's own phases."""
    done = [r for r in records if r.get('total_s') is not None]
    if not done:
        return None
    names = {tuple(s[0] for s in r['segments']) for r in done}
    if len(names) > 1:
        slow = max(done, key=lambda r: r['origin'] + r['total_s'])
        return _ordered({'total_s': slow['total_s'], 'unaccounted_s': slow['unaccounted_s'],
                         'phases': dict(slow['phases']),
                         'phase_ranks': {n: slow['rank'] for n in slow['phases']},
                         'critical_path': False}, done)
    start = min(r['origin'] for r in done)  # the first process's start
    prev, gap, phases, owner = start, 0.0, {}, {}
    for k, name in enumerate(next(iter(names))):
        end, late = max((r['origin'] + r['segments'][k][2], r['rank']) for r in done)
        begun = next(r['origin'] + r['segments'][k][1] for r in done if r['rank'] == late)
        if k == 0 and begun > prev:  # that rank's process started late: the launcher's delay
            phases['launch'], owner['launch'] = begun - prev, late
        else:
            gap += max(0.0, begun - prev)
        spent = end - max(prev, begun)
        if spent >= phases.get(name, 0.0):  # the rank that cost the most of this phase
            owner[name] = late
        phases[name] = phases.get(name, 0.0) + spent
        prev = end
    last = max(r['origin'] + r['total_s'] for r in done)
    return _ordered({'total_s': last - start, 'unaccounted_s': gap + last - prev, 'phases': phases,
                     'phase_ranks': owner, 'critical_path': True}, done)


def _ordered(job, done):
    job['phases'] = dict(sorted(job['phases'].items(), key=lambda kv: -kv[1]))
    job['slowest_rank'] = max(done, key=lambda r: r['origin'] + r['total_s'])['rank']  # the last
    job['ranks'] = [{k: v for k, v in r.items() if k != 'segments'} for r in done]
    return job


def line(startup, world_size, shown=4):
    """The `>>>` line: the total and the longest phases, each with the rank it waited for."""
    if not startup:
        return None
    phases = list(startup['phases'].items())
    ranks = startup['phase_ranks'] if world_size > 1 else {}
    parts = []
    for name, s in phases[:shown]:
        waited = f' (rank {ranks[name]})' if name in ranks else ''
        parts.append(f'{name.replace("_", " ")} {s:.1f} s{waited}')
    if len(phases) > shown:
        rest = sum(s for _, s in phases[shown:])
        parts.append(f'{len(phases) - shown} other phases {rest:.1f} s')
    parts.append(f'unaccounted {startup["unaccounted_s"]:.1f} s')
    if world_size == 1:
        where = ''
    elif startup['critical_path']:
        where = f' (critical path over {world_size} ranks)'
    else:
        where = f' (slowest rank {startup["slowest_rank"]}: the ranks took different paths)'
    return f'>>> Start-up: {startup["total_s"]:.1f} s to the first step{where}; ' + ', '.join(parts)
