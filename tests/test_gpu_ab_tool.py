"""`tools/gpu_ab.sh`: the device machine's A/B of the working tree against older copies of
some of its files. Run here on a throwaway tree: each round sees the new files, then the old
ones, and the new ones are back afterwards, even when a command fails."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def tree(tmp_path: Path) -> tuple[Path, Path]:
    repo = tmp_path / "repo"
    (repo / "tools").mkdir(parents=True)
    shutil.copy(ROOT / "tools" / "gpu_ab.sh", repo / "tools" / "gpu_ab.sh")
    (repo / "pkg").mkdir()
    (repo / "pkg" / "kernel.cu").write_text("new\n")
    (repo / "pkg" / "other.py").write_text("untouched\n")
    old = tmp_path / "old"
    (old / "pkg").mkdir(parents=True)
    (old / "pkg" / "kernel.cu").write_text("old\n")
    return repo, old


def run(repo: Path, old: Path, out: Path, rounds: int, command: str) -> int:
    return subprocess.run(
        ["bash", str(repo / "tools" / "gpu_ab.sh"), str(old), str(out), str(rounds),
         "bash", "-c", command],
        capture_output=True, text=True,
    ).returncode  # fmt: skip


def test_rounds_alternate_new_and_old_files_and_restore_the_new(tmp_path: Path) -> None:
    repo, old = tree(tmp_path)
    out = tmp_path / "out"
    assert run(repo, old, out, 2, "cat pkg/kernel.cu pkg/other.py > {out}/seen") == 0
    for r in (1, 2):
        assert (out / f"new{r}" / "seen").read_text() == "new\nuntouched\n"
        assert (out / f"old{r}" / "seen").read_text() == "old\nuntouched\n"
    assert (repo / "pkg" / "kernel.cu").read_text() == "new\n"
    assert sorted(p.name for p in out.iterdir()) == ["new1", "new2", "old1", "old2"]


def test_a_failing_command_runs_every_round_then_fails_and_leaves_the_new_files(
    tmp_path: Path,
) -> None:
    repo, old = tree(tmp_path)
    out = tmp_path / "out"
    # fails on the old side only
    assert run(repo, old, out, 2, "grep -q new pkg/kernel.cu && touch {out}/ran") == 1
    assert (out / "new1" / "ran").exists() and (out / "new2" / "ran").exists()
    assert (repo / "pkg" / "kernel.cu").read_text() == "new\n"
