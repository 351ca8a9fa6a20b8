"""A stand-in for `vllm.config.parallel`: `EPLBConfig`'s fields and defaults (vLLM 0.34.0),
for tests that import it; epcomm validates the real one (`epcomm.check`)."""

from dataclasses import dataclass
from typing import Optional


@dataclass
class EPLBConfig:
    window_size: int = 1000
    step_interval: int = 3000
    num_redundant_experts: Optional[int] = None
    log_balancedness: bool = False
    log_balancedness_interval: int = 1
    use_async: bool = True
    policy: str = "default"
    communicator: Optional[str] = None
    enable_migration_batching: bool = False

    @property
    def migration_batching_enabled(self) -> bool:
        return self.use_async and self.enable_migration_batching
