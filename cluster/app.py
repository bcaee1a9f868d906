"""The Serve application builder: `import_path: cluster.app:build_app` in a Serve config.

    applications:
      - name: slidespec
        import_path: cluster.app:build_app
        args: {model: tiny-gemma3, tp_size: 2, router: {policy: cache_aware}, ...}   # cluster.config.AppArgs

The application is two deployments: `GrpcIngress` (the gRPC API and the HTTP route) and
`LLMServer` (the engine replicas, routed by `cluster.routing.serve_router`).
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from cluster.config import AppArgs
from cluster.ingress import GrpcIngress
from cluster.replica import LLMServer


def build_app(args: dict[str, Any]) -> Application:
    """Validate the arguments; bind the engine replica deployment (each replica in its own
    placement group: bundle 0 for the replica actor, one per tensor-parallel rank) behind the
    ingress."""
    cfg = AppArgs(**args)
    options: dict[str, Any] = dict(
        placement_group_bundles=[{"CPU": 1}] + cfg.rank_bundles(),
        placement_group_strategy=cfg.placement_strategy,
        ray_actor_options={"num_cpus": 1},
        health_check_period_s=cfg.health_check_period_s,
        health_check_timeout_s=cfg.health_check_timeout_s,
        graceful_shutdown_timeout_s=cfg.graceful_shutdown_timeout_s,
        max_ongoing_requests=cfg.max_ongoing_requests,
        max_queued_requests=cfg.max_queued_requests,
        request_router_config=RequestRouterConfig(
            request_router_class="cluster.routing.serve_router:SlidespecRequestRouter",
            request_router_kwargs=cfg.router.policy_kwargs(),
            request_routing_stats_period_s=cfg.routing_stats_period_s,
        ),
    )
    if cfg.autoscaling_config is not None or cfg.num_replicas == "auto":
        options["autoscaling_config"] = cfg.autoscaling_config or {"min_replicas": 1, "max_replicas": 4}
    else:
        options["num_replicas"] = cfg.num_replicas
    engine = serve.deployment(LLMServer).options(**options).bind(cfg.model_dump())
    return (
        serve.deployment(GrpcIngress)
        .options(num_replicas=1, ray_actor_options={"num_cpus": 0.5})
        .bind(engine, cfg.model_dump())
    )
