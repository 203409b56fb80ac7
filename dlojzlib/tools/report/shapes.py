"""What the report reads of a run folder, each file's shape declared once with only the fields the
report uses: summary.json (record.summary writes it; modes.tune and modes.doctor write theirs),
config.json (dlojz.py) and each record of metrics.jsonl (record.log). runs.py reads them through
dlojzlib.readers: a file of another shape is one note on its run, a record of another shape is left
out and counted, and the views never meet a value they cannot use.

The bounds are far beyond any run's (10^9 s is 31 years, 2^64 bytes 16 EiB) and keep the views'
arithmetic finite: a float of 1e308 times 1e3 is infinite, an integer of 4000 digits cannot become
a float at all."""
import math

from dlojz_chrono import PHASES
from dlojzlib.readers import Any, Bool, Dict, Int, List, Map, Maybe, Num, Shape, Str, Wrong, found

TIME = Num(-1e9, 1e9)  # seconds; a phase's 'other' share of a step can be a little below 0
SECONDS = Num(0, 1e9)
BYTES = Num(0, 2 ** 64)
RATE = Num(0, 1e12)  # images/s, W, J
COUNT = Int(0, 2 ** 53)
FRACTION = Num(-1e3, 1e3)  # shares of a step, bubbles, skews: 0 to 1 as written, with room
NAME = Str(max_len=200)


class Real(Shape):
    """A measured number that may have diverged: NaN and infinities are kept (a NaN loss is what a
    failed run recorded), integers within 2^63 (beyond, no float holds them)."""
    expected = 'a number'

    def accepts(self, value):
        if isinstance(value, bool):
            return False
        return isinstance(value, float) or isinstance(value, int) and abs(value) < 2 ** 63


class Row(Shape):
    """A list of fixed length, one shape per position (a timeline chunk: kind, stage, start,
    end)."""

    def __init__(self, *shapes):
        self.shapes = shapes
        self.expected = f'a list of {len(shapes)} values'

    def check(self, value, where):
        if not isinstance(value, list) or len(value) != len(self.shapes):
            raise Wrong(where, found(value), self.expected)
        return [s.check(v, f'{where}[{i}]') for i, (s, v) in enumerate(zip(self.shapes, value))]


class Rising(List):
    """An LR sweep's learning rates: positive, each larger than the one before (the LR finder
    divides by the differences of their logarithms)."""

    def __init__(self):
        super().__init__(Num(1e-300, 1e300), expected='a list of rising positive numbers')

    def check(self, value, where):
        out = super().check(value, where)
        if any(math.log10(b) <= math.log10(a) for a, b in zip(out, out[1:])):
            raise Wrong(where, 'a list that does not rise', self.expected)
        return out


def fields(**shapes):
    """An object whose fields are all optional (older summaries lack newer fields)."""
    return Dict(shapes, optional=shapes)


STAT = Dict({k: TIME for k in ('min', 'median', 'mean', 'p90', 'std')} | {'n': COUNT})
SHARE_NAME = Str('compute|communication|bubble|straggler|loader|host', 'a share of a step')
SHARES = Map(FRACTION, key=SHARE_NAME)
PHASE_SERIES = List(Maybe(TIME))
RANK = fields(step_median_s=Maybe(TIME), data_mean_s=Maybe(TIME), host_peak_rss_bytes=Maybe(BYTES),
              gpu_max_allocated_bytes=Maybe(BYTES), energy_j=Maybe(Real()),
              steady_steps=Maybe(COUNT), wall_s=Maybe(TIME), data_s=Maybe(TIME),
              busy_s=Maybe(TIME), comm_s=TIME, late_s=TIME)
STAGE = Dict({'stage': Int(0, 2 ** 12), 'compute_s': TIME, 'wait_s': TIME, 'bubble': FRACTION,
              'timeline': Maybe(List(Row(Str('F|B', 'F or B'), Int(0, 2 ** 20), TIME, TIME))),
              'timeline_span_s': Maybe(TIME)})
PIPELINE = Dict({'n_stages': Any, 'schedule': Any, 'microbatches': Any,
                 'measured_bubble': FRACTION, 'expected_bubble': FRACTION,
                 'forecast_span_s': TIME, 'span_s': TIME, 'stages': List(STAGE, max_len=2 ** 12)})
TIMING = fields(
    stats=Maybe(Map(Maybe(STAT))), phase_share=Maybe(Map(FRACTION)),
    train_throughput=Maybe(RATE), gpu_throughput=Maybe(RATE), steady_images_per_s=Maybe(RATE),
    device_busy=Maybe(FRACTION), device_busy_all_ranks=Maybe(FRACTION),
    data_share=Maybe(FRACTION), data_share_all_ranks=Maybe(FRACTION),
    comm_share=Maybe(FRACTION), straggler_share=Maybe(FRACTION), rank_skew=Maybe(FRACTION),
    bound=Maybe(NAME), bound_all_ranks=Maybe(Bool()), shares=Maybe(SHARES),
    shares_all_ranks=Maybe(SHARES), clock=Maybe(NAME), comm_measured=Maybe(NAME),
    epoch_time_estimate_s=Maybe(SECONDS), full_val_time_estimate_s=Maybe(SECONDS),
    warmup_steps=Maybe(COUNT),
    first_steps=Maybe(List(Maybe(fields(step=TIME, data=TIME, h2d=TIME)))),
    per_step=Maybe(fields(step=List(TIME), **dict.fromkeys(PHASES, PHASE_SERIES))),
    totals=Maybe(fields(steady_steps=Maybe(COUNT), wall_s=TIME, data_s=TIME,
                        busy_s=Maybe(TIME), collective_s=TIME)),
    ranks=Maybe(List(RANK)), pipeline=Maybe(PIPELINE), unmeasured=Maybe(Map(Str())))
# the trials of --tune and of the loader doctor: every field is read as a table's cell
TUNE_TRIAL = Dict({'batch': Int(1, 2 ** 40), 'images_per_s': Maybe(RATE),
                   'memory_bytes': Maybe(BYTES), 'status': Maybe(NAME),
                   **dict.fromkeys(('amp', 'channels_last', 'compile', 'step_ms', 'bound'), Any)})
LOADER_TRIAL = Dict({'images_per_second': RATE, 'host_peak_bytes': BYTES, **dict.fromkeys((
    'num_workers', 'pin_memory', 'prefetch_factor', 'decode', 'images_per_second_per_worker',
    'wait_mean_s', 'first_batch_s'), Any)})
VAL = fields(top1=Maybe(Num()), top5=Maybe(Num()), loss=Maybe(Real()))

# config.json, and summary.json's copy of it: the batch is compared, multiplied and sorted on
CONFIG = fields(batch_size=Maybe(Int(1, 2 ** 40)))

SUMMARY = fields(
    status=Maybe(Str(r'[a-z_-]{1,20}', 'a run status')), mode=Maybe(NAME), config=Maybe(CONFIG),
    world_size=Maybe(Int(1, 2 ** 20)),
    provenance=Maybe(fields(gpu_total_memory_bytes=Maybe(BYTES))),
    val=Maybe(VAL), timing=Maybe(TIMING),
    memory=Maybe(fields(**{k: Maybe(BYTES) for k in (
        'gpu_max_allocated_bytes', 'gpu_max_reserved_bytes', 'host_peak_rss_bytes',
        'gpu_max_allocated_bytes_any_rank')})),
    energy=Maybe(fields(peak_w=Maybe(RATE), mean_w=Maybe(RATE), joules_per_image=Maybe(RATE),
                        joules_per_image_all_ranks=Maybe(RATE), why_unavailable=Maybe(Str()))),
    startup=Maybe(fields(total_s=Maybe(SECONDS), phases=Maybe(Map(Any)))),
    communication=Maybe(fields(gradient_bytes_per_step=Maybe(BYTES))),
    findlr=Maybe(fields(lr=Rising(), loss=List(Maybe(Real())))),
    time_to_accuracy=Maybe(fields(target_top1=Maybe(Num()), raw=Maybe(Dict({})),
                                  ema=Maybe(Dict({})))),
    tune=Maybe(fields(trials=List(TUNE_TRIAL), recommended=Maybe(Dict({'images_per_s': RATE})),
                      skipped=Maybe(List(Str())), forecast=Maybe(List(Dict({}))))),
    tune_loader=Maybe(Dict({'trials': List(LOADER_TRIAL),
                            'verdict': Dict({'ceiling_images_per_second': Maybe(RATE),
                                             'best': Dict({'images_per_second': RATE})}),
                            'ceiling': Dict({'images_per_second': Maybe(RATE)})})))

# one record of metrics.jsonl: its kind and step, what the dashboards, the race and the metric
# sync log read
BEFORE_AFTER = Maybe(fields(loss=Maybe(Real()), top1=Maybe(Real())))
RECORD = Dict({'type': NAME, 'global_step': Maybe(COUNT), 'wall_s': Maybe(SECONDS),
               'train_images': Maybe(COUNT), 'top1': Maybe(Num()), 'loss': Maybe(Real()),
               'img_s': Maybe(Real()), 'step_ms': Maybe(Real()),
               'ranks': Maybe(List(fields(before=BEFORE_AFTER, after=BEFORE_AFTER)))},
              optional=['global_step', 'wall_s', 'train_images', 'top1', 'loss', 'img_s',
                        'step_ms', 'ranks'])
