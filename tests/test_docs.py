"""The docs stay true to the code: the quick config documents every key, and the code cites files that exist."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from pydantic import BaseModel

import dturbo
from dturbo.settings import load_config

ROOT = Path(__file__).resolve().parents[1]
QUICK = ROOT / "configs" / "fmnist_quick.toml"

_HEADER = re.compile(r"^\s*#?\s*\[([A-Za-z0-9_.]+)\]\s*(#.*)?$")
_KEY = re.compile(r"^\s*#?\s*([A-Za-z_][A-Za-z0-9_]*)\s*=")


def documented_keys(text: str) -> dict[str, set[str]]:
    """Keys per section named in a TOML text, set or commented out (``# [faults]``, ``# drop_prob = 0.0``)."""
    keys: dict[str, set[str]] = {"": set()}
    section = ""
    for line in text.splitlines():
        if m := _HEADER.match(line):
            section = m.group(1)
            keys.setdefault(section, set())
        elif m := _KEY.match(line):
            keys[section].add(m.group(1))
    return keys


def config_fields(model: type[BaseModel] | None = None, prefix: str = "") -> dict[str, set[str]]:
    """Every field of every section model under ``model``, by dotted section name (sub-sections recursively)."""
    out: dict[str, set[str]] = {prefix: set()} if prefix else {}
    model = model or dturbo.Config
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out.update(config_fields(ann, f"{prefix}.{name}" if prefix else name))
        else:
            out.setdefault(prefix, set()).add(name)
    return out


def test_config_fields_walks_every_section():
    fields = config_fields()
    assert {"experiment", "faults", "dturbo", "dturbo.sparsity", "dturbo.prior.conv", "dturbo.prior.dense",
            "fedavg", "fedpaq", "dssm"} <= set(fields)
    assert "sparsity" not in fields["dturbo"] and "tie_rows" in fields["dturbo.prior.dense"]
    assert fields.get("", set()) == set()  # Config itself holds sections only


def test_quick_config_documents_every_key():
    """README: configs/fmnist_quick.toml lists every key (the ones it does not set commented out). A key added
    to dturbo.config and not documented there fails here."""
    documented = documented_keys(QUICK.read_text())
    missing = [f"{section}.{key}" if section else key
               for section, keys in sorted(config_fields().items()) for key in sorted(keys)
               if key not in documented.get(section, set())]
    assert not missing, f"document these keys in {QUICK.name} (commented, with their default): {missing}"
    unknown = [f"{s}.{k}" for s, keys in documented.items() for k in keys if k not in config_fields().get(s, set())]
    assert not unknown, f"{QUICK.name} names keys the config does not have: {unknown}"


def test_documented_keys_sees_commented_lines_and_misses_absent_ones():
    text = "[a]\nx = 1  # y = 2\n# z = 3\n# [b.c]   # note\n#w=4\n# prose: not a key\n"
    assert documented_keys(text) == {"": set(), "a": {"x", "z"}, "b.c": {"w"}}


def test_quick_config_commented_keys_are_only_comments():
    """What runs is what is set: the commented keys leave the resolved config at its defaults."""
    data = tomllib.loads(QUICK.read_text())
    cfg = load_config(QUICK)
    assert "faults" not in data and "fedavg" not in data and "hidden" not in data["model"]
    assert cfg.model.hidden == dturbo.Config().model.hidden and cfg.faults == dturbo.Config().faults


# ------------------------------------------------------------------ citations
_FOREIGN = re.compile(r"\bSPEC\.md\b|\bDESIGN(\.md)?\b|\bSPEC [0-9E]|\bSPEC sections?\b|\(SPEC\)")
_DOC_PATH = re.compile(r"docs/[A-Za-z0-9_./-]+\.md")


def _sources() -> list[Path]:
    return sorted((ROOT / "src").rglob("*.py"))


def test_no_source_cites_files_outside_the_repository():
    """SPEC.md and DESIGN.md are not in the repository: the code cites docs/algorithm.md and README.md."""
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
            for p in _sources() for i, line in enumerate(p.read_text().splitlines(), 1) if _FOREIGN.search(line)]
    assert not hits, "\n".join(hits)


def test_every_cited_doc_exists():
    cited = {m.group(0).rstrip(".") for p in _sources() for m in _DOC_PATH.finditer(p.read_text())}
    assert "docs/algorithm.md" in cited
    missing = sorted(c for c in cited if not (ROOT / c).is_file())
    assert not missing, missing


@pytest.mark.parametrize("line, bad", [("(SPEC 7.3-7.5)", True), ("see SPEC.md", True), ("(DESIGN.md)", True),
                                       ("SPEC_FILE = 'model.json'", False), ("docs/algorithm.md §7", False)])
def test_the_citation_pattern(line, bad):
    assert bool(_FOREIGN.search(line)) is bad


def test_algorithm_doc_keeps_sections_and_equations():
    text = (ROOT / "docs" / "algorithm.md").read_text()
    for n in range(1, 12):
        assert re.search(rf"^## {n}\. ", text, re.M), f"section {n}"
    for e in range(1, 7):
        assert f"(E{e})" in text, f"E{e}"


def test_local_sim_connection_is_the_same_in_readme_and_docs():
    """The Flower simulation federation (`[superlink.local-sim]`, for $FLWR_HOME/config.toml) shown in the README
    is docs/flower.md's, which tests/test_flower_sim.py runs."""
    def connection(path: Path) -> dict:
        blocks = [b for b in re.findall(r"```toml\n(.*?)```", path.read_text(), flags=re.S)
                  if "[superlink.local-sim]" in b]
        assert len(blocks) == 1, f"{path.name}: one local-sim block expected, found {len(blocks)}"
        return tomllib.loads(blocks[0])

    docs, readme = connection(ROOT / "docs" / "flower.md"), connection(ROOT / "README.md")
    assert docs == readme
    assert docs["superlink"]["local-sim"]["options"]["num-supernodes"] == load_config(
        ROOT / "configs" / "flower_sim100.toml").federation.clients
