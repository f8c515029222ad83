"""The GPU kit and the GPU program, dry-run on CPU so they cannot rot (issues 24, 45): `make gpu-kit` fetches the
codec tier's wheels; deploy/gpu/program.sh runs first_contact.sh, which installs them into a private folder and
runs `python -m megapod.doctor --codec-only` where vLLM and the web stack cannot be imported (a bare GPU node has
neither), then the LLM tier's ceiling in plain PyTorch; the JSON holds every field a GPU run fills, the GPU-only
ones saying so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
KIT = ROOT / ".gpu-kit"
BLOCKED = ("vllm", "fastapi", "uvicorn", "httpx", "av", "soxr")
# The settings' packages: the node lacks them too, so they import only once the kit's folder is on the path.
KIT_ONLY = ("pydantic", "pydantic_core", "pydantic_settings", "dotenv", "typing_inspection", "annotated_types")
# Imported at start-up from PYTHONPATH: these top-level packages raise ImportError, as on the GPU node.
SITECUSTOMIZE = f"""
import importlib.abc, sys

class _NotOnTheGpuNode(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top in {BLOCKED!r}:
            raise ImportError(f"{{name}} is not installed on the GPU node")
        if top in {KIT_ONLY!r} and not any("megapod-gpu-site." in p for p in sys.path):
            raise ImportError(f"{{name}} is not installed on the GPU node (the kit brings it)")
        return None

sys.meta_path.insert(0, _NotOnTheGpuNode())
"""
CHECKS = {"codec_warm_up", "codec_graph_equals_eager", "codec_streaming_equals_full_decode", "codec_step_never_syncs",
          "codec_replica_serves"}


@pytest.fixture(scope="module")
def node_env(tmp_path_factory) -> dict[str, str]:
    """This environment as a bare GPU node sees it: the blocked packages raise on import."""
    blocker = tmp_path_factory.mktemp("gpu-node")
    (blocker / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return {**os.environ, "PYTHONPATH": str(blocker), "PYTHON": sys.executable}


@pytest.fixture(scope="module")
def program(node_env, tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    made = subprocess.run(["make", "gpu-kit"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert made.returncode == 0, made.stdout[-2000:] + made.stderr[-2000:]
    print(made.stdout[-600:])  # the kit's size
    out = tmp_path_factory.mktemp("gpu-program")
    ran = subprocess.run([str(ROOT / "deploy/gpu/program.sh"), str(out), "--device", "cpu"],
                         capture_output=True, text=True, timeout=900, env=node_env)
    assert ran.returncode == 0, ran.stdout[-4000:] + ran.stderr[-2000:]
    return ran, out


@pytest.fixture(scope="module")
def first_contact(program) -> tuple[str, Path]:
    """The program's first part: first_contact.sh's output and folder."""
    _, out = program
    return (out / "first-contact.log").read_text(), out / "first-contact"


@pytest.mark.parametrize("module", BLOCKED + KIT_ONLY)
def test_the_stand_in_node_cannot_import_the_llm_or_web_stack(node_env, module):
    """Else the dry-run below would prove nothing about a node without them."""
    done = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, env=node_env)
    assert done.returncode != 0 and "not installed on the GPU node" in done.stderr


def test_the_megapod_command_loads_no_web_stack_or_vllm_before_a_subcommand_needs_it(node_env):
    """`megapod doctor --codec-only` goes through megapod.cli, which imported uvicorn, FastAPI and httpx first."""
    done = subprocess.run([sys.executable, "-c", "import megapod.cli, megapod.doctor"], capture_output=True, text=True,
                          env=node_env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_kit_is_small_and_holds_the_codec_wheels(first_contact):
    wheels = sorted(p.name for p in KIT.glob("*.whl"))
    assert [w.split("-")[0] for w in wheels] == [
        "annotated_types", "grpcio", "grpcio_health_checking", "grpcio_reflection", "protobuf", "pydantic", "pydantic_core",
        "pydantic_settings", "python_dotenv", "snac", "typing_extensions", "typing_inspection"]
    assert all("cp312" in w or "abi3" in w or "py3-none-any" in w for w in wheels), wheels
    assert sum(p.stat().st_size for p in KIT.iterdir()) < 48 * 2**20


def test_first_contact_installs_the_kit_privately_and_prints_the_versions(first_contact):
    ran, out = first_contact
    versions = (out / "versions.txt").read_text()
    assert "gpu: " in versions and "snac 1.2.1" in versions and "protobuf 7.36.2" in versions
    # The pure-Python wheels fit any Python, so they come from the kit, into a folder of their own.
    installed = next(line for line in versions.splitlines() if line.startswith("installed from the kit"))
    assert "snac-1.2.1-py3-none-any.whl" in installed and "megapod-gpu-site." in installed
    assert "doctor exit status 0" in ran


def test_the_program_runs_every_part_and_says_so(program):
    ran, out = program
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] and list(summary["parts"]) == ["first-contact", "snac-replicas", "llm-ceiling"]
    assert all(p["exit_status"] == 0 and 0 < p["seconds"] < p["limit_s"] for p in summary["parts"].values())
    assert {"first-contact/doctor.json", "snac-replicas.json", "llm-ceiling.json", "first-contact.log"} <= set(summary["files"])
    assert "llm-ceiling: exit status 0" in ran.stdout


def test_the_llm_ceiling_names_every_gpu_figure_and_runs_its_code_on_a_tiny_model(program):
    _, out = program
    ceiling = json.loads((out / "llm-ceiling.json").read_text())
    assert ceiling["arch"]["layers"] == 28 and ceiling["arch"]["vocab"] == 156940  # the figures' model: Orpheus 3B
    grid = ceiling["figures"]
    assert set(grid) == {"bf16", "fp8"} and all(set(heads) == {"full", "audio"} for heads in grid.values())
    named = [f for heads in grid.values() for contexts in heads.values() for batches in contexts.values()
             for f in batches.values()]
    assert len(named) == 2 * 2 * 3 * 8 and set(named) == {"not measured: cpu"}
    assert set(grid["bf16"]["full"]) == {"300", "600", "1200"} and "512" in grid["bf16"]["full"]["1200"]
    tiny = ceiling["dry_run"]["figures"]  # the same code eager on a tiny model: bf16 and FP8 (torch._scaled_mm), both heads
    timed = [f for heads in tiny.values() for contexts in heads.values() for batches in contexts.values()
             for f in batches.values()]
    assert len(timed) == 2 * 2 * 2 and all(f["step_ms"] > 0 and f["bytes_read_gb"] >= 0 for f in timed), tiny


def test_the_replicas_benchmark_names_the_megapods_layout_and_drives_real_replicas(program):
    """On a GPU: 1 and 3 replicas; here the same processes (snac-server started as a pod starts it, client processes
    of their own) on the small codec, 1 and 2 replicas, 2 streams."""
    _, out = program
    replicas = json.loads((out / "snac-replicas.json").read_text())
    assert replicas["figures"] == {"1": "not measured: cpu", "3": "not measured: cpu"}
    assert replicas["megapod_streams"] == 1750 and replicas["mps"].startswith("not measured")
    for n, layout in replicas["dry_run"].items():
        (level,) = layout["levels"]
        assert layout["replicas"] == int(n) and level["streams"] == 2 and level["complete_streams"] == 2, layout
        # Whether 2 streams keep real time is the machine's load, not the code's (it failed once in CI under the
        # suite's load): the verdict must follow from the gaps measured, and every stream must get all its audio.
        assert level["holds"] == (level["gapped_streams"] == 0) and not level["errors"], level
        assert layout["realtime_streams"] == (2 if level["holds"] else 0) and level["first_audio_p50_s"] > 0
    assert sorted(replicas["dry_run"]) == ["1", "2"]


def test_the_codec_only_doctor_passes_and_writes_every_field(first_contact):
    _, out = first_contact
    report = json.loads((out / "doctor.json").read_text())
    assert report["codec_only"] and set(report["checks"]) == CHECKS, report["checks"]
    assert report["ok"] and all(c["ok"] for c in report["checks"].values())
    warm = report["checks"]["codec_warm_up"]
    assert warm["batch_ladder"] == [1, 2] and warm["frame_buckets"] == [1, 2, 4, 8, 16] and warm["reference_window"] == 4
    assert warm["state_kib_per_stream"] > 400 and warm["seconds"] > 0
    codec = report["figures"]["codec"]
    for kind in ("streaming", "reference"):
        timed = codec["float32"][kind]
        assert set(timed["step_ms"]) == {"1", "2"} and all(ms > 0 for ms in timed["step_ms"].values())
        assert timed["realtime_streams"] == max(timed["audio_s_per_s"].values()) > 0
    assert 30 < codec["bfloat16"]["snr_db_to_fp32"] < 50 < codec["float16"]["snr_db_to_fp32"]
    assert codec["chosen_precision"]["dtype"] == "float32"  # no half precision was timed on a CPU
    assert warm["compiled_step"] is False  # a CPU's replica does not compile (compile_step auto)
    streamed = report["checks"]["codec_streaming_equals_full_decode"]
    assert 0 < max(streamed["max_abs_diff"].values()) <= streamed["tolerance"]
    served = report["checks"]["codec_replica_serves"]
    assert served["streams"] == 2 and served["max_abs_diff"] <= served["tolerance"]
    assert report["checks"]["codec_step_never_syncs"]["detector_findings"] == []


def test_gpu_only_fields_say_not_measured_on_cpu(first_contact):
    _, out = first_contact
    report = json.loads((out / "doctor.json").read_text())
    gpu_only = [report["checks"]["codec_warm_up"]["graph_pool_mib"], report["checks"]["codec_warm_up"]["peak_allocated_mib"],
                report["checks"]["codec_graph_equals_eager"]["detail"], report["checks"]["codec_step_never_syncs"]["cuda_sync_debug"],
                report["figures"]["codec"]["bfloat16"]["speed"], report["figures"]["codec"]["float16"]["speed"],
                report["figures"]["codec"]["float32_eager"]["speed"]]
    assert gpu_only == ["not measured: cpu"] * 7
    assert report["checks"]["codec_warm_up"]["cuda_graphs"] == 0
    assert not {"llm_engine_starts", "attention"} & {*report["checks"], *report}


def test_a_codec_figure_that_failed_is_reported_not_a_crash(monkeypatch):
    """A timing that raised leaves its error where its figures would be; the report is still written."""
    from megapod import doctor
    from snac_server import selfcheck as codec

    error = {"ok": False, "detail": "RuntimeError: CUDA out of memory"}
    monkeypatch.setattr(codec, "check_codec", lambda device, max_batch, quick, model: ({"codec_warm_up": {"ok": True}}, {"float32": error}))
    report = doctor.examine("cpu", quick=True, codec_only=True)
    assert report["figures"]["codec"]["float32"] == error and "realtime_streams_per_codec_gpu" not in report["figures"]
    assert doctor.summary(report).startswith("megapod doctor on")
