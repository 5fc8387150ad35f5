"""Utilities: free ports, timers, straggler detection, NVTX ranges, gradient comparison."""
