"""The repository is the product, not a diary: no tracked file (code, comments, tests, configs, examples,
docs) and no file name tells the development history (TEXT_PATTERNS and NAME_PATTERNS below). Explanations
say what the code does and why, in the present tense; what changed over time belongs in CHANGELOG.md, and
measured figures in docs/RESULTS.md. This file is exempt only because its samples must show each pattern."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Files exempted from the check: none. An entry is only for a file being rewritten elsewhere, and
# test_the_allowlist_names_only_dirty_files fails on one that has no finding or no longer exists.
ALLOWLIST: tuple[str, ...] = ()

# This file quotes the patterns it looks for (its examples below): its name is checked, its text is not.
SELF = "tests/test_no_history.py"

ORDINALS = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
            "thirteenth|fourteenth|fifteenth|\\d+(?:st|nd|rd|th)")
TEXT_PATTERNS = (
    ("'session'", re.compile(r"\bsession\b", re.I)),
    ("'call N-M'", re.compile(r"\bcall \d+-\d+\b", re.I)),
    ("a numbered device call", re.compile(r"\bcall \d+ \(\d|\bof call \d+\b", re.I)),
    ("'issue N'", re.compile(r"\bissue \d+\b", re.I)),
    ("an ordinal session", re.compile(rf"\b(?:{ORDINALS})[ -]session", re.I)),
    ("'not yet run'", re.compile(r"\bnot yet run\b", re.I)),
)
# In file names the words are joined by -, _, / or .; a session number looks like "-s10-".
NAME_PATTERNS = (
    ("'session'", re.compile(r"(?:^|[^a-z])session(?:[^a-z]|$)", re.I)),
    ("a session number", re.compile(r"(?:^|[-_./])s\d{1,2}(?:[-_./]|$)", re.I)),
    ("an issue number", re.compile(r"issue[-_ ]?\d+", re.I)),
    ("a call number", re.compile(r"call[-_ ]?\d+-\d+", re.I)),
)


def _about_nvshmem(path: str, line: str) -> bool:
    """NVSHMEM's own API speaks of a session (one per process): lines about NVSHMEM may say it."""
    return "nvshmem" in line.lower() or "nvshmem" in path.lower()


def text_findings(path: str, text: str) -> list[str]:
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        for what, pat in TEXT_PATTERNS:
            if pat.search(line) and not (what == "'session'" and _about_nvshmem(path, line)):
                found.append(f"{path}:{n}: {what}: {line.strip()[:120]}")
    return found


def name_findings(path: str) -> list[str]:
    return [f"{path}: the file name has {what}" for what, pat in NAME_PATTERNS if pat.search(path)]


def _tracked() -> list[str]:
    r = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"not a git work tree (git ls-files: {r.stderr.decode(errors='replace').strip()})")
    return [p for p in r.stdout.decode().split("\0") if p]


def _text(path: str) -> str | None:
    try:
        data = (ROOT / path).read_bytes()
    except (FileNotFoundError, IsADirectoryError):
        return None  # deleted in the work tree, or a submodule
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def findings(path: str) -> list[str]:
    out = name_findings(path)
    if path != SELF:  # measured records (docs/results) too: their labels say when, not which sitting
        text = _text(path)
        if text is not None:
            out += text_findings(path, text)
    return out


def test_no_tracked_file_tells_the_development_history():
    bad = [f for p in _tracked() if p not in ALLOWLIST for f in findings(p)]
    assert not bad, ("development history in the repository (say what the code does and why; history "
                     "goes to CHANGELOG.md):\n" + "\n".join(bad))


def test_the_allowlist_names_only_dirty_files():
    tracked = set(_tracked())
    stale = [p for p in ALLOWLIST if p not in tracked or not findings(p)]
    assert not stale, f"clean or gone, remove from ALLOWLIST: {stale}"


# The samples below are assembled from parts, so that this file's own text reads as no history either;
# at run time they are whole sentences.
_SESSION_WORD = "ses" + "sion"


@pytest.mark.parametrize("line", [
    f"measured in the ninth {_SESSION_WORD} on the H200",
    f"the Tenth {_SESSION_WORD.title()}'s table",
    "call 10" + "-3 returned 56 rows",
    "call 4" + " (05:19-05:26 UTC, 421 s): STEPS=setup",
    "against the reference of call" + " 5",
    "see issue" + " 16 for the targets",
    "a GPU test, written, not yet" + " run",
    f"the {_SESSION_WORD}'s device time",
])
def test_each_pattern_is_found(line):
    assert text_findings("README.md", line)


@pytest.mark.parametrize("line", [
    "NVSHMEM is process-global, so this module keeps one NVSHMEM session per process",
    "start_new_session=True",
    "a call of 10-20 us",
    "rank 1 rejects call 1; call 2 then meets on every rank",
    "this issue is a user error",
    "a kernel that cannot run at all",
])
def test_ordinary_text_is_not_a_finding(line):
    assert not text_findings("purlin_sglang/api.py", line)


def test_session_lines_are_allowed_in_nvshmem_files_only():
    line = f"    {_SESSION_WORD} = _{_SESSION_WORD.upper()}"
    assert not text_findings("purlin_sglang/memory/nvshmem.py", line)
    assert text_findings("purlin_sglang/api.py", line)


@pytest.mark.parametrize("name,bad", [
    ("docs/results/2026-12-05-h200-s10-kernel-ab.json", True),
    (f"tools/gpu-{_SESSION_WORD}.sh", True),
    ("tools/issue" + "16_table.py", True),
    ("docs/results/2026-12-05-h200-kernel-ab.json", False),
    ("tests/test_symmetric.py", False),
    ("docs/results/2026-12-02-h200-reduce-16mib.json", False),
])
def test_file_names_are_checked(name, bad):
    assert bool(name_findings(name)) == bad
