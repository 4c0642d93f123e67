"""Validation of every contract document: good documents load, bad ones give one-line messages."""

import json
import subprocess

import pytest

from zeppelin.schemas.cluster import CLUSTER_PRESETS, ClusterSpec, cluster_preset
from zeppelin.schemas.common import InputError, content_hash, validate_doc
from zeppelin.schemas.io.documents import load_doc
from zeppelin.schemas.manifest import ManifestSpec
from zeppelin.schemas.model import MODEL_PRESETS, ModelSpec, model_preset
from zeppelin.schemas.plan import InputHashes, PlanHeader, StepPlan
from zeppelin.schemas.profile import CostProfile, default_profile


def write(tmp_path, name, obj):
    p = tmp_path / name
    p.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return p


@pytest.mark.parametrize("name", CLUSTER_PRESETS)
def test_cluster_presets_round_trip(tmp_path, name):
    c = cluster_preset(name)
    p = write(tmp_path, "c.json", c.model_dump_json())
    back = load_doc(ClusterSpec, p)
    assert back == c
    assert content_hash(back) == content_hash(c)
    assert back.world_size == c.num_nodes * c.gpus_per_node


@pytest.mark.parametrize("name", MODEL_PRESETS)
def test_model_presets_round_trip(tmp_path, name):
    m = model_preset(name)
    assert load_doc(ModelSpec, write(tmp_path, "m.json", m.model_dump_json())) == m


def test_model_preset_parameter_counts():
    # independently known sizes (within 3%): LLaMA-7B 6.74B, LLaMA-13B 13.0B, Llama-3-8B 8.03B
    for name, expect in (("llama-7b", 6.74e9), ("llama-13b", 13.0e9), ("llama3-8b", 8.03e9)):
        assert abs(model_preset(name).num_params() / expect - 1) < 0.03, name


def test_cluster_preset_sizes():
    assert cluster_preset("zeppelin-a:8").world_size == 64
    c = cluster_preset("local-cpu:2x2")
    assert (c.num_nodes, c.gpus_per_node, c.device) == (2, 2, "cpu")
    a = cluster_preset("zeppelin-a")
    assert a.gpu_nic == ["nic0", "nic0", "nic1", "nic1", "nic2", "nic2", "nic3", "nic3"]
    assert a.nic_of(9) == "node1/nic0"
    assert len(cluster_preset("zeppelin-c").nics) == 8


def test_unknown_presets():
    with pytest.raises(InputError) as e:
        cluster_preset("nope")
    assert str(e.value) == (
        "unknown cluster preset 'nope' (known: zeppelin-a, zeppelin-b, zeppelin-c, flexsp-a100, h100, local-cpu)"
    )
    with pytest.raises(InputError) as e:
        model_preset("llama-70b")
    assert str(e.value).startswith("unknown model preset 'llama-70b' (known: llama-3b, llama-7b")


def test_cluster_missing_nic(tmp_path):
    d = cluster_preset("zeppelin-a").model_dump(mode="json")
    d["gpu_nic"][3] = "mlx5_9"
    p = write(tmp_path, "bad.json", d)
    with pytest.raises(InputError) as e:
        load_doc(ClusterSpec, p)
    assert str(e.value) == (
        f"{p}: invalid ClusterSpec: (document): gpu_nic[3] names NIC 'mlx5_9', which is not in nics "
        "(nic0, nic1, nic2, nic3)"
    )


def test_cluster_field_errors(tmp_path):
    d = cluster_preset("h100").model_dump(mode="json")
    d["num_nodes"] = 0
    d["gpu"]["peak_tflops"] = "fast"
    d["bogus"] = 1
    p = write(tmp_path, "bad.json", d)
    with pytest.raises(InputError) as e:
        load_doc(ClusterSpec, p)
    msg = str(e.value)
    assert "\n" not in msg
    assert "num_nodes: Input should be greater than or equal to 1" in msg
    assert "gpu.peak_tflops: Input should be a valid number" in msg
    assert "bogus: Extra inputs are not permitted" in msg


def test_malformed_json(tmp_path):
    p = write(tmp_path, "c.json", '{"name": "x",\n  "num_nodes": }')
    with pytest.raises(InputError) as e:
        load_doc(ClusterSpec, p)
    assert str(e.value) == f"{p}: malformed JSON at line 2 column 16: Expecting value"


def test_missing_file(tmp_path):
    with pytest.raises(InputError) as e:
        load_doc(ModelSpec, tmp_path / "none.json")
    assert str(e.value) == f"{tmp_path / 'none.json'}: file not found"


def test_wrong_schema_version(tmp_path):
    d = model_preset("tiny").model_dump(mode="json")
    d["schema_version"] = "zeppelin.model/9"
    with pytest.raises(InputError) as e:
        load_doc(ModelSpec, write(tmp_path, "m.json", d))
    assert "schema_version 'zeppelin.model/9' is not supported (this zeppelin reads 'zeppelin.model/1')" in str(e.value)


def test_model_shape_errors():
    d = model_preset("tiny").model_dump(mode="json")
    d["num_heads"] = 5
    with pytest.raises(InputError) as e:
        validate_doc(ModelSpec, d, source="m.json")
    assert str(e.value) == "m.json: invalid ModelSpec: (document): hidden (64) must be divisible by num_heads (5)"
    d = model_preset("tiny").model_dump(mode="json")
    d["num_kv_heads"] = 3
    with pytest.raises(InputError) as e:
        validate_doc(ModelSpec, d)
    assert str(e.value) == "invalid ModelSpec: (document): num_heads (4) must be a multiple of num_kv_heads (3)"


def test_profile_validation():
    d = default_profile().model_dump(mode="json")
    d["attention"]["eff_max"] = 1.5
    with pytest.raises(InputError) as e:
        validate_doc(CostProfile, d)
    assert str(e.value) == "invalid CostProfile: attention.eff_max: Input should be less than or equal to 1"
    assert validate_doc(CostProfile, default_profile("x", "cpu").model_dump(mode="json")).cluster == "x"


def test_manifest_spec_validation():
    with pytest.raises(InputError) as e:
        validate_doc(ManifestSpec, {"paths": ["a.jsonl"], "text_field": "text"})
    assert str(e.value) == (
        "invalid ManifestSpec: (document): text_field needs a tokenizer ('whitespace', 'bytes' or a tokenizer.json path)"
    )
    with pytest.raises(InputError) as e:
        validate_doc(ManifestSpec, {"paths": []})
    assert str(e.value) == "invalid ManifestSpec: paths: List should have at least 1 item after validation, not 0"


def _header(**kw):
    c = cluster_preset("local-cpu")
    m = model_preset("tiny")
    p = default_profile(c.name, "cpu")
    h = dict(planner="t", num_steps=1, world_size=c.world_size, cluster=c, model=m, profile=p,
             hashes=InputHashes(cluster=content_hash(c), model=content_hash(m), profile=content_hash(p), manifest="x"))
    h.update(kw)
    return h


def test_plan_header_world_size():
    with pytest.raises(InputError) as e:
        validate_doc(PlanHeader, json.loads(json.dumps(PlanHeader.model_construct(**_header()).model_dump(mode="json")
                                                       | {"world_size": 8})))
    assert str(e.value) == "invalid PlanHeader: (document): world_size 8 does not match the cluster (4 GPUs)"


def test_step_plan_validation_messages():
    with pytest.raises(InputError) as e:
        validate_doc(StepPlan, {"step": 0, "sequences": [{"sample_id": 1, "length": 0}],
                                "microbatches": [{"queues": [[]]}]})
    assert str(e.value) == "invalid StepPlan: sequences.0.length: Input should be greater than or equal to 1"
    bad_group = {"step": 0, "sequences": [{"sample_id": 1, "length": 4}],
                 "microbatches": [{"queues": [[0]], "groups": [{"kind": "local", "tier": "local", "units": [0, 1]}]}]}
    with pytest.raises(InputError) as e:
        validate_doc(StepPlan, bad_group)
    assert str(e.value) == "invalid StepPlan: microbatches.0.groups.0: a local group has exactly one unit"


@pytest.mark.parametrize("name", ["cluster", "model", "manifest", "profile", "plan", "step"])
def test_schema_export(zeppelin_bin, name):
    out = subprocess.run([zeppelin_bin, "schema", name], capture_output=True, text=True, check=True).stdout
    js = json.loads(out)
    assert js["type"] == "object" and "properties" in js


def test_schema_unknown(zeppelin_bin):
    r = subprocess.run([zeppelin_bin, "schema", "bogus"], capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip() == "zeppelin: error: unknown schema 'bogus' (known: cluster, model, manifest, profile, plan, step, case)"
    assert r.stdout == ""


def test_presets_dump_edit_and_reload(zeppelin_bin, tmp_path):
    out = tmp_path / "a.json"
    r = subprocess.run([zeppelin_bin, "presets", "--dump", "zeppelin-a:4", "-o", str(out)], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    d = json.loads(out.read_text())
    d["nics"][0]["bandwidth_GBps"] = 12.5
    out.write_text(json.dumps(d))
    from zeppelin.planner.core.inputs import resolve_cluster

    c = resolve_cluster(str(out))
    assert c.world_size == 32 and c.nics[0].bandwidth_GBps == 12.5
    r = subprocess.run([zeppelin_bin, "presets", "--dump", "nope"], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("zeppelin: error: unknown preset 'nope'")


def test_presets_listing(zeppelin_bin):
    r = subprocess.run([zeppelin_bin, "presets"], capture_output=True, text=True, env={"COLUMNS": "200", "PATH": ""})
    assert r.returncode == 0
    for n in CLUSTER_PRESETS + MODEL_PRESETS:
        assert n in r.stdout


def test_cli_rejects_bad_cluster_file_without_writing(zeppelin_bin, tmp_path):
    d = cluster_preset("zeppelin-a").model_dump(mode="json")
    d["gpu_nic"][5] = "mlx5_7"
    bad = write(tmp_path, "cluster.json", d)
    out = tmp_path / "plan.jsonl"
    for args in (["demo", "--cluster", str(bad), "--stages", "data"],
                 ["plan", "--cluster", str(bad), "--model", "tiny", "--steps", "1", "-o", str(out)]):
        r = subprocess.run([zeppelin_bin, *args], capture_output=True, text=True, cwd=tmp_path)
        assert r.returncode == 2, (args, r.stderr)
        assert r.stderr == (f"zeppelin: error: {bad}: invalid ClusterSpec: (document): gpu_nic[5] names NIC "
                            "'mlx5_7', which is not in nics (nic0, nic1, nic2, nic3)\n")
    assert not out.exists()
    bad.write_text('{"name": "x", ')
    r = subprocess.run([zeppelin_bin, "plan", "--cluster", str(bad), "--model", "tiny", "-o", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr == f"zeppelin: error: {bad}: malformed JSON at line 1 column 15: Expecting property name enclosed in double quotes\n"
    assert not out.exists()
