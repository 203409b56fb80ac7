"""What dlojz measures beside the Chronometer (dlojz_chrono.py): the all-reduce's timing, the
boards' energy, the scaling forecast."""
