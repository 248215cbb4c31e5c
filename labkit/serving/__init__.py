"""labkit's inference engine (chapter 12, "Serving"): continuous batching over a paged KV cache.

* :mod:`~labkit.serving.blocks`: the block manager (free list, reference counts, copy-on-write, prefix caching);
* :mod:`~labkit.serving.scheduler`: one iteration's plan under a token budget (a pure function);
* :mod:`~labkit.serving.runner`: one forward pass over a packed ragged batch, attention through block tables;
* :mod:`~labkit.serving.engine`: :class:`Engine` puts them together (``add_request``, ``step``, ``run``);
* :mod:`~labkit.serving.sampling`: how each request picks its next token (temperature, top-k, top-p, penalties);
* :mod:`~labkit.serving.speculative`: speculative decoding with a draft model, and the chapter's target/draft pair;
* :mod:`~labkit.serving.hf`: labkit's model as a Llama checkpoint for Hugging Face and vLLM (imported on its own:
  ``from labkit.serving import hf``; it needs ``transformers`` only to load the checkpoint back);
* :mod:`~labkit.serving.workload`: seeded request streams, a driver that feeds them by the clock, metrics
  (tokens/s, TTFT, TPOT) and KV-memory accounting; ``Engine(..., batching="static")`` is the baseline.
"""
from labkit.serving.blocks import BlockManager, PoolExhaustedError, blocks_for
from labkit.serving.engine import Engine, EngineStats, RequestOutput, StepTrace
from labkit.serving.sampling import SamplingParams, next_token_probs, sample_next
from labkit.serving.speculative import SpeculativeStats, speculative_accept, speculative_generate
from labkit.serving.scheduler import SeqState, StepPlan, plan_step

__all__ = ["BlockManager", "PoolExhaustedError", "blocks_for", "Engine", "EngineStats", "RequestOutput", "StepTrace",
           "SamplingParams", "next_token_probs", "sample_next", "SpeculativeStats", "speculative_accept",
           "speculative_generate", "SeqState", "StepPlan", "plan_step"]
