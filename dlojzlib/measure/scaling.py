"""Scaling forecast: img/s and efficiency at 1..N GPUs from one measured single-device run.

    python dlojz_scaling.py --summary runs/one-gpu/summary.json --machine a100 --gpus 1,4,8,32
    torchrun --nproc_per_node 2 dlojz_scaling.py --probe probe.json   # all-reduce bandwidth here
    python dlojz_scaling.py --summary runs/cpu-1rank/summary.json --link probe.json --gpus 1,2,3 \
        --slowed-from runs/cpu-2ranks/summary.json   # the compute slowed term, measured at 2 ranks

The model (docs/scaling.md says it in prose):

* Inputs: the steady step time t_step and the backward time t_bwd of one device at its batch, the gradient
  bytes G (trainable parameters x 4: DDP reduces the fp32 .grad even under AMP), the DDP buckets (a first
  1 MiB bucket, then --bucket-cap-mb ones: torch's _DEFAULT_FIRST_BUCKET_BYTES and bucket_cap_mb), and the
  interconnect: per-rank bandwidth B (bytes/s in each direction) and latency a (s per ring step) inside a
  node, and the node's network bandwidth and latency between nodes.
* Backward: gradients come out at a constant rate, G / t_bwd, in bucket order (DDP fills buckets in reverse
  parameter order, the order the backward produces them). Bucket i is ready when its last byte is out.
* Communication: the all-reduces run one after another (one communication stream), each starting when its
  bucket is ready and the previous one is over. All-reduce of b bytes over N ranks in one node, ring:
  2 (N-1)/N b / B + 2 (N-1) a. Over k nodes of g ranks, hierarchical (reduce-scatter inside the node, ring
  all-reduce of each rank's 1/g share across the nodes, all-gather inside the node):
  2 (g-1)/g b / B_intra + 2 (g-1) a_intra + 2 (k-1)/k b / B_node_net + 2 (k-1) a_net.
  The inter-node term is the least any all-reduce must move through a node's network links (each node
  sends and receives 2 (k-1)/k of the buffer), which is what NCCL's rings over several NICs get close to
  for large buffers; a flat ring would be limited the same way by its node-crossing hops.
* Stragglers: every step waits for the slowest of the N ranks. With the reference run's measured steady
  step times as the distribution of one rank's step, a step at N lasts on average the expected maximum of
  N independent draws from it (exact for the empirical distribution: expected_max); the straggler term is
  that minus the mean step. A steady run whose steps vary by 1 % loses little; a loader that delivers in
  bursts loses more with every rank added.
* Compute slowed: each rank's own work per step w (the one device's busy time less its waits in
  collectives) grows by a fraction s(N) at N ranks, and the backward with it (slowdown()): from
  cores the ranks of a node share (CPU ranks of t threads on C cores: s = max(1, N t / C) - 1), from
  a run at M >= 2 ranks of the same flags (--slowed-from: its measured work against the one
  device's, what the other ranks' communication took from each rank, taken as is at every N >= 2,
  with the cores' share on top), or none. The forecast says which.
* Step at N: t_step + s(N) w + straggler(N) + max(0, end of the last all-reduce - end of the
  backward): only the communication the backward cannot hide is added (at least the last bucket's).
  img/s = N x batch / step(N); efficiency = t_step / step(N); each term's share of step(N) is what
  it costs in points.
* Checked against what was measured: given runs at some world sizes (--measured), their exposed
  communication per step (measure.comm, the transfer every rank waited for), their wait for a late
  rank and their work grown per step are set beside the model's, which tests the overlap and the
  slowdown the model assumes, and their img/s beside the forecast.
* Left out, so the forecast is an upper bound where nothing measured the slowdown: compute slowed by
  communication kernels or threads sharing the device (NCCL uses SMs; gloo uses CPU threads) unless
  --slowed-from measured it, data-loader limits at scale, DDP's own per-bucket copies and buffer
  broadcast, topology effects (a ring through a slow PCIe hop).
* Refused (measure.forecast_inputs): a file of another shape; a --slowed-from run of other flags,
  not completed or of no more ranks; a term below 0 or an efficiency above 100 %, which only
  runs measured on a busy node (or too few steps) give: a measurement problem, not a forecast.

Pure functions (no torch import at module level): the probe imports torch.distributed when it runs.
"""
import argparse
import json
import os
import statistics
import sys
from dataclasses import asdict, dataclass

from dlojzlib.dist import stages
from dlojzlib.files import write_atomic
from dlojzlib.flags import COUNT
from dlojzlib.measure import forecast_inputs

# timing.comm_measured where each rank timed its waits in collectives (measure.comm): DDP's
# all-reduce, FSDP2's gathers and reduce-scatters
HOOKED = ('all-reduce hook', 'FSDP2 hooks')

FIRST_BUCKET_BYTES = 2 ** 20  # torch.distributed's _DEFAULT_FIRST_BUCKET_BYTES: DDP's first bucket, 1 MiB


@dataclass(frozen=True)
class Link:
    """An interconnect. intra_bw: bytes/s each rank sends (and receives) inside a node; intra_lat: seconds
    per ring step inside a node; net_bw: bytes/s a node sends (and receives) to the others, all its network
    links together; net_lat: seconds per ring step between nodes; ranks_per_node: ranks in a full node."""
    intra_bw: float
    intra_lat: float
    net_bw: float = None
    net_lat: float = None
    ranks_per_node: int = 1 << 30
    source: str = ''


def bucket_sizes(grad_bytes, bucket_cap_mb=25.0, first_bucket_bytes=FIRST_BUCKET_BYTES):
    """DDP's buckets in the order the backward fills them: a first small bucket, then full ones, the rest
    last. Parameter boundaries are ignored (a bucket closes at the cap, not at the parameter that crosses it)."""
    cap = bucket_cap_mb * 2 ** 20
    sizes, left = [], float(grad_bytes)
    first = min(first_bucket_bytes, left)
    if first > 0:
        sizes.append(first)
        left -= first
    while left > 0:
        sizes.append(min(cap, left))
        left -= sizes[-1]
    return sizes


def ring_allreduce_s(nbytes, ranks, bandwidth, latency):
    """Ring all-reduce of nbytes over `ranks` ranks: reduce-scatter then all-gather, 2 (ranks-1) steps, each
    moving nbytes/ranks per rank."""
    if ranks <= 1:
        return 0.0
    return 2 * (ranks - 1) / ranks * nbytes / bandwidth + 2 * (ranks - 1) * latency


def layout(gpus, ranks_per_node):
    """-> (nodes, ranks per node): fill nodes; beyond one node, whole nodes only (as tools.slurm.shape)."""
    if gpus <= ranks_per_node:
        return 1, gpus
    if gpus % ranks_per_node:
        raise ValueError(f'{gpus} ranks do not fill nodes of {ranks_per_node}: ask for a multiple '
                         f'of {ranks_per_node}.')
    return gpus // ranks_per_node, ranks_per_node


def allreduce_s(nbytes, gpus, link):
    """One all-reduce of nbytes over `gpus` ranks: a ring inside one node, hierarchical across nodes."""
    nodes, per_node = layout(gpus, link.ranks_per_node)
    inside = ring_allreduce_s(nbytes, per_node, link.intra_bw, link.intra_lat)
    if nodes == 1:
        return inside
    if link.net_bw is None:
        raise ValueError(f'{gpus} ranks span {nodes} nodes but the interconnect has no network '
                         f'figures.')
    # the ring across nodes reduces each rank's 1/per_node share; the node's links carry all
    # per_node shares
    return inside + ring_allreduce_s(nbytes, nodes, link.net_bw, link.net_lat)


def exposed_comm_s(sizes, backward_s, comm_s):
    """Communication left after the backward: bucket i is ready at backward_s x (bytes produced up to and
    including it) / (all bytes); all-reduces run one at a time, in order. comm_s(bytes) -> seconds."""
    total, produced, end = sum(sizes), 0.0, 0.0
    for b in sizes:
        produced += b
        start = max(backward_s * produced / total, end)
        end = start + comm_s(b)
    return max(0.0, end - backward_s)


def expected_max(samples, n):
    """Expected maximum of n independent draws from the empirical distribution of `samples`: with the
    samples sorted, the i-th of m is the maximum with probability (i/m)^n - ((i-1)/m)^n."""
    xs, m = sorted(samples), len(samples)
    return sum(x * ((i / m) ** n - ((i - 1) / m) ** n) for i, x in enumerate(xs, 1))


def forecast(step_s, backward_s, batch_per_device, grad_bytes, link, gpus=(1, 2, 4, 8),
             bucket_cap_mb=25.0, first_bucket_bytes=FIRST_BUCKET_BYTES, step_samples=None,
             work_s=None, slowed=None):
    """-> one dict per GPU count: gpus, nodes, comm_s (all-reduce time, hidden or not), exposed_s,
    straggler_s (the wait for the slowest rank, from step_samples: one rank's measured steady step times),
    slowed_s (the device's work per step grown: work_s, the one device's work per step, times
    slowed(n), the fraction by which n ranks slow it: slowdown()), step_s, images_per_s (all ranks),
    efficiency (vs linear from one device), comm_pts, straggler_pts and slowed_pts (what each term
    costs, in points of efficiency). The backward grows with the work, so the all-reduce overlaps
    more of it."""
    if not 0 <= backward_s <= step_s:
        raise ValueError(f'the backward ({backward_s:.4g} s) must lie inside the step '
                         f'({step_s:.4g} s).')
    sizes = bucket_sizes(grad_bytes, bucket_cap_mb, first_bucket_bytes)
    mean = statistics.fmean(step_samples) if step_samples else None
    rows = []
    for n in gpus:
        comm = lambda b, n=n: allreduce_s(b, n, link)
        grown = slowed(n) if slowed and work_s else 0.0
        exposed = exposed_comm_s(sizes, backward_s * (1 + grown), comm)
        straggler = expected_max(step_samples, n) - mean if step_samples else 0.0
        slow = grown * (work_s or 0.0)
        step = step_s + slow + straggler + exposed
        rows.append({'gpus': n, 'nodes': layout(n, link.ranks_per_node)[0],
                     'comm_s': sum(map(comm, sizes)), 'exposed_s': exposed,
                     'straggler_s': straggler,
                     'slowed_s': slow, 'step_s': step, 'images_per_s': n * batch_per_device / step,
                     'efficiency': step_s / step, 'comm_pts': 100 * exposed / step,
                     'straggler_pts': 100 * straggler / step, 'slowed_pts': 100 * slow / step})
    return rows


def slowdown(threads=None, cores=None, measured=None):
    """-> (n -> the fraction by which n ranks on a node slow each rank's work, the source in words).

    - cores: the cores the ranks of a node share (CPU ranks), each rank computing on `threads` of
      them: past one thread per core, each rank's work takes n x threads / cores as long. None: the
      ranks do not share their compute (a GPU each).
    - measured: (m, fraction) from a run at m >= 2 ranks of the same flags (measured_from_summary's
      work against the one device's): what the other ranks' communication took from each rank's work
      (NCCL kernels on its SMs, gloo's threads on its cores), taken as is at every n >= 2 (it does
      not depend on the number of peers), with the cores' share on top.
    One rank is never slowed."""
    share = (lambda n: max(1.0, n * threads / cores)) if cores else (lambda n: 1.0)
    if measured:
        m, f = measured
        words = f'measured at {m} ranks ({f:+.1%} work per step)'
        words += f', and {cores} cores shared by ranks of {threads} thread(s)' if cores else ''
        return (lambda n: (1 + f) * share(n) / share(m) - 1 if n > 1 else 0.0), words
    if cores:
        return (lambda n: share(n) - 1), f'{cores} cores shared by ranks of {threads} thread(s)'
    return (lambda n: 0.0), ('none: no run at 2 or more ranks given (--slowed-from), the ranks '
                             'share no cores')


# ------------------------------------------------------------------------------------ from a dlojz run

def inputs_from_summary(summary):
    """The forecast's inputs from a dlojz summary.json of a one-rank run -> dict(step_s, backward_s,
    batch_per_device, grad_bytes, bucket_cap_mb). Reads: world_size, global_batch,
    timing.steady_images_per_s (images / steady time: a sum, not a median), timing.stats.backward.mean,
    communication.gradient_bytes_per_step (written under a launcher, world size 1 included),
    config.bucket_cap_mb, and the steady steps' times (timing.per_step: after the warm-up, full batches)."""
    if summary.get('world_size', 1) != 1:
        raise ValueError(f"the forecast starts from a one-device run; this one had "
                         f"{summary['world_size']} ranks (its steps already hold communication).")
    factor = traffic_factor(summary.get('communication') or {})
    t = summary.get('timing') or {}
    rate = t.get('steady_images_per_s')
    backward = ((t.get('stats') or {}).get('backward') or {}).get('mean')
    comm = summary.get('communication') or {}
    if not rate or backward is None:
        raise ValueError('the run has no steady steps with phase timing: run it with --timing and '
                         'more steps than --warmup-steps.')
    if not comm.get('gradient_bytes_per_step'):
        raise ValueError('the run has no gradient size: run the one-device reference under '
                         'torchrun or srun (world size 1) so that summary.json has its '
                         '"communication" block.')
    batch = summary['global_batch']
    cap = (summary.get('config') or {}).get('bucket_cap_mb', 25.0)
    forecast_inputs.check_buckets(comm['gradient_bytes_per_step'] * factor, cap)
    per_step = t.get('per_step') or {}
    steps, images = per_step.get('step') or [], per_step.get('images') or []
    full = max((i for i in images if i), default=None)
    samples = [s for k, (s, i) in enumerate(zip(steps, images)) if k >= t.get('warmup_steps', 1) and i == full
               and s is not None]
    split = step_split(t) or {}
    return {'step_s': batch / rate, 'backward_s': backward, 'batch_per_device': batch,
            # what the run's --shard sends per step, in gradient all-reduces (ZeRO-3: 1.5 x); DDP's
            # before
            # --shard wrote no factor
            'grad_bytes': comm['gradient_bytes_per_step'] * factor,
            'bucket_cap_mb': cap,
            'step_samples': samples if len(samples) >= 2 else None, 'work_s': split.get('work')}


def traffic_factor(comm):
    """summary.json's communication.traffic_factor: a number from 1 to 2 (record.summary.TRAFFIC); 1
    where it is absent (a summary from before --shard). Anything else: ValueError, naming it."""
    f = comm.get('traffic_factor', 1.0)
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not 1 <= f <= 2:
        raise ValueError(f'the summary\'s communication.traffic_factor is {f!r}, where dlojz '
                         f'writes a number from 1 to 2 (1.5 under --shard optimizer and full); '
                         f'give the summary.json dlojz wrote.')
    return float(f)


def shared_cores(summary):
    """(threads per rank, usable cores) of a CPU run's summary.json, where its ranks would share the
    host's cores; (None, None) for a GPU run."""
    host = summary.get('host') or {}
    device = (summary.get('provenance') or {}).get('device', 'cpu')
    if device != 'cpu' or not host.get('usable_cores'):
        return None, None
    return host.get('torch_threads') or 1, host['usable_cores']


def job_ranks(timing):
    """The ranks whose sums give the job's terms: the typical rank (a pipeline's typical replica:
    its stages) that summary.json['timing'] names (record.summary.job_view, issue 57: its wait for
    a late rank is the time the job lost to it, whatever the late rank spent it on), else every
    rank with steady steps (a summary written before, whose figures are means over the ranks)."""
    ranks = [r for r in timing.get('ranks') or [] if r.get('steady_steps')]
    mine = [r for r in ranks if r.get('rank') in (timing.get('typical_ranks') or ())]
    return mine if timing.get('bound_job') and mine else ranks


def collective_waits(timing):
    """From a distributed run's summary.json['timing'] -> (seconds per step of the transfer every
    rank waited for, the time per step the job waited for a late rank: the typical rank's wait,
    the step being shared), or (None, None) where the ranks did not measure them (measure.comm;
    docs/chronometer.md). A summary written before issue 57: the mean transfer and the most any
    rank waited."""
    ranks = [r for r in timing.get('ranks') or [] if r.get('steady_steps')]
    if not ranks or not hooked(timing, ranks):
        return None, None
    job = job_ranks(timing)
    late = [r['late_s'] / r['steady_steps'] for r in job]
    return (statistics.fmean(r['comm_s'] / r['steady_steps'] for r in job),
            statistics.fmean(late) if timing.get('bound_job') else max(late))


def step_split(timing):
    """A run's mean steady step split by what it went to (seconds per step, from the job's ranks'
    sums: job_ranks): {'step', 'work' (the device's own work: busy time less the waits in
    collectives), 'data' (the data wait), 'comm' (the transfer every rank waited for), 'late' (the
    wait for a late rank)}. step = work + data + comm + late + the host's rest holds for the typical
    rank, and for the mean of a summary written before issue 57. work None where the run did not
    measure the device's busy time, comm and late None where the ranks did not time their
    collectives; None without steady steps."""
    ranks = [r for r in timing.get('ranks') or [] if r.get('steady_steps')]
    if any(r.get('wall_s') is None or r.get('data_s') is None for r in ranks):
        return None
    if not ranks:  # one process: its own sums; a launcher's world of one all-reduces with itself
        tot = timing.get('totals') or {}
        if not tot.get('steady_steps'):
            return None
        n, collective = tot['steady_steps'], tot.get('collective_s', 0.0)
        work = tot['busy_s'] - collective if tot.get('busy_s') is not None else None
        return {'step': tot['wall_s'] / n, 'work': work / n if work is not None else None,
                'data': tot['data_s'] / n, 'comm': collective / n, 'late': 0.0}
    timed = hooked(timing, ranks)
    ranks = job_ranks(timing)
    mean = lambda f: statistics.fmean(f(r) / r['steady_steps'] for r in ranks)  # noqa: E731
    busy = all(r.get('busy_s') is not None for r in ranks)
    return {'step': mean(lambda r: r['wall_s']), 'data': mean(lambda r: r['data_s']),
            'comm': mean(lambda r: r['comm_s']) if timed else None,
            'late': mean(lambda r: r['late_s']) if timed else None,
            'work': (mean(lambda r: r['busy_s'] - r['comm_s'] - r['late_s'])
                     if timed and busy else None)}


def hooked(timing, ranks):
    """Whether the ranks timed their waits in collectives (measure.comm), each rank's recorded."""
    return timing.get('comm_measured') in HOOKED and \
        all(r.get('comm_s') is not None and r.get('late_s') is not None for r in ranks)


def measured_from_summary(summary):
    """What a multi-rank dlojz run measured -> dict(gpus, images_per_s, exposed_s, late_s:
    collective_waits, work_s: the job's own work per step: step_split)."""
    t = summary.get('timing') or {}
    exposed, late = collective_waits(t)
    return {'gpus': summary.get('world_size', 1), 'images_per_s': t.get('steady_images_per_s'),
            'exposed_s': exposed, 'late_s': late, 'work_s': (step_split(t) or {}).get('work')}


def machine_link(machine):
    """The interconnect of a machine profile (dist/machines.py) (vendors' figures), as a Link."""
    from dlojzlib.dist.machines import MACHINES
    m = MACHINES[machine]
    ic = m.get('interconnect')
    if not ic:
        raise ValueError(f'machine {machine!r} has no interconnect figures; measure them with '
                         f'--probe.')
    return Link(ic['intra_bw'], ic['intra_lat'], ic.get('net_bw'), ic.get('net_lat'),
                m['gpus_per_node'] or 1 << 30, source=f'dist/machines.py MACHINES[{machine!r}]')


# ----------------------------------------------------------------------------------- measured: a probe

def allreduce_probe(group=None, sizes=(2 ** 16, 2 ** 20, 2 ** 22, 2 ** 24), repeats=5, warmup=2,
                    clock=None):
    """Time all_reduce of float32 buffers of each size (bytes) on this process group (all its ranks call
    this). -> [(bytes, median seconds)], the median over `repeats` of the slowest rank's time (a collective
    is over when its last rank is). A barrier lines the ranks up before each timed call."""
    import time

    import torch
    import torch.distributed as tdist
    clock = clock or time.perf_counter
    out = []
    for size in sizes:
        buf = torch.ones(max(1, size // 4), dtype=torch.float32)
        times = []
        for i in range(warmup + repeats):
            tdist.barrier(group=group)
            t0 = clock()
            tdist.all_reduce(buf, group=group)
            dt = torch.tensor([clock() - t0], dtype=torch.float64)
            tdist.all_reduce(dt, op=tdist.ReduceOp.MAX, group=group)
            if i >= warmup:
                times.append(dt.item())
        out.append((buf.numel() * 4, statistics.median(times)))
    return out


def fit_ring(points, ranks):
    """Bandwidth and latency of a ring from probe points [(bytes, seconds)] at `ranks` ranks: least squares
    of t = 2 (ranks-1)/ranks x bytes / bw + 2 (ranks-1) x lat. -> (bw bytes/s, lat s per step); a negative
    latency (noise at small sizes) is clipped to 0 and the bandwidth refitted through the origin."""
    if ranks < 2 or len(points) < 2:
        raise ValueError('a fit needs at least 2 ranks and 2 buffer sizes.')
    xs = [2 * (ranks - 1) / ranks * b for b, _ in points]
    ys = [t for _, t in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    intercept = my - slope * mx
    if intercept < 0 or slope <= 0:
        slope, intercept = sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs), 0.0
    return 1 / slope, intercept / (2 * (ranks - 1))


# ------------------------------------------------------------------------------------------ output

def table(rows, measured=None, work_s=None):
    """Text table of forecast rows; measured: {gpus: measured_from_summary(...)} adds the measured img/s,
    error, exposed communication, wait for a late rank and work grown per step (against the one
    device's work_s) beside the model's."""
    head = f"{'GPUs':>5} {'nodes':>5} {'all-reduce ms':>13} {'exposed ms':>10} " \
           f"{'straggler ms':>12} " \
           f"{'slowed ms':>9} {'step ms':>8} {'img/s':>10} {'efficiency':>10} {'comm pts':>8} " \
           f"{'strag pts':>9} {'slow pts':>8}"
    if measured:
        head += f" {'measured':>10} {'error':>7} {'meas. exposed ms':>16} {'meas. late ms':>13} " \
                f"{'meas. slowed ms':>15}"
    lines = [head]
    ms = lambda v: f"{v * 1e3:.2f}" if v is not None else '-'  # noqa: E731
    for r in rows:
        line = f"{r['gpus']:>5} {r['nodes']:>5} {r['comm_s'] * 1e3:>13.2f} " \
               f"{r['exposed_s'] * 1e3:>10.2f} {r['straggler_s'] * 1e3:>12.2f} " \
               f"{r.get('slowed_s', 0.0) * 1e3:>9.2f} {r['step_s'] * 1e3:>8.1f} " \
               f"{r['images_per_s']:>10.1f} {r['efficiency']:>10.1%} {r['comm_pts']:>8.1f} " \
               f"{r['straggler_pts']:>9.1f} {r.get('slowed_pts', 0.0):>8.1f}"
        m = (measured or {}).get(r['gpus'])
        if m and m['images_per_s']:
            both = m.get('work_s') is not None and work_s is not None
            grown = m['work_s'] - work_s if both else None
            line += f" {m['images_per_s']:>10.1f} {r['images_per_s'] / m['images_per_s'] - 1:>+7.1%} " \
                    f"{ms(m['exposed_s']):>16} {ms(m['late_s']):>13} {ms(grown):>15}"
        lines.append(line)
    return lines


def _probe_main(path):
    import torch.distributed as tdist
    tdist.init_process_group('gloo')
    try:
        n = tdist.get_world_size()
        points = allreduce_probe()
        if tdist.get_rank() == 0:
            bw, lat = fit_ring(points, n) if n > 1 else (None, None)
            # atomic: a FIFO at `path` is replaced, not opened (an open for writing waits for a
            # reader), and a failed write leaves the previous probe
            write_atomic(path, json.dumps({'world_size': n, 'backend': 'gloo', 'points': points,
                                           'bandwidth': bw, 'latency': lat}, indent=1))
            print(f'{n} ranks: ring bandwidth {bw / 1e9 if bw else float("nan"):.3f} GB/s, latency '
                  f'per step {lat * 1e6 if lat is not None else float("nan"):.1f} us -> {path}')
    finally:
        tdist.destroy_process_group()


def gpu_counts(text):
    """--gpus '1,2,4' -> [1, 2, 4]; an argparse type (its error: one sentence)."""
    try:
        counts = [int(g) for g in text.split(',')]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f'must be positive whole numbers separated by commas, '
                                         f'e.g. 1,2,4 (got {text})')
    return counts


def pipeline_main(a):
    """--pipeline: the forecast table of stages.forecast_rows."""
    try:
        summary = forecast_inputs.read('--pipeline', a.pipeline, forecast_inputs.PIPELINE)
        rows = stages.forecast_rows(summary, a.pipeline_stages, a.microbatches)
    except ValueError as e:
        print(f'dlojz_scaling: error: {e}', file=sys.stderr)
        return 2
    p = summary['timing']['pipeline']
    print(f"measured: {p['n_stages']} stages, {p['schedule']}, {p['microbatches']} microbatches: "
          f"span {p['span_s'] * 1e3:.1f} ms, slowest stage computes "
          f"{max(s['compute_s'] for s in p['stages']) * 1e3:.1f} ms")
    print(f"{'stages':>6} {'micro':>6} {'bubble %':>9} {'span ms':>9} {'step ms':>9} {'img/s':>9}")
    for r in rows:
        print(f"{r['stages']:>6} {r['microbatches']:>6} {r['bubble'] * 100:>9.1f} "
              f"{r['span_s'] * 1e3:>9.1f} {r['step_s'] * 1e3:>9.1f} {r['images_per_s']:>9.1f}")
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--summary', help='summary.json of a one-rank run (under torchrun or srun)')
    p.add_argument('--machine',
                   help='interconnect from dist/machines.py (a100, h100, v100, generic)')
    p.add_argument('--link',
                   help='interconnect from a --probe json (one node: ring bandwidth and latency)')
    p.add_argument('--gpus', type=gpu_counts, default='1,2,4,8', help='GPU (rank) counts, comma '
                   'separated')
    p.add_argument('--measured', nargs='*', default=[], metavar='SUMMARY',
                   help='summary.json of runs at other world sizes: their img/s and exposed '
                        'communication beside the forecast')
    p.add_argument('--slowed-from', metavar='SUMMARY', help='summary.json of a run of the same '
                   'flags at 2 or more ranks: its work per step against the one device\'s is the '
                   'compute slowed term (docs/scaling.md)')
    p.add_argument('--cores', type=COUNT, metavar='N', help='cores the ranks of a node share (CPU '
                   'ranks); default: the one-device run\'s usable cores when it ran on the CPU; 0: '
                   'they share none (a GPU each)')
    p.add_argument('--pipeline', metavar='SUMMARY', help='summary.json of a --pipeline-stages '
                   'run: its step forecast at the --pipeline-stages and --microbatches given '
                   '(docs/pipeline.md)')
    p.add_argument('--pipeline-stages', type=gpu_counts, help='stage counts for --pipeline, '
                   'comma separated (default: the run\'s)')
    p.add_argument('--microbatches', type=gpu_counts, help='microbatch counts for --pipeline, '
                   'comma separated (default: the run\'s)')
    p.add_argument('--probe', metavar='JSON',
                   help='run the all-reduce probe on this torchrun group (gloo) and write its '
                   'points and fit')
    a = p.parse_args(argv)
    if a.probe:
        if os.path.isdir(a.probe) or not os.path.isdir(os.path.dirname(a.probe) or '.'):
            print(f'dlojz_scaling: error: --probe {a.probe} is a folder, or in a folder that does '
                  f'not exist; give the name of the file to write, such as probe.json.',
                  file=sys.stderr)
            return 2
        _probe_main(a.probe)
        return 0
    if a.pipeline:
        return pipeline_main(a)
    try:
        if not a.summary or bool(a.machine) == bool(a.link):
            raise ValueError('give --summary and one of --machine or --link.')
        reference = forecast_inputs.read('--summary', a.summary, forecast_inputs.SUMMARY)
        x = inputs_from_summary(reference)
        factor = traffic_factor(reference.get('communication') or {})
        mode = (reference.get('config') or {}).get('shard')
        shard = f' x {factor:g} (--shard {mode})' if factor != 1 else ''
        threads, cores = shared_cores(reference)
        if a.cores is not None:
            threads, cores = threads or 1, a.cores or None
        measured_slowdown, whose = None, f'the one device\'s work from --summary {a.summary}'
        if a.slowed_from:
            other = forecast_inputs.read('--slowed-from', a.slowed_from, forecast_inputs.SUMMARY)
            forecast_inputs.check_slowed_from(reference, a.summary, other, a.slowed_from)
            m = measured_from_summary(other)
            if m['work_s'] is None or x['work_s'] is None:
                raise ValueError(f'--slowed-from needs a run at 2 or more ranks, and both runs '
                                 f'with their work per step measured (phase timing on); '
                                 f'{a.slowed_from} or {a.summary} has none.')
            forecast_inputs.check_work('--summary', a.summary, x['work_s'])
            measured_slowdown = (m['gpus'], m['work_s'] / x['work_s'] - 1)
            whose = f'--slowed-from {a.slowed_from} against --summary {a.summary}'
        slowed, slowed_source = slowdown(threads, cores, measured_slowdown)
        if a.machine:
            link = machine_link(a.machine)
        else:
            probe = forecast_inputs.read('--link', a.link, forecast_inputs.PROBE)
            link = Link(probe['bandwidth'], probe['latency'], source=a.link)
        measured = {}
        for path in a.measured:
            m = measured_from_summary(forecast_inputs.read('--measured', path,
                                                           forecast_inputs.SUMMARY))
            measured[m['gpus']] = m
        gpus = sorted(set(a.gpus) | set(measured))
        rows = forecast(link=link, gpus=gpus, slowed=slowed, **x)
        problem = forecast_inputs.measurement_problem(rows, f'{slowed_source}, {whose}')
        if problem:
            raise ValueError(problem)
    except ValueError as e:  # each input was read and shape-checked: anything else is a bug
        print(f'dlojz_scaling: error: {e}', file=sys.stderr)
        return 2
    steps = sorted(x['step_samples'] or [])
    median = statistics.median(steps) if steps else 0.0
    p90 = f'{steps[int(0.9 * (len(steps) - 1))] / median:.3f}' if median > 0 else '-'
    spread = f", {len(steps)} steady steps (p90/median {p90})" if steps else \
        ', no per-step times: no straggler term'
    print(f"one device: step {x['step_s'] * 1e3:.1f} ms, backward {x['backward_s'] * 1e3:.1f} ms, "
          f"batch {x['batch_per_device']}, gradients {x['grad_bytes'] / factor / 2**20:.1f} "
          f"MiB{shard}{spread}; link {asdict(link)}")
    print(f'compute slowed: {slowed_source}')
    print('\n'.join(table(rows, measured, x['work_s'])))
    return 0


if __name__ == '__main__':
    sys.exit(main())
