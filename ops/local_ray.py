"""A local Ray cluster that listens on loopback only, for the commands that start one
(`slidespec serve`, `slidespec demo`).

Ray 2.60 replaces a loopback node address with the machine's own, and then listens on every
interface, unless `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, which it reads when it is imported
(docs/deploy.md, "What listens where"; `ops/ray_loopback_head.sh` does the same for `ray start`).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

logger = logging.getLogger(__name__)

LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def keep_ray_on_loopback() -> None:
    """Before Ray is imported: a local cluster started by this process (and the processes it
    starts) keeps 127.0.0.1 as its node address."""
    if "ray" in sys.modules and os.environ.get(LOOPBACK_ENV) != "0":
        logger.warning("Ray was imported before %s=0 was set: a local cluster may listen beyond loopback", LOOPBACK_ENV)
    os.environ[LOOPBACK_ENV] = "0"


def start_local_ray(**options: Any) -> None:
    """A new local Ray cluster on 127.0.0.1 (whatever a stale address file says); `options` go
    to `ray.init`."""
    keep_ray_on_loopback()
    import ray

    ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1", **options)
