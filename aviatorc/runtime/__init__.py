"""The runtime: `Session(artifact, device="sim").run(feeds)` executes a compiled plan.

See `aviatorc.runtime.session` and docs/runtime.md. The backends live in `backends/`
(imported as `aviatorc.backends`).
"""

from aviatorc.runtime.errors import NotRunnableError, RankFailed, RuntimeFault, RuntimeInputError
from aviatorc.runtime.session import ExpertTally, RunStats, Session

__all__ = ["ExpertTally", "NotRunnableError", "RankFailed", "RunStats", "RuntimeFault", "RuntimeInputError", "Session"]
