"""`zeppelin plan --save-case DIR/NAME`: a `zeppelin check` case and its golden from the plan's own
flags; it checks green, and a planner option that slows the plan fails it with a line naming the
case, the step, the change and the option; `zeppelin schema case` exports the case's schema."""

from __future__ import annotations

import json

from tests.support.cli import run_cli

FLAGS = ["-c", "zeppelin-a:4", "--model", "llama-7b", "--steps", "2", "--tokens-per-step", "131072",
         "--max-seq-len", "32768"]


def test_saved_case_checks_green_then_fails_on_a_slower_option(tmp_path, capsys):
    target = tmp_path / "ci" / "a32"
    code, out, err = run_cli(["plan", *FLAGS, "--save-case", str(target)], capsys)
    assert code == 0, err
    case = json.loads((tmp_path / "ci" / "a32.json").read_text())
    assert {k: case[k] for k in ("cluster", "model", "dataset", "planner", "options", "steps", "tokens_per_step",
                                 "max_seq_len")} == {
        "cluster": "zeppelin-a:4", "model": "llama-7b", "dataset": "sample", "planner": "zeppelin", "options": {},
        "steps": 2, "tokens_per_step": 131072, "max_seq_len": 32768}
    assert out.startswith(f"wrote {target}.json and its golden {target}.plan")
    code, out, err = run_cli(["check", str(tmp_path / "ci"), "--exact", "-j", "1"], capsys)
    assert code == 0 and out.splitlines()[-1].startswith("1 case(s) checked in ")
    assert out.splitlines()[-1].endswith(": passed")
    # a planner setting that gives slower steps (here the tiered search alone, packed greedily)
    case["options"] = {"ilp": "never", "families": "none"}
    (tmp_path / "ci" / "a32.json").write_text(json.dumps(case))
    code, out, err = run_cli(["check", str(tmp_path / "ci"), "-j", "1"], capsys)
    assert code == 1
    flat = " ".join(out.split())  # (the FAIL line is wrapped at 80 columns)
    fail = flat[flat.index("FAIL a32: "):]
    assert "zeppelin mean step time" in fail and "against the golden" in fail and "(tolerance 1%)" in fail
    assert "; worst step " in fail and "planner options changed: families default -> none, ilp default -> never" \
        in fail


def test_case_records_field_flags_memory_setting_and_options(tmp_path, capsys):
    """A case holds what the plan depended on: the manifest's column, recompute, ZeRO stage, options."""
    from zeppelin.schemas.io.datasets import default_manifest_path

    rows = [json.loads(ln) for ln in default_manifest_path().read_text().splitlines()[1:400]]
    data = tmp_path / "data" / "docs.jsonl"
    data.parent.mkdir()
    data.write_text("".join(json.dumps({"num_tokens": r["length"]}) + "\n" for r in rows))
    flags = ["-c", "zeppelin-a:1", "--model", "llama-7b", "--steps", "2", "--tokens-per-step", "65536", "-m", str(data),
             "--length-field", "num_tokens", "--recompute", "selective", "--zero-stage", "2", "--no-shuffle",
             "--ilp", "never"]
    code, out, err = run_cli(["plan", *flags, "--save-case", str(tmp_path / "ci" / "c")], capsys)
    assert code == 0, err
    case = json.loads((tmp_path / "ci" / "c.json").read_text())
    assert {k: case[k] for k in ("dataset", "length_field", "recompute", "zero_stage", "shuffle", "options")} == {
        "dataset": str(data), "length_field": "num_tokens", "recompute": "selective", "zero_stage": 2,
        "shuffle": False, "options": {"ilp": "never"}}
    assert "ids_field" not in case and "overflow" not in case  # left at their defaults
    golden = (tmp_path / "ci" / "c.plan").read_text()
    assert '"recompute": "selective"' in golden and '"zero_stage": 2' in golden
    code, out, err = run_cli(["check", str(tmp_path / "ci"), "--exact", "-j", "1"], capsys)
    assert code == 0 and out.splitlines()[-1].endswith(": passed"), out + err
    case["recompute"] = "full"  # another memory setting: the golden no longer answers for the case
    (tmp_path / "ci" / "c.json").write_text(json.dumps(case))
    code, out, err = run_cli(["check", str(tmp_path / "ci"), "-j", "1"], capsys)
    assert code == 1
    assert "golden plan c.plan is stale (made for ZeRO stage 2 and recompute selective)" in " ".join(out.split())


def test_save_case_refuses_what_a_case_cannot_hold(tmp_path, capsys):
    code, out, err = run_cli(["plan", *FLAGS, "--seqs-per-step", "8", "--save-case", str(tmp_path / "c")], capsys)
    assert (code, err) == (2, "zeppelin: error: --save-case: a check case holds every planning flag but "
                              "--seqs-per-step; drop it\n")
    code, out, err = run_cli(["plan", *FLAGS, "--save-case", str(tmp_path / "c.json")], capsys)
    assert (code, err) == (2, f"zeppelin: error: --save-case takes DIR/NAME (NAME without an extension; got "
                              f"{str(tmp_path / 'c.json')!r})\n")
    assert list(tmp_path.iterdir()) == []


def test_schema_case(capsys):
    from zeppelin.planner.tools.check import CheckCase

    code, out, err = run_cli(["schema", "case"], capsys)
    assert code == 0 and json.loads(out) == CheckCase.model_json_schema()
