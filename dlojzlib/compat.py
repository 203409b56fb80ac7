"""The private names of torch, DALI and the standard library that dlojz reaches, each in one place.

For each: what it does, why the public API does not do it, and the versions it was read on.
tests/test_compat.py names each one and fails when an upgrade removes it; CI runs it at the newest
torch and at requirements.txt's floors (torch 2.4), and checks that no other module reaches them.
"""
import torch
import torch.utils.data.dataloader as dataloader


# ---------------------------------------------------------------- torch: device work

def spin(cuda, cycles):
    """Queue a kernel that keeps the current stream busy for `cycles` GPU clock cycles: the probe
    step's head start (dlojz_chrono.py). torch.cuda._sleep is torch's own test helper; no public
    call queues device time of a chosen length without reading it back. torch 2.4 to 2.14. `cuda`:
    the torch.cuda module, or a test's fake."""
    cuda._sleep(cycles)


def foreach_lerp_(tensors, targets, weight):
    """tensors[i] += weight * (targets[i] - tensors[i]) in a few launches for the whole list (the
    EMA's update). torch._foreach_lerp_ is what torch's own optimizers call; the public
    torch.lerp is one launch per tensor (about 300 for ResNet-50). torch 2.4 to 2.14."""
    torch._foreach_lerp_(tensors, targets, weight)


def foreach_copy_(tensors, sources):
    """tensors[i].copy_(sources[i]) in a few launches (the EMA's BatchNorm counters). torch 2.1
    on."""
    torch._foreach_copy_(tensors, sources)


def standard_gamma(concentration, generator):
    """Gamma(concentration, 1) draws from `generator`. torch.distributions.Gamma takes no generator,
    and mixup's lambda must come from the run's own (a per-step seed, whatever the workers draw).
    torch._standard_gamma is the kernel Gamma.rsample calls. torch 2.4 to 2.14."""
    return torch._standard_gamma(concentration, generator=generator)


def shared_storage(nbytes):
    """An UntypedStorage of `nbytes` made in shared memory directly (forked workers inherit its
    mapping); share_memory_() on a fresh storage would copy it there. UntypedStorage._new_shared is
    what the DataLoader's default collate uses for its own batches. torch 2.4 to 2.14."""
    return torch.UntypedStorage._new_shared(nbytes)


def fuses_amp_scaling(optimizer):
    """Whether `optimizer.step` takes fp16's loss scale and inf flag as device tensors (torch's
    fused optimizers): GradScaler then skips its per-step host read. _step_supports_amp_scaling is
    the flag GradScaler itself reads; nothing public says it. torch 2.0 to 2.14."""
    return bool(getattr(optimizer, '_step_supports_amp_scaling', False))


def nested_view(buffer, shapes):
    """A strided nested tensor viewing the 1-D contiguous `buffer` as consecutive contiguous
    matrices of `shapes` [(rows, columns), ...], for a batched matrix product over images of
    different sizes (data.resize). torch._nested_view_from_buffer is what torch's nested tensors
    are built on; the public constructors (nested_tensor, as_nested_tensor) copy each component,
    one launch per image, and take a list. The metadata tensors stay on the CPU, as torch keeps
    them. torch 2.4 to 2.14."""
    sizes = torch.tensor(shapes, dtype=torch.int64).view(-1, 2)
    strides = torch.stack([sizes[:, 1], torch.ones_like(sizes[:, 1])], 1)
    numels = sizes[:, 0] * sizes[:, 1]
    offsets = torch.cat([numels.new_zeros(1), numels.cumsum(0)[:-1]])
    return torch._nested_view_from_buffer(buffer, sizes, strides, offsets)


# ------------------------------------------------------- torch: DataLoader and DDP internals

def loader_iterator(loader):
    """The persistent workers' iterator a DataLoader keeps between epochs (None before the first
    epoch, or without persistent workers): whether the next epoch forks new workers. DataLoader
    keeps it in _iterator and says nothing public. torch 2.4 to 2.14."""
    return loader._iterator


def is_multiprocessing_iterator(obj):
    """Whether `obj` is a DataLoader iterator with worker processes (torch's private class: the
    iterator a stopped start leaves half-built, found in the traceback). torch 2.4 to 2.14."""
    return isinstance(obj, dataloader._MultiProcessingDataLoaderIter)


def abandon_iterator(it):
    """Terminate and join the workers of a half-built multiprocessing iterator and mark it shut
    down, so that its __del__ does not tear down what it never finished building: torch has no
    call for an iterator whose __init__ raised. _workers and _shutdown are its own. torch 2.4 to
    2.14."""
    workers = getattr(it, '_workers', [])
    for w in workers:
        w.terminate()  # SIGTERM from the parent: the worker exits (ignore_preemption_signals)
    for w in workers:
        w.join(timeout=10)
    it._shutdown = True
    # torch keys its SIGCHLD watch list by id(iterator) and drops the entry in _shutdown_workers,
    # which an abandoned iterator skips: a later iterator at the same address then failed to start
    # ('_set_worker_pids should be called only once', a fast-tier test in one run of two)
    try:
        dataloader._utils.signal_handling._remove_worker_pids(id(it))
    except ValueError:  # its __init__ raised before it registered its workers
        pass


def shutdown_workers(it):
    """Stop the workers of a multiprocessing DataLoader iterator now, as its __del__ would: torch
    has no public call. Needed once a batch raised: the re-raised exception's traceback holds
    frames that hold the iterator, a reference cycle, so its __del__ waits for the cyclic garbage
    collector, which can finalize its queues first; the workers never get their stop message and
    are terminated 5 s later (MP_STATUS_CHECK_INTERVAL), in whatever the process does then.
    _shutdown_workers does nothing the second time. torch 2.4 to 2.14."""
    it._shutdown_workers()


def ddp_buffer_sync(ddp):
    """DDP's broadcast of rank 0's buffers before each forward pass, as a bound method, or None
    where this torch has no _sync_buffers (then the broadcast is not timed, and summary.json says
    so). No public hook runs around it. torch 1.11 to 2.14."""
    sync = getattr(ddp, '_sync_buffers', None)
    return sync if callable(sync) else None


def replace_ddp_buffer_sync(ddp, fn):
    """Make DDP call `fn` in place of its buffer broadcast (an instance attribute over the
    method)."""
    ddp._sync_buffers = fn


def use_count(tensor):
    """How many C++ owners a tensor's TensorImpl has: 1 where only its Python object holds it, more
    while a collective's work (a gloo worker thread's) still does (dist.objects.keep). No public
    call tells it. Tensor._use_count: torch 2.4 to 2.14."""
    return tensor._use_count()


def load_whole_dcp(path):
    """A torch.distributed.checkpoint folder read whole in this one process, whatever world size
    wrote it: {key: whole tensors, and the values saved as bytes}. The public dcp.load fills only
    the keys of a state dict given to it, which a process without the model's slices cannot make;
    _load_state_dict with _EmptyStateDictLoadPlanner is what torch's own dcp_to_torch_save calls.
    torch 2.4 to 2.14."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    state = {}
    _load_state_dict(state, storage_reader=FileSystemReader(path),
                     planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return state


# ---------------------------------------------------------------- torch: AOTInductor

def aoti_available():
    """Whether this torch has AOTInductor's packages (torch 2.6 on)."""
    import torch._inductor
    return hasattr(torch._inductor, 'aoti_compile_and_package')


def aoti_compile_and_package(exported, path):
    """Compile an ExportedProgram into an AOTInductor package at `path` (a .pt2 file) that LibTorch
    loads in C++ without Python (torch::inductor::AOTIModelPackageLoader). torch's AOTInductor
    documentation calls torch._inductor.aoti_compile_and_package; torch.export has no public
    name for it. torch 2.6 to 2.14 (aoti_available: not 2.4 nor 2.5)."""
    import torch._inductor
    return torch._inductor.aoti_compile_and_package(exported, package_path=path)


def aoti_load_package(path):
    """The package's model as a Python callable (torch._inductor.aoti_load_package, as documented
    beside aoti_compile_and_package). torch 2.6 to 2.14."""
    import torch._inductor
    return torch._inductor.aoti_load_package(path)


# ---------------------------------------------------------------- DALI

def dali_native_pipeline(pipe):
    """A DALI Pipeline's handle on its C++ pipeline (what Pipeline._shutdown tears down), or None.
    A forked child must keep it and never shut it down (the parent owns its threads); DALI offers
    no call for that. DALI 2.4.0 (the version CI installs; its stage runs tests/test_compat.py)."""
    return getattr(pipe, '_pipe', None)


def detach_dali_native_pipeline(pipe):
    """Take the C++ pipeline away from `pipe`, so that its __del__ finds nothing to shut down."""
    pipe._pipe = None


# ---------------------------------------------------------------- the standard library

def pool_processes(pool):
    """The worker processes of a ProcessPoolExecutor, to kill them when it breaks: the executor
    lists them only in _processes. Python 3.11 and 3.12."""
    return list(pool._processes.values())


def parser_actions(parser):
    """The actions of an argparse parser, to rebuild a command line from parsed values: argparse
    keeps them in _actions and has no public accessor. Python 3.11 and 3.12."""
    return parser._actions
