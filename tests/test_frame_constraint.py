"""The frame constraint's GPU paths, on CPU tensors: each masks the right slot, leaves other requests
alone, and passes the sync detector; TensorRT-LLM's one-step lag and vLLM's preemption change nothing."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate
from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext

from llm_server.engine.audio_tokens import CODES_PER_FRAME, END_OF_SPEECH, slot_range
from llm_server.engine.frame_constraint import OPT_IN, FrameConstraintV1, FrameConstraintV2, _inverse_cdf, _SlotSampler, _top_p
from llm_server.engine.slot_mask import blocked_ids
from llm_server.engine.trtllm import FrameMask
from orpheus_common.sync_detector import host_syncs

VOCAB = 156_940
CPU = torch.device("cpu")
MASKED = SamplingParams(extra_args={OPT_IN: True})
FREE = SamplingParams()


def allowed(row: torch.Tensor) -> set[int]:
    return set(torch.isfinite(row).nonzero().flatten().tolist())


def slot_ids(slot: int) -> set[int]:
    first, last = slot_range(slot)
    return set(range(first, last)) | ({END_OF_SPEECH} if slot == 0 else set())


def test_the_table_allows_exactly_each_slots_ids():
    table = blocked_ids(VOCAB, CPU)
    for slot in range(CODES_PER_FRAME):
        assert set((~table[slot]).nonzero().flatten().tolist()) == slot_ids(slot)
    assert not table[CODES_PER_FRAME].any(), "the last row leaves a request alone"


# ---------------------------------------------------------------- vLLM V1 runner, mask mode


def v1_config(max_num_seqs: int = 8) -> SimpleNamespace:
    """The two fields of VllmConfig the V1 processor reads (test double)."""
    return SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
                           model_config=SimpleNamespace(get_vocab_size=lambda: VOCAB))


def test_v1_mask_mode_masks_each_row_by_its_own_count_without_a_host_sync():
    proc = FrameConstraintV1(v1_config(), CPU, is_pin_memory=False)
    outputs = {0: [1] * 3, 2: [1] * 7}
    proc.update_state(BatchUpdate(3, removed=[], moved=[], added=[
        (0, MASKED, [5], outputs[0]), (1, FREE, [5], []), (2, MASKED, [5], outputs[2])]))
    proc.apply(torch.zeros(3, VOCAB))  # a first step, as vLLM's warm-up gives
    outputs[0].append(1)
    logits = torch.zeros(3, VOCAB)
    assert host_syncs(proc.apply, logits) == []
    assert allowed(logits[0]) == slot_ids(4) and allowed(logits[2]) == slot_ids(0)
    assert torch.isfinite(logits[1]).all(), "a request that did not opt in is left alone"


# ---------------------------------------------------------------- Model Runner V2


def v2_states(prompt_lens: list[int]) -> SimpleNamespace:
    """LogitsProcRequestState's fields the processor reads (test double; prompt_len as vLLM's UVA view)."""
    return SimpleNamespace(device=CPU, max_num_reqs=len(prompt_lens), vocab_size=VOCAB,
                           prompt_len=SimpleNamespace(gpu=torch.tensor(prompt_lens, dtype=torch.int32)))


def v2_context(slots: list[int], pos: list[int]) -> LogitsContext:
    rows = torch.tensor(slots)
    requests = sorted(set(slots))
    return LogitsContext(expanded_idx_mapping=rows, idx_mapping=torch.tensor(requests), idx_mapping_np=np.array(requests),
                         expanded_local_pos=torch.zeros(len(slots), dtype=torch.int64),
                         input_ids=torch.zeros(len(slots), dtype=torch.int64), pos=torch.tensor(pos, dtype=torch.int32),
                         seq_lens_upper_bound_np=np.array([max(pos) + 1] * len(requests)))


def test_v2_masks_draft_rows_by_position_and_never_syncs():
    proc = FrameConstraintV2(None, v2_states([0, 0, 0, 10, 0, 4, 0, 0]))
    assert proc.add_request(3, MASKED) and not proc.add_request(5, FREE)
    assert host_syncs(proc.apply_staged_writes) == []  # admissions never wait for the GPU
    # Request 3 (prompt 10) verifies two drafts: its rows sit at positions 12, 13, 14.
    ctx = v2_context([3, 3, 3, 5], [12, 13, 14, 40])
    logits = torch.zeros(4, VOCAB)
    assert host_syncs(proc.apply, logits, ctx) == []
    assert [allowed(logits[i]) == slot_ids(s) for i, s in enumerate((3, 4, 5))] == [True] * 3
    assert torch.isfinite(logits[3]).all()


def test_v2_a_recycled_slot_takes_its_new_requests_choice():
    proc = FrameConstraintV2(None, v2_states([2, 2]))
    proc.add_request(1, MASKED)
    proc.apply_staged_writes()
    proc.add_request(1, FREE)  # the request finished; its slot went to one without the constraint
    proc.apply_staged_writes()
    logits = torch.zeros(1, VOCAB)
    proc.apply(logits, v2_context([1], [9]))
    assert torch.isfinite(logits).all()


# ---------------------------------------------------------------- TensorRT-LLM


def test_trtllm_mask_counts_its_calls_not_the_lagging_token_list():
    """TensorRT-LLM's overlap scheduler calls the processor before appending the previous step's token:
    the token list it passes is one short from the second call on. The slot must not follow it."""
    prompt, generated, mask = [1, 2, 3], [], FrameMask()
    for k in range(15):
        lagging = prompt + generated[:-1]  # the last sampled token is not appended yet
        logits = torch.zeros(1, 1, VOCAB)  # [beam, 1, vocab], as the PyTorch backend passes it
        mask(k, logits, [lagging], None, None)
        assert allowed(logits[0, 0]) == slot_ids(k % CODES_PER_FRAME), f"call {k}"
        generated.append(slot_range(k % CODES_PER_FRAME)[0])


def test_trtllm_mask_is_one_fill_from_the_table():
    mask = FrameMask()
    mask(0, torch.zeros(1, 1, VOCAB), [[1]], None, None)
    assert host_syncs(mask, 0, torch.zeros(1, 1, VOCAB), [[1, 2]], None, None) == []


# ---------------------------------------------------------------- the CPU slot sampler


SAMPLED = SamplingParams(temperature=0.0, extra_args={OPT_IN: {"temperature": 0.6, "top_p": 0.8, "repetition_penalty": 1.1, "seed": 7}})


def sample_stream(preempt_at: int | None, steps: int = 40) -> list[int]:
    """Tokens the slot sampler picks over `steps` steps; at `preempt_at` vLLM preempts the request and
    later re-adds it in another row, with a new list holding the same tokens (async scheduling)."""
    proc = FrameConstraintV1(v1_config(), CPU, is_pin_memory=False)
    out: list[int] = []
    row = 0
    proc.update_state(BatchUpdate(1, removed=[], moved=[], added=[(row, SAMPLED, [5], out)]))
    logits_source = torch.Generator().manual_seed(0)
    for step in range(steps):
        if step == preempt_at:
            proc.update_state(BatchUpdate(0, removed=[row], moved=[], added=[]))
            out, row = list(out), 2
            proc.update_state(BatchUpdate(3, removed=[], moved=[], added=[(row, SAMPLED, [5], out)]))
        logits = torch.randn(1, VOCAB, generator=logits_source).expand(3, VOCAB).clone()
        proc.apply(logits)
        out.append(int(logits[row].argmax()))
    return out


@pytest.mark.parametrize("preempt_at", [1, 10, 23])
def test_a_seeded_stream_is_the_same_after_preemption(preempt_at):
    assert sample_stream(preempt_at) == sample_stream(None)


def test_top_p_keeps_the_smallest_most_probable_set_that_reaches_it():
    probs = np.array([0.05, 0.5, 0.15, 0.3])
    assert _top_p(probs, 0.7).nonzero()[0].tolist() == [1, 3]  # 0.5 + 0.3 reach 0.7; 0.5 alone does not
    assert _top_p(probs, 0.9).nonzero()[0].tolist() == [1, 2, 3]
    assert _top_p(probs, 0.01).nonzero()[0].tolist() == [1]  # the most probable one always stays
    assert _top_p(probs, 1.0) is probs


def test_the_inverse_cdf_picks_by_weight_and_never_a_zero_weight():
    weights = np.array([0.0, 1.0, 0.0, 3.0, 0.0])
    assert [_inverse_cdf(weights, u) for u in (0.0, 0.2499, 0.25, 0.9999)] == [1, 1, 3, 3]


def sampler_picks(logits: torch.Tensor, spec: dict, seeds: range, outputs: list[int] | None = None) -> list[int]:
    picks = []
    for seed in seeds:
        sampler = _SlotSampler.create(SamplingParams(extra_args={OPT_IN: {**spec, "seed": seed}}), list(outputs or []))
        picks.append(sampler.choose(logits))
    return picks


def test_the_slot_sampler_draws_the_nucleus_in_proportion():
    """Slot 0 with three live codes of probability 0.6, 0.3, 0.1 at temperature 1: top_p 0.8 keeps the
    first two, drawn 2:1 over 3,000 seeds; the third and every other id never."""
    logits = torch.full((VOCAB,), -1e4)
    low, _ = slot_range(0)
    logits[[low + 5, low + 9, low + 11]] = torch.tensor([0.6, 0.3, 0.1]).log()
    picks = sampler_picks(logits, {"temperature": 1.0, "top_p": 0.8, "repetition_penalty": 1.0}, range(3000))
    counts = {token: picks.count(token) for token in set(picks)}
    assert set(counts) == {low + 5, low + 9}
    assert abs(counts[low + 5] / len(picks) - 2 / 3) < 0.03
    assert sampler_picks(logits, {"temperature": 1.0, "top_p": 0.8, "repetition_penalty": 1.0}, range(3000)) == picks  # seeded


def test_the_slot_sampler_penalises_what_the_request_already_said():
    """Two equal codes; the request already produced one, so a penalty of 4 makes the other win every draw."""
    logits = torch.full((VOCAB,), -1e4)
    low, _ = slot_range(0)
    logits[[low + 1, low + 2]] = 20.0  # the said one falls to 5: e**-15 of the other
    said = [low + 1, *range(slot_range(1)[0], slot_range(1)[0] + 6)]  # one whole frame: the next token is slot 0 again
    spec = {"temperature": 1.0, "top_p": 1.0, "repetition_penalty": 4.0}
    assert set(sampler_picks(logits, spec, range(200), said)) == {low + 2}
    assert set(sampler_picks(logits, {**spec, "repetition_penalty": 1.0}, range(200), said)) == {low + 1, low + 2}


def test_vllm_0_33s_own_loader_builds_the_v2_processor_and_steps_it_with_its_own_context():
    """The GPU image runs vLLM 0.33's Model Runner V2, not the CPU 0.32 these tests import: its loader
    (build_custom_logits_processors) checks the class against the V2 interface and constructs it as the runner
    does, and its LogitsContext is built by field name, so signature drift fails here rather than at a pod's start
    (issue 44, item 6). tests/engine_config_probe.py runs it with the release's files first on the path."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    assert (repo / ".vllm-gpu" / "vllm").is_dir(), "`make test` fetches vLLM's CUDA release into .vllm-gpu"
    done = subprocess.run([sys.executable, str(repo / "tests" / "engine_config_probe.py"), "frame-constraint-v2"],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": f"{repo / '.vllm-gpu'}{os.pathsep}{repo}"})
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.splitlines()[-1])
    assert got["class"] == "FrameConstraintV2" and got["opted"] == [True, True, False]
    (first0, last0), (first3, last3) = got["slot_ranges"]
    # 0 tokens generated: slot 0 and end of speech; 3: slot 3 only; a request that did not opt in: every id
    assert got["allowed"] == [[END_OF_SPEECH, last0 - 1, 4097], [first3, last3 - 1, 4096], [0, VOCAB - 1, VOCAB]]
    assert END_OF_SPEECH < first0
