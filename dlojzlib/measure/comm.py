"""How long each step waits for the gradient all-reduce, measured where it happens: a DDP
communication hook around the default all-reduce stamps each bucket when its gradients are ready
(the hook is called) and when its all-reduce is done (the future's callback).

    comm = CommTimer(world_size, timeline)      # timeline: CUDA events on a GPU, None for the host clock
    ddp.register_comm_hook(None, comm.hook)
    chrono.comm = comm                          # the Chronometer takes each step's stamps at its end

Per step, from its buckets' stamps (seconds):
- exposed = last done - last ready: the backward computation has ended (its last bucket is ready) and the
  step waits for the all-reduce. This is the communication the overlap did not hide, whatever its cause.
- link = the time the all-reduce itself ran: the buckets are reduced one after another, in the order they
  became ready (gloo's and NCCL's work queues are in order), so each one runs from when it was ready, or
  the previous one was done, to when it is done. Bytes / link is the achieved bandwidth.
- buffers = the broadcast of rank 0's buffers (BatchNorm statistics) that DDP runs before each forward pass
  with --broadcast-buffers (its default): a collective too, where an early rank waits for a late one. It is
  timed around DDP's _sync_buffers (a private method, there from torch 1.11 to 2.14 at least; when it is
  missing the buffers are not timed and summary.json says so).
All three include waiting for a peer that arrives late. The late rank does not wait for anyone, so across
ranks, at the end of the run (record.summary.ranks_summary), the smallest time in collectives over the run
(exposed + buffers, summed) is the transfer and each rank's excess over it is waiting for a late rank. Only
durations measured on one rank's own clock are compared, never clock readings of two hosts.

On the host clock the stamps are time.perf_counter() (gloo's callback runs in gloo's thread when the
all-reduce is done). On a GPU they are CUDA events: the ready event is recorded on the stream that
ran the backward pass, the done event in the callback, whose current stream waits for the all-reduce
(torch.futures semantics for CUDA), so the two events bracket the device's wait. Events are read
once they have completed, by the Chronometer, never by synchronising. Nothing here reads a device
value on the host."""
import time

import torch.distributed as tdist

from dlojzlib import compat


class CommTimer:
    def __init__(self, world_size, timeline=None, group=None, clock=time.perf_counter,
                 all_reduce=None):
        self.world_size, self.timeline, self.clock = world_size, timeline, clock
        # all_reduce(tensor) -> a torch.futures.Future of [tensor]: tests give a fake one
        self.all_reduce = all_reduce or (
            lambda t: tdist.all_reduce(t, group=group, async_op=True).get_future())
        self.marks = []  # this step's buckets: [ready stamp, done stamp (None until done), bytes]
        self.buffer_marks = []  # this step's buffer broadcasts: [start stamp, end stamp, 0]
        self.buffers_timed = False

    def time_buffers(self, ddp):
        """Time DDP's buffer broadcast before each forward pass (an instance attribute over the
        method)."""
        sync = compat.ddp_buffer_sync(ddp)
        if sync is None:
            return

        def timed():
            mark = [self._stamp(), None, 0]
            sync()
            mark[1] = self._stamp()
            self.buffer_marks.append(mark)
        compat.replace_ddp_buffer_sync(ddp, timed)
        self.buffers_timed = True

    def _stamp(self):
        if self.timeline is None:
            return self.clock()
        event = self.timeline.event()
        event.record()
        return event

    def hook(self, state, bucket):
        """DDP's default all-reduce (the mean of the gradients over the ranks), stamped."""
        tensor = bucket.buffer()
        mark = [self._stamp(), None, tensor.numel() * tensor.element_size()]
        self.marks.append(mark)
        tensor.div_(self.world_size)

        def done(fut):
            mark[1] = self._stamp()
            return fut.value()[0]
        return self.all_reduce(tensor).then(done)

    def take(self):
        """The stamps of the step that ends: (all-reduce buckets, buffer broadcasts) since the last
        call."""
        marks, buffers, self.marks, self.buffer_marks = self.marks, self.buffer_marks, [], []
        return marks, buffers


def completed(marks, buffers=()):
    """Whether a step's stamps can be read without waiting (events: query(), no synchronisation)."""
    return all(done is not None and (isinstance(done, float) or done.query()) for _, done, _ in [*marks, *buffers])


def _seconds(marks):
    if isinstance(marks[0][0], float):
        return [(start, end) for start, end, _ in marks]
    origin = marks[0][0]  # events: seconds after the first one, on the device's clock
    return [(origin.elapsed_time(start) / 1e3, origin.elapsed_time(end) / 1e3)
            for start, end, _ in marks]


def resolve(marks, buffers=()):
    """A step's stamps -> {'exposed': s, 'link': s, 'bytes': n, 'buffers': s}, or None for a step
    with no all-reduce (a no_sync() micro-batch) or one whose callback never ran."""
    if not marks or not completed(marks, buffers):
        return None
    times = _seconds(marks)
    link, free = 0.0, float('-inf')
    for ready, done in sorted(times):
        link += max(0.0, done - max(ready, free))
        free = max(free, done)
    exposed = max(0.0, max(d for _, d in times) - max(r for r, _ in times))
    return {'exposed': exposed, 'link': link, 'bytes': sum(b for _, _, b in marks),
            'buffers': sum(end - start for start, end in _seconds(buffers)) if buffers else 0.0}
