"""GPU behaviour proven on CPU through seams (no GPU is lent to this project's machines):

- precision by compute capability: --amp auto picks fp16 on a V100 (sm70), bf16 from sm80; --amp bf16 on
  sm70 is refused with a sentence (torch.cuda.is_bf16_supported() counts emulation, which cuDNN runs slowly);
- fp16's GradScaler without a host synchronisation per step: fused optimizers take the scale and the inf
  flag as tensors (counted with a dispatch mode that sees every .item()); timm's LARS/LAMB/Lion do not, and
  the count and summary.json's warning agree for each optimizer; timm's foreach paths are used on a GPU;
- peak memory reset after the warm-up steps (a fake torch.cuda; on CPU the resident set's peak, VmHWM);
- torch.compile with the aot_eager backend, graphs counted: the -heads archs compile once, and
  --grad-checkpointing compiles and updates BatchNorm statistics once per step.
- a sync detector: a training step and a validation batch read nothing from the device (no .item(), bool(),
  nonzero, .tolist(), tensor from host data); the reads the loop is allowed are listed with their reason.

Run: python -m pytest -q tests/test_gpu_seams.py"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import custom_models
import dlojz
from dlojzlib import choices
from dlojzlib import flags
from dlojzlib import recipe
from dlojzlib.dist import launch
from dlojzlib.errors import UsageError
from dlojzlib.measure.power import PowerMeter
from dlojzlib.metrics import PeakMemory
from test_chrono import FakeNVML

GPU = torch.device('cuda', 0)  # a device object only: nothing runs on it
AS_GPU = choices.choose('cuda', (9, 0))  # an H100's choices, made on CPU tensors


def resolved_on(capability, *argv):
    args = dlojz.get_args_parser().parse_args(list(argv))
    return flags.check_args(args, GPU, 1, capability=capability)


@pytest.mark.parametrize('capability, expected', [((7, 0), 'fp16'), ((7, 5), 'fp16'), ((8, 0), 'bf16'),
                                                  ((9, 0), 'bf16')])
def test_amp_auto_follows_the_compute_capability(capability, expected):
    assert resolved_on(capability).amp == expected


def test_amp_bf16_on_a_v100_is_a_sentence():
    with pytest.raises(UsageError, match=r'compute capability 8.0 or more .* this one is 7.0 .* use --amp fp16'):
        resolved_on((7, 0), '--amp', 'bf16')
    assert resolved_on((7, 0), '--amp', 'fp16').amp == 'fp16'


class HostSyncs(TorchDispatchMode):
    """Counts the operators that make the host wait for the device on a GPU: a tensor read as a
    Python number (.item(), bool(), int()), nonzero (its output size depends on the values)."""
    SYNCS = {'_local_scalar_dense', 'nonzero', 'is_nonzero', 'equal'}

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.SYNCS:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def scaled_step(fused):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=fused)
    scaler = torch.amp.GradScaler('cpu', init_scale=2.0 ** 8)
    loss = model(torch.randn(16, 8)).square().mean()
    scaler.scale(loss).backward()
    with HostSyncs() as mode:
        scaler.step(opt)
        scaler.update()
    return mode.seen, model.weight.detach().clone()


def test_fused_optimizer_spares_the_scaler_its_item():
    plain, w_plain = scaled_step(fused=False)
    fused, w_fused = scaled_step(fused=True)
    assert plain.count('_local_scalar_dense') >= 1  # GradScaler reads found_inf on the host
    assert fused == []
    torch.testing.assert_close(w_fused, w_plain)  # the same update


@pytest.mark.filterwarnings('ignore:torch.cuda.amp.GradScaler is enabled')
def test_gpu_runs_build_fused_optimizers():
    args = resolved_on((8, 0), '--amp', 'fp16')
    for name in ('sgd', 'adamw'):
        args.optimizer = name
        opt = recipe.build_optimization(args, torch.nn.Linear(2, 2), 10, 10, AS_GPU)[1]
        assert opt.defaults['fused'] is True, name
    cpu = recipe.build_optimization(args, torch.nn.Linear(2, 2), 10, 10, choices.choose('cpu'))[1]
    assert not cpu.defaults.get('fused')


def fp16_step_syncs(name):
    """The host reads of GradScaler.step + update after one fp16-scaled backward, with the optimizer
    dlojz builds for a GPU (fused, or timm's with foreach where timm has it), on CPU tensors."""
    args = resolved_on((7, 0), '--optimizer', name)  # a V100: --amp auto picks fp16
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    opt = recipe.build_optimizer(args, model, 0.01, AS_GPU)
    scaler = torch.amp.GradScaler('cpu', init_scale=2.0 ** 8)
    scaler.scale(model(torch.randn(16, 8)).square().mean()).backward()
    with HostSyncs() as mode:
        scaler.step(opt)
        scaler.update()
    return args, opt, mode.seen


@pytest.mark.parametrize('name', ['sgd', 'adamw', 'lars', 'lamb', 'lion'])
def test_fp16_host_syncs_per_optimizer_are_counted_and_said(name):
    """fp16 (the automatic choice on a V100) with timm's LARS, LAMB or Lion: they do not declare
    _step_supports_amp_scaling, so GradScaler reads found_inf with .item() at every step (counted
    here); the fused SGD/AdamW read nothing. summary.json's warnings say it exactly when the count
    is not zero."""
    args, opt, seen = fp16_step_syncs(name)
    assert args.amp == 'fp16'
    if name in ('sgd', 'adamw'):
        assert seen == []
    else:
        assert seen.count('_local_scalar_dense') >= 1, seen
    warning = recipe.scaler_sync_warning(opt, args.amp)
    assert (warning is not None) == bool(seen)
    assert warning is None or ('reads the inf/NaN flag on the host at every step' in warning and
                               type(opt).__name__ in warning)
    assert recipe.scaler_sync_warning(opt, 'bf16') is None  # no scaler, no read


def test_the_sync_warning_reaches_the_summary_warnings(monkeypatch, tmp_path, cache_dir):
    """build_run puts the scaler's sentence in run.host['warnings'] (the header prints them,
    summary.json keeps them); CPU runs cannot use fp16, so the sentence is forced here and the
    wiring checked."""
    from conftest import TINY
    from dlojzlib.record.log import Console
    monkeypatch.setattr(recipe, 'scaler_sync_warning',
                        lambda opt, amp: f'sync with {type(opt).__name__}')
    argv = [*TINY, '--cache-dir', cache_dir, '--output-dir', str(tmp_path), '--test-nsteps', '1', '--optimizer', 'lion']
    args = flags.check_args(dlojz.get_args_parser().parse_args(argv), torch.device('cpu'))
    run, _ = dlojz.build_run(args, dlojz.get_dist_info(), torch.device('cpu'), Console(False))
    assert run.host['warnings'][-1] == 'sync with Lion'


class Launches(TorchDispatchMode):
    """Counts the operators one optimizer step dispatches: each is a kernel launch (or a few) on a
    GPU."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize('name', ['lars', 'lamb', 'lion'])
def test_timm_optimizers_take_their_foreach_path_on_a_gpu(name):
    """Where timm has a multi-tensor path (Lion from 0.9, LARS and LAMB from 1.0.31), dlojz asks for
    it on a GPU: a ResNet-18 step dispatches a few hundred operators instead of thousands (one loop
    per parameter, 62 of them). Older timm: the per-parameter loop, and this test says so by
    skipping."""
    from timm import optim as timm_optim
    cls = {'lars': timm_optim.Lars, 'lamb': timm_optim.Lamb, 'lion': timm_optim.Lion}[name]
    if not recipe.has_foreach(cls):
        pytest.skip(f'this timm has no foreach path for {cls.__name__}')
    args = resolved_on((8, 0), '--optimizer', name)
    counts = {}
    for device in ('cpu', 'cuda'):  # CPU: the loop (no foreach asked for); GPU: foreach
        torch.manual_seed(0)
        model = custom_models.build_model('resnet18', 4)
        opt = recipe.build_optimizer(args, model, 0.01, choices.choose(device, (8, 0)))
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()  # state made at the first step
        with Launches() as mode:
            opt.step()
        counts[device] = mode.n
    n_params = len(list(model.parameters()))
    assert counts['cuda'] * 3 < counts['cpu'] and counts['cpu'] > 5 * n_params, counts


class FakeCuda:
    def __init__(self):
        self.allocated, self.peak, self.resets = 0, 0, 0

    def alloc(self, n):
        self.allocated += n
        self.peak = max(self.peak, self.allocated)

    def reset_peak_memory_stats(self, device):
        self.resets += 1
        self.peak = self.allocated

    def max_memory_allocated(self, device):
        return self.peak

    def max_memory_reserved(self, device):
        return self.peak


def test_gpu_peak_memory_after_warmup_leaves_out_the_autotune_trials():
    cuda = FakeCuda()
    mem = PeakMemory(GPU, cuda=cuda)
    cuda.alloc(8 << 30)   # warm-up: cudnn benchmark workspaces
    cuda.alloc(-8 << 30)
    mem.reset()
    cuda.alloc(3 << 30)   # a steady step
    s = mem.summary()
    assert s['gpu_max_allocated_bytes'] == 3 << 30 and s['peak_after_warmup'] and cuda.resets == 1


def test_training_peak_is_read_before_validation_and_validation_apart():
    """Defect 8: two epochs of training (3 GiB, then 4 GiB) each followed by a validation (6 GiB:
    other shapes, cudnn's trials). Training's peak is 4 GiB, validation's 6 GiB; before, the one
    figure was 6."""
    cuda = FakeCuda()
    mem = PeakMemory(GPU, cuda=cuda)
    mem.reset()
    for train, val in ((3, 6), (4, 5)):
        cuda.alloc(train << 30)
        cuda.alloc(-train << 30)
        mem.end_training()
        with mem.validation():
            cuda.alloc(val << 30)
            cuda.alloc(-val << 30)
    s = mem.summary()
    assert s['gpu_max_allocated_bytes'] == 4 << 30 and s['val_gpu_max_allocated_bytes'] == 6 << 30
    cuda.alloc(7 << 30)  # a third epoch's steps, then an error: the summary still counts them
    assert mem.summary()['gpu_max_allocated_bytes'] == 7 << 30


def test_evaluate_only_reports_its_validation_peak():
    cuda = FakeCuda()
    mem = PeakMemory(GPU, cuda=cuda)
    with mem.validation():
        cuda.alloc(2 << 30)
    s = mem.summary()
    assert s['gpu_max_allocated_bytes'] == s['val_gpu_max_allocated_bytes'] == 2 << 30


def test_host_peak_memory_reset_on_linux():
    mem = PeakMemory(torch.device('cpu'))
    block = torch.ones(512 << 20, dtype=torch.uint8)  # 512 MiB, touched
    high = mem.peak()
    del block
    mem.reset()
    if not mem.reset_done:
        pytest.skip('/proc/self/clear_refs is not writable here')
    assert mem.peak() < high - (256 << 20)


# ------------------------------------------------------------------------------ torch.compile, counted
# The aot_eager backend traces the graph and autograd as inductor does (dynamo's guards and
# recompiles are the same), in seconds; what it cannot show is inductor's own kernels (tests/gpu).

def compiled_steps(arch, steps=6, grad_checkpointing=False):
    import torch._dynamo
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    model = custom_models.build_model(arch, 4, 0.5, 3)
    if grad_checkpointing:
        custom_models.apply_grad_checkpointing(model)
    compiled = torch.compile(model, backend='aot_eager', dynamic=False)
    x = torch.randn(4, 3, 32, 32)
    for _ in range(steps):
        compiled(x).sum().backward()
    return model, torch._dynamo.utils.counters['stats']['unique_graphs']


def test_heads_compile_once():
    """The head draw (a CPU generator re-seeded from a Python counter) stays out of the graph:
    dynamo guarded the counter as a constant and compiled a new graph at every step (6 in 6 steps).
    """
    _, graphs = compiled_steps('resnet18-heads')
    assert graphs == 1


@pytest.mark.skipif(torch.__version__ < '2.9', reason='torch < 2.9 updates BatchNorm again in the compiled recompute '
                    '(measured on 2.4.0 aot_eager, 2.5.1-2.8.0 aot_eager and inductor); dlojz refuses the combination')
@pytest.mark.slow
def test_grad_checkpointing_compiles_and_updates_batchnorm_once():
    """--compile --grad-checkpointing failed at the first step (a context_fn that is not two
    TorchDispatchModes); compiled, the checkpointed model's BatchNorm statistics equal an
    uncheckpointed eager model's after 3 steps (updated once per step, not again in the recompute).
    """
    model, graphs = compiled_steps('resnet18', steps=3, grad_checkpointing=True)
    torch.manual_seed(0)
    ref = custom_models.build_model('resnet18', 4)
    x = torch.randn(4, 3, 32, 32)
    for _ in range(3):
        ref(x).sum().backward()
    assert graphs == 1
    for k, v in ref.state_dict().items():
        if 'running' in k or 'num_batches' in k:
            torch.testing.assert_close(model.state_dict()[k], v, msg=k)


# ------------------------------------------------------------------------------ host synchronisations, counted

class DeviceReads(HostSyncs):
    """HostSyncs plus tensors made from host data (torch.tensor(...) inside the loop would be a
    host->device copy on a GPU), and .tolist()/.numpy(), which read a CPU tensor without any
    operator (on a GPU they copy to the host first)."""
    SYNCS = HostSyncs.SYNCS | {'lift_fresh', 'lift_fresh_copy'}

    def __enter__(self):
        self.saved = {name: getattr(torch.Tensor, name) for name in ('tolist', 'numpy')}
        for name, real in self.saved.items():
            def read(t, *a, _name=name, _real=real, **kw):
                self.seen.append(_name)
                return _real(t, *a, **kw)
            setattr(torch.Tensor, name, read)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, real in self.saved.items():
            setattr(torch.Tensor, name, real)
        return super().__exit__(*exc)


@pytest.fixture
def cpu_run(tmp_path, cache_dir):
    """A run built as dlojz builds it, on CPU, with the NaN guard read by the log lines only, as on
    a GPU (CPU runs read it every step too, where it costs nothing)."""
    from conftest import TINY
    from dlojzlib.record.log import Console
    argv = [*TINY, '--cache-dir', cache_dir, '--output-dir', str(tmp_path), '--test-nsteps', '20']
    device = torch.device('cpu')
    args = flags.check_args(dlojz.get_args_parser().parse_args(argv), device)
    dlojz.seed_everything(args.seed)
    run, _ = dlojz.build_run(args, dlojz.get_dist_info(), device, Console(False))
    run.guard.every = 0
    return run, args


# Where the training loop may make the host wait for the device, and why. Anything else is a defect.
ALLOWED = {
    'log': 'the log line reads, in one transfer, the NaN guard\'s first bad step (never train on NaN) and the '
           'loss summed since the previous line, every --log-interval steps',
    'compute': 'Meters.compute(): the epoch-end and --metric-step all-reduce of the metric sums',
}


def test_steps_and_validation_batches_never_read_the_device(cpu_run):
    from dlojzlib.metrics import Meters
    (run, args), meters = cpu_run, Meters(4, torch.device('cpu'))
    batches = iter(run.data.train_loader)
    for _ in range(2):  # global steps 0 and 1
        images, labels = next(batches)
        meters.update(*dlojz.train_step(run, images, labels))
    images, labels = next(batches)
    val_images, val_labels = next(iter(run.data.val_loader))
    with DeviceReads() as mode:
        meters.update(*dlojz.train_step(run, images, labels))  # global step 2: no guard read
        with torch.inference_mode():
            x, y = dlojz.to_device(val_images, val_labels, run)
            output = run.eval_model(x)
            meters.update(run.criterion(output, y), output, y)
    assert mode.seen == []
    progress, window = dlojz.Progress(), torch.zeros(())
    args.log_interval = 5  # the epoch holds 12 steps, 3 of them done
    steps = 0
    for images, labels in run.chrono.iterate(run.data.train_loader, args.log_interval):
        with DeviceReads() as mode:
            loss = dlojz.train_step(run, images, labels)[0]
            window += loss
            progress.advance()
            if progress.step % args.log_interval == 0:  # the loop's condition
                dlojz.log_train(run, progress, 0.1, window, 0.0)  # ALLOWED['log']
        steps += 1
        assert mode.seen == (['tolist'] if steps == args.log_interval else []), steps
    with DeviceReads() as mode:
        meters.compute()  # ALLOWED['compute']
    assert mode.seen == ['tolist']  # the four sums at once


def test_compiled_grad_checkpointing_is_refused_before_torch_2_9(monkeypatch):
    monkeypatch.setattr(torch, '__version__', torch.torch_version.TorchVersion('2.8.0'))
    with pytest.raises(UsageError, match='needs torch 2.9 or later'):
        resolved_on((8, 0), '--compile', '--grad-checkpointing')
    monkeypatch.setattr(torch, '__version__', torch.torch_version.TorchVersion('2.10.0'))
    assert resolved_on((8, 0), '--compile', '--grad-checkpointing').compile


def test_power_meter_on_torch_without_device_uuid_says_why():
    """torch 2.4 has neither props.uuid (2.5) nor the PCI fields (2.8): unavailable, with the
    reason."""
    class Old:
        name = 'Fake V100'
    s = PowerMeter('cuda:0', nvml=FakeNVML(), props=Old(), synchronize=lambda: None).summary()
    assert not s['available'] and 'gives no UUID or PCI address' in s['why_unavailable']


def test_log_line_read_carries_the_nan_guard():
    """On a GPU the guard is read only with the log line's loss, in one transfer: the loss comes
    back, and a non-finite loss seen since is raised with its step (global step 7 -> step 8 in the
    message)."""
    from dlojzlib.errors import NonFiniteLoss
    from dlojzlib.metrics import NonFiniteGuard
    guard = NonFiniteGuard(torch.device('cpu'), every=0)
    guard.reset(5)
    for loss in (1.0, 2.0):
        guard.observe(torch.tensor(loss))
    window = torch.tensor(3.5)
    with DeviceReads() as mode:
        assert guard.check(window) == [3.5]
    assert mode.seen == ['tolist']
    guard.observe(torch.tensor(float('nan')))
    guard.observe(torch.tensor(1.0))
    with pytest.raises(NonFiniteLoss, match='at step 8;'):
        guard.check(torch.tensor(3.5))


def test_sync_bn_is_refused_where_ranks_share_a_gpu_through_gloo():
    """gloo has no all_gather of CUDA tensors, which SyncBatchNorm needs: with ranks sharing a GPU
    (the gloo group, dist.launch.process_group_backend) --sync-bn is one sentence, not a traceback
    inside the first forward; with NCCL, or alone, it is allowed."""
    args = lambda: dlojz.get_args_parser().parse_args(['--sync-bn'])
    backend = launch.process_group_backend('cuda', device_count=1, local_world_size=4, share=True)
    with pytest.raises(UsageError, match='--sync-bn all-gathers'):
        flags.check_args(args(), GPU, 4, capability=(8, 0), backend=backend)
    assert flags.check_args(args(), GPU, 4, capability=(8, 0), backend='nccl').sync_bn
    assert flags.check_args(args(), GPU, 1, capability=(8, 0), backend='gloo').sync_bn
