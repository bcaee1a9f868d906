"""`slidespec serve MODEL [options]`: serve a model in the foreground, as `vllm serve` does.

Starts a local Ray head on loopback only (or joins a cluster with `--address`), deploys the application with the
given settings at the route prefix `/` and stays until Ctrl-C or SIGTERM, then deletes the
application and stops the Ray it started. The options are the application settings
(`cluster.config.AppArgs`, docs/configuration.md) as flags: `a_b` is `--a-b`, a nested
`grpc.port` is `--grpc-port`, booleans are `--x/--no-x`; `--config serve.yaml` takes the
settings (and the HTTP host and port) of a Serve config's first application, flags overriding.
While replicas start, their start-up progress (weights, kernels compiled, graphs captured) is
streamed to the terminal; the URLs are printed once the application is ready.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import os
import signal
import sys
import time
from typing import Any

import yaml
from pydantic import ValidationError

from cluster.config import AppArgs, Setting, settings
from ops.local_ray import keep_ray_on_loopback, start_local_ray

logger = logging.getLogger("slidespec.serve")

PREFIX = "setting:"  # argparse destinations of application settings
ALIASES = {  # the names other servers' users type
    "speculative.draft_model": ("--draft-model",),
    "grpc.auth_token_file": ("--api-key-file",),
}
DEFAULT_HTTP = {"host": "127.0.0.1", "port": 8000}


def flag(name: str) -> str:
    """The command-line flag of a setting: `grpc.auth_token_file` -> `--grpc-auth-token-file`."""
    return "--" + name.replace(".", "-").replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", help="a Hugging Face model directory or a shipped model's name")
    parser.add_argument("--config", help="a Serve config (the form of ops/serve.yaml): its first application's args")
    parser.add_argument("--host", help=f"HTTP bind address (default {DEFAULT_HTTP['host']}, or the config's)")
    parser.add_argument("--port", type=int, help=f"HTTP port (default {DEFAULT_HTTP['port']}, or the config's)")
    parser.add_argument("--address", help="join this Ray cluster (host:port, or 'auto') instead of starting one")
    parser.add_argument("--app-name", default="slidespec", help="the Serve application's name")
    group = parser.add_argument_group("application settings (docs/configuration.md)")
    for setting in settings():
        group.add_argument(flag(setting.name), *ALIASES.get(setting.name, ()), **_argument(setting))


def _argument(setting: Setting) -> dict[str, Any]:
    default = "required" if setting.required else f"default {setting.default!r}"
    options: dict[str, Any] = dict(
        dest=PREFIX + setting.name,
        default=argparse.SUPPRESS,  # only what was given overrides the config and the defaults
        help=f"{setting.description} ({setting.type}; {default})".replace("%", "%%"),
    )
    if setting.kind is bool:
        options["action"] = argparse.BooleanOptionalAction
    else:
        name = setting.name.split(".")[-1].upper()
        choices = ",".join(map(str, setting.choices))
        options["metavar"] = f"{{{choices}}}" if choices and "int" not in setting.type else name
        if setting.kind is dict:
            options["type"] = _mapping(setting.name)
    return options


def _mapping(name: str):
    def parse(text: str) -> dict[str, Any]:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"{flag(name)} takes a JSON object: {exc}") from None
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError(f"{flag(name)} takes a JSON object, got {text!r}")
        return value

    return parse


def app_settings(args: argparse.Namespace) -> tuple[AppArgs, dict[str, Any]]:
    """The validated application settings and the HTTP options: the config's, then the model
    argument, then the flags given. A value no setting allows is a ValueError naming its flag."""
    values: dict[str, Any] = {}
    http = dict(DEFAULT_HTTP)
    if args.config:
        app, options = _config(args.config)
        values.update(copy.deepcopy(app))
        http.update({k: v for k, v in options.items() if k in DEFAULT_HTTP})
    if args.model:
        values["model"] = args.model
    given = {k.removeprefix(PREFIX): v for k, v in vars(args).items() if k.startswith(PREFIX)}
    values.update(given)
    if "device" not in values and _cuda():
        values["device"] = "cuda"
    if "model" not in values:
        raise ValueError("model: give a model directory or a shipped model's name (slidespec serve MODEL)")
    http.update({k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None})
    try:
        return AppArgs.from_flat(values), http
    except ValidationError as exc:
        error = exc.errors(include_url=False, include_input=False)[0]
        name = ".".join(str(part) for part in error["loc"] if not isinstance(part, int))
        message = error["msg"].removeprefix("Value error, ")
        named, _, rest = message.partition(": ")  # a group's own check names its settings first
        known = {s.name for s in settings()}
        if rest and all(word in known or word == "/" for word in named.split(" ")):
            where, message = " / ".join(flag(w) for w in named.split(" ") if w != "/"), rest
        else:
            where = "model" if name == "model" else flag(name) if name in known else name
            message = message.removeprefix(f"{name}: ")
        raise ValueError(f"{where}: {message}") from None


def _config(path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    try:
        with open(path, encoding="utf-8") as f:
            config = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"--config: cannot read {path}: {exc}") from None
    apps = config.get("applications") if isinstance(config, dict) else None
    if not apps or not isinstance(apps[0], dict):
        raise ValueError(f"--config: {path} has no applications (a Serve config, as ops/serve.yaml)")
    args = apps[0].get("args") or {}
    if not isinstance(args, dict):
        raise ValueError(f"--config: {path}: applications[0].args is not a mapping")
    return args, config.get("http_options") or {}


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def run(args: argparse.Namespace) -> int:
    cfg, http = app_settings(args)
    started_ray = args.address is None
    if started_ray:
        keep_ray_on_loopback()
    import ray
    from ray import serve

    from cluster.app import build_app

    def stop(signum, frame) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    level = logging.getLogger().level or logging.WARNING
    try:
        if started_ray:
            cpus = max(os.cpu_count() or 1, math.ceil(cfg.total_cpus()))
            start_local_ray(num_cpus=cpus, log_to_driver=True, logging_level=level)
        else:
            ray.init(address=args.address, log_to_driver=True, logging_level=level)
        logging.getLogger("ray.serve").setLevel(max(level, logging.WARNING))
        print(
            f"slidespec: deploying {cfg.model} ({_summary(cfg)}) on "
            f"{'a local Ray head' if started_ray else 'the Ray cluster at ' + args.address}; "
            "start-up progress follows",
            flush=True,
        )
        start = time.perf_counter()
        quiet = {"log_level": logging.getLevelName(max(level, logging.WARNING))}  # access logs with --log-level INFO
        serve.start(http_options={"host": http["host"], "port": http["port"]}, logging_config=quiet)
        ingress = serve.run(build_app(cfg.model_dump()), name=args.app_name, route_prefix="/", logging_config=quiet)
        grpc_port = ingress.ports.remote().result()["grpc"]
        base = f"http://{http['host']}:{http['port']}"
        print(
            f"slidespec: ready in {time.perf_counter() - start:.1f} s, serving {os.path.basename(cfg.model)}\n"
            f"  OpenAI API   {base}/v1\n"
            f"  gRPC         {cfg.grpc.host}:{grpc_port}\n"
            f"  metrics      {base}/metrics\n"
            f"  health       {base}/health\n"
            "Press Ctrl-C to stop.",
            flush=True,
        )
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("slidespec: stopping", flush=True)
        return 0
    except RuntimeError as exc:  # Serve could not deploy the application (its replicas' errors say why)
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the shutdown short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _shut_down(args.app_name, started_ray)


def _summary(cfg: AppArgs) -> str:
    spec = f", {cfg.speculative.algorithm} drafts x{cfg.speculative.num_steps}" if cfg.speculative else ""
    return f"{cfg.device}, tp_size {cfg.tp_size}, {cfg.num_replicas} replica(s){spec}"


def _shut_down(app_name: str, started_ray: bool) -> None:
    """Delete the application (its replicas finish what they run), then stop the Ray this
    command started (or leave the cluster it joined)."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        return
    try:
        serve.delete(app_name)
    except Exception as exc:  # noqa: BLE001 - Ray itself may be going away; stop what is left
        logger.warning("could not delete the application %s cleanly: %s", app_name, exc)
    ray.shutdown()
    if started_ray:
        print("slidespec: stopped", flush=True)
