"""The README and docs/ point only at what a user has: files of this repository."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_docs_point_at_files_that_exist_in_the_repository():
    for doc in DOCS:
        text = doc.read_text()
        assert "../shared" not in text and "DESIGN.md" not in text, doc
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):  # relative Markdown links
            assert (doc.parent / target).exists(), f"{doc.name} links to {target}, which does not exist"


def test_readme_keeps_two_set_up_commands():
    text = (REPO / "README.md").read_text()
    block = text.split("## Set up and run", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    assert [line.split()[0] for line in block.strip().splitlines()] == ["./scripts/serve", "./scripts/test"]
