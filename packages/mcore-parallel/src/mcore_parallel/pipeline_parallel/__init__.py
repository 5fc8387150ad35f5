"""Pipeline parallelism: p2p between stages, 1F1B and interleaved schedules, bridges between grids."""
