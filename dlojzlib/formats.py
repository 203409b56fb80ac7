"""The shapes of the files dlojz writes and reads back, each declared once (issue 49): a run's
summary.json (record.summary writes it; modes.tune and modes.doctor write theirs), config.json,
each record of metrics.jsonl, tune.json, tune-loader.json, a Slurm job id. Every field is optional
and of its widest sensible type and range, so that no tool calls a file damaged that another
accepts; a reader that needs a field there says so where it reads (readers.require(SUMMARY,
'timing.totals.wall_s')), never by declaring the shape again.

The bounds are far beyond any run's (10^9 s is 31 years, 2^64 bytes 16 EiB) and keep the readers'
arithmetic finite: a float of 1e308 times 1e3 is infinite, an integer of 4000 digits cannot become
a float at all. Imports dlojzlib.readers only (a base module)."""
import math

from dlojzlib.readers import (Any, Bool, Dict, Either, Int, List, Map, Maybe, Num, Row, Str, Wrong,
                              fields)

TIME = Num(-1e9, 1e9)  # seconds; a phase's 'other' share of a step can be a little below 0
SECONDS = Num(0, 1e9)  # a duration: 10^9 s is 31 years
BYTES = Num(0, 2 ** 64)
RATE = Num(0, 1e12)  # images/s, W, J
COUNT = Int(0, 2 ** 53)  # steps, images: exact in a float
FRACTION = Num(-1e3, 1e3)  # shares of a step, bubbles, skews: 0 to 1 as written, with room
REAL = Num(finite=False)  # a loss, a measured rate: NaN where a run diverged
NAME = Str(max_len=200)  # a word dlojz writes (a mode, a bound, a clock)
RANKS = Int(1, 2 ** 20)
BATCH = Int(1, 2 ** 40)
# errors.py's statuses (completed, failed, oom, nan, preempted, interrupted, disk_full, crashed)
STATUS = Str(r'[a-z_]{1,20}', 'a run status')
JOB_ID = Str(r'[0-9]{1,18}', 'a Slurm job id')  # digits, as Slurm prints them (< 2^63)

# config.json, and summary.json's copy of it (vars(args)): the flags a reader compares or counts by
CONFIG = fields(batch_size=Maybe(BATCH), test=Maybe(Bool()), epochs=Maybe(COUNT),
                test_nsteps=Maybe(COUNT), bucket_cap_mb=Num(0.001, 1e6), shard=Maybe(Str()))

STAT = fields(**dict.fromkeys(('min', 'median', 'mean', 'p90', 'std'), Maybe(TIME)), n=COUNT)
SHARE_NAME = Str('compute|communication|bubble|straggler|loader|host', 'a share of a step')
SHARES = Map(FRACTION, key=SHARE_NAME)
PHASE_SERIES = List(Maybe(TIME))
# a rank's sums over its steady steps (record.summary); comm_s and late_s where its waits in
# collectives were timed
RANK = fields(step_median_s=Maybe(TIME), data_mean_s=Maybe(TIME), host_peak_rss_bytes=Maybe(BYTES),
              gpu_max_allocated_bytes=Maybe(BYTES), energy_j=Maybe(REAL),
              steady_steps=Maybe(COUNT), wall_s=Maybe(TIME), data_s=Maybe(TIME),
              busy_s=Maybe(TIME), comm_s=TIME, late_s=TIME)
STAGE = fields(stage=Int(0, 2 ** 12), compute_s=TIME, wait_s=TIME, bubble=FRACTION,
               timeline=Maybe(List(Row(Str('F|B', 'F or B'), Int(0, 2 ** 20), TIME, TIME))),
               timeline_span_s=Maybe(TIME))
PIPELINE = fields(n_stages=Int(1, 2 ** 12), schedule=Str(), microbatches=Int(1, 10 ** 6),
                  measured_bubble=FRACTION, expected_bubble=FRACTION, forecast_span_s=TIME,
                  span_s=TIME, stages=List(STAGE, max_len=2 ** 12))
TIMING = fields(
    stats=Maybe(Map(Maybe(STAT))), phase_share=Maybe(Map(FRACTION)),
    train_throughput=Maybe(RATE), gpu_throughput=Maybe(RATE), steady_images_per_s=Maybe(RATE),
    device_busy=Maybe(FRACTION), device_busy_job=Maybe(FRACTION),
    data_share=Maybe(FRACTION), data_share_job=Maybe(FRACTION),
    comm_share=Maybe(FRACTION), straggler_share=Maybe(FRACTION), rank_skew=Maybe(FRACTION),
    bound=Maybe(NAME), bound_job=Maybe(Bool()), shares=Maybe(SHARES),
    shares_job=Maybe(SHARES), typical_ranks=Maybe(List(COUNT, max_len=2 ** 12)),
    straggler_pace=Maybe(RATE),
    # summary.json before issue 57: the job's shares were every rank's sums
    device_busy_all_ranks=Maybe(FRACTION), data_share_all_ranks=Maybe(FRACTION),
    bound_all_ranks=Maybe(Bool()), shares_all_ranks=Maybe(SHARES),
    clock=Maybe(NAME), comm_measured=Maybe(NAME),
    epoch_time_estimate_s=Maybe(SECONDS), full_val_time_estimate_s=Maybe(SECONDS),
    warmup_steps=COUNT,
    first_steps=Maybe(List(Maybe(fields(step=TIME, data=TIME, h2d=TIME)))),
    per_step=Maybe(fields(step=List(Maybe(TIME)), images=List(Maybe(COUNT)), **dict.fromkeys(
        ('data', 'h2d', 'forward', 'backward', 'optimizer', 'other'), PHASE_SERIES))),
    totals=Maybe(fields(steady_steps=COUNT, wall_s=TIME, data_s=TIME, busy_s=Maybe(TIME),
                        collective_s=TIME)),
    ranks=Maybe(List(RANK)), pipeline=Maybe(PIPELINE), unmeasured=Maybe(Map(Str())))

# one row of tune.json's table (modes.tune.row_from and Tuner.trial write it; summary.json's
# tune.trials holds the same rows)
WORDS = Str(r'[-\w.]{1,100}', 'a flag or its value')  # flags of the recommended command
TUNE_TRIAL = fields(
    name=Str(max_len=200), batch=BATCH, amp=Str(r'off|fp16|bf16', 'off, fp16 or bf16'),
    channels_last=Bool(), compile=Either(Bool(), Str(r'[a-z-]{1,40}', 'a --compile-mode')),
    status=Maybe(Str(max_len=40)), images_per_s=Maybe(RATE), step_ms=Maybe(RATE),
    backward_ms=Maybe(RATE), memory_bytes=Maybe(BYTES), bound=Maybe(NAME),
    train_images=Maybe(COUNT), classes=Maybe(Int(1)), wall_s=SECONDS, loader_flags=List(WORDS),
    error=Maybe(Str()))
# tune.json (modes.tune.Tuner._save), and summary.json's tune section
TUNE = fields(status=Str(max_len=40), base_argv=List(Str()), trials=List(TUNE_TRIAL),
              skipped=List(Str(max_len=200)), elapsed_s=SECONDS,
              recommended=Maybe(fields(images_per_s=RATE)), forecast=Maybe(List(Dict({}))))

# one trial of the loader doctor (modes.doctor.tune_loader), its flags and its measure
LOADER_TRIAL = fields(
    num_workers=Int(0, 4096), decode=Str(r'auto|fast|pil|gpu|dali', 'a --decode or dali'),
    pin_memory=Maybe(Bool()), prefetch_factor=Maybe(Int(1, 4096)),
    images_per_second=Maybe(RATE), images_per_second_per_worker=Maybe(RATE),
    wait_mean_s=Maybe(SECONDS), first_batch_s=Maybe(SECONDS), host_peak_bytes=Maybe(BYTES))
# tune-loader.json (modes.doctor writes it), and summary.json's tune_loader section
TUNE_LOADER = fields(trials=List(LOADER_TRIAL),
                     verdict=fields(ceiling_images_per_second=Maybe(RATE), best=LOADER_TRIAL),
                     ceiling=fields(images_per_second=Maybe(RATE)))
# what the tuner reads of it: the best trial's loader flags
LOADER_BEST = Dict({'verdict': Dict({'best': Dict(LOADER_TRIAL.fields, optional=(
    'images_per_second', 'images_per_second_per_worker', 'wait_mean_s', 'first_batch_s',
    'host_peak_bytes'))})})

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


VAL = fields(top1=Maybe(Num(0, 1)), top5=Maybe(Num(0, 1)), loss=Maybe(REAL))

# summary.json: record.summary.write_summary, and the modes' own records (tune, tune-loader,
# loader-only: a 'loader' section)
SUMMARY = fields(
    status=STATUS, mode=Maybe(NAME), config=Maybe(CONFIG), world_size=Maybe(RANKS),
    global_step=Maybe(COUNT), global_batch=Maybe(BATCH),
    data=Maybe(fields(batches_per_epoch=Maybe(COUNT), train_images=Maybe(COUNT),
                      classes=Maybe(Int(1, 2 ** 40)))),
    provenance=Maybe(fields(gpu_total_memory_bytes=Maybe(BYTES), device=Str())),
    host=Maybe(fields(usable_cores=Maybe(Int(1, 10 ** 6)), torch_threads=Maybe(Int(1, 10 ** 6)))),
    val=Maybe(VAL), timing=Maybe(TIMING),
    memory=Maybe(fields(**dict.fromkeys((
        'gpu_max_allocated_bytes', 'gpu_max_reserved_bytes', 'host_peak_rss_bytes',
        'gpu_max_allocated_bytes_any_rank'), Maybe(BYTES)))),
    energy=Maybe(fields(peak_w=Maybe(RATE), mean_w=Maybe(RATE), joules_per_image=Maybe(RATE),
                        joules_per_image_all_ranks=Maybe(RATE), why_unavailable=Maybe(Str()))),
    startup=Maybe(fields(total_s=Maybe(SECONDS), phases=Maybe(Map(Any)))),
    communication=Maybe(fields(gradient_bytes_per_step=Maybe(BYTES), traffic_factor=Num(1, 2))),
    time_to_accuracy=Maybe(fields(target_top1=Maybe(Num()), raw=Maybe(Dict({})),
                                  ema=Maybe(Dict({})))),
    findlr=Maybe(fields(lr=Rising(), loss=List(Maybe(REAL)))),
    tune=Maybe(TUNE), tune_loader=Maybe(TUNE_LOADER),
    loader=Maybe(fields(images_per_second=Maybe(RATE), images_per_second_per_worker=Maybe(RATE),
                        wait_mean_s=Maybe(SECONDS), first_batch_s=Maybe(SECONDS),
                        host_peak_main_bytes=Maybe(BYTES), host_peak_workers_bytes=Maybe(BYTES))))

# one record of metrics.jsonl (record.log.Logger): its kind and step, what the dashboards, the race,
# the metric sync log and a resume's trim read
BEFORE_AFTER = Maybe(fields(loss=Maybe(REAL), top1=Maybe(REAL)))
METRIC = fields(type=NAME, global_step=Maybe(COUNT), wall_s=Maybe(SECONDS),
                train_images=Maybe(COUNT), top1=Maybe(Num()), loss=Maybe(REAL),
                img_s=Maybe(REAL), step_ms=Maybe(REAL),
                ranks=Maybe(List(fields(before=BEFORE_AFTER, after=BEFORE_AFTER))))
METRICS_LIMIT = 16 * 2 ** 30  # bytes: a 90-epoch ImageNet run logging every step writes ~0.3 GiB
