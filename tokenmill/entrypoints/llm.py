"""The offline API, as in vLLM: ``LLM(model=...).generate(prompts, params)``."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

from tqdm import tqdm

from tokenmill.engine.llm_engine import EngineConfig, LLMEngine
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizer import apply_chat_template

Prompt = str | list[int]


class LLM:
    """Generate offline for a batch of prompts: all are queued, then the engine steps
    until every one is done (continuous batching does the rest)."""

    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Outputs in the order of ``prompts``. A single prompt may be a string or a list of ids."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = sampling_params if sampling_params is not None else SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        elif len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                request_id = str(next(self._ids))
                self.engine.add_request(request_id, prompt, p, stream=False)
                ids.append(request_id)
        except ValueError:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        finals = {out.request_id: out for out in self._run(len(ids), use_tqdm)}
        return [finals[request_id] for request_id in ids]

    def _run(self, total: int, use_tqdm: bool) -> Iterator[RequestOutput]:
        with tqdm(total=total, desc="Generating", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        bar.update(1)
                        yield out

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | None = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [apply_chat_template(self.engine.tokenizer, conv) for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
