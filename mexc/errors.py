"""The exceptions mexc raises.

Every error mexc raises on purpose derives from `MexcError`, so a caller can catch them all. The
subclasses say whose fault it is: the model (`UnsupportedOpError`, `TraceError`), the caller's data
(`InputError`, `CheckpointError`), or mexc itself (`VerificationError`, `PassError`: a pass broke
an invariant or crashed; both name the pass and point to a reproducer file).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mexc.ir import Node


class MexcError(Exception):
    """Base class of all errors mexc raises on purpose."""


class UnsupportedOpError(MexcError):
    """The model uses an operation (or an option of one) that mexc cannot compile."""


class TraceError(MexcError):
    """The model could not be traced into a static graph (data-dependent control flow, ...)."""


class ParseError(MexcError, ValueError):
    """Malformed mexc IR text; the message names the line."""

    def __init__(self, message: str, line: int = 0, text: str = "") -> None:
        self.line = line
        self.text = text
        where = f"line {line}: " if line else ""
        shown = f" (in: {text.strip()!r})" if text.strip() else ""
        super().__init__(f"mexc IR parse error at {where}{message}{shown}.")


class VerificationError(MexcError):
    """The IR broke an invariant. `stage` is the pass after which it was found ("" if none),
    `node` the offending node (None for graph-level rules), `rule` the verifier rule's name and
    `reproducer` the path of a file with the input IR of the failing pass (when one was written)."""

    def __init__(
        self,
        stage: str,
        node: Node | None,
        message: str,
        *,
        rule: str = "",
        reproducer: str | None = None,
    ) -> None:
        self.stage = stage
        self.node = node
        self.message = message
        self.rule = rule
        self.reproducer = reproducer
        super().__init__(self._render())

    def _render(self) -> str:
        where = f"after pass '{self.stage}'" if self.stage else "in the input graph"
        rule = f" [rule {self.rule}]" if self.rule else ""
        text = f"IR verification failed {where}{rule}: {self.message}"
        if self.node is not None:
            from mexc.printer import print_node

            try:
                shown = print_node(self.node)
            except Exception:  # a node too broken to print
                shown = repr(self.node)
            text += f" Offending node: {shown}"
        if self.reproducer:
            text += (
                f" The input IR of that pass was written to {self.reproducer}; "
                "rerun the pass on it with mexc.parser.parse_graph to reproduce."
            )
        return text

    def with_reproducer(self, stage: str, path: str) -> VerificationError:
        """A copy naming `stage` and pointing to a reproducer file."""
        return VerificationError(stage, self.node, self.message, rule=self.rule, reproducer=path)


class PassError(MexcError):
    """A pass crashed (raised something other than a user-facing mexc error). `pass_name` names
    it; `reproducer` is the path of a file holding the pass's input IR."""

    def __init__(self, pass_name: str, message: str, reproducer: str | None = None) -> None:
        self.pass_name = pass_name
        self.reproducer = reproducer
        self.message = message
        text = f"Pass '{pass_name}' failed: {message}"
        if reproducer:
            text += (
                f" Its input IR was written to {reproducer}; load it with "
                "mexc.parser.parse_graph and run the pass on it to reproduce."
            )
        super().__init__(text)


class CheckpointError(MexcError):
    """A checkpoint could not be loaded: missing file, wrong format or a different program."""


class InputError(MexcError, ValueError):
    """Bad data given to a training or evaluation step: wrong shape or dtype, labels out of
    range, NaN or infinite values."""


class TornStateError(MexcError, RuntimeError):
    """A training step stopped after some of its kernels ran: the state is partly updated."""


class DistributedError(MexcError, RuntimeError):
    """A data-parallel step cannot go on: no process group, a worker that stopped answering
    (its collective timed out), workers that disagree on the program."""
