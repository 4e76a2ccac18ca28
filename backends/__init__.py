"""Runtime backends (sim, cuda), imported as aviatorc.backends. The runtime lands with a later issue."""
