"""The project carries its own docs: every relative link in README.md and docs/ resolves in a
clone, and nothing points outside the repository."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_relative_links_resolve():
    broken = []
    for doc in DOCS:
        for target in LINK.findall(doc.read_text()):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue  # a URL or an anchor in the same page
            path = (doc.parent / target.split("#", 1)[0]).resolve()
            if not path.exists() or not path.is_relative_to(ROOT):
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert not broken


def test_no_reference_outside_the_repository():
    """Docs, code and help point only at what a clone has (no design notes kept elsewhere)."""
    code = [
        p
        for top in ("daemon", "kernels", "benchmarks", "scripts")
        for p in (ROOT / top).rglob("*")
        if p.is_file() and p.suffix in {".py", ".c", ".h", ".sh", ".md"} and ".work" not in p.parts
    ]
    for path in [*DOCS, *code]:
        text = path.read_text(errors="replace")
        assert not any(ref in text for ref in ("../shared", "DESIGN.md", "STYLE.md", "the seeds")), path


def test_readme_keeps_two_set_up_commands():
    text = (ROOT / "README.md").read_text()
    block = text.split("## Set up and run", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    assert [line.split()[0] for line in block.strip().splitlines()] == ["./scripts/serve", "./scripts/test"]


def test_no_merge_conflict_markers_left():
    """A half-resolved merge is not caught by any other test when it lands in prose or YAML."""
    marker = re.compile(r"^(<{7}|>{7}) ", re.M)
    suffixes = {".md", ".py", ".yaml", ".yml", ".toml", ".json", ".c", ".h", ".sh", ".service", ".socket"}
    hit = [
        str(path.relative_to(ROOT))
        for top in (
            "README.md",
            "docs",
            "daemon",
            "kernels",
            "configs",
            "tests",
            "benchmarks",
            "schemas",
            "scripts",
            "systemd",
            "deploy",
        )
        for path in ([ROOT / top] if (ROOT / top).is_file() else (ROOT / top).rglob("*"))
        # hidden folders hold what scripts fetched or built (benchmarks/peers/.work, .gpu), not the project's files
        if not any(part.startswith(".") for part in path.relative_to(ROOT).parts)
        and path.is_file()
        and path.suffix in suffixes
        and marker.search(path.read_text(errors="replace"))
    ]
    assert not hit
