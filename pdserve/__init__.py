"""pdserve: prefill/decode disaggregated LLM serving. See docs/architecture.md."""

__version__ = "0.1.0"
