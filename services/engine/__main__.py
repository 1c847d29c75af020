"""`python -m services.engine`: an engine-worker with the backend TALARIA_ENGINE names."""

import functools
import sys

from services.engine.worker import EngineBackend, EngineWorker
from shared.bus import run_service
from shared.settings import Settings


def main() -> None:
    settings = Settings.from_env_or_exit(sys.argv[1:])
    backend: type[EngineBackend]
    if settings.engine == "vllm":
        from services.engine.vllm_backend import VllmBackend  # imports vLLM only when asked

        backend = VllmBackend
    else:
        from services.engine.sim_backend import SimBackend

        backend = SimBackend
    run_service(functools.partial(EngineWorker, backend=backend), settings=settings)


if __name__ == "__main__":
    main()
