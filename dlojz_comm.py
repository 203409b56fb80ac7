"""How long each step waits for the gradient all-reduce, measured where it happens: a DDP communication hook
around the default all-reduce stamps each bucket when its gradients are ready (the hook is called) and when
its all-reduce is done (the future's callback).

    comm = CommTimer(world_size, timeline)      # timeline: CUDA events on a GPU, None for the host clock
    ddp.register_comm_hook(None, comm.hook)
    chrono.comm = comm                          # the Chronometer takes each step's stamps at its end

Per step, from its buckets' stamps (seconds):
- exposed = last done - last ready: the backward computation has ended (its last bucket is ready) and the
  step waits for the all-reduce. This is the communication the overlap did not hide, whatever its cause.
- link = the time the all-reduce itself ran: the buckets are reduced one after another, in the order they
  became ready (gloo's and NCCL's work queues are in order), so each one runs from when it was ready, or
  the previous one was done, to when it is done. Bytes / link is the achieved bandwidth.
Both include waiting for a peer that arrives late. The late rank does not wait for anyone, so across ranks,
at the end of the run (dlojz_summary.ranks_summary), the smallest exposed time of a step is its transfer
and each rank's excess over it is straggler wait. Only durations measured on one rank's own clock are
compared, never clock readings of two hosts.

On the host clock the stamps are time.perf_counter() (gloo's callback runs in gloo's thread when the
all-reduce is done). On a GPU they are CUDA events: the ready event is recorded on the stream that ran the
backward pass, the done event in the callback, whose current stream waits for the all-reduce (torch.futures
semantics for CUDA), so the two events bracket the device's wait. Events are read once they have completed,
by the Chronometer, never by synchronising. Nothing here reads a device value on the host.
"""
import time

import torch.distributed as tdist


class CommTimer:
    def __init__(self, world_size, timeline=None, group=None, clock=time.perf_counter, all_reduce=None):
        self.world_size, self.timeline, self.clock = world_size, timeline, clock
        # all_reduce(tensor) -> a torch.futures.Future of [tensor]: tests give a fake one
        self.all_reduce = all_reduce or (
            lambda t: tdist.all_reduce(t, group=group, async_op=True).get_future())
        self.marks = []  # this step's buckets: [ready stamp, done stamp (None until done), bytes]

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
        """The stamps of the step that ends (every all-reduce since the last call)."""
        marks, self.marks = self.marks, []
        return marks


def completed(marks):
    """Whether a step's stamps can be read without waiting (events: query(), no synchronisation)."""
    return all(done is not None and (isinstance(done, float) or done.query()) for _, done, _ in marks)


def resolve(marks):
    """A step's stamps -> {'exposed': s, 'link': s, 'bytes': n}, or None for a step with no all-reduce (a
    no_sync() micro-batch) or one whose callback never ran."""
    if not marks or not completed(marks):
        return None
    if isinstance(marks[0][0], float):
        times = [(ready, done) for ready, done, _ in marks]
    else:  # events: seconds after the first bucket's ready event, on the device's clock
        origin = marks[0][0]
        times = [(origin.elapsed_time(ready) / 1e3, origin.elapsed_time(done) / 1e3) for ready, done, _ in marks]
    link, free = 0.0, float('-inf')
    for ready, done in sorted(times):
        link += max(0.0, done - max(ready, free))
        free = max(free, done)
    exposed = max(0.0, max(d for _, d in times) - max(r for r, _ in times))
    return {'exposed': exposed, 'link': link, 'bytes': sum(b for _, _, b in marks)}
