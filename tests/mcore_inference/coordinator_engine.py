"""An engine process for the coordinator tests: the conftest's tiny model behind an
``EngineEndpoint``. Usage: ``python coordinator_engine.py ADDRESS NAME [STEP_DELAY_SECONDS]``.

After a ``stop`` it serves a fresh engine of the same model at the same address (so one process
serves a test module's coordinators); it exits on ``shutdown``, or when no coordinator has been
heard from for a minute (so nothing outlives a crashed test run)."""

import sys
import time
from pathlib import Path


def main(address: str, name: str, step_delay: float = 0.0) -> None:
    """Serve engines at ``address`` until a ``shutdown`` (each step ``step_delay`` seconds slower)."""
    import torch.distributed as dist
    from mcore_inference import DynamicInferenceEngine, EngineEndpoint
    from mcore_parallel import ProcessGroupCollection

    sys.path.insert(0, str(Path(__file__).parent))
    from conftest import build_engine, build_model

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = build_model("llama-like", ProcessGroupCollection(tp=dist.new_group([0])), seed=0)

    class SlowEngine(DynamicInferenceEngine):
        def step(self):
            time.sleep(step_delay)
            return super().step()

    while True:
        engine = build_engine(model, blocks=256)
        if step_delay:
            engine.__class__ = SlowEngine
        endpoint = EngineEndpoint(engine, address, name=name, heartbeat_interval=0.1, coordinator_timeout=60)
        try:
            endpoint.run()
        except TimeoutError:
            return
        if endpoint.shutdown_requested:
            return


def start_engine_processes(address: str, delays: dict[str, float]) -> dict:
    """``{name: process}``: one engine process per name of ``delays`` (its step delay), started
    from a forkserver that imported torch and the packages once, connecting to ``address``."""
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(
        ["coordinator_engine", "mcore_inference", "mcore_models", "mcore_parallel"]
    )
    processes = {
        name: context.Process(target=main, args=(address, name, delay), daemon=True)
        for name, delay in delays.items()
    }
    for process in processes.values():
        process.start()
    return processes


def stop_engine_processes(processes: dict) -> None:
    """Kill and reap the processes of ``start_engine_processes``."""
    for process in processes.values():
        process.kill()
        process.join(5)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]) if len(sys.argv) > 3 else 0.0)
