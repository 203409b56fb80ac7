"""Python objects between ranks (gathered, broadcast) as pickles in uint8 tensors, and the tensors
that dlojz gives a collective, kept by Python until no work holds them.

Why kept: before torch 2.8 (pytorch#154976), freeing a gloo group (launch.cleanup) joins its
worker threads with the GIL held, while a worker that drops the last reference to a tensor made in
Python waits for the GIL to free its Python object: a deadlock, the rank hangs at the end of a
run. At the floor (torch 2.4) a 2-rank gloo run that ended normally hung in cleanup() in 7 of 55
tries, and in a loop of ends in one process, at the 3rd to 5th end (tests/test_dist). Kept here,
a tensor's last reference is always Python's, dropped by the main thread. torch's own
all_gather_object and broadcast_object_list make their tensors inside, where nothing can keep
them: hence gather and broadcast below, which do what those do."""
import pickle

import torch
import torch.distributed as tdist

from dlojzlib import compat

_KEPT = []


def keep(*tensors):
    """Keep `tensors` (given to a collective) until no work holds them; let go of those that no
    work holds any more (compat.use_count 1: their Python object's own reference)."""
    global _KEPT
    _KEPT = [t for t in _KEPT if compat.use_count(t) > 1] + list(tensors)


def kept(tensor):
    """Whether `tensor` is kept now (tests)."""
    return any(t is tensor for t in _KEPT)


def _device(group):
    """Where the tensors go: the CPU on a gloo group; the current GPU on an NCCL group (Lightning's
    default group, where dlojz made no gloo one), which takes no CPU tensor."""
    if tdist.get_backend(group) == 'nccl':
        return torch.device('cuda', torch.cuda.current_device())
    return torch.device('cpu')


def _tensor_of(data, device):
    """bytes -> a uint8 tensor of its own (not a view of the Python buffer)."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device, copy=True)


def _object_of(tensor, size):
    return pickle.loads(tensor[:size].cpu().numpy().tobytes())


def gather(obj, group):
    """Every rank's obj, in rank order (as torch.distributed.all_gather_object)."""
    device, n = _device(group), tdist.get_world_size(group)
    mine = pickle.dumps(obj)
    size = torch.tensor([len(mine)], device=device)
    sizes = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(n)]
    keep(size, *sizes)
    tdist.all_gather(sizes, size, group=group)
    sizes = [int(s) for s in sizes]
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device=device)  # all_gather: one length
    padded[:len(mine)] = _tensor_of(mine, device)
    out = [torch.empty(max(sizes), dtype=torch.uint8, device=device) for _ in range(n)]
    keep(padded, *out)
    tdist.all_gather(out, padded, group=group)
    return [_object_of(t, k) for t, k in zip(out, sizes)]


def broadcast(obj, src, group):
    """Rank src's obj on every rank (as torch.distributed.broadcast_object_list); src: a global
    rank."""
    device, sending = _device(group), tdist.get_rank() == src
    data = pickle.dumps(obj) if sending else b''
    size = torch.tensor([len(data)], device=device)
    keep(size)
    tdist.broadcast(size, src=src, group=group)
    size = int(size)
    box = _tensor_of(data, device) if sending else \
        torch.empty(size, dtype=torch.uint8, device=device)
    keep(box)
    tdist.broadcast(box, src=src, group=group)
    return obj if sending else _object_of(box, size)
