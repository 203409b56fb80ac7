"""The training recipe: the optimizer and its parameter groups, the learning-rate schedule, and the
exponential moving average (EMA) of the weights.

- Optimizers: torch's SGD and AdamW (fused on a GPU, SGD with foreach over FSDP2's sharded
  parameters: choices.optimizer_kernels); LARS, LAMB and Lion from timm, imported only when
  chosen (timm's import takes seconds).
- Weight decay goes to every parameter unless --no-wd-norm-bias, which gives the BatchNorm weights and all
  biases (the 1-D parameters) their own group without decay. LARS and LAMB leave that group out of their
  layer-wise adaptation too, as published (You et al. 2017, 2019): timm adapts a group when its weight decay
  is non-zero or its 'always_adapt' is set, so the decayed group gets always_adapt and the other none.
- Schedules are functions of the optimizer step: onecycle (torch's), cosine, poly and constant, the last
  three after --warmup-epochs of linear warm-up.
- The LR range test (--findlr): the sweep and its suggested learning rate.
"""
import copy
import inspect
import math

import torch
import torch.nn as nn

from dlojzlib import compat
from dlojzlib.dist import launch, shard
from dlojzlib.errors import Preempted
from dlojzlib.flags import ADAPTIVE, BASE_LR  # noqa: F401 (beside the flags, which read them without torch)


def param_groups(model, wd, wd_norm_bias=True, adaptive=False):
    """-> optimizer parameter groups: one with every parameter, or (without wd_norm_bias) the
    weights of convolutions and linear layers with `wd`, then the 1-D parameters (norm weights,
    biases) without. adaptive: the groups carry timm's always_adapt (LARS, LAMB)."""
    group = lambda params, decay, adapt: {'params': params, 'weight_decay': decay,
                                          **({'always_adapt': adapt} if adaptive else {})}
    params = [p for p in model.parameters() if p.requires_grad]
    if wd_norm_bias:
        return [group(params, wd, True)]
    flat = [p for p in params if p.ndim <= 1]
    return ([group([p for p in params if p.ndim > 1], wd, True)]
            + ([group(flat, 0.0, False)] if flat else []))


def build_optimizer(args, model, lr, choice):
    """-> the optimizer of --optimizer over `model`'s parameter groups; with --shard optimizer,
    ZeRO-1's around it (each rank keeps and steps a part of the state). choice: the device's
    choices.Choices, which pick its kernels (fused, foreach; implementation() says which)."""
    groups = param_groups(model, args.wd, args.wd_norm_bias, args.optimizer in ADAPTIVE)
    # ZeRO-1 over every rank, or a pipeline stage's replicas (dist.pipeline)
    replicas = getattr(model, 'replica_group', None)
    make = (lambda cls, groups, **kw: shard.zero_optimizer(cls, groups, replicas, **kw)) \
        if getattr(args, 'shard', 'none') == 'optimizer' else \
        lambda cls, groups, **kw: cls(groups, **kw)
    dtensors = any(isinstance(p, shard.DTensor) for p in model.parameters())  # FSDP2's
    on_host = getattr(args, 'cpu_offload', False)
    if args.optimizer in ('sgd', 'adamw'):
        kernels = choice.optimizer_kernels(args.optimizer, dtensors, on_host)
        if args.optimizer == 'sgd':
            return zero_momentum(make(torch.optim.SGD, groups, lr=lr, momentum=args.mom, **kernels))
        return make(torch.optim.AdamW, groups, lr=lr, betas=(args.mom, 0.999), **kernels)
    from timm import optim as timm_optim  # seconds to import: only when asked for
    cls = {'lars': timm_optim.Lars, 'lamb': timm_optim.Lamb,
           'lion': timm_optim.Lion}[args.optimizer]
    kw = {'momentum': args.mom} if args.optimizer == 'lars' else \
        {'betas': (args.mom, 0.999 if args.optimizer == 'lamb' else 0.99)}
    kernels = choice.optimizer_kernels(args.optimizer, dtensors, on_host, has_foreach(cls))
    return make(cls, groups, lr=lr, **kw, **kernels)


def implementation(optimizer):
    """How the optimizer updates the parameters, for the run's header: 'fused' (one kernel for
    all), 'foreach' (multi-tensor ops), or torch's default for the device (per-parameter on a CPU,
    foreach for CUDA tensors)."""
    defaults = shard.local_optimizer(optimizer).defaults
    return 'fused' if defaults.get('fused') else 'foreach' if defaults.get('foreach') else \
        "torch's default"


def zero_momentum(optimizer):
    """SGD with its momentum buffers set to zero before the first step -> optimizer.

    torch's fused SGD allocates them uninitialised (empty_like) at its first step and tells the
    kernel to fill them with the gradient; when fp16's GradScaler finds an inf in that step (usual
    at the initial scale of 65536), the kernel skips, and every later step reads the uninitialised
    memory: NaN within a few steps (ResNet-18, H100, torch 2.11). A zero buffer gives the first
    step's own rule, momentum x 0 + gradient = gradient (dampening is 0), bit for bit, on every
    implementation, and a skipped step leaves it zero. ZeRO-1: the buffers of this rank's part."""
    local = shard.local_optimizer(optimizer)
    for group in local.param_groups:
        assert group['dampening'] == 0, 'the zero buffer equals the first-step rule only without dampening'
        if group['momentum']:
            for p in group['params']:
                local.state[p]['momentum_buffer'] = torch.zeros_like(p)
    return optimizer


def has_foreach(cls):
    """Whether this timm optimizer has a multi-tensor path, which a GPU run asks for
    (choices.optimizer_kernels): a few launches per parameter group per step instead of several
    per parameter (~2 000 for ResNet-50 with LARS's Python loop). Lion has one from timm 0.9 (off
    unless asked for until timm made it the CUDA default); LARS and LAMB from timm 1.0.31 (1.0.29
    and 1.0.30 have none). Asked for explicitly, since older timm defaults it off."""
    return 'foreach' in inspect.signature(cls.__init__).parameters


def scaler_sync_warning(optimizer, amp):
    """The sentence for summary.json's warnings when fp16's GradScaler makes the host wait for the
    GPU at every step: an optimizer that does not declare `_step_supports_amp_scaling` (timm's LARS,
    LAMB, Lion; torch's non-fused ones) gets its gradients unscaled by the scaler, which then reads
    found_inf with .item() to decide whether to step. None when there is no such wait."""
    if amp != 'fp16' or compat.fuses_amp_scaling(optimizer):
        return None
    return (f'--amp fp16 with {type(optimizer).__name__}: the loss scaler reads the inf/NaN flag '
            f'on the host at every step (a GPU synchronisation; only fused optimizers take it on '
            f'the device); use --amp bf16 where the GPU has it (compute capability 8.0+), or '
            f'--optimizer sgd/adamw.')


def lr_factor(schedule, step, warmup, total, power=2.0):
    """The multiplier of the peak LR at optimizer step `step` (0-based) of `total`, after `warmup`
    steps of linear warm-up: cosine to 0, poly (1 - t)^power to 0, or constant."""
    if step < warmup:
        return (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == 'cosine':
        return 0.5 * (1 + math.cos(math.pi * t))
    if schedule == 'poly':
        return (1 - t) ** power
    return 1.0


def build_optimization(args, model, steps_per_epoch, total_steps, choice):
    """-> (criterion, optimizer, scheduler, scaler); model: the plain module (its parameters are the
    DDP/compiled model's). steps_per_epoch: optimizer steps. choice: the device's
    choices.Choices."""
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    optimizer = build_optimizer(args, model, 1e-8 if args.findlr else args.lr, choice)
    if args.findlr:  # geometric sweep from 1e-8 to --lr over every step of the run
        mult = (args.lr / 1e-8) ** (1 / max(1, total_steps - 1))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: mult ** s)
    elif args.scheduler == 'onecycle':
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr,
                                                        total_steps=args.epochs * steps_per_epoch)
    else:
        warmup, total = round(args.warmup_epochs * steps_per_epoch), args.epochs * steps_per_epoch
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: lr_factor(args.scheduler, s, warmup, total, args.poly_power))
    scaler = torch.amp.GradScaler('cuda', enabled=args.amp == 'fp16')
    return criterion, optimizer, scheduler, scaler


class EMA:
    """Exponential moving average of a model's parameters and floating-point buffers (BatchNorm
    running statistics), updated on the device after each optimizer step: ema = decay * ema + (1 -
    decay) * model. With warm-up the decay starts low, min(decay, (1 + n) / (10 + n)) after n
    updates (TensorFlow's and timm's rule), so that the average does not drag the random initial
    weights along. Integer buffers (BatchNorm's batch counter) are copied."""

    def __init__(self, model, decay, warmup=True):
        self.module = copy.deepcopy(model).eval()
        for p in self.module.parameters():
            p.requires_grad_(False)
        self.decay, self.warmup, self.updates = decay, warmup, 0
        self._pairs = None  # (model, averaged tensors, model tensors, integer pairs): listed once

    def pairs(self, model):
        if self._pairs is None or self._pairs[0] is not model:
            mine = list(self.module.parameters()) + list(self.module.buffers())
            theirs = [t.detach() for t in list(model.parameters()) + list(model.buffers())]
            floats = [(a, b) for a, b in zip(mine, theirs) if a.is_floating_point()]
            ints = [(a, b) for a, b in zip(mine, theirs) if not a.is_floating_point()]
            self._pairs = (model, [a for a, _ in floats], [b for _, b in floats],
                           [a for a, _ in ints],
                           [b for _, b in ints])
        return self._pairs[1:]

    @torch.no_grad()
    def update(self, model):
        self.updates += 1
        decay = (min(self.decay, (1 + self.updates) / (10 + self.updates)) if self.warmup
                 else self.decay)
        averaged, current, int_mine, int_theirs = self.pairs(model)
        compat.foreach_lerp_(averaged, current, 1 - decay)
        if int_mine:  # BatchNorm's counters: one multi-tensor copy (torch >= 2.1), not one launch per layer
            compat.foreach_copy_(int_mine, int_theirs)

    def state_dict(self):
        return {'module': self.module.state_dict(), 'updates': self.updates, 'decay': self.decay}

    def load_state_dict(self, state):
        self.module.load_state_dict(state['module'])
        self.updates = state['updates']


# ------------------------------------------------------------------------------------------- LR range test
# Fewer steps than this and the suggestion is coarse: over 1e-8..10 (9 decades) 100 steps multiply
# the LR by 1.23 per step, so the steepest point is placed within about a quarter of its value, and
# the divergence test's EMA (beta 0.98: a memory of ~50 steps) has had time to warm up; fastai's LR
# finder also runs 100 by default.
FINDLR_MIN_STEPS = 100


def diverged_at(losses, beta=0.98, explode=4.0):
    """Index of the first loss where the sweep counts as diverged (dlojz's stopping rule: not
    finite, or the bias-corrected EMA of the losses above `explode` x its minimum so far);
    len(losses) if none."""
    avg, best = 0.0, math.inf
    for i, loss in enumerate(losses):
        if not math.isfinite(loss):
            return i
        avg = beta * avg + (1 - beta) * loss
        smoothed = avg / (1 - beta ** (i + 1))
        if smoothed > explode * best:
            return i
        best = min(best, smoothed)
    return len(losses)


def centered_mean(values, half):
    """Moving average over i-h..i+h, the window shrunk symmetrically at the ends: no lag, unlike an
    EMA, which shifts the curve towards larger LRs by its memory (~50 steps at 0.98)."""
    out = []
    for i in range(len(values)):
        h = min(half, i, len(values) - 1 - i)
        out.append(sum(values[i - h:i + h + 1]) / (2 * h + 1))
    return out


def suggest_lr(lrs, losses):
    """The LR range test's suggestion: the LR where the smoothed loss falls fastest per decade of LR (steepest
    descent), searched between the sweep's start and the LR of the smoothed loss's minimum, before the
    divergence. It is one of the swept LRs, so it lies within the sweep by construction; the other common rule,
    the minimum's LR divided by 10, can fall below the sweep's start (it suggested 1e-9 for a sweep from 1e-8)
    and depends on where the noise puts the minimum. The losses are smoothed by a centered moving average over
    ~10% of the sweep (no lag), and the slope is taken across that window.
    -> (suggested lr or None, why): None when the curve has too few points or never descends."""
    n = diverged_at(losses)
    if n < 5:
        return None, f'{n} steps before the divergence: too few to find a descent'
    half = max(1, n // 20)
    sm = centered_mean(losses[:n], half)
    i_min = min(range(n), key=sm.__getitem__)
    logs = [math.log10(lr) for lr in lrs[:n]]
    slopes = {i: (sm[i + half] - sm[i - half]) / (logs[i + half] - logs[i - half])
              for i in range(half, min(i_min + 1, n - half))}
    if not slopes or min(slopes.values()) >= 0:
        return None, 'the smoothed loss never falls: no descent to follow (sweep further, or start higher)'
    i = min(slopes, key=slopes.get)
    return lrs[i], f'steepest descent of the smoothed loss, {-slopes[i]:.3g} per decade of LR'


def find_lr(run, progress, train_step, beta=0.98, explode=4.0):
    """LR range test (Smith 2017): the LR grows geometrically from 1e-8 to --lr over the run's
    steps. The sweep ends at the first non-finite loss or once the smoothed loss (EMA `beta`,
    bias-corrected) passes `explode` x its minimum, as LR finders do. -> the curve up to there:
    {'lr', 'loss', 'steps', 'stopped'}. It reads the rank-mean loss every step (a sync per step:
    this is a measurement, not training). train_step: dlojz.train_step, the step every mode runs."""
    run.model.train()
    lrs, losses, why, avg, best = [], [], 'end of the sweep', 0.0, math.inf

    def curve():
        suggested, reason = suggest_lr(lrs, losses)
        return {'lr': lrs, 'loss': losses, 'steps': len(lrs), 'stopped': why,
                'suggested_lr': suggested,
                'suggestion': reason}

    def batches():  # the sweep crosses epoch boundaries
        for epoch in range(run.args.epochs):
            run.data.set_epoch(epoch)
            yield from run.data.train_steps
    for images, labels in run.chrono.iterate(batches(), run.total_steps):
        lr = run.optimizer.param_groups[0]['lr']
        loss = train_step(run, images, labels)[0]
        loss = launch.all_reduce_(loss.float().clone()).item() / run.dist.world_size
        progress.advance()
        if not math.isfinite(loss):
            why = f'non-finite loss at lr {lr:.3g}'
            break
        avg = beta * avg + (1 - beta) * loss
        smoothed = avg / (1 - beta ** (len(lrs) + 1))
        best = min(best, smoothed)
        lrs.append(lr)
        losses.append(loss)
        if len(lrs) % run.args.log_interval == 0:
            run.log.log(type='findlr', global_step=progress.global_step, lr=lr, loss=loss,
                        smoothed=smoothed)
        if smoothed > explode * best:
            why = f'smoothed loss {smoothed:.3g} passed {explode:g}x its minimum {best:.3g} at lr {lr:.3g}'
            break
        if run.stop.agreed():
            run.chrono.finish()
            run.stop.settle()
            raise Preempted(f'the LR sweep was stopped by '
                            f'{run.stop.received or "a signal on another rank"} at step '
                            f'{progress.global_step}; its curve so far is in summary.json; run it '
                            f'again to sweep further.', findlr=curve())
    run.stop.settle()  # the sweep ended: a signal during its last step changes nothing
    run.chrono.finish()
    run.log.print(f'LR sweep: {len(lrs)} steps, lr {lrs[0] if lrs else 1e-8:.3g} to '
                  f'{lrs[-1] if lrs else 1e-8:.3g}; stopped: {why}')
    result = curve()
    if result['suggested_lr'] is None:
        run.log.print(f'LR sweep: no suggestion ({result["suggestion"]})')
    else:
        run.log.print(f'LR sweep: suggested --lr {result["suggested_lr"]:.3g} '
                      f'({result["suggestion"]})')
    return result
