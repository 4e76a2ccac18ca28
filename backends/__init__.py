"""Runtime backends, imported as aviatorc.backends: `sim` (a plan's instruction streams on the CPU,
`aviatorc.backends.sim`) and `cuda` (the same streams on a GPU, `aviatorc.backends.cuda`).

`backend_class(device)` names a device's backend; each module is imported only when its device
is asked for (the cuda backend imports torch)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aviatorc.errors import OptionError

if TYPE_CHECKING:
    from aviatorc.backends.sim import SimBackend


def backend_class(device: str) -> type[SimBackend]:
    """The backend that runs a plan's programs on `device` ("sim" or "cuda")."""
    if device == "sim":
        from aviatorc.backends.sim import SimBackend

        return SimBackend
    if device == "cuda":
        from aviatorc.backends.cuda import CudaBackend

        return CudaBackend
    raise OptionError(f"unknown device '{device}'", hint="choose sim or cuda")
