"""The memory plan of --shard: the model states (parameters, gradients, optimizer state) each rank
holds under each mode, from the parameters' shapes alone, before anything is allocated; and the
flags a mode cannot take. Light: no torch at import (flags.check_args reads the refusals).

A rank's model states under --shard (P: every parameter's bytes, N ranks; ZeRO's names in brackets):

    mode        parameters        gradients        optimizer state     also, during the step
    none        P                 P                k x P               -
    optimizer   P                 P                k x its part [1]    -
    gradients   P / N [2]         P / N            k x P / N           the whole model gathered (P)
    full        P / N             P / N            k x P / N           two blocks gathered [3]

k: state tensors per parameter (SGD with momentum 1, AdamW 2 and its step, LARS 1, LAMB 2, Lion 1).
[1] ZeroRedundancyOptimizer gives each parameter whole to the rank with the fewest elements so far,
    largest first, group by group: the plan does the same, and counts the rank that gets the most.
[2] FSDP2 keeps a slice of each parameter between steps in both modes; 'gradients' keeps the
    gathered parameters from the forward to the backward (reshard_after_forward=False), 'full'
    gathers them again for the backward. A slice is torch.chunk's along dim 0: rank 0's is the
    largest.
[3] The block being computed and the next one, prefetched.
With --cpu-offload the sharded states live in host memory and the device holds what is gathered.
"""
import math

MODES = ('none', 'optimizer', 'gradients', 'full')
FSDP_MODES = ('gradients', 'full')  # FSDP2's: the parameters sliced too
ZERO = {'none': 'DDP', 'optimizer': 'ZeRO-1', 'gradients': 'ZeRO-2', 'full': 'ZeRO-3'}
# optimizer state tensors per parameter, and whether a per-parameter step count is kept as a tensor
STATE = {'sgd': (1, False), 'adamw': (2, True), 'lars': (1, False), 'lamb': (2, False),
         'lion': (1, False)}
STEP_BYTES = 4  # torch's AdamW keeps each parameter's step as a float32 scalar tensor
FSDP_TORCH = (2, 6)  # fully_shard is public (torch.distributed.fsdp) and runs on CPU from torch 2.6


def chunk(n, world):
    """Rank 0's rows of a dimension of n split over `world` ranks as torch.chunk splits it."""
    return math.ceil(n / world) if n else 0


def zero_partition(groups, world):
    """-> elements per rank as ZeroRedundancyOptimizer partitions `groups` (lists of numels)."""
    return _zero_parts(groups, world)[0]


def _zero_parts(groups, world):
    """-> (elements, tensors) per rank: ZeroRedundancyOptimizer gives each tensor, largest first and
    group by group, to the rank with the fewest elements so far (the first such rank)."""
    sizes, counts = [0] * world, [0] * world
    for group in groups:
        for numel in sorted(group, reverse=True):
            r = sizes.index(min(sizes))
            sizes[r] += numel
            counts[r] += 1
    return sizes, counts


def plan(groups, mode, world, optimizer='sgd', momentum=0.9, element_size=4, blocks=()):
    """The model states of the rank that holds the most under `mode`, in bytes.

    groups: the optimizer's parameter groups, as lists of parameter shapes; blocks: each block's
    parameter shapes (the units --shard gradients and full gather). -> dict of parameters,
    gradients, optimizer (state) and model_states (their sum: what a rank keeps between steps),
    gathered (what the step adds) and peak (their sum)."""
    shapes = [s for g in groups for s in g]
    numel = lambda s: math.prod(s)
    sliced = lambda s: chunk(s[0], world) * math.prod(s[1:]) if s else (1 if world == 1 else 0)
    per_tensor, step = STATE[optimizer]
    if optimizer == 'sgd' and not momentum:
        per_tensor = 0
    whole = sum(map(numel, shapes))
    # owned: the elements whose optimizer state this rank keeps; counted: their tensors (for AdamW)
    if mode == 'none':
        params = grads = owned = whole
        counted = len(shapes)
    elif mode == 'optimizer':  # ZeRO-1: the part with the most elements
        params = grads = whole
        sizes, counts = _zero_parts([[numel(s) for s in g] for g in groups], world)
        owned, counted = max(zip(sizes, counts), key=lambda part: part[0])
    else:
        params = grads = owned = sum(map(sliced, shapes))
        counted = len(shapes)
    state = per_tensor * owned * element_size + (STEP_BYTES * counted if step else 0)
    gathered = {'none': 0, 'optimizer': 0, 'gradients': whole,
                'full': sum(sorted((sum(map(numel, b)) for b in blocks), reverse=True)[:2])}[mode]
    out = {'parameters': params * element_size, 'gradients': grads * element_size,
           'optimizer': state, 'gathered': gathered * element_size}
    out['model_states'] = out['parameters'] + out['gradients'] + out['optimizer']
    out['peak'] = out['model_states'] + out['gathered']
    return out


def plans(groups, world, optimizer='sgd', momentum=0.9, element_size=4, blocks=()):
    """-> {mode: plan(...)} for every mode at this world size."""
    return {m: plan(groups, m, world, optimizer, momentum, element_size, blocks) for m in MODES}


def device_bytes(p, offload):
    """What a plan asks of the device's memory: with --cpu-offload, the gathered parameters only."""
    return p['gathered'] if offload else p['peak']


def fitting_mode(all_plans, capacity, offload=False):
    """The first mode, from none to full, whose model states fit `capacity` bytes; None if none
    does."""
    for m in MODES:
        if device_bytes(all_plans[m], offload and m in FSDP_MODES) <= capacity:
            return m
    return None


def gib(n):
    return f'{n / 2**30:.2f}'


def plan_lines(all_plans, mode, world):
    """The plan as printed before the first step: one line per mode, the chosen one marked."""
    lines = [f'Memory plan per rank at {world} rank(s), GiB (parameters + gradients + optimizer '
             f'state = model states; + gathered during the step):']
    for m, p in all_plans.items():
        mark = '*' if m == mode else ' '
        parts = ' + '.join(gib(p[k]) for k in ('parameters', 'gradients', 'optimizer'))
        lines.append(f' {mark} --shard {m:<9} ({ZERO[m]}): {parts} = {gib(p["model_states"])}; '
                     f'+ {gib(p["gathered"])}')
    return lines


def refusals(args, device_type, world_size, torch_version, backend=None):
    """-> [(refused, sentence)] for --shard and --cpu-offload (flags.check_args raises the
    first)."""
    sharded = args.shard in FSDP_MODES
    name = f'--shard {args.shard}'
    version = '.'.join(map(str, torch_version))
    return [
        (args.cpu_offload and not sharded,
         f'--cpu-offload keeps the shards of --shard gradients or full in host memory, and --shard '
         f'{args.shard} has none there; add --shard full (or gradients), or drop --cpu-offload.'),
        (sharded and args.ema_decay,
         f'{name} keeps a slice of the weights on each rank, and --ema-decay averages whole ones; '
         f'drop --ema-decay, or use --shard optimizer.'),
        (sharded and args.arch.endswith('-heads'),
         f'{name} reduces every block\'s gradients each step, and --arch {args.arch} leaves its '
         f'unused heads without one; use --shard optimizer, or another --arch.'),
        (sharded and args.compile,
         f'{name} with --compile is not supported by dlojz yet (its gathers would need compiling '
         f'block by block); drop --compile, or use --shard optimizer.'),
        (sharded and args.amp == 'fp16',
         f'{name} would need a loss scale agreed over the ranks\' gradient slices, which --amp '
         f'fp16\'s GradScaler does not do; use --amp bf16 (no loss scale) or --shard optimizer.'),
        (sharded and args.channels_last,
         f'{name} slices the parameters as they lie in memory, and FSDP2 takes contiguous ones '
         f'only (channels-last convolution weights are not); drop --channels-last (off by default '
         f'under {name}), or use --shard optimizer.'),
        (sharded and args.sync_bn,
         f'{name} with --sync-bn is not supported by dlojz yet; use --shard optimizer with '
         f'--sync-bn (DDP under ZeRO-1).'),
        (sharded and device_type == 'cuda' and backend == 'gloo' and world_size > 1,
         f'{name} reduce-scatters gradients on the GPU, which the gloo group of tasks sharing a '
         f'GPU cannot do; give each task a GPU of its own.'),
        # last: the combinations above are refused whatever the torch
        (sharded and torch_version < FSDP_TORCH,
         f'{name} needs FSDP2\'s fully_shard, public from torch 2.6 (this is {version}); use '
         f'--shard optimizer (ZeRO-1) or upgrade torch.'),
    ]
