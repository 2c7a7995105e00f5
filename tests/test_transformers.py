"""Hugging Face transformers backend: small models built from configs (no download) give the same
logits, gradients and greedy generations with attn_implementation="tritonattn" as with "sdpa", and
train the same; padding masks take the key-padding path (no S x S mask)."""

import pytest
import torch
from conftest import DEVICE

transformers = pytest.importorskip("transformers")

import tritonattn.integrations.transformers as hf  # noqa: E402 - registers the backend
import tritonattn.ops  # noqa: E402
from tritonattn.kernels.variants import MASK_KEYS, MASK_NONE, MASK_TILE  # noqa: E402

SIZES = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
MODELS = {  # name: (config class, model class, extra config)
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral-sw5": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=5)),
    # layer 0 a sliding window of 5, layer 1 full attention: both masks in one model; its attention
    # modules do not pass sliding_window to the attention function (the mask carries it)
    "qwen2moe-mixed-sw5": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        sliding_window=5, use_sliding_window=True, max_window_layers=1, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32)),
}


def _model(attn, name="llama", **cfg):
    torch.manual_seed(0)
    config_cls, model_cls, extra = MODELS[name]
    config = getattr(transformers, config_cls)(**SIZES, **extra, **cfg)
    model = getattr(transformers, model_cls)(config).to(DEVICE)
    model.set_attn_implementation(attn)
    return model


def _spy_kernel_calls(monkeypatch, attr):
    """A list that gets ``var.<attr>`` of every forward kernel call through the autograd path."""
    seen = []
    real = tritonattn.ops.attention_forward

    def spy(q, k, v, var):
        seen.append(getattr(var, attr))
        return real(q, k, v, var)

    monkeypatch.setattr(tritonattn.ops, "attention_forward", spy)
    return seen


@pytest.fixture
def mask_kinds(monkeypatch):
    """The mask kind of every kernel call that went through the autograd path (``attention()``)."""
    return _spy_kernel_calls(monkeypatch, "mask_kind")


@pytest.fixture
def varlen_flags(monkeypatch):
    """For every kernel call through the autograd path: whether it ran variable-length."""
    return _spy_kernel_calls(monkeypatch, "varlen")


def _padding(ids, where):
    mask = torch.ones_like(ids)
    if where == "left":
        mask[0, :7] = 0
    elif where == "right":
        mask[1, -5:] = 0
    return mask


def _logits_and_grads(attn, ids, mask, name="llama", labels=None):
    model = _model(attn, name)
    out = model(input_ids=ids, attention_mask=mask, labels=ids if labels is None else labels)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), [p.grad.clone() for p in model.parameters()]


def _labels_skipping_padding(ids, mask):
    """Causal-LM labels that no padded position predicts (label t is predicted from position t - 1)."""
    return torch.cat([torch.full_like(ids[:, :1], -100), ids[:, 1:].masked_fill(mask[:, :-1] == 0, -100)], 1)


def _assert_same(results, mask):
    (l_s, loss_s, g_s), (l_t, loss_t, g_t) = results
    keep = mask.bool()
    assert (l_s[keep] - l_t[keep]).abs().max().item() < 1e-4
    assert abs(loss_s.item() - loss_t.item()) < 1e-5
    for a, b in zip(g_s, g_t):
        assert (a - b).abs().max().item() < 1e-4 * max(1.0, a.abs().max().item())


@pytest.mark.parametrize("padding", ["none", "left", "right"], ids=lambda p: f"{p}-padding")
def test_logits_and_grads_match_sdpa(padding, mask_kinds):
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    mask = _padding(ids, padding)
    results = [_logits_and_grads(attn, ids, mask) for attn in ("sdpa", "tritonattn")]
    _assert_same(results, mask)
    # padding only: the key-padding path (one boolean per key), never an S x S mask
    assert set(mask_kinds) == ({MASK_NONE} if padding == "none" else {MASK_KEYS}), mask_kinds


FAMILIES = {  # more families, against "eager" (Gemma 2 has no sdpa path in transformers: softcapping)
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16)),  # q / k norms
    # logit softcapping, query_pre_attn_scalar scaling, sliding-window and full layers alternating
    "gemma2-softcap-sw5": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        head_dim=16, sliding_window=5, attn_logit_softcapping=20.0, final_logit_softcapping=None,
        query_pre_attn_scalar=24)),
    "gemma3-sw5": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=16, sliding_window=5, query_pre_attn_scalar=24, layer_types=["sliding_attention", "full_attention"])),
}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_more_families_match_eager(name, mask_kinds):
    """Qwen3, Gemma 2 (softcap, scaling, sliding windows) and Gemma 3 with left padding: logits, loss
    and every gradient as transformers' eager attention gives them. Labels skip the positions that
    follow padding (a padded query's output is 0 here and uniform in eager)."""
    if not hasattr(transformers, FAMILIES[name][0]):
        pytest.skip(f"transformers {transformers.__version__} has no {FAMILIES[name][0]}")
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    mask = _padding(ids, "left")
    labels = _labels_skipping_padding(ids, mask)
    results = []
    for attn in ("eager", "tritonattn"):
        config_cls, model_cls, extra = FAMILIES[name]
        torch.manual_seed(0)
        model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**{**SIZES, **extra})).to(DEVICE)
        model.set_attn_implementation(attn)
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        results.append((out.logits.detach(), out.loss.detach(), [p.grad.clone() for p in model.parameters()
                                                                 if p.grad is not None]))
    _assert_same(results, mask)
    assert MASK_KEYS in mask_kinds and MASK_TILE not in mask_kinds, mask_kinds


@pytest.mark.parametrize("attn", [hf.NAME, hf.FLASH_PATH_NAME])
def test_packed_sequences_match_separate(attn, varlen_flags):
    """Packed sequences (batch 1, position_ids restarting, cu_seq_lens_* kwargs as transformers'
    DataCollatorWithFlattening gives them) take the varlen path and give each sequence's logits as a
    forward of that sequence alone does."""
    lens = [5, 9, 7]
    gen = torch.Generator().manual_seed(6)
    seqs = [torch.randint(0, 128, (1, n), generator=gen).to(DEVICE) for n in lens]
    packed = torch.cat(seqs, 1)
    pos = torch.cat([torch.arange(n) for n in lens])[None].to(DEVICE)
    cu = torch.tensor([0, 5, 14, 21], dtype=torch.int32, device=DEVICE)
    model = _model(attn)
    logits = model(input_ids=packed, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=9,
                   max_length_k=9).logits
    assert varlen_flags and all(varlen_flags), varlen_flags
    ref = _model("sdpa")
    for i, seq in enumerate(seqs):
        alone = ref(input_ids=seq).logits
        torch.testing.assert_close(logits[:, cu[i]:cu[i + 1]], alone, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("padding", ["none", "left", "right"], ids=lambda p: f"{p}-padding")
def test_flash_path_matches_sdpa(padding, varlen_flags):
    """attn_implementation="tritonattn_fa": transformers' own flash-attention code (unpadding, varlen)
    calling tritonattn's flash-attn-compatible functions. Same logits and gradients as sdpa; padded
    batches run variable-length, as with flash-attn; greedy generation of a left-padded batch equal."""
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    mask = _padding(ids, padding)
    # flash-attn's path outputs 0 for padded queries (sdpa attends them to the keys before them), so the
    # labels skip the positions that follow padding, as a real training run's would
    labels = _labels_skipping_padding(ids, mask)
    results = [_logits_and_grads(attn, ids, mask, labels=labels) for attn in ("sdpa", hf.FLASH_PATH_NAME)]
    _assert_same(results, mask)
    assert varlen_flags and all(varlen_flags) == (padding != "none"), varlen_flags
    if padding == "left":
        outs = [_model(a).generate(ids[:, :12], attention_mask=mask[:, :12], max_new_tokens=6, do_sample=False,
                                   pad_token_id=0) for a in ("sdpa", hf.FLASH_PATH_NAME)]
        assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("name", ["mistral-sw5", "qwen2moe-mixed-sw5"])
def test_sliding_window_with_padding_matches_sdpa(name, mask_kinds):
    """Sequences longer than the window, left padding: the window goes with the key-padding mask."""
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    mask = _padding(ids, "left")
    results = [_logits_and_grads(attn, ids, mask, name) for attn in ("sdpa", "tritonattn")]
    _assert_same(results, mask)
    assert set(mask_kinds) == {MASK_KEYS}, mask_kinds
    # generation: 7 of 10 prompt tokens padded, so the window still holds padding while decoding
    gen = [_model(attn, name).generate(ids[:, :10], attention_mask=mask[:, :10], max_new_tokens=6,
                                       do_sample=False, pad_token_id=0) for attn in ("sdpa", "tritonattn")]
    assert torch.equal(gen[0], gen[1])
    assert MASK_TILE not in mask_kinds


@pytest.mark.parametrize("cache", [None, "static"], ids=["dynamic-cache", "static-cache"])
def test_generate_left_padding_matches_sdpa(cache, mask_kinds):
    """Greedy generation, a left-padded batch: the same tokens. With a dynamic cache the new queries
    are the last keys (bottom-right causal, key padding); a static cache is longer than the keys
    seen so far, so its masks are the S x S ones."""
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    outs = [_model(a).generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                               cache_implementation=cache) for a in ("sdpa", "tritonattn")]
    assert torch.equal(outs[0], outs[1])
    if cache is None:
        assert set(mask_kinds) == {MASK_KEYS}, mask_kinds  # prefill and every decoding step


@pytest.mark.parametrize("name", ["llama", "mistral-sw5"])
def test_compiled_forward_with_padding(name, mask_kinds):
    """torch.compile(fullgraph=True) of a padded forward: no graph break in the mask function, and the
    logits equal eager's. While tracing, a causal padding mask still takes the key-padding path; a
    sliding window (the mask function cannot read closures under dynamo) takes the S x S mask."""
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    mask = _padding(ids, "left")
    model = _model("tritonattn", name)
    fn = lambda ids, mask: model(input_ids=ids, attention_mask=mask).logits  # noqa: E731
    eager = fn(ids, mask)
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")(ids, mask)
    if name == "llama":  # the same path traced: the same kernels
        assert torch.equal(eager, compiled)
    else:  # eager takes the key-padding path, the trace the S x S mask (other tiles: other rounding)
        torch.testing.assert_close(eager, compiled, rtol=1e-4, atol=1e-5)
    assert MASK_KEYS in mask_kinds and (MASK_TILE in mask_kinds) == (name != "llama"), mask_kinds


def test_mask_function():
    """What the registered mask function hands to the attention function."""
    from transformers import masking_utils as mu

    pad = torch.ones(2, 12, dtype=torch.bool, device=DEVICE)
    pad[0, :3] = False
    base = dict(batch_size=2, q_length=4, kv_length=12, q_offset=8, kv_offset=0, attention_mask=pad, device=DEVICE)
    # causal + padding, a decoding step of a dynamic cache: the (B, kv_len) key mask
    assert torch.equal(hf.tritonattn_mask(**base, mask_function=mu.causal_mask_function), pad)
    # no padding: None (bottom-right causal)
    assert hf.tritonattn_mask(**{**base, "attention_mask": pad[1:].expand(2, 12)}) is None
    # sliding window: the keys in the cache's window only
    long_pad = pad.clone()
    long_pad[0, :6] = False
    sw = dict(base, kv_length=7, kv_offset=5, local_size=6, attention_mask=long_pad,
              mask_function=mu.sliding_window_causal_mask_function(6))
    m = hf.tritonattn_mask(**sw)
    assert torch.equal(m, long_pad[:, 5:12]) and getattr(m, hf.WINDOW_ATTR) == 6
    # no padding in the window: an all-True key mask still carries the window, unless it cuts nothing
    m = hf.tritonattn_mask(**{**sw, "attention_mask": pad})
    assert m.all() and m.shape == (2, 7) and getattr(m, hf.WINDOW_ATTR) == 6
    assert hf.tritonattn_mask(**{**sw, "attention_mask": pad, "kv_length": 6, "kv_offset": 6}) is None
    assert not hasattr(hf.tritonattn_mask(**base), hf.WINDOW_ATTR)
    # bidirectional + padding: a (B, 1, 1, kv_len) view of it
    bi = hf.tritonattn_mask(**base, mask_function=mu.bidirectional_mask_function, allow_is_causal_skip=False,
                            allow_is_bidirectional_skip=True)
    assert bi.shape == (2, 1, 1, 12) and torch.equal(bi[:, 0, 0], pad)
    # anything else: sdpa's boolean (B, 1, q_len, kv_len)
    others = [
        dict(mask_function=mu.chunked_causal_mask_function(4, torch.zeros(2, dtype=torch.long, device=DEVICE))),
        dict(mask_function=mu.and_masks(mu.causal_mask_function, lambda b, h, q, kv: kv != 5)),
        dict(mask_function=mu.sliding_window_causal_mask_function(6), local_size=5),  # inconsistent window
        dict(allow_is_causal_skip=False),  # the caller wants the mask materialised
        dict(q_offset=torch.tensor(8)),  # static cache: the offset is a tensor
        dict(kv_length=20),  # the keys run past the last query (static cache): top-left causal
    ]
    for kw in others:
        m = hf.tritonattn_mask(**{**base, **kw})
        assert m.dtype == torch.bool and m.dim() == 4 and tuple(m.shape[:3]) == (2, 1, 4), kw
    expected = mu.sdpa_mask(**base, allow_is_causal_skip=False)
    assert torch.equal(hf.tritonattn_mask(**base, allow_is_causal_skip=False), expected)


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


def test_unsupported_kwargs_are_refused_by_name():
    from tritonattn.integrations.transformers import tritonattn_attention_forward

    module = torch.nn.Module()
    module.is_causal, module.training = True, False
    q = torch.randn(1, 2, 8, 16, device=DEVICE)
    for name, value in (("position_bias", torch.zeros(1, 2, 8, 8, device=DEVICE)), ("s_aux", torch.zeros(2))):
        with pytest.raises(ValueError, match=name):
            tritonattn_attention_forward(module, q, q, q, None, **{name: value})


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
