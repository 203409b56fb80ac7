"""The run's record: its folder, log and metrics, checkpoints and the state they hold, the resume
contract, summary.json."""
