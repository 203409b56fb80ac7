"""The plan of --pipeline-stages: where a model is cut (contiguous runs of blocks, balanced by
cost), what a schedule leaves idle (its bubble), and the flags a pipeline cannot take. Light: no
torch at import (flags.check_args reads the refusals; dist.pipeline builds the stages).

A pipeline of S stages runs each step's batch as M microbatches. Each stage waits for its first
microbatch while the stages before it fill the pipeline, and for the last backward while the ones
after it drain it: with equal stages, a share (S - 1) / (M + S - 1) of the step, GPipe's and
1F1B's alike (Huang et al. 2019; Narayanan et al. 2021). The interleaved schedule gives each rank
V = 2 stages, each half as long, and fills in half the time: (S - 1) / (V M + S - 1).
"""
import math
import re

SCHEDULES = ('gpipe', '1f1b', 'interleaved')
VIRTUAL = {'gpipe': 1, '1f1b': 1, 'interleaved': 2}  # stages each rank holds
BALANCE = ('time', 'params')
PIPELINE_TORCH = (2, 4)  # torch.distributed.pipelining is public from torch 2.4
# before pytorch/pytorch#152938 (torch 2.8) the schedules waited on one of the works gloo's
# batch_isend_irecv returns, not all: 1F1B and the interleaved schedule hang on gloo there
GLOO_P2P_TORCH = (2, 8)


def add_flags(p):
    """The pipeline's flags, a group of --help's (flags.get_args_parser)."""
    g = p.add_argument_group('pipeline parallelism (docs/pipeline.md)')
    g.add_argument('--pipeline-stages', type=_positive, default=1, help='cut the model into this '
                   'many stages, one per rank; the ranks make stages x replicas (timm ViTs and '
                   'CoAtNets)')
    g.add_argument('--microbatches', type=_positive, default=1, help='microbatches of each '
                   'step\'s -b images, run through the stages one after the other; with '
                   '--pipeline-stages 1, the reference a pipeline is held to')
    g.add_argument('--pipeline-schedule', choices=SCHEDULES, default='1f1b', help='gpipe (all '
                   'forwards, then all backwards), 1f1b (a backward after each forward once '
                   'filled: fewer activations held), interleaved (two stages per rank)')
    g.add_argument('--pipeline-split', type=_split, default='time', help='where the stages '
                   'begin: time (balanced by the time of each block, measured here), params (by '
                   'parameters), or the blocks where stages 2, 3, ... begin, e.g. 6 or 4,8')


def _positive(text):
    import argparse
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f'invalid value {text!r}: a whole number, 1 or more')
    return int(text)


def _split(text):
    import argparse
    try:
        parse_split(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix('--pipeline-split ')) from None
    return text.strip()


def parse_split(text):
    """--pipeline-split: 'time', 'params', or the blocks where stages 2, 3, ... begin ('4,8':
    blocks 0-3, 4-7, 8-). -> the word, or a tuple of increasing positive ints."""
    text = text.strip()
    if text in BALANCE:
        return text
    if not re.fullmatch(r'\d+(,\d+)*', text):
        raise ValueError(f'--pipeline-split takes time, params or the blocks where the stages '
                         f'after the first begin, such as 4,8; got {text!r}')
    cuts = tuple(int(v) for v in text.split(','))
    if cuts[0] == 0 or any(b <= a for a, b in zip(cuts, cuts[1:])):
        raise ValueError(f'--pipeline-split {text}: each stage begins after the one before, and '
                         f'the first at block 0; give increasing block numbers above 0')
    return cuts


def balance(costs, parts):
    """Cut `costs` (one per block, in order) into `parts` contiguous runs, none empty, so that the
    largest run's sum is as small as it can be (the pipeline goes at its slowest stage's pace) ->
    the bounds [0, b1, ..., len(costs)]: run k is costs[bounds[k]:bounds[k+1]]. Among equal
    largest sums, the one whose runs are the most even from the first on."""
    n = len(costs)
    if not 1 <= parts <= n:
        raise ValueError(f'{n} blocks cannot make {parts} stages')
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float('inf')
    # best[k][i]: (largest run, runs' sums from the last) of costs[:i] in k runs
    best = [[(inf, ())] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = (0.0, ())
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                run = prefix[i] - prefix[j]
                worst, sums = best[k - 1][j]
                cand = (max(worst, run), tuple(sorted(sums + (run,), reverse=True)))
                if cand < best[k][i]:
                    best[k][i], cut[k][i] = cand, j
    bounds, i = [n], n
    for k in range(parts, 0, -1):
        i = cut[k][i]
        bounds.append(i)
    return bounds[::-1]


def bounds_of(cuts, n, parts):
    """--pipeline-split's block numbers -> the bounds balance() gives, refused in one sentence
    where they do not make `parts` stages of `n` blocks."""
    given = ','.join(map(str, cuts))
    if parts == 1:
        raise ValueError(f'--pipeline-split {given} cuts the model, and this run has one stage; '
                         f'drop --pipeline-split, or raise --pipeline-stages.')
    if len(cuts) != parts - 1 or cuts[-1] >= n:
        raise ValueError(f'--pipeline-split {given} does not cut the {n} blocks into {parts} '
                         f'stages; give {parts - 1} increasing block number(s) below {n}.')
    return [0, *cuts, n]


def bubble(schedule, stages, microbatches):
    """The share of a step each rank waits, with equal stages and free communication."""
    v = VIRTUAL[schedule]
    return (stages - 1) / (v * microbatches + stages - 1)


def refusals(args, world_size, torch_version, backend=None, device_type=None):
    """-> [(refused, sentence)] for the pipeline flags (flags.check_args raises the first).
    backend: the process group's; device_type: the run's device's ('cuda', 'cpu')."""
    s, m = args.pipeline_stages, args.microbatches
    piped = s > 1 or m > 1
    name = f'--pipeline-stages {s}'
    version = '.'.join(map(str, torch_version))
    resnet = not args.arch.startswith('timm:') and args.arch != 'coatnet7'
    return [
        (piped and world_size % s != 0,
         f'{name} needs a multiple of {s} ranks (stages x data-parallel replicas); this run has '
         f'{world_size}.'),
        (piped and resnet,
         f'{name} --microbatches {m} would run --arch {args.arch}\'s BatchNorm over microbatches '
         f'of {args.batch_size // m} images instead of -b {args.batch_size}, which changes what it '
         f'learns; pipelines are for timm\'s ViTs and CoAtNets (--arch timm:vit_base_patch16_224, '
         f'coatnet7).'),
        (piped and args.batch_size % m != 0,
         f'-b {args.batch_size} does not split into --microbatches {m} equal microbatches; give a '
         f'multiple of {m}.'),
        (piped and args.accum_steps > 1,
         f'--microbatches already splits each step\'s batch; drop --accum-steps, or raise '
         f'--microbatches.'),
        (s > 1 and args.shard in ('gradients', 'full') and args.pipeline_schedule == 'interleaved',
         f'--shard {args.shard} with --pipeline-schedule interleaved is not supported by dlojz yet '
         f'(each of a rank\'s two stages would need an FSDP2 root of its own); use gpipe or 1f1b, '
         f'or --shard optimizer.'),
        (piped and args.cpu_offload,
         f'{name} with --cpu-offload is not supported by dlojz yet; drop --cpu-offload.'),
        (piped and args.ema_decay,
         f'{name} keeps a part of the weights on each rank, and --ema-decay averages whole ones; '
         f'drop --ema-decay.'),
        (piped and args.compile,
         f'{name} with --compile is not supported by dlojz yet; drop --compile.'),
        (piped and args.amp == 'fp16',
         f'{name} would need a loss scale agreed over the stages, which --amp fp16\'s GradScaler '
         f'does not do; use --amp bf16 (no loss scale).'),
        (piped and (args.mixup or args.cutmix),
         f'{name} with --mixup or --cutmix is not supported by dlojz yet; drop them.'),
        (piped and args.findlr,
         f'--findlr with {name} is not supported by dlojz yet; find the rate without the '
         f'pipeline.'),
        # gloo's send and recv hand the tensor's address to its TCP transport, and a CUDA tensor's
        # is on the GPU (only gloo's collectives copy CUDA tensors through the host); dist.plan
        # refuses FSDP2 there for the same reason
        (s > 1 and device_type == 'cuda' and backend == 'gloo',
         f'{name} sends activations and gradients between the stages\' ranks on the GPU, which '
         f'the gloo group of tasks sharing a GPU cannot do (its sends take host memory only); '
         f'give each task a GPU of its own, or drop --pipeline-stages.'),
        (s > 1 and args.pipeline_schedule == 'interleaved' and m % s != 0,
         f'--pipeline-schedule interleaved runs the microbatches in rounds of {s} (one per stage); '
         f'give --microbatches a multiple of {s}.'),
        (s > 1 and args.pipeline_schedule != 'gpipe' and m < s,
         f'--pipeline-schedule {args.pipeline_schedule} needs at least one microbatch per stage; '
         f'give --microbatches {s} or more, or use gpipe.'),
        # last: the combinations above are refused whatever the torch
        (piped and torch_version < PIPELINE_TORCH,
         f'{name} needs torch.distributed.pipelining, public from torch 2.4 (this is {version}); '
         f'upgrade torch.'),
        (s > 1 and args.pipeline_schedule != 'gpipe' and backend == 'gloo'
         and torch_version < GLOO_P2P_TORCH,
         f'--pipeline-schedule {args.pipeline_schedule} hangs on gloo below torch 2.8 (its '
         f'batched sends and receives, pytorch/pytorch#152938; this is {version}); use '
         f'--pipeline-schedule gpipe, or upgrade torch.'),
    ]


def forecast(compute_s, schedule, n_stages, microbatches):
    """A pipeline's step (its schedule's span, seconds) from one stage's compute in a step (the
    forward and backward of its M microbatches) and the schedule: the slowest stage paces the
    others, and every rank idles the bubble's share besides."""
    return compute_s / (1 - bubble(schedule, n_stages, microbatches))


def summary(ranks, schedule, n_stages, microbatches):
    """summary.json's timing['pipeline'] from every rank's report (Chronometer.totals with its
    place in the pipeline, 'pipe_rank'): per stage, the mean step's span of the schedule, its
    compute and its waits (seconds) and the bubble (the waits' share of the span), over the
    stage's replicas; the schedule's bubble beside the measured one; the forecast of the span from
    the slowest stage's compute; the timeline of a median step of each stage (replica 0)."""
    out = []
    for p in range(n_stages):
        mine = [r for r in ranks if r.get('pipe_rank') == p and r.get('pipe_steps')]
        if not mine:
            return None
        steps = sum(r['pipe_steps'] for r in mine)
        span = sum(r['pipe_span_s'] for r in mine)
        idle = sum(r['bubble_s'] for r in mine)
        out.append({'stage': p, 'span_s': span / steps, 'compute_s': (span - idle) / steps,
                    'wait_s': idle / steps, 'bubble': idle / span if span else None,
                    'timeline': mine[0].get('timeline'),
                    'timeline_span_s': mine[0].get('timeline_span_s')})
    slowest = max(s['compute_s'] for s in out)
    return {'schedule': schedule, 'n_stages': n_stages, 'microbatches': microbatches,
            'expected_bubble': bubble(schedule, n_stages, microbatches),
            'measured_bubble': sum(s['bubble'] for s in out) / len(out),
            'forecast_span_s': forecast(slowest, schedule, n_stages, microbatches),
            'span_s': max(s['span_s'] for s in out), 'stages': out}


def line(p):
    """'>>> Pipeline: ...' from summary()."""
    each = '; '.join(f"stage {s['stage']} computes {s['compute_s'] * 1e3:.1f} ms and waits "
                     f"{s['wait_s'] * 1e3:.1f} ms ({s['bubble']:.1%})" for s in p['stages'])
    v = VIRTUAL[p['schedule']]
    return (f">>> Pipeline: {p['n_stages']} stages, {p['schedule']}, {p['microbatches']} "
            f"microbatches: bubble {p['measured_bubble']:.1%} measured, "
            f"{p['expected_bubble']:.1%} the schedule's ((S-1)/({v if v > 1 else ''}M+S-1)); "
            f"{each}; forecast from the slowest stage {p['forecast_span_s'] * 1e3:.1f} ms a step "
            f"(measured {p['span_s'] * 1e3:.1f} ms)")


def forecast_rows(summary, n_stages=None, microbatches=None):
    """The pipeline forecast of dlojz_scaling.py --pipeline: from a pipeline run's summary.json
    (timing.pipeline, global_batch, timing.steady_images_per_s), its slowest stage's compute per
    step, spread over S' stages (the model's compute is S times the slowest stage's, at best) and
    run as M' microbatches of the same -b (the compute per image kept): the schedule's span is
    that compute / (1 - its bubble), the rest of the step (loader, optimizer) as measured ->
    [{'stages', 'microbatches', 'bubble', 'span_s', 'step_s', 'images_per_s'}]. Refused in one
    sentence (ValueError) where the summary lacks what it needs."""
    t = summary.get('timing') if isinstance(summary, dict) else None
    p = t.get('pipeline') if isinstance(t, dict) else None
    try:
        s, m, schedule = int(p['n_stages']), int(p['microbatches']), p['schedule']
        slowest = max(float(st['compute_s']) for st in p['stages'])
        span = float(p['span_s'])
        step = float(summary['global_batch']) / float(t['steady_images_per_s'])
        replicas_batch = float(summary['global_batch'])
    except (TypeError, KeyError, ValueError, ZeroDivisionError):
        raise ValueError('the summary holds no measured pipeline (timing.pipeline, '
                         'timing.steady_images_per_s, global_batch): give the summary.json of a '
                         'completed --pipeline-stages run with --timing.') from None
    finite = all(map(math.isfinite, (slowest, span, step)))
    if schedule not in SCHEDULES or s < 2 or m < 1 or not finite or not slowest > 0 \
            or not step > 0:
        raise ValueError(f'the summary\'s pipeline ({s} stages, {m} microbatches, schedule '
                         f'{schedule!r}, slowest stage {slowest!r} s) cannot be forecast from; '
                         f'give the summary.json of a completed --pipeline-stages run.')
    rest = max(0.0, step - span)
    rows = []
    for s2 in n_stages or [s]:
        for m2 in microbatches or [m]:
            b = bubble(schedule, s2, m2)
            span2 = slowest * s / s2 / (1 - b)
            if not math.isfinite(span2 + rest) or not replicas_batch / (span2 + rest) > 0:
                raise ValueError(f'the summary\'s times ({slowest!r} s a step) are out of '
                                 f'range; give the summary.json of a completed '
                                 f'--pipeline-stages run.')
            rows.append({'stages': s2, 'microbatches': m2, 'bubble': b, 'span_s': span2,
                         'step_s': span2 + rest, 'images_per_s': replicas_batch / (span2 + rest)})
    return rows
