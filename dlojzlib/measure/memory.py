"""Memory planned before the first step and measured after it: the model states per rank of every
--shard mode at this world size (dist.plan's arithmetic over the shapes of a model built on the meta
device), the refusal of a mode whose states cannot fit the GPU, and the `>>> Memory:` line that puts
the largest rank's measured states beside the plan."""
import torch

from dlojzlib.dist import plan
from dlojzlib.errors import UsageError
from dlojzlib.recipe import param_groups


def shapes(module):
    return [tuple(p.shape) for p in module.parameters()]


def plan_run(args, build, blocks, world_size, capacity=None, say=print):
    """-> {mode: plan} of the model `build()` makes, built on the meta device (nothing allocated),
    under this run's optimizer, printed with say(); None, with a note, where the model cannot be
    built there. blocks(model): the units --shard shards. capacity: the GPU's memory in bytes (None
    on CPU): a mode whose model states exceed it is refused, naming one that fits. A pipeline's
    ranks hold their stages' part, which the plan does not know yet: none is made."""
    if getattr(args, 'pipeline_stages', 1) > 1:
        say(f'Memory plan: not made for --pipeline-stages {args.pipeline_stages} (each rank holds '
            f'its stages\' part); the measured states are reported after the first step.')
        return None
    try:
        with torch.device('meta'):
            meta_model = build()
    except (RuntimeError, NotImplementedError) as e:  # timm 1.0.3 reads .item() building ViTs
        why = str(e).splitlines()[0][:80]
        say(f'Memory plan: not made, as --arch {args.arch} cannot be built on the meta device with '
            f'this torch and timm ({why}); the measured states are still reported.')
        return None
    plans = plan_model(args, meta_model, blocks(meta_model), world_size, capacity)
    say('\n'.join(plan.plan_lines(plans, args.shard, world_size)))
    return plans


def plan_model(args, meta_model, blocks, world_size, capacity=None):
    """-> {mode: plan} for `meta_model` (see plan_run)."""
    groups = [[tuple(p.shape) for p in g['params']]
              for g in param_groups(meta_model, args.wd, args.wd_norm_bias)]
    size = next(meta_model.parameters()).element_size()
    plans = plan.plans(groups, world_size, args.optimizer, args.mom, size,
                       [shapes(b) for b in blocks])
    need = plan.device_bytes(plans[args.shard], args.cpu_offload)
    if capacity is None or need <= capacity:
        return plans
    fits = plan.fitting_mode(plans, capacity, args.cpu_offload)
    if fits:
        what = (f'--shard {fits} ({plan.ZERO[fits]}) plans '
                f'{plan.gib(plan.device_bytes(plans[fits], args.cpu_offload))} GiB: use it')
    else:
        what = f'no mode fits at {world_size} rank(s): add GPUs, or --shard full --cpu-offload'
    raise UsageError(f'--arch {args.arch} with --optimizer {args.optimizer} needs '
                     f'{plan.gib(need)} GiB of model states per GPU under --shard {args.shard} '
                     f'({plan.ZERO[args.shard]}) at {world_size} rank(s), more than this GPU\'s '
                     f'{plan.gib(capacity)} GiB; {what}.')


def capacity(device):
    """The GPU's memory in bytes; None on CPU (no limit is checked there)."""
    return torch.cuda.get_device_properties(device).total_memory if device.type == 'cuda' else None


def summary(plans, mode, measured):
    """summary.json's memory entries: the plan of every mode (None where none was made), the chosen
    one's model states, and the largest rank's measured (None until the first optimizer step ran).
    """
    return {'model_state_plan': plans,
            'model_state_plan_bytes': plans[mode]['model_states'] if plans else None,
            'model_state_bytes': measured['model_states'] if measured else None,
            'model_state_measured': measured}


def line(memory, mode, world_size, offload=False):
    """'>>> Memory: ...' from summary.json's memory entries; None without a measurement."""
    got = memory.get('model_state_measured')
    if not got:
        return None
    planned = (memory.get('model_state_plan') or {}).get(mode)
    where = 'host memory (--cpu-offload)' if offload else 'per rank'
    parts = ' + '.join(f'{plan.gib(got[k])}' for k in ('parameters', 'gradients', 'optimizer'))
    return (f">>> Memory: model states {where} {plan.gib(got['model_states'])} GiB measured "
            f"(parameters + gradients + optimizer state = {parts}), "
            + (f"{plan.gib(planned['model_states'])} GiB planned" if planned else 'no plan')
            + f" (--shard {mode}, {plan.ZERO[mode]}, {world_size} rank(s))")
