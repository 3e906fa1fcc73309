"""Engine adapters: :class:`~bulletin.target.WeightTarget` implementations for engines.

- :mod:`bulletin.engines.torch_module`: in-process PyTorch modules, patched in place.
- :mod:`bulletin.engines.hf_server`: a small OpenAI-compatible server for such a module.
- :mod:`bulletin.engines.sglang`: SGLang, reloaded from a local folder over HTTP.
- :mod:`bulletin.engines.vllm`: vLLM, patched in place by a worker extension.

Each module imports its engine (torch, vLLM) only when used, so this package imports
without them. See docs/ENGINES.md.
"""
