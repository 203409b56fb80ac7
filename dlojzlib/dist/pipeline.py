"""--pipeline-stages: a model cut at its blocks into stages, one GPU each, run by the schedules of
torch.distributed.pipelining, with data-parallel replicas of every stage (a 2-D mesh; torchtitan's
order, the stages outermost: rank = stage x replicas + replica).

    build(...)          the cut (dist.stages: balanced by time measured here, or by parameters),
                        this rank's part of the model, and a Pipeline
    Pipeline.gradients  a step's gradients: the schedule over the microbatches, the replicas'
                        all-reduce (dlojz.train_step then steps the optimizer)
    Pipeline.forward    validation: each batch through the stages in turn (sends and receives)

Each rank keeps the model with the parts it does not run replaced by nn.Identity (or None for a
bare parameter), so that its state dict holds its parameters under their whole-model names: the
stages' checkpoints put together are a one-process checkpoint. `--pipeline-stages 1
--microbatches M` runs the same microbatches in one process without torch's schedules: the
reference the pipelines are held to (tests/test_pipeline.py).

The loss of each microbatch is divided by M before its backward, and torch's own gradient scaling
is off (torch 2.4 sums the microbatches' gradients, later ones divide by M unless told not to):
the gradients are the mean over the step's images on every torch.
"""
import dataclasses
import inspect
import statistics
import time

import torch
import torch.distributed as tdist
import torch.nn as nn

from dlojzlib.dist import launch, shard, stages


def wanted(args):
    """Whether the steps go through a Pipeline: stages, or microbatches in one process."""
    return args.pipeline_stages > 1 or args.microbatches > 1


def data_view(dist, replicas):
    """The launch as the data path sees it: a pipeline's stages read their replica's batches (all
    of them: the first stage its images, the last its labels)."""
    if replicas == dist.world_size:
        return dist
    return dataclasses.replace(dist, rank=dist.rank % replicas, world_size=replicas)


# ------------------------------------------------------------------------------------ the cut

class Family:
    """How a kind of model runs around its blocks: `first` names the model's own parts (modules
    or parameters) its head runs before them; the others, but the blocks' container, run after
    them (its tail). blocks(model): [(name, block)] in order."""

    def __init__(self, first, head, tail, blocks):
        self.first, self.head, self.tail, self.blocks = first, head, tail, blocks


def _vit_head(m, x):
    x = m.patch_embed(x)
    x = m._pos_embed(x)
    return m.norm_pre(m.patch_drop(x))


def _tail(m, x):
    return m.forward_head(m.norm(x))


def family(model):
    """-> the Family of timm's ViTs and CoAtNets (MaxxVit), or None for any other model."""
    from timm.models.maxxvit import MaxxVit
    from timm.models.vision_transformer import VisionTransformer
    if isinstance(model, VisionTransformer):
        return Family(('patch_embed', 'cls_token', 'reg_token', 'pos_embed', 'pos_drop',
                       'patch_drop', 'norm_pre'), _vit_head, _tail,
                      lambda m: [(f'blocks.{i}', b) for i, b in enumerate(m.blocks)])
    if isinstance(model, MaxxVit):
        return Family(('stem',), lambda m, x: m.stem(x), _tail,
                      lambda m: [(f'stages.{i}.blocks.{j}', b) for i, s in enumerate(m.stages)
                                 for j, b in enumerate(s.blocks)])
    return None


def _owned(model, names):
    """Parameters and buffers of the model's own parts `names` (those it has)."""
    out = []
    for name in names:
        part = getattr(model, name, None)
        if isinstance(part, nn.Module):
            out += [*part.parameters(), *part.buffers()]
        elif isinstance(part, torch.Tensor):
            out.append(part)
    return out


class Part(nn.Module):
    """One stage: the model's head when it is the first, blocks[lo:hi], its tail when it is the
    last. Registers nothing: the rank's model holds the parameters, under their names."""

    def __init__(self, model, fam, blocks, first, last):
        super().__init__()
        self.__dict__.update(_model=model, _fam=fam, _blocks=blocks, first=first, last=last)

    def forward(self, x):
        if self.first:
            x = self._fam.head(self._model, x)
        for b in self._blocks:
            x = b(x)
        return self._fam.tail(self._model, x) if self.last else x


def prune(model, fam, bounds, mine):
    """Keep the stages `mine` (indices into bounds' runs) of the model in place; every other
    block and part becomes nn.Identity (a bare parameter None) -> the Parts, in stage order."""
    blocks = fam.blocks(model)
    last = len(bounds) - 2
    keep = {i for k in mine for i in range(bounds[k], bounds[k + 1])}
    for i, (name, _) in enumerate(blocks):
        if i not in keep:
            parent, _, attr = name.rpartition('.')
            setattr(model.get_submodule(parent), attr, nn.Identity())
    for name in [*fam.first, *_last(model, fam)]:
        if not hasattr(model, name) or getattr(model, name) is None:
            continue
        if (0 if name in fam.first else last) not in mine:
            setattr(model, name, None if isinstance(getattr(model, name), nn.Parameter)
                    else nn.Identity())
    return [Part(model, fam, [b for _, b in blocks[bounds[k]:bounds[k + 1]]], k == 0, k == last)
            for k in mine]


def _last(model, fam):
    """Names of the model's own parts run after the blocks: all but the first's and the blocks'."""
    container = fam.blocks(model)[0][0].split('.')[0]
    return [n for n, _ in [*model.named_children(), *model.named_parameters(recurse=False)]
            if n not in fam.first and n != container]


def measure(model, fam, x, device, autocast, reps):
    """Each piece of the model (its head, every block, its tail) run forward and backward on
    `device` in turn, its parameters moved there and back (the whole model need not fit) ->
    (seconds per piece: the median of `reps` runs after a first one, 0 without reps; the output
    shape, dtype and strides of each piece). The RNG is left as it was."""
    blocks = [b for _, b in fam.blocks(model)]
    pieces = [lambda h: fam.head(model, h), *blocks, lambda h: fam.tail(model, h)]
    owned = [_owned(model, fam.first), *[[*b.parameters(), *b.buffers()] for b in blocks],
             _owned(model, _last(model, fam))]
    sync = torch.cuda.synchronize if device.type == 'cuda' else (lambda: None)
    costs, shapes = [], []
    with torch.random.fork_rng(devices=[device] if device.type == 'cuda' else []):
        h = x.to(device)
        for piece, tensors in zip(pieces, owned):
            saved = [t.data for t in tensors]
            for t in tensors:
                t.data = t.data.to(device)
            times = []
            for _ in range(1 + reps):
                inp = h.detach().requires_grad_(h.is_floating_point())
                sync()
                t0 = time.perf_counter()
                with autocast:
                    out = piece(inp)
                out.float().sum().backward()
                sync()
                times.append(time.perf_counter() - t0)
            for t, d in zip(tensors, saved):
                t.data, t.grad = d, None
            costs.append(statistics.median(times[1:]) if reps else 0.0)
            # the strides too: torch 2.4's stages hold the tensors they are given to their
            # examples' strides, and a channels-last run's activations lie channels-last
            shapes.append((tuple(out.shape), out.dtype, tuple(out.stride())))
            h = out.detach()
    return costs, shapes


def piece_params(model, fam):
    """Parameters of each piece (head, blocks, tail): the cost --pipeline-split params balances."""
    count = lambda ts: sum(t.numel() for t in ts if isinstance(t, nn.Parameter))
    return [count(_owned(model, fam.first)),
            *[count(b.parameters()) for _, b in fam.blocks(model)],
            count(_owned(model, _last(model, fam)))]


def batchnorm_note(model, arch, batch, microbatches):
    """What microbatches change in a model with BatchNorm (a CoAtNet's MBConv stages): a
    sentence, or None."""
    n = sum(isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm))
            for m in model.modules())
    if not n or microbatches == 1:
        return None
    return (f'Note: --arch {arch} has {n} BatchNorm layers: under --microbatches {microbatches} '
            f'each normalises over microbatches of {batch // microbatches} images, not -b {batch}, '
            f'and updates its running statistics {microbatches} times a step.')


def block_costs(costs):
    """Costs per piece (head, blocks, tail) -> per block: the head counts with the first block and
    the tail with the last, which always go to the first and last stage."""
    blocks = list(costs[1:-1])
    blocks[0] += costs[0]
    blocks[-1] += costs[-1]
    return blocks


def plan_cut(split, costs, parts):
    """-> bounds over the blocks, from --pipeline-split's block numbers or balancing
    block_costs(costs)."""
    if isinstance(split, tuple):
        return stages.bounds_of(split, len(costs) - 2, parts)
    return stages.balance(block_costs(costs), parts)


# ------------------------------------------------------------------------------------ the mesh

def mesh(device, n_stages, replicas):
    """The 2-D mesh (stages x replicas; rank = stage x replicas + replica) -> (this rank's
    pipeline group, its stage's replicas' group, their 1-D mesh: FSDP2's)."""
    from torch.distributed.device_mesh import init_device_mesh
    m = init_device_mesh(device.type, (n_stages, replicas), mesh_dim_names=('pp', 'dp'))
    return m.get_group('pp'), m.get_group('dp'), m['dp']


def _schedule(name, parts, microbatches, loss_fn):
    from torch.distributed import pipelining as pp
    cls = {'gpipe': pp.ScheduleGPipe, '1f1b': pp.Schedule1F1B,
           'interleaved': pp.ScheduleInterleaved1F1B}[name]
    # torch 2.4 has no scale_grads and sums the microbatches' gradients; the loss is divided here
    kw = {'scale_grads': False} if 'scale_grads' in inspect.signature(cls).parameters else {}
    return cls(parts if name == 'interleaved' else parts[0], microbatches, loss_fn=loss_fn, **kw)


# ------------------------------------------------------------------------------------ the run

class Pipeline(nn.Module):
    """This rank's stages and how they run. As a module, it is validation's model: forward(x)
    sends each batch through the stages (-> the logits on the last stage's ranks, None elsewhere).
    """

    def __init__(self, model, parts, ids, n_total, layout, microbatches, device, shapes,
                 schedule=None, groups=(None, None)):
        super().__init__()
        self.model = model
        self.__dict__.update(parts=parts, ids=ids, criterion=None)
        self.n_total, self.microbatches, self.device = n_total, microbatches, device
        # each local stage's (input, output) (shape, dtype, strides) of a microbatch
        self.shapes = shapes
        self.ranks, self.replicas, self.rank_in_pipe, self.replica = layout
        self.first, self.last = ids[0] == 0, ids[-1] == n_total - 1
        self.pp, self.dp = groups
        # one stage: no schedule; measure.bubble times the stages' chunks
        self.schedule, self.stages = None, []
        if schedule is not None:
            from torch.distributed.pipelining import PipelineStage
            # torch 2.4 needs example tensors (and would run a forward for the outputs'); later
            # ones learn the shapes from the first microbatch, and take given ones as static
            # metadata that does not ask for gradients
            examples = 'output_grads' not in inspect.signature(PipelineStage).parameters
            made = []
            for part, k, (shape_in, shape_out) in zip(parts, ids, shapes):
                empty = lambda s: torch.empty_strided(s[0], s[2], dtype=s[1], device=device)
                kw = dict(input_args=empty(shape_in), output_args=empty(shape_out)) if examples \
                    else {}
                stage = PipelineStage(part, k, n_total, device, group=self.pp, **kw)
                made.append(stage)
            self.stages, self.schedule = made, _schedule(schedule, made, microbatches, self._loss)

    def _loss(self, output, target):
        # each microbatch's mean loss over M: the step's gradient is the mean over its images
        return self.criterion(output, target) / self.microbatches

    def state(self, optimizer):
        """{'model', 'optimizer'} of this rank's stages for a torch.distributed.checkpoint folder:
        the parameters under their whole-model names (the stages' together are the whole model's),
        the optimizer's state as torch keeps it, under this rank's place in the pipeline (the
        replicas write the same; DCP keeps one)."""
        shard.reshard(self.model)  # FSDP2's slices over the replicas, as DCP writes them
        if hasattr(optimizer, 'consolidate_state_dict'):  # ZeRO-1: the stage's first replica's
            optimizer.consolidate_state_dict(to=0)
            if self.replica != 0:
                return {'model': self.model.state_dict()}
        return {'model': self.model.state_dict(),
                'optimizer': {f'pipe{self.rank_in_pipe}': optimizer.state_dict()}}

    def optimizer_part(self, state):
        """This rank's optimizer state from a pipeline checkpoint's (the same cut: a resume keeps
        it) -> torch's one-process form."""
        mine = state.get(f'pipe{self.rank_in_pipe}') if 'param_groups' not in state else None
        if mine is None:
            raise KeyError(f'pipe{self.rank_in_pipe}')
        return {**mine, 'state': {int(k): v for k, v in mine.get('state', {}).items()}}

    def _global(self, pipe_rank):
        return pipe_rank * self.replicas + self.replica

    def gradients(self, run, images, labels, to_device):
        """A step's forwards and backwards, its gradients averaged over the replicas (the caller
        steps the optimizer) -> (the step's mean loss on every rank, the logits on the last
        stage's ranks (None elsewhere), the labels)."""
        with run.chrono.phase('h2d'):
            if self.first:
                x, y = to_device(images, labels, run)
            else:
                y = labels.to(self.device, non_blocking=run.args.non_blocking)
        losses, outputs = [], []
        self.criterion = run.criterion
        with run.autocast:
            if self.schedule is None:  # one stage: the microbatches one after the other
                for xk, yk in zip(x.chunk(self.microbatches), y.chunk(self.microbatches)):
                    out = self.parts[0](xk)
                    loss = self._loss(out, yk)
                    loss.backward()
                    losses.append(loss.detach())
                    outputs.append(out.detach())
                output = torch.cat(outputs)
            else:
                last = {'target': y, 'losses': losses} if self.last else {}
                output = self.schedule.step(*((x,) if self.first else ()), **last)
        loss = self.share_loss(losses)
        # the replicas' all-reduce, timed with the step after it; a wait for the transfer and for
        # the last replica in (measure.comm: a slow replica is a straggler). The replicas' first
        # meeting in a step: the guard's all-reduce after it finds them together
        with run.chrono.phase('optimizer'):
            comm = run.chrono.comm
            if comm is not None and self.replicas > 1 and not shard.is_sharded(self.model):
                comm.wait(self._average_gradients)
            else:
                self._average_gradients()
        run.guard.observe(loss)  # before the optimizer: on CPU a non-finite loss is never applied
        return loss, (output.detach() if self.last else None), y

    def share_loss(self, losses):
        """The step's loss, from the last stage to every stage's ranks, which log it and watch
        it (one scalar). The schedule's span ends here: the last stage, done first, waits in this
        all-reduce while the first stage drains the pipeline (measure.bubble)."""
        loss = torch.stack([v.detach() for v in losses]).sum() if self.last else \
            torch.zeros((), device=self.device)
        if self.ranks > 1:
            tdist.all_reduce(loss, group=self.pp)
        return loss

    def _average_gradients(self):
        """The replicas' gradients averaged, as DDP does (divided, then summed), in one
        all-reduce per step."""
        if self.replicas == 1 or shard.is_sharded(self.model):  # FSDP2 reduce-scatters them itself
            return
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads]).div_(self.replicas)
        tdist.all_reduce(flat, group=self.dp)
        for g, v in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(v.view_as(g))

    def forward(self, x):
        n = x.shape[0]
        h = x
        for k in range(self.n_total):
            owner = k % self.ranks
            if owner != self.rank_in_pipe:
                continue
            i = self.ids.index(k)
            if k > 0 and (k - 1) % self.ranks != owner:
                shape, dtype, _ = self.shapes[i][0]  # sent contiguous
                h = torch.empty((n, *shape[1:]), dtype=dtype, device=self.device)
                tdist.recv(h, src=self._global((k - 1) % self.ranks), group=self.pp)
            h = self.parts[i](h)
            if k < self.n_total - 1 and (k + 1) % self.ranks != owner:
                tdist.send(h.contiguous(), dst=self._global((k + 1) % self.ranks), group=self.pp)
        return h if self.last else None


def build(args, model, device, dist, autocast, say=print, cut=None, comm=None):
    """--pipeline-stages S --microbatches M over this run's ranks -> the Pipeline of this rank,
    its model moved to `device` (the parts it does not run never go there). The cut: a resumed
    checkpoint's (`cut`, its stages hold their blocks' optimizer state), else the one
    --pipeline-split gives, or balanced by the time each piece takes forward and backward on rank
    0's device (or by parameters); it is printed, and kept in the checkpoints. comm: the
    measure.comm.CommTimer that times FSDP2's waits on each stage's replicas (--shard)."""
    from dlojzlib.errors import UsageError
    n_ranks, schedule = args.pipeline_stages, args.pipeline_schedule
    virtual = stages.VIRTUAL[schedule] if n_ranks > 1 else 1
    n_total, world = n_ranks * virtual, dist.world_size
    fam = family(model)
    if fam is None:
        raise UsageError(f'--pipeline-stages cuts timm\'s ViTs and CoAtNets at their blocks, and '
                         f'--arch {args.arch} is neither; use --arch timm:vit_base_patch16_224 or '
                         f'coatnet7.')
    n_blocks = len(fam.blocks(model))
    if n_blocks < n_total:
        raise UsageError(f'--arch {args.arch} has {n_blocks} blocks, too few for {n_total} stages; '
                         f'lower --pipeline-stages.')
    split, mb = stages.parse_split(args.pipeline_split), args.batch_size // args.microbatches
    note = batchnorm_note(model, args.arch, args.batch_size, args.microbatches)
    if note:
        say(note)
    replicas = world // n_ranks
    rank_in_pipe, replica = (dist.rank // replicas, dist.rank % replicas) if dist.distributed \
        else (0, 0)
    ids = [rank_in_pipe + i * n_ranks for i in range(virtual)]
    if cut is not None and (len(cut) != n_total + 1 or cut[-1] != n_blocks):
        raise UsageError(f'the checkpoint holds a pipeline of {len(cut) - 1} stages (cut at blocks '
                         f'{",".join(map(str, cut[1:-1]))}) and this run makes {n_total}; resume '
                         f'with the --pipeline-stages and --pipeline-schedule it was written with.')
    costs, shapes = [0.0] * (n_blocks + 2), None
    # the layout the run's batches reach the stages in (datasets.to_device)
    fmt = torch.channels_last if args.channels_last else torch.contiguous_format
    if n_total > 1:  # the shapes between stages always; the time only where it chooses the cut
        reps = 3 if split == 'time' and cut is None else 0

        def probe():
            x = torch.randn(mb, 3, args.image_size, args.image_size,
                            generator=torch.Generator().manual_seed(0))
            x = x.contiguous(memory_format=fmt)
            costs, shapes = measure(model, fam, x, device, autocast, reps)
            return piece_params(model, fam) if split == 'params' else costs, shapes
        costs, shapes = launch.broadcast_object(launch.on_ranks(probe, when=dist.is_main))
    try:
        bounds = list(cut) if cut is not None else \
            plan_cut(split, costs, n_total) if n_total > 1 or isinstance(split, tuple) \
            else [0, n_blocks]
    except ValueError as e:  # --pipeline-split's numbers against this model's blocks
        raise UsageError(str(e)) from None
    if n_total > 1:
        say(cut_line(args, bounds, costs, 'checkpoint' if cut is not None else split, replicas,
                     mb, virtual))
    parts = prune(model, fam, bounds, ids)
    kept = [b for k in ids for _, b in fam.blocks(model)[bounds[k]:bounds[k + 1]]]
    if virtual == 1:  # the model runs its one stage itself: FSDP2's root sees its forward
        model.forward = parts[0].forward
        parts = [model]
    # its ranks hold different parts: launch.broadcast_buffers_, record.state's checkpoints
    model.piped = n_total > 1
    model.to(device)
    stage_shapes = None
    if shapes is not None:
        x = torch.empty(mb, 3, args.image_size, args.image_size, device='meta', memory_format=fmt)
        image = (tuple(x.shape), torch.float32, x.stride())
        stage_shapes = [(image if k == 0 else shapes[bounds[k]],
                         shapes[-1] if k == n_total - 1 else shapes[bounds[k + 1]]) for k in ids]
    pp = dp = dp_mesh = None
    if dist.distributed:
        pp, dp, dp_mesh = mesh(device, n_ranks, replicas)
    if args.shard in shard.FSDP_MODES:  # each stage's blocks sliced over its replicas
        shard.apply_fsdp(model, kept, device, args.shard == 'full', False, comm, dp_mesh)
    model.replica_group = dp  # --shard optimizer: ZeRO-1 over them (recipe.build_optimizer)
    pipe = Pipeline(model, parts, ids, n_total, (n_ranks, replicas, rank_in_pipe, replica),
                    args.microbatches, device, stage_shapes,
                    schedule if n_ranks > 1 else None, (pp, dp))
    pipe.cut = bounds
    return pipe


def cut_line(args, bounds, costs, split, replicas, mb, virtual):
    """The cut, as the run's header prints it."""
    how = {'time': 'by the time of each block forward and backward here',
           'params': 'by parameters', 'checkpoint': 'as the checkpoint was'}.get(
        split, 'as --pipeline-split gives')
    blocks = block_costs(costs)
    unit = (lambda v: f'{v * 1e3:.1f} ms') if split == 'time' else \
        (lambda v: f'{v / 1e6:.2f} M parameters') if split == 'params' else (lambda v: '')
    runs = [f'stage {k}: blocks {a}-{b - 1}' + (f' {unit(sum(blocks[a:b]))}' if unit(0) else '')
            for k, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    share = stages.bubble(args.pipeline_schedule, args.pipeline_stages, args.microbatches)
    return (f'Pipeline: {args.pipeline_stages} stages x {replicas} replica(s), '
            f'{args.pipeline_schedule}, {args.microbatches} microbatches of {mb} images; cut '
            f'{how}: ' + '; '.join(runs) + f'. The schedule idles {share:.1%} of each step with '
            f'equal stages ((S-1)/({"2" if virtual == 2 else ""}M+S-1)).')
