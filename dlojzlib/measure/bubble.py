"""Where a pipeline's step goes, on each stage: its forward and backward chunks (compute) and the
rest of the schedule's span, spent waiting for the other stages' sends (the bubble, and whatever
the transfers and uneven stages add to it). dist.pipeline wraps each stage's chunks with a
StageTimer; the Chronometer takes each step's marks and resolves them once the step is done.

Measured on one rank, the bubble needs no clock shared between ranks: a stage either computes or
waits. With equal stages and free transfers it is the schedule's own share, dist.stages.bubble.
"""
import time

import torch


class StageTimer:
    """This rank's stages' forward and backward chunks inside each schedule step: the host clock,
    or CUDA events on a GPU (read once the Chronometer's step has completed). take() -> the step's
    (start, [(kind, stage, start, end)], end) for the Chronometer; resolve() turns it into seconds.
    """

    def __init__(self, device):
        self.cuda = device.type == 'cuda'
        self._step = None

    def attach(self, pipe):
        """Time a dist.pipeline.Pipeline's steps, from its schedule's start to the end of its
        loss's all-reduce (share_loss: where the stages meet again; the last stage waits there
        while the first drains), and its stages' chunks -> self."""
        for stage in pipe.stages:
            self.wrap(stage)
        step, share = pipe.schedule.step, pipe.share_loss

        def started(*a, **k):
            self.begin()
            return step(*a, **k)

        def ended(*a, **k):
            out = share(*a, **k)
            if self._step is not None:
                self.end()
            return out
        pipe.schedule.step, pipe.share_loss = started, ended
        return self

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def wrap(self, stage):
        for name, kind in (('forward_one_chunk', 'F'), ('backward_one_chunk', 'B')):
            fn = getattr(stage, name)

            def timed(*a, _fn=fn, _kind=kind, _id=stage.stage_index, **k):
                t0 = self.mark()
                out = _fn(*a, **k)
                if self._step is not None:
                    self._step[1].append((_kind, _id, t0, self.mark()))
                return out
            setattr(stage, name, timed)

    def begin(self):
        self._step = [self.mark(), []]

    def end(self):
        self._step.append(self.mark())

    def take(self):
        step, self._step = self._step, None
        return step if step is not None and len(step) == 3 else None


def resolve(step):
    """A StageTimer step -> {'span', 'compute', 'forward', 'backward', 'chunks': [(kind, stage,
    start, end)]}, seconds (the chunks' from the step's start)."""
    start, chunks, end = step
    since = (lambda a, b: a.elapsed_time(b) / 1e3) if hasattr(start, 'elapsed_time') \
        else (lambda a, b: b - a)
    out = [(kind, k, since(start, t0), since(start, t1)) for kind, k, t0, t1 in chunks]
    took = {kind: sum(e - s for c, _, s, e in out if c == kind) for kind in 'FB'}
    return {'span': since(start, end), 'compute': took['F'] + took['B'], 'forward': took['F'],
            'backward': took['B'], 'chunks': out}
