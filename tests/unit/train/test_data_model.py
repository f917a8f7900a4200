"""Unit tests for the deterministic character stream and the small model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from relay_train.examples.data import VOCAB_SIZE, CharStream, load_corpus, mix_seed
from relay_train.examples.transformer import ModelConfig, build_model

CORPUS = "builtin:python_docs"
SMALL = ModelConfig(context=16, d_model=16, n_layers=1, n_heads=2, dropout=0.0)


@pytest.fixture(scope="module")
def corpus() -> torch.Tensor:
    return load_corpus(CORPUS)


@pytest.fixture
def stream(corpus: torch.Tensor) -> CharStream:
    return CharStream(corpus, context=32, batch_size=8, seed=1234)


def test_builtin_corpus_is_non_trivial(corpus: torch.Tensor) -> None:
    assert corpus.dtype == torch.uint8
    assert corpus.dim() == 1
    assert corpus.numel() > 10_000
    assert int(corpus.max()) < VOCAB_SIZE
    assert len(torch.unique(corpus)) > 40  # real text, not one repeated byte
    text = bytes(corpus.tolist()).decode("ascii")
    assert text.count(" ") > 1000


def test_load_corpus_from_file_maps_non_ascii_into_the_vocabulary(tmp_path: Path) -> None:
    source = tmp_path / "corpus.txt"
    source.write_text("naïve café — ok\n" * 10, encoding="utf-8")

    codes = load_corpus(str(source))

    assert int(codes.max()) < VOCAB_SIZE
    assert bytes(codes.tolist()).decode("ascii").startswith("na?ve caf? ? ok\n")


def test_batch_is_a_pure_function_of_seed_step_rank(
    stream: CharStream, corpus: torch.Tensor
) -> None:
    inputs, targets = stream.batch(step=7, rank=1)
    again = CharStream(corpus, context=32, batch_size=8, seed=1234).batch(step=7, rank=1)
    # Draws from the global RNG in between must not matter.
    torch.rand(100)

    assert torch.equal(inputs, again[0])
    assert torch.equal(targets, again[1])
    assert torch.equal(inputs, stream.batch(step=7, rank=1)[0])


@pytest.mark.parametrize(
    ("step", "rank", "seed"),
    [(8, 1, 1234), (7, 0, 1234), (7, 2, 1234), (7, 1, 1235), (1, 7, 1234)],
    ids=["step", "rank0", "rank2", "seed", "swapped"],
)
def test_batch_differs_when_any_input_differs(
    corpus: torch.Tensor, step: int, rank: int, seed: int
) -> None:
    base = CharStream(corpus, context=32, batch_size=8, seed=1234).batch(step=7, rank=1)[0]
    other = CharStream(corpus, context=32, batch_size=8, seed=seed).batch(step=step, rank=rank)[0]

    assert not torch.equal(base, other)


def test_batch_differs_for_pairs_whose_seeds_share_their_low_32_bits(
    corpus: torch.Tensor,
) -> None:
    salt = 0xDA7A  # the stream's own salt, see CharStream.batch
    a, b = mix_seed(1234, salt, 293, 3), mix_seed(1234, salt, 30111, 1)
    assert a != b and a & 0xFFFFFFFF == b & 0xFFFFFFFF  # the precondition of this test

    stream = CharStream(corpus, context=64, batch_size=16, seed=1234)
    assert not torch.equal(stream.batch(293, 3)[0], stream.batch(30111, 1)[0])


def test_batch_shapes_and_types(stream: CharStream) -> None:
    inputs, targets = stream.batch(step=0, rank=0)

    assert inputs.shape == targets.shape == (8, 32)
    assert inputs.dtype == targets.dtype == torch.int64


def test_targets_are_inputs_shifted_by_one(stream: CharStream) -> None:
    inputs, targets = stream.batch(step=3, rank=0)

    assert torch.equal(inputs[:, 1:], targets[:, :-1])


def test_windows_are_contiguous_slices_of_the_corpus(
    stream: CharStream, corpus: torch.Tensor
) -> None:
    text = bytes(corpus.tolist())
    inputs, targets = stream.batch(step=11, rank=2)
    for row_in, row_t in zip(inputs, targets, strict=True):
        window = bytes(row_in.tolist()) + bytes(row_t[-1:].tolist())
        assert window in text


def test_values_are_in_the_vocabulary(stream: CharStream) -> None:
    for step in range(20):
        inputs, targets = stream.batch(step=step, rank=step % 3)
        for tensor in (inputs, targets):
            assert int(tensor.min()) >= 0
            assert int(tensor.max()) < VOCAB_SIZE


def test_build_model_same_seed_same_weights() -> None:
    a, b = build_model(SMALL, seed=5), build_model(SMALL, seed=5)
    sa, sb = a.state_dict(), b.state_dict()

    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


def test_build_model_different_seed_different_weights() -> None:
    a, b = build_model(SMALL, seed=5), build_model(SMALL, seed=6)

    assert not torch.equal(a.tok.weight, b.tok.weight)
    assert not torch.equal(a.head.weight, b.head.weight)


def test_build_model_leaves_the_global_rng_alone() -> None:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        expected = torch.rand(3)
        torch.manual_seed(0)
        build_model(SMALL, seed=99)
        assert torch.equal(torch.rand(3), expected)


def test_model_maps_tokens_to_logits(stream: CharStream) -> None:
    model = build_model(SMALL, seed=1).eval()
    inputs, _ = CharStream(stream.corpus, SMALL.context, 2, seed=3).batch(0, 0)

    logits = model(inputs)

    assert logits.shape == (2, SMALL.context, SMALL.vocab_size)
    assert torch.isfinite(logits).all()


def test_model_is_causal() -> None:
    model = build_model(SMALL, seed=1).eval()
    idx = torch.randint(0, SMALL.vocab_size, (1, SMALL.context), generator=torch.Generator())
    changed = idx.clone()
    changed[0, -1] = (changed[0, -1] + 1) % SMALL.vocab_size

    with torch.no_grad():
        before, after = model(idx), model(changed)

    assert torch.allclose(before[0, :-1], after[0, :-1])
    assert not torch.allclose(before[0, -1], after[0, -1])


def test_mix_seed_is_deterministic_and_order_sensitive() -> None:
    assert mix_seed(1, 2, 3) == mix_seed(1, 2, 3)
    assert mix_seed(1, 2, 3) != mix_seed(3, 2, 1)
    assert mix_seed(0) != mix_seed(0, 0)
    assert mix_seed(-1) == mix_seed(0xFFFFFFFFFFFFFFFF)  # negative ints wrap to 64 bits


def test_mix_seed_spreads_over_63_bits() -> None:
    seeds = [mix_seed(1234, step, rank) for step in range(1000) for rank in range(8)]

    assert len(set(seeds)) == len(seeds)
    assert all(0 <= s < 2**63 for s in seeds)
    # Neighbouring inputs land far apart: high and low bits both vary.
    assert len({s >> 48 for s in seeds}) > 4000
    assert len({s & 0xFFFF for s in seeds}) > 4000
