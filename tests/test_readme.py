"""The README followed as a new user would: from a fresh clone, in a fresh virtualenv.

What a clone holds (the tracked files, and new ones git does not ignore) is copied into an
empty folder. The code blocks of the "Quickstart" and "Use it in your own graph" sections
then run in order, in one bash session (``set -euo pipefail``) started in that copy: shell
blocks exactly as written (the install line included: nothing is substituted), each Python
block saved, under the file name its first line gives, in the folder the session is in at
that point. The other install route, the wheel of ``make dist``, runs afterwards in the same
virtualenv with the package uninstalled first, so it is checked as written too without a
second download of every dependency.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"```(\w+)\n(.*?)```", re.DOTALL)
SECTIONS = ("## Quickstart", "## Use it in your own graph")
STEP = "=== README step {} ==="


def section(title: str) -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index(f"\n{title}\n")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def blocks(title: str) -> list[tuple[str, str]]:
    return FENCE.findall(section(title))


def _is_wheel(body: str) -> bool:
    return "make dist" in body


def test_sections_have_the_blocks_the_test_runs() -> None:
    """Install, the wheel alternative, a folder of one's own, the script and its commands;
    then langchain, the own-graph script and its commands."""
    assert [lang for lang, _ in blocks("## Quickstart")] == [
        "bash",
        "bash",
        "bash",
        "python",
        "bash",
    ]
    assert [lang for lang, _ in blocks("## Use it in your own graph")] == [
        "bash",
        "python",
        "bash",
    ]
    install = blocks("## Quickstart")[0][1]
    assert "pip install .\n" in install or "pip install .  " in install
    assert sum(_is_wheel(body) for _, body in blocks("## Quickstart")) == 1


def test_every_command_names_its_database() -> None:
    """The CLI's default database may change; the README's commands never rely on it."""
    commands = [
        line.strip()
        for title in SECTIONS
        for lang, body in blocks(title)
        if lang == "bash"
        for line in body.splitlines()
        if line.strip().startswith("taskpilots ")
    ]
    assert len(commands) >= 3
    for command in commands:
        assert "--db " in command, command


def test_no_links_to_places_that_do_not_exist() -> None:
    """No URL in the README or the package metadata but the local inbox: the project has
    no public home yet, and a link to a repository that does not exist misleads."""
    for path in ("README.md", "pyproject.toml"):
        for url in re.findall(r"https?://[^\s)\"'>`]+", (ROOT / path).read_text()):
            assert url.startswith("http://127.0.0.1"), f"{path}: {url}"


def _clone(target: Path) -> None:
    """Copy what a fresh clone would hold: tracked files and unignored new ones."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():  # a file deleted in the working tree is not in a clone
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)


def _script(clone: Path) -> str:
    lines = ["set -euo pipefail"]
    wheel: str | None = None
    step = 0
    for title in SECTIONS:
        for lang, body in blocks(title):
            if lang == "bash" and _is_wheel(body):
                wheel = body
                continue
            step += 1
            lines.append(f"echo '{STEP.format(step)}'")
            if lang == "python":
                name = body.splitlines()[0].removeprefix("# ").split(":")[0].strip()
                assert name.endswith(".py"), f"a Python block must start with '# <file>.py': {name}"
                lines.append(f"cat > {name} <<'README_PY_EOF'\n{body}README_PY_EOF")
            else:
                lines.append(body)
    assert wheel is not None
    lines += [
        f"echo '{STEP.format('wheel')}'",
        'HERE="$PWD"',
        f"cd '{clone}'",
        "pip uninstall -y -q taskpilots-graph",
        wheel,
        'cd "$HERE"',
        "python quickstart.py resume",
        "python -c 'import taskpilots_graph; print(\"installed at\", taskpilots_graph.__file__)'",
    ]
    return "\n".join(lines) + "\n"


def _steps(output: str) -> dict[str, str]:
    parts = re.split(r"^=== README step (\S+) ===$", output, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_readme_works_from_a_fresh_clone(tmp_path: Path) -> None:
    """Install from the clone, the Quickstart's crash and resume, ``taskpilots show`` and
    ``metrics``, the three ways into one's own graph under a crash, and the wheel."""
    if shutil.which("python3.11") is None:
        pytest.fail("python3.11 is required (the README's first command uses it)")
    clone = tmp_path / "taskpilots-graph"
    _clone(clone)
    (tmp_path / "steps.sh").write_text(_script(clone))
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    # The test runner's own virtualenv must not leak into the user's shell.
    env["PATH"] = os.pathsep.join(
        p for p in env.get("PATH", "").split(os.pathsep) if not p.startswith(str(ROOT))
    )
    env.pop("TASKPILOTS_DB", None)
    done = subprocess.run(
        ["bash", str(tmp_path / "steps.sh")],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        timeout=840,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    steps = _steps(done.stdout)
    # 1 install, 2 cd, 3 quickstart.py, 4 crash + resume + show + metrics,
    # 5 langchain, 6 own_graph.py, 7 crash + run again + show, then the wheel.
    assert (clone / ".venv" / "bin" / "taskpilots").exists()
    quickstart = steps["4"]
    assert "killed" in quickstart, output[-6000:]
    assert "tickets: 1\nduplicate side effects: 0" in quickstart, quickstart
    # `taskpilots show`: the thread closed, its ticket committed in the ledger.
    assert re.search(r"\bt-1\b.*\bclosed\b", quickstart), quickstart
    assert re.search(r"create_ticket\s+committed", quickstart), quickstart
    assert "recovery metrics" in quickstart, quickstart
    own = steps["7"]
    assert "killed" in own, own
    for graph in ("tool-node", "executor", "middleware"):
        assert f"{graph}: create_ticket committed" in own, own
    assert "tickets: 4\nduplicate side effects: 0" in own, own
    assert "pre-check of create_ticket" in own, own  # `taskpilots show tool-node`
    wheel = steps["wheel"]
    assert list((clone / "dist").glob("taskpilots_graph-*-py3-none-any.whl")), wheel
    assert "tickets: 4" in wheel, wheel
    installed = re.search(r"installed at (\S+)", wheel)
    assert installed is not None, wheel
    assert "site-packages" in installed.group(1), wheel
