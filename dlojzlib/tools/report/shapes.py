"""What the report reads of a run folder: summary.json, config.json, each record of metrics.jsonl,
in the shapes dlojzlib/formats.py declares once for every reader, with the fields the report's
views need there said here (readers.require). runs.py reads them through
dlojzlib.readers: a file of another shape is one note on its run, a record of another shape is left
out and counted, and the views never meet a value they cannot use (formats.py's bounds keep
their arithmetic finite)."""
from dlojzlib import formats
from dlojzlib.readers import require

CONFIG = formats.CONFIG
_STAGE = ('stage', 'compute_s', 'wait_s', 'bubble')
_PIPELINE = ('n_stages', 'schedule', 'microbatches', 'measured_bubble', 'expected_bubble',
             'forecast_span_s', 'span_s', 'stages')
SUMMARY = require(
    formats.SUMMARY,
    *(f'timing.stats.{k}' for k in ('min', 'median', 'mean', 'p90', 'std', 'n')),
    *(f'timing.pipeline.{k}' for k in _PIPELINE),
    *(f'timing.pipeline.stages.{k}' for k in _STAGE),
    # measure.scaling.step_split's sums of a one-process run
    'timing.totals.wall_s', 'timing.totals.data_s',
    'findlr.lr', 'findlr.loss', 'tune.trials', 'tune.trials.batch', 'tune.recommended.images_per_s',
    'tune_loader.trials', 'tune_loader.trials.images_per_second',
    'tune_loader.trials.host_peak_bytes', 'tune_loader.verdict', 'tune_loader.verdict.best',
    'tune_loader.verdict.best.images_per_second', 'tune_loader.ceiling')
# one record of metrics.jsonl: its kind and step, what the dashboards, the race and the metric
# sync log read
RECORD = require(formats.METRIC, 'type')
METRICS_LIMIT = formats.METRICS_LIMIT
