"""vocab_padding: a language model's vocabulary padded to a multiple of 64 computes what the unpadded
model computes (logits, loss, gradients of the real rows), keeps its tied head tied, trains, compiles,
and its checkpoints keep the original shapes both ways."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import fake_models
import strategies
from autotune.recipe import Recipe
from autotune.deploy.runtime import prepare_model
from autotune.space import SearchSpace
from strategies.channel_alignment import align_channels
from strategies.vocab_padding import PaddedEmbedding, PaddedHead, VocabPadding, pad_vocab, vocab_size

VOCAB = 1003
PADDED = 1024


def lm(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return fake_models.TinyLM(VOCAB)


def batch(size: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (size, 17), generator=g)
    tokens[0, :2] = VOCAB - 1  # the last real row is used
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(x)
    return logits, nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def test_padded_model_gives_the_same_logits_loss_and_gradients():
    plain, padded = lm(), pad_vocab(lm(), 64)
    x, y = batch()
    logits, loss = loss_of(plain, x, y)
    logits_p, loss_p = loss_of(padded, x, y)
    assert logits_p.shape == logits.shape == (3, 16, VOCAB)  # the user's code sees the real width
    torch.testing.assert_close(logits_p, logits, rtol=0, atol=1e-6)
    torch.testing.assert_close(loss_p, loss, rtol=0, atol=1e-6)
    loss.backward()
    loss_p.backward()
    grad, grad_p = plain.embed.weight.grad, padded.embed.weight.grad
    assert grad_p.shape == (PADDED, 32)
    torch.testing.assert_close(grad_p[:VOCAB], grad, rtol=0, atol=1e-6)
    assert torch.count_nonzero(grad_p[VOCAB:]) == 0  # the padded rows never learn anything
    for (name, p), p_padded in zip(plain.named_parameters(), padded.parameters()):
        if p.shape == p_padded.shape:
            torch.testing.assert_close(p_padded.grad, p.grad, rtol=0, atol=1e-6, msg=name)


def test_padding_is_in_place_keeps_tying_and_widths_are_multiples_of_64():
    model = lm()
    weight = model.embed.weight
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)  # built before, as users do
    assert pad_vocab(model, 64) is model
    assert model.embed.weight is weight and model.head.weight is model.embed.weight  # same Parameter, still tied
    assert type(model.embed) is PaddedEmbedding and type(model.head) is PaddedHead
    assert model.embed.weight.shape == (PADDED, 32) and PADDED % 64 == 0
    assert model.embed.num_embeddings == model.head.out_features == PADDED
    assert torch.count_nonzero(model.embed.weight[VOCAB:]) == 0
    assert model.pos.weight.shape == (16, 32)  # a small embedding (positions) is no vocabulary
    x, y = batch()
    for _ in range(3):  # the optimizer steps the padded parameter; padded rows stay zero under AdamW
        optimizer.zero_grad()
        loss_of(model, x, y)[1].backward()
        optimizer.step()
    assert torch.count_nonzero(model.embed.weight[VOCAB:]) == 0
    assert pad_vocab(model, 64) is model and model.embed.weight.shape == (PADDED, 32)  # not padded twice


def test_untied_head_with_bias_is_padded_too():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(1500, 8), nn.Linear(8, 1500))
    reference = copy.deepcopy(model)
    pad_vocab(model, 64)
    assert model[0].weight.shape == (1536, 8) and model[1].weight.shape == (1536, 8) and model[1].bias.shape == (1536,)
    tokens = torch.randint(0, 1500, (2, 5))
    torch.testing.assert_close(model(tokens), reference(tokens), rtol=0, atol=1e-6)
    assert set(model.state_dict()) == set(reference.state_dict())
    for key, value in model.state_dict().items():
        assert value.shape == reference.state_dict()[key].shape, key


def test_state_dict_has_the_original_shapes_and_loads_both_ways():
    plain, padded = lm(seed=0), pad_vocab(lm(seed=1), 64)
    x, _ = batch()
    # a padded model's checkpoint: original shapes, loads into an unpadded model (strict)
    saved = padded.state_dict()
    assert saved["embed.weight"].shape == saved["head.weight"].shape == (VOCAB, 32)
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    fresh = lm(seed=2)
    fresh.load_state_dict(torch.load(buffer))
    torch.testing.assert_close(fresh(x), padded(x), rtol=0, atol=1e-6)
    # an unpadded checkpoint loads into a padded model, whose padded rows stay zero and tying holds
    checkpoint = plain.state_dict()
    before = {k: v.clone() for k, v in checkpoint.items()}
    padded.load_state_dict(checkpoint)
    assert all(torch.equal(checkpoint[k], before[k]) and checkpoint[k].shape == before[k].shape for k in before)
    assert padded.head.weight is padded.embed.weight and padded.embed.weight.shape == (PADDED, 32)
    assert torch.count_nonzero(padded.embed.weight[VOCAB:]) == 0
    torch.testing.assert_close(padded(x), plain(x), rtol=0, atol=1e-6)
    # a wrong checkpoint is still refused
    wrong = dict(checkpoint, **{"embed.weight": torch.zeros(VOCAB + 1, 32)})
    with pytest.raises(RuntimeError, match="size mismatch"):
        padded.load_state_dict(wrong)


def test_channel_padding_after_vocab_padding_leaves_the_head_alone():
    """The registry pads the vocabulary first: channel padding then sees no plain nn.Linear head."""
    names = [s.name for s in strategies.REGISTRY]
    assert names.index("vocab_padding") < names.index("channel_alignment")
    model = align_channels(pad_vocab(lm(), 64), 16)
    assert type(model.head) is PaddedHead and model.head.weight is model.embed.weight
    x, y = batch()
    torch.testing.assert_close(model(x), lm()(x), rtol=0, atol=1e-5)


@pytest.mark.slow
def test_compiled_padded_model_matches_eager():
    torch._dynamo.reset()
    model = pad_vocab(lm(), 64)
    x, _ = batch()
    expected = model(x)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), expected, rtol=0, atol=1e-6)


def test_strategy_offers_samples_and_applies():
    strategy = VocabPadding()
    off = SearchSpace(device="cpu")
    assert strategy.offer(None, "cpu", {"vocab_size": 1024}, {}) == {}  # already a multiple
    assert strategy.offer(None, "cpu", {"vocab_size": None}, {}) == {}
    assert strategy.offer(None, "cpu", {}, {}) == {}
    offered = strategy.offer(None, "cuda", {"vocab_size": 50257}, {})
    assert offered == {"choices": {"vocab_padding": [1, 64]}}
    space = SearchSpace(device="cuda", **offered)
    assert strategy.applies(space) and not strategy.applies(off)
    assert strategy.seed(space, tuned=False, chosen={}) == {"vocab_padding.multiple": 1}
    assert strategy.seed(space, tuned=True, chosen={}) == {"vocab_padding.multiple": 64}
    assert strategy.words({"multiple": 64}) == "vocab x64" and strategy.words({}) == ""
    recipe = Recipe(device="cpu")
    strategy.apply(strategy.Config(multiple=64), recipe)
    model = prepare_model(lm(), recipe, set_flags=False)
    assert model.embed.weight.shape == (PADDED, 32)
    recipe = Recipe(device="cpu")
    strategy.apply(strategy.Config(), recipe)
    assert recipe.model_transforms == []


def test_probe_figure_is_the_vocabulary():
    assert vocab_size(lm()) == VOCAB
    assert vocab_size(fake_models.tiny_cnn()) is None
    assert vocab_size(nn.Embedding(999, 4)) is None  # smaller than a vocabulary


def test_a_resumed_optimizer_state_is_padded_with_its_parameters():
    """A run resumed from an unpadded checkpoint: model and AdamW state loaded before cfg.prepare."""
    from autotune.deploy.runtime import prepare_optimizer

    x, y = batch()
    trained = lm()
    optimizer = torch.optim.AdamW(trained.parameters(), lr=1e-2)
    loss_of(trained, x, y)[1].backward()
    optimizer.step()
    model = lm(seed=3)
    model.load_state_dict(trained.state_dict())
    resumed = torch.optim.AdamW(model.parameters(), lr=1e-2)
    resumed.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # as from a file: no tensor shared
    recipe = Recipe(device="cpu")
    VocabPadding().apply(VocabPadding.Config(multiple=64), recipe)
    model = prepare_model(model, recipe, set_flags=False)
    resumed = prepare_optimizer(resumed, recipe)
    moments = resumed.state[model.embed.weight]["exp_avg"]
    assert moments.shape == (PADDED, 32) and torch.count_nonzero(moments[VOCAB:]) == 0
    torch.testing.assert_close(moments[:VOCAB], optimizer.state[trained.embed.weight]["exp_avg"])
    assert resumed.state[model.qkv.weight]["exp_avg"].shape == model.qkv.weight.shape  # others as they were
    for step_model, step_optimizer in ((trained, optimizer), (model, resumed)):  # the next step agrees
        step_optimizer.zero_grad()
        loss_of(step_model, x, y)[1].backward()
        step_optimizer.step()
    torch.testing.assert_close(model.embed.weight[:VOCAB], trained.embed.weight, rtol=0, atol=1e-6)
    assert torch.count_nonzero(model.embed.weight[VOCAB:]) == 0
