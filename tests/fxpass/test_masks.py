"""``fxpass.masks``: what a boolean mask keeps, proved from the graph Dynamo captured (or why it cannot be)."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from transformers import masking_utils

from fxpass import masks

B, T = 2, 6


def _mask_node(fn, *args) -> tuple[fx.Node, masks.RealValue]:
    """The node ``fn`` returns, in the graph Dynamo captures, and a reader of its placeholders' real values."""
    captured: list[tuple[fx.GraphModule, list]] = []

    def backend(gm, example_inputs):
        captured.append((gm, list(example_inputs)))
        return gm.forward

    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    ((gm, inputs),) = captured
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    return output.args[0][0], lambda node: inputs[placeholders.index(node)] if node in placeholders else None


def _kept(fn, *args, complement: bool = False) -> masks.Structure | str:
    node, real = _mask_node(fn, *args)
    return masks.kept(node, real, complement=complement)


def _padding() -> torch.Tensor:
    pad = torch.ones(B, T, dtype=torch.bool)
    pad[1, :2] = False
    return pad


def _hf(mask_function, pad):
    """transformers' own construction (masking_utils.sdpa_mask, as the models call it under torch.compile)."""
    return masking_utils.sdpa_mask(
        batch_size=B, q_length=T, kv_length=T, mask_function=mask_function, attention_mask=pad,
        allow_is_causal_skip=False,
    )


def _key_names(structure: masks.Structure) -> list[tuple[str, bool]]:
    return [(atom.node.op, atom.positive) for atom in structure.keys]


def test_transformers_causal_and_padding():
    structure = _kept(lambda pad: _hf(masking_utils.causal_mask_function, pad), _padding())
    assert isinstance(structure, masks.Structure), structure
    assert structure.causal and structure.window is None
    assert len(structure.keys) == 1 and structure.keys[0].positive
    assert structure.keys[0].node.meta["example_value"].shape == (B, 1, 1, T)  # padding_mask[b_idx, kv_idx]


def test_transformers_bidirectional_padding_is_keys_only():
    """BERT's mask: ``q_idx >= 0`` holds everywhere, so only the per-key padding remains."""
    structure = _kept(lambda pad: _hf(masking_utils.bidirectional_mask_function, pad), _padding())
    assert isinstance(structure, masks.Structure), structure
    assert not structure.causal and len(structure.keys) == 1


def test_transformers_sliding_window():
    structure = _kept(lambda pad: _hf(masking_utils.sliding_window_causal_mask_function(3), pad), _padding())
    assert isinstance(structure, masks.Structure), structure
    assert structure.causal and structure.window == 3 and len(structure.keys) == 1


def test_transformers_union_is_not_proved():
    """or_masks (a causal mask opened up for a prefix): a union, which no flag and key mask can express."""
    prefix = masking_utils.or_masks(masking_utils.causal_mask_function, lambda b, h, q, kv: kv < 2)
    assert _kept(lambda pad: _hf(prefix, pad), _padding()) == (
        "the mask is a union of conditions (or_masks), not an intersection"
    )


def test_transformers_packed_sequences_are_not_proved():
    """Per-pair comparisons of a [B, T] tensor (packed sequences) are not per-key: the mask stays a tensor."""
    ids = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 0]])
    packed = masking_utils.and_masks(
        masking_utils.causal_mask_function, masking_utils.packed_sequence_mask_function(ids)
    )
    reason = _kept(lambda pad: _hf(packed, pad), _padding())
    assert isinstance(reason, str) and "not built from" in reason


def test_user_padding_mask_hidden_with_masked_fill():
    """``masked_fill(~pad[:, None, None, :] | future, -inf)``: the complement of what is hidden is kept."""

    def hidden(pad):
        i = torch.arange(T)
        return ~pad[:, None, None, :] | (i[None, :] > i[:, None])

    structure = _kept(hidden, _padding(), complement=True)
    assert isinstance(structure, masks.Structure), structure
    assert structure.causal and _key_names(structure) == [("call_function", True)]


def test_tril_buffer_is_read_from_the_real_input():
    buffer = torch.tril(torch.ones(8, 8)).view(1, 1, 8, 8)
    assert _kept(lambda b: b[:, :, :T, :T] == 1, buffer) == masks.Structure(causal=True)
    assert isinstance(_kept(lambda b: b[:, :, :T, :T] == 1, torch.triu(torch.ones(1, 1, 8, 8))), str)


@pytest.mark.parametrize(
    ("compare", "expected"),
    [
        (lambda kv, q: kv <= q, masks.Structure(causal=True)),
        (lambda kv, q: q >= kv, masks.Structure(causal=True)),
        (lambda kv, q: kv < q + 1, masks.Structure(causal=True)),
        (lambda kv, q: (kv <= q) & (kv > q - 2), masks.Structure(causal=True, window=2)),
        (lambda kv, q: kv <= q + 1, "its diagonal is shifted (keys j <= i + 1), not the causal j <= i"),
        (lambda kv, q: kv > q - 2, "it keeps keys after the query (j - i > -2) without a causal bound"),
        (lambda kv, q: (kv <= q) & (kv > q), "it hides every pair (an empty band)"),
        (lambda kv, q: ~(kv > q), masks.Structure(causal=True)),
    ],
)
def test_position_comparisons(compare, expected):
    def fn(x):
        i = torch.arange(x.shape[-1])
        return compare(i[None, None, None, :], i[None, None, :, None])

    assert _kept(fn, torch.zeros(T)) == expected


def _positions_mask(position_ids, batch: int = B):
    """transformers without a KV cache or a mask: causal on gathered positions, and the packed-sequence ids of
    those positions (``find_packed_sequence_indices``) compared per pair."""
    packed = masking_utils.find_packed_sequence_indices(position_ids)
    mask_function = masking_utils.and_masks(
        lambda b, h, q, kv: position_ids[b, kv] <= position_ids[b, q],
        masking_utils.packed_sequence_mask_function(packed),
    )
    return masking_utils.sdpa_mask(
        batch_size=batch, q_length=T, kv_length=T, mask_function=mask_function, attention_mask=None,
        allow_is_causal_skip=False,
    )


@pytest.mark.parametrize("batch", [B, 1])
def test_positions_from_arange_prove_causal(batch):
    """Positions built from arange: every pair is in one packed sequence, and position order is index order
    (also for one sequence, where the batch index has no dimension of its own)."""

    def unpacked(x):
        return _positions_mask((torch.arange(T) + 0).unsqueeze(0).expand(batch, -1), batch)

    structure = _kept(unpacked, torch.zeros(1))
    assert structure == masks.Structure(causal=True), structure


def test_positions_given_as_input_are_not_proved():
    """Real position ids (two packed sequences per row) make a block-diagonal mask: it stays a tensor."""
    positions = torch.tensor([[0, 1, 2, 0, 1, 2]] * B)
    reason = _kept(_positions_mask, positions)
    assert isinstance(reason, str) and "not built from" in reason


def test_positions_gathered_at_negative_indices_are_not_proved():
    """``positions[b, q - 1]`` wraps around at q = 0: not the position q - 1 there, so nothing is proved."""

    def shifted(x):
        positions = torch.arange(T).unsqueeze(0).expand(B, -1)
        q, kv = torch.arange(T) - 1, torch.arange(T)
        rows = torch.arange(B)[:, None, None, None]
        return positions[rows, kv[None, None, None, :]] <= positions[rows, q[None, None, :, None]]

    reason = _kept(shifted, torch.zeros(1))
    assert isinstance(reason, str), reason


def test_packed_ids_from_a_wider_prepend_are_not_proved():
    """``diff`` with two prepended columns starts with a zero difference, so the ids are not all equal."""

    def wider(x):
        positions = torch.arange(T).unsqueeze(0).expand(B, -1)
        steps = torch.diff(positions, prepend=(positions[:, :1] - 1).expand(B, 2), dim=-1)
        ids = (steps != 1).cumsum(-1)
        rows = torch.arange(B)[:, None, None, None]
        q, kv = torch.arange(T)[None, None, :, None], torch.arange(T)[None, None, None, :]
        return ids[rows, q] == ids[rows, kv]

    reason = _kept(wider, torch.zeros(1))
    assert isinstance(reason, str), reason


@pytest.mark.parametrize("padded", [False, True], ids=["positions-only", "padded"])
def test_transformers_sliding_window_from_the_models_entry_point(padded):
    """``create_sliding_window_causal_mask``, which Mistral, Qwen2 and Gemma's sliding layers call: from position
    ids alone (transformers compares them for packed sequences) the window of 3 and causal are proved; with an
    attention_mask its per-key padding joins them."""
    import transformers

    config = transformers.MistralConfig(sliding_window=3, num_hidden_layers=1)
    config._attn_implementation = "sdpa"
    embeds = torch.zeros(B, T, 4)

    def build(embeds, pad):
        positions = torch.arange(T).unsqueeze(0)  # as the models make them without a cache
        return masking_utils.create_sliding_window_causal_mask(
            config, embeds, pad if padded else None, None, positions, allow_is_causal_skip=False
        )

    structure = _kept(build, embeds, _padding())
    assert isinstance(structure, masks.Structure), structure
    assert structure.causal and structure.window == 3 and len(structure.keys) == (1 if padded else 0)
