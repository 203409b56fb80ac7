"""Commands beside training (their launchers at the top: dlojz_report.py, dlojz_slurm.py,
dlojz_bench.py): the report, the SLURM scripts, the decoder benchmark. They import the library,
never the reverse."""
