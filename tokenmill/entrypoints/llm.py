"""The offline API, as in vLLM: ``LLM(model=...).generate(prompts, params)``."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

from tqdm import tqdm

from tokenmill.engine.config import EngineConfig
from tokenmill.engine.frontend.llm_engine import LLMEngine
from tokenmill.outputs import ERROR_INVALID, EngineStats, RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizer import ChatOptions, apply_chat_template

Prompt = str | list[int]


class EngineError(RuntimeError):
    """The engine could not finish a request (a step failed). The engine itself is fine:
    the next ``generate`` works."""


class LLM:
    """Generate offline for a batch of prompts: all are queued, then the engine steps
    until every one is done (continuous batching does the rest). The engine core runs in
    this process."""

    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        self.engine = LLMEngine(EngineConfig.from_options(model, **engine_options))
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_stats(self) -> EngineStats:
        """The engine's gauges (KV cache use, running and waiting requests) as of its last step and
        its counters since it started (tokens, steps, CUDA-graph steps, preemptions, prefix-cache and
        speculative-decoding counts): the figures the server's ``/metrics`` shows."""
        return self.engine.get_stats()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in the order of ``prompts``. A single prompt may be a string or a list of
        ids. ``priority`` gives one per prompt (lower first; needs scheduling_policy "priority").
        Bad input raises ValueError before anything runs; the engine is left as it was."""
        prompts = _prompt_list(prompts)
        params = sampling_params if sampling_params is not None else SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        else:
            params = _one_per_prompt("sampling_params", params, len(prompts), "a SamplingParams or a list of them")
        priorities = (
            [0] * len(prompts)
            if priority is None
            else _one_per_prompt("priority", priority, len(prompts), "None or a list of integers")
        )
        ids = []
        try:
            for prompt, p, rank in zip(prompts, params, priorities):
                request_id = str(next(self._ids))
                self.engine.add_request(request_id, prompt, p, stream=False, priority=rank)
                ids.append(request_id)
            finals = {out.request_id: out for out in self._run(len(ids), use_tqdm)}
        except BaseException:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        return [finals[request_id] for request_id in ids]

    def _run(self, total: int, use_tqdm: bool) -> Iterator[RequestOutput]:
        with tqdm(total=total, desc="Generating", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.error is not None:
                        if out.error_kind == ERROR_INVALID:  # the request's own fault, found only in the engine
                            raise ValueError(f"request {out.request_id}: {out.error}")
                        raise EngineError(f"request {out.request_id}: {out.error}")
                    if out.finished:
                        bar.update(1)
                        yield out

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
        *,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, and generate.
        ``tools`` (OpenAI's function tools) go to the template, which tells the model how to call
        them; the output is the model's raw text, as in vLLM: reading calls out of it is the
        server's job."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of messages, or a list of conversations")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        options = ChatOptions(tools=tools)
        prompts = [apply_chat_template(self.engine.tokenizer, conv, options) for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)


def _prompt_list(prompts: Any) -> list[Prompt]:
    """One prompt (a string or a list of ids) or a sequence of them, as a list."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, list | tuple) and prompts and all(type(t) is int for t in prompts):
        return [list(prompts)]
    if not isinstance(prompts, list | tuple):
        raise ValueError(
            f"prompts must be a string, a list of token ids, or a list of those, not {type(prompts).__name__}"
        )
    if not prompts:
        raise ValueError("no prompts were given")
    return list(prompts)


def _one_per_prompt(name: str, values: Any, num_prompts: int, kind: str) -> list[Any]:
    """``values`` as a list of one item per prompt, or a ValueError naming ``name``."""
    if not isinstance(values, Sequence) or isinstance(values, str):
        raise ValueError(f"{name} must be {kind}, not {type(values).__name__}")
    if len(values) != num_prompts:
        raise ValueError(f"got {len(values)} {name} for {num_prompts} prompts")
    return list(values)
