"""Every command block of the README runs verbatim, on the shipped sample: the blocks (``bash``; the
``zeppelin`` lines of the CI workflow) are run in order by one bash script in a scratch directory
laid out like a checkout, where the data files the recipes name (``data/lengths.parquet``,
``docs.parquet``: a Parquet column ``num_tokens``) are the shipped sample's lengths. A command
that fails, or a README block this test cannot find, fails it."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: README lines this test does not run, and why (each must still be in the README)
NOT_RUN = {"./dev test": "runs this test suite, which holds this test"}
#: what a scratch checkout holds (links to the real one)
LINKED = ("dev", "pyproject.toml", "setup.py", "schemas", "plans", "examples", "planner", "runtime", ".venv")


def command_blocks(text: str) -> list[str]:
    """The README's bash blocks and, from its YAML workflow, the ``run: zeppelin ...`` lines."""
    blocks = re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M)
    for yaml in re.findall(r"^```yaml\n(.*?)^```", text, flags=re.S | re.M):
        runs = [m.group(1) for m in re.finditer(r"^\s*- run: (zeppelin .*?)\s*(?:#.*)?$", yaml, flags=re.M)]
        if runs:
            blocks.append("\n".join(runs) + "\n")
    return blocks


def script(blocks: list[str]) -> str:
    lines = []
    for block in blocks:
        for line in block.splitlines():
            if line.split("#")[0].strip() in NOT_RUN:
                continue
            lines.append(line)
    # (bash takes no PS4 from the environment when run as root: the trace's clock is set here)
    return ("set -euo pipefail\nPS4='+ [$SECONDS s] '\nexport PATH=\"$PWD/.venv/bin:$PATH\"\n"
            + "\n".join(lines) + "\n")


def _data(work: Path) -> None:
    import pyarrow as pa  # (a dev dependency)
    import pyarrow.parquet as pq

    from zeppelin.schemas.io.datasets import default_manifest_path

    rows = [json.loads(ln) for ln in default_manifest_path().read_text().splitlines()]
    lengths = [r["length"] for r in rows if "length" in r]
    table = pa.table({"num_tokens": lengths})
    (work / "data").mkdir()
    pq.write_table(table, work / "data" / "lengths.parquet")
    pq.write_table(table, work / "docs.parquet")


def test_the_readme_names_what_it_does_not_run():
    text = (ROOT / "README.md").read_text()
    blocks = command_blocks(text)
    assert len(blocks) >= 5
    for line in NOT_RUN:
        assert any(line in b for b in blocks), line


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_every_readme_command_block_runs_verbatim(tmp_path):
    if not (ROOT / ".venv" / "bin" / "zeppelin").exists():
        pytest.fail("no .venv: run ./dev setup (the README's commands use .venv/bin/zeppelin)")
    # the scratch checkout links this .venv: with a stale install stamp, its `./dev demo` would
    # reinstall the project from the scratch checkout and leave .venv pointing there
    import hashlib

    stamp = ROOT / ".venv" / ".zeppelin-installed"
    want = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()[:16]
    if not stamp.exists() or stamp.read_text().strip() != want:
        pytest.fail(".venv is older than pyproject.toml: run ./dev setup first")
    work = tmp_path / "checkout"
    work.mkdir()
    for name in LINKED:
        (work / name).symlink_to(ROOT / name)
    _data(work)
    text = script(command_blocks((ROOT / "README.md").read_text()))
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="80", PYTHONUNBUFFERED="1")
    log = work / "readme.log"  # every command (with the seconds since the start) and its output
    with open(log, "w") as fh:
        r = subprocess.run(["bash", "-x", "-c", text], cwd=work, env=env, stdout=fh, stderr=subprocess.STDOUT,
                           timeout=2300)
    assert r.returncode == 0, log.read_text()[-5000:]
    for made in ("plan.jsonl", "plan.png", "cpu.jsonl", "prof.json", "ci/plans/a16.json", "ci/plans/a16.plan"):
        assert (work / made).is_file(), made
