"""The recipe flags: the parameter groups counted by hand on torchvision's ResNet-18, LARS's update
against the published formula (and its norm/bias group left unadapted), the schedules against their
formulas, each optimizer training, the EMA against a hand-rolled average.

Run: python -m pytest -q tests/test_recipe.py"""
import math
from argparse import Namespace

import pytest
import torch
import torch.nn as nn
import torchvision

from conftest import TINY, run_main
import dlojz
from dlojzlib import choices
from dlojzlib import flags
from dlojzlib import recipe as R


def test_no_wd_norm_bias_groups_by_hand():
    model = torchvision.models.resnet18(num_classes=10)
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    decay, flat = R.param_groups(model, 5e-5, wd_norm_bias=False)
    assert len(flat['params']) == 2 * len(bns) + 1 and flat['weight_decay'] == 0  # BN weight and bias, fc.bias
    assert len(decay['params']) == len(convs) + 1 and decay['weight_decay'] == 5e-5  # conv weights, fc.weight
    everything, = R.param_groups(model, 5e-5)
    assert len(everything['params']) == len(list(model.parameters()))


def lars_step(wd_norm_bias, lr=0.5, wd=1e-4):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    nn.CrossEntropyLoss()(model(torch.randn(5, 3, 8, 8)), torch.tensor([0, 1, 2, 0, 1])).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    args = Namespace(optimizer='lars', wd=wd, wd_norm_bias=wd_norm_bias, mom=0.9)
    R.build_optimizer(args, model, lr, choices.choose('cpu')).step()
    return before, grads, dict(model.named_parameters())


def test_lars_follows_the_published_update_and_leaves_norm_and_bias_alone():
    """You et al. 2017: local lr = trust * ||w|| / (||g|| + wd ||w||), applied to g + wd w (trust
    0.001, first step: momentum buffer = the update). BatchNorm weights and biases take a plain SGD
    step."""
    lr, wd = 0.5, 1e-4
    before, grads, after = lars_step(False, lr, wd)
    for name in before:
        w, g = before[name], grads[name]
        if w.ndim > 1:
            ratio = 0.001 * w.norm() / (g.norm() + wd * w.norm() + 1e-8)
            want = w - lr * ratio * (g + wd * w)
        else:
            want = w - lr * g
        torch.testing.assert_close(after[name].detach(), want, rtol=1e-5, atol=1e-7, msg=name)
    _, _, adapted = lars_step(True, lr, wd)  # every group adapted: the biases move differently, so the check bites
    assert not torch.allclose(adapted['3.bias'], before['3.bias'] - lr * grads['3.bias'])


def test_sgd_survives_a_first_step_that_fp16s_scaler_skips():
    """fp16's GradScaler hands the fused SGD its inf flag; an inf in the first step (usual at the
    initial scale) makes the kernel skip. torch's fused SGD had allocated its momentum buffers
    uninitialised for that step and reads them from then on: NaN on an H100 (torch 2.11). Here the
    CPU's fused kernel stands in (the optimizer built with a GPU's choices), and deterministic mode
    fills uninitialised memory with NaN, so the defect shows on every run. Expected: torch's plain
    SGD after one step with the same gradients, bit for bit."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    reference = nn.Linear(3, 2)
    reference.load_state_dict(model.state_dict())
    x = torch.randn(4, 3)
    for m in (model, reference):
        m(x).square().sum().backward()
    args = Namespace(optimizer='sgd', wd=1e-4, wd_norm_bias=True, mom=0.9)
    optimizer = R.build_optimizer(args, model, 0.1, choices.choose('cuda', (9, 0)))
    assert all(group['fused'] for group in optimizer.param_groups)
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)  # torch.empty* filled with NaN
    try:
        for inf in (1.0, 0.0):  # the step the scaler skips, then a finite one
            optimizer.found_inf = torch.tensor(inf)
            optimizer.step()
    finally:
        torch.use_deterministic_algorithms(deterministic)
    torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4).step()
    for p, want in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.detach(), want.detach()), (p, want)


def scheduled(run_flags, key, steps=20):
    """The optimizer's group value `key` before each of `steps` steps of the schedule a run with
    `run_flags` builds (10 steps per epoch, 20 in all)."""
    args = flags.check_args(dlojz.get_args_parser().parse_args(TINY + run_flags),
                            torch.device('cpu'))
    _, opt, sched, _ = R.build_optimization(args, nn.Linear(2, 2), 10, 20, choices.choose('cpu'))
    seen = []
    for _ in range(steps):
        seen.append(opt.param_groups[0][key])
        opt.step()
        sched.step()
    return seen


def test_schedules_by_formula():
    f = R.lr_factor
    assert [f('constant', s, 4, 20) for s in (0, 1, 3, 4, 19)] == [0.25, 0.5, 1.0, 1.0, 1.0]
    assert f('cosine', 4, 4, 20) == 1.0 and f('cosine', 12, 4, 20) == pytest.approx(0.5)
    assert f('cosine', 20, 4, 20) == pytest.approx(0.0, abs=1e-12)
    assert f('poly', 12, 4, 20) == pytest.approx(0.25) and f('poly', 12, 4, 20, power=1) == pytest.approx(0.5)
    # the scheduler the run builds: 10 steps per epoch, 2 epochs, 0.5 epoch of warm-up, poly power 2
    lrs = scheduled(['--scheduler', 'poly', '--warmup-epochs', '0.5', '-e', '2', '--lr', '0.4'], 'lr')
    want = [0.4 * (s + 1) / 5 if s < 5 else 0.4 * (1 - (s - 5) / 15) ** 2 for s in range(20)]
    assert lrs == pytest.approx(want)


def test_onecycle_sets_the_momentum_and_says_that_mom_is_not_used(tmp_path, cache_dir, capsys):
    """torch's OneCycleLR overwrites the momentum (beta1) at every step, so --mom 0.8 never reaches
    the optimizer under onecycle: the run says so; with another scheduler --mom is the momentum and
    nothing is said."""
    seen = scheduled(['--mom', '0.8', '-e', '2'], 'momentum')
    assert 0.8 not in seen and max(seen) == pytest.approx(0.95) and min(seen) < 0.86
    note = 'Note: --mom 0.8 is not used'
    for scheduler, said in (('onecycle', True), ('cosine', False)):
        assert dlojz.cli([*TINY, '--cache-dir', cache_dir, '--output-dir', str(tmp_path / scheduler), '--mom', '0.8',
                          '--scheduler', scheduler, '--test-nsteps', '1']) == 0
        assert (note in capsys.readouterr().out) == said, scheduler
    assert scheduled(['--mom', '0.8', '--scheduler', 'cosine'], 'momentum', steps=2)[1] == 0.8  # after a step


@pytest.mark.parametrize('name', ['lars', 'lamb', 'lion', 'adamw'])
def test_each_optimizer_trains(tmp_path, cache_dir, name):
    s, recs = run_main(tmp_path, cache_dir, '--optimizer', name, '--test-nsteps', '4', '--log-interval', '1',
                       '--scheduler', 'poly')
    train = [r['loss'] for r in recs if r['type'] == 'train']
    assert s['status'] == 'completed' and len(train) == 4 and all(math.isfinite(v) for v in train)
    assert s['config']['base_lr'] == R.BASE_LR[name] and s['config']['wd_norm_bias'] == (name not in R.ADAPTIVE)


def test_accumulation_with_static_graph_is_refused(capsys):
    assert dlojz.cli([*TINY, '--accum-steps', '2', '--static-graph', '--test-nsteps', '1']) == 2
    assert 'pytorch/pytorch#143580' in capsys.readouterr().err


def test_lars_with_decay_on_norm_and_bias_is_refused(capsys):
    assert dlojz.cli([*TINY, '--optimizer', 'lars', '--wd-norm-bias', '--test-nsteps', '1']) == 2
    assert 'leaves BatchNorm weights and biases out of weight decay' in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ EMA, race

def test_ema_is_the_hand_rolled_average():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    ema = R.EMA(model, 0.9, warmup=False)
    want = {k: v.clone().double() for k, v in model.state_dict().items()}
    for _ in range(3):
        model(torch.randn(2, 3, 8, 8))  # moves the BatchNorm statistics and counter
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        ema.update(model)
        for k, v in model.state_dict().items():
            want[k] = v.double() if not v.is_floating_point() else 0.9 * want[k] + 0.1 * v.double()
    for k, v in ema.module.state_dict().items():
        torch.testing.assert_close(v.double(), want[k], rtol=1e-5, atol=1e-6, msg=k)
    assert int(ema.module[1].num_batches_tracked) == 3
    warm = R.EMA(model, 0.9999)
    before = [p.clone() for p in warm.module.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    warm.update(model)  # first update: decay min(0.9999, 2 / 11)
    for a, b, m in zip(warm.module.parameters(), before, model.parameters()):
        torch.testing.assert_close(a, 2 / 11 * b + 9 / 11 * m.detach())


def test_ema_update_is_a_few_launches():
    """A ResNet-18 EMA update: one multi-tensor lerp for the floats and one multi-tensor copy for
    the 20 BatchNorm counters, not a copy per layer (each operator is a kernel launch on a GPU); the
    counters still arrive."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))
    model = torchvision.models.resnet18(num_classes=4)
    ema = R.EMA(model, 0.9)
    ema.update(model)  # the first update lists the tensor pairs
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.num_batches_tracked.fill_(7)
    with Ops() as ops:
        ema.update(model)
    assert sum(isinstance(m, nn.BatchNorm2d) for m in model.modules()) == 20
    assert ops.names.count('copy_') == 0 and len(ops.names) <= 4, ops.names
    assert all(int(m.num_batches_tracked) == 7 for m in ema.module.modules() if isinstance(m, nn.BatchNorm2d))


def val_records(recs, kind='val'):
    return [r for r in recs if r['type'] == kind]


@pytest.mark.slow
def test_ema_is_resumed_exactly(tmp_path, cache_dir):
    """2 epochs with an EMA, and the same run stopped mid-epoch 2 then resumed: the same EMA
    validation."""
    flags = ['-e', '2', '--ema-decay', '0.9', '--log-interval', '1']
    _, full = run_main(tmp_path / 'full', cache_dir, *flags)
    run_main(tmp_path / 'part', cache_dir, *flags, '--test-nsteps', '18', '--chkpt')
    part = tmp_path / 'part'
    ckpt = sorted(part.glob('checkpoint-*.pt'))[-1]
    _, second = run_main(tmp_path / 'resumed', cache_dir, *flags, '--resume', ckpt)
    ref, got = val_records(full, 'val_ema')[-1], val_records(second, 'val_ema')[-1]
    assert (got['loss'], got['top1']) == (ref['loss'], ref['top1']) and got['global_step'] == 24
    assert val_records(full, 'val')[-1]['loss'] != ref['loss']  # the EMA is another model than the raw one


@pytest.mark.slow
def test_val_every_best_checkpoint_and_time_to_accuracy(tmp_path, cache_dir):
    s, recs = run_main(tmp_path, cache_dir, '-e', '4', '--val-every', '2', '--chkpt', '--target-top1', '0.3',
                       '--ema-decay', '0.5')
    vals = val_records(recs)
    assert [r['epoch'] for r in vals] == [2, 4] and [r['epoch'] for r in val_records(recs, 'val_ema')] == [2, 4]
    best = max(vals, key=lambda r: r['top1'])
    ckpt = torch.load(tmp_path / 'best.pt', weights_only=False)
    assert ckpt['global_step'] == best['global_step'] and ckpt['race']['best_top1'] == best['top1']
    assert ckpt['ema'] is not None
    newest = torch.load(sorted(tmp_path.glob('checkpoint-*.pt'))[-1], weights_only=False)
    race = newest['race']  # written after the last validation: a resume keeps the best and the targets reached
    assert race['best_top1'] == best['top1']
    assert race['reached'] == {k: s['time_to_accuracy'][k] for k in ('raw', 'ema')}
    tta = s['time_to_accuracy']
    for kind, records in (('raw', vals), ('ema', val_records(recs, 'val_ema'))):
        first = next(r for r in records if r['top1'] >= 0.3)
        assert tta[kind]['epoch'] == first['epoch'] and tta[kind]['train_images'] == first['global_step'] * 8
        assert 0 < tta[kind]['wall_s'] == first['wall_s']
        assert tta[kind]['process_wall_s'] == first['process_wall_s'] > first['wall_s']  # the clock with start-up
