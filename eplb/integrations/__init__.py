"""Adapters that run eplb inside the serving engines its users already run.

- ``eplb.integrations.vllm``: a vLLM ``vllm.general_plugins`` entry point that makes eplb's solver
  vLLM's EPLB policy, when ``EPLB_VLLM_POLICY`` asks for it;
- ``eplb.integrations.sglang``: an SGLang ``sglang.srt.plugins`` entry point that routes
  ``--eplb-algorithm scipy`` (and ``eplb:NAME``) to eplb's solver, and with
  ``EPLB_SGLANG_FUSED_REMAP=1`` puts eplb's remap kernel behind SGLang's fused map+record
  (``eplb.integrations.sglang_remap``);
- ``eplb.integrations.trtllm``: TensorRT-LLM's offline ``load_balancer`` file, which ``eplb solve``
  writes.

Importing any of them imports no engine: the engines' own code is imported only when an engine
calls in. docs/integrations.md says how to turn each one on, check it and turn it off.
"""
