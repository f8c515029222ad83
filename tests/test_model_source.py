"""Where the backbone comes from and how the CPU engine runs it: the generated `tiny` checkpoint, written
once however many start at once, its dtype, and the environment vLLM's CPU backend reads."""

from __future__ import annotations

import json
import os

from llm_server.engine.model_source import TINY_VERSION, generate_tiny


def test_a_second_writer_of_the_tiny_checkpoint_keeps_the_first(tmp_path):
    """Two workers starting on a fresh cache both generate `tiny`; the one that renames second found the
    folder taken (OSError: directory not empty) and its worker died. Now it keeps the first and tidies up."""
    target = tmp_path / TINY_VERSION
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"written_by": "the other worker"}))
    generate_tiny(target)
    assert json.loads((target / "config.json").read_text()) == {"written_by": "the other worker"}
    assert [p.name for p in tmp_path.iterdir()] == [TINY_VERSION]  # no tmp folder left behind


# What engine_args sets on CPU (llm_server/engine/vllm.py, _cpu_environment): restored after each test that calls it.
CPU_ENVIRONMENT = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS", "VLLM_ENABLE_V1_MULTIPROCESSING")


def _unset(monkeypatch, *names: str) -> None:
    for name in names:  # set, then deleted: the test's end restores each as it was
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def test_the_tiny_checkpoint_runs_in_float32_unless_asked_otherwise(monkeypatch):
    """vLLM's `auto` downcasts a float32 checkpoint to bfloat16 (its log: "Downcasting torch.float32 to
    torch.bfloat16"), the CPU's slow matmul; the tiny one asks for float32, other models keep `auto`."""
    from llm_server.config import LlmServerConfig
    from llm_server.engine.vllm import engine_args

    _unset(monkeypatch, *CPU_ENVIRONMENT)
    assert engine_args(LlmServerConfig(model="tiny", device="cpu"), "/models/tiny").dtype == "float32"
    assert engine_args(LlmServerConfig(model="tiny", device="cpu", dtype="bfloat16"), "/models/tiny").dtype == "bfloat16"
    assert engine_args(LlmServerConfig(model="canopylabs/orpheus-3b-0.1-ft", device="cpu"), "/models/3b").dtype == "auto"


def test_cpu_engines_leave_thread_placement_to_the_os_unless_the_operator_binds(monkeypatch):
    """vLLM's CPU default pins every engine's worker to the same cores (core 0 of a two-core machine for
    each of them); unset, the worker gets no binding, one thread and no process of its own (its queue
    spins); an operator's binding stays, with the process vLLM binds it in."""
    from llm_server.config import LlmServerConfig
    from llm_server.engine.vllm import engine_args

    placement = CPU_ENVIRONMENT[1:]
    _unset(monkeypatch, *CPU_ENVIRONMENT)
    engine_args(LlmServerConfig(model="tiny", device="cpu"), "/models/tiny")
    assert tuple(os.environ[name] for name in placement) == ("nobind", "1", "0")

    _unset(monkeypatch, *placement)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    engine_args(LlmServerConfig(model="tiny", device="cpu"), "/models/tiny")
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and not {"OMP_NUM_THREADS", "VLLM_ENABLE_V1_MULTIPROCESSING"} & set(os.environ)
