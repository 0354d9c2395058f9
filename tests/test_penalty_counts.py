"""The penalties' token counts kept on the device: whatever sequences come, sample, pause and end,
each sampling row reads exactly the counts of its sequence's prompt and output tokens."""

from __future__ import annotations

import time

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill import SamplingParams
from tokenmill.engine.worker.penalty_counts import PenaltyCounts
from tokenmill.engine.sequence import Sequence, SequenceStatus

VOCAB = 12
PENALISED = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5)

events = st.lists(st.tuples(st.sampled_from(["join", "sample", "pause", "resume", "end"]),
                            st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6), st.booleans()),
                  min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(events)
def test_each_row_reads_its_sequences_counts(script: list[tuple[str, list[int], bool]]) -> None:
    counts = PenaltyCounts(VOCAB, torch.device("cpu"), max_seqs=4)
    seqs: list[Sequence] = []
    for kind, tokens, flag in script:
        running = [s for s in seqs if s.status is SequenceStatus.RUNNING]
        if kind == "join" or not seqs:
            seq = Sequence(len(seqs), str(len(seqs)), 0, tokens, PENALISED if flag else SamplingParams(), time.time())
            seq.status = SequenceStatus.RUNNING
            seqs.append(seq)
        elif kind == "sample" and running:
            batch = [s for i, s in enumerate(running) if flag or i % 2 == 0] or running[:1]
            read, add = counts.rows(batch)
            got_counts, got_prompt = counts.counts[read], counts.prompt[read]
            for row, seq in enumerate(batch):
                want_counts = torch.zeros(VOCAB)
                want_prompt = torch.zeros(VOCAB, dtype=torch.bool)
                if seq.params.uses_penalties:
                    want_counts.index_put_((torch.tensor(seq.output_token_ids, dtype=torch.int64),),
                                           torch.ones(len(seq.output_token_ids)), accumulate=True)
                    want_prompt[list(seq.prompt_token_ids)] = True
                assert torch.equal(got_counts[row], want_counts) and torch.equal(got_prompt[row], want_prompt)
            sampled = torch.tensor([tokens[i % len(tokens)] for i in range(len(batch))])
            counts.add(add, sampled)
            for seq, token in zip(batch, sampled.tolist()):
                seq.token_ids.append(token)
        elif kind == "pause" and running:
            running[tokens[0] % len(running)].status = SequenceStatus.WAITING
        elif kind == "resume":
            paused = [s for s in seqs if s.status is SequenceStatus.WAITING]
            if paused:
                paused[tokens[0] % len(paused)].status = SequenceStatus.RUNNING
        elif kind == "end" and running:
            running[tokens[0] % len(running)].status = SequenceStatus.FINISHED
    live = sum(s.status is SequenceStatus.RUNNING and s.params.uses_penalties for s in seqs)
    assert len(counts.counts) <= 2 * (live + len(seqs)) + 2  # rows are reused, not one per sequence ever
