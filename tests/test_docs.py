"""The README and docs/ as a reader uses them: every link lands on a file and heading that exist, and every path or
make target a command names is in the repository, and what the README's layout table names is there (every module
of grpo/ among it), so a page cannot keep pointing at something moved or renamed."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")  # [text](target), ![alt](target)
# a path inside the repository as commands and prose write it (placeholders such as path/to/... are not)
REPO_PATH = re.compile(r"(?<![\w./-])((?:\.ci|configs|scripts|bench|tests|docs)/[\w./-]*\w)")
COMMAND = re.compile(r"^\s*(?:[A-Z_]+=\S*\s+)*(?:\.venv/bin/)?(python|torchrun|make|sbatch|srun|bash)\b")
ROOT_FILE = re.compile(r"(?<![\w./-])([\w-]+\.(?:py|yaml|txt))\b")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def headings(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)  # (a `# comment` in code is no heading)
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, flags=re.M)}


def commands(page: Path) -> list[str]:
    """Command lines: those in code blocks and indented blocks, and inline code that starts with a command."""
    text = page.read_text()
    found = [line for block in re.findall(r"^```\w*\n(.*?)^```", text, flags=re.S | re.M) for line in block.split("\n")]
    found += [line for line in text.split("\n") if line.startswith("    ") and COMMAND.match(line)]
    found += [span for span in re.findall(r"`([^`\n]+)`", text) if COMMAND.match(span)]
    return [c for c in found if COMMAND.match(c) or REPO_PATH.search(c)]


def make_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), flags=re.M))


def test_slug_matches_githubs_anchors():
    """Guards against the anchor check passing links that GitHub would not resolve, or failing good ones."""
    assert slug("Data: text-only rows and the peers' files") == "data-text-only-rows-and-the-peers-files"
    assert slug("The whole log of `make demo`") == "the-whole-log-of-make-demo"
    assert slug("Smaller GPUs: bf16 master weights and offloading") == "smaller-gpus-bf16-master-weights-and-offloading"


def test_every_link_resolves():
    """Guards against a link to a page, image or heading that was moved, renamed or never written."""
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):  # http(s), mailto: not this repository's
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in headings(dest):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert broken == []


def test_every_path_and_make_target_a_command_names_exists():
    """Guards against a command a reader copies failing on a path or make target the repository no longer has."""
    targets, missing = make_targets(), []
    for page in PAGES:
        paths = set(REPO_PATH.findall(page.read_text()))  # in prose too: a reader types what a page names
        for command in commands(page):
            paths |= set(REPO_PATH.findall(command))
            word = COMMAND.match(command)
            if word and word.group(1) in ("python", "torchrun"):
                paths |= set(ROOT_FILE.findall(command.split("#")[0]))
            if word and word.group(1) == "make":
                missing += [f"{page.name}: make {t}" for t in command.split("#")[0].split()[1:2] if t not in targets]
        missing += [f"{page.name}: {p}" for p in sorted(paths) if not (REPO / p).exists()]
    assert missing == []


def test_the_checks_see_the_commands():
    """Guards against a check that passes because it reads nothing: the README's own commands must be found."""
    found = commands(REPO / "README.md")
    assert any(c.startswith("make demo") for c in found) and any("configs/geo3k.yaml" in c for c in found)
    assert {"demo", "test", "demo-vision", "demo-video", "demo-lora", "bench"} <= make_targets()


def test_the_layout_table_names_what_the_repository_holds():
    """Guards against the README's layout going stale as files move: everything its table names exists (files git
    does not ignore), and it names every module of grpo/. What else a checkout holds is not checked: a fork's own
    folder (docs/reward.md's my_task/) is the fork's business."""
    import subprocess

    section = (REPO / "README.md").read_text().split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"^\| `([\w./-]+)` \|", section, flags=re.M))
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    files = [f for f in listed if (REPO / f).is_file()]  # a file deleted but not yet staged is gone
    here = set(files) | {f.split("/")[0] + "/" for f in files if "/" in f}
    modules = {f for f in files if re.fullmatch(r"grpo/\w+\.py", f) and f != "grpo/__init__.py"}
    assert {"train_grpo.py", "grpo/"} <= named  # the table is there and the pattern still reads it
    missing, gone = sorted(modules - named), sorted(named - here)
    assert (missing, gone) == ([], []), f"modules not in the layout table: {missing}; in it but not here: {gone}"


def test_every_cited_page_is_in_the_repository():
    """Guards against a citation of a page the repository does not have (code and configs once cited a notes file
    kept outside it): every page ending in .md that a tracked file names is a file here, by its path from the
    repository's root, from the citing file, or in docs/. (This file is left out: it names a missing one below.)"""
    import subprocess

    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    cited = re.compile(r"(?<![\w./-])([\w./-]*\w\.md)\b")
    missing = []
    for name in tracked:
        path = REPO / name
        if path.suffix in (".png", ".parquet") or not path.is_file() or name == "tests/test_docs.py":
            continue
        for target in set(cited.findall(path.read_text(errors="replace"))):
            if target.startswith(("http", "//")) or "://" in target:
                continue
            if not any((base / target).is_file() for base in (REPO, path.parent, REPO / "docs")):
                missing.append(f"{name}: {target}")
    assert missing == []
    assert cited.findall("a (REFERENCE.md section 1) and docs/memory.md") == ["REFERENCE.md", "docs/memory.md"]
