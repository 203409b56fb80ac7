"""--shard: the ways of spreading a run over its ranks, on torch's own APIs, a function per way
(torchtitan's shape), and what the rest of dlojz needs to treat them alike: the accumulation's
no_sync, state dicts for checkpoints, the bytes of the model states, and validation
in lockstep.

    --shard none        launch.wrap_ddp: DistributedDataParallel
    --shard optimizer   wrap_ddp + zero_optimizer: ZeroRedundancyOptimizer (ZeRO-1)
    --shard gradients   apply_fsdp(reshard_after_forward=False): FSDP2 (ZeRO-2)
    --shard full        apply_fsdp(reshard_after_forward=True): FSDP2 (ZeRO-3)

dlojz's autocast stays as it is: FSDP2 keeps fp32 parameters and gradients, and the losses and
weights are DDP's bit for bit at 2 gloo ranks (tests/test_shard.py). What each mode keeps per rank:
dist.plan.
"""
from contextlib import contextmanager

import torch
import torch.distributed as tdist

from dlojzlib.dist.plan import FSDP_MODES  # noqa: F401 (shard.FSDP_MODES: dlojz.py's)

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch < 2.5: no public DTensor; --shard gradients and full are refused there
    DTensor = ()


def apply_fsdp(model, blocks, device, reshard_after_forward, offload, comm=None, mesh=None):
    """FSDP2: each block its own unit (its parameters gathered just before it runs), then the root
    (the stem, the head and whatever no block holds). The model may still be on the CPU: each rank's
    slices go to `device` (to host memory with offload), so a model larger than one GPU is never
    whole on it. comm: a measure.comm.CommTimer, which times each unit's waits. mesh: the ranks
    that share the slices (every rank; a pipeline stage's replicas)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard
    mesh = mesh or init_device_mesh(device.type, (tdist.get_world_size(),))
    kw = dict(mesh=mesh, reshard_after_forward=reshard_after_forward,
              offload_policy=CPUOffloadPolicy(pin_memory=device.type == 'cuda') if offload else
              OffloadPolicy())
    for block in blocks:
        fully_shard(block, **kw)
    model = fully_shard(model, **kw)
    if comm is not None:
        comm.time_fsdp([*blocks, model])
    return model


def zero_optimizer(cls, groups, group=None, **kw):
    """ZeRO-1: each rank keeps the state of a part of the parameters (whole tensors, balanced by
    size), steps them and broadcasts them to the others. group: the ranks that share them (every
    rank; a pipeline stage's replicas)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    return ZeroRedundancyOptimizer(groups, optimizer_class=cls, process_group=group, **kw)


def local_optimizer(optimizer):
    """The optimizer that holds this rank's state: ZeRO-1's own, or the optimizer itself."""
    return getattr(optimizer, 'optim', optimizer)


def is_sharded(module):
    """Whether FSDP2 slices this module's parameters (fully_shard made it an FSDPModule). Not
    whether they are DTensors now: under --shard gradients (reshard_after_forward=False) a forward
    without a backward, validation's, leaves them whole until the next backward."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6: --shard gradients and full are refused there
        return False
    return isinstance(module, FSDPModule)


def reshard(module):
    """Every FSDP2 unit of the module back to its slices (a no-op where they are), so that its
    state dict holds each rank's slices and its whole parameters are freed."""
    for m in module.modules():
        if is_sharded(m):
            m.reshard()


def _is_dtensor(t):
    return isinstance(t, DTensor)


@contextmanager
def no_sync(model):
    """Gradients accumulate on this rank without a collective (the micro-batches of --accum-steps
    before the last): DDP's no_sync(), FSDP2's set_requires_gradient_sync(False). FSDP2 then holds
    whole gradients until the last micro-batch, as DDP does: the same sums in the same order."""
    if not hasattr(model, 'set_requires_gradient_sync'):
        with model.no_sync():
            yield
        return
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def optimizer_state(optimizer):
    """The optimizer's state dict in torch's one-process form (state by parameter index), for a
    one-file checkpoint (--shard none and optimizer; FSDP2's slices go to a sharded one): ZeRO-1's
    parts consolidated on rank 0 (None elsewhere). Every rank calls it."""
    if hasattr(optimizer, 'consolidate_state_dict'):
        optimizer.consolidate_state_dict(to=0)
        return optimizer.state_dict() if tdist.get_rank() == 0 else None
    return optimizer.state_dict()


def sharded_state(module, optimizer):
    """{'model', 'optimizer'}: the state dicts of a sliced model and its optimizer as they are,
    each rank's slices (DTensors, keyed by parameter name), for torch.distributed.checkpoint.
    Every rank calls it. Buffers are whole on every rank but each rank's own (FSDP2 does not
    broadcast them as DDP does): DCP would keep any one rank's copy, so each is replaced by rank
    0's, a copy (the ranks' own stay as they are), and rank 0's BatchNorm statistics are saved, as
    under DDP."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    reshard(module)
    model, optim = get_state_dict(module, optimizer)
    for key, value in model.items():
        if isinstance(value, torch.Tensor) and not _is_dtensor(value):
            value = value.detach().clone()
            tdist.broadcast(value, src=0)
            model[key] = value
    return {'model': model, 'optimizer': optim}


def part_of(module, state):
    """A whole model's state dict as this rank's module holds it: a pipeline stage's entries
    (dist.pipeline keeps the whole model's names), or all of it."""
    if not getattr(module, 'piped', False):
        return state
    mine = module.state_dict()
    return {k: v for k, v in state.items() if k in mine}


def load_model_state(module, state):
    """Load a whole state dict (any world size, any mode wrote it) into this rank's module: each
    parameter's slice is cut as FSDP2 cuts it, a pipeline stage's part taken."""
    state = part_of(module, state)
    if is_sharded(module):
        reshard(module)
        mine = module.state_dict()
        state = {k: _slice_like(v, mine[k]) if k in mine else v for k, v in state.items()}
    module.load_state_dict(state)


def _slice_like(value, like):
    """A whole tensor as the DTensor `like` is laid out (this rank's slice; no communication)."""
    from torch.distributed.tensor import distribute_tensor
    if not _is_dtensor(like) or not isinstance(value, torch.Tensor) or value.shape != like.shape:
        return value
    mesh = like.device_mesh
    return distribute_tensor(value.to(mesh.device_type), mesh, like.placements,
                             src_data_rank=None)


def optimizer_state_for(optimizer, state):
    """A one-process optimizer state dict made ready for this rank's optimizer: FSDP2's moments cut
    to their parameter's slice (ZeRO-1's load_state_dict keeps its own part by itself)."""
    params = [p for g in optimizer.param_groups for p in g['params']]
    if not any(_is_dtensor(p) for p in params):
        return state
    cut = {i: {k: _slice_like(v, params[i]) for k, v in s.items()}
           for i, s in state['state'].items()}
    return {**state, 'state': cut}


def state_bytes(model, optimizer):
    """This rank's model states as stored: {'parameters', 'gradients', 'optimizer', 'model_states'}
    in bytes, each tensor counted by its own (local) elements."""
    def size(t):
        t = t.to_local() if _is_dtensor(t) else t
        return t.numel() * t.element_size()
    params = list(model.parameters())
    local = local_optimizer(optimizer)
    out = {'parameters': sum(size(p) for p in params),
           'gradients': sum(size(p.grad) for p in params if p.grad is not None),
           'optimizer': sum(size(v) for s in local.state.values() for v in s.values()
                            if isinstance(v, torch.Tensor))}
    out['model_states'] = sum(out.values())
    return out


class StateMeter:
    """This rank's model states, counted once, just after the first optimizer step that ran (its
    state then exists, the gradients are not yet cleared): an optimizer hook, nothing in the step.
    """

    def __init__(self, model, optimizer):
        self.model, self.optimizer, self.bytes = model, optimizer, None
        self._hook = local_optimizer(optimizer).register_step_post_hook(self._count)

    def _count(self, *_):
        self.bytes = state_bytes(self.model, self.optimizer)
        self._hook.remove()


def most_batches(run, max_batches=None):
    """Validation under --shard gradients or full: each forward gathers parameters from every rank,
    and each rank evaluates its own unpadded part of the validation set, so the ranks may have a
    batch more or less. -> the most batches a rank runs (a collective: every rank calls it before
    its first batch); 0 where the model is not sliced."""
    if not is_sharded(run.model_without_ddp):
        return 0
    mine = min(len(run.data.val_loader), max_batches or len(run.data.val_loader))
    most = torch.tensor([mine], device=run.device)
    tdist.all_reduce(most, op=tdist.ReduceOp.MAX)
    return int(most.item())


def blank_forwards(model, n, run):
    """n forwards of a blank image, discarded: a rank out of validation batches keeps gathering in
    step with the ranks still validating (most_batches)."""
    size = run.args.val_image_size
    blank = torch.zeros((1, 3, size, size), device=run.device)
    for _ in range(n):
        with run.autocast:
            model(blank)
