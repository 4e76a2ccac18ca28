"""Runtime backends, imported as aviatorc.backends: `sim` (a plan's instruction streams on the CPU,
`aviatorc.backends.sim`), `cuda` (the same streams on a GPU, `aviatorc.backends.cuda`), and the
multi-card ranks (`aviatorc.backends.distributed`, driven by `aviatorc.backends.cluster`).

The runtime reaches them only through `aviatorc.backends.contract`.
"""
