"""Source style: no line of the repository's Python files is longer than 120 characters (the
readability standard the code is written to), checked without processes so that it stays so."""
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("bench", "systems", "analysis", "workloads", "tests", "scripts")
MAX_LINE = 120
# what runs, installs and builds leave behind; a Python package of that name (bench/data) is source
SKIPPED = {".venv", "data", "results", "build"}


def _skipped(folder: Path) -> bool:
    return ((folder.name in SKIPPED or folder.name.endswith(".egg-info"))
            and not (folder / "__init__.py").is_file())


def _python_files() -> list[Path]:
    files = []
    for top in FOLDERS:
        for folder, dirs, names in os.walk(ROOT / top):
            dirs[:] = sorted(d for d in dirs if not _skipped(Path(folder, d)))
            files += [Path(folder, n) for n in sorted(names) if n.endswith(".py")]
    return files


def test_no_python_line_is_longer_than_120_characters():
    files = _python_files()
    assert any(f.name == "test_style.py" for f in files)          # the walk reaches the sources
    long = [f"{path.relative_to(ROOT)}:{i} ({len(line)} chars)"
            for path in files
            for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if len(line) > MAX_LINE]
    assert not long, f"{len(long)} line(s) over {MAX_LINE} characters:\n" + "\n".join(long)
