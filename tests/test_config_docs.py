"""docs/configuration.md is what `python -m ops.config_docs` writes from the code now, and it
describes every application setting, every speculative option and every Engine argument."""

import dataclasses
import inspect
import re

import pytest

from cluster.config import SpeculativeArgs, settings
from ops import config_docs
from workers.engine import ENGINE_OPTIONS, Engine
from workers.speculative import SpecConfig


@pytest.fixture(scope="module")
def page() -> str:
    return config_docs.PAGE.read_text(encoding="utf-8")


def _rows(text: str) -> dict[tuple[str, str], list[str]]:
    """Table rows of the page by their first cell's name: (section title, cells)."""
    rows, section = {}, ""
    for line in text.splitlines():
        if line.startswith("## "):
            section = line[3:]
        match = re.match(r"\| `([\w.]+)` \| (.*) \|$", line)
        if match:
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", match.group(2))]
            rows[(section, match.group(1))] = cells
    return rows


def test_the_page_is_what_the_code_generates(page):
    generated = config_docs.render()
    diff = "\n".join(config_docs.check(config_docs.PAGE)[:40])
    assert page == generated, f"docs/configuration.md is stale: run `{config_docs.COMMAND}`\n{diff}"


def test_every_application_setting_has_a_row_with_its_meaning(page):
    rows = _rows(page)
    names = [s.name for s in settings()]
    assert {"model", "grpc.port", "speculative.algorithm", "router.policy", "tracing.exporter"} <= set(names)
    titles = {title for title, _ in config_docs.SECTIONS.values()}
    for setting in settings():
        found = [cells for (section, name), cells in rows.items() if name == setting.name and section in titles]
        assert len(found) == 1, f"{setting.name}: {len(found)} rows in docs/configuration.md"
        _, default, meaning = found[0]
        assert meaning, f"{setting.name}: no meaning on the page"
        assert (default == "*required*") == setting.required, f"{setting.name}: default {default}"


def test_every_engine_argument_has_a_row_with_its_meaning(page):
    rows = _rows(page)
    params = [p for p in inspect.signature(Engine.__init__).parameters if p != "self"]
    assert {"model", "tp", "speculative", "overlap_schedule"} <= set(params)
    for name in params:
        cells = rows.get(("In-process Engine", name))
        assert cells is not None, f"Engine({name}=...) has no row in docs/configuration.md"
        assert cells[2], f"Engine({name}=...): no meaning on the page"


def test_engine_options_name_only_engine_arguments():
    params = set(inspect.signature(Engine.__init__).parameters)
    assert set(ENGINE_OPTIONS) <= params, f"stale entries: {sorted(set(ENGINE_OPTIONS) - params)}"


def test_the_speculative_settings_are_the_engines_speculative_options():
    """The page documents `Engine(speculative={...})` with the speculative settings' rows."""
    spec = {f.name: f for f in dataclasses.fields(SpecConfig)}
    assert list(spec) == list(SpeculativeArgs.model_fields)
    for name, field in SpeculativeArgs.model_fields.items():
        if not field.is_required():
            assert spec[name].default == field.default, f"speculative.{name}: SpecConfig and SpeculativeArgs differ"


def test_check_names_the_command_when_stale_and_passes_when_current(tmp_path, capsys):
    path = tmp_path / "configuration.md"
    path.write_text(config_docs.render().replace("tokens per KV page", "tokens in a page"), encoding="utf-8")
    assert config_docs.main(["--check", "--path", str(path)]) == 1
    err = capsys.readouterr().err
    assert "-| `page_size`" in err and config_docs.COMMAND in err
    assert config_docs.main(["--path", str(path)]) == 0
    assert config_docs.main(["--check", "--path", str(path)]) == 0


def test_a_setting_without_a_description_stops_the_generator(monkeypatch):
    bare = [dataclasses.replace(settings()[0], description="")]
    monkeypatch.setattr(config_docs, "settings", lambda: bare)
    with pytest.raises(ValueError, match=bare[0].name):
        config_docs.render()
