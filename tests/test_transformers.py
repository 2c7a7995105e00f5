"""Hugging Face transformers backend: a small Llama built from a config (no download) gives the
same logits and gradients with attn_implementation="tritonattn" as with "sdpa", and trains the same."""

import pytest
import torch
from conftest import DEVICE

transformers = pytest.importorskip("transformers")

import tritonattn.integrations.transformers  # noqa: E402,F401 - registers the backend


def _model(attn, **cfg):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      **cfg)
    model = transformers.LlamaForCausalLM(config).to(DEVICE)
    model.set_attn_implementation(attn)
    return model


@pytest.mark.parametrize("padded", [False, True], ids=["no-padding", "left-padding"])
def test_logits_and_grads_match_sdpa(padded):
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :7] = 0
    results = []
    for attn in ("sdpa", "tritonattn"):
        model = _model(attn)
        out = model(input_ids=ids, attention_mask=mask, labels=ids)
        out.loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        results.append((out.logits.detach(), out.loss.detach(), grads))
    (l_s, loss_s, g_s), (l_t, loss_t, g_t) = results
    keep = mask.bool()
    assert (l_s[keep] - l_t[keep]).abs().max().item() < 1e-4
    assert abs(loss_s.item() - loss_t.item()) < 1e-5
    for a, b in zip(g_s, g_t):
        assert (a - b).abs().max().item() < 1e-4 * max(1.0, a.abs().max().item())


def test_autocast_with_fp32_weights():
    """Under autocast the rotary embeddings hand back fp32 q / k next to a low-precision v; the backend
    casts them to the autocast dtype (as transformers' sdpa path does) instead of refusing."""
    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    low = torch.float16 if DEVICE == "cpu" else torch.bfloat16  # bf16 dots are wrong in the interpreter
    losses = []
    for attn in ("sdpa", "tritonattn"):
        model = _model(attn)
        with torch.autocast(torch.device(DEVICE).type, dtype=low):
            out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
        losses.append(out.loss.item())
    assert abs(losses[0] - losses[1]) < 2e-2 * losses[0], losses


def test_generate_matches_sdpa():
    ids = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    outs = [_model(a).generate(ids, max_new_tokens=6, do_sample=False) for a in ("sdpa", "tritonattn")]
    assert torch.equal(outs[0], outs[1])


def test_output_attentions_is_refused():
    model = _model("tritonattn")
    ids = torch.randint(0, 128, (1, 8)).to(DEVICE)
    with pytest.raises(ValueError, match="output_attentions"):
        model(input_ids=ids, output_attentions=True)


def test_convergence_against_sdpa():
    """Train twice on the same synthetic data (fp32): the loss curves agree within 1e-3."""
    torch.manual_seed(3)
    batch = torch.randint(0, 128, (4, 32)).to(DEVICE)
    data = [batch] * 10  # one fixed batch, ten steps: the model memorises it
    curves = []
    for attn in ("sdpa", "tritonattn"):
        model = _model(attn)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses = []
        for batch in data:
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        curves.append(losses)
    assert curves[1][-1] < curves[1][0]  # it learns
    diffs = [abs(a - b) for a, b in zip(*curves)]
    assert max(diffs) < 1e-3, (curves, diffs)
