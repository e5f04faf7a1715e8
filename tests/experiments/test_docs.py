"""Every `docs/*.md` page the code, the docs, the README or a committed result names exists, and every
relative link of a docs page resolves."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC_PATH = re.compile(r"docs/[A-Za-z0-9_./-]+?\.md")


def sources() -> list[Path]:
    code = [p for d in ("lrmoe", "paper_figures", "ablations") for p in sorted((ROOT / d).rglob("*"))
            if p.suffix in (".py", ".toml", ".md")]
    return code + sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"] + sorted((ROOT / "results").rglob("*.md"))


def missing_doc_paths(files) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for f in files:
        for m in DOC_PATH.findall(f.read_text(errors="replace")):
            if not (ROOT / m).is_file():
                out.setdefault(m, []).append(str(f))
    return out


def test_every_named_docs_page_exists():
    files = sources()
    assert any(f.name == "stats.py" for f in files) and any("results" in f.parts for f in files)
    missing = missing_doc_paths(files)
    assert not missing, f"docs pages named but absent (page: where): {missing}"


def test_the_check_finds_a_missing_page(tmp_path):
    f = tmp_path / "x.py"
    f.write_text('"""see docs/statistics.md, ../docs/results.md and docs/no_such_page.md"""')
    assert missing_doc_paths([f]) == {"docs/no_such_page.md": [str(f)]}


def test_docs_links_resolve():
    broken = []
    for page in sorted((ROOT / "docs").glob("*.md")):
        for link in re.findall(r"\]\(([^)#\s]+)", page.read_text()):
            if not link.startswith(("http://", "https://", "mailto:")) and not (page.parent / link).exists():
                broken.append(f"{page.name}: {link}")
    assert not broken, broken
