"""The Serve application builder: `import_path: cluster.app:build_app` in a Serve config.

    applications:
      - name: slidespec
        import_path: cluster.app:build_app
        args: {model: tiny-gemma3, tp_size: 2, router: {policy: cache_aware}, ...}   # cluster.config.AppArgs

The application is two deployments: `GrpcIngress` (the gRPC API and the HTTP route) and
`LLMServer` (the engine replicas, routed by `cluster.routing.serve_router`).
"""

from __future__ import annotations

import logging
from typing import Any

import ray
from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from cluster.config import AppArgs
from cluster.ingress import HANDOVER_S, GrpcIngress
from cluster.replica import LLMServer
from workers.engine import resolve_context_length
from workers.models import load_model_config

logger = logging.getLogger(__name__)


HEAD_NODE_RESOURCE = "node:__internal_head__"  # Ray gives the head node this resource
# A stopping replica (or ingress) looks this often for Serve requests still running before its
# own drain (__del__) starts; Serve's 2 s default made every stop (a redeploy, a scale-down, a
# shutdown) wait 2 s per deployment with nothing in flight.
DRAIN_POLL_S = 0.1


def build_app(args: dict[str, Any]) -> Application:
    """Validate the arguments (a config's nested `args`, or `serve run` key=value pairs with
    dotted keys for nested settings); bind the engine replica deployment (each replica in its
    own placement group: bundle 0 for the replica actor, one per tensor-parallel rank) behind
    the ingress."""
    cfg = AppArgs.from_flat(args)
    context_length = served_context_length(cfg)  # a model or context length it cannot serve fails here
    _warn_if_it_cannot_fit(cfg)
    options: dict[str, Any] = dict(
        placement_group_bundles=[{"CPU": cfg.replica_cpus}] + cfg.rank_bundles(),
        placement_group_strategy=cfg.placement_strategy,
        ray_actor_options={"num_cpus": cfg.replica_cpus},
        health_check_period_s=cfg.health_check_period_s,
        health_check_timeout_s=cfg.health_check_timeout_s,
        graceful_shutdown_timeout_s=cfg.graceful_shutdown_timeout_s,
        graceful_shutdown_wait_loop_s=DRAIN_POLL_S,
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
        .options(
            num_replicas=1,
            max_ongoing_requests=cfg.ingress_max_ongoing_requests,
            health_check_period_s=cfg.health_check_period_s,  # a dead ingress is replaced as fast as a replica
            health_check_timeout_s=cfg.health_check_timeout_s,
            # hand over to a successor, then drain the gRPC calls in flight (ingress.__del__)
            graceful_shutdown_timeout_s=HANDOVER_S + cfg.graceful_shutdown_timeout_s + 5,
            graceful_shutdown_wait_loop_s=DRAIN_POLL_S,
            ray_actor_options={
                "num_cpus": cfg.ingress_cpus,
                "resources": {HEAD_NODE_RESOURCE: 0.001} if cfg.ingress_on_head else {},
            },
        )
        .bind(engine, cfg.model_dump(), context_length)
    )


def served_context_length(cfg: AppArgs) -> int:
    """The context length the replicas' engines serve (the ingress checks prompts against it)."""
    model_cfg = load_model_config(cfg.engine_args().engine_kwargs()["model"])
    return resolve_context_length(model_cfg, cfg.context_length, cfg.max_total_tokens)


def _warn_if_it_cannot_fit(cfg: AppArgs) -> None:
    """Serve waits, repeating that no node type can fulfil the request, when the cluster lacks
    the CPUs or GPUs the application asks for; say up front what it needs."""
    if not ray.is_initialized():
        return
    have = ray.cluster_resources()
    need = {"CPU": cfg.total_cpus()}
    if cfg.device == "cuda":
        need["GPU"] = cfg.tp_size * (cfg.num_replicas if isinstance(cfg.num_replicas, int) else 1)
    short = {k: (v, have.get(k, 0)) for k, v in need.items() if have.get(k, 0) < v}
    if short:
        logger.warning(
            "slidespec needs %s (replica_cpus %.2g + tp_size %d x cpus_per_rank %.2g per replica, ingress_cpus %.2g) "
            "but the cluster has %s: replicas will wait for resources; lower cpus_per_rank / replica_cpus or add nodes",
            ", ".join(f"{v:g} {k}" for k, (v, _) in short.items()),
            cfg.replica_cpus,
            cfg.tp_size,
            cfg.cpus_per_rank,
            cfg.ingress_cpus,
            ", ".join(f"{h:g} {k}" for k, (_, h) in short.items()),
        )
