"""The README's quickstart, followed as a new user would: in a fresh virtualenv.

The code blocks of the "Quickstart" section are extracted and run in order in an empty
folder: the shell blocks with bash (``set -e``), the Python block saved under the file name
its first line gives. The one substitution: ``pip install taskpilots-graph`` installs this
checkout (the package index does not have it), as a regular, non-editable install.
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


def quickstart_blocks() -> list[tuple[str, str]]:
    text = (ROOT / "README.md").read_text()
    start = text.index("## Quickstart")
    end = text.index("\n## ", start + 1)
    return FENCE.findall(text[start:end])


def test_quickstart_has_install_script_and_commands() -> None:
    kinds = [lang for lang, _ in quickstart_blocks()]
    assert kinds == ["bash", "python", "bash"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_quickstart_works_in_a_fresh_virtualenv(tmp_path: Path) -> None:
    if shutil.which("python3.11") is None:
        pytest.fail("python3.11 is required (the README's first command uses it)")
    script = ["set -euo pipefail"]
    for lang, body in quickstart_blocks():
        if lang == "python":
            name = body.splitlines()[0].removeprefix("# ").split(":")[0].strip()
            assert name.endswith(".py"), f"the Python block must start with '# <file>.py': {name}"
            (tmp_path / name).write_text(body)
            continue
        script.append(body.replace("pip install taskpilots-graph", f"pip install -q '{ROOT}'"))
    (tmp_path / "steps.sh").write_text("\n".join(script))
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    # The test runner's own virtualenv must not leak into the user's shell.
    env["PATH"] = os.pathsep.join(
        p for p in env.get("PATH", "").split(os.pathsep) if not p.startswith(str(ROOT))
    )
    done = subprocess.run(
        ["bash", "steps.sh"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=840,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "killed" in done.stdout, output[-4000:]
    assert "tickets: 1" in done.stdout, output[-4000:]
    assert "duplicate side effects: 0" in done.stdout, output[-4000:]
    assert "recovery metrics" in done.stdout, output[-4000:]
    assert (tmp_path / ".venv" / "bin" / "taskpilots").exists()
