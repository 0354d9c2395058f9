"""Token parity with transformers on tiny random configs of every supported architecture.

All prompts go through one ``generate`` call with block size 16, at most 4
sequences at once, a chunk budget smaller than the longest prompt, and a pool
small enough that sequences get preempted (smaller still where every layer slides). Greedy tokens must equal
transformers' greedy ``generate`` in float32. Where they differ, the first
differing position must be a tie in the reference's logits: the two tokens'
logits within ``TIE_TOL`` of each other (float32 noise from a different
summation order is ~1e-6 at these logit scales); the rest of that sequence is
then not compared. Per-token logprobs must agree within ``LOGPROB_TOL``.
"""

from __future__ import annotations

import pytest
from helpers import TINY_CONFIGS, make_model_dir
from parity_helpers import assert_engine_matches


@pytest.mark.parametrize("arch", sorted(TINY_CONFIGS))
def test_greedy_parity_with_transformers(arch: str, tmp_path) -> None:
    assert_engine_matches(make_model_dir(arch, tmp_path), tmp_path)
