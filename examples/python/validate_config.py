"""Validate a vLLM-style EP configuration before launch.

    python3 validate_config.py '{"all2all_backend": "naive", "enable_eplb": true}'
"""
import json
import logging
import sys

import epcomm

logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
config = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {
    "all2all_backend": "naive",
    "enable_expert_parallel": True,
    "enable_eplb": True,
    "data_parallel_size": 4,
}
try:
    report = epcomm.check_config(config)
except (ValueError, AssertionError, NotImplementedError, RuntimeError) as e:
    print(f"{type(e).__name__}: {e}")
    if getattr(e, "hint", None):
        print(f"hint: {e.hint}")
    sys.exit(1)
print(f"{report['effective_name']} -> {report['manager_class']} ({report['layout']}); "
      f"EPLB communicator: {report['eplb_communicator']}")
