"""What a dlojz run says of itself: the header it opens with, summary.json and the closing '>>>'
lines (timing, memory, energy, per-rank reports and the gradient all-reduce estimate), from a run
(what dlojz.py built) and its progress (where the loop stopped). Every rank calls write_summary;
rank 0 writes the file."""
import math
import os
import socket
from contextlib import contextmanager

from dlojz_chrono import percents, step_shares, verdict
from dlojzlib import recipe
from dlojzlib.dist import launch, plan, stages, starting
from dlojzlib.flags import get_args_parser
from dlojzlib.host import provenance
from dlojzlib.measure import memory, startup
from dlojzlib.measure.scaling import HOOKED
from dlojzlib.record.log import SUMMARY_VERSION, write_json

# comm_measured of a pipeline: its stages' waits inside the schedule (measure.bubble), then also
# the replicas' all-reduce of each stage (dist.pipeline.Pipeline._average_gradients), in which a
# rank is compared with its stage's other replicas
PIPED = ("pipeline stages' waits (bubble); no replicas to compare",
         "pipeline stages' waits (bubble) and the replicas' all-reduce")


def print_header(run):
    """The run's opening lines on rank 0: launch, batch, learning rate, the flags that differ from
    the defaults."""
    args, dist, say = run.args, run.dist, run.log.print
    nodes, procs = dist.num_nodes, dist.world_size
    # ends with the process count, which the course's tools read as split()[-2]
    say(f">>> Training on {nodes} node{'s' * (nodes > 1)} and {procs} process{'es' * (procs > 1)}")
    kernels = recipe.implementation(run.optimizer)  # fused, foreach: choices.optimizer_kernels
    say(f'{dist.launcher} launch on {run.device}: {args.arch}, amp {args.amp}, channels-last '
        f'{args.channels_last}, optimizer {args.optimizer} ({kernels})')
    if run.choices is not None and run.choices.as_if_cuda:
        say(f"As if on CUDA (DLOJZ_AS_IF_CUDA=1), a GPU's choices: {', '.join(run.choices.made)}; "
            f"CUDA events, streams, pinned memory, NCCL, NVML and the GPU decoders stay the CPU's")
    say(f'global batch size: {run.global_batch} - mini batch size: {args.batch_size}' +
        (f' ({args.accum_steps} micro-batches per step)' if args.accum_steps > 1 else ''))
    if args.findlr:
        say(f'learning rate: sweep from 1e-08 to {args.lr:g} over {run.total_steps} steps')
        if run.total_steps < recipe.FINDLR_MIN_STEPS:
            say(f'Warning: an LR sweep of {run.total_steps} steps multiplies the LR by '
                f'{(args.lr / 1e-8) ** (1 / max(1, run.total_steps - 1)):.2g} per step: its '
                f'suggestion is coarse; give it {recipe.FINDLR_MIN_STEPS} steps or more '
                f'(--test-nsteps, and -e so that the epochs hold them).')
    else:
        rule = '--lr' if args.lr != args.base_lr * run.global_batch / 256 else \
            f'--base-lr {args.base_lr:g} per 256 images x global batch {run.global_batch}'
        say(f'learning rate: {args.lr:.6g} ({rule}; {args.scheduler} schedule)')
    # the flags that differ from their defaults; config.json holds them all
    defaults = vars(get_args_parser().parse_args([]))
    if args.scheduler == 'onecycle' and not args.findlr and args.mom != defaults['mom']:
        say(f"Note: --mom {args.mom:g} is not used: the onecycle schedule sets the momentum "
            f"(beta1) at every step, from 0.95 down to 0.85 and back (torch's OneCycleLR); another "
            f"--scheduler keeps --mom.")
    changed = [f'{k}={v}' for k, v in sorted(vars(args).items()) if k not in defaults or defaults[k] != v]
    say('Config (differs from the defaults; all of it in config.json): ' + ' '.join(changed))
    for warning in run.host['warnings']:
        say(f'Warning: {warning}')


def write_summary(run, progress, status, error=None, extra=None):
    """On a completed run this gathers every rank's timings (a collective); after a failure other
    ranks may be gone, so nothing is gathered then. Energy per image is this GPU's energy over the
    steady training steps divided by the images this rank trained on in them."""
    args, dist, gb = run.args, run.dist, run.global_batch
    cuda = run.device.type == 'cuda'
    timing = run.chrono.summary(gb, run.steps_per_epoch, len(run.data.val_loader))
    energy = run.power.summary()
    summary = {
        'version': SUMMARY_VERSION, 'status': status, 'error': error, 'config': vars(args),
        'provenance': provenance(run.device, dist),
        'world_size': dist.world_size, 'num_nodes': dist.num_nodes, 'global_batch': gb,
        'mode': 'evaluate' if args.evaluate else 'findlr' if args.findlr else 'train',
        'data': run.data.record(run.steps_per_epoch),
        'timing': timing,
        'memory': {**run.memory.summary(), **states_summary(run, [states_of(run)])},
        'host': run.host,
        'energy': energy,
        'global_step': progress.global_step, 'train': progress.train, 'val': progress.val,
        'val_ema': progress.val_ema,
        # DLOJZ_AS_IF_CUDA=1: the CUDA choices this CPU run made (dlojzlib.choices); null without it
        'as_if_cuda': list(run.choices.made) if run.choices and run.choices.as_if_cuda else None,
        'time_to_accuracy': {'target_top1': args.target_top1, 'best_top1': progress.best_top1,
                             'raw': progress.reached.get('raw'),
                             'ema': progress.reached.get('ema')},
        **(extra or {}),
    }
    starts = [rank_startup(run)]  # every rank's once the run completed (gathered below)
    if dist.distributed:
        if run.pipe is None:  # DDP's buckets; a pipeline has none
            summary['communication'] = communication_estimate(
                args.bucket_cap_mb, run.model_without_ddp, args.shard, dist.world_size)
        if status == 'completed':
            ranks = launch.all_gather_object(rank_report(run))
            timing['bound_rank0'] = timing.get('bound')
            timing.update(ranks_summary(ranks, gathers=args.shard in plan.FSDP_MODES))
            if run.pipe is not None and run.pipe.schedule is not None:  # per stage (measure.bubble)
                timing['pipeline'] = stages.summary(ranks, args.pipeline_schedule,
                                                    args.pipeline_stages, args.microbatches)
            summary['memory']['gpu_max_allocated_bytes_any_rank'] = max(
                (r['gpu_max_allocated_bytes'] or 0 for r in ranks), default=0) if cuda else None
            summary['memory'].update(states_summary(run, [r['model_states'] for r in ranks]))
            energy.update(energy_over_ranks(ranks))
            starts = [r['startup'] for r in ranks]
    summary['startup'] = startup.summarize(starts)
    add_reasons(summary)
    if dist.is_main:
        write_json(os.path.join(args.output_dir, 'summary.json'), summary)
    return summary


NO_FIRST_STEP = 'no training step ran (the start-up ends at the first one)'
NOT_HERE = 'this training loop does not measure it'  # Lightning's callback (docs/lightning.md)


def add_reasons(summary):
    """summary.json says why a figure is null, as its '>>>' line does: the reasons that depend on
    the run as a whole (the Chronometer and the power meter give theirs)."""
    t, m = summary['timing'], summary['memory']
    if 'ranks' in t and t.get('rank_skew') is None:  # no rank timed a steady step
        t['rank_skew'] = None
        t['unmeasured']['rank_skew'] = t['unmeasured'].get('train_throughput') or NOT_HERE
    m['unmeasured'] = memory_unmeasured(m, summary['provenance']['device'])
    summary['unmeasured'] = {'startup': NO_FIRST_STEP} if summary['startup'] is None else {}


def memory_unmeasured(m, device):
    """{entry: why it is null} of summary.json's memory entries."""
    off_gpu = None if str(device).startswith('cuda') else f'the run is on {device}, not a GPU'
    why = {'gpu_max_allocated_bytes': off_gpu or 'no step ran on the GPU',
           'val_gpu_max_allocated_bytes': off_gpu or 'no validation ran',
           'host_peak_rss_bytes': 'this system has no /proc/<pid>/status (VmHWM is Linux\'s)',
           'model_state_bytes': 'no optimizer step ran' if 'model_state_measured' in m else
           NOT_HERE}
    why['gpu_max_reserved_bytes'] = why['gpu_max_allocated_bytes']
    why['val_gpu_max_reserved_bytes'] = why['val_gpu_max_allocated_bytes']
    return {k: v for k, v in why.items() if m.get(k) is None}


@contextmanager
def stop_recorded(args, dist, mode):
    """A mode whose summary.json is written at its end (--loader-only: no step to finish), ended
    by a stop signal (dist.starting): the stop's record, status 'preempted', then its Preempted.
    Once the mode has written its own record, a stop only records itself (the command ends)."""
    try:
        yield
        starting.disarm()
    except starting.Stopped as e:
        err = starting.preempted(e, args, dist, launch.requeue)
        if dist.is_main:
            write_json(os.path.join(args.output_dir, 'summary.json'),
                       {'version': SUMMARY_VERSION, 'status': err.status, 'error': str(err),
                        'mode': mode, 'config': vars(args), 'world_size': dist.world_size})
        raise err from None


def rank_report(run):
    """This rank's timing, memory and energy; gathered from every rank at the end of a completed
    run."""
    return {**rank_timing(run.chrono, run.memory, run.power, run.dist.rank),
            'pipe_rank': run.pipe.rank_in_pipe if run.pipe is not None else None,
            'model_states': states_of(run), 'startup': rank_startup(run)}


def rank_timing(chrono, memory, power, rank):
    """What every loop's rank reports of its steps (a Chronometer's), memory and energy: dlojz.py's
    and a Lightning run's (dlojzlib.lightning)."""
    st, mem = chrono.stats(), memory.summary()
    step, data = st.get('step'), st.get('data')
    profiled = sum(bool(r.get('excluded')) for r in chrono.steps)
    return {**chrono.totals(), 'profiled_steps': profiled, 'rank': rank,
            'host': socket.gethostname(),
            'steps': len(chrono.steps),
            'step_median_s': step['median'] if step else None,
            'step_mean_s': step['mean'] if step else None,
            'data_mean_s': data['mean'] if data else None, 'val_time_s': chrono.val_time,
            'gpu_max_allocated_bytes': mem['gpu_max_allocated_bytes'],
            'host_peak_rss_bytes': mem['host_peak_rss_bytes'],
            **power.report()}


def states_of(run):
    """This rank's model states in bytes (dist.shard.state_bytes), None before an optimizer step."""
    return run.states.bytes if run.states is not None else None


def states_summary(run, ranks):
    """summary.json's model-state entries: the plan, and the rank that holds the most, measured."""
    if run.states is None:
        return {}
    measured = max((r for r in ranks if r), key=lambda r: r['model_states'], default=None)
    return memory.summary(run.plans, run.args.shard, measured)


def rank_startup(run):
    """This rank's start-up record (measure.startup), 'total_s' None before its first step."""
    record = run.startup.record() if run.startup is not None else None
    return {'rank': run.dist.rank, 'host': socket.gethostname(), **(record or {'total_s': None})}


def energy_over_ranks(ranks):
    """The energy of every rank's GPU board over the run (J) and per image trained over the steady
    steps, from the rank reports: each rank reports its share of its board (PowerMeter.report), so
    that a board read by several ranks is counted once. {} where a rank has no figure."""
    out = {}
    if all(r['energy_j'] is not None for r in ranks):
        out['energy_j_all_ranks'] = sum(r['energy_j'] for r in ranks)
    if all(r['train_images'] for r in ranks):
        out['joules_per_image_all_ranks'] = sum(r['train_energy_j'] for r in ranks) / \
            sum(r['train_images'] for r in ranks)
    return out


def ranks_summary(ranks, gathers=False):
    """Straggler view: slowest and fastest rank by median step time, and the skew between them; the
    verdict from every rank's sums (Chronometer.totals).

    Each rank measured how long its steps waited in collectives (`collective_s`, measure.comm): for
    the gradient all-reduce after their backward computation (`exposed_s`) and for DDP's buffer
    broadcast before their forward pass (`buffers_s`). The rank that arrives last at a collective
    waits only for the transfer; the others wait for it as well. So the smallest such time over the
    ranks is the transfer (`comm_s`, communication every rank waits for alike) and each rank's
    excess over it is waiting for a late peer (`late_s`). Only durations are compared, so hosts'
    clocks need not agree. The late rank is the one that waited least for the others
    (`straggler_rank`); its own bound says why it was late. Under --shard gradients and full
    (gathers: FSDP2's) the waits are those of FSDP2's gathers and reduce-scatters
    (measure.comm.CommTimer.time_fsdp). Without those measurements (phase timing off), a rank's
    backward time (and forward, where FSDP2 gathers) above the fastest rank's is taken as waiting
    for a late peer, and a network every rank waits for alike reads as compute. The job's verdict
    is then a typical rank's (job_view)."""
    timed = [r for r in ranks if r['step_median_s']]
    if not timed:
        return {'ranks': ranks}
    slow = max(timed, key=lambda r: r['step_median_s'])
    fast = min(timed, key=lambda r: r['step_median_s'])
    res = {'ranks': ranks, 'slowest_rank': slow['rank'], 'fastest_rank': fast['rank'],
           'slowest_step_median_s': slow['step_median_s'],
           'fastest_step_median_s': fast['step_median_s'],
           'rank_skew': slow['step_median_s'] / fast['step_median_s'] - 1}
    measured = [r for r in timed if r.get('busy_s') is not None and r.get('wall_s')]
    if len(measured) != len(ranks):
        return res
    piped = all('bubble_s' in r for r in measured)  # pipeline stages: their waits are measured
    # as the bubble (measure.bubble). A pipeline's ranks meet their stage's replicas only, in the
    # replicas' all-reduce: they are compared with them alone
    groups = {}
    for r in measured:
        groups.setdefault(r.get('pipe_rank') if piped else None, []).append(r)
    if all(r.get('comm_steps') for r in measured):
        # the rank that waited least is the one the others waited for: its wait is the transfer
        # alone. Sums over the run, not step by step: ranks that are late by turns (noise) wait
        # alike and read as communication; a rank late every step is a straggler
        for group in groups.values():
            last_in = min(group, key=lambda r: (r['collective_s'], r['rank']))
            for r in group:
                r['comm_s'] = last_in['collective_s']
                r['late_s'] = r['collective_s'] - r['comm_s']
        replicas = max(len(g) for g in groups.values()) > 1
        res['comm_measured'] = PIPED[replicas] if piped else HOOKED[1] if gathers else HOOKED[0]
        if not gathers and not piped:  # FSDP2's hooks see waits, not buckets: no bandwidth
            volume = last_in['comm_bytes'] / last_in['comm_steps']
            link = last_in['link_s'] / last_in['comm_steps']
            res.update(gradient_bytes_per_step=volume, link_s_per_step=link,
                       achieved_bytes_per_s=volume / link if link > 0 else None)
    elif piped:  # one replica per stage: nothing but the bubble to wait for
        for r in ranks:
            r['comm_s'] = r['late_s'] = 0.0
        res['comm_measured'] = PIPED[0]
    else:
        waits = lambda r: None if r.get('backward_s') is None else \
            r['backward_s'] + ((r.get('forward_s') or 0.0) if gathers else 0.0)
        times = [waits(r) for r in measured]
        fastest = min(times) if None not in times else None
        for r, t in zip(measured, times):  # seconds waiting for peers, over the rank's steady steps
            r['late_s'] = (t - fastest) * r['steady_steps'] if fastest is not None else 0.0
            r['comm_s'] = 0.0  # the transfer itself is not told from the work
        where = 'forward and backward' if gathers else 'backward'
        res['comm_measured'] = f'{where} above the fastest rank'
    for group in groups.values():
        least_data = min(r['data_s'] for r in group)
        for r in group:  # the others waited for this rank's loader
            r['data_excess_s'] = r['data_s'] - least_data
    for r in measured:
        r['bound'] = verdict(r['wall_s'], r['busy_s'], r['data_s'], r['comm_s'], r['late_s'],
                             idle=r.get('bubble_s'))
        # its own pace: the time it did not spend waiting for its peers or the network
        r['own_s'] = r['wall_s'] - r['comm_s'] - r['late_s'] - (r.get('bubble_s') or 0.0)
    res.update(job_view(measured, piped, groups.values()))
    return res


KEYS = ('wall_s', 'busy_s', 'data_s', 'comm_s', 'late_s')


def typical(units):
    """The unit whose view is the job's, of lists of rank reports (a rank, or a pipeline's replica:
    its stages): the upper median by the time waited for a late peer (the faster of two; with one
    late among many, one of the others), then by its own pace."""
    key = lambda u: (sum(r['late_s'] for r in u), -sum(r['own_s'] for r in u),  # noqa: E731
                     min(r['rank'] for r in u))
    return sorted(units, key=key)[len(units) // 2]


def job_view(measured, piped, groups):
    """The job's verdict (docs/chronometer.md): the shares of a typical rank's steady steps (a
    pipeline's: a typical replica's, its stages' sums), whose wait for a late peer is the straggler
    share, the time the job's steps would save if the late rank kept the others' pace. Every
    rank's steps last as long (each waits for the last in), so a typical rank's wait is the
    slowest rank's own time above its own, whatever the slow rank spent it on. Ranks are compared
    with the replicas of their own stage: a pipeline's slowest stage is the others' bubble, a slow
    replica of a stage is a straggler. groups: the ranks compared with each other (ranks_summary's:
    a stage's replicas, every rank outside a pipeline)."""
    if piped:  # rank = stage x replicas + replica (dist.pipeline)
        n = sum(r.get('pipe_rank') == 0 for r in measured) or 1
        units = {}
        for r in measured:
            units.setdefault(r['rank'] % n, []).append(r)
        units = list(units.values())
    else:
        units = [[r] for r in measured]
    unit = typical(units)
    wall, busy, data, comm, late = (sum(r[k] for r in unit) for k in KEYS)
    idle = sum(r['bubble_s'] for r in unit) if piped else None
    # its own loader wait is its loader's (a late rank's is in its wait for it, late_s)
    shares = step_shares(wall, busy, data, comm, late, idle=idle)
    work = busy - comm - late - (idle or 0.0)
    res = {'bound': next(iter(shares)), 'bound_job': True,
           'typical_ranks': sorted(r['rank'] for r in unit),
           'shares_job': {k: v / wall for k, v in shares.items()},
           'device_busy_job': busy / wall, 'data_share_job': data / wall,
           'comm_share': comm / wall, 'late_share': late / wall,
           'straggler_share': shares['straggler'] / wall,
           # waiting for peers or the network is waiting: the headroom leaves it out
           'compute_headroom_job': wall / work if work > 0 else None}
    if shares['straggler'] <= 0:
        return res
    pace = {}  # each rank against the pace of its group's typical rank
    for group in groups:
        own = typical([[r] for r in group])[0]['own_s']
        pace.update((r['rank'], own) for r in group)
    slow = max(measured, key=lambda r: (r['own_s'] - pace[r['rank']], -r['rank']))
    mine = pace[slow['rank']]
    res.update(straggler_rank=slow['rank'], straggler_bound=slow['bound'],
               straggler_host=slow.get('host'),
               straggler_pace=slow['own_s'] / mine if mine > 0 and slow['own_s'] > 0 else None)
    return res


# what a rank sends per step under --shard, in gradient all-reduces: an all-reduce is a
# reduce-scatter then an all-gather, (W-1)/W of the buffer each; ZeRO-1 broadcasts the stepped
# parameters too, ZeRO-3 gathers them for the forward and again for the backward (Rajbhandari et al.
# 2020, section 7)
TRAFFIC = {'none': 1.0, 'optimizer': 1.5, 'gradients': 1.0, 'full': 1.5}


def communication_estimate(bucket_cap_mb, model, shard, world_size):
    """Gradient all-reduce volume per step: 4 bytes per trainable parameter (gradients are fp32 even
    under AMP, the parameters being fp32), sent in DDP buckets: a first 1 MiB bucket, then
    --bucket-cap-mb ones. Under --shard, the traffic in all-reduces of that volume (TRAFFIC)."""
    # DTensors count their whole size
    grad_bytes = 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)
    first, cap = 2 ** 20, bucket_cap_mb * 2 ** 20
    buckets = 1 + math.ceil(max(0, grad_bytes - first) / cap)
    return {'gradient_bytes_per_step': grad_bytes, 'bucket_cap_mb': bucket_cap_mb,
            'buckets_estimate': buckets, 'shard': shard, 'traffic_factor': TRAFFIC[shard],
            # a ring all-reduce sends (and receives) 2 (W-1)/W of the buffer per rank
            'ring_bytes_per_rank_per_step':
                TRAFFIC[shard] * 2 * (world_size - 1) / world_size * grad_bytes}


SHARE_NAMES = {'communication': 'exposed communication', 'bubble': 'pipeline bubble',
               'straggler': 'waiting for a late rank',
               'loader': 'data wait', 'host': 'host'}


def job_key(t, name):
    """The key of a job-wide figure in summary.json['timing']: `<name>_job` (a typical rank's view,
    issue 57), `<name>_all_ranks` (every rank's sums, summaries written before it), or None for a
    run of one process."""
    for tail in ('job', 'all_ranks'):
        if t.get(f'bound_{tail}'):
            return f'{name}_{tail}'
    return None


def share_text(t):
    """'compute 89%, exposed communication 8%, ...': every share of the steady steps, largest first,
    in whole percents adding up to 100 (summary.json['timing']); None for a summary written before
    the shares were (issue 39)."""
    every = job_key(t, 'shares')
    shares = t.get(every or 'shares')
    if not shares:
        return None
    if not every and 'exposed_share' not in t:  # one process: nothing to wait for but its loader
        shares = {k: v for k, v in shares.items() if k not in ('communication', 'straggler')}
    names = {**SHARE_NAMES, 'compute': 'GPU work' if t.get('clock') == 'cuda-events' else 'compute'}
    return ', '.join(f'{names[k]} {v}%' for k, v in percents(shares).items())


def straggler_text(t):
    """'rank 1 on <host>: its steps 2.10x the others', bound by compute' from
    summary.json['timing'] (pace and host: since issue 57)."""
    host = f" on {t['straggler_host']}" if t.get('straggler_host') else ''
    pace = f": its steps {t['straggler_pace']:.2f}x the others'" if t.get('straggler_pace') else ''
    return f"rank {t['straggler_rank']}{host}{pace}, bound by {t['straggler_bound']}"


def whose(t):
    """Whose steps the job's shares are: 'as rank 0 saw the job' (a pipeline's replica: 'as ranks 0
    and 2 saw the job', summary.json['timing']'s typical_ranks), 'all ranks' (a summary written
    before issue 57: every rank's sums), or None for one process."""
    if not t.get('bound_job'):
        return 'all ranks' if t.get('bound_all_ranks') else None
    ranks = t.get('typical_ranks') or []
    if len(ranks) < 2:
        return f"as rank {ranks[0] if ranks else '?'} saw the job"
    return f"as ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]} saw the job"


def bound_line(t):
    """'>>> Bound by: <the largest share> (<share_text>; why; headroom)' from
    summary.json['timing']."""
    split, late, why = share_text(t), '', ''
    if t['bound'] == 'communication' and t.get('achieved_bytes_per_s'):
        why = (f"; {t['gradient_bytes_per_step'] / 2**20:.1f} MiB per step, "
               f"{t['achieved_bytes_per_s'] / 1e9:.3g} GB/s achieved")
    elif t['bound'] == 'straggler' and t.get('straggler_rank') is not None:
        late = f'{straggler_text(t)}; ' if t.get('bound_job') else ''
        why = '' if late else \
            f"; rank {t['straggler_rank']} is late, bound by {t['straggler_bound']}"
    headroom = t.get(job_key(t, 'compute_headroom') or 'compute_headroom')
    headroom = f"; with no waiting the steps would be {headroom:.2f}x faster" if headroom else ''
    view = f', {whose(t)}' if whose(t) else ''
    return f">>> Bound by: {t['bound']} ({late}{split} of the steady steps{view}{why}{headroom})"


def final_lines(summary, chrono, steps_per_epoch):
    """The course's '>>>' lines (Chronometer's) and dlojz's own, from the summary just written. A
    figure that cannot be measured keeps its line, which says why (summary.json's 'unmeasured')."""
    lines = chrono.display_lines(steps_per_epoch)
    t = summary['timing']
    why = t.get('unmeasured') or {}
    lines.append(throughput_line(t, why))
    if t.get('bound'):
        lines.append(bound_line(t))
    else:
        lines.append(f">>> Bound by: not measured: {why.get('bound', NOT_HERE)}")
    if t.get('pipeline'):
        lines.append(stages.line(t['pipeline']))
    if t.get('rank_skew') is not None:
        lines.append(f">>> Step time per rank (median): fastest rank {t['fastest_rank']} "
                     f"{t['fastest_step_median_s'] * 1e3:.1f} ms, slowest rank {t['slowest_rank']} "
                     f"{t['slowest_step_median_s'] * 1e3:.1f} ms (skew {t['rank_skew'] * 100:.1f} "
                     f"%)")
    elif 'ranks' in t:  # a distributed run none of whose ranks timed a steady step
        lines.append(f">>> Step time per rank (median): not measured: "
                     f"{why.get('rank_skew') or why.get('train_throughput', NOT_HERE)}")
    c = summary.get('communication')
    if c and c.get('shard', 'none') != 'none':
        mib = c['gradient_bytes_per_step'] / 2**20
        lines.append(f">>> Sharded traffic per step (--shard {c['shard']}): "
                     f"{c['traffic_factor']:g} x the gradient all-reduce of {mib:.1f} MiB")
    elif c:
        lines.append(f">>> Gradient all-reduce per step: "
                     f"{c['gradient_bytes_per_step'] / 2**20:.1f} MiB in about "
                     f"{c['buckets_estimate']} buckets of <= {c['bucket_cap_mb']:g} MiB")
    lines.append(power_line(summary.get('energy') or {}))
    start = startup.line(summary.get('startup'), summary.get('world_size', 1))
    no_start = (summary.get('unmeasured') or {}).get('startup', NOT_HERE)
    lines.append(start or f'>>> Start-up: not measured: {no_start}')
    m = summary['memory']
    device = (summary.get('provenance') or {}).get('device') or 'cpu'
    mwhy = m.get('unmeasured') or memory_unmeasured(m, device)
    config = summary['config']
    states = memory.line(m, config.get('shard', 'none'), summary.get('world_size', 1),
                         config.get('cpu_offload'))
    lines.append(states or f">>> Memory: not measured: {mwhy.get('model_state_bytes', NOT_HERE)}")
    if m.get('gpu_max_allocated_bytes') is not None:
        # the byte count stays second to last: the course's tools read it there
        lines.append(f">>> Max Memory Allocated {m['gpu_max_allocated_bytes'] / 2**30:.2f} GiB "
                     f"(reserved {m['gpu_max_reserved_bytes'] / 2**30:.2f} GiB) = "
                     f"{m['gpu_max_allocated_bytes']} Bytes")
    else:
        lines.append(f">>> Max Memory Allocated: not measured: "
                     f"{mwhy.get('gpu_max_allocated_bytes', NOT_HERE)}")
    if m.get('val_gpu_max_allocated_bytes') is not None:  # worded apart: the course's tools grep 'Max Memory'
        lines.append(f">>> Validation peak memory: {m['val_gpu_max_allocated_bytes'] / 2**30:.2f} "
                     f"GiB allocated (reserved {m['val_gpu_max_reserved_bytes'] / 2**30:.2f} GiB) "
                     f"= {m['val_gpu_max_allocated_bytes']} Bytes")
    else:
        lines.append(f">>> Validation peak memory: not measured: "
                     f"{mwhy.get('val_gpu_max_allocated_bytes', NOT_HERE)}")
    if m.get('host_peak_rss_bytes') is not None:
        lines.append(f">>> Host peak memory (VmHWM): {m['host_peak_rss_bytes'] / 2**30:.2f} GiB")
    else:
        lines.append(f">>> Host peak memory (VmHWM): not measured: "
                     f"{mwhy.get('host_peak_rss_bytes', NOT_HERE)}")
    lines.append(f"Run written to {summary['config']['output_dir']}")
    return lines


def throughput_line(t, why):
    """'>>> Train throughput: ...; GPU (or Compute) throughput: ...; epoch time estimate: ...' from
    summary.json['timing'], each figure or why it is missing."""
    if t.get('train_throughput') is None:
        return f">>> Train throughput: not measured: {why.get('train_throughput', NOT_HERE)}"
    device = 'GPU' if t.get('clock') != 'host' else 'Compute'  # the key stays gpu_throughput
    rate, epoch = t.get('gpu_throughput'), t.get('epoch_time_estimate_s')
    rate = f"not measured ({why.get('gpu_throughput', NOT_HERE)})" if rate is None else \
        f'{rate:.2f} images/second'
    epoch = f"not known ({why.get('epoch_time_estimate_s', NOT_HERE)})" if epoch is None else \
        f'{epoch:.1f} s'
    return (f">>> Train throughput: {t['train_throughput']:.2f} images/second; {device} "
            f"throughput: {rate}; epoch time estimate: {epoch}")


def power_line(e):
    """'>>> Peak Power during training: ...' from summary.json['energy'], or why not measured."""
    why = e.get('unmeasured') or {}
    if e.get('peak_w') is None:
        return (f">>> Peak Power during training: not measured: "
                f"{why.get('peak_w') or e.get('why_unavailable') or NOT_HERE}")
    per_image = f" ({e['joules_per_image']:.3f} J/image)" if e.get('joules_per_image') is not None \
        else f" (J/image not measured: {why.get('joules_per_image', NOT_HERE)})"
    energy = f"; energy {e['energy_j']:.1f} J" if e.get('energy_j') is not None else ''
    return f">>> Peak Power during training: {e['peak_w']:.1f} W{energy}{per_image}"
