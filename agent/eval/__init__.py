"""The evaluation: the paper's baselines (B0-B9) and metrics, run on recorded sessions against real daemons."""
