"""Passes: graph-to-graph rewrites (fusion, quantization, sparsity), imported as aviatorc.passes."""
