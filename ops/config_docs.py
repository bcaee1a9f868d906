"""docs/configuration.md, generated from the code so that it cannot drift from what the code accepts:
the application settings (`cluster.config.settings`) and the in-process Engine's keyword arguments
(its signature; meanings from `cluster.config.EngineArgs` and `workers.engine.ENGINE_OPTIONS`).

    python -m ops.config_docs            # write the page
    python -m ops.config_docs --check    # exit 1, showing the difference, when the page is stale
"""

from __future__ import annotations

import argparse
import difflib
import inspect
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any

from cluster.config import EngineArgs, Setting, settings
from workers import engine as engine_module
from workers.engine import ENGINE_OPTIONS, Engine

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "configuration.md"
COMMAND = "python -m ops.config_docs"

INTRO = f"""\
# Configuration

Generated from the code by `{COMMAND}`: the descriptions live in `cluster/config.py` and
`workers/engine.py` (edit them there and run it again); `{COMMAND} --check` tells whether
this page is current.

The application's settings (`cluster.config.AppArgs`) can be given:

- in a Serve config's `args:` (as in `ops/serve.yaml`), nested groups as mappings (`grpc: {{port: 50052}}`);
- to `serve run cluster.app:build_app key=value ...`, nested settings as dotted keys:
  `serve run cluster.app:build_app model=tiny-gemma3 speculative.algorithm=eagle
  speculative.draft_model=tiny-gemma3-eagle grpc.port=50052`;
- to `slidespec serve MODEL --flag value ...`: a setting `a_b` is the flag `--a-b`, a nested one such as
  `grpc.port` is `--grpc-port` (`speculative.draft_model` is `--speculative-draft-model`, alias
  `--draft-model`), a boolean `x` is `--x` / `--no-x`; `--config serve.yaml` takes them from a Serve
  config's `args:`.

The in-process `Engine(...)` takes the engine settings as keyword arguments, and a few more: see
[In-process Engine](#in-process-engine). A default of *required* means the setting must be given;
`null` is YAML's None."""

# Sections of settings in page order: (title, introduction).
SECTIONS: dict[str, tuple[str, str]] = {
    "application": (
        "Application",
        "How engine replicas are laid out on the Ray cluster, and how requests reach them.",
    ),
    "engine": (
        "Engine",
        "What every rank's `workers.engine.Engine` is built with; the in-process Engine takes the same "
        "keyword arguments.",
    ),
    "speculative": (
        "Speculative decoding",
        "Off unless given: any `speculative.*` setting turns it on, and then `algorithm` and `draft_model` are "
        "required. `Engine(speculative={...})` takes the same options as a mapping, named without the prefix "
        "(`workers.speculative.SpecConfig`).",
    ),
    "grpc": ("gRPC", "The gRPC API server, run inside the ingress deployment."),
    "router": (
        "Router",
        "How requests are spread over engine replicas (`cluster.routing.policies`); a threshold applies to the "
        "policy it names.",
    ),
    "tracing": ("Tracing", "OpenTelemetry export of request, router and engine-step spans."),
    "metrics": (
        "Metrics",
        "Prometheus metrics are served at `GET /metrics` on the HTTP port; these settings add to that.",
    ),
}

ENGINE_INTRO = (
    "`workers.engine.Engine` keyword arguments (`from workers.engine import Engine`). An argument named as an "
    "engine setting means what the setting means; the table adds what only the Engine takes."
)


def section_of(setting: Setting) -> str:
    """The page section a setting belongs to: its group when nested, else by what it configures."""
    head, dot, _ = setting.name.partition(".")
    if dot:
        key = head
    elif setting.name.startswith("metrics_"):
        key = "metrics"
    elif setting.name in EngineArgs.model_fields:
        key = "engine"
    else:
        key = "application"
    if key not in SECTIONS:
        raise ValueError(f"{setting.name}: group {key!r} has no section in ops/config_docs.py SECTIONS; add one")
    return key


def engine_options() -> list[tuple[str, str, str, str]]:
    """(name, type, default, meaning) of every keyword argument of `Engine.__init__`, in its order."""
    hints = typing.get_type_hints(Engine.__init__)
    rows = []
    for name, param in inspect.signature(Engine.__init__).parameters.items():
        if name == "self":
            continue
        shared = EngineArgs.model_fields.get(name)
        parts = [shared.description if shared is not None else None, ENGINE_OPTIONS.get(name)]
        meaning = "; ".join(p for p in parts if p)
        if not meaning:
            raise ValueError(
                f"Engine parameter {name!r} has no meaning: describe it in cluster.config.EngineArgs "
                "(if the application shares it) or in workers.engine.ENGINE_OPTIONS"
            )
        rows.append((name, _python_type(hints.get(name, Any)), _python_default(param.default), meaning))
    return rows


def render() -> str:
    """The whole page; the same code always gives the same text."""
    by_section: dict[str, list[Setting]] = {key: [] for key in SECTIONS}
    for setting in settings():
        if not setting.description:
            raise ValueError(f"{setting.name}: no description; give its Field in cluster/config.py one")
        by_section[section_of(setting)].append(setting)
    out = [INTRO]
    for key, (title, intro) in SECTIONS.items():
        rows = [(f"`{s.name}`", f"`{s.type}`", _setting_default(s), s.description) for s in by_section[key]]
        out.append(_section(title, intro, ("Setting", "Type", "Default", "Meaning"), rows))
    rows = [(f"`{n}`", f"`{t}`", d, m) for n, t, d, m in engine_options()]
    out.append(_section("In-process Engine", ENGINE_INTRO, ("Argument", "Type", "Default", "Meaning"), rows))
    return "\n\n".join(out) + "\n"


def _section(title: str, intro: str, header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    lines = [f"## {title}", "", intro, "", _row(header), _row(tuple("---" for _ in header))]
    lines += [_row(row) for row in rows]
    return "\n".join(lines)


def _row(cells: tuple[str, ...]) -> str:
    return "| " + " | ".join(" ".join(c.split()).replace("|", "\\|") for c in cells) + " |"


def _setting_default(setting: Setting) -> str:
    """A default as a Serve config writes it (YAML: null, true)."""
    if setting.required:
        return "*required*"
    value = setting.default
    if isinstance(value, str):
        return f"`{value}`"
    text = f"`{json.dumps(value)}`"
    if setting.name.endswith("_bytes") and isinstance(value, int) and value % (1 << 20) == 0:
        text += f" ({value >> 20} MiB)"
    return text


def _python_default(value: Any) -> str:
    """A default as Python writes it; an object by the module-level name it is bound to."""
    if value is inspect.Parameter.empty:
        return "*required*"
    if value is None or isinstance(value, (bool, int, float, str)):
        return f"`{value!r}`"
    for name, bound in sorted(vars(engine_module).items()):
        if bound is value:
            return f"`{name}`"
    return f"`{value!r}`"


def _python_type(annotation: Any) -> str:
    if annotation is type(None):
        return "None"
    if annotation is Any:
        return "Any"
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_python_type(a) for a in args)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_python_type(a) for a in args)}]"
    return getattr(annotation, "__name__", repr(annotation))


def check(path: Path) -> list[str]:
    """The lines by which the page at `path` differs from what the code gives now (empty: current)."""
    have = path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
    return list(difflib.unified_diff(have, render().splitlines(), str(path), "generated", lineterm=""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the page differs from what the code gives")
    parser.add_argument("--path", type=Path, default=PAGE, help="the page (default: docs/configuration.md)")
    args = parser.parse_args(argv)
    if args.check:
        diff = check(args.path)
        if diff:
            print("\n".join(diff[:60] + (["..."] if len(diff) > 60 else [])), file=sys.stderr)
            print(f"{args.path} is stale: run `{COMMAND}`", file=sys.stderr)
            return 1
        print(f"{args.path} is current")
        return 0
    args.path.write_text(render(), encoding="utf-8")
    print(f"wrote {args.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
