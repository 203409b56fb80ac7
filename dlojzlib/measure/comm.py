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

Under --shard gradients and full (FSDP2) there is no bucket to hook: FSDP2 gathers and reduces
inside its own hooks. Its collectives are timed where the computation waits for them, by hooks on
either side of FSDP2's own on each unit (time_fsdp): around its forward pre-hook (the all-gather of
the unit's parameters), its pre-backward hook (the all-gather again under `full`) and its
post-backward function (the reduce-scatter of the gradients). Each such wait counts as exposed; the
same rule over the ranks then tells the transfer from the wait for a late rank, so that the late
rank is named under FSDP2 as under DDP. Not seen: on a GPU, the last reduce-scatters the backward
waits for in FSDP2's final callback (nothing runs after it), and gathers a prefetch hid.

A pipeline's stages meet their replicas in one all-reduce of the gradients a step
(dist.pipeline), stamped whole on either side (wait): the same rule over each stage's replicas
names a slow replica.

On the host clock the stamps are time.perf_counter() (gloo's callback runs in gloo's thread when the
all-reduce is done). On a GPU they are CUDA events: the ready event is recorded on the stream that
ran the backward pass, the done event in the callback, whose current stream waits for the all-reduce
(torch.futures semantics for CUDA), so the two events bracket the device's wait. Events are read
once they have completed, by the Chronometer, never by synchronising. Nothing here reads a device
value on the host."""
import time

import torch
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
        self.waits = []  # this step's FSDP2 waits: [start stamp, end stamp]
        self.buffers_timed = False
        self._open = {}  # FSDP2 unit -> the pre-backward wait its backward will stamp

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

    def wait(self, fn):
        """fn() -> its result, a collective the step waits for whole (a pipeline's replicas'
        all-reduce, the NaN guard's and the log line's), stamped as FSDP2's waits are: its time is
        a wait for the transfer and for the last rank in. A blocking collective the ranks may
        reach apart must be one, or a rank's wait for a late peer hides there, in its compute."""
        start = self._stamp()
        out = fn()
        self.waits.append([start, self._stamp()])
        return out

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
        """The stamps of the step that ends: (all-reduce buckets, buffer broadcasts, FSDP2 waits)
        since the last call."""
        marks, buffers, waits = self.marks, self.buffer_marks, self.waits
        self.marks, self.buffer_marks, self.waits = [], [], []
        return marks, buffers, waits

    # ------------------------------------------------------------------------------------- FSDP2

    def time_fsdp(self, units):
        """Time FSDP2's waits on each unit (fully_shard's modules). torch runs a module's hooks,
        and a tensor's, in the order they were registered, prepended ones first; fully_shard has
        registered FSDP2's: its forward pre-hook prepended, its forward hook (which registers its
        pre-backward hook on the outputs) appended. Training steps only (grad enabled): validation
        forwards are not steps."""
        for unit in units:
            unit.register_forward_pre_hook(self._before_gather, prepend=True)
            unit.register_forward_pre_hook(self._after_gather)
            unit.register_forward_hook(self._before_backward_gather, prepend=True)
            unit.register_forward_hook(self._after_backward_gather)

    def _before_gather(self, module, args):
        if not torch.is_grad_enabled():
            return None
        wait = [self._stamp(), None]
        self._open[module] = wait
        # in the backward, after FSDP2's post-backward (its inputs' gradients come out of it)
        return _on_backward(args, lambda: self._close(wait[2]) if len(wait) > 2 else None)

    def _after_gather(self, module, args):
        wait = self._open.pop(module, None)
        if wait is None:
            return None
        wait[1] = self._stamp()
        self.waits.append(wait)
        reduce = [None, None]
        wait.append(reduce)

        def started():  # the unit's own backward is done; FSDP2's post-backward comes next
            reduce[0] = self._stamp()
        return _on_backward(args, started)

    def _close(self, wait):
        if wait[0] is not None:
            wait[1] = self._stamp()
            self.waits.append(wait)

    def _before_backward_gather(self, module, args, output):
        if torch.is_grad_enabled():
            self._open[module] = (output, _on_grad(output, self._stamp))

    def _after_backward_gather(self, module, args, output):
        opened = self._open.pop(module, None)
        if opened is None or opened[0] is not output or opened[1] is None:
            return  # FSDP2 returned other outputs (a cast): the order is not known
        stamps = opened[1]
        _on_grad(output, lambda: self.waits.append([stamps[0], self._stamp()])
                 if stamps else None)


def _on_backward(args, fn):
    """args with the tensors that need a gradient passed through an identity whose backward calls
    fn(), or None (the args unchanged) where none needs one."""
    at = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
    if not at:
        return None
    out = _Stamp.apply(fn, *(args[i] for i in at))
    out = out if isinstance(out, tuple) else (out,)
    args = list(args)
    for i, t in zip(at, out):
        args[i] = t
    return tuple(args)


class _Stamp(torch.autograd.Function):
    """The identity; its backward calls fn() when its outputs' gradients have come."""

    @staticmethod
    def forward(ctx, fn, *tensors):
        ctx.fn = fn
        return tensors if len(tensors) > 1 else tensors[0]  # as FSDP2's post-backward function

    @staticmethod
    def backward(ctx, *grads):
        ctx.fn()
        return (None, *grads)


def _on_grad(output, stamp):
    """Call stamp() when the first gradient of the output's tensors comes, before the hooks
    registered after this one; -> the list the stamp goes in, or None where no output tensor needs
    a gradient."""
    tensors = [t for t in (output if isinstance(output, (tuple, list)) else (output,))
               if isinstance(t, torch.Tensor) and t.requires_grad]
    if not tensors:
        return None
    got = []
    torch.autograd.graph.register_multi_grad_hook(tensors, lambda grad: got.append(stamp()),
                                                  mode='any')
    return got


def completed(marks, buffers=(), waits=()):
    """Whether a step's stamps can be read without waiting (events: query(), no synchronisation)."""
    return all(done is not None and (isinstance(done, float) or done.query())
               for _, done, *_ in [*marks, *buffers, *waits])


def _seconds(marks):
    if isinstance(marks[0][0], float):
        return [(start, end) for start, end, _ in marks]
    origin = marks[0][0]  # events: seconds after the first one, on the device's clock
    return [(origin.elapsed_time(start) / 1e3, origin.elapsed_time(end) / 1e3)
            for start, end, _ in marks]


def _span(start, end):
    return end - start if isinstance(start, float) else start.elapsed_time(end) / 1e3


def resolve(marks, buffers=(), waits=()):
    """A step's stamps -> {'exposed': s, 'link': s, 'bytes': n, 'buffers': s}, or None for a step
    with no all-reduce (a no_sync() micro-batch) or one whose callback never ran. The waits
    (FSDP2's, a pipeline's replicas' all-reduce, the guard's and the log line's all-reduce): their
    sum is exposed, beside DDP's buckets' (no link or bytes of theirs: no bucket is seen whole)."""
    waited = sum(_span(start, end) for start, end, *_ in waits) \
        if waits and completed((), waits=waits) else None
    if not marks or not completed(marks, buffers):
        return None if waited is None else {'exposed': waited, 'link': 0.0, 'bytes': 0,
                                            'buffers': 0.0}
    times = _seconds(marks)
    link, free = 0.0, float('-inf')
    for ready, done in sorted(times):
        link += max(0.0, done - max(ready, free))
        free = max(free, done)
    exposed = max(0.0, max(d for _, d in times) - max(r for r, _ in times)) + (waited or 0.0)
    return {'exposed': exposed, 'link': link, 'bytes': sum(b for _, _, b in marks),
            'buffers': sum(end - start for start, end in _seconds(buffers)) if buffers else 0.0}
