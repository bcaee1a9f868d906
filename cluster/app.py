"""The Serve application builder: `import_path: cluster.app:build_app` in a Serve config.

    applications:
      - name: slidespec
        import_path: cluster.app:build_app
        args: {model: tiny-gemma3, tp_size: 2, ...}   # cluster.config.AppArgs
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application

from cluster.config import AppArgs
from cluster.replica import LLMServer


def build_app(args: dict[str, Any]) -> Application:
    """Validate the arguments and bind the engine replica deployment: each replica in its own
    placement group, bundle 0 for the replica actor and one per tensor-parallel rank."""
    cfg = AppArgs(**args)
    options: dict[str, Any] = dict(
        placement_group_bundles=[{"CPU": 1}] + cfg.rank_bundles(),
        placement_group_strategy=cfg.placement_strategy,
        ray_actor_options={"num_cpus": 1},
        health_check_period_s=cfg.health_check_period_s,
        health_check_timeout_s=cfg.health_check_timeout_s,
        graceful_shutdown_timeout_s=cfg.graceful_shutdown_timeout_s,
        max_ongoing_requests=cfg.max_ongoing_requests,
    )
    if cfg.autoscaling_config is not None or cfg.num_replicas == "auto":
        options["autoscaling_config"] = cfg.autoscaling_config or {"min_replicas": 1, "max_replicas": 4}
    else:
        options["num_replicas"] = cfg.num_replicas
    return serve.deployment(LLMServer).options(**options).bind(cfg.model_dump())
