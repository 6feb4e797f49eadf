"""TRL's generation captured into buffers (CaptureRollouts) and as a rollout source."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from posttrain import SourceClosed
from posttrain.adapters.trl import CaptureRollouts, TRLRolloutSource
from posttrain.contracts.layout import LLM_LAYOUT_V1
from posttrain.reference_impls import RingBuffer
from posttrain.testing import tiny_causal_lm

K = LLM_LAYOUT_V1.key


@pytest.fixture(scope="module")
def source() -> Iterator[TRLRolloutSource]:
    src = TRLRolloutSource(tiny_causal_lm(), [[5, 6]], 1, max_new_tokens=3)
    src.trainer.model.train(True)  # as inside trainer.train(): captures go to the buffer
    yield src
    src.shutdown()


def test_capture_into_a_fixed_width_buffer_stamps_groups_and_versions(
    source: TRLRolloutSource,
) -> None:
    rb = RingBuffer(16)
    capture = CaptureRollouts(rb, width=8, report_logprobs=True)
    out = capture(["t5 t6", "t5 t6", "t7", "t7"], source.trainer)
    assert [p for p in out["prompt_ids"]] == [[5, 6], [5, 6], [7], [7]]
    assert len(out["completion_ids"]) == 4
    # The reported log-probs are the model's own, teacher-forced, at each completion token.
    model = source.trainer.model
    for p, c, lp in zip(out["prompt_ids"], out["completion_ids"], out["logprobs"], strict=True):
        ids = torch.tensor([[*p, *c]])
        with torch.no_grad():
            ref = model(input_ids=ids).logits[0, :-1].log_softmax(-1)
        want = ref[len(p) - 1 :].gather(-1, torch.tensor(c)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(lp), want, atol=1e-5, rtol=1e-5)
    assert CaptureRollouts(RingBuffer(4), width=8)(["t5", "t5"], source.trainer)["logprobs"] is None
    assert len(rb) == 4
    stored = rb.sample(64)
    assert LLM_LAYOUT_V1.violations(stored) == []
    pairs = {
        (int(g), tuple(t[: (~a).sum()].tolist()))
        for g, t, a in zip(
            stored.get(K("group_id")),
            stored.get(K("tokens")),
            stored.get(K("assistant_mask")) | ~stored.get(K("attention_mask")),
            strict=True,
        )
    }
    assert pairs == {(0, (5, 6)), (1, (7,))}
    assert set(stored.get(K("policy_version")).tolist()) == {0}
    capture(["t8", "t8"], source.trainer)
    assert capture.groups == 3
    pad = source.trainer.processing_class.pad_token_id
    tokens, attn = stored.get(K("tokens")), stored.get(K("attention_mask"))
    assert (tokens[~attn] == pad).all()


def test_eval_generations_use_the_eval_group_size_and_stay_out_of_the_training_buffer(
    source: TRLRolloutSource,
) -> None:
    rb, evals = RingBuffer(16), RingBuffer(16)
    capture = CaptureRollouts(rb, width=8, eval_buffer=evals)
    trainer = source.trainer
    trainer.model.train(False)
    old = trainer.num_generations_eval
    trainer.num_generations_eval = 3
    try:
        capture(["t5", "t5", "t5"], trainer)
    finally:
        trainer.num_generations_eval = old
        trainer.model.train(True)
    assert len(rb) == 0
    assert len(evals) == 3
    assert set(evals.sample(32).get(K("group_id")).tolist()) == {0}


def test_prompt_ids_come_from_the_dataset_not_a_decode_encode_round_trip() -> None:
    from tokenizers.processors import TemplateProcessing

    from posttrain.adapters._hf import word_level_tokenizer

    policy = tiny_causal_lm()
    tok = word_level_tokenizer(policy.config)
    tok._tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    src = TRLRolloutSource(policy, [[5, 6]], 1, max_new_tokens=2, tokenizer=tok)
    try:
        assert src.trainer.processing_class(text=["t9 t19"])["input_ids"] == [[1, 9, 19]]
        rb = RingBuffer(8)
        naive = CaptureRollouts(rb, width=8)(["t9 t19", "t9 t19"], src.trainer)
        assert naive["prompt_ids"][0] == [1, 9, 19]  # what TRL's own tokenization gives
        exact = CaptureRollouts(rb, width=8, prompt_ids={"t9 t19": [9, 19]})
        assert exact(["t9 t19", "t9 t19"], src.trainer)["prompt_ids"] == [[9, 19], [9, 19]]
        # Per prompt: a known text gives its stored ids, an unknown one TRL's tokenization.
        mixed = exact(["t9 t19", "t9 t19", "t5", "t5"], src.trainer)["prompt_ids"]
        assert mixed == [[9, 19], [9, 19], [1, 5], [1, 5]]
    finally:
        src.shutdown()


def test_capture_refuses_a_batch_without_breaking_the_buffer(source: TRLRolloutSource) -> None:
    rb = RingBuffer(16)
    capture = CaptureRollouts(rb, width=8)
    with pytest.raises(ValueError, match=r"prompts\[0:2\]: expected one prompt repeated"):
        capture(["t5", "t6"], source.trainer)
    with pytest.raises(ValueError, match="expected a multiple of num_generations=2"):
        capture(["t5"], source.trainer)
    tight = CaptureRollouts(rb, width=3)
    with pytest.raises(ValueError, match="width=3: item 0 has 3 prompt"):
        tight(["t5 t6 t7", "t5 t6 t7"], source.trainer)
    assert len(rb) == 0
    assert (capture.groups, tight.groups) == (0, 0)


def test_source_rejects_bad_weights_unchanged_and_refuses_after_shutdown() -> None:
    src = TRLRolloutSource(tiny_causal_lm(), [[5, 6]], None, max_new_tokens=2)
    model = src.trainer.accelerator.unwrap_model(src.trainer.model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bad = {k: torch.zeros_like(v) for k, v in before.items()}
    bad["lm_head.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"'lm_head.weight': expected \(64, 32\)"):
        src.update_policy_weights_(bad)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert src.policy_version == 0
    src.shutdown()
    src.shutdown()
    with pytest.raises(SourceClosed):
        next(iter(src))
