"""One DP worker process: the only place where the engine meets the disagg layer."""
