"""How the training loader's workers hand their batches to the main process: into shared memory made
once.

torch's default collate stacks each batch into a new shared-memory block, which the main process
then maps through a file descriptor sent over a socket, once per tensor (the labels too). The
block's pages are new each time: measured on this project's 2-core machine, allocating and filling a
fresh 4.8 MB block (32 images of 224 px) costs 3.1 ms against 0.07 ms for ordinary memory, and one
worker on the same core as the main process hands a batch over in 4.3 ms (0.13 ms per image, as much
as the resize).

SharedCollate stacks the batch into one of the worker's own slots instead: blocks allocated by the
main process before the workers fork, so that both sides map them once and their pages stay. Only a
small SlotBatch (the slot's number, the shape, the labels as a list) goes through the queue. The
main process copies the images out (into pinned memory in the pin-memory thread, which copied them
anyway, or into ordinary memory) and releases the slot at once; the worker reuses it after that.

Safety: a worker writes a slot only after taking one of its semaphore's K permits (K =
prefetch_factor + 1 slots per worker); a permit comes back only when the main process has copied the
batch out, or dropped it unread (a stopped epoch, the persistent workers' reset). A worker's batches
are taken in the order it made them, and its slots are used in a ring, so the slot it takes next is
always one already copied out. A worker that finds no permit within 50 ms stacks the batch the
default way, and the summary counts those batches: nothing ever waits for the main process. Each
iterator of a loader without persistent workers forks new workers and starts a new generation: a
batch of an older one never releases a newer one's permit."""
import itertools
import math
import multiprocessing as mp
import os
import weakref

import torch
from torch.utils.data import default_collate, get_worker_info

from dlojzlib import compat

WAIT_S = 0.05  # longest wait for a free slot before stacking the batch the default way


SHM = '/dev/shm'  # where torch's shared memory lives on Linux (memfd or shm_open)
SHM_SHARE = 0.25  # the most of its free space the slots may take


def make(workers, prefetch_factor, batch_size, max_image_size, shm=SHM):
    """-> (SharedCollate, None), or (None, why not): the slots must fit in a quarter of the free
    shared memory (a container's /dev/shm is often 64 MB), and their allocation must succeed."""
    need = SharedCollate.bytes_needed(workers, prefetch_factor, batch_size, max_image_size)
    try:
        st = os.statvfs(shm)
        free = st.f_bavail * st.f_frsize
    except OSError:
        free = None
    if free is not None and need > SHM_SHARE * free:
        return None, (f'the shared batch slots would take {need / 2**20:.0f} MiB of the '
                      f'{free / 2**20:.0f} MiB free in {shm}')
    try:
        return SharedCollate(workers, prefetch_factor, batch_size, max_image_size), None
    except (RuntimeError, OSError) as e:  # ENOSPC, a limit: torch's own hand-over still works
        return None, f'the shared batch slots could not be allocated ({str(e).strip().splitlines()[0]})'


class SlotBatch:
    """A training batch in a shared slot: materialize() (or pin_memory(), from the pin-memory
    thread) -> (uint8 images, int64 labels), copied out of the slot, which is then released."""

    def __init__(self, owner, generation, worker, slot, shape, labels):
        self.owner, self.generation, self.worker, self.slot = owner, generation, worker, slot
        self.shape, self.labels = shape, labels
        self._pending = False  # True in the main process until released (set by __setstate__)

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop('owner')
        state['owner_id'] = self.owner.id
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.owner = SharedCollate.registry[self.__dict__.pop('owner_id')]
        self._pending = True

    def _copy(self, pin):
        images = torch.empty(self.shape, dtype=torch.uint8, pin_memory=pin)
        images.copy_(self.owner.view(self.worker, self.slot, self.shape))
        labels = torch.tensor(self.labels, dtype=torch.int64)
        self._release()
        return images, (labels.pin_memory() if pin else labels)

    def materialize(self):
        return self._copy(False)

    def pin_memory(self, device=None):  # torch's pin-memory thread calls it
        return self._copy(True)

    def _release(self):
        if self._pending:
            self._pending = False
            self.owner.release(self.generation, self.worker)

    def __del__(self):  # dropped unread (a stopped epoch, a reset): the slot is free again
        try:
            self._release()
        except Exception:  # interpreter shutdown: nothing left to release
            pass


class SharedCollate:
    """collate_fn of the training loader with workers, for batches of uint8 (3, s, s) images and int
    labels (--decode fast and pil); anything else, or a batch larger than a slot, is collated the
    default way."""
    # id -> SharedCollate, inherited by the forked workers; weak, so that a loader's slots go with
    # it
    registry = weakref.WeakValueDictionary()
    ids = itertools.count()

    @staticmethod
    def slots_per_worker(prefetch_factor):
        return (prefetch_factor or 2) + 1

    @staticmethod
    def bytes_needed(workers, prefetch_factor, batch_size, max_image_size):
        return workers * SharedCollate.slots_per_worker(prefetch_factor) * batch_size * 3 * max_image_size ** 2

    def __init__(self, workers, prefetch_factor, batch_size, max_image_size):
        self.id = next(SharedCollate.ids)
        SharedCollate.registry[self.id] = self
        self.workers, self.per_worker = workers, self.slots_per_worker(prefetch_factor)
        self.slot_bytes = batch_size * 3 * max_image_size ** 2
        # one block for every slot, allocated here so that the workers inherit its mapping at their
        # fork; made shared directly (as default_collate's blocks are), not copied into shared
        # memory by share_memory_()
        shape = (workers, self.per_worker, self.slot_bytes)
        storage = compat.shared_storage(workers * self.per_worker * self.slot_bytes)
        self.blocks = torch.empty(0, dtype=torch.uint8).set_(storage).view(shape)
        ctx = mp.get_context('fork')
        self.counts = ctx.Array('q', 2)  # batches handed over in slots, batches stacked the default way
        self.generation, self.sems, self.next = 0, None, None
        self.main_pid = os.getpid()
        self.new_generation()

    def new_generation(self):
        """Fresh permits for workers about to be forked (each iterator without persistent workers)."""
        ctx = mp.get_context('fork')
        self.generation += 1
        self.sems = [ctx.BoundedSemaphore(self.per_worker) for _ in range(self.workers)]
        self.next = [0] * self.workers  # the worker's next slot in its ring (each worker's copy counts its own)

    def view(self, worker, slot, shape):
        return self.blocks[worker, slot, :math.prod(shape)].view(shape)

    def release(self, generation, worker):
        if generation == self.generation and os.getpid() == self.main_pid:
            self.sems[worker].release()

    def stats(self):
        return {'slots': self.workers * self.per_worker, 'slot_bytes': self.slot_bytes,
                'batches_in_slots': self.counts[0], 'batches_stacked_default': self.counts[1]}

    def __call__(self, batch):
        info = get_worker_info()
        images, labels = zip(*batch)
        x = images[0]
        uniform = (info is not None and isinstance(x, torch.Tensor) and x.dtype == torch.uint8 and x.dim() == 3
                   and x.numel() * len(images) <= self.slot_bytes and all(isinstance(y, int) for y in labels)
                   and all(isinstance(t, torch.Tensor) and t.shape == x.shape for t in images))
        if uniform and self.sems[info.id].acquire(timeout=WAIT_S):
            w = info.id
            slot, self.next[w] = self.next[w], (self.next[w] + 1) % self.per_worker
            shape = (len(images), *x.shape)
            torch.stack(images, out=self.view(w, slot, shape))
            self._count(0)
            return SlotBatch(self, self.generation, w, slot, shape, list(labels))
        self._count(1)
        return default_collate(batch)

    def _count(self, k):
        with self.counts.get_lock():
            self.counts[k] += 1


class Materialized:
    """The loader's iterator, with SlotBatches copied out (the pin-memory thread has already done it
    for a pinned loader). Other attributes are the wrapped iterator's."""

    def __init__(self, it):
        self._it = it

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self._it)
        return batch.materialize() if isinstance(batch, SlotBatch) else batch

    def __len__(self):
        return len(self._it)

    def __getattr__(self, name):
        return getattr(self._it, name)
