"""The sampler keeps exactly the right tokens and draws from the right distribution."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from tokenmill.kernels.reference import apply_penalties, kth_largest, sampling_candidates
from tokenmill.layers import ops
from tokenmill.layers.sampler import Sampler, SamplingBatch, inverse_temperature, largest_logits


def batch_of(rows: int, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, generators=None,
             num_logprobs=-1) -> SamplingBatch:
    full = lambda v, dt=torch.float32: torch.full((rows,), v, dtype=dt)  # noqa: E731
    return SamplingBatch(
        temperature=full(temperature), inv_temperature=full(inverse_temperature(temperature)),
        top_k=full(top_k, torch.int64), top_p=full(top_p), min_p=full(min_p),
        repetition_penalty=full(1.0), presence_penalty=full(0.0), frequency_penalty=full(0.0),
        generators=generators or [None] * rows, num_logprobs=num_logprobs, all_greedy=temperature == 0,
        max_top_k=top_k)


# probabilities 0.4, 0.3, 0.15, 0.1, 0.05 (in a shuffled order)
PROBS = torch.tensor([0.1, 0.4, 0.05, 0.3, 0.15])
LOGITS = PROBS.log()[None, :]


def candidates(logits: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float] | None = None,
               max_top_k: int | None = None) -> torch.Tensor:
    """The sampler's candidates at temperature 1, the top-k threshold taken as the sampler takes it."""
    rows, vocab = logits.shape
    k = torch.tensor(top_k).clamp(max=vocab)
    if max_top_k is None:
        max_top_k = max((x for x in top_k if 0 < x < vocab), default=0)
    return sampling_candidates(logits, torch.ones(rows, dtype=logits.dtype), kth_largest(k, largest_logits(logits, max_top_k)),
                               torch.tensor(top_p, dtype=logits.dtype),
                               torch.tensor(min_p or [0.0] * rows, dtype=logits.dtype))


def kept(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
         max_top_k: int | None = None) -> set[int]:
    return set(torch.nonzero(candidates(logits, [top_k], [top_p], [min_p], max_top_k)[0]).flatten().tolist())


@pytest.mark.parametrize("k, expected", [(1, {1}), (2, {1, 3}), (4, {0, 1, 3, 4}), (0, {0, 1, 2, 3, 4}),
                                         (9, {0, 1, 2, 3, 4})])
def test_top_k_keeps_the_k_most_likely(k: int, expected: set[int]) -> None:
    assert kept(LOGITS, top_k=k) == expected


@pytest.mark.parametrize("p, expected", [(0.4, {1}), (0.41, {1, 3}), (0.7, {1, 3}), (0.71, {1, 3, 4}),
                                         (0.95, {0, 1, 3, 4}), (1.0, {0, 1, 2, 3, 4})])
def test_top_p_keeps_the_smallest_set_reaching_p(p: float, expected: set[int]) -> None:
    assert kept(LOGITS, top_p=p) == expected


def test_top_k_then_top_p_renormalises_over_the_top_k() -> None:
    # top-2 leaves 0.4/0.7 and 0.3/0.7; p = 0.5 then keeps only the first
    assert kept(LOGITS, top_k=2, top_p=0.5) == {1}


def test_ties_at_the_edge_are_kept_whole() -> None:
    logits = torch.tensor([[0.4, 0.2, 0.2, 0.2, 0.1]]).log()
    assert kept(logits, top_k=2) == {0, 1, 2, 3}
    assert kept(logits, top_p=0.5) == {0, 1, 2, 3}
    assert kept(logits, top_p=0.3) == {0}
    # Ordering only the 2 largest values: the ties past them still count in the top-k's mass.
    ties = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0]])
    for max_top_k in (2, 5):
        assert kept(ties, top_k=2, top_p=0.8, max_top_k=max_top_k) == {0, 1, 2, 3}
        assert kept(ties, top_k=2, top_p=0.4, max_top_k=max_top_k) == {0}


def test_max_top_k_is_the_largest_cut_of_a_sampled_row() -> None:
    from tokenmill import SamplingParams
    from tokenmill.engine.worker.model_runner import max_top_k
    from tokenmill.engine.worker.sequence_rows import clamped_top_k

    def cut(vocab: int, *kinds: dict) -> int:
        """max_top_k over the sampling columns of rows of these parameters, as a step builds them."""
        params = [SamplingParams(**kind) for kind in kinds]
        return max_top_k(np.array([p.temperature for p in params], np.float32),
                         np.array([clamped_top_k(p, vocab) for p in params], np.int64), vocab)

    assert cut(1000, {"top_k": 20, "top_p": 0.8}, {"top_k": 50}, {"temperature": 0.0, "top_k": 500}) == 50
    assert cut(1000, {"top_k": 20}, {"top_p": 0.9}) == 20
    assert cut(1000, {"temperature": 1.0}, {"top_k": -1}) == 0  # nothing cuts
    assert cut(10**6, {"top_k": 5000}) == 5000
    assert cut(800, {"top_k": 900}, {"top_k": 800}) == 0  # the whole vocabulary


def test_top_k_top_p_keeps_what_the_definition_keeps() -> None:
    """Against the rule token by token (float64, random rows with ties): a token stays when fewer
    than k tokens are more likely and they hold less than p of the top-k's renormalised mass."""
    gen = torch.Generator().manual_seed(11)
    logits = (torch.randn(40, 60, generator=gen, dtype=torch.float64) * 3).round()  # many ties
    logits[::4] *= 25  # extreme temperatures
    top_k = torch.randint(0, 70, (40,), generator=gen)
    top_p = torch.rand(40, generator=gen, dtype=torch.float64).clamp_min(1e-3)
    top_p[::3] = 1.0
    out = candidates(logits, top_k.tolist(), top_p.tolist())
    for row in range(40):
        z = logits[row]
        larger = (z[None, :] > z[:, None]).sum(dim=1)
        in_top_k = larger < (top_k[row] if top_k[row] > 0 else len(z))
        probs = torch.where(in_top_k, z, float("-inf")).softmax(dim=0)
        mass_larger = ((z[None, :] > z[:, None]) * probs[None, :]).sum(dim=1)
        expected = in_top_k & ((mass_larger < top_p[row]) | (top_p[row] >= 1))  # top-p 1 is off
        assert torch.equal(out[row], expected), row


@pytest.mark.parametrize("min_p, expected", [(0.2, {0, 1, 3, 4}), (0.3, {1, 3, 4}), (0.8, {1}), (0.0, {0, 1, 2, 3, 4})])
def test_min_p_drops_tokens_below_a_fraction_of_the_best(min_p: float, expected: set[int]) -> None:
    assert kept(LOGITS, min_p=min_p) == expected


def test_per_row_parameters_apply_to_their_own_row() -> None:
    out = candidates(LOGITS.repeat(3, 1), [1, 0, 0], [1.0, 1.0, 0.5], [0.0, 0.3, 0.0])
    assert [set(torch.nonzero(row).flatten().tolist()) for row in out] == [{1}, {1, 3, 4}, {1, 3}]


def test_greedy_takes_the_argmax_and_reports_logprobs() -> None:
    out = Sampler()(LOGITS.repeat(3, 1), batch_of(3, temperature=0.0, num_logprobs=2))
    assert out.token_ids.tolist() == [1, 1, 1]
    assert out.logprob_token_ids[0].tolist() == [1, 1, 3]
    assert torch.allclose(out.logprobs[0], torch.tensor([0.4, 0.4, 0.3]).log())


def test_finish_applies_only_where_logit_values_are_read() -> None:
    """A model's final map of the head's logits (Gemma's softcap) is increasing: greedy rows answered by
    a graph's argmax skip it; logprobs and sampled rows see the finished logits."""
    head = torch.tensor([[0.0, 60.0, 45.0, -30.0]])
    calls = []

    def softcap_(logits: torch.Tensor) -> torch.Tensor:
        calls.append(logits.shape[0])
        return logits.div_(30.0).tanh_().mul_(30.0)

    ids = ops.argmax_rows(head)
    out = Sampler()(head.clone(), batch_of(1, temperature=0.0), ids, softcap_)
    assert out.token_ids.tolist() == [1] and calls == []
    out = Sampler()(head.clone(), batch_of(1, temperature=0.0, num_logprobs=1), ids, softcap_)
    capped = torch.tanh(head / 30.0) * 30.0
    assert calls == [1] and out.token_ids.tolist() == [1]
    assert torch.allclose(out.logprobs[0], capped.log_softmax(-1)[0, [1, 1]])
    out = Sampler()(head.clone(), batch_of(1, temperature=1.0, generators=[torch.Generator().manual_seed(0)]),
                    ids, softcap_)
    assert calls == [1, 1]


def test_seeded_rows_reproduce_whatever_shares_the_batch() -> None:
    def draw(rows: int, row: int) -> list[int]:
        gens = [None] * rows
        gens[row] = torch.Generator().manual_seed(5)
        logits = torch.randn(rows, 50)
        logits[row] = torch.linspace(0, 3, 50)
        sampler, batch = Sampler(), batch_of(rows, generators=gens)
        return [sampler(logits, batch).token_ids[row].item() for _ in range(20)]

    alone = draw(1, 0)
    assert draw(6, 4) == alone
    assert draw(3, 2) == alone


def test_sampled_frequencies_match_the_distribution() -> None:
    torch.manual_seed(0)
    rows = 20000
    out = Sampler()(LOGITS.repeat(rows, 1), batch_of(rows))
    counts = torch.bincount(out.token_ids, minlength=5).double()
    expected = PROBS.double() / PROBS.double().sum() * rows
    result = chisquare(counts.numpy(), expected.numpy())
    assert result.pvalue > 1e-3, (counts, result)


def test_temperature_sharpens_the_distribution() -> None:
    torch.manual_seed(0)
    rows = 20000
    out = Sampler()(LOGITS.repeat(rows, 1), batch_of(rows, temperature=0.5))
    squared = PROBS.double() ** 2
    expected = squared / squared.sum()
    counts = torch.bincount(out.token_ids, minlength=5).double()
    assert chisquare(counts.numpy(), (expected * rows).numpy()).pvalue > 1e-3


@pytest.mark.parametrize("top_k, top_p, min_p", [(3, 1.0, 0.0), (0, 0.8, 0.0), (4, 0.9, 0.0), (0, 1.0, 0.3)])
def test_filtered_frequencies_match_the_renormalised_distribution(top_k: int, top_p: float, min_p: float) -> None:
    torch.manual_seed(0)
    rows = 20000
    out = Sampler()(LOGITS.repeat(rows, 1), batch_of(rows, top_k=top_k, top_p=top_p, min_p=min_p))
    keep = candidates(LOGITS, [top_k], [top_p], [min_p])[0]
    expected = torch.where(keep, PROBS, 0.0).double()
    counts = torch.bincount(out.token_ids, minlength=5).double()
    assert counts[~keep].sum() == 0
    result = chisquare(counts[keep].numpy(), (expected[keep] / expected.sum() * rows).numpy())
    assert result.pvalue > 1e-3, (counts, result)


def test_top_p_sampling_never_leaves_the_nucleus() -> None:
    torch.manual_seed(0)
    out = Sampler()(LOGITS.repeat(5000, 1), batch_of(5000, top_p=0.7))
    assert set(out.token_ids.tolist()) == {1, 3}


def test_penalties() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 1.0]])
    # Row 1 of the tables is this row's; row 0 (another sequence's) must not be read.
    prompt = torch.tensor([[False, True, True, True], [True, False, False, False]])
    counts = torch.tensor([[5.0, 0.0, 1.0, 1.0], [0.0, 2.0, 0.0, 0.0]])
    out = apply_penalties(logits, counts, prompt, torch.tensor([1]), torch.tensor([2.0]), torch.tensor([0.5]),
                          torch.tensor([0.25]))
    # token 0: in the prompt, positive -> halved; token 1: output twice, negative -> doubled,
    # minus 0.25 * 2 and 0.5; tokens 2, 3 untouched
    assert torch.allclose(out, torch.tensor([[1.0, -4.0 - 0.5 - 0.5, 1.0, 1.0]]))
    assert math.isclose(out[0, 1].item(), -5.0)



@settings(max_examples=300, deadline=None)
@given(st.floats(min_value=0.0, max_value=1e6, allow_nan=False) | st.floats(min_value=0.0, max_value=1e-5))
def test_inverse_temperature_is_float32s_quotient(temperature: float) -> None:
    """The host's inverse temperature (float64 division rounded to float32) is float32's own division
    of the float32 temperature, the floor at 1e-6 and greedy's 0 included."""
    t = np.float32(temperature)
    want = np.float32(1) / np.maximum(t, np.float32(1e-6)) if t > 0 else np.float32(0)
    assert inverse_temperature(temperature) == float(want)
