"""TorchRL 0.14.1's SFTLoss through the nll_loss suite: the adapted rows conform, the raw row
fails exactly what it declares, and each raw deviation has a repro on TorchRL's code."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchrl")

from tensordict import TensorDict

from posttrain.adapters._hf import word_level_tokenizer
from posttrain.adapters.torchrl.sft import RAW_KNOWN, ROWS
from posttrain.testing import tiny_causal_lm
from tests.outcomes import own_failures


@pytest.mark.parametrize("name", sorted(ROWS))
def test_row_fails_what_it_declares(name: str) -> None:
    want = RAW_KNOWN if "-raw-" in name else frozenset()
    assert set(own_failures(ROWS[name])) == set(want)


def _sft(policy: torch.nn.Module) -> tuple[object, int]:
    from torchrl.modules.llm import TransformersWrapper
    from torchrl.objectives.llm import SFTLoss

    tok = word_level_tokenizer(policy.config)
    actor = TransformersWrapper(
        policy,
        tokenizer=tok,
        input_mode="tokens",
        generate=False,
        return_log_probs=True,
        pad_output=True,
    )
    loss = SFTLoss(actor_network=actor, reduction="sum", normalize_by_seq_length=False)
    loss.set_keys(history=("tokens", "full"))
    return loss, int(tok.pad_token_id)


def _batch(tokens: torch.Tensor, asst: torch.Tensor) -> TensorDict:
    return TensorDict(
        {
            ("tokens", "full"): tokens,
            ("masks", "all_attention_mask"): torch.ones_like(asst),
            ("masks", "all_assistant_mask"): asst,
        },
        batch_size=[tokens.shape[0]],
    )


def test_repro_nll_003_004_pad_id_inside_a_sequence_is_dropped() -> None:
    # SFTLoss hands its actor only the tokens; the token-mode wrapper then masks out every
    # token equal to the pad id, here one in the prompt, and the answer's log-probs change.
    policy = tiny_causal_lm(vocab_size=64)
    loss, pad = _sft(policy)
    tokens = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    asst = torch.tensor([[False] * 4 + [True] * 4])
    with_pad = tokens.clone()
    with_pad[0, 2] = pad  # attended: the layout's attention mask says it is a real token

    def gap(ids: torch.Tensor) -> float:
        with torch.no_grad():
            logp = torch.log_softmax(policy(input_ids=ids).logits[0, :-1].double(), -1)
            want = -logp[torch.arange(7), ids[0, 1:]][3:].sum()
            got = loss(_batch(ids, asst)).loss_sft  # type: ignore[operator]
        return abs(float(got) - float(want))

    assert gap(tokens) < 1e-4  # no pad id inside: TorchRL's value is the NLL
    assert gap(with_pad) > 1e-3


def test_repro_nll_006_float_mask_taken_as_a_mask() -> None:
    # SFTLoss calls mask.bool() on the assistant mask: a float 0/1 mask is accepted.
    policy = tiny_causal_lm(vocab_size=64)
    loss, _ = _sft(policy)
    tokens = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    asst = torch.tensor([[False] * 4 + [True] * 4])
    with torch.no_grad():
        out = loss(_batch(tokens, asst.float()))  # type: ignore[operator]
    assert torch.isfinite(out.loss_sft)
