"""What a new user meets in the first hour: a model that does not fit is refused in one line with
the real reason and a remedy the command takes; a measured profile of another device or model is
refused (``--force-profile`` uses it anyway); ``run`` reads text data with ``plan``'s field flags
and a bad ``--data`` is refused once, by the launcher, before any process starts."""

from __future__ import annotations

import json
import subprocess

from tests.support.cli import run_cli
from zeppelin.schemas.profile import ModelFits, PolyFit, ProfileSource, default_profile


def test_a_model_that_does_not_fit_is_refused_with_the_reason_and_a_remedy(tmp_path, capsys):
    out_file = tmp_path / "p.jsonl"
    code, out, err = run_cli(["plan", "-c", "h100:1x1", "--model", "llama-30b", "--steps", "2", "-o", str(out_file)],
                             capsys)
    assert (code, err) == (2, "zeppelin: error: model llama-30b does not fit cluster h100:1x1: its model states take "
                              "587.0 GB of a GPU's 76.0 GB (ZeRO stage 1, tp 1, 1 data-parallel unit(s)), leaving no "
                              "room for activations; no ZeRO stage or TP degree within a node makes room: use a "
                              "cluster with more GPUs or more memory\n")
    assert not out_file.exists()
    code, out, err = run_cli(["compare", "-c", "h100:1x2", "--model", "llama3-8b", "--steps", "2"], capsys)
    assert (code, out) == (2, "")
    assert err == ("zeppelin: error: model llama3-8b does not fit cluster h100:1x2: its model states take 81.8 GB of "
                   "a GPU's 76.0 GB (ZeRO stage 1, tp 1, 2 data-parallel unit(s)), leaving no room for activations; "
                   "--zero-stage 3 leaves 855 tokens per GPU\n")
    # the remedy named is one the command takes: the same problem now has room
    code, out, err = run_cli(["plan", "-c", "h100:1x2", "--model", "llama3-8b", "--zero-stage", "3", "--explain"],
                             capsys)
    assert code == 0, err


def _measured(tmp_path, machine: str, model: str = "tiny"):
    prof = default_profile("local-cpu", "cpu").model_copy(update={
        "source": ProfileSource(kind="measured", machine=machine, created_at="2026-01-01"),
        "fits": [ModelFits(model=model, dtype="float32", attention=PolyFit(coeffs=[0.0, 1e-6]),
                           linear=PolyFit(coeffs=[0.0, 1e-7]))]})
    path = tmp_path / "prof.json"
    path.write_text(prof.model_dump_json())
    return path


def test_a_profile_of_another_device_or_model_is_refused(tmp_path, capsys):
    prof = _measured(tmp_path, "box (cpu, 2 ranks)")
    flags = ["--steps", "1", "--tokens-per-step", "4096", "--max-seq-len", "2048", "--profile", str(prof), "--explain"]
    code, out, err = run_cli(["plan", "-c", "h100:2", "--model", "tiny", *flags], capsys)
    assert (code, err) == (2, f"zeppelin: error: --profile {prof} was measured on CPUs (box (cpu, 2 ranks)) but "
                              f"--cluster h100:2 has GPUs: profile the cluster's machines; or pass --force-profile to "
                              f"use it anyway\n")
    code, out, err = run_cli(["compare", "-c", "local-cpu:1x2", "--model", "small", *flags[:-1]], capsys)
    assert (code, err) == (2, f"zeppelin: error: --profile {prof} holds kernel fits of model tiny, not of --model "
                              f"small (small): measure it with `zeppelin profile --model small`; or pass "
                              f"--force-profile to use it anyway\n")
    code, out, err = run_cli(["plan", "-c", "h100:2", "--model", "tiny", *flags, "--force-profile"], capsys)
    assert code == 0, err
    code, out, err = run_cli(["plan", "-c", "local-cpu:1x2", "--model", "tiny", *flags], capsys)  # the same kind
    assert code == 0, err


def test_run_reads_text_data_with_the_field_flags_and_refuses_once(zeppelin_bin, tmp_path):
    data = tmp_path / "code.jsonl"
    words = "def f ( x ) : return x + 1".split()
    data.write_text("".join(json.dumps({"text": " ".join(words * (3 + k % 5))}) + "\n" for k in range(64)))
    plan = tmp_path / "p.jsonl"
    fields = ["--text-field", "text", "--tokenizer", "whitespace"]
    r = subprocess.run([zeppelin_bin, "plan", "-c", "local-cpu:1x2", "--model", "tiny", "-m", str(data), *fields,
                        "--steps", "1", "--tokens-per-step", "256", "-q", "-o", str(plan)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([zeppelin_bin, "run", str(plan), "--data", str(data), "--progress", "none"],
                       capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stderr) == (2, f"zeppelin: error: {data}: field 'length' not found at line 1 (fields: "
                                           f"text); "
                                           f"read --data with the field flags `zeppelin plan` took (--length-field, "
                                           f"--ids-field, or --text-field with --tokenizer)\n")
    r = subprocess.run([zeppelin_bin, "run", str(plan), "--data", str(data), *fields, "--progress", "none"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


JOB = """
[plan]
cluster = "local-cpu:1x2"
model = "tiny"
steps = 2
tokens_per_step = 1024
max_seq_len = 512
families = "none"
output = "job.plan.jsonl"
quiet = true

[run]
lr = 3e-3
progress = "none"
checkpoint_dir = "ck"
"""


def _losses(path) -> list[float]:
    return [json.loads(ln)["loss"] for ln in path.read_text().splitlines() if '"loss"' in ln]


def test_a_job_file_drives_plan_and_run_and_a_longer_plan_resumes(zeppelin_bin, tmp_path):
    """One job file for plan and run (a flag wins over it); the run continues with --resume on the
    plan extended by two steps (its first steps byte-identical) and gives the losses of an
    uninterrupted run of the longer plan."""
    from zeppelin.schemas.plan import PlanReader

    (tmp_path / "job.toml").write_text(JOB)

    def z(*args, timeout=300):
        r = subprocess.run([zeppelin_bin, *args], cwd=tmp_path, capture_output=True, text=True, timeout=timeout)
        assert r.returncode == 0, (args, r.stderr[-2000:])
        return r

    z("plan", "--config", "job.toml")
    z("plan", "--config", "job.toml", "--steps", "4", "-o", "long.plan.jsonl")  # the flag wins over the file
    short, long_ = PlanReader(tmp_path / "job.plan.jsonl"), PlanReader(tmp_path / "long.plan.jsonl")
    assert (short.header.num_steps, long_.header.num_steps) == (2, 4)
    assert [s.model_dump_json() for s in short] == [s.model_dump_json() for s in list(long_)[:2]]
    z("run", "--config", "job.toml")                                    # job.plan.jsonl, checkpoint after step 1
    r = z("run", "long.plan.jsonl", "--config", "job.toml", "--resume")  # steps 2 and 3 on the longer plan
    assert "resuming at step 2" in r.stdout + r.stderr
    z("run", "long.plan.jsonl", "--config", "job.toml", "--checkpoint-dir", "ck2", "--metrics", "full.jsonl")
    full = _losses(tmp_path / "full.jsonl")
    assert _losses(tmp_path / "job.plan.metrics.jsonl") + _losses(tmp_path / "long.plan.metrics.jsonl") == full
    assert len(full) == 4


def test_config_dump_and_a_bad_job_file(tmp_path, capsys):
    code, out, err = run_cli(["config", "--dump"], capsys)
    assert code == 0 and "[plan]\n" in out and "[run]\n" in out and 'planner = "zeppelin"\n' in out
    assert "\n# tokens_per_step =\n" in out and "\nlr = 0.001\n" in out
    import tomllib

    assert set(tomllib.loads(out)) == {"plan", "compare", "demo", "run"}
    bad = tmp_path / "bad.toml"
    bad.write_text('[plan]\nclusters = "h100"\n')
    code, out, err = run_cli(["plan", "--config", str(bad)], capsys)
    assert (code, err) == (2, f"zeppelin: error: {bad}: [plan] has no key 'clusters' (`zeppelin config --dump` "
                              f"lists them)\n")


def test_a_model_directory_is_pointed_to_hf(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "Llama-3-8B").mkdir()
    (tmp_path / "Llama-3-8B" / "config.json").write_text("{}")
    code, out, err = run_cli(["plan", "-c", "h100:1", "--model", "Llama-3-8B", "--explain"], capsys)
    assert (code, err) == (2, "zeppelin: error: model 'Llama-3-8B' is a directory: a Hugging Face model directory is "
                              "named hf:DIR; did you mean hf:Llama-3-8B?\n")
    code, out, err = run_cli(["plan", "--help"], capsys)
    assert "hf:DIR" in out


def test_compare_answers_for_the_users_baseline_as_planned_by_hand(tmp_path, capsys):
    """compare with the job's memory setting and the baseline's CP size (-O te-cp.cp=8) gives the
    speedup that planning both by hand and simulating them gives, and prints the CP size."""
    flags = ["-c", "zeppelin-a:2", "--model", "llama-7b", "--steps", "2", "--tokens-per-step", "131072",
             "--max-seq-len", "32768", "--recompute", "selective"]
    means = {}
    for planner, option in (("zeppelin", []), ("te-cp", ["-O", "cp=8"])):
        out_file = tmp_path / f"{planner}.jsonl"
        code, out, err = run_cli(["plan", *flags, "--planner", planner, *option, "-q", "-o", str(out_file)], capsys)
        assert code == 0, err
        code, out, err = run_cli(["simulate", str(out_file), "--json"], capsys)
        means[planner] = json.loads(out)["summary"]["mean_step_time_s"]
    code, out, err = run_cli(["compare", *flags, "--planners", "zeppelin,te-cp", "--baseline", "te-cp",
                              "-O", "te-cp.cp=8", "-j", "1", "--json"], capsys)
    assert code == 0, err
    row = json.loads(out)["verdict"]["rows"][0]
    assert row["baseline"] == "te-cp" and abs(row["speedup"] - means["te-cp"] / means["zeppelin"]) < 1e-9
    assert "recompute selective" in err and "te-cp CP 8 (cp=8)" in " ".join(err.split())
